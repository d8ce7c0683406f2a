//! The storage daemon: one per GPU host. It owns a DRAM pool allocated once
//! at start and carved by an offset allocator, keeps an index of the blocks
//! in it with LRU eviction between two watermarks, verifies every block's
//! checksum, serves block reads and writes over TCP, and reports to the meta
//! service what it drops on its own.
//!
//! Built on `mooncake-server` (the skeleton both servers share) and
//! `mooncake-net` (its link to the meta service); never on the client SDK
//! nor on the meta service's crate.

mod admit;
pub mod config;
mod fetch;
mod headroom;
pub mod hot;
pub mod io;
mod leases;
mod memory;
mod meta_link;
pub mod metrics;
pub mod nvme;
pub mod pool;
pub mod quota;
#[cfg(feature = "rdma")]
mod rdma;
mod region;
mod server;
mod shm;
pub mod tiers;

use std::net::SocketAddr;
use std::sync::Arc;

use mooncake_coord::{Coordinator, MemberKind};
use mooncake_proto::transport::{Endpoint, TransportKind};
use mooncake_server::Server;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::DaemonConfig;
pub use pool::{DramPool, PoolError};

/// Why a daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("invalid config: {0}")]
    Config(String),
    #[error("cannot allocate the DRAM pool of {size} bytes: {err}")]
    Pool { size: u64, err: std::io::Error },
    #[error("{0}")]
    Memory(String),
    #[error("cannot read the listener's address: {0}")]
    Listener(std::io::Error),
    #[error("coordinator: {0}")]
    Coordinator(#[from] mooncake_coord::CoordinatorError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("NVMe tier at {path}: {err}")]
    Nvme {
        path: std::path::PathBuf,
        err: String,
    },
}

/// How long a stopping daemon waits for its connections, sessions and
/// NVMe writes to finish.
const DRAIN_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// A running daemon.
pub struct DaemonHandle {
    pub addr: SocketAddr,
    /// Transports served besides TCP at `addr` (QUIC, when configured).
    pub endpoints: Vec<Endpoint>,
    pub pool: Arc<DramPool>,
    /// Accept loops (TCP, QUIC, RDMA, shared memory).
    listeners: Vec<JoinHandle<()>>,
    /// The link to the meta service, which leaves it on the stop.
    link: Option<JoinHandle<()>>,
    server: Arc<Server<server::DataService>>,
    /// Sessions of the RDMA and shared-memory paths, and the NVMe demoter.
    background: TaskTracker,
    tiers: Arc<tiers::Tiers>,
    /// The meta service this daemon is registered with (id 0: none).
    registered: tokio::sync::watch::Receiver<meta_link::Registration>,
}

impl DaemonHandle {
    /// The NVMe drives summed; `None` without an NVMe tier.
    pub fn nvme_totals(&self) -> Option<tiers::NvmeTotals> {
        self.tiers.nvme_totals()
    }

    /// Blocks a lease found only on the NVMe drives: brought back to DRAM,
    /// and left on the drive (`Tiers::prefetches`).
    pub fn lease_prefetches(&self) -> (u64, u64) {
        self.tiers.prefetches()
    }

    /// Blocks on each NVMe drive, in configuration order.
    pub fn nvme_blocks_per_drive(&self) -> Vec<usize> {
        self.tiers.nvme.iter().map(|d| d.blocks()).collect()
    }

    /// Waits, at most `within`, until the daemon is registered with the
    /// meta service and has sent its inventory: from then on puts can be
    /// placed on it. `false` past `within`, or without a meta service.
    pub async fn registered(&self, within: std::time::Duration) -> bool {
        let mut rx = self.registered.clone();
        let waited = tokio::time::timeout(within, rx.wait_for(|r| r.id != 0)).await;
        matches!(waited, Ok(Ok(_)))
    }

