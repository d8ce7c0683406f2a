//! A client's leases and reservations on the DRAM pool, for the data paths
//! where the client moves the bytes itself: same-host shared memory (over
//! the daemon's Unix socket) and RDMA (over its RDMA control port). Either
//! way the connection carries the same requests: lease a block so that it
//! stays in place while the client reads it (`ShmGet`, `ShmRelease`),
//! reserve room and have the client's bytes verified and stored
//! (`ShmPut`, `ShmCommit`), and note reads the client made without a lease
//! (`ShmTouch`). Everything a connection holds ends when it goes away.
//! A same-host session also takes small puts with their bytes in the frame
//! (`Put`, as over TCP): one round trip instead of reserve and commit.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use mooncake_proto::message::{
    Body, EngineTag, KeyRequest, ShmCommitRequest, ShmLease, ShmPutRequest, ShmRelease, ShmSlot,
    ShmTouch,
};
use mooncake_proto::{BlockKey, ErrorCode, Header, Opcode, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::pool::{PoolError, ReadLease, WriteSlot};
use crate::server::DataService;
use crate::tiers::Tiers;

/// Leases (and reserved slots) one client may hold at once.
const MAX_LEASES: usize = 1 << 16;
/// Longest a writer waits for the demotion queue before its put evicts.
const BACKPRESSURE: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves one client's lease requests on `stream` until it goes away, sends
/// something else, or `shutdown`; counted in `sessions` meanwhile. Puts
/// with their bytes are taken where `puts` serves them: a same-host
/// session, whose client maps the pool and so may also hash the bytes it
/// wrote there itself and say their checksum at commit (`ShmCommitRequest`);
/// over RDMA only this daemon's CPU reads them, so it checks them.
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    tiers: &Arc<Tiers>,
    puts: Option<&DataService>,
    sessions: &prometheus::IntGauge,
    shutdown: &CancellationToken,
) -> io::Result<()> {
    sessions.inc();
    let _open = Open(sessions);
    // A request's header, body and a small put's bytes in one read where
    // they came together. Answers gather in `out`, written at once when no
    // whole request is left to read without waiting (a client keeps many
    // unanswered: one write for all their answers, not two each).
    let stream = &mut tokio::io::BufReader::with_capacity(64 << 10, stream);
    let mut out: Vec<u8> = Vec::with_capacity(4 << 10);
    let pool = &tiers.dram;
    let same_host = puts.is_some();
    // Every lease this client holds; all end when it goes away.
    let mut leases: HashMap<u64, ReadLease> = HashMap::new();
    // Blocks reserved and being written by this client; dropped (their
    // space freed) if it goes away before committing.
    // Each reserved slot, with the key and the engine's tag it was put with.
    let mut slots: HashMap<u64, (WriteSlot, BlockKey, Option<Arc<EngineTag>>)> = HashMap::new();
    let mut next_lease = 1u64;
    loop {
        if !out.is_empty() && !request_waits(stream.buffer()) {
            stream.write_all(&out).await?;
            out.clear();
        }
        let mut raw = [0u8; HEADER_LEN];
        tokio::select! {
            read = stream.read_exact(&mut raw) => match read {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            },
            _ = shutdown.cancelled() => return Ok(()),
        }
        let parsed = Header::parse(&raw);
        if let (Ok(Some(h)), Some(service)) = (&parsed, puts) {
            if !h.response && h.opcode == Opcode::Put {
                // It answers, or ends the session on a broken frame: the
                // answers before it go first.
                stream.write_all(&out).await?;
                out.clear();
                service
                    .put_on(*h, stream)
                    .await
                    .map_err(|err| io::Error::other(err.to_string()))?;
                continue;
            }
        }
        let header = match parsed {
            Ok(Some(h))
                if !h.response
                    && matches!(
                        h.opcode,
                        Opcode::ShmGet
                            | Opcode::ShmRelease
                            | Opcode::ShmPut
                            | Opcode::ShmCommit
                            | Opcode::ShmTouch
                    ) =>
            {
                h
            }
            Ok(_) => {
                out.extend_from_slice(&Header::error_reply(&raw, ErrorCode::UnknownOpcode as u16));
                stream.write_all(&out).await?;
                return Ok(());
            }
            Err(err) => {
                out.extend_from_slice(&Header::error_reply(&raw, err.code() as u16));
                stream.write_all(&out).await?;
                return Ok(());
            }
        };
        let mut body = vec![0u8; header.body_len as usize];
        stream.read_exact(&mut body).await?;
        let (code, answer) = match header.opcode {
            Opcode::ShmGet => match KeyRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(_) if leases.len() >= MAX_LEASES => (ErrorCode::Busy, Vec::new()),
                Ok(req) => match pool.get(&req.key) {
                    None => {
                        pool.note_get(false);
                        (ErrorCode::NotFound, Vec::new())
                    }
                    Some(lease) => {
                        pool.note_get(true);
                        tiers.hot.note(&req.key);
                        let id = next_lease;
                        next_lease += 1;
                        let answer = ShmLease {
                            lease: id,
                            offset: lease.byte_offset(),
                            len: lease.len() as u32,
                            checksum: lease.checksum(),
                        };
                        leases.insert(id, lease);
                        (ErrorCode::Ok, answer.to_bytes())
                    }
                },
            },
            Opcode::ShmPut => match ShmPutRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(_) if slots.len() >= MAX_LEASES => (ErrorCode::Busy, Vec::new()),
                Ok(req) if req.checksum.is_none() && !same_host => {
                    (ErrorCode::Malformed, Vec::new())
                }
                Ok(req) => {
                    let key = req.key.clone();
                    let reserved = tiers
                        .reserve_put(req.key, req.len, req.checksum, BACKPRESSURE)
                        .await;
                    match reserved {
                        Err(err) => (err.code(), Vec::new()),
                        Ok(mut slot) => {
                            slot.set_parent(req.parent);
                            slot.set_continues(req.continues);
                            let id = next_lease;
                            next_lease += 1;
                            let answer = ShmSlot {
                                slot: id,
                                offset: slot.byte_offset(),
                            };
                            slots.insert(id, (slot, key, req.tag));
                            (ErrorCode::Ok, answer.to_bytes())
                        }
                    }
                }
            },
            Opcode::ShmCommit => match ShmCommitRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) if req.checksum.is_some() && !same_host => {
                    (ErrorCode::Malformed, Vec::new())
                }
                Ok(req) => match slots.remove(&req.slot) {
                    None => (ErrorCode::NoReservation, Vec::new()),
                    Some((slot, key, tag)) => match commit(tiers, slot, req.checksum) {
                        Ok(()) => {
                            tiers.set_tag(&key, tag);
                            (ErrorCode::Ok, Vec::new())
                        }
                        Err(e) => (e.code(), Vec::new()),
                    },
                },
            },
            Opcode::ShmTouch => match ShmTouch::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) => {
                    for key in &req.keys {
                        if pool.touch(key) {
                            pool.note_get(true);
                            tiers.hot.note(key);
                        }
                    }
                    (ErrorCode::Ok, Vec::new())
                }
            },
            _ => match ShmRelease::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) => {
                    for id in req.leases {
                        leases.remove(&id);
                    }
                    (ErrorCode::Ok, Vec::new())
                }
            },
        };
        let h = Header::response(
            header.opcode,
            header.request_id,
            code as u16,
            answer.len() as u32,
        );
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(&answer);
    }
}

