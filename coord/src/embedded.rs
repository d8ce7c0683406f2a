//! The in-process coordinator of a single-host store: the first campaign
//! wins at once and leads until it resigns.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::{Coordinator, CoordinatorError, LeaderInfo, Leadership, MemberKind};

#[derive(Debug, Default)]
pub struct EmbeddedCoordinator {
    leader: Mutex<Option<(LeaderInfo, CancellationToken)>>,
    members: Mutex<BTreeSet<(u8, String)>>,
    revision: AtomicU64,
}

impl EmbeddedCoordinator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives up the lead (a graceful stop); the next campaign wins.
    pub fn resign(&self) {
        if let Some((_, lost)) = self.leader.lock().take() {
            lost.cancel();
        }
    }
}

impl Coordinator for EmbeddedCoordinator {
    fn campaign(&self, addr: String) -> BoxFuture<'_, Result<Leadership, CoordinatorError>> {
        Box::pin(async move {
            let mut leader = self.leader.lock();
            if let Some((current, _)) = leader.as_ref() {
                return Err(CoordinatorError::AlreadyLeading(current.addr.clone()));
            }
            let revision = self.revision.fetch_add(1, Ordering::SeqCst) + 1;
            let lost = CancellationToken::new();
            *leader = Some((LeaderInfo { addr, revision }, lost.clone()));
            Ok(Leadership { revision, lost })
        })
    }

    fn leader(&self) -> BoxFuture<'_, Result<Option<LeaderInfo>, CoordinatorError>> {
        Box::pin(async move { Ok(self.leader.lock().as_ref().map(|(l, _)| l.clone())) })
    }

    fn register(
        &self,
        kind: MemberKind,
        addr: String,
    ) -> BoxFuture<'_, Result<(), CoordinatorError>> {
        Box::pin(async move {
            self.members.lock().insert((kind as u8, addr));
            Ok(())
        })
    }

    fn members(&self, kind: MemberKind) -> BoxFuture<'_, Result<Vec<String>, CoordinatorError>> {
        Box::pin(async move {
            Ok(self
                .members
                .lock()
                .iter()
                .filter(|(k, _)| *k == kind as u8)
                .map(|(_, a)| a.clone())
                .collect())
        })
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

    #[tokio::test]
    async fn members_are_listed_by_kind() {
        let c = EmbeddedCoordinator::new();
        c.register(MemberKind::Meta, "m:1".into()).await.unwrap();
        c.register(MemberKind::Daemon, "d:1".into()).await.unwrap();
        assert_eq!(
            c.members(MemberKind::Daemon).await.unwrap(),
            vec!["d:1".to_string()]
        );
    }
}
