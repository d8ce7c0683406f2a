//! Readers that come back for blocks a daemon evicted: the signal a 2Q
//! pool grows its probation by (`store/src/pool/evict.rs`: a block
//! probation let go before anyone read it, then wanted, means probation is
//! too small for how soon this workload reads what it writes, as a decode
//! node reads what a prefill node put). A daemon sees that signal only when
//! a get reaches it, but a reader whose lookup finds the block gone from the
//! index never asks the daemon. The meta service saw the daemon report the
//! eviction, so it remembers the last evictions and, when a lookup or a
//! prefix match misses one of them, tells the daemon in the answer to its
//! next heartbeat. Bounded: the last `cap` evictions, and at most
//! `MAX_BATCH` keys waiting for each daemon.

use std::collections::{HashMap, VecDeque};

use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use parking_lot::Mutex;

/// Evictions remembered by default.
pub const DEFAULT_CAP: usize = 65_536;

pub struct Misses {
    cap: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Each key evicted recently: its daemon and the eviction's number.
    evicted: HashMap<BlockKey, (u32, u64)>,
    /// The evictions in order, oldest first (a key evicted again since
    /// appears twice; only its latest number counts).
    order: VecDeque<(BlockKey, u64)>,
    next: u64,
    /// Keys missed, waiting for their daemon's next heartbeat.
    told: HashMap<u32, Vec<BlockKey>>,
}

impl Misses {
    pub fn new(cap: usize) -> Self {
        Misses {
            cap: cap.max(1),
            inner: Mutex::default(),
        }
    }

    /// `daemon` evicted `key` (its own report).
    pub fn evicted(&self, daemon: u32, key: &BlockKey) {
        let mut inner = self.inner.lock();
        let n = inner.next;
        inner.next += 1;
        inner.evicted.insert(key.clone(), (daemon, n));
        inner.order.push_back((key.clone(), n));
        while inner.order.len() > self.cap {
            let Some((old, at)) = inner.order.pop_front() else {
                break;
            };
            if inner
                .evicted
                .get(&old)
                .is_some_and(|(_, latest)| *latest == at)
            {
                inner.evicted.remove(&old);
            }
        }
    }

    /// A reader looked for these blocks and did not find them: each one a
    /// daemon evicted recently is queued for that daemon (once).
    pub fn missed<'a>(&self, ns: &Namespace, hashes: impl IntoIterator<Item = &'a BlockHash>) {
        // A lookup that missed nothing takes no lock (every get's lookup
        // comes here).
        let mut hashes = hashes.into_iter().peekable();
        if hashes.peek().is_none() {
            return;
        }
        let mut inner = self.inner.lock();
        if inner.evicted.is_empty() {
            return;
        }
        for hash in hashes {
            let key = BlockKey::new(ns.clone(), *hash);
            let Some((daemon, _)) = inner.evicted.remove(&key) else {
                continue;
            };
            let queue = inner.told.entry(daemon).or_default();
            if queue.len() < MAX_BATCH {
                queue.push(key);
            }
        }
    }

    /// What to tell `daemon` now.
    pub fn take(&self, daemon: u32) -> Vec<BlockKey> {
        self.inner.lock().told.remove(&daemon).unwrap_or_default()
    }

    /// `daemon` left (or registered anew): nothing waits for it. Its
    /// evictions age out with the others.
    pub fn forget(&self, daemon: u32) {
        self.inner.lock().told.remove(&daemon);
    }

    /// How many evictions are remembered and keys wait to be told (for
    /// tests of the bounds).
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (inner.evicted.len(), inner.told.values().map(Vec::len).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("t").unwrap()
    }

    fn key(i: u64) -> BlockKey {
        BlockKey::new(ns(), BlockHash::from_opaque(&i.to_le_bytes()))
    }

    #[test]
    fn a_miss_of_a_recent_eviction_is_told_to_its_daemon_once() {
        let misses = Misses::new(100);
        misses.evicted(1, &key(1));
        misses.evicted(2, &key(2));
        let hashes = [key(1).hash, key(2).hash, key(3).hash];
        misses.missed(&ns(), &hashes);
        misses.missed(&ns(), &hashes);
        assert_eq!(misses.take(1), [key(1)]);
        assert_eq!(misses.take(2), [key(2)]);
        assert!(misses.take(1).is_empty(), "told once");
        assert_eq!(misses.held(), (0, 0));
    }

    #[test]
    fn only_the_last_evictions_are_remembered_and_queues_are_bounded() {
        let misses = Misses::new(10);
        for i in 0..20 {
            misses.evicted(1, &key(i));
        }
        // Evicted again: its later eviction counts, not the first.
        misses.evicted(1, &key(9));
        assert_eq!(misses.held().0, 10);
        let all: Vec<BlockHash> = (0..20).map(|i| key(i).hash).collect();
        misses.missed(&ns(), &all);
        let told = misses.take(1);
        assert_eq!(told.len(), 10, "{told:?}");
        assert!(told.contains(&key(9)) && !told.contains(&key(5)));

        let misses = Misses::new(10 * MAX_BATCH);
        let keys: Vec<BlockKey> = (0..2 * MAX_BATCH as u64).map(key).collect();
        for k in &keys {
            misses.evicted(3, k);
        }
        misses.missed(&ns(), keys.iter().map(|k| &k.hash));
        assert_eq!(misses.take(3).len(), MAX_BATCH);
        for k in &keys[..10] {
            misses.evicted(3, k);
        }
        misses.missed(&ns(), keys[..10].iter().map(|k| &k.hash));
        assert_eq!(misses.held(), (0, 10));
        misses.forget(3);
        assert_eq!(misses.held(), (0, 0), "a daemon gone is told nothing");
    }
}