/// Whether `buffered` holds a whole request (header and body) to serve
/// without reading: else the answers gathered go out first.
fn request_waits(buffered: &[u8]) -> bool {
    let Some(raw) = buffered.get(..HEADER_LEN) else {
        return false;
    };
    match Header::parse(raw) {
        // A put's value is read from the socket: its answers go first.
        Ok(Some(h)) => {
            h.opcode != Opcode::Put && buffered.len() >= HEADER_LEN + h.body_len as usize
        }
        // A broken header is answered at once.
        _ => true,
    }
}

/// Makes a written slot visible: checked against the checksum given at
/// reservation (`sum` none: this CPU hashes the bytes), or with the
/// checksum its same-host writer computed of them in place.
fn commit(tiers: &Tiers, slot: WriteSlot, sum: Option<u64>) -> Result<(), PoolError> {
    match sum {
        None => slot.commit(),
        Some(sum) => tiers.commit_put(slot, sum),
    }
}

/// Counts a session out when it ends, however it ends.
struct Open<'a>(&'a prometheus::IntGauge);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{DramPool, PoolConfig};
    use mooncake_proto::checksum::checksum;
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
            },
            metrics: crate::metrics::DaemonMetrics::new(
                &prometheus::Registry::new(),
                tiers.clone(),
            )
            .unwrap(),
        });
        let sessions = prometheus::IntGauge::new("sessions", "open").unwrap();
        let counted = sessions.clone();
        let task = tokio::spawn(async move {
            let stop = CancellationToken::new();
            serve(&mut server, &t, service.as_ref(), &counted, &stop).await
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
            frames.extend_from_slice(
                &Header::request(*op, id as u64 + 1, body.len() as u32).encode(),
            );
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
        let (code, body) = conn
            .call(Opcode::ShmPut, &put_request(1, &bytes, checksum(&bytes)))
            .await;
        assert_eq!(code, ErrorCode::Ok);
        let slot = ShmSlot::from_bytes(&body).unwrap();
        write_pool(&tiers, slot.offset, &bytes);
        assert_eq!(
            conn.call(Opcode::ShmCommit, &commit_of(slot, None)).await.0,
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
}
