//! The same-host session (the daemon's Unix socket), fed a sequence of
//! requests: a real daemon with a shared pool, registered with a real meta
//! service, in this process. Each input is one session's requests, made
//! to reach deep: rooms asked for, blocks stored and admitted into them
//! (`ShmAdmit` asks the meta service), leases taken and released, puts
//! reserved and committed, reads noted, with ids and keys from small sets
//! so that they name what the session holds; between them, removals of
//! the same keys through the meta service, and frames of any opcode and
//! bytes. A panic anywhere aborts (a crash to libFuzzer); a block removed
//! once every request before its removal was answered is never leased
//! again until the session admits it anew; after every input a new
//! session must still be served, and both servers must still answer
//! `Ping`.
#![no_main]

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mooncake_proto::message::{
    Body, KeyRequest, KeysRequest, ShmCommitRequest, ShmPutRequest, ShmRelease, ShmRoomRequest,
    ShmStoreRequest, ShmTouch, Statuses,
};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Header, Namespace, Opcode, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Longest any step waits for an answer.
const WAIT: Duration = Duration::from_secs(5);
/// Longest a removal waits for the session's requests before it.
const SETTLE: Duration = Duration::from_millis(100);

struct Servers {
    store: common::Served,
    socket: PathBuf,
}

fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| {
        let socket = common::scratch("shm").join("daemon.sock");
        let ms = |ms| mooncake_proto::units::HumanDuration(Duration::from_millis(ms));
        let meta_cfg = mooncake_meta::MetaConfig {
            admin: String::new(),
            request_timeout: ms(500),
            ..mooncake_meta::MetaConfig::default()
        };
        let daemon_cfg = mooncake_store_daemon::DaemonConfig {
            admin: String::new(),
            dram: mooncake_proto::units::ByteSize(16 << 20),
            hugepages: false,
            prefault: false,
            shm_socket: Some(socket.clone()),
            request_timeout: ms(500),
            put_stall_timeout: ms(200),
            ..mooncake_store_daemon::DaemonConfig::default()
        };
        let store = common::serve(meta_cfg, daemon_cfg);
        Servers { store, socket }
    })
}

/// The fuzzer's bytes, read a field at a time (zeros once they run out).
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }

    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |v, _| v << 8 | u64::from(self.byte()))
    }

    /// An id of the session's (room, slot, lease): the first few, mostly.
    fn id(&mut self) -> u64 {
        match self.byte() {
            b @ 0..=250 => u64::from(b % 8),
            _ => self.u64(),
        }
    }

    /// A namespace whose blocks the meta service knows of: this session
    /// stores them only through admissions, which index them.
    fn indexed(b: u8) -> Namespace {
        Namespace::new(if b & 0x80 == 0 { "f" } else { "g" }).unwrap()
    }

    /// One of a few keys, so that requests meet on the same blocks: of
    /// the indexed namespaces, or (`local`) of the one this session stores
    /// into by `ShmStore` and `ShmPut` alone, which the meta service never
    /// hears of (a client's put asks it before and after).
    fn key(&mut self, local: bool) -> BlockKey {
        let b = self.byte();
        let namespace = if local {
            Namespace::new("l").unwrap()
        } else {
            Self::indexed(b)
        };
        BlockKey::new(namespace, Self::hash(b))
    }

    fn hash(b: u8) -> BlockHash {
        BlockHash([b % 6; 32])
    }

    fn parent(&mut self) -> Option<BlockHash> {
        let b = self.byte();
        (b & 0x40 != 0).then(|| Self::hash(b))
    }

    /// A block length: none, a few bytes, the usual sizes, past the pool.
    fn len(&mut self) -> u64 {
        match self.byte() % 10 {
            0 => 0,
            1 => 1,
            2 => 4096,
            3 => 16 << 10,
            4 => 16 << 10,
            5 => 256 << 10,
            6 => 1 << 20,
            7 => 4 << 20,
            8 => 64 << 20,
            _ => self.u64(),
        }
    }

    fn checksum(&mut self) -> Option<u64> {
        (self.byte() & 1 == 1).then(|| self.u64())
    }
}

/// What to do next in the session.
enum Step {
    /// A request to send on it (`id`: its request id).
    Send { bytes: Vec<u8>, id: u64, what: What },
    /// Removals through the meta service: once the requests sent so far
    /// are answered (`settled`), or with them still in flight.
    Remove { req: KeysRequest, settled: bool },
}

/// What a request may do to the blocks the session sees.
enum What {
    /// Reads `key` (a lease).
    Reads(BlockKey),
    /// May store `key` and tell the meta service.
    Admits(BlockKey),
    /// Any bytes: from here on the frames may no longer be where the
    /// requests think they are.
    Raw,
    /// Stores nothing of the indexed namespaces.
    Other,
}

