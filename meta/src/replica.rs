//! A meta replica in a cluster: it stands by, leads when the coordinator
//! elects it (serving on its address for the term), and stands by again
//! when the lead is lost, for as long as it runs. Daemons register with
//! whichever replica leads; a new leader's index fills from their
//! inventories.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{Coordinator, LiveDaemons, MetaConfig, MetaError, MetaMetrics};

/// Pause before campaigning again after the coordinator failed.
const CAMPAIGN_RETRY: Duration = Duration::from_secs(1);
/// How long a term that ends waits for its connections.
const TERM_GRACE: Duration = Duration::from_secs(10);

/// What a running replica shows its admin endpoint: its role, and the
/// live daemons of the term it leads.
#[derive(Clone, Default)]
pub struct ReplicaView {
    leading: Arc<AtomicBool>,
    term: Arc<Mutex<Option<LiveDaemons>>>,
}

impl ReplicaView {
    pub fn is_leading(&self) -> bool {
        self.leading.load(Ordering::Relaxed)
    }

    /// The live daemons of the term this replica leads; none while it
    /// stands by.
    pub fn live_daemons(&self) -> Vec<String> {
        self.term
            .lock()
            .as_ref()
            .map_or_else(Vec::new, |list| list())
    }
}

/// Runs a replica advertised as `advertise` until `stop`: each time it is
/// elected it serves the term on `listener` and publishes store events on
/// `events` (`bind_events`), which it holds from its start, so that no
/// other process takes its ports while it stands by, and a port taken
/// already stops it at start, not at a failover. An error only when the
/// configuration is refused; a failed campaign is retried.
pub async fn run_replica(
    cfg: MetaConfig,
    (listener, events): (std::net::TcpListener, Option<crate::events::Sockets>),
    advertise: String,
    coordinator: Arc<dyn Coordinator>,
    metrics: Arc<MetaMetrics>,
    view: ReplicaView,
    stop: CancellationToken,
) -> Result<(), MetaError> {
    while !stop.is_cancelled() {
        tracing::info!(%advertise, "meta replica standing by");
        let leadership = tokio::select! {
            won = coordinator.campaign(advertise.clone()) => won,
            _ = stop.cancelled() => break,
        };
        let leadership = match leadership {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(%err, "campaign failed; retrying");
                tokio::time::sleep(CAMPAIGN_RETRY).await;
                continue;
            }
        };
        // The term's handle on the held socket; closing it at the term's
        // end leaves the socket open.
        let term_listener = listener
            .try_clone()
            .and_then(TcpListener::from_std)
            .map_err(MetaError::Listener)?;
        let term_events = events
            .as_ref()
            .map(|e| e.try_clone())
            .transpose()
            .map_err(MetaError::Listener)?;
        let term = stop.child_token();
        let meta = crate::serve_term(
            cfg.clone(),
            (term_listener, term_events),
            leadership,
            coordinator.clone(),
            metrics.clone(),
            term.clone(),
        )?;
        view.leading.store(true, Ordering::Relaxed);
        *view.term.lock() = Some(meta.live_daemons());
        tracing::info!(
            %advertise,
            addr = %meta.addr,
            revision = meta.leadership.revision,
            "meta replica leading"
        );
        let lost = meta.leadership.lost.clone();
        tokio::select! {
            _ = lost.cancelled() => {}
            _ = stop.cancelled() => {}
        }
        term.cancel();
        view.leading.store(false, Ordering::Relaxed);
        *view.term.lock() = None;
        if tokio::time::timeout(TERM_GRACE, meta.join()).await.is_err() {
            tracing::warn!("the ended term's connections took over {TERM_GRACE:?} to close");
        }
    }
    Ok(())
}
