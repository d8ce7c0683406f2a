//! The storage daemon: one per GPU host. It owns a DRAM pool allocated once
//! at start and carved by an offset allocator, keeps an index of the blocks
//! in it with LRU eviction between two watermarks, verifies every block's
//! checksum, serves block reads and writes over TCP, and reports to the meta
//! service what it drops on its own.
//!
//! Depends on `mooncake-proto` and the client SDK's connection (to reach
//! the meta service); never on the meta service's crate.

pub mod config;
pub mod io;
mod meta_link;
pub mod metrics;
pub mod nvme;
pub mod pool;
mod region;
mod server;

use std::net::SocketAddr;
use std::sync::Arc;

use mooncake_coord::{Coordinator, MemberKind};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::DaemonConfig;
pub use pool::{DramPool, PoolError};

/// Why a daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("invalid config: {0}")]
    Config(String),
    #[error("cannot allocate the DRAM pool of {size} bytes: {err}")]
    Pool { size: u64, err: std::io::Error },
    #[error("cannot read the listener's address: {0}")]
    Listener(std::io::Error),
    #[error("coordinator: {0}")]
    Coordinator(#[from] mooncake_coord::CoordinatorError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running daemon.
pub struct DaemonHandle {
    pub addr: SocketAddr,
    pub pool: Arc<DramPool>,
    tasks: Vec<JoinHandle<()>>,
}

impl DaemonHandle {
    /// Waits until every task of the daemon has stopped (after `shutdown`
    /// was cancelled).
    pub async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
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
    let addr = listener.local_addr().map_err(DaemonError::Listener)?;
    let pool = Arc::new(
        DramPool::new(config.pool()).map_err(|err| DaemonError::Pool {
            size: config.dram.0,
            err,
        })?,
    );
    tracing::info!(
        %addr,
        capacity = %config.dram,
        hugepages = pool.uses_hugepages(),
        "storage daemon listening"
    );
    let metrics = metrics::DaemonMetrics::new(registry, pool.clone())?;
    let mut tasks = vec![tokio::spawn(server::run(
        listener,
        pool.clone(),
        config.server(),
        metrics,
        shutdown.child_token(),
    ))];
    let advertise = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    let target = match (coordinator, config.meta.clone()) {
        (Some(c), _) => {
            c.register(MemberKind::Daemon, advertise.clone()).await?;
            MetaTarget::Leader(c)
        }
        (None, Some(meta)) => MetaTarget::Addr(meta),
        (None, None) => MetaTarget::None,
    };
    if !matches!(target, MetaTarget::None) {
        tasks.push(tokio::spawn(meta_link::run(
            meta_link::LinkConfig {
                target,
                node: config.node.clone(),
                advertise,
                interval: config.heartbeat_interval.0,
            },
            pool.clone(),
            shutdown.child_token(),
        )));
    }
    Ok(DaemonHandle { addr, pool, tasks })
}
