//! The client API: `put`, `get_into`, `match_prefix`, `exists`, `remove`,
//! `pin`, in batch form. Every call runs under the configured deadline.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::message::{
    Body, ClusterStats, CommitItem, DaemonAddr, Empty, KeyRequest, KeysRequest, ListRequest,
    ListResponse, Location, Locations, PinRequest, PutCommitRequest, PutStartRequest,
    PutStartResponse, Revision, Slot, Statuses,
};
use mooncake_proto::{checksum, BlockHash, BlockKey, ErrorCode, Namespace, Opcode};
use parking_lot::RwLock;

use crate::coalesce::Coalescer;
use crate::locations::LocationCache;
use crate::metrics::ClientMetrics;
use crate::transport::shm::ShmLink;
use crate::transport::stream::StreamTransport;
use crate::transport::{hits, stored, GetItem, PutItem, Read, Transport, TransportCounters};
use crate::{ClientError, ErrorSource};
use mooncake_net::quic::QuicConnector;
use mooncake_net::ClientTls;
use mooncake_net::ConnPool;
use mooncake_net::Connection;
use mooncake_net::Dialer;
use mooncake_proto::transport::TransportKind;

/// Pause between attempts to reach the same-host daemon's socket.
const SHM_RETRY: Duration = Duration::from_secs(1);
use crate::MetaResolver;

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("meta_addr", &self.meta_addr)
            .field("follows_leader", &self.resolver.is_some())
            .field("metrics", &self.metrics.is_some())
            .field("timeout", &self.timeout)
            .field("quic", &self.quic.is_some())
            .field("rdma", &self.rdma)
            .finish()
    }
}

/// Pause between attempts to reach a meta leader during a failover.
const LEADER_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// How a client reaches the cluster and how long it waits.
#[derive(Clone)]
pub struct ClientConfig {
    /// The meta service's address, e.g. `127.0.0.1:7070` (the first one to
    /// try, when a resolver is set).
    pub meta_addr: String,
    /// Finds the current meta leader when the meta service is unreachable
    /// (e.g. through etcd); without one the client keeps `meta_addr`.
    pub resolver: Option<Arc<dyn MetaResolver>>,
    /// Client-side metrics, in a registry the application exposes. Default
    /// none.
    pub metrics: Option<Arc<ClientMetrics>>,
    /// This host's name, as its daemon registers it: new blocks go to the
    /// daemon on the same host first. Default: the hostname.
    pub node: String,
    /// Deadline of every call, end to end. Default 5s.
    pub timeout: Duration,
    /// Deadline of opening one connection. Default 1s.
    pub connect_timeout: Duration,
    /// Idle connections kept per peer. Default 64.
    pub max_idle_per_peer: usize,
    /// Block locations remembered, so that gets of known blocks skip the
    /// meta lookup (0 disables). Default 1M (about 100 MiB at most).
    pub location_cache: usize,
    /// Token presented to servers that require authentication (its tenant
    /// decides which namespaces this client may use). Default none.
    pub token: Option<Arc<str>>,
    /// The Unix socket of the daemon on this host (its `shm_socket`): its
    /// blocks are then copied straight out of its shared pool. Default
    /// none.
    pub shm_socket: Option<std::path::PathBuf>,
    /// Threads that copy one large same-host batch (8 MiB or more) out of
    /// the shared pool side by side: one core copies and checks about
    /// 7 GB/s. Default a quarter of the cores, 1 to 8.
    pub copy_threads: usize,
    /// Talks to the meta service and moves blocks over QUIC with these TLS
    /// settings (see [`ClientConfig::with_quic`]); daemons that serve no
    /// QUIC are refused, never reached over plain TCP. Default none: TCP.
    pub quic: Option<Arc<QuicConnector>>,
    /// Moves blocks over RDMA (one-sided reads and writes of the daemon's
    /// pool) to daemons that serve it, when this host has an RDMA NIC and
    /// the client is built with the `rdma` feature. Otherwise, and for
    /// blocks a daemon holds only on NVMe, blocks go over QUIC or TCP, and
    /// each fallback is counted. Default false.
    pub rdma: bool,
    /// The RDMA NIC to use (e.g. `mlx5_0`). Default: the first with an
    /// active port.
    pub rdma_device: Option<String>,
    /// The GID index to use on it. Default: its first routable RoCE v2
    /// GID (InfiniBand: 0).
    pub rdma_gid_index: Option<u32>,
    /// Most connections (or QUIC streams) one large batch to one daemon is
    /// spread over, 8 MiB or more each. Default 4; 1 keeps every batch on
    /// one connection.
    pub stripes: usize,
}

impl ClientConfig {
    pub fn new(meta_addr: impl Into<String>) -> Self {
        ClientConfig {
            meta_addr: meta_addr.into(),
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(1),
            max_idle_per_peer: 64,
            location_cache: 1 << 20,
            resolver: None,
            metrics: None,
            node: hostname(),
            token: None,
            shm_socket: None,
            copy_threads: (std::thread::available_parallelism().map_or(1, |n| n.get()) / 4)
                .clamp(1, 8),
            quic: None,
            rdma: false,
            rdma_device: None,
            rdma_gid_index: None,
            stripes: 4,
        }
    }

