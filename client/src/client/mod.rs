//! The client API: `put`, `get_into`, `match_prefix`, `exists`,
//! `exists_leased`, `remove`,
//! `pin`, in batch form. Every call runs under the configured deadline.
//!
//! - `config`: what a client is configured with;
//! - `put`, `get`: the data calls (meta service for placement and
//!   locations, then straight to the daemons);
//! - `control`: the other calls to the meta service, and leader following;
//! - `hold`: lookups that lease what they find (Mooncake's `batch_is_exist`);
//! - `device`: blocks to and from GPU memory, through pinned staging;
//! - `paths`: which data path (shared memory, RDMA, QUIC, TCP) reaches
//!   each daemon.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use mooncake_proto::frame::{MAX_BATCH, MAX_CONTROL_BODY};
use mooncake_proto::message::{
    Body, ClusterStats, CommitItem, Copies, DaemonAddr, Empty, EngineTag, KeyRequest, KeysRequest,
    ListRequest, ListResponse, Location, Locations, PinRequest, PutCommitRequest, PutStartRequest,
    PutStartResponse, Revision, RouteAnswer, RouteCandidate, RouteRequest, Slot, Statuses, ToPlace,
    MAX_COPIES,
};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace, Opcode};
use parking_lot::RwLock;

use crate::lineage::Lineage;
use crate::locations::LocationCache;
use crate::metrics::ClientMetrics;
use crate::pieces::{Dest, Value};
use crate::transport::shm::{ShmCounts, ShmLink};
use crate::transport::stream::StreamTransport;
use crate::transport::{
    hits, stored, GetItem, PutItem, Read, Transport, TransportCounters, Written,
};
use crate::{ClientError, ErrorSource};
use mooncake_net::coalesce::Coalescer;
use mooncake_net::quic::QuicConnector;
use mooncake_net::ClientTls;
use mooncake_net::ConnPool;
use mooncake_net::Connection;
use mooncake_net::Dialer;
use mooncake_net::TlsConnector;
use mooncake_proto::transport::TransportKind;

use crate::MetaResolver;

mod admit;
mod config;
mod control;
mod device;
mod direct;
mod get;
mod hold;
mod paths;
mod put;

use config::pool_for;
pub use config::ClientConfig;

/// Pause between attempts to reach the same-host daemon's socket.
const SHM_RETRY: Duration = Duration::from_secs(1);

/// Most bytes of engine tags in one commit request, so that a request of
/// `MAX_BATCH` items stays within a control frame.
const MAX_COMMIT_TAG_BYTES: usize = MAX_CONTROL_BODY as usize / 2;

fn commit_tag_bytes(item: &CommitItem) -> usize {
    item.tag.as_deref().map_or(0, EngineTag::encoded_len)
}

/// What became of one block of a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored, as many copies as asked.
    Stored,
    /// Stored and visible, but on fewer hosts than asked (this many
    /// copies): too few hosts could take it, or writes to the others
    /// failed.
    Short {
        copies: u8,
    },
    /// Another writer stored (or is storing) the same key: nothing to do.
    AlreadyExists,
    Failed(ErrorCode),
}

impl PutOutcome {
    /// The block is stored (every copy asked or fewer), or was already.
    pub fn is_stored(&self) -> bool {
        !matches!(self, PutOutcome::Failed(_))
    }
}

/// How a put stores its blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Copies of each block, on distinct hosts, 1 to 4; 0: the client's
    /// `replicas`.
    pub replicas: u8,
    /// The blocks are a chain's, in order, even where no parent is named:
    /// a block that names none, and that no earlier lookup of this client
    /// placed, extends the block before it in the call. So the serving
    /// engines' Mooncake backends put a request's blocks (opaque keys,
    /// in order, no parent): LMCache's `batch_put_from` of the chunks past
    /// a request's stored prefix.
    pub in_order: bool,
}

impl PutOptions {
    /// `replicas` copies of each block (0: the client's `replicas`).
    pub fn copies(replicas: u8) -> Self {
        PutOptions {
            replicas,
            ..PutOptions::default()
        }
    }
}

/// What became of one block of a get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetOutcome {
    /// The block's bytes fill the first `n` bytes of the buffer.
    Hit(usize),
    /// Not stored, evicted, or found corrupt: recompute it.
    Miss,
    /// The block exists but could not be read (`TooLarge`: the buffer is
    /// smaller than the block; `Unavailable`: its daemon is unreachable).
    Failed(ErrorCode),
}

/// The answer to `match_prefix`: how many leading keys are stored, and where.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    pub matched: usize,
    pub locations: Vec<Location>,
    pub daemons: Vec<DaemonAddr>,
}

/// A handle to a Mooncake Store cluster; cheap to share behind an `Arc`.
pub struct Client {
    cfg: ClientConfig,
    meta: RwLock<Arc<ConnPool>>,
    daemons: RwLock<HashMap<u32, Arc<Peer>>>,
    locations: LocationCache,
    /// The parents that lookups imply for puts that name none.
    lineage: Lineage,
    corrupt_reads: AtomicU64,
    /// Highest meta election revision seen (fencing).
    leader_revision: AtomicU64,
    /// This host's RDMA NIC, opened on first use (or why there is none).
    #[cfg(feature = "rdma")]
    nic: std::sync::OnceLock<Result<Arc<mooncake_net::rdma::Nic>, String>>,
    /// Memory registered with the NIC by the caller.
    #[cfg(feature = "rdma")]
    registered: Arc<mooncake_net::rdma::Registered>,
    /// The same-host link, once made (and when it was last tried).
    shm: parking_lot::Mutex<(Option<Arc<ShmLink>>, Option<std::time::Instant>)>,
    /// Blocks read through the daemon's shared index (no lease), over
    /// every same-host link this client made.
    shm_counts: Arc<ShmCounts>,
    transports: TransportCounters,
    /// Reservations and commits of puts in flight at once, sent together;
    /// reservations one queue per number of copies asked (0 to 4), since
    /// one request asks one number for all its blocks.
    reservations: [Coalescer<ToPlace, Slot, Vec<DaemonAddr>>; MAX_COPIES + 1],
    commits: Coalescer<CommitItem, ErrorCode, ()>,
    /// The GPU support, loaded on first use (`None`: no GPU).
    device: std::sync::OnceLock<Option<Arc<dyn crate::device::Device>>>,
    /// Pinned staging buffers for GPU memory, kept between calls.
    stages: crate::device::Stages,
    /// Memory registered with `register_memory`: start -> (length, which
    /// memory), so that calls on it need not ask the GPU driver.
    memory_ranges: RwLock<std::collections::BTreeMap<usize, (usize, crate::device::Memory)>>,
}

