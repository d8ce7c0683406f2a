//! The meta service: the cluster's index of blocks (key -> size, checksum,
//! daemon, state), placement of new blocks, two-phase puts, prefix matching
//! and daemon membership. Block data never passes through it.
//!
//! Its index is soft state, rebuilt from daemons; leadership comes from a
//! [`Coordinator`] (embedded in-process here, etcd for a cluster). Built
//! on `mooncake-server` (the skeleton both servers share) and
//! `mooncake-net` (its calls to daemons); never on the client SDK nor on
//! the daemon's crate.

mod admit;
pub mod branches;
mod clients;
pub mod config;
mod daemons;
pub mod events;
mod hot;
mod index;
pub mod metrics;
mod misses;
mod recent;
mod removals;
mod remove;
mod removing;
mod repair;
mod replica;
mod route;
mod server;
mod table;

use std::net::SocketAddr;
use std::sync::Arc;

use mooncake_server::Server;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use clients::Client;
pub use config::MetaConfig;
use events::Events;
pub use index::{Index, PrefixStats};
pub use metrics::MetaMetrics;
pub use mooncake_coord::{Coordinator, CoordinatorError, Leadership};
pub use replica::{run_replica, ReplicaView};

/// Why a meta service could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("invalid config: {0}")]
    Config(String),
    #[error("cannot read the listener's address: {0}")]
    Listener(std::io::Error),
    #[error("coordinator: {0}")]
    Coordinator(#[from] CoordinatorError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// A running meta service.
pub struct MetaHandle {
    pub addr: SocketAddr,
    pub leadership: Leadership,
    tasks: Vec<JoinHandle<()>>,
    state: Arc<server::State>,
    server: Arc<Server<server::MetaService>>,
}

/// How long a stopping meta service waits for its connections to finish
/// the request each is serving.
const DRAIN_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// The data addresses of the live daemons, read when called.
pub type LiveDaemons = Arc<dyn Fn() -> Vec<String> + Send + Sync>;

impl MetaHandle {
    /// The live daemons of this term, as the index knows them when asked
    /// (the admin endpoint's `/get_all_segments`).
    pub fn live_daemons(&self) -> LiveDaemons {
        let state = self.state.clone();
        Arc::new(move || {
            state
                .daemons
                .infos()
                .into_iter()
                .filter(|d| d.alive)
                .map(|d| d.addr)
                .collect()
        })
    }

    /// Waits until the service stopped (after `shutdown` was cancelled or
    /// its leadership was lost): it stopped accepting, and each connection
    /// finished the request it was serving (bounded).
    pub async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
        }
        self.server.drained(DRAIN_WITHIN).await;
    }
}