    /// Authenticates with `token` (see `docs/security.md`).
    pub fn with_token(mut self, token: impl Into<Arc<str>>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Records latency, hits and misses in `registry` (which the
    /// application serves on its own /metrics).
    pub fn with_metrics(mut self, registry: &prometheus::Registry) -> prometheus::Result<Self> {
        self.metrics = Some(ClientMetrics::new(registry)?);
        Ok(self)
    }

    /// Follows the meta leader through `resolver`, starting from the
    /// address it names now.
    pub async fn with_resolver(
        mut self,
        resolver: Arc<dyn MetaResolver>,
    ) -> Result<Self, ClientError> {
        self.meta_addr = resolver.resolve().await.map_err(ClientError::NoLeader)?;
        self.resolver = Some(resolver);
        Ok(self)
    }

    /// Sends blocks over QUIC, trusting daemons whose certificates `tls.ca`
    /// signed (and presenting `tls.identity` for mutual TLS). Fails, in
    /// one line naming the file, if a certificate or key does not load.
    pub fn with_quic(mut self, tls: &ClientTls) -> Result<Self, ClientError> {
        let connector =
            QuicConnector::new(tls).map_err(|err| ClientError::Invalid(err.to_string()))?;
        self.quic = Some(Arc::new(connector));
        Ok(self)
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// A connection pool to `addr` with the client's limits and token. A
/// client set up for QUIC reaches the meta service over QUIC too (UDP, at
/// the meta address), so that keys and tokens never travel in clear.
fn pool_for(cfg: &ClientConfig, addr: String, side: ErrorSource) -> ConnPool {
    let pool = ConnPool::new(addr, side, cfg.connect_timeout, cfg.max_idle_per_peer)
        .with_token(cfg.token.clone());
    match (&cfg.quic, side) {
        (Some(quic), ErrorSource::Meta) => pool.with_dialer(Dialer::Quic(quic.clone())),
        _ => pool,
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// What became of one block of a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    /// Another writer stored (or is storing) the same key: nothing to do.
    AlreadyExists,
    Failed(ErrorCode),
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
    shm_indexed: Arc<AtomicU64>,
    transports: TransportCounters,
    /// Reservations and commits of puts in flight at once, sent together.
    reservations: Coalescer<(BlockHash, u32), Slot, Vec<DaemonAddr>>,
    commits: Coalescer<CommitItem, ErrorCode, ()>,
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
    ) -> futures::future::BoxFuture<'a, Result<Vec<ErrorCode>, ClientError>> {
        Box::pin(std::future::ready(Err(ClientError::Invalid(
            self.why.clone(),
        ))))
    }
}

impl Client {
    /// A client that connects lazily; see [`Client::connect`].
    pub fn new(cfg: ClientConfig) -> Self {
        let cfg_locations = cfg.location_cache;
        let meta = RwLock::new(Arc::new(pool_for(
            &cfg,
            cfg.meta_addr.clone(),
            ErrorSource::Meta,
        )));
        Client {
            cfg,
            meta,
            daemons: RwLock::new(HashMap::new()),
            locations: LocationCache::new(cfg_locations),
            corrupt_reads: AtomicU64::new(0),
            shm: parking_lot::Mutex::new((None, None)),
            shm_indexed: Arc::new(AtomicU64::new(0)),
            transports: TransportCounters::default(),
            reservations: Coalescer::default(),
            commits: Coalescer::default(),
            leader_revision: AtomicU64::new(0),
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
        self.shm_indexed.load(Ordering::Relaxed)
    }

    /// Blocks stored through the same-host shared pool.
    pub fn shm_writes(&self) -> u64 {
        self.transports.writes(TransportKind::Shm)
    }

    /// The same-host link to the daemon at `addr`, if configured and up;
    /// (re)connects at most once a second.
    /// A link that cannot be made counts a fallback to `instead`.
    fn shm_link(&self, addr: &str, instead: TransportKind) -> Option<Arc<ShmLink>> {
        self.shm_connect(Some(instead)).filter(|l| l.addr == addr)
    }

    /// Makes the same-host link and waits (at most `within`) until this
    /// process's view of the daemon's pool is in place, so that the first
    /// reads do not share a core with setting it up (a few seconds for a
    /// large pool of 4 KiB pages). `false` without a link, or if time ran
    /// out. For a worker's warm-up; calls work without it.
    pub async fn same_host_ready(&self, within: std::time::Duration) -> bool {
        let Some(link) = self.shm_connect(None) else {
            return false;
        };
        let deadline = std::time::Instant::now() + within;
        while !link.populated() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        true
    }

    /// The same-host link, made if need be (at most once a second); a
    /// failure counts a fallback to `instead`, if given.
    fn shm_connect(&self, instead: Option<TransportKind>) -> Option<Arc<ShmLink>> {
        let path = self.cfg.shm_socket.as_ref()?;
        let mut shm = self.shm.lock();
        if shm.0.is_none() && shm.1.is_none_or(|t| t.elapsed() > SHM_RETRY) {
            shm.1 = Some(std::time::Instant::now());
            match ShmLink::connect(path, self.shm_indexed.clone(), self.cfg.copy_threads) {
                Ok(link) => shm.0 = Some(Arc::new(link)),
                Err(err) => {
                    drop(shm);
                    if let Some(instead) = instead {
                        tracing::warn!(%err, path = %path.display(), "no shared-memory link; going over {instead}");
                        self.fell_back(TransportKind::Shm, instead);
                    }
                    return None;
                }
            }
        }
        shm.0.clone()
    }

    /// Blocks whose bytes failed their checksum on read (each was a miss).
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads.load(Ordering::Relaxed)
    }

    /// Checks the meta service answers; returns its election revision.
    pub async fn ping(&self) -> Result<u64, ClientError> {
        let r: Revision = self.meta_call(Opcode::Ping, &Empty, "ping").await?;
        Ok(r.revision)
    }

    /// Stores blocks; each becomes visible to every client once this
    /// returns `Stored` for it.
    pub async fn put(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        self.put_with_parents(namespace, blocks, &vec![None; blocks.len()])
            .await
    }

    /// Stores consecutive blocks of one chain: `blocks[0]` extends
    /// `parent` (`None`: it starts the chain), each next block extends the
    /// one before. Daemons then evict a chain from its tail, keeping the
    /// prefixes later requests match (see `docs/ARCHITECTURE.md`).
    pub async fn put_chain(
        &self,
        namespace: &Namespace,
        parent: Option<BlockHash>,
        blocks: &[(BlockHash, &[u8])],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let parents: Vec<Option<BlockHash>> = std::iter::once(parent)
            .chain(blocks.iter().map(|(h, _)| Some(*h)))
            .take(blocks.len())
            .collect();
        self.put_with_parents(namespace, blocks, &parents).await
    }

    async fn put_with_parents(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
        parents: &[Option<BlockHash>],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let started = std::time::Instant::now();
        let mut out = Vec::with_capacity(blocks.len());
        for (chunk, parents) in blocks.chunks(MAX_BATCH).zip(parents.chunks(MAX_BATCH)) {
            out.extend(
                self.deadline("put", self.put_chunk(namespace, chunk, parents))
                    .await?,
            );
        }
        if let Some(m) = &self.cfg.metrics {
            let sizes = blocks.iter().map(|(_, v)| v.len());
            m.puts(started.elapsed().as_secs_f64(), &out, sizes);
        }
        Ok(out)
    }

    /// Stores one block.
    pub async fn put_one(&self, key: &BlockKey, value: &[u8]) -> Result<PutOutcome, ClientError> {
        let out = self.put(&key.namespace, &[(key.hash, value)]).await?;
        Ok(out[0])
    }

    async fn put_chunk(
        &self,
        namespace: &Namespace,
        blocks: &[(BlockHash, &[u8])],
        parents: &[Option<BlockHash>],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let mut items = Vec::with_capacity(blocks.len());
        for (hash, value) in blocks {
            let size = u32::try_from(value.len())
                .map_err(|_| ClientError::Invalid(format!("block {hash} is over 4 GiB")))?;
            items.push((*hash, size));
        }
        let (slots, daemons) = self
            .reservations
            .call(namespace.clone(), items, |namespace, items| async move {
                let start: PutStartResponse = self
                    .meta_call(
                        Opcode::PutStart,
                        &PutStartRequest {
                            namespace,
                            node: self.cfg.node.clone(),
                            items,
                        },
                        "put_start",
                    )
                    .await?;
                Ok((start.slots, start.daemons))
            })
            .await?;
        self.learn_daemons(&daemons);

        let mut outcomes = vec![PutOutcome::Failed(ErrorCode::Internal); blocks.len()];
        let mut by_daemon: HashMap<u32, Vec<PutItem<'_>>> = HashMap::new();
        for (index, (slot, (hash, value))) in slots.iter().zip(blocks).enumerate() {
            match slot {
                Slot::Place(daemon) => by_daemon.entry(*daemon).or_default().push(PutItem {
                    index,
                    hash: *hash,
                    value,
                    checksum: checksum(value),
                    parent: parents[index],
                }),
                Slot::Skip(ErrorCode::AlreadyExists) => outcomes[index] = PutOutcome::AlreadyExists,
                Slot::Skip(code) => outcomes[index] = PutOutcome::Failed(*code),
            }
        }

        let writes = by_daemon.into_iter().map(|(daemon, items)| async move {
            let result = self.put_on_daemon(daemon, namespace, &items).await;
            (daemon, items, result)
        });
        let mut commits = Vec::new();
        for (daemon, items, result) in join_all(writes).await {
            let codes = match result {
                Ok(codes) => codes,
                Err(err) => {
                    tracing::warn!(daemon, %err, "put to daemon failed");
                    vec![err.code().unwrap_or(ErrorCode::Unavailable); items.len()]
                }
            };
            for (item, code) in items.iter().zip(codes) {
                // A daemon that already holds the key has complete, verified
                // bytes for it: committing makes them visible.
                let stored = matches!(code, ErrorCode::Ok | ErrorCode::AlreadyExists);
                outcomes[item.index] = if stored {
                    PutOutcome::Stored
                } else {
                    PutOutcome::Failed(code)
                };
                commits.push(CommitItem {
                    hash: item.hash,
                    daemon,
                    size: item.value.len() as u32,
                    checksum: item.checksum,
                    stored,
                });
            }
        }
        if commits.is_empty() {
            return Ok(outcomes);
        }
        let (codes, ()) = self
            .commits
            .call(
                namespace.clone(),
                commits.clone(),
                |namespace, items| async move {
                    let statuses: Statuses = self
                        .meta_call(
                            Opcode::PutCommit,
                            &PutCommitRequest { namespace, items },
                            "put_commit",
                        )
                        .await?;
                    Ok((statuses.codes, ()))
                },
            )
            .await?;
        for (item, code) in commits.iter().zip(codes) {
            if !item.stored {
                continue;
            }
            if code == ErrorCode::Ok {
                let location = Location {
                    daemon: item.daemon,
                    size: item.size,
                    checksum: item.checksum,
                };
                self.locations
                    .insert(BlockKey::new(namespace.clone(), item.hash), location);
            } else {
                let index = blocks
                    .iter()
                    .position(|(h, _)| *h == item.hash)
                    .expect("hash of this batch");
                outcomes[index] = PutOutcome::Failed(code);
            }
        }
        Ok(outcomes)
    }

    async fn put_on_daemon(
        &self,
        daemon: u32,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let peer = self.peer(daemon)?;
        if let Some(link) = self.shm_link(&peer.addr, peer.data.kind()) {
            match link.put(namespace, items).await {
                Ok(codes) => {
                    self.transports.wrote(TransportKind::Shm, stored(&codes));
                    return Ok(codes);
                }
                Err(err) => self.shm_lost(&err, peer.data.kind()),
            }
        }
        if let Some(rdma) = &peer.rdma {
            match rdma.put(namespace, items).await {
                Ok(codes) => {
                    self.transports.wrote(TransportKind::Rdma, stored(&codes));
                    return Ok(codes);
                }
                Err(err) => self.rdma_failed(&err, peer.data.kind()),
            }
        }
        let codes = peer.data.put(namespace, items).await?;
        self.transports.wrote(peer.data.kind(), stored(&codes));
        Ok(codes)
    }

    /// Reads blocks straight into the caller's buffers, one per hash. Every
    /// hit has been verified against the writer's checksum.
    pub async fn get_into(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        if hashes.len() != bufs.len() {
            return Err(ClientError::Invalid(format!(
                "{} hashes but {} buffers",
                hashes.len(),
                bufs.len()
            )));
        }
        let started = std::time::Instant::now();
        let mut out = Vec::with_capacity(hashes.len());
        for (hs, bs) in hashes.chunks(MAX_BATCH).zip(bufs.chunks_mut(MAX_BATCH)) {
            out.extend(
                self.deadline("get", self.get_chunk(namespace, hs, bs))
                    .await?,
            );
        }
        if let Some(m) = &self.cfg.metrics {
            m.gets(started.elapsed().as_secs_f64(), &out);
        }
        Ok(out)
    }

    /// Reads one block into a new buffer; `None` on a miss.
    pub async fn get(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, ClientError> {
        // The buffer is sized from the location; a cached one may describe
        // a block since replaced by a larger one: then ask the index again.
        for cached in [true, false] {
            let location = match self.locations.get(key).filter(|_| cached) {
                Some(loc) => loc,
                None => match self
                    .lookup(&key.namespace, &[key.hash])
                    .await?
                    .items
                    .first()
                {
                    Some(Some(loc)) => *loc,
                    _ => return Ok(None),
                },
            };
            let mut buf = vec![0u8; location.size as usize];
            match self
                .get_into(&key.namespace, &[key.hash], &mut [&mut buf[..]])
                .await?[0]
            {
                GetOutcome::Hit(n) => {
                    buf.truncate(n);
                    return Ok(Some(buf));
                }
                GetOutcome::Miss => return Ok(None),
                GetOutcome::Failed(ErrorCode::TooLarge) if cached => {
                    self.locations.forget(key);
                }
                GetOutcome::Failed(code) => {
                    let addr = self.peer(location.daemon).map(|p| p.addr.clone());
                    return Err(ClientError::Server {
                        side: ErrorSource::Daemon,
                        addr: addr.unwrap_or_default(),
                        op: "get",
                        code,
                    });
                }
            }
        }
        unreachable!("the second pass returns")
    }

    async fn get_chunk(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        let mut locations: Vec<Option<Location>> = hashes
            .iter()
            .map(|h| self.locations.get(&BlockKey::new(namespace.clone(), *h)))
            .collect();
        let from_cache: Vec<bool> = locations.iter().map(Option::is_some).collect();
        let unknown: Vec<usize> = (0..hashes.len()).filter(|i| !from_cache[*i]).collect();
        self.locate(namespace, hashes, &unknown, &mut locations)
            .await?;

        let mut outcomes = vec![GetOutcome::Miss; hashes.len()];
        let first = self
            .read_located(namespace, hashes, &locations, bufs, |_| true)
            .await;
        // A hint from the cache that the daemon no longer backs is asked
        // about once more, at the meta service.
        let mut retry = Vec::new();
        for (index, read) in first {
            match read {
                // An unreachable daemon too: the block may live elsewhere
                // now, or nowhere (a miss).
                Read::Stale
                | Read::Missing
                | Read::Failed(ErrorCode::Unavailable | ErrorCode::Timeout)
                    if from_cache[index] =>
                {
                    self.locations
                        .forget(&BlockKey::new(namespace.clone(), hashes[index]));
                    retry.push(index);
                }
                other => outcomes[index] = other.outcome(),
            }
        }
        if !retry.is_empty() {
            self.locate(namespace, hashes, &retry, &mut locations)
                .await?;
            let again = self
                .read_located(namespace, hashes, &locations, bufs, |i| retry.contains(&i))
                .await;
            for (index, read) in again {
                outcomes[index] = read.outcome();
            }
        }
        Ok(outcomes)
    }

    /// Fills `locations[i]` for each index in `which` with one meta lookup.
    async fn locate(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        which: &[usize],
        locations: &mut [Option<Location>],
    ) -> Result<(), ClientError> {
        if which.is_empty() {
            return Ok(());
        }
        let wanted: Vec<BlockHash> = which.iter().map(|i| hashes[*i]).collect();
        let found = self.lookup_raw(namespace, &wanted).await?;
        if found.items.len() != wanted.len() {
            return Err(self.meta_protocol("lookup answered a different number of items"));
        }
        self.learn_daemons(&found.daemons);
        for (index, loc) in which.iter().zip(found.items) {
            if let Some(loc) = loc {
                self.locations
                    .insert(BlockKey::new(namespace.clone(), hashes[*index]), loc);
            }
            locations[*index] = loc;
        }
        Ok(())
    }

    /// Reads every selected block that has a location, from all its daemons
    /// in parallel; returns what each read found.
    async fn read_located(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        locations: &[Option<Location>],
        bufs: &mut [&mut [u8]],
        selected: impl Fn(usize) -> bool,
    ) -> Vec<(usize, Read)> {
        let mut results = Vec::new();
        let mut by_daemon: HashMap<u32, Vec<GetItem<'_>>> = HashMap::new();
        for (index, buf) in bufs.iter_mut().enumerate() {
            if !selected(index) {
                continue;
            }
            let Some(location) = locations[index] else {
                results.push((index, Read::Missing));
                continue;
            };
            if (location.size as usize) > buf.len() {
                results.push((index, Read::Failed(ErrorCode::TooLarge)));
                continue;
            }
            by_daemon.entry(location.daemon).or_default().push(GetItem {
                index,
                hash: hashes[index],
                location,
                buf,
            });
        }
        let reads = by_daemon.into_iter().map(|(daemon, mut items)| async move {
            let result = self.get_on_daemon(daemon, namespace, &mut items).await;
            let indexes: Vec<usize> = items.iter().map(|it| it.index).collect();
            (indexes, result)
        });
        for (indexes, result) in join_all(reads).await {
            match result {
                Ok(got) => results.extend(indexes.into_iter().zip(got)),
                Err(err) => {
                    tracing::warn!(%err, "get from daemon failed");
                    let code = err.code().unwrap_or(ErrorCode::Unavailable);
                    results.extend(indexes.into_iter().map(|i| (i, Read::Failed(code))));
                }
            }
        }
        results
    }

    async fn get_on_daemon(
        &self,
        daemon: u32,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> Result<Vec<Read>, ClientError> {
        let peer = self.peer(daemon)?;
        let mut reads = None;
        if let Some(link) = self.shm_link(&peer.addr, peer.data.kind()) {
            match link.get(namespace, items).await {
                Ok(got) => {
                    self.transports.read(TransportKind::Shm, hits(&got));
                    reads = Some(got);
                }
                Err(err) => self.shm_lost(&err, peer.data.kind()),
            }
        }
        if let (None, Some(rdma)) = (&reads, &peer.rdma) {
            match rdma.get(namespace, items).await {
                Ok(got) => {
                    self.transports.read(TransportKind::Rdma, hits(&got));
                    reads = Some(got);
                }
                Err(err) => self.rdma_failed(&err, peer.data.kind()),
            }
        }
        let reads = match reads {
            // Blocks not in the daemon's DRAM (on NVMe) come over the network.
            Some(mut reads) => {
                let rest: Vec<usize> = (0..reads.len())
                    .filter(|i| matches!(reads[*i], Read::Missing))
                    .collect();
                if !rest.is_empty() {
                    let mut again: Vec<GetItem<'_>> = items
                        .iter_mut()
                        .enumerate()
                        .filter(|(i, _)| rest.contains(i))
                        .map(|(_, it)| GetItem {
                            index: it.index,
                            hash: it.hash,
                            location: it.location,
                            buf: &mut *it.buf,
                        })
                        .collect();
                    let got = peer.data.get(namespace, &mut again).await?;
                    self.transports.read(peer.data.kind(), hits(&got));
                    for (i, read) in rest.into_iter().zip(got) {
                        reads[i] = read;
                    }
                }
                reads
            }
            None => {
                let got = peer.data.get(namespace, items).await?;
                self.transports.read(peer.data.kind(), hits(&got));
                got
            }
        };
        for (item, read) in items.iter().zip(&reads) {
            if matches!(read, Read::Corrupt) {
                self.report_corrupt(&peer.tcp, BlockKey::new(namespace.clone(), item.hash));
            }
        }
        Ok(reads)
    }

    /// The same-host link failed: drop it (it is tried again a second
    /// later) and go over the network meanwhile.
    fn shm_lost(&self, err: &ClientError, to: TransportKind) {
        tracing::warn!(%err, "shared-memory link lost; going over {to}");
        *self.shm.lock() = (None, Some(std::time::Instant::now()));
        self.fell_back(TransportKind::Shm, to);
    }

    /// An RDMA call failed: this one goes over the network path instead
    /// (the link itself waits a second before trying RDMA again).
    fn rdma_failed(&self, err: &ClientError, to: TransportKind) {
        tracing::warn!(%err, "RDMA call failed; going over {to}");
        self.fell_back(TransportKind::Rdma, to);
    }

    /// Counts a fallback from `from` to `to`.
    fn fell_back(&self, from: TransportKind, to: TransportKind) {
        self.transports.fell_back(from, to);
        if let Some(m) = &self.cfg.metrics {
            m.fell_back(from, to);
        }
    }

    /// Bytes that failed their checksum: counted, logged, and reported to
    /// the daemon, which checks its copy and drops it if it is the culprit.
    fn report_corrupt(&self, pool: &Arc<ConnPool>, key: BlockKey) {
        self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        if let Some(m) = &self.cfg.metrics {
            m.corrupt.inc();
        }
        tracing::warn!(%key, daemon = pool.addr(), "block failed its checksum on read; treated as a miss");
        let pool = pool.clone();
        let timeout = self.cfg.timeout;
        tokio::spawn(async move {
            let verify = async {
                let (mut conn, _) = pool.get().await?;
                let result = conn
                    .call::<Empty>(Opcode::Verify, &KeyRequest { key }, "verify")
                    .await;
                if matches!(result, Ok(_) | Err(ClientError::Server { .. })) {
                    pool.put_back(conn);
                }
                result
            };
            let _ = tokio::time::timeout(timeout, verify).await;
        });
    }

    /// How many leading keys of a chain are stored, in one round trip.
    pub async fn match_prefix(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<PrefixMatch, ClientError> {
        let started = std::time::Instant::now();
        let mut out = PrefixMatch::default();
        for chunk in hashes.chunks(MAX_BATCH) {
            let locs: Locations = self
                .meta_call(
                    Opcode::MatchPrefix,
                    &KeysRequest {
                        namespace: namespace.clone(),
                        hashes: chunk.to_vec(),
                    },
                    "match_prefix",
                )
                .await?;
            self.learn_daemons(&locs.daemons);
            self.remember(namespace, chunk, &locs.items);
            let matched = locs.items.iter().take_while(|l| l.is_some()).count();
            out.matched += matched;
            out.locations
                .extend(locs.items.into_iter().flatten().take(matched));
            out.daemons.extend(locs.daemons);
            if matched < chunk.len() {
                break;
            }
        }
        if let Some(m) = &self.cfg.metrics {
            m.matched(started.elapsed().as_secs_f64());
        }
        Ok(out)
    }

    /// Whether each key is stored and visible.
    pub async fn exists(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<bool>, ClientError> {
        let locs = self.lookup(namespace, hashes).await?;
        Ok(locs.items.iter().map(Option::is_some).collect())
    }

    /// Locations of each key (`None`: not stored).
    pub async fn lookup(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Locations, ClientError> {
        let mut out = Locations::default();
        for chunk in hashes.chunks(MAX_BATCH) {
            let locs = self.lookup_raw(namespace, chunk).await?;
            self.learn_daemons(&locs.daemons);
            self.remember(namespace, chunk, &locs.items);
            out.items.extend(locs.items);
            out.daemons.extend(locs.daemons);
        }
        Ok(out)
    }

    async fn lookup_raw(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Locations, ClientError> {
        self.meta_call(
            Opcode::Lookup,
            &KeysRequest {
                namespace: namespace.clone(),
                hashes: hashes.to_vec(),
            },
            "lookup",
        )
        .await
    }

    /// Removes keys everywhere: a status per key, `Ok` once the daemon that
    /// held it dropped its bytes, `NotFound` if it was not stored, else why
    /// the removal is not confirmed (`Timeout`, `Unavailable`: the key is
    /// gone from the index and its daemon is told again when it answers).
    pub async fn remove(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let mut out = Vec::with_capacity(hashes.len());
        for chunk in hashes.chunks(MAX_BATCH) {
            let st: Statuses = self
                .meta_call(
                    Opcode::MetaRemove,
                    &KeysRequest {
                        namespace: namespace.clone(),
                        hashes: chunk.to_vec(),
                    },
                    "remove",
                )
                .await?;
            for hash in chunk {
                self.locations
                    .forget(&BlockKey::new(namespace.clone(), *hash));
            }
            out.extend(st.codes);
        }
        Ok(out)
    }

    /// Pins keys against eviction (or unpins them); a status per key.
    pub async fn pin(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        pin: bool,
    ) -> Result<Vec<ErrorCode>, ClientError> {
        let mut out = Vec::with_capacity(hashes.len());
        for chunk in hashes.chunks(MAX_BATCH) {
            let st: Statuses = self
                .meta_call(
                    Opcode::MetaPin,
                    &PinRequest {
                        keys: KeysRequest {
                            namespace: namespace.clone(),
                            hashes: chunk.to_vec(),
                        },
                        pin,
                    },
                    "pin",
                )
                .await?;
            out.extend(st.codes);
        }
        Ok(out)
    }

    /// Stops (or resumes) placing new blocks on a daemon.
    pub async fn drain(&self, daemon: u32, drain: bool) -> Result<(), ClientError> {
        let req = mooncake_proto::message::DrainRequest { daemon, drain };
        self.meta_call::<Empty>(Opcode::Drain, &req, "drain")
            .await?;
        Ok(())
    }

    /// The cluster at a glance: daemons, capacity, use, block count.
    pub async fn cluster_stats(&self) -> Result<ClusterStats, ClientError> {
        self.meta_call(Opcode::ClusterStat, &Empty, "stat").await
    }

    /// One page of the index.
    pub async fn list(&self, req: &ListRequest) -> Result<ListResponse, ClientError> {
        self.meta_call(Opcode::List, req, "list").await
    }

    fn remember(&self, namespace: &Namespace, hashes: &[BlockHash], items: &[Option<Location>]) {
        self.locations
            .insert_batch(namespace, hashes.iter().zip(items));
    }

    async fn meta_call<Resp: Body>(
        &self,
        op: Opcode,
        req: &impl Body,
        name: &'static str,
    ) -> Result<Resp, ClientError> {
        self.deadline(name, async {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let pool = self.meta.read().clone();
                let result = match self.meta_conn(&pool).await {
                    Ok((mut conn, reused)) => match conn.call(op, req, name).await {
                        Ok(resp) => {
                            pool.put_back(conn);
                            return Ok(resp);
                        }
                        Err(err @ ClientError::Server { .. }) => {
                            pool.put_back(conn);
                            return Err(err);
                        }
                        Err(ClientError::Io { .. }) if reused && attempt == 1 => continue,
                        Err(err) => err,
                    },
                    Err(err) => err,
                };
                // The meta service is unreachable: with a resolver, find
                // the (new) leader and try again until the deadline.
                if !matches!(
                    result,
                    ClientError::Io { .. }
                        | ClientError::Timeout { .. }
                        | ClientError::Stale { .. }
                ) || !self.follow_leader(&pool).await
                {
                    return Err(result);
                }
            }
        })
        .await
    }

    /// A connection to the meta service. A new one is first asked for its
    /// election revision: a leader older than one this client has already
    /// seen is stale (it lost its lead and has not noticed), and refused.
    async fn meta_conn(&self, pool: &ConnPool) -> Result<(Connection, bool), ClientError> {
        let (mut conn, reused) = pool.get().await?;
        if reused {
            return Ok((conn, true));
        }
        let r: Revision = conn.call(Opcode::Ping, &Empty, "ping").await?;
        let seen = self
            .leader_revision
            .fetch_max(r.revision, Ordering::Relaxed);
        if r.revision < seen {
            return Err(ClientError::Stale {
                addr: pool.addr().to_string(),
                revision: r.revision,
                seen,
            });
        }
        Ok((conn, false))
    }

    /// Points the client at the leader the resolver names; `false` when
    /// there is no resolver (a fixed meta address).
    async fn follow_leader(&self, failed: &Arc<ConnPool>) -> bool {
        let Some(resolver) = &self.cfg.resolver else {
            return false;
        };
        match resolver.resolve().await {
            Ok(addr) if addr != failed.addr() => {
                tracing::info!(leader = %addr, "following the new meta leader");
                *self.meta.write() = Arc::new(pool_for(&self.cfg, addr, ErrorSource::Meta));
            }
            Ok(_) => {
                failed.clear();
                tokio::time::sleep(LEADER_RETRY_PAUSE).await;
            }
            Err(why) => {
                tracing::debug!(%why, "no meta leader yet");
                tokio::time::sleep(LEADER_RETRY_PAUSE).await;
            }
        }
        true
    }

    async fn deadline<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        match tokio::time::timeout(self.cfg.timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Timeout {
                side: ErrorSource::Meta,
                addr: self.cfg.meta_addr.clone(),
                op,
                timeout_ms: self.cfg.timeout.as_millis() as u64,
            }),
        }
    }

    fn learn_daemons(&self, daemons: &[DaemonAddr]) {
        if daemons.is_empty() {
            return;
        }
        {
            let known = self.daemons.read();
            if daemons
                .iter()
                .all(|d| known.get(&d.id).is_some_and(|p| p.advertised == *d))
            {
                return;
            }
        }
        let mut known = self.daemons.write();
        for d in daemons {
            if known.get(&d.id).is_none_or(|p| p.advertised != *d) {
                known.insert(d.id, Arc::new(self.reach(d)));
            }
        }
    }

    /// Chooses how to reach a daemon from what it advertised and what this
    /// client is configured for: RDMA if asked and both sides have it, then
    /// QUIC if configured (never plain TCP instead: a client that asks for
    /// QUIC does not trust the network), else TCP. Same-host shared memory
    /// comes before all of them, per call (see `shm_link`).
    fn reach(&self, d: &DaemonAddr) -> Peer {
        let tcp = Arc::new(pool_for(&self.cfg, d.addr.clone(), ErrorSource::Daemon));
        let offered = |kind| d.endpoints.iter().find(|e| e.kind == kind);
        let data: Arc<dyn Transport> = match (&self.cfg.quic, offered(TransportKind::Quic)) {
            (Some(quic), Some(endpoint)) => Arc::new(StreamTransport {
                pool: Arc::new(
                    pool_for(&self.cfg, endpoint.addr.clone(), ErrorSource::Daemon)
                        .with_dialer(Dialer::Quic(quic.clone())),
                ),
                stripes: self.cfg.stripes,
            }),
            (Some(_), None) => Arc::new(Unreachable {
                kind: TransportKind::Quic,
                why: format!(
                    "daemon {} at {} serves no QUIC endpoint, and this client sends blocks only over QUIC",
                    d.id, d.addr
                ),
            }),
            (None, _) => Arc::new(StreamTransport {
                pool: tcp.clone(),
                stripes: self.cfg.stripes,
            }),
        };
        let rdma = if self.cfg.rdma {
            let link = match offered(TransportKind::Rdma) {
                Some(endpoint) => self.rdma_link(&endpoint.addr, &d.addr),
                None => Err("the daemon offers no RDMA endpoint".to_string()),
            };
            link.inspect_err(|why| {
                tracing::debug!(daemon = d.id, why, to = %data.kind(), "RDMA not used");
                self.fell_back(TransportKind::Rdma, data.kind());
            })
            .ok()
        } else {
            None
        };
        Peer {
            advertised: d.clone(),
            addr: d.addr.clone(),
            tcp,
            data,
            rdma,
        }
    }

    /// This host's RDMA NIC, opened on first use.
    #[cfg(feature = "rdma")]
    fn nic(&self) -> Result<Arc<mooncake_net::rdma::Nic>, String> {
        use mooncake_net::rdma::{Nic, NicChoice};
        self.nic
            .get_or_init(|| {
                Nic::open(&NicChoice {
                    device: self.cfg.rdma_device.clone(),
                    gid_index: self.cfg.rdma_gid_index,
                })
                .inspect(|nic| tracing::info!(nic = %nic.name, "RDMA ready"))
                .inspect_err(|why| {
                    tracing::warn!(why, "RDMA unavailable; blocks go over QUIC or TCP")
                })
            })
            .clone()
    }

    /// Registers `len` bytes at `ptr` with this host's RDMA NIC, once, so
    /// that blocks read into them (`get_into`) or written from them (`put`)
    /// move by RDMA straight between them and a daemon's pool, with no
    /// copy here. True if registered; false where this client moves
    /// blocks otherwise (`rdma` not configured, no NIC, a build without
    /// the feature): the memory then works as any other, through copies.
    /// Host memory only: every block read is checked by this CPU where it
    /// lands, so GPU memory (GPUDirect) cannot be registered here; load
    /// into GPU memory through pinned host buffers.
    ///
    /// # Safety
    ///
    /// The bytes must stay allocated until `unregister_memory(ptr)` and
    /// until every call using them has returned.
    pub unsafe fn register_memory(&self, ptr: *mut u8, len: usize) -> Result<bool, ClientError> {
        #[cfg(feature = "rdma")]
        if self.cfg.rdma {
            let Ok(nic) = self.nic() else {
                return Ok(false);
            };
            // SAFETY: the caller's promise above.
            unsafe { self.registered.add(&nic, ptr, len) }.map_err(ClientError::Invalid)?;
            return Ok(true);
        }
        let _ = (ptr, len);
        Ok(false)
    }

    /// Ends a registration made with `register_memory`; false if `ptr`
    /// had none.
    pub fn unregister_memory(&self, ptr: *const u8) -> bool {
        #[cfg(feature = "rdma")]
        return self.registered.remove(ptr);
        #[cfg(not(feature = "rdma"))]
        {
            let _ = ptr;
            false
        }
    }

    /// The RDMA data path to the daemon at `addr` whose RDMA control port
    /// is `control`, through this host's NIC (opened once).
    #[cfg(feature = "rdma")]
    fn rdma_link(&self, control: &str, addr: &str) -> Result<Arc<dyn Transport>, String> {
        Ok(Arc::new(crate::transport::rdma::RdmaLink::new(
            self.nic()?,
            control.to_string(),
            addr.to_string(),
            self.cfg.connect_timeout,
            self.registered.clone(),
        )))
    }

    #[cfg(not(feature = "rdma"))]
    fn rdma_link(&self, _: &str, _: &str) -> Result<Arc<dyn Transport>, String> {
        Err("this client is built without the `rdma` feature".to_string())
    }

    fn peer(&self, daemon: u32) -> Result<Arc<Peer>, ClientError> {
        self.daemons
            .read()
            .get(&daemon)
            .cloned()
            .ok_or_else(|| self.meta_protocol("a location named a daemon it did not list"))
    }

    /// Blocks moved per transport, and fallbacks between transports.
    pub fn transports(&self) -> &TransportCounters {
        &self.transports
    }

    fn meta_protocol(&self, why: &str) -> ClientError {
        ClientError::Protocol {
            side: ErrorSource::Meta,
            addr: self.cfg.meta_addr.clone(),
            err: mooncake_proto::ProtoError::Invalid {
                field: "response",
                why: why.to_string(),
            },
        }
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
