//! Limits a server applies per client, so that one client cannot take all
//! of a server's connections (and with them its request slots: each
//! connection has at most one request in flight, bounded by its opcode's
//! body limit), and so that peers without a token cannot hold connections
//! that token holders need (`Unproven`, `Deadlines`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

/// Open connections per client address, at most `max` each.
#[derive(Debug)]
pub struct PerClient {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection counted against its client; released when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    owner: Arc<PerClient>,
    ip: IpAddr,
}

impl PerClient {
    pub fn new(max: usize) -> Arc<PerClient> {
        Arc::new(PerClient {
            max,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `ip`, or `None` at the limit.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<ClientSlot> {
        let mut open = self.open.lock();
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            owner: self.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.owner.open.lock();
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// How long a server keeps a connection that does nothing useful.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// From accept to a valid token, where the server requires one: the
    /// whole time a peer without a token is kept, its `Auth` included.
    pub auth: Duration,
    /// Waiting for the next request's header on a connection; a connection
    /// quiet this long is closed (clients open a new one).
    pub idle: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            auth: Duration::from_secs(5),
            idle: Duration::from_secs(300),
        }
    }
}

/// Connections that have not presented a valid token yet, at most `max` at
/// once. A new connection is never refused for this: when all `max` places
/// are taken, the oldest peer still without a token is closed to make room
/// (its `evict` is called). A client with a token proves itself one round
/// trip after connecting, so peers without one cannot lock it out unless
/// they open `max` connections within that round trip; and they never hold
/// more than `max` of a server's connections, each for at most
/// `Deadlines::auth`.
pub struct Unproven {
    max: usize,
    inner: Mutex<UnprovenInner>,
}

type Evict = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct UnprovenInner {
    next: u64,
    /// The places taken, oldest first, with how to close each.
    open: std::collections::BTreeMap<u64, Evict>,
    evicted: u64,
}

impl std::fmt::Debug for Unproven {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unproven")
            .field("max", &self.max)
            .field("open", &self.open())
            .finish()
    }
}

/// One connection not yet proven; its place is freed when dropped (its
/// token was accepted, or it closed).
#[derive(Debug)]
pub struct UnprovenSlot {
    owner: Arc<Unproven>,
    id: u64,
}

impl Unproven {
    pub fn new(max: usize) -> Arc<Unproven> {
        Arc::new(Unproven {
            max: max.max(1),
            inner: Mutex::new(UnprovenInner::default()),
        })
    }

    /// A place for a new connection without a token; `evict` closes it if
    /// it is still without one when the places run out.
    pub fn admit(self: &Arc<Self>, evict: impl FnOnce() + Send + 'static) -> UnprovenSlot {
        let mut inner = self.inner.lock();
        let oldest = (inner.open.len() >= self.max)
            .then(|| inner.open.pop_first())
            .flatten();
        if oldest.is_some() {
            inner.evicted += 1;
        }
        let id = inner.next;
        inner.next += 1;
        inner.open.insert(id, Box::new(evict));
        drop(inner);
        if let Some((_, evict)) = oldest {
            evict();
        }
        UnprovenSlot {
            owner: self.clone(),
            id,
        }
    }

    /// Places taken now.
    pub fn open(&self) -> usize {
        self.inner.lock().open.len()
    }

    /// Peers closed since start to make room for newer ones.
    #[cfg(test)]
    pub fn evicted(&self) -> u64 {
        self.inner.lock().evicted
    }
}

impl Drop for UnprovenSlot {
    fn drop(&mut self) {
        self.owner.inner.lock().open.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_client_gets_its_own_allowance_back_when_it_closes() {
        let limits = PerClient::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let s1 = limits.admit(a).unwrap();
        let _s2 = limits.admit(a).unwrap();
        assert!(limits.admit(a).is_none(), "a third connection from a");
        assert!(limits.admit(b).is_some(), "b is not held back by a");
        drop(s1);
        assert!(limits.admit(a).is_some());
    }

    #[test]
    fn peers_without_a_token_hold_at_most_their_share_the_oldest_giving_way() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let unproven = Unproven::new(2);
        let closed = Arc::new(AtomicUsize::new(usize::MAX));
        let slot = |n: usize| {
            let closed = closed.clone();
            unproven.admit(move || closed.store(n, Ordering::SeqCst))
        };
        let a = slot(0);
        let b = slot(1);
        assert_eq!(closed.load(Ordering::SeqCst), usize::MAX);
        let c = slot(2);
        assert_eq!(closed.load(Ordering::SeqCst), 0, "the oldest was closed");
        assert_eq!(unproven.open(), 2);
        drop(a);
        assert_eq!(
            unproven.open(),
            2,
            "an evicted peer's place is already free"
        );
        drop(b);
        assert_eq!(
            unproven.open(),
            1,
            "a proven or closed peer frees its place"
        );
        let _d = slot(3);
        assert_eq!(
            closed.load(Ordering::SeqCst),
            0,
            "room enough: nobody closed"
        );
        drop(c);
        assert_eq!(unproven.evicted(), 1);
    }
}
