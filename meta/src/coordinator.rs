//! Coordination: who leads the meta service, with a fencing revision that
//! grows with every new leader. Two implementations share this trait: the
//! embedded one (one process, one leader, no external service) and etcd
//! (leader election bound to a lease) for a cluster.

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("coordinator unreachable: {0}")]
    Unavailable(String),
    #[error("another meta service already leads at {0}")]
    AlreadyLeading(String),
}

/// This node's leadership: valid until `lost` is cancelled.
#[derive(Debug, Clone)]
pub struct Leadership {
    /// Fencing token: strictly greater than every earlier leader's.
    pub revision: u64,
    /// Cancelled the moment the lead is lost; the leader must stop answering.
    pub lost: CancellationToken,
}

/// The leader as others see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    pub addr: String,
    pub revision: u64,
}

/// The small, strongly consistent facts of a cluster. Block locations are
/// never stored here: they are soft state of the meta leader.
pub trait Coordinator: Send + Sync + 'static {
    /// Resolves once this node (serving at `addr`) leads.
    fn campaign(&self, addr: String) -> BoxFuture<'_, Result<Leadership, CoordinatorError>>;
    /// The current leader, if any.
    fn leader(&self) -> BoxFuture<'_, Result<Option<LeaderInfo>, CoordinatorError>>;
}

/// The in-process coordinator of a single-host store: the first campaign
/// wins at once, and leads until it resigns.
#[derive(Debug, Default)]
pub struct EmbeddedCoordinator {
    state: parking_lot::Mutex<Option<(LeaderInfo, CancellationToken)>>,
    revision: std::sync::atomic::AtomicU64,
}

impl EmbeddedCoordinator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives up the lead (a graceful stop); the next campaign wins.
    pub fn resign(&self) {
        if let Some((_, lost)) = self.state.lock().take() {
            lost.cancel();
        }
    }
}

impl Coordinator for EmbeddedCoordinator {
    fn campaign(&self, addr: String) -> BoxFuture<'_, Result<Leadership, CoordinatorError>> {
        Box::pin(async move {
            let mut state = self.state.lock();
            if let Some((leader, _)) = state.as_ref() {
                return Err(CoordinatorError::AlreadyLeading(leader.addr.clone()));
            }
            let revision = self
                .revision
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1;
            let lost = CancellationToken::new();
            *state = Some((LeaderInfo { addr, revision }, lost.clone()));
            Ok(Leadership { revision, lost })
        })
    }

    fn leader(&self) -> BoxFuture<'_, Result<Option<LeaderInfo>, CoordinatorError>> {
        Box::pin(async move { Ok(self.state.lock().as_ref().map(|(l, _)| l.clone())) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_leader_at_a_time_and_revisions_grow() {
        let c = EmbeddedCoordinator::new();
        let first = c.campaign("a:1".into()).await.unwrap();
        assert!(matches!(
            c.campaign("b:2".into()).await,
            Err(CoordinatorError::AlreadyLeading(_))
        ));
        assert_eq!(c.leader().await.unwrap().unwrap().addr, "a:1");
        c.resign();
        assert!(first.lost.is_cancelled(), "the old leader learns it lost");
        let second = c.campaign("b:2".into()).await.unwrap();
        assert!(second.revision > first.revision, "fencing token grows");
    }
}