    /// Stops the daemon in order, once its `shutdown` was cancelled: it
    /// stops accepting and leaves the meta service (which then places
    /// nothing more on it and drops its blocks from the index), lets each
    /// connection finish the request it serves, ends its sessions and
    /// writes what it was demoting to NVMe, then closes its tiers: the NVMe
    /// index is flushed and unlocked for a next daemon. Each wait is
    /// bounded; what overran is logged.
    pub async fn join(self) {
        for task in self.listeners {
            let _ = task.await;
        }
        if let Some(link) = self.link {
            let _ = link.await;
        }
        self.server.drained(DRAIN_WITHIN).await;
        self.background.close();
        if tokio::time::timeout(DRAIN_WITHIN, self.background.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                open = self.background.len(),
                "sessions or NVMe writes still running {DRAIN_WITHIN:?} after the stop"
            );
        }
        drop(self.server);
        self.tiers.close();
        if Arc::strong_count(&self.tiers) > 1 {
            tracing::warn!("the tiers are still held after the stop; the NVMe index stays locked until they are let go");
        }
    }
}

/// Where a daemon finds the meta service it reports to.
#[derive(Clone)]
pub enum MetaTarget {
    /// A standalone daemon: no meta service.
    None,
    /// A fixed address (single host, or a meta service without standbys).
    Addr(String),
    /// Whoever leads, as the coordinator says; followed across failovers.
    Leader(Arc<dyn Coordinator>),
}

/// Starts a daemon on `listener`: the pool, the data server, and the link
/// that registers and reports to the meta service (`config.meta`, or the
/// leader that `coordinator` names). Everything stops when `shutdown` is
/// cancelled.
pub async fn start(
    config: DaemonConfig,
    listener: TcpListener,
    coordinator: Option<Arc<dyn Coordinator>>,
    registry: &prometheus::Registry,
    shutdown: CancellationToken,
) -> Result<DaemonHandle, DaemonError> {
    config.validate().map_err(DaemonError::Config)?;
    let files = config.tls_files();
    let meta_dialer = files.peer_dialer().map_err(DaemonError::Config)?;
    let tcp_tls = files.tcp_acceptor().map_err(DaemonError::Config)?;
    let addr = listener.local_addr().map_err(DaemonError::Listener)?;
    // Mapping and filling a large pool (the kernel may compact memory for
    // its huge pages) and recovering a drive's index take seconds: off the
    // runtime, which in `up` serves the meta service meanwhile.
    let io_times = io::IoTimes::new(metrics::latency_buckets())?;
    let storage = {
        let (config, io_times) = (config.clone(), io_times.clone());
        tokio::task::spawn_blocking(move || open_storage(&config, addr, &io_times))
    };
    let (pool, drives) = storage.await.map_err(|err| DaemonError::Pool {
        size: config.dram.0,
        err: std::io::Error::other(err),
    })??;
    tracing::info!(
        %addr,
        capacity = %config.dram,
        pages = %pool.pages(),
        tls = tcp_tls.is_some(),
        "storage daemon listening"
    );
    let background = TaskTracker::new();
    let tiers = if drives.is_empty() {
        tiers::Tiers::dram_only(pool.clone())
    } else {
        tiers::Tiers::with_nvme(
            pool.clone(),
            drives,
            config.promote_after,
            (&background, shutdown.child_token()),
        )
    };
    let metrics = metrics::DaemonMetrics::new(registry, tiers.clone(), &io_times)?;
    let mut data = config.data();
    data.peers = fetch::Peers {
        dialer: meta_dialer.clone(),
        token: config.token.clone(),
    };
    let service = Arc::new(server::DataService {
        tiers: tiers.clone(),
        cfg: data,
        metrics: metrics.clone(),
    });
    let server = Server::new(
        "data server",
        service.clone(),
        config.limits(),
        config.tokens().map_err(DaemonError::Config)?,
        metrics.server.clone(),
    );
    let mut listeners = vec![tokio::spawn(server.clone().run_tcp(
        listener,
        tcp_tls,
        shutdown.child_token(),
    ))];
    let advertise = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    let mut endpoints = Vec::new();
    if let Some(listen) = &config.quic_listen {
        let tls = config
            .tls_files()
            .server_tls("quic_listen")
            .map_err(DaemonError::Config)?;
        let endpoint = mooncake_net::quic::bind(listen, &tls).map_err(DaemonError::Config)?;
        let bound = endpoint.local_addr().map_err(DaemonError::Listener)?;
        let quic_addr = config
            .quic_advertise
            .clone()
            .unwrap_or_else(|| with_port(&advertise, bound.port()));
        tracing::info!(%bound, advertised = %quic_addr, mutual_tls = tls.client_ca.is_some(), "QUIC listening");
        endpoints.push(Endpoint {
            kind: TransportKind::Quic,
            addr: quic_addr,
        });
        listeners.push(tokio::spawn(
            server.clone().run_quic(endpoint, shutdown.child_token()),
        ));
    }
    if let Some(listen) = &config.rdma_listen {
        if let Some((endpoint, task)) = serve_rdma(
            listen,
            &config,
            &tiers,
            &advertise,
            &metrics,
            (&background, shutdown.child_token()),
        )
        .await?
        {
            endpoints.push(endpoint);
            listeners.push(task);
        }
    }
    let (registered_tx, registered) = tokio::sync::watch::channel(Default::default());
    // Same-host puts in one round trip, where the daemon can ask a meta
    // service. Never where clients must show a token: the socket carries
    // none, so the meta service must not take the daemon's word for their
    // namespaces (a daemon with `auth` serves no socket today anyway).
    let admitter = ((coordinator.is_some() || config.meta.is_some()) && config.auth.is_none())
        .then(|| {
            Arc::new(admit::Admitter::new(
                meta_dialer.clone(),
                config.token.clone(),
                registered.clone(),
                (
                    admit::ADMIT_TIMEOUT.min(config.request_timeout.0 / 2),
                    metrics.admissions.clone(),
                ),
            ))
        });
    if let Some(path) = config.shm_socket.clone() {
        let socket = shm::bind(path.clone()).map_err(|err| {
            DaemonError::Config(format!("shm_socket = {}: {err}", path.display()))
        })?;
        let (service, advertise) = (service.clone(), advertise.clone());
        let stop = shutdown.child_token();
        let sessions = metrics.shm_sessions.clone();
        let max_sessions = config.max_connections;
        let sessions_tracker = background.clone();
        listeners.push(tokio::spawn(async move {
            let served = shm::run(
                socket,
                (service, admitter),
                advertise,
                (sessions, max_sessions),
                (&sessions_tracker, stop),
            );
            if let Err(err) = served.await {
                tracing::error!(%err, path = %path.display(), "shared-memory socket failed");
            }
        }));
    }
    let target = match (coordinator, config.meta.clone()) {
        (Some(c), _) => {
            c.register(MemberKind::Daemon, advertise.clone()).await?;
            MetaTarget::Leader(c)
        }
        (None, Some(meta)) => MetaTarget::Addr(meta),
        (None, None) => MetaTarget::None,
    };
    let mut link = None;
    if !matches!(target, MetaTarget::None) {
        link = Some(tokio::spawn(meta_link::run(
            meta_link::LinkConfig {
                target,
                node: config.node.clone(),
                advertise,
                endpoints: endpoints.clone(),
                interval: config.heartbeat_interval.0,
                token: config.token.clone(),
                requires_auth: config.auth.is_some(),
                dialer: meta_dialer,
                registered: registered_tx,
            },
            tiers.clone(),
            shutdown.child_token(),
        )));
    }
    Ok(DaemonHandle {
        addr,
        endpoints,
        pool,
        listeners,
        link,
        server,
        background,
        tiers,
        registered,
    })
}

