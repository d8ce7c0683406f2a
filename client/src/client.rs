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
    ListResponse, Location, Locations, PinRequest, PutCommitRequest, PutHead, PutStartRequest,
    PutStartResponse, Revision, Slot, Statuses, GET_HEAD_LEN,
};
use mooncake_proto::{checksum, BlockHash, BlockKey, ErrorCode, Namespace, Opcode};
use parking_lot::RwLock;

use crate::conn::Connection;
use crate::error::{ClientError, ErrorSource};
use crate::locations::LocationCache;
use crate::metrics::ClientMetrics;
use crate::pool::ConnPool;
use crate::shm::ShmLink;

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

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// A connection pool to `addr` with the client's limits and token.
fn pool_for(cfg: &ClientConfig, addr: String, side: ErrorSource) -> ConnPool {
    ConnPool::new(addr, side, cfg.connect_timeout, cfg.max_idle_per_peer)
        .with_token(cfg.token.clone())
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
    daemons: RwLock<HashMap<u32, Arc<ConnPool>>>,
    locations: LocationCache,
    corrupt_reads: AtomicU64,
    /// Highest meta election revision seen (fencing).
    leader_revision: AtomicU64,
    /// The same-host link, once made (and when it was last tried).
    shm: parking_lot::Mutex<(Option<Arc<ShmLink>>, Option<std::time::Instant>)>,
    shm_reads: AtomicU64,
    shm_writes: AtomicU64,
}

pub(crate) struct GetItem<'b> {
    pub index: usize,
    pub hash: BlockHash,
    pub location: Location,
    pub buf: &'b mut [u8],
}

