//! Admission: which connections a server takes. One budget of connections
//! for all its transports, a cap per client address, and with
//! authentication on a cap on peers without a token yet (the oldest of them
//! is closed to make room, so they cannot lock out clients with one).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::limits::{ClientSlot, Deadlines, PerClient, Unproven, UnprovenSlot};

/// The limits every server applies to its connections; each server's
/// configuration sets them under the same names (`max_connections`,
/// `max_connections_per_client`, `max_unauthenticated_connections`,
/// `request_timeout`, `auth_timeout`, `idle_timeout`).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most connections at once, every transport together.
    pub max_connections: usize,
    /// Most connections at once from one client address.
    pub max_connections_per_client: usize,
    /// With authentication: most connections at once without a valid token.
    pub max_unauthenticated: usize,
    /// Longest time one request may take once its header arrived.
    pub request_timeout: Duration,
    /// How long a connection may go without a token, or without a request.
    pub deadlines: Deadlines,
}

pub(crate) struct Admission {
    permits: Arc<Semaphore>,
    per_client: Arc<PerClient>,
    unproven: Arc<Unproven>,
    /// Whether connections must present a token.
    auth: bool,
}

/// A connection admitted under the limits; dropping it frees its place.
pub(crate) struct Admitted {
    _permit: OwnedSemaphorePermit,
    _slot: ClientSlot,
    /// Held until the connection presents a valid token (auth on).
    pub(crate) unproven: Option<UnprovenSlot>,
    /// Cancelled if the connection is still without a token when a newer
    /// one needs its place.
    pub(crate) evicted: CancellationToken,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    Full,
    ClientFull,
}

impl Admission {
    pub(crate) fn new(limits: &Limits, auth: bool) -> Self {
        Admission {
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            per_client: PerClient::new(limits.max_connections_per_client),
            unproven: Unproven::new(limits.max_unauthenticated),
            auth,
        }
    }

    /// A place for one more connection from `peer`, or why not.
    pub(crate) fn admit(&self, peer: SocketAddr) -> Result<Admitted, Refusal> {
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::Full)?;
        let slot = self
            .per_client
            .admit(peer.ip())
            .ok_or(Refusal::ClientFull)?;
        let evicted = CancellationToken::new();
        let unproven = self.auth.then(|| {
            let evicted = evicted.clone();
            self.unproven.admit(move || evicted.cancel())
        });
        Ok(Admitted {
            _permit: permit,
            _slot: slot,
            unproven,
            evicted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, per_client: usize) -> Limits {
        Limits {
            max_connections: max,
            max_connections_per_client: per_client,
            max_unauthenticated: 1,
            request_timeout: Duration::from_secs(1),
            deadlines: Deadlines::default(),
        }
    }

    #[test]
    fn the_budget_and_the_per_client_cap_both_hold_and_free_on_drop() {
        let admission = Admission::new(&limits(3, 2), false);
        let a: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:1".parse().unwrap();
        let first = admission.admit(a).unwrap();
        let _second = admission.admit(a).unwrap();
        assert_eq!(admission.admit(a).err(), Some(Refusal::ClientFull));
        let _third = admission.admit(b).unwrap();
        assert_eq!(admission.admit(b).err(), Some(Refusal::Full));
        drop(first);
        assert!(admission.admit(a).is_ok());
    }

    #[test]
    fn with_auth_the_oldest_peer_without_a_token_is_evicted_for_a_new_one() {
        let admission = Admission::new(&limits(8, 8), true);
        let peer: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let old = admission.admit(peer).unwrap();
        assert!(!old.evicted.is_cancelled());
        let new = admission.admit(peer).unwrap();
        assert!(old.evicted.is_cancelled());
        assert!(!new.evicted.is_cancelled());
    }
}
