//! A whole store in one process: a meta service (with the embedded
//! coordinator, no etcd) and storage daemons that register with it over
//! TCP exactly as remote daemons do, so that a single host runs the same
//! paths as a cluster. `mooncake-store up`, `mooncake-store bench`'s own
//! store and the test harness are built on it.
//!
//! Started in order (the meta service, then each daemon, ready once it is
//! registered: a put can be placed on it) and stopped in order (daemons
//! first, each leaving the meta service while it still answers).

use std::sync::Arc;
use std::time::Duration;

use mooncake_coord::EmbeddedCoordinator;
use mooncake_meta::{MetaConfig, MetaError, MetaHandle};
use mooncake_store_daemon::{DaemonConfig, DaemonError, DaemonHandle};
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Why a local store could not start. The inner errors are part of the
/// message, not its source, so that an error chain prints them once.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("meta service: {0}")]
    Meta(MetaError),
    #[error("daemon: {0}")]
    Daemon(DaemonError),
    #[error(
        "the daemon on {addr} did not register with the meta service at {meta} within {within:?}"
    )]
    NotRegistered {
        addr: String,
        meta: String,
        within: Duration,
    },
}

impl From<MetaError> for LocalError {
    fn from(e: MetaError) -> Self {
        LocalError::Meta(e)
    }
}

impl From<DaemonError> for LocalError {
    fn from(e: DaemonError) -> Self {
        LocalError::Daemon(e)
    }
}

/// A daemon of this process, and what stops it.
pub struct LocalDaemon {
    pub handle: DaemonHandle,
    pub stop: CancellationToken,
}

impl LocalDaemon {
    /// Starts a daemon on `listener` reporting to the meta service that
    /// `cfg.meta` names, without waiting for it to register.
    pub async fn launch(
        cfg: DaemonConfig,
        listener: TcpListener,
        registry: &Registry,
        stop: CancellationToken,
    ) -> Result<LocalDaemon, LocalError> {
        let handle =
            mooncake_store_daemon::start(cfg, listener, None, registry, stop.clone()).await?;
        Ok(LocalDaemon { handle, stop })
    }

    /// Starts a daemon as `launch` does and returns once it is registered
    /// (its inventory sent: puts can be placed on it), or an error past
    /// `within`, the daemon stopped.
    pub async fn start(
        cfg: DaemonConfig,
        listener: TcpListener,
        registry: &Registry,
        stop: CancellationToken,
        within: Duration,
    ) -> Result<LocalDaemon, LocalError> {
        let meta = cfg.meta.clone().unwrap_or_default();
        let daemon = Self::launch(cfg, listener, registry, stop).await?;
        if !daemon.handle.registered(within).await {
            let addr = daemon.handle.addr.to_string();
            daemon.stop.cancel();
            daemon.handle.join().await;
            return Err(LocalError::NotRegistered { addr, meta, within });
        }
        Ok(daemon)
    }

    /// Stops the daemon in order (`DaemonHandle::join`).
    pub async fn shut_down(self) {
        self.stop.cancel();
        self.handle.join().await;
    }
}

/// Starts a meta service on `listener` that leads at once (the embedded
/// coordinator), until `stop`.
pub async fn start_meta(
    cfg: MetaConfig,
    listener: TcpListener,
    registry: &Registry,
    stop: CancellationToken,
) -> Result<MetaHandle, LocalError> {
    let coordinator = Arc::new(EmbeddedCoordinator::new());
    Ok(mooncake_meta::start(cfg, listener, coordinator, registry, stop).await?)
}

/// A meta service and one daemon in this process.
pub struct LocalStore {
    pub meta: MetaHandle,
    pub daemon: LocalDaemon,
    meta_stop: CancellationToken,
}

impl LocalStore {
    /// Starts the meta service on `meta_listener`, then the daemon on
    /// `daemon_listener` (its `meta` set to the meta service), and returns
    /// once the daemon is registered, within `within`. Both report metrics
    /// to `registry`.
    pub async fn start(
        meta: MetaConfig,
        meta_listener: TcpListener,
        mut daemon: DaemonConfig,
        daemon_listener: TcpListener,
        registry: &Registry,
        within: Duration,
    ) -> Result<LocalStore, LocalError> {
        let meta_stop = CancellationToken::new();
        let meta = start_meta(meta, meta_listener, registry, meta_stop.clone()).await?;
        daemon.meta = Some(meta.addr.to_string());
        let started = LocalDaemon::start(
            daemon,
            daemon_listener,
            registry,
            CancellationToken::new(),
            within,
        )
        .await;
        match started {
            Ok(daemon) => Ok(LocalStore {
                meta,
                daemon,
                meta_stop,
            }),
            Err(err) => {
                meta_stop.cancel();
                meta.join().await;
                Err(err)
            }
        }
    }

    /// The meta service's address: what clients are given.
    pub fn meta_addr(&self) -> String {
        self.meta.addr.to_string()
    }

    /// Stops the daemon (it leaves the meta service, drains and closes its
    /// tiers), then the meta service; `false` if that took over `grace`.
    pub async fn stop(self, grace: Duration) -> bool {
        let LocalStore {
            meta,
            daemon,
            meta_stop,
        } = self;
        let stopped = async move {
            daemon.shut_down().await;
            meta_stop.cancel();
            meta.join().await;
        };
        let in_time = tokio::time::timeout(grace, stopped).await.is_ok();
        if !in_time {
            tracing::warn!("stopping took over {grace:?}");
        }
        in_time
    }
}