pub(crate) struct PutItem<'v> {
    pub index: usize,
    pub hash: BlockHash,
    pub value: &'v [u8],
    pub checksum: u64,
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
            shm_reads: AtomicU64::new(0),
            shm_writes: AtomicU64::new(0),
            leader_revision: AtomicU64::new(0),
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
        self.shm_reads.load(Ordering::Relaxed)
    }

    /// Blocks stored through the same-host shared pool.
    pub fn shm_writes(&self) -> u64 {
        self.shm_writes.load(Ordering::Relaxed)
    }

    /// The same-host link to the daemon at `addr`, if configured and up;
    /// (re)connects at most once a second.
    fn shm_link(&self, addr: &str) -> Option<Arc<ShmLink>> {
        let path = self.cfg.shm_socket.as_ref()?;
        let mut shm = self.shm.lock();
        if shm.0.is_none() && shm.1.is_none_or(|t| t.elapsed() > SHM_RETRY) {
            shm.1 = Some(std::time::Instant::now());
            match ShmLink::connect(path) {
                Ok(link) => shm.0 = Some(Arc::new(link)),
                Err(err) => tracing::debug!(%err, path = %path.display(), "no shared-memory link"),
            }
        }
        shm.0.clone().filter(|l| l.addr == addr)
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
        let started = std::time::Instant::now();
        let mut out = Vec::with_capacity(blocks.len());
        for chunk in blocks.chunks(MAX_BATCH) {
            out.extend(
                self.deadline("put", self.put_chunk(namespace, chunk))
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
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let mut items = Vec::with_capacity(blocks.len());
        for (hash, value) in blocks {
            let size = u32::try_from(value.len())
                .map_err(|_| ClientError::Invalid(format!("block {hash} is over 4 GiB")))?;
            items.push((*hash, size));
        }
        let start: PutStartResponse = self
            .meta_call(
                Opcode::PutStart,
                &PutStartRequest {
                    namespace: namespace.clone(),
                    node: self.cfg.node.clone(),
                    items,
                },
                "put_start",
            )
            .await?;
        if start.slots.len() != blocks.len() {
            return Err(self.meta_protocol("put_start answered a different number of slots"));
        }
        self.learn_daemons(&start.daemons);

        let mut outcomes = vec![PutOutcome::Failed(ErrorCode::Internal); blocks.len()];
        let mut by_daemon: HashMap<u32, Vec<PutItem<'_>>> = HashMap::new();
        for (index, (slot, (hash, value))) in start.slots.iter().zip(blocks).enumerate() {
            match slot {
                Slot::Place(daemon) => by_daemon.entry(*daemon).or_default().push(PutItem {
                    index,
                    hash: *hash,
                    value,
                    checksum: checksum(value),
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
                    tracing::debug!(daemon, %err, "put to daemon failed");
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
        let request = PutCommitRequest {
            namespace: namespace.clone(),
            items: commits,
        };
        let statuses: Statuses = self
            .meta_call(Opcode::PutCommit, &request, "put_commit")
            .await?;
        for (item, code) in request.items.iter().zip(statuses.codes) {
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
        let pool = self.daemon_pool(daemon)?;
        if let Some(link) = self.shm_link(pool.addr()) {
            match link.put(namespace, items).await {
                Ok(codes) => {
                    self.shm_writes.fetch_add(
                        codes.iter().filter(|c| **c == ErrorCode::Ok).count() as u64,
                        Ordering::Relaxed,
                    );
                    return Ok(codes);
                }
                Err(err) => {
                    tracing::warn!(%err, "shared-memory link lost; writing over TCP");
                    *self.shm.lock() = (None, Some(std::time::Instant::now()));
                }
            }
        }
        let heads: Vec<Vec<u8>> = items
            .iter()
            .map(|it| {
                PutHead {
                    key: BlockKey::new(namespace.clone(), it.hash),
                    checksum: it.checksum,
                }
                .to_bytes()
            })
            .collect();
        for attempt in 0..2 {
            let (mut conn, reused) = pool.get().await?;
            let (writer, reader) = conn.split();
            let write = async {
                for (item, head) in items.iter().zip(&heads) {
                    writer.send(Opcode::Put, head, item.value).await?;
                }
                writer.flush().await
            };
            let read = async {
                let mut codes = Vec::with_capacity(items.len());
                for _ in items {
                    let header = reader.next_header(Opcode::Put).await?;
                    reader.discard(header.body_len as usize).await?;
                    codes.push(ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal));
                }
                Ok::<_, ClientError>(codes)
            };
            let (written, read) = tokio::join!(write, read);
            match (written, read) {
                (Ok(()), Ok(codes)) => {
                    pool.put_back(conn);
                    return Ok(codes);
                }
                (Err(err), _) if reused && attempt == 0 => {
                    tracing::trace!(%err, "stale pooled connection, retrying");
                }
                (_, Err(ClientError::Io { .. })) if reused && attempt == 0 => {}
                (Err(err), _) => {
                    return Err(ClientError::Io {
                        side: ErrorSource::Daemon,
                        addr: pool.addr().to_string(),
                        err,
                    })
                }
                (_, Err(err)) => return Err(err),
            }
        }
        Err(ClientError::Server {
            side: ErrorSource::Daemon,
            addr: pool.addr().to_string(),
            op: "put",
            code: ErrorCode::Unavailable,
        })
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
                    return Err(ClientError::Server {
                        side: ErrorSource::Daemon,
                        addr: String::new(),
                        op: "get",
                        code,
                    })
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
                    tracing::debug!(%err, "get from daemon failed");
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
        let pool = self.daemon_pool(daemon)?;
        if let Some(link) = self.shm_link(pool.addr()) {
            match link.get(namespace, items).await {
                Ok(mut reads) => {
                    self.shm_reads.fetch_add(
                        reads.iter().filter(|r| matches!(r, Read::Hit(_))).count() as u64,
                        Ordering::Relaxed,
                    );
                    for (item, read) in items.iter().zip(&reads) {
                        if matches!(read, Read::Corrupt) {
                            self.report_corrupt(&pool, BlockKey::new(namespace.clone(), item.hash));
                        }
                    }
                    // Blocks not in the daemon's DRAM (on NVMe) come over TCP.
                    let rest: Vec<usize> = (0..reads.len())
                        .filter(|i| matches!(reads[*i], Read::Missing))
                        .collect();
                    if rest.is_empty() {
                        return Ok(reads);
                    }
                    let mut tcp: Vec<GetItem<'_>> = items
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
                    let got = self.get_over_tcp(&pool, namespace, &mut tcp).await?;
                    for (i, read) in rest.into_iter().zip(got) {
                        reads[i] = read;
                    }
                    return Ok(reads);
                }
                Err(err) => {
                    tracing::warn!(%err, "shared-memory link lost; reading over TCP");
                    *self.shm.lock() = (None, Some(std::time::Instant::now()));
                }
            }
        }
        self.get_over_tcp(&pool, namespace, items).await
    }

    async fn get_over_tcp(
        &self,
        pool: &Arc<ConnPool>,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> Result<Vec<Read>, ClientError> {
        let requests: Vec<Vec<u8>> = items
            .iter()
            .map(|it| {
                KeyRequest {
                    key: BlockKey::new(namespace.clone(), it.hash),
                }
                .to_bytes()
            })
            .collect();
        for attempt in 0..2 {
            let (mut conn, reused) = pool.get().await?;
            let (writer, reader) = conn.split();
            let write = async {
                for req in &requests {
                    writer.send(Opcode::Get, req, &[]).await?;
                }
                writer.flush().await
            };
            let read = async {
                let mut got = Vec::with_capacity(items.len());
                for item in items.iter_mut() {
                    got.push(read_one_get(reader, item).await?);
                }
                Ok::<_, ClientError>(got)
            };
            let (written, read) = tokio::join!(write, read);
            match (written, read) {
                (Ok(()), Ok(got)) => {
                    pool.put_back(conn);
                    for (item, read) in items.iter().zip(&got) {
                        if matches!(read, Read::Corrupt) {
                            self.report_corrupt(pool, BlockKey::new(namespace.clone(), item.hash));
                        }
                    }
                    return Ok(got);
                }
                (Err(_), _) | (_, Err(ClientError::Io { .. })) if reused && attempt == 0 => {}
                (Err(err), _) => {
                    return Err(ClientError::Io {
                        side: ErrorSource::Daemon,
                        addr: pool.addr().to_string(),
                        err,
                    })
                }
                (_, Err(err)) => return Err(err),
            }
        }
        Err(ClientError::Server {
            side: ErrorSource::Daemon,
            addr: pool.addr().to_string(),
            op: "get",
            code: ErrorCode::Unavailable,
        })
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

    /// Removes keys everywhere; `true` for each key that was stored.
    pub async fn remove(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<Vec<bool>, ClientError> {
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
            out.extend(st.codes.iter().map(|c| *c == ErrorCode::Ok));
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
        for (hash, loc) in hashes.iter().zip(items) {
            if let Some(loc) = loc {
                self.locations
                    .insert(BlockKey::new(namespace.clone(), *hash), *loc);
            }
        }
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
                .all(|d| known.get(&d.id).is_some_and(|p| p.addr() == d.addr))
            {
                return;
            }
        }
        let mut known = self.daemons.write();
        for d in daemons {
            if known.get(&d.id).is_none_or(|p| p.addr() != d.addr) {
                known.insert(
                    d.id,
                    Arc::new(pool_for(&self.cfg, d.addr.clone(), ErrorSource::Daemon)),
                );
            }
        }
    }

    fn daemon_pool(&self, daemon: u32) -> Result<Arc<ConnPool>, ClientError> {
        self.daemons
            .read()
            .get(&daemon)
            .cloned()
            .ok_or_else(|| self.meta_protocol("a location named a daemon it did not list"))
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

/// What one read found, before it is told to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
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
    fn outcome(self) -> GetOutcome {
        match self {
            Read::Hit(n) => GetOutcome::Hit(n),
            Read::Missing | Read::Stale | Read::Corrupt => GetOutcome::Miss,
            Read::Failed(code) => GetOutcome::Failed(code),
        }
    }
}

/// Reads one `Get` response into the item's buffer and verifies it: the
/// bytes against the checksum the daemon sent, and that checksum against
/// the one the location carries (the writer's).
async fn read_one_get(
    reader: &mut crate::conn::FrameReader,
    item: &mut GetItem<'_>,
) -> Result<Read, ClientError> {
    let header = reader.next_header(Opcode::Get).await?;
    let len = header.body_len as usize;
    let status = ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal);
    if status != ErrorCode::Ok {
        reader.discard(len).await?;
        return Ok(match status {
            ErrorCode::NotFound => Read::Missing,
            ErrorCode::Corrupt => Read::Corrupt,
            other => Read::Failed(other),
        });
    }
    if len < GET_HEAD_LEN {
        return Err(reader.protocol("get response shorter than its head"));
    }
    let mut head = [0u8; GET_HEAD_LEN];
    reader.read_into(&mut head).await?;
    let sent_checksum = u64::from_le_bytes(head);
    let value_len = len - GET_HEAD_LEN;
    if value_len > item.buf.len() {
        reader.discard(value_len).await?;
        return Ok(Read::Failed(ErrorCode::TooLarge));
    }
    let dst = &mut item.buf[..value_len];
    reader.read_into(dst).await?;
    if checksum(dst) != sent_checksum {
        return Ok(Read::Corrupt);
    }
    if sent_checksum != item.location.checksum || value_len != item.location.size as usize {
        return Ok(Read::Stale);
    }
    Ok(Read::Hit(value_len))
}
