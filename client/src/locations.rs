//! Where blocks were last seen, learned from puts, lookups and prefix
//! matches, so that a get of a known block goes straight to its daemon in
//! one round trip. A cached location is only a hint: the daemon answers for
//! what it holds, every byte is checked against its checksum, and a stale
//! hint costs one extra lookup at the meta service, never a wrong block.
//! A hint this client reads often (more than `REREAD` times) is looked up
//! again once it is `ttl` old: that is how readers find the copies the meta
//! service adds to a block that turned hot, while a block read now and
//! then keeps its hint (and its get keeps its single round trip).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mooncake_proto::message::Location;
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use parking_lot::Mutex;

/// Reads of one hint after which it is looked up again once `ttl` old.
const REREAD: u32 = 8;

/// A location, when it was learned, and how often it was read since.
#[derive(Clone, Copy)]
struct Hint {
    location: Location,
    learned: Instant,
    reads: u32,
}

impl Hint {
    fn new(location: Location, learned: Instant) -> Self {
        Hint {
            location,
            learned,
            reads: 0,
        }
    }
}

/// Block keys are hashes already: a cheap hash of them spreads well, and
/// SipHash cost more than the rest of an insert.
type Map = HashMap<BlockKey, Hint, rustc_hash::FxBuildHasher>;

pub struct LocationCache {
    capacity: usize,
    ttl: Duration,
    map: Mutex<Map>,
}

impl LocationCache {
    /// At most `capacity` entries (0 disables the cache). When full, it is
    /// emptied and refilled by later calls: memory stays bounded, and a
    /// forgotten hint only costs a lookup.
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        LocationCache {
            capacity,
            ttl,
            map: Mutex::new(Map::default()),
        }
    }

    /// The hint for `key`; `None` too for one read often and `ttl` old.
    pub fn get(&self, key: &BlockKey) -> Option<Location> {
        if self.capacity == 0 {
            return None;
        }
        let mut map = self.map.lock();
        let hint = map.get_mut(key)?;
        hint.reads = hint.reads.saturating_add(1);
        if hint.reads > REREAD && hint.learned.elapsed() >= self.ttl {
            return None;
        }
        Some(hint.location)
    }

    pub fn insert(&self, key: BlockKey, location: Location) {
        if self.capacity == 0 {
            return;
        }
        let mut map = self.map.lock();
        if map.len() >= self.capacity {
            map.clear();
        }
        map.insert(key, Hint::new(location, Instant::now()));
    }

    /// Inserts the located blocks of a batch under one lock (a prefix
    /// match brings back up to thousands).
    pub fn insert_batch<'a>(
        &self,
        namespace: &Namespace,
        found: impl Iterator<Item = (&'a BlockHash, &'a Option<Location>)>,
    ) {
        if self.capacity == 0 {
            return;
        }
        let mut map = self.map.lock();
        let now = Instant::now();
        for (hash, location) in found {
            let Some(location) = location else { continue };
            if map.len() >= self.capacity {
                map.clear();
            }
            map.insert(
                BlockKey::new(namespace.clone(), *hash),
                Hint::new(*location, now),
            );
        }
    }

    /// The daemons holding `key` as last seen, without counting a read.
    pub fn peek_daemons(&self, namespace: &Namespace, hashes: &[BlockHash]) -> Vec<Vec<u32>> {
        let map = self.map.lock();
        hashes
            .iter()
            .map(|h| {
                let key = BlockKey::new(namespace.clone(), *h);
                map.get(&key)
                    .map_or_else(Vec::new, |hint| hint.location.daemons.iter().collect())
            })
            .collect()
    }

    pub fn forget(&self, key: &BlockKey) {
        self.map.lock().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(i: u8) -> BlockKey {
        BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]))
    }

    fn loc() -> Location {
        Location::on(1, 2, 3)
    }

    #[test]
    fn stays_within_capacity_and_forgets() {
        let c = LocationCache::new(2, Duration::from_secs(60));
        c.insert(key(1), loc());
        c.insert(key(2), loc());
        assert_eq!(c.get(&key(1)), Some(loc()));
        c.insert(key(3), loc());
        assert!(c.map.lock().len() <= 2);
        assert_eq!(c.get(&key(3)), Some(loc()));
        c.forget(&key(3));
        assert_eq!(c.get(&key(3)), None);
        let off = LocationCache::new(0, Duration::from_secs(60));
        off.insert(key(1), loc());
        assert_eq!(off.get(&key(1)), None);
        let aged = LocationCache::new(2, Duration::ZERO);
        aged.insert(key(1), loc());
        for _ in 0..REREAD {
            assert_eq!(aged.get(&key(1)), Some(loc()), "read now and then: kept");
        }
        assert_eq!(
            aged.get(&key(1)),
            None,
            "read often and past its ttl: looked up again"
        );
        aged.insert(key(1), loc());
        assert_eq!(aged.get(&key(1)), Some(loc()), "learned again");
    }

    #[test]
    fn a_peek_names_the_daemons_and_counts_no_read() {
        let c = LocationCache::new(4, Duration::ZERO);
        c.insert(key(1), loc());
        let ns = key(1).namespace;
        for _ in 0..2 * REREAD {
            let seen = c.peek_daemons(&ns, &[key(1).hash, key(2).hash]);
            assert_eq!(seen, vec![vec![1], vec![]]);
        }
        for _ in 0..REREAD {
            assert_eq!(c.get(&key(1)), Some(loc()), "peeks were not reads");
        }
    }
}