/// Registers the pool with this host's RDMA NIC and serves the RDMA control
/// port; `None` (said in one line) where the host has no usable NIC.
#[cfg(feature = "rdma")]
async fn serve_rdma(
    listen: &str,
    config: &DaemonConfig,
    tiers: &Arc<tiers::Tiers>,
    advertise: &str,
    metrics: &metrics::DaemonMetrics,
    (sessions, shutdown): (&TaskTracker, CancellationToken),
) -> Result<Option<(Endpoint, JoinHandle<()>)>, DaemonError> {
    let choice = mooncake_net::rdma::NicChoice {
        device: config.rdma_device.clone(),
        gid_index: config.rdma_gid_index,
    };
    let pool = match rdma::RdmaPool::register(tiers, &choice) {
        Ok(pool) => Arc::new(pool),
        Err(why) => {
            tracing::warn!(why, "RDMA unavailable: serving TCP (and QUIC) only");
            return Ok(None);
        }
    };
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| DaemonError::Config(format!("rdma_listen = {listen}: {e}")))?;
    let bound = listener.local_addr().map_err(DaemonError::Listener)?;
    let addr = config
        .rdma_advertise
        .clone()
        .unwrap_or_else(|| with_port(advertise, bound.port()));
    tracing::info!(nic = pool.nic(), %bound, advertised = %addr, "RDMA listening");
    let task = tokio::spawn(rdma::run(
        listener,
        pool,
        advertise.to_string(),
        config.max_connections,
        metrics.rdma_sessions.clone(),
        (sessions.clone(), shutdown),
    ));
    Ok(Some((
        Endpoint {
            kind: TransportKind::Rdma,
            addr,
        },
        task,
    )))
}

