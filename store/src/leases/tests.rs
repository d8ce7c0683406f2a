use super::*;
use crate::pool::{DramPool, PoolConfig};
use mooncake_proto::checksum::checksum;
use mooncake_proto::message::ShmRooms;
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use tokio::io::DuplexStream;

fn key(n: u8) -> BlockKey {
    BlockKey::new(Namespace::new("t").unwrap(), BlockHash([n; 32]))
}

/// A client's end of the connection: one request, its answer.
struct Conn(DuplexStream, u64);

impl Conn {
    async fn call(&mut self, op: Opcode, body: &[u8]) -> (ErrorCode, Vec<u8>) {
        self.1 += 1;
        let h = Header::request(op, self.1, body.len() as u32);
        self.0.write_all(&h.encode()).await.unwrap();
        self.0.write_all(body).await.unwrap();
        let mut raw = [0u8; HEADER_LEN];
        self.0.read_exact(&mut raw).await.unwrap();
        let h = Header::parse(&raw).unwrap().unwrap();
        assert!(h.response && h.opcode == op && h.request_id == self.1);
        let mut body = vec![0u8; h.body_len as usize];
        self.0.read_exact(&mut body).await.unwrap();
        (ErrorCode::from_u16(h.status).unwrap(), body)
    }
}

type Session = (
    Arc<Tiers>,
    Conn,
    tokio::task::JoinHandle<io::Result<()>>,
    prometheus::IntGauge,
);

/// A session of the RDMA control port: leases and reservations only.
fn session() -> Session {
    session_with(false)
}

/// A session, of the same-host socket if `puts` (it takes puts with
/// their bytes).
fn session_with(puts: bool) -> Session {
    let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
    let tiers = Tiers::dram_only(pool);
    let (client, mut server) = tokio::io::duplex(1 << 16);
    let t = tiers.clone();
    let service = puts.then(|| DataService {
        tiers: tiers.clone(),
        cfg: crate::server::DataConfig {
            verify_on_read: false,
            request_timeout: std::time::Duration::from_secs(5),
            put_stall_timeout: std::time::Duration::from_secs(5),
            peers: crate::fetch::Peers::default(),
            kv_lease_ttl: std::time::Duration::from_secs(5),
        },
        metrics: crate::metrics::DaemonMetrics::new(
            &prometheus::Registry::new(),
            tiers.clone(),
            &crate::io::IoTimes::new(vec![1.0]).unwrap(),
        )
        .unwrap(),
    });
    let sessions = prometheus::IntGauge::new("sessions", "open").unwrap();
    let counted = sessions.clone();
    let task = tokio::spawn(async move {
        let stop = CancellationToken::new();
        serve(&mut server, &t, (service.as_ref(), None), &counted, &stop).await
    });
    (tiers, Conn(client, 0), task, sessions)
}

/// A `Put` body: its head, then the bytes.
fn put_with_bytes(n: u8, bytes: &[u8], sum: u64) -> Vec<u8> {
    let mut body = mooncake_proto::message::PutHead {
        key: key(n),
        checksum: sum,
        parent: None,
        continues: false,
        tag: None,
    }
    .to_bytes();
    body.extend_from_slice(bytes);
    body
}

#[tokio::test]
async fn requests_sent_together_are_answered_in_order_around_a_put_with_its_bytes() {
    let (_tiers, mut conn, _task, _) = session_with(true);
    let small = vec![7u8; 3000];
    let large = vec![8u8; 50_000];
    // Three requests in one write: a reservation, a put with its
    // bytes (whose answer the daemon writes itself), a lease of a
    // block it does not hold; then, after those answers, a fourth.
    let sent = [
        (Opcode::ShmPut, put_request(1, &large, checksum(&large))),
        (Opcode::Put, put_with_bytes(2, &small, checksum(&small))),
        (Opcode::ShmGet, KeyRequest { key: key(3) }.to_bytes()),
        (Opcode::ShmGet, KeyRequest { key: key(2) }.to_bytes()),
    ];
    let mut frames = Vec::new();
    for (id, (op, body)) in sent.iter().enumerate().take(3) {
        frames.extend_from_slice(&Header::request(*op, id as u64 + 1, body.len() as u32).encode());
        frames.extend_from_slice(body);
    }
    conn.0.write_all(&frames).await.unwrap();
    let mut answers = Vec::new();
    for _ in 0..3 {
        let mut raw = [0u8; HEADER_LEN];
        conn.0.read_exact(&mut raw).await.unwrap();
        let h = Header::parse(&raw).unwrap().unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        conn.0.read_exact(&mut body).await.unwrap();
        answers.push((
            h.opcode,
            h.request_id,
            ErrorCode::from_u16(h.status).unwrap(),
        ));
    }
    assert_eq!(
        answers,
        vec![
            (Opcode::ShmPut, 1, ErrorCode::Ok),
            (Opcode::Put, 2, ErrorCode::Ok),
            (Opcode::ShmGet, 3, ErrorCode::NotFound),
        ]
    );
    // The session goes on: the block put with its bytes is there.
    conn.1 = 3;
    let (code, body) = conn.call(sent[3].0, &sent[3].1).await;
    assert_eq!(code, ErrorCode::Ok);
    assert_eq!(
        ShmLease::from_bytes(&body).unwrap().len as usize,
        small.len()
    );
}