/// How this client reaches one daemon.
struct Peer {
    /// What the meta service said about it (a change makes a new `Peer`).
    advertised: DaemonAddr,
    /// Its TCP address: the name block locations and same-host links use.
    addr: String,
    /// TCP connections, for control calls (corruption reports).
    tcp: Arc<ConnPool>,
    /// The network data path chosen for it.
    data: Arc<dyn Transport>,
    /// RDMA to it, when configured and both sides have it; blocks it
    /// cannot move go over `data`.
    rdma: Option<Arc<dyn Transport>>,
    /// Bytes of reads from it in flight: of a block's copies, the least
    /// busy daemon is read.
    reading: AtomicU64,
}

/// The data path a daemon would need and does not offer: every call fails
/// with why, rather than moving blocks some weaker way.
struct Unreachable {
    kind: TransportKind,
    why: String,
}

impl Transport for Unreachable {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn get<'a, 'b: 'a>(
        &'a self,
        _: &'a Namespace,
        _: &'a mut [GetItem<'b>],
    ) -> futures::future::BoxFuture<'a, Result<Vec<Read>, ClientError>> {
        Box::pin(std::future::ready(Err(ClientError::Invalid(
            self.why.clone(),
        ))))
    }

    fn put<'a, 'b: 'a>(
        &'a self,
        _: &'a Namespace,
        _: &'a [PutItem<'b>],
    ) -> futures::future::BoxFuture<'a, Result<Vec<Written>, ClientError>> {
        Box::pin(std::future::ready(Err(ClientError::Invalid(
            self.why.clone(),
        ))))
    }
}

impl Client {
    /// A client that connects lazily; see [`Client::connect`].
    pub fn new(cfg: ClientConfig) -> Self {
        let cfg_locations = (cfg.location_cache, cfg.location_ttl);
        let meta = RwLock::new(Arc::new(pool_for(
            &cfg,
            cfg.meta_addr.clone(),
            ErrorSource::Meta,
        )));
        Client {
            cfg,
            meta,
            daemons: RwLock::new(HashMap::new()),
            locations: LocationCache::new(cfg_locations.0, cfg_locations.1),
            lineage: Lineage::default(),
            corrupt_reads: AtomicU64::new(0),
            shm: parking_lot::Mutex::new((None, None)),
            shm_counts: Arc::default(),
            transports: TransportCounters::default(),
            reservations: Default::default(),
            commits: Coalescer::weighed(MAX_BATCH, MAX_COMMIT_TAG_BYTES, commit_tag_bytes),
            leader_revision: AtomicU64::new(0),
            device: std::sync::OnceLock::new(),
            stages: Default::default(),
            memory_ranges: Default::default(),
            #[cfg(feature = "rdma")]
            nic: std::sync::OnceLock::new(),
            #[cfg(feature = "rdma")]
            registered: Arc::default(),
        }
    }

    /// A client whose meta service answered a ping.
    pub async fn connect(cfg: ClientConfig) -> Result<Self, ClientError> {
        let client = Client::new(cfg);
        client.ping().await?;
        Ok(client)
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// Blocks read through the same-host shared pool.
    pub fn shm_reads(&self) -> u64 {
        self.transports.reads(TransportKind::Shm)
    }

    /// Of `shm_reads`, the blocks found through the daemon's shared index
    /// and copied without a lease (no message to the daemon).
    pub fn shm_index_reads(&self) -> u64 {
        self.shm_counts.index_reads.load(Ordering::Relaxed)
    }

    /// Of `shm_writes`, the blocks the daemon made visible itself: puts of
    /// one round trip, with no reservation or commit at the meta service.
    pub fn shm_admitted(&self) -> u64 {
        self.shm_counts.admitted.load(Ordering::Relaxed)
    }

    /// Of `shm_writes`, the blocks written into room held ahead for them
    /// (one message to the daemon instead of two).
    pub fn shm_room_writes(&self) -> u64 {
        self.shm_counts.room_writes.load(Ordering::Relaxed)
    }

    /// Blocks stored through the same-host shared pool.
    pub fn shm_writes(&self) -> u64 {
        self.transports.writes(TransportKind::Shm)
    }

    /// Blocks whose bytes failed their checksum on read (each was a miss).
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads.load(Ordering::Relaxed)
    }

    /// Blocks moved per transport, and fallbacks between transports.
    pub fn transports(&self) -> &TransportCounters {
        &self.transports
    }
}

impl Read {
    fn outcome(self) -> GetOutcome {
        match self {
            Read::Hit(n) => GetOutcome::Hit(n),
            Read::Missing | Read::Stale | Read::Corrupt => GetOutcome::Miss,
            Read::Failed(code) => GetOutcome::Failed(code),
        }
    }
}