/// Without the `rdma` feature `validate` refuses `rdma_listen`.
#[cfg(not(feature = "rdma"))]
async fn serve_rdma(
    _: &str,
    _: &DaemonConfig,
    _: &Arc<tiers::Tiers>,
    _: &str,
    _: &metrics::DaemonMetrics,
    _: (&TaskTracker, CancellationToken),
) -> Result<Option<(Endpoint, JoinHandle<()>)>, DaemonError> {
    Err(DaemonError::Config(
        "rdma_listen needs a daemon built with the `rdma` feature".into(),
    ))
}

/// Whether this host can give `config`'s DRAM pool the memory it asks
/// (`start` checks it again): for a caller that starts other servers
/// first, such as `up`'s meta service.
pub fn memory_fits(config: &DaemonConfig) -> Result<(), String> {
    memory::check(config.dram.0, config.hugepages).map(|_| ())
}

/// The DRAM pool and the NVMe drives of `config`, opened: blocking work.
fn open_storage(
    config: &DaemonConfig,
    addr: SocketAddr,
    io_times: &io::IoTimes,
) -> Result<(Arc<DramPool>, Vec<Arc<nvme::NvmeTier>>), DaemonError> {
    match memory::check(config.dram.0, config.hugepages) {
        Err(why) => return Err(DaemonError::Memory(why)),
        Ok(Some(warning)) => tracing::warn!("{warning}"),
        Ok(None) => {}
    }
    // Drives first: one in use stops the start before the pool is filled.
    let mut drives = Vec::new();
    for (path, capacity) in config.nvme_drives().map_err(DaemonError::Config)? {
        let tier =
            open_drive(&path, capacity, config, io_times).map_err(|err| DaemonError::Nvme {
                path: path.clone(),
                err,
            })?;
        tracing::info!(path = %path.display(), capacity, blocks = tier.blocks(), "NVMe drive ready");
        drives.push(Arc::new(tier));
    }
    if config.prefault {
        tracing::info!(%addr, capacity = %config.dram, "filling the DRAM pool");
    }
    let pool = DramPool::new(config.pool()).map_err(|err| DaemonError::Pool {
        size: config.dram.0,
        err,
    })?;
    Ok((Arc::new(pool), drives))
}

/// Opens one NVMe drive: its space reserved, its engine (io_uring, or
/// pread/pwrite where io_uring is unavailable; its I/O timed into
/// `io_times`), its index recovered.
fn open_drive(
    path: &std::path::Path,
    capacity: u64,
    config: &DaemonConfig,
    io_times: &io::IoTimes,
) -> Result<nvme::NvmeTier, String> {
    let file = io::open_direct(path).map_err(|e| e.to_string())?;
    io::reserve(&file, capacity).map_err(|e| e.to_string())?;
    let engine = match io::engine(config.nvme_engine, file, config.nvme_depth) {
        Ok(e) => e,
        Err(err) => {
            tracing::warn!(%err, "io_uring unavailable; the NVMe tier uses pread/pwrite");
            let file = io::open_direct(path).map_err(|e| e.to_string())?;
            io::engine(io::EngineKind::Psync, file, config.nvme_depth).map_err(|e| e.to_string())?
        }
    };
    let engine = Box::new(io::Timed::over(engine, io_times.clone()));
    nvme::NvmeTier::open(engine, capacity, &nvme::NvmeTier::index_dir_for(path))
        .map(|tier| {
            tier.with_order(config.eviction, config.probation_share)
                .with_quotas(config.nvme_quotas())
        })
        .map_err(|e| e.to_string())
}

/// `addr` (`host:port`) with its port replaced: the QUIC address advertised
/// by default is the TCP one's host with the QUIC port.
fn with_port(addr: &str, port: u16) -> String {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    format!("{host}:{port}")
}