#[tokio::test]
async fn a_same_host_put_with_its_bytes_is_stored_in_one_round_trip() {
    let (tiers, mut conn, _task, _) = session_with(true);
    let bytes: Vec<u8> = (0..20_000u32).map(|i| (i * 13) as u8).collect();
    let put = put_with_bytes(4, &bytes, checksum(&bytes));
    assert_eq!(conn.call(Opcode::Put, &put).await.0, ErrorCode::Ok);
    let (code, body) = conn
        .call(Opcode::ShmGet, &KeyRequest { key: key(4) }.to_bytes())
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let lease = ShmLease::from_bytes(&body).unwrap();
    assert_eq!(read_pool(&tiers, lease.offset, bytes.len()), bytes);
    // Bytes that do not match their checksum are refused and not kept;
    // the session goes on.
    let wrong = put_with_bytes(5, &bytes, checksum(&bytes) ^ 1);
    assert_eq!(
        conn.call(Opcode::Put, &wrong).await.0,
        ErrorCode::ChecksumMismatch
    );
    let get = KeyRequest { key: key(5) }.to_bytes();
    assert_eq!(conn.call(Opcode::ShmGet, &get).await.0, ErrorCode::NotFound);
}

#[tokio::test]
async fn a_put_with_bytes_is_refused_where_only_leases_are_served() {
    let (_tiers, mut conn, task, _) = session();
    let bytes = vec![1u8; 100];
    let put = put_with_bytes(6, &bytes, checksum(&bytes));
    assert_eq!(
        conn.call(Opcode::Put, &put).await.0,
        ErrorCode::UnknownOpcode
    );
    assert!(task.await.unwrap().is_ok());
}

/// Writes `bytes` at `offset` of the pool, as a client's RDMA write (or
/// same-host copy) would.
fn write_pool(tiers: &Tiers, offset: u64, bytes: &[u8]) {
    let (base, len) = tiers.dram.memory();
    assert!(offset as usize + bytes.len() <= len);
    // SAFETY: in bounds, into room reserved for this block alone.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            base.as_ptr().add(offset as usize),
            bytes.len(),
        )
    };
}

fn read_pool(tiers: &Tiers, offset: u64, len: usize) -> Vec<u8> {
    let (base, size) = tiers.dram.memory();
    assert!(offset as usize + len <= size);
    // SAFETY: in bounds, under a lease.
    unsafe { std::slice::from_raw_parts(base.as_ptr().add(offset as usize), len) }.to_vec()
}

fn put_request(n: u8, bytes: &[u8], sum: u64) -> Vec<u8> {
    ShmPutRequest {
        key: key(n),
        len: bytes.len() as u64,
        checksum: Some(sum),
        parent: None,
        continues: false,
        tag: None,
    }
    .to_bytes()
}

/// Puts block `n` through room reserved for it (`ShmPut`, the bytes
/// written, `ShmCommit`); the commit's status.
async fn put_through_pool(tiers: &Tiers, conn: &mut Conn, n: u8, bytes: &[u8]) -> ErrorCode {
    let (code, body) = conn
        .call(Opcode::ShmPut, &put_request(n, bytes, checksum(bytes)))
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let slot = ShmSlot::from_bytes(&body).unwrap();
    write_pool(tiers, slot.offset, bytes);
    conn.call(Opcode::ShmCommit, &commit_of(slot, None)).await.0
}

fn commit_of(slot: ShmSlot, checksum: Option<u64>) -> Vec<u8> {
    ShmCommitRequest {
        slot: slot.slot,
        checksum,
    }
    .to_bytes()
}