/// The session's steps, from the fuzzer's bytes: at most 64.
fn steps(data: &[u8]) -> Vec<Step> {
    let mut input = Input(data);
    let mut steps = Vec::new();
    let mut id = 1u64;
    let mut frame = |opcode: Opcode, body: Vec<u8>, what: What| {
        let mut bytes = Header::request(opcode, id, body.len() as u32)
            .encode()
            .to_vec();
        bytes.extend_from_slice(&body);
        id += 1;
        Step::Send {
            bytes,
            id: id - 1,
            what,
        }
    };
    while !input.0.is_empty() && steps.len() < 64 {
        let step = match input.byte() % 10 {
            0 => {
                let (len, count) = (input.len(), u32::from(input.byte() % 5));
                let req = ShmRoomRequest { len, count };
                frame(Opcode::ShmRoom, req.to_bytes(), What::Other)
            }
            op @ (1 | 2) => {
                let req = ShmStoreRequest {
                    room: input.id(),
                    key: input.key(op == 1),
                    len: input.len(),
                    checksum: input.u64(),
                    parent: input.parent(),
                    continues: input.byte() & 1 == 1,
                    tag: None,
                };
                let opcode = if op == 1 {
                    Opcode::ShmStore
                } else {
                    Opcode::ShmAdmit
                };
                let what = if op == 1 {
                    What::Other
                } else {
                    What::Admits(req.key.clone())
                };
                frame(opcode, req.to_bytes(), what)
            }
            3 => {
                let b = input.byte();
                let key = input.key(b & 1 == 1);
                let what = What::Reads(key.clone());
                frame(Opcode::ShmGet, KeyRequest { key }.to_bytes(), what)
            }
            4 => {
                let leases = (0..input.byte() % 4).map(|_| input.id()).collect();
                let req = ShmRelease { leases };
                frame(Opcode::ShmRelease, req.to_bytes(), What::Other)
            }
            5 => {
                let req = ShmPutRequest {
                    key: input.key(true),
                    len: input.len(),
                    checksum: input.checksum(),
                    parent: input.parent(),
                    continues: input.byte() & 1 == 1,
                    tag: None,
                };
                frame(Opcode::ShmPut, req.to_bytes(), What::Other)
            }
            6 => {
                let req = ShmCommitRequest {
                    slot: input.id(),
                    checksum: input.checksum(),
                };
                frame(Opcode::ShmCommit, req.to_bytes(), What::Other)
            }
            7 => {
                let keys = (0..input.byte() % 4).map(|i| input.key(i == 1)).collect();
                frame(Opcode::ShmTouch, ShmTouch { keys }.to_bytes(), What::Other)
            }
            8 => {
                // Any opcode, any bytes: a frame cut short included.
                let (op, len) = (input.byte(), usize::from(input.byte()) * 4);
                let take = len.min(input.0.len());
                let mut step = frame(Opcode::Ping, input.0[..take].to_vec(), What::Raw);
                if let Step::Send { bytes, .. } = &mut step {
                    bytes[3] = op;
                    bytes[16..20].copy_from_slice(&(len as u32).to_le_bytes());
                }
                input.0 = &input.0[take..];
                step
            }
            _ => {
                let b = input.byte();
                let hashes = (0..b % 3 + 1)
                    .map(|i| Input::hash(b.wrapping_add(i)))
                    .collect();
                let req = KeysRequest {
                    namespace: Input::indexed(b),
                    hashes,
                };
                Step::Remove {
                    req,
                    settled: b & 0x40 != 0,
                }
            }
        };
        steps.push(step);
    }
    steps
}

/// Reads one answer and its body: `None` past `WAIT` or on a closed or
/// broken stream.
async fn answer<S: AsyncRead + Unpin>(stream: &mut S) -> Option<(Header, Vec<u8>)> {
    let mut raw = [0u8; HEADER_LEN];
    tokio::time::timeout(WAIT, stream.read_exact(&mut raw))
        .await
        .ok()?
        .ok()?;
    let header = Header::parse(&raw).ok()??;
    let mut body = vec![0u8; header.body_len as usize];
    tokio::time::timeout(WAIT, stream.read_exact(&mut body))
        .await
        .ok()?
        .ok()?;
    Some((header, body))
}

/// A new same-host session, past the daemon's hello (the pool's
/// descriptors it carries are not taken).
async fn session(socket: &PathBuf) -> Option<UnixStream> {
    let mut stream = UnixStream::connect(socket).await.ok()?;
    let mut hello = [0u8; 4096];
    let n = tokio::time::timeout(WAIT, stream.read(&mut hello))
        .await
        .ok()?
        .ok()?;
    (n > 0).then_some(stream)
}

