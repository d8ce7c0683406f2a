//! Removals a daemon has not confirmed yet. A key removed from the index
//! must not come back: while the daemon that held it cannot be reached, its
//! bytes are still there, and its next inventory (after it restarts, or to
//! a new leader) would publish them again. So the meta service keeps each
//! unconfirmed removal, leaves such keys out of that daemon's inventories,
//! and sends the removal again once the daemon answers (its heartbeats
//! say when). A new put of the key on the same daemon settles it: the
//! daemon replaces the stale bytes itself. While a resend of it is on its
//! way to that daemon, though, the put is refused (`Busy`): the removal
//! would take the put's copy.
//!
//! The set is bounded; past the bound the oldest removals are given up
//! (logged and counted), which can only bring back a key whose removal was
//! reported to its caller as failed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};

use mooncake_proto::BlockKey;
use parking_lot::Mutex;

/// Unconfirmed removals kept across all daemons.
pub const MAX_OWED: usize = 1 << 20;

#[derive(Default)]
pub struct OwedRemovals {
    inner: Mutex<Inner>,
    /// `Inner::count`, readable without the lock (puts ask on every block).
    count: AtomicUsize,
}

#[derive(Default)]
struct Inner {
    by_daemon: HashMap<u32, HashSet<BlockKey>>,
    /// Every (daemon, key) owed, oldest first; may hold entries settled
    /// since, skipped when the bound drops the oldest.
    order: VecDeque<(u32, BlockKey)>,
    count: usize,
    /// Daemons with a resend under way.
    sending: HashSet<u32>,
    /// Removals on their way to their daemon now (`take_to_send`): a put
    /// there cannot settle them, as it would be taken by them.
    in_flight: HashSet<(u32, BlockKey)>,
    given_up: u64,
}

impl OwedRemovals {
    /// Records that `daemon` still holds `key`, which the index no longer has.
    pub fn owe(&self, daemon: u32, key: BlockKey) {
        let mut inner = self.inner.lock();
        if !inner
            .by_daemon
            .entry(daemon)
            .or_default()
            .insert(key.clone())
        {
            return;
        }
        inner.count += 1;
        self.count.store(inner.count, Ordering::Relaxed);
        inner.order.push_back((daemon, key));
        while inner.count > MAX_OWED {
            let Some((d, k)) = inner.order.pop_front() else {
                break;
            };
            if inner.remove(d, &k) {
                inner.given_up += 1;
                self.count.store(inner.count, Ordering::Relaxed);
                tracing::warn!(daemon = d, key = %k, "too many unconfirmed removals: giving up the oldest");
            }
        }
        if inner.order.len() > 2 * MAX_OWED {
            inner.compact();
        }
    }

    /// The daemon confirmed the removal, or a new put of the key there
    /// replaces its bytes.
    pub fn settle(&self, daemon: u32, key: &BlockKey) {
        if !self.any() {
            return;
        }
        let mut inner = self.inner.lock();
        if inner.remove(daemon, key) {
            self.count.store(inner.count, Ordering::Relaxed);
        }
    }

    /// A new put of `key` on `daemons` replaces the stale bytes they hold:
    /// their removals are settled; `false` (nothing settled) where one of
    /// them is on its way to its daemon, which would take the put's copy.
    pub fn settle_for_put(&self, daemons: &[u32], key: &BlockKey) -> bool {
        if !self.any() {
            return true;
        }
        let mut inner = self.inner.lock();
        let on_its_way = daemons
            .iter()
            .any(|&d| inner.in_flight.contains(&(d, key.clone())));
        if on_its_way {
            return false;
        }
        for &d in daemons {
            inner.remove(d, key);
        }
        self.count.store(inner.count, Ordering::Relaxed);
        true
    }

    /// Takes the removal of `key` owed by `daemon` to send now; `false`
    /// where it is no longer owed (a put there settled it). Until
    /// `send_done`, no put there settles it.
    pub fn take_to_send(&self, daemon: u32, key: &BlockKey) -> bool {
        let mut inner = self.inner.lock();
        let owed = inner
            .by_daemon
            .get(&daemon)
            .is_some_and(|keys| keys.contains(key));
        if owed {
            inner.in_flight.insert((daemon, key.clone()));
        }
        owed
    }

    /// The removal taken by `take_to_send` was answered (or not).
    pub fn send_done(&self, daemon: u32, key: &BlockKey) {
        self.inner.lock().in_flight.remove(&(daemon, key.clone()));
    }