#[tokio::test]
async fn a_block_written_into_reserved_room_is_verified_stored_and_leased_in_place() {
    let (tiers, mut conn, _task, _) = session();
    let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    assert_eq!(
        put_through_pool(&tiers, &mut conn, 1, &bytes).await,
        ErrorCode::Ok
    );
    let (code, body) = conn
        .call(Opcode::ShmGet, &KeyRequest { key: key(1) }.to_bytes())
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let lease = ShmLease::from_bytes(&body).unwrap();
    assert_eq!(
        (lease.len as usize, lease.checksum),
        (bytes.len(), checksum(&bytes))
    );
    assert_eq!(read_pool(&tiers, lease.offset, bytes.len()), bytes);
    let release = ShmRelease {
        leases: vec![lease.lease],
    };
    assert_eq!(
        conn.call(Opcode::ShmRelease, &release.to_bytes()).await.0,
        ErrorCode::Ok
    );
    assert_eq!(tiers.dram.stats().hits, 1);
}

#[tokio::test]
async fn bytes_that_do_not_match_their_checksum_are_refused_at_commit() {
    let (tiers, mut conn, _task, _) = session();
    let bytes = vec![9u8; 3000];
    let (_, body) = conn
        .call(Opcode::ShmPut, &put_request(2, &bytes, checksum(&bytes)))
        .await;
    let slot = ShmSlot::from_bytes(&body).unwrap();
    write_pool(&tiers, slot.offset, &bytes[..2999]);
    write_pool(&tiers, slot.offset + 2999, &[8]);
    assert_eq!(
        conn.call(Opcode::ShmCommit, &commit_of(slot, None)).await.0,
        ErrorCode::ChecksumMismatch
    );
    let get = KeyRequest { key: key(2) }.to_bytes();
    assert_eq!(conn.call(Opcode::ShmGet, &get).await.0, ErrorCode::NotFound);
    // The slot is gone: committing it again is refused.
    assert_eq!(
        conn.call(Opcode::ShmCommit, &commit_of(slot, None)).await.0,
        ErrorCode::NoReservation
    );
}

#[tokio::test]
async fn a_same_host_writer_says_the_checksum_of_its_bytes_in_place_at_commit() {
    let (tiers, mut conn, _task, _) = session_with(true);
    let bytes: Vec<u8> = (0..70_000u32).map(|i| (i * 13) as u8).collect();
    let unhashed = |n| {
        ShmPutRequest {
            key: key(n),
            len: bytes.len() as u64,
            checksum: None,
            parent: None,
            continues: false,
            tag: None,
        }
        .to_bytes()
    };
    let (code, body) = conn.call(Opcode::ShmPut, &unhashed(4)).await;
    assert_eq!(code, ErrorCode::Ok);
    let slot = ShmSlot::from_bytes(&body).unwrap();
    write_pool(&tiers, slot.offset, &bytes);
    let sum = checksum(&bytes);
    assert_eq!(
        conn.call(Opcode::ShmCommit, &commit_of(slot, Some(sum)))
            .await
            .0,
        ErrorCode::Ok
    );
    let (code, body) = conn
        .call(Opcode::ShmGet, &KeyRequest { key: key(4) }.to_bytes())
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let lease = ShmLease::from_bytes(&body).unwrap();
    assert_eq!((lease.len as usize, lease.checksum), (bytes.len(), sum));
    assert_eq!(read_pool(&tiers, lease.offset, bytes.len()), bytes);
    assert_eq!(
        tiers.dram.inventory(),
        vec![(key(4), bytes.len() as u32, sum, None)]
    );

    // A commit's checksum that disagrees with the one given at
    // reservation is refused, and the block stays unseen.
    let (_, body) = conn
        .call(Opcode::ShmPut, &put_request(5, &bytes, sum))
        .await;
    let slot = ShmSlot::from_bytes(&body).unwrap();
    write_pool(&tiers, slot.offset, &bytes);
    assert_eq!(
        conn.call(Opcode::ShmCommit, &commit_of(slot, Some(sum ^ 1)))
            .await
            .0,
        ErrorCode::ChecksumMismatch
    );
    let get = KeyRequest { key: key(5) }.to_bytes();
    assert_eq!(conn.call(Opcode::ShmGet, &get).await.0, ErrorCode::NotFound);

    // A put of a held key whose checksum comes only at commit replaces
    // what is held, with the new bytes and checksum.
    let other = vec![3u8; 9000];
    let (code, body) = conn
        .call(
            Opcode::ShmPut,
            &ShmPutRequest {
                key: key(4),
                len: other.len() as u64,
                checksum: None,
                parent: None,
                continues: false,
                tag: None,
            }
            .to_bytes(),
        )
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let slot = ShmSlot::from_bytes(&body).unwrap();
    write_pool(&tiers, slot.offset, &other);
    let commit = commit_of(slot, Some(checksum(&other)));
    assert_eq!(conn.call(Opcode::ShmCommit, &commit).await.0, ErrorCode::Ok);
    assert_eq!(
        tiers.dram.inventory(),
        vec![(key(4), other.len() as u32, checksum(&other), None)]
    );
}

