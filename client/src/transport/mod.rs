//! How block data moves between this client and a daemon. Every data path
//! implements [`Transport`]: read a batch of blocks into the caller's
//! buffers, write a batch from the caller's slices, each verified against
//! its checksum. The client picks one per daemon from what the daemon
//! advertised and what this host offers, best first: same-host shared
//! memory, then RDMA, then QUIC or TCP as configured. Each time a better
//! path cannot be used the fallback is counted
//! (`mooncake_client_transport_fallbacks_total{from,to}`).
//!
//! The control path (meta calls, corruption reports) is always TCP.

use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use mooncake_proto::message::{Location, ShmLease};
use mooncake_proto::transport::TransportKind;
use mooncake_proto::{BlockHash, ErrorCode, Header, Namespace, Opcode, HEADER_LEN};

use crate::pieces::{Dest, Value};
use crate::ClientError;

pub(crate) mod outbox;
#[cfg(feature = "rdma")]
pub mod rdma;
pub(crate) mod shm;
pub(crate) mod stream;

/// One data path to one daemon.
pub trait Transport: Send + Sync {
    fn kind(&self) -> TransportKind;

    /// Reads each item's block into its buffer; what each read found.
    /// `Read::Missing` for a block this path cannot serve (e.g. one on
    /// NVMe, for shared memory): the caller asks another path.
    fn get<'a, 'b: 'a>(
        &'a self,
        namespace: &'a Namespace,
        items: &'a mut [GetItem<'b>],
    ) -> BoxFuture<'a, Result<Vec<Read>, ClientError>>;

    /// Writes each item's value; the daemon's status for each, with the
    /// checksum it was stored under.
    fn put<'a, 'b: 'a>(
        &'a self,
        namespace: &'a Namespace,
        items: &'a [PutItem<'b>],
    ) -> BoxFuture<'a, Result<Vec<Written>, ClientError>>;
}

/// One block to read, and where its bytes go.
pub struct GetItem<'b> {
    /// Its position in the caller's batch.
    pub index: usize,
    pub hash: BlockHash,
    /// What the index says about it (size and the writer's checksum).
    pub location: Location,
    pub buf: Dest<'b>,
}

/// One block to write.
#[derive(Clone)]
pub struct PutItem<'v> {
    pub index: usize,
    pub hash: BlockHash,
    pub value: Value<'v>,
    /// XXH3-64 of `value`, which the daemon checks before storing it;
    /// `None` to have the transport compute it: as the bytes land in the
    /// same-host pool (one pass for the copy and its checksum), else
    /// before it sends them.
    pub checksum: Option<u64>,
    /// The block whose prefix this one extends, for prefix-aware eviction.
    pub parent: Option<BlockHash>,
    /// The meta service judged that it continues a branch readers come
    /// back to (`Slot::Place`), for the daemon's 2Q pool.
    pub continues: bool,
    /// What the engine calls it, kept by the daemon with it.
    pub tag: Option<std::sync::Arc<mooncake_proto::message::EngineTag>>,
}

impl PutItem<'_> {
    /// Its checksum: the one given, else computed now.
    pub(crate) fn sum(&self) -> u64 {
        self.checksum.unwrap_or_else(|| self.value.checksum())
    }
}

/// What became of one block written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The daemon's status.
    pub code: ErrorCode,
    /// XXH3-64 of the bytes written: the item's, or computed by the
    /// transport (meaningful where `code` is `Ok`).
    pub checksum: u64,
}

/// What one read found, before it is told to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    Hit(usize),
    /// No location, or the daemon does not hold the block.
    Missing,
    /// The daemon's bytes are intact but are not the block the location
    /// described (it was replaced since): ask the meta service again.
    Stale,
    /// The bytes do not match the daemon's own checksum.
    Corrupt,
    Failed(ErrorCode),
}

impl Read {
    /// What a read of a leased block (same host or RDMA) found, its bytes
    /// hashing to `sum`: corrupt unless they match the daemon's checksum,
    /// stale unless the lease is the block the location described.
    pub(crate) fn of_lease(lease: &ShmLease, sum: u64, item: &GetItem<'_>) -> Read {
        if sum != lease.checksum {
            Read::Corrupt
        } else if lease.checksum != item.location.checksum || lease.len != item.location.size {
            Read::Stale
        } else {
            Read::Hit(lease.len as usize)
        }
    }
}

const KINDS: usize = TransportKind::ALL.len();

/// Blocks moved per transport and fallbacks between transports, counted
/// whether or not the application exposes a metrics registry.
#[derive(Default)]
pub struct TransportCounters {
    reads: [AtomicU64; KINDS],
    writes: [AtomicU64; KINDS],
    fallbacks: [[AtomicU64; KINDS]; KINDS],
}

impl TransportCounters {
    pub(crate) fn read(&self, kind: TransportKind, blocks: usize) {
        self.reads[kind as usize].fetch_add(blocks as u64, Ordering::Relaxed);
    }

    pub(crate) fn wrote(&self, kind: TransportKind, blocks: usize) {
        self.writes[kind as usize].fetch_add(blocks as u64, Ordering::Relaxed);
    }

    pub(crate) fn fell_back(&self, from: TransportKind, to: TransportKind) {
        self.fallbacks[from as usize][to as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Blocks read through `kind` (hits only).
    pub fn reads(&self, kind: TransportKind) -> u64 {
        self.reads[kind as usize].load(Ordering::Relaxed)
    }

    /// Blocks stored through `kind`.
    pub fn writes(&self, kind: TransportKind) -> u64 {
        self.writes[kind as usize].load(Ordering::Relaxed)
    }

    /// Times `from` could not be used and `to` was used instead.
    pub fn fallbacks(&self, from: TransportKind, to: TransportKind) -> u64 {
        self.fallbacks[from as usize][to as usize].load(Ordering::Relaxed)
    }
}

/// Hits among `reads`.
pub(crate) fn hits(reads: &[Read]) -> usize {
    reads.iter().filter(|r| matches!(r, Read::Hit(_))).count()
}

/// Successes among `written`.
pub(crate) fn stored(written: &[Written]) -> usize {
    written.iter().filter(|w| w.code == ErrorCode::Ok).count()
}

/// Appends one request frame to `frames`.
pub(crate) fn push_frame(frames: &mut Vec<u8>, op: Opcode, id: u64, body: &[u8]) {
    frames.extend_from_slice(&Header::request(op, id, body.len() as u32).encode());
    frames.extend_from_slice(body);
}

/// Reads the answer to request `id` (an `op`) on a link whose answers come
/// in the order of the requests: its status and body.
pub(crate) async fn answer<S: tokio::io::AsyncRead + Unpin>(
    conn: &mut S,
    op: Opcode,
    id: u64,
) -> std::io::Result<(ErrorCode, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut raw = [0u8; HEADER_LEN];
    conn.read_exact(&mut raw).await?;
    let header = Header::parse(&raw)
        .map_err(std::io::Error::other)?
        .ok_or_else(|| std::io::Error::other("short header"))?;
    if !header.response || header.opcode != op || header.request_id != id {
        return Err(std::io::Error::other(format!(
            "answers out of order: {:?} #{} where {op:?} #{id} was due",
            header.opcode, header.request_id
        )));
    }
    let mut body = vec![0u8; header.body_len as usize];
    conn.read_exact(&mut body).await?;
    let status = ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal);
    Ok((status, body))
}