/// Removes `req`'s keys (forced, as Mooncake's `remove`); whether each is
/// gone from the index and from every daemon that held it.
async fn remove(meta: SocketAddr, req: &KeysRequest) -> bool {
    let Ok(Ok(mut conn)) = tokio::time::timeout(WAIT, TcpStream::connect(meta)).await else {
        return false;
    };
    let body = req.to_bytes();
    let mut out = Header::request(Opcode::MetaRemove, 1, body.len() as u32)
        .encode()
        .to_vec();
    out.extend_from_slice(&body);
    if conn.write_all(&out).await.is_err() {
        return false;
    }
    let Some((h, body)) = answer(&mut conn).await else {
        return false;
    };
    let done = |c: &ErrorCode| matches!(c, ErrorCode::Ok | ErrorCode::NotFound);
    h.status == ErrorCode::Ok as u16
        && Statuses::from_bytes(&body).is_ok_and(|s| s.codes.iter().all(done))
}

/// Sends the steps on one session while reading its answers, until the
/// daemon has answered or closed it. A block removed once every request
/// before its removal was answered never comes back: a lease on it is
/// refused until the session writes again.
async fn run(s: &Servers, steps: Vec<Step>) {
    let Some(stream) = session(&s.socket).await else {
        return;
    };
    let (mut rd, mut wr) = stream.into_split();
    // Answers read so far; `None` once the session is closed.
    let (answered, mut seen) = tokio::sync::watch::channel(Some(0usize));
    // The requests that must be answered `NotFound` (leases on blocks
    // removed), by request id.
    let must_miss = std::sync::Mutex::new(HashSet::new());
    let write = async {
        let (mut sent, mut framed) = (0, true);
        let mut removed: HashSet<BlockKey> = HashSet::new();
        for step in steps {
            match step {
                Step::Send { bytes, id, what } => {
                    match what {
                        What::Reads(key) if removed.contains(&key) => {
                            must_miss.lock().unwrap().insert(id);
                        }
                        What::Admits(key) => {
                            removed.remove(&key);
                        }
                        What::Raw => framed = false,
                        What::Reads(_) | What::Other => {}
                    }
                    if wr.write_all(&bytes).await.is_err() {
                        return;
                    }
                    sent += 1;
                }
                Step::Remove { req, settled } => {
                    // A frame cut short or refused is never answered: wait
                    // a little at most.
                    let all = seen.wait_for(|n| n.is_none_or(|n| n >= sent));
                    let settled = settled
                        && framed
                        && matches!(tokio::time::timeout(SETTLE, all).await, Ok(Ok(n)) if n.is_some());
                    if remove(s.store.meta, &req).await && settled {
                        let keys = req.hashes.iter();
                        removed.extend(keys.map(|h| BlockKey::new(req.namespace.clone(), *h)));
                    }
                }
            }
        }
        let _ = wr.shutdown().await;
    };
    let read = async {
        while let Some((h, _)) = answer(&mut rd).await {
            if must_miss.lock().unwrap().remove(&h.request_id) {
                assert_eq!(
                    h.status,
                    ErrorCode::NotFound as u16,
                    "a lease on a block removed (request {}) was not refused: a removed block came back",
                    h.request_id
                );
            }
            answered.send_modify(|n| *n = n.map(|n| n + 1));
        }
        answered.send_replace(None);
    };
    tokio::join!(write, read);
}

/// Whether a new session is served: a lease on a block never stored is
/// answered `NotFound`.
async fn serves_sessions(socket: &PathBuf) -> bool {
    let Some(mut stream) = session(socket).await else {
        return false;
    };
    let key = BlockKey::new(Namespace::new("probe").unwrap(), BlockHash([9; 32]));
    let body = KeyRequest { key }.to_bytes();
    let mut out = Header::request(Opcode::ShmGet, 1, body.len() as u32)
        .encode()
        .to_vec();
    out.extend_from_slice(&body);
    if stream.write_all(&out).await.is_err() {
        return false;
    }
    matches!(answer(&mut stream).await, Some((h, _)) if h.status == ErrorCode::NotFound as u16)
}

async fn answers_ping<S: AsyncRead + AsyncWrite + Unpin>(mut conn: S) -> bool {
    let ping = Header::request(Opcode::Ping, 1, 0).encode();
    conn.write_all(&ping).await.is_ok()
        && matches!(answer(&mut conn).await, Some((h, _)) if h.status == ErrorCode::Ok as u16)
}

fuzz_target!(|data: &[u8]| {
    let s = servers();
    let steps = steps(data);
    s.store.rt.block_on(async {
        run(s, steps).await;
        assert!(
            serves_sessions(&s.socket).await,
            "the daemon stopped serving sessions (sessions open: {:?})",
            common::metric(&s.store.registry, "mooncake_daemon_lease_sessions")
        );
        for addr in [s.store.daemon, s.store.meta] {
            let conn = TcpStream::connect(addr).await.expect("still listening");
            assert!(answers_ping(conn).await, "{addr} stopped serving");
        }
    });
});
