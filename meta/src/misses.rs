//! Blocks a daemon evicted recently, remembered by the meta service for
//! two uses, both for the daemons' 2Q pools (`store/src/pool/evict.rs`):
//!
//! - Readers that come back for them: the signal a 2Q pool grows its
//!   probation by (a block probation let go before anyone read it, then
//!   wanted, means probation is too small for how soon this workload reads
//!   what it writes, as a decode node reads what a prefill node put). A
//!   daemon sees that signal only when a get reaches it, but a reader whose
//!   lookup finds the block gone from the index never asks the daemon. So
//!   when a lookup or a prefix match misses one of them, the meta service
//!   tells the daemon in the answer to its next heartbeat.
//! - Writers that store them again: such a block goes back to the daemon
//!   that evicted it (`Daemons::place_copies`), whose pool remembers the key
//!   and takes the block straight into main, as one that came back. On any
//!   other daemon it would start in probation again, and a cluster of
//!   several daemons would lose much of what 2Q keeps over LRU.
//!
//! Bounded: the last `cap` evictions, and at most `MAX_BATCH` keys waiting
//! for each daemon.

use std::collections::HashMap;

use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use parking_lot::Mutex;

use crate::recent::Recent;

/// Evictions remembered by default.
pub const DEFAULT_CAP: usize = 65_536;

pub struct Misses {
    inner: Mutex<Inner>,
}

struct Inner {
    /// Each key evicted recently (a key evicted again: its latest).
    evicted: Recent<BlockKey, Evicted>,
    /// Keys missed, waiting for their daemon's next heartbeat.
    told: HashMap<u32, Vec<BlockKey>>,
}

struct Evicted {
    daemon: u32,
    /// A reader missed it, and its daemon was told (or will be).
    told: bool,
}

impl Misses {
    pub fn new(cap: usize) -> Self {
        Misses {
            inner: Mutex::new(Inner {
                evicted: Recent::new(cap),
                told: HashMap::new(),
            }),
        }
    }

    /// `daemon` evicted `key` (its own report).
    pub fn evicted(&self, daemon: u32, key: &BlockKey) {
        let evicted = Evicted {
            daemon,
            told: false,
        };
        self.inner.lock().evicted.insert(key.clone(), evicted);
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
        let inner = &mut *inner;
        for hash in hashes {
            let key = BlockKey::new(ns.clone(), *hash);
            let Some(evicted) = inner.evicted.get_mut(&key).filter(|e| !e.told) else {
                continue;
            };
            evicted.told = true;
            let queue = inner.told.entry(evicted.daemon).or_default();
            if queue.len() < MAX_BATCH {
                queue.push(key);
            }
        }
    }

    /// These blocks are being stored again: for each, the daemon that
    /// evicted it recently, if one did. Each is then forgotten (stored, it
    /// is no longer an eviction; evicted again, it is a new one).
    pub fn returning<'a>(
        &self,
        ns: &Namespace,
        hashes: impl IntoIterator<Item = &'a BlockHash>,
    ) -> Vec<Option<u32>> {
        let mut inner = self.inner.lock();
        hashes
            .into_iter()
            .map(|hash| {
                if inner.evicted.is_empty() {
                    return None;
                }
                let key = BlockKey::new(ns.clone(), *hash);
                inner.evicted.remove(&key).map(|e| e.daemon)
            })
            .collect()
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

/// The blocks a lookup of `hashes` that found `items` says readers
/// missed: those gone from among blocks still held (a decode node reading
/// what a prefill node just put), and the first of a missing tail. The
/// engines look up whole requests, whose prefix ends at the first block
/// gone: the rest of a tail would not have made it longer, as after a
/// prefix match, and counting it grew probation past need (0.7 to 1.6
/// points on the agents trace).
pub fn missed_by_lookup<'a, T>(
    hashes: &'a [BlockHash],
    items: &'a [Option<T>],
) -> impl Iterator<Item = &'a BlockHash> + 'a {
    let ends = items
        .iter()
        .rposition(Option::is_some)
        .map_or(1, |last| last + 2);
    hashes
        .iter()
        .zip(items)
        .take(ends)
        .filter(|(_, item)| item.is_none())
        .map(|(hash, _)| hash)
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
    fn a_lookup_misses_the_holes_among_blocks_held_and_the_first_of_a_missing_tail() {
        let hashes: Vec<BlockHash> = (0..6u8).map(|i| BlockHash([i; 32])).collect();
        let missed = |found: [bool; 6]| -> Vec<u8> {
            let items: Vec<Option<()>> = found.iter().map(|f| f.then_some(())).collect();
            missed_by_lookup(&hashes, &items).map(|h| h.0[0]).collect()
        };
        // A decode node's read: the first blocks let go, the rest held.
        assert_eq!(missed([false, false, true, false, true, true]), [0, 1, 3]);
        // An engine's prefix lookup: a held prefix, then a tail gone.
        assert_eq!(missed([true, true, false, false, false, false]), [2]);
        assert_eq!(missed([false; 6]), [0]);
        assert_eq!(missed([true, false, true, false, false, false]), [1, 3]);
        assert!(missed([true; 6]).is_empty());
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
        assert_eq!(
            misses.held(),
            (2, 0),
            "kept for a writer that stores them again"
        );
    }

    #[test]
    fn a_block_stored_again_returns_to_the_daemon_that_evicted_it_last() {
        let misses = Misses::new(100);
        misses.evicted(1, &key(1));
        misses.evicted(2, &key(2));
        misses.evicted(3, &key(1));
        // A reader missed both first: they are still known to the writer.
        misses.missed(&ns(), &[key(1).hash, key(2).hash]);
        let hashes = [key(1).hash, key(2).hash, key(4).hash];
        assert_eq!(misses.returning(&ns(), &hashes), [Some(3), Some(2), None]);
        assert_eq!(
            misses.returning(&ns(), &hashes),
            [None, None, None],
            "stored again, no longer an eviction"
        );
        let other = Namespace::new("u").unwrap();
        misses.evicted(1, &key(5));
        assert_eq!(misses.returning(&other, &[key(5).hash]), [None]);
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
        assert_eq!(misses.held(), (keys.len(), 10));
        misses.forget(3);
        assert_eq!(
            misses.held(),
            (keys.len(), 0),
            "a daemon gone is told nothing"
        );
    }
}