#[tokio::test]
async fn over_rdma_the_daemon_checks_every_block_itself() {
    // Without a same-host writer that can read the pool, a put must
    // say its checksum first and cannot vouch for its bytes at commit.
    let (tiers, mut conn, task, _) = session_with(false);
    let bytes = vec![5u8; 6000];
    let unhashed = ShmPutRequest {
        key: key(6),
        len: bytes.len() as u64,
        checksum: None,
        parent: None,
        continues: false,
        tag: None,
    };
    assert_eq!(
        conn.call(Opcode::ShmPut, &unhashed.to_bytes()).await.0,
        ErrorCode::Malformed
    );
    let (code, body) = conn
        .call(Opcode::ShmPut, &put_request(6, &bytes, checksum(&bytes)))
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let slot = ShmSlot::from_bytes(&body).unwrap();
    write_pool(&tiers, slot.offset, &bytes[..5999]);
    // The writer's word for bytes it did not write in full.
    let vouched = commit_of(slot, Some(checksum(&bytes)));
    assert_eq!(
        conn.call(Opcode::ShmCommit, &vouched).await.0,
        ErrorCode::Malformed
    );
    write_pool(&tiers, slot.offset + 5999, &bytes[5999..]);
    assert_eq!(
        conn.call(Opcode::ShmCommit, &commit_of(slot, None)).await.0,
        ErrorCode::Ok
    );
    assert!(tiers.dram.contains(&key(6)));
    assert!(!task.is_finished());
}

#[tokio::test]
async fn a_request_of_another_path_is_refused_and_ends_the_session() {
    let (_tiers, mut conn, task, sessions) = session();
    let get = KeyRequest { key: key(3) }.to_bytes();
    // Answered once the session is open: it counts.
    assert_eq!(conn.call(Opcode::ShmGet, &get).await.0, ErrorCode::NotFound);
    assert_eq!(sessions.get(), 1);
    assert_eq!(
        conn.call(Opcode::Get, &get).await.0,
        ErrorCode::UnknownOpcode
    );
    assert!(task.await.unwrap().is_ok());
    assert_eq!(sessions.get(), 0, "an ended session is counted out");
}

/// Asks for `count` rooms of `len` bytes; the rooms given.
async fn rooms(conn: &mut Conn, len: u64, count: u32) -> ShmRooms {
    let ask = ShmRoomRequest { len, count }.to_bytes();
    let (code, body) = conn.call(Opcode::ShmRoom, &ask).await;
    assert_eq!(code, ErrorCode::Ok);
    let given = ShmRooms::from_bytes(&body).unwrap();
    assert_eq!(given.len, len);
    given
}

fn store_request(room: &ShmSlot, n: u8, bytes: &[u8], sum: u64) -> Vec<u8> {
    ShmStoreRequest {
        room: room.slot,
        key: key(n),
        len: bytes.len() as u64,
        checksum: sum,
        parent: None,
        continues: false,
        tag: None,
    }
    .to_bytes()
}

#[tokio::test]
async fn a_block_written_into_a_held_room_is_stored_by_one_message_that_hands_over_the_next_room() {
    let (tiers, mut conn, _task, _) = session_with(true);
    let bytes: Vec<u8> = (0..20_000u32).map(|i| (i * 13) as u8).collect();
    let len = bytes.len() as u64;
    let held = rooms(&mut conn, len, 2).await;
    assert_eq!(held.rooms.len(), 2);
    let room = &held.rooms[0];
    write_pool(&tiers, room.offset, &bytes);
    let (code, body) = conn
        .call(
            Opcode::ShmStore,
            &store_request(room, 1, &bytes, checksum(&bytes)),
        )
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let next = ShmRooms::from_bytes(&body).unwrap();
    assert_eq!((next.len, next.rooms.len()), (len, 1));
    assert!(held.rooms.iter().all(|r| r.offset != next.rooms[0].offset));
    // Two rooms held (the other one and the next), beside the block.
    let room_bytes = tiers.dram.room_bytes();
    assert!(
        (2 * len..2 * len + 512).contains(&room_bytes),
        "{room_bytes}"
    );
    let (code, body) = conn
        .call(Opcode::ShmGet, &KeyRequest { key: key(1) }.to_bytes())
        .await;
    assert_eq!(code, ErrorCode::Ok);
    let lease = ShmLease::from_bytes(&body).unwrap();
    assert_eq!(lease.checksum, checksum(&bytes));
    assert_eq!(read_pool(&tiers, lease.offset, bytes.len()), bytes);
}