/// Binds the event sockets the config asks for, so that a port in use is
/// refused at once: when a term starts, or, for a meta replica, when it
/// starts (it holds them while it stands by).
pub fn bind_events(config: &MetaConfig) -> Result<Option<events::Sockets>, MetaError> {
    if config.events_listen.is_empty() {
        return Ok(None);
    }
    let bind = |what: &str, addr: &str| {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| MetaError::Config(format!("{what} = {addr}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| MetaError::Config(format!("{what} = {addr}: {e}")))?;
        Ok::<_, MetaError>(listener)
    };
    let replay = match config.events_replay_listen.as_str() {
        "" => None,
        addr => Some(bind("events_replay_listen", addr)?),
    };
    Ok(Some(events::Sockets {
        publish: bind("events_listen", &config.events_listen)?,
        replay,
        topic: config.events_topic.clone(),
        format: match config.events_format {
            config::EventsFormat::Vllm => events::Format::Vllm {
                int_hashes: config.events_int_hashes,
            },
            config::EventsFormat::Mooncake => events::Format::Mooncake(events::mooncake::Context {
                backend_id: config.events_backend_id.clone(),
                model_name: config.events_model_name.clone(),
                block_size: config.events_block_size,
                lora_name: config.events_lora_name.clone(),
                additional_salt: config.events_additional_salt.clone(),
                dp_rank: config.events_dp_rank,
            }),
        },
        keep: config.events_replay_batches,
        window: config.events_window.0,
    }))
}

/// Starts a meta service on `listener`: it campaigns for leadership through
/// `coordinator` (at once with the embedded one), then serves.
pub async fn start(
    config: MetaConfig,
    listener: TcpListener,
    coordinator: Arc<dyn Coordinator>,
    registry: &prometheus::Registry,
    shutdown: CancellationToken,
) -> Result<MetaHandle, MetaError> {
    let addr = listener.local_addr().map_err(MetaError::Listener)?;
    let metrics = MetaMetrics::new(registry)?;
    let leadership = coordinator.campaign(addr.to_string()).await?;
    serve(config, listener, leadership, coordinator, metrics, shutdown)
}

/// Serves as the leader on `listener` until `shutdown` is cancelled or the
/// lead is lost (a stale leader must not answer). The index starts empty
/// and fills as daemons register and send their inventories.
pub fn serve(
    config: MetaConfig,
    listener: TcpListener,
    leadership: Leadership,
    coordinator: Arc<dyn Coordinator>,
    metrics: Arc<MetaMetrics>,
    shutdown: CancellationToken,
) -> Result<MetaHandle, MetaError> {
    config.validate().map_err(MetaError::Config)?;
    let events = bind_events(&config)?;
    serve_term(
        config,
        (listener, events),
        leadership,
        coordinator,
        metrics,
        shutdown,
    )
}

/// `serve` on sockets bound already: the control port and the events
/// ports (a meta replica binds them once, at its start).
pub(crate) fn serve_term(
    config: MetaConfig,
    (listener, events): (TcpListener, Option<events::Sockets>),
    leadership: Leadership,
    coordinator: Arc<dyn Coordinator>,
    metrics: Arc<MetaMetrics>,
    shutdown: CancellationToken,
) -> Result<MetaHandle, MetaError> {
    config.validate().map_err(MetaError::Config)?;
    let addr = listener.local_addr().map_err(MetaError::Listener)?;
    tracing::info!(%addr, revision = leadership.revision, "meta service leading");
    let stop = shutdown.child_token();
    let lost = leadership.lost.clone();
    let stop_on_loss = stop.clone();
    let (index_events, feed) = match &events {
        Some(_) => {
            let keys = config.events_format == config::EventsFormat::Mooncake;
            let (events, feed) = Events::new(config.events_queue, metrics.events.clone(), keys);
            (events, Some(feed))
        }
        None => (Events::default(), None),
    };
    let state = Arc::new(server::State::new(
        &config,
        addr.to_string(),
        leadership.revision,
        coordinator,
        stop.clone(),
        index_events,
    )?);
    metrics.set_term(&state);
    let server = Server::new(
        "meta service",
        Arc::new(server::MetaService {
            state: state.clone(),
            metrics: metrics.clone(),
        }),
        config.limits(),
        state.tokens.clone(),
        metrics.server.clone(),
    );
    let tcp_tls = config
        .tls_files()
        .tcp_acceptor()
        .map_err(MetaError::Config)?;
    if tcp_tls.is_some() {
        tracing::info!(%addr, mutual_tls = config.tls_client_ca.is_some(), "meta service speaks TLS on its TCP port");
    }
    let mut tasks = vec![
        tokio::spawn(async move {
            tokio::select! {
                _ = lost.cancelled() => {
                    tracing::error!("leadership lost: the meta service stops answering");
                    stop_on_loss.cancel();
                }
                _ = stop_on_loss.cancelled() => {}
            }
        }),
        tokio::spawn(server::reaper(state.clone(), stop.clone())),
        tokio::spawn(repair::run(state.clone(), stop.clone())),
        tokio::spawn(server.clone().run_tcp(listener, tcp_tls, stop.clone())),
    ];
    if let (Some(sockets), Some(feed)) = (events, feed) {
        tracing::info!(publish = %config.events_listen, replay = %config.events_replay_listen, "meta service publishing store events");
        if config.auth.is_some() {
            tracing::warn!(publish = %config.events_listen, "the events ports take no token: whoever reaches them reads every block hash, host and namespace (docs/security.md)");
        }
        let index = state.clone();
        let snapshot: events::Snapshot = Arc::new(move |shard| index.index.visible_in_shard(shard));
        tasks.push(tokio::spawn(events::run(
            feed,
            sockets,
            snapshot,
            stop.clone(),
        )));
    }
    if config.quic {
        // UDP at the TCP address: clients set up for QUIC dial the meta
        // address they already have.
        let tls = config
            .tls_files()
            .server_tls("quic")
            .map_err(MetaError::Config)?;
        let endpoint =
            mooncake_net::quic::bind(&addr.to_string(), &tls).map_err(MetaError::Config)?;
        tracing::info!(%addr, mutual_tls = tls.client_ca.is_some(), "meta service serving QUIC too");
        tasks.push(tokio::spawn(server.clone().run_quic(endpoint, stop)));
    }
    Ok(MetaHandle {
        addr,
        leadership,
        tasks,
        state,
        server,
    })
}
