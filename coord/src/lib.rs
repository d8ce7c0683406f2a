//! Coordination: who leads the meta service (with a fencing revision that
//! grows with every new leader), which meta replicas and daemons are alive,
//! and how anyone finds the leader. Two implementations share the
//! [`Coordinator`] trait: [`EmbeddedCoordinator`] for one process (no
//! external service) and [`EtcdCoordinator`] for a cluster.
//!
//! Only small, strongly consistent facts live here; block locations never
//! do (they are soft state of the meta leader, rebuilt from daemons).

mod embedded;
mod etcd;
mod resolver;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

pub use embedded::EmbeddedCoordinator;
pub use etcd::{EtcdConfig, EtcdCoordinator};
pub use resolver::leader_address;

#[derive(Debug, Clone, thiserror::Error)]
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

/// The kinds of members a cluster lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberKind {
    Meta,
    Daemon,
}

impl MemberKind {
    fn dir(self) -> &'static str {
        match self {
            MemberKind::Meta => "meta",
            MemberKind::Daemon => "daemons",
        }
    }
}

/// The small, strongly consistent facts of a cluster.
pub trait Coordinator: Send + Sync + 'static {
    /// Resolves once this node (serving at `addr`) leads; waits as a
    /// standby until then.
    fn campaign(&self, addr: String) -> BoxFuture<'_, Result<Leadership, CoordinatorError>>;
    /// The current leader, if any.
    fn leader(&self) -> BoxFuture<'_, Result<Option<LeaderInfo>, CoordinatorError>>;
    /// Lists this node as a live member until the process stops (or its
    /// session with the coordinator ends).
    fn register(
        &self,
        kind: MemberKind,
        addr: String,
    ) -> BoxFuture<'_, Result<(), CoordinatorError>>;
    /// Live members of a kind, by address.
    fn members(&self, kind: MemberKind) -> BoxFuture<'_, Result<Vec<String>, CoordinatorError>>;
}