#[tokio::test]
async fn a_room_is_spent_once_and_a_block_not_taken_hands_it_back() {
    let (tiers, mut conn, _task, _) = session_with(true);
    let bytes = vec![7u8; 20_000];
    let sum = checksum(&bytes);
    let held = rooms(&mut conn, bytes.len() as u64, 2).await;
    let (first, second) = (&held.rooms[0], &held.rooms[1]);
    write_pool(&tiers, first.offset, &bytes);
    let store = store_request(first, 2, &bytes, sum);
    assert_eq!(conn.call(Opcode::ShmStore, &store).await.0, ErrorCode::Ok);
    // The same room again: spent.
    assert_eq!(
        conn.call(Opcode::ShmStore, &store).await.0,
        ErrorCode::NoReservation
    );
    // The same bytes under the same key: already stored, and the room
    // comes back (a new name for it) unfilled.
    let before = tiers.dram.room_bytes();
    write_pool(&tiers, second.offset, &bytes);
    let (code, body) = conn
        .call(Opcode::ShmStore, &store_request(second, 2, &bytes, sum))
        .await;
    assert_eq!(code, ErrorCode::AlreadyExists);
    let back = ShmRooms::from_bytes(&body).unwrap();
    assert_eq!(back.rooms[0].offset, second.offset);
    assert_eq!(tiers.dram.room_bytes(), before);
    assert_eq!(tiers.dram.stats().blocks, 1);
}

#[tokio::test]
async fn rooms_are_capped_let_go_by_length_and_never_keep_a_put_from_starting() {
    let (tiers, mut conn, task, _) = session_with(true);
    let first = rooms(&mut conn, 8 << 10, 4).await;
    assert_eq!(first.rooms.len(), 4);
    // Rooms of another length: those of the first are let go, and no
    // more are given than the pool spares for rooms (an eighth of this
    // 1 MiB pool).
    let second = rooms(&mut conn, 16 << 10, 1000).await;
    assert_eq!(second.rooms.len(), 8);
    assert_eq!(tiers.dram.room_bytes(), 8 * (16 << 10));
    let stale = store_request(&first.rooms[0], 3, &[1; 8 << 10], 0);
    assert_eq!(
        conn.call(Opcode::ShmStore, &stale).await.0,
        ErrorCode::NoReservation
    );
    // Puts still get room of their own beside the rooms held.
    let bytes = vec![3u8; 200 << 10];
    assert_eq!(
        put_through_pool(&tiers, &mut conn, 4, &bytes).await,
        ErrorCode::Ok
    );
    // The session's end frees every room it held.
    drop(conn);
    assert!(task.await.unwrap().is_ok());
    assert_eq!(tiers.dram.room_bytes(), 0);
    assert_eq!(tiers.dram.stats().used, 200 << 10);
}

#[tokio::test]
async fn over_rdma_a_block_stored_from_a_room_is_checked_by_the_daemon() {
    let (tiers, mut conn, _task, _) = session();
    let bytes = vec![9u8; 20_000];
    let held = rooms(&mut conn, bytes.len() as u64, 1).await;
    let room = &held.rooms[0];
    write_pool(&tiers, room.offset, &bytes);
    let said = checksum(&bytes) ^ 1;
    let (code, body) = conn
        .call(Opcode::ShmStore, &store_request(room, 5, &bytes, said))
        .await;
    assert_eq!(code, ErrorCode::ChecksumMismatch);
    // Nothing stored; the session holds a new room instead.
    let get = KeyRequest { key: key(5) }.to_bytes();
    assert_eq!(conn.call(Opcode::ShmGet, &get).await.0, ErrorCode::NotFound);
    assert_eq!(ShmRooms::from_bytes(&body).unwrap().rooms.len(), 1);
    assert_eq!(tiers.dram.stats().blocks, 0);
}