    /// Whether any removal is owed (without taking the lock).
    pub fn any(&self) -> bool {
        self.count.load(Ordering::Relaxed) > 0
    }

    pub fn is_owed(&self, daemon: u32, key: &BlockKey) -> bool {
        self.any()
            && self
                .inner
                .lock()
                .by_daemon
                .get(&daemon)
                .is_some_and(|keys| keys.contains(key))
    }

    /// The removals owed by `daemon`, if there are any and no resend to it
    /// is under way; the caller resends them and then calls `sent`.
    pub fn start_resend(&self, daemon: u32) -> Option<Vec<BlockKey>> {
        if !self.any() {
            return None;
        }
        let mut inner = self.inner.lock();
        let keys: Vec<BlockKey> = inner.by_daemon.get(&daemon)?.iter().cloned().collect();
        if keys.is_empty() || !inner.sending.insert(daemon) {
            return None;
        }
        Some(keys)
    }

    pub fn sent(&self, daemon: u32) {
        self.inner.lock().sending.remove(&daemon);
    }

    /// Removals owed now, and given up since start.
    pub fn counts(&self) -> (usize, u64) {
        let inner = self.inner.lock();
        (inner.count, inner.given_up)
    }
}

impl Inner {
    fn remove(&mut self, daemon: u32, key: &BlockKey) -> bool {
        let Some(keys) = self.by_daemon.get_mut(&daemon) else {
            return false;
        };
        let removed = keys.remove(key);
        if keys.is_empty() {
            self.by_daemon.remove(&daemon);
        }
        if removed {
            self.count -= 1;
        }
        removed
    }

    /// Drops settled entries from the order queue.
    fn compact(&mut self) {
        let by_daemon = &self.by_daemon;
        self.order
            .retain(|(d, k)| by_daemon.get(d).is_some_and(|keys| keys.contains(k)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(n: u8) -> BlockKey {
        BlockKey::new(Namespace::new("t").unwrap(), BlockHash([n; 32]))
    }

    #[test]
    fn owed_until_settled_and_resent_once_at_a_time() {
        let owed = OwedRemovals::default();
        owed.owe(1, key(1));
        owed.owe(1, key(1));
        owed.owe(2, key(2));
        assert_eq!(owed.counts(), (2, 0), "the same removal counts once");
        assert!(owed.is_owed(1, &key(1)) && !owed.is_owed(2, &key(1)));
        assert_eq!(owed.start_resend(1), Some(vec![key(1)]));
        assert_eq!(
            owed.start_resend(1),
            None,
            "one resend per daemon at a time"
        );
        owed.settle(1, &key(1));
        owed.sent(1);
        assert_eq!(owed.start_resend(1), None, "nothing left to send");
        assert!(!owed.is_owed(1, &key(1)));
        assert_eq!(owed.counts(), (1, 0));
    }

    #[test]
    fn a_put_settles_no_removal_while_one_of_its_daemons_is_being_told() {
        let owed = OwedRemovals::default();
        owed.owe(1, key(1));
        owed.owe(2, key(1));
        assert!(owed.take_to_send(2, &key(1)));
        assert!(!owed.take_to_send(3, &key(1)), "not owed there");
        assert!(!owed.settle_for_put(&[1, 2], &key(1)));
        assert!(owed.is_owed(1, &key(1)), "none settled");
        assert!(owed.settle_for_put(&[1, 3], &key(1)));
        assert!(!owed.is_owed(1, &key(1)));
        owed.send_done(2, &key(1));
        assert!(owed.settle_for_put(&[2], &key(1)));
        assert!(!owed.take_to_send(2, &key(1)), "settled by the put");
        assert_eq!(owed.counts(), (0, 0));
    }

    #[test]
    fn past_the_bound_the_oldest_is_given_up() {
        let owed = OwedRemovals::default();
        for i in 0..MAX_OWED + 3 {
            let mut hash = [0u8; 32];
            hash[..8].copy_from_slice(&(i as u64).to_le_bytes());
            owed.owe(
                7,
                BlockKey::new(Namespace::new("t").unwrap(), BlockHash(hash)),
            );
        }
        assert_eq!(owed.counts(), (MAX_OWED, 3));
        let first = BlockKey::new(Namespace::new("t").unwrap(), BlockHash([0; 32]));
        assert!(!owed.is_owed(7, &first), "the oldest went first");
    }
}
