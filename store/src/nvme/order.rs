//! What a drive drops when it needs room: the NVMe tier's eviction order,
//! shared with `simulate --nvme` so that what it predicts is what a drive
//! does.
//!
//! Under [`Eviction::Lru`] the least recently used block goes. Under
//! [`Eviction::TwoQ`] the drive continues the DRAM pool's 2Q over its own,
//! larger capacity: a block that left DRAM's *main* queue (it was read, or
//! admitted as reused) enters the drive's main part, and one that left
//! DRAM's probation unread enters the drive's probation. A read from the
//! drive moves a block to main; a block the drive dropped that is demoted
//! again (it came back, was stored again and left DRAM) enters main, as a
//! ghost hit does in DRAM; so does a block read while it was on its way
//! to the drive (`DramPool::read_on_its_way`). The drive evicts from probation while it holds
//! more than `probation_share` of the drive, else its least recently used
//! block of either part, as DRAM's 2Q does: probation may fill a drive
//! whose main part is still empty, so no room is wasted.
//!
//! Without it a drive is an LRU of everything DRAM evicts, and the
//! documents that one-off requests push out of DRAM's main queue are
//! pushed out of the drive by the same one-off blocks a little later
//! (docs/benchmarks.md, "A drive behind the pool").
//!
//! Each block's place is kept by the caller beside its record
//! ([`Place`]); the order holds the stamps and the ghosts. Every operation
//! is O(log n) in the blocks held; nothing scans.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasher;

use mooncake_proto::BlockKey;

use crate::pool::Eviction;

/// Keys of dropped blocks remembered per block held, and at least this
/// many: as DRAM's pool. A ghost costs about 40 bytes of the daemon's
/// memory, so four per block add about 150 bytes to the 200 or so the
/// drive's index takes per block. On the Mooncake trace one per block
/// lost 0.2-0.4 point, on chat 0.5.
const GHOSTS_PER_BLOCK: usize = 4;
const MIN_GHOSTS: usize = 1024;

/// Where a block is in the order: its last use, and its part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    stamp: u64,
    probation: bool,
}

/// What a drive's 2Q did since it opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriveEvents {
    /// Blocks that entered probation (they left DRAM's probation unread).
    pub probation_admitted: u64,
    /// Probation blocks read from the drive, moved to main.
    pub promoted: u64,
    /// Blocks the drive dropped that were demoted again: main at once.
    pub ghost_hits: u64,
}

/// The order of one drive (see the module).
pub struct DriveOrder {
    order: Eviction,
    events: DriveEvents,
    /// Bytes probation may hold before it gives way.
    probation_target: u64,
    probation_bytes: u64,
    clock: u64,
    probation: BTreeMap<u64, BlockKey>,
    main: BTreeMap<u64, BlockKey>,
    ghosts: Ghosts,
}

impl std::fmt::Debug for DriveOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriveOrder")
            .field("order", &self.order)
            .field("probation", &self.probation.len())
            .field("main", &self.main.len())
            .finish()
    }
}

impl Place {
    /// When the block was last used, on the order's clock.
    pub fn stamp(&self) -> u64 {
        self.stamp
    }
}

impl DriveOrder {
    /// The order of a drive of `capacity` bytes (a simulation may count in
    /// blocks: any unit, the same as `insert`'s).
    pub fn new(order: Eviction, probation_share: f64, capacity: u64) -> DriveOrder {
        DriveOrder {
            order,
            events: DriveEvents::default(),
            probation_target: (capacity as f64 * probation_share) as u64,
            probation_bytes: 0,
            clock: 0,
            probation: BTreeMap::new(),
            main: BTreeMap::new(),
            ghosts: Ghosts::default(),
        }
    }

    pub fn eviction(&self) -> Eviction {
        self.order
    }

    pub fn events(&self) -> DriveEvents {
        self.events
    }

    /// Bytes in probation, and the most it holds before its own blocks go
    /// first.
    pub fn probation(&self) -> (u64, u64) {
        (self.probation_bytes, self.probation_target)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.probation.len() + self.main.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A block of `bytes` stored on the drive. `hot`: it left DRAM's main
    /// queue (read, or admitted as reused), or it was recovered from the
    /// index on open.
    pub fn insert(&mut self, key: &BlockKey, bytes: u64, hot: bool) -> Place {
        let came_back = self.order == Eviction::TwoQ && self.ghosts.take(key);
        let probation = self.order == Eviction::TwoQ && !hot && !came_back;
        self.events.ghost_hits += u64::from(came_back);
        self.events.probation_admitted += u64::from(probation);
        self.place(key.clone(), bytes, probation)
    }

    /// A block was read: it is the most recently used, in main.
    pub fn touch(&mut self, key: &BlockKey, place: Place, bytes: u64) -> Place {
        self.events.promoted += u64::from(place.probation);
        self.take(place, bytes);
        self.place(key.clone(), bytes, false)
    }

    /// A block passed over for eviction (a lease holds it): it goes to the
    /// most recent end of its own part, counted as nothing.
    pub fn pass_over(&mut self, key: &BlockKey, place: Place, bytes: u64) -> Place {
        self.take(place, bytes);
        self.place(key.clone(), bytes, place.probation)
    }

    /// A block leaves the drive; `evicted`: it was dropped for room (the
    /// order remembers it), not removed.
    pub fn remove(&mut self, key: &BlockKey, place: Place, bytes: u64, evicted: bool) {
        self.take(place, bytes);
        if evicted && self.order == Eviction::TwoQ {
            let cap = (self.len() * GHOSTS_PER_BLOCK).max(MIN_GHOSTS);
            self.ghosts.remember(key, cap);
        }
    }

    /// The block to evict next: probation's least recently used while
    /// probation holds more than its share, else the least recently used
    /// of the drive.
    pub fn victim(&self) -> Option<&BlockKey> {
        let (probation, main) = (
            self.probation.first_key_value(),
            self.main.first_key_value(),
        );
        let next = match self.probation_bytes > self.probation_target {
            true => probation.or(main),
            false => [probation, main]
                .into_iter()
                .flatten()
                .min_by_key(|(s, _)| **s),
        };
        next.map(|(_, key)| key)
    }

    /// Blocks from the first to evict on: probation's, then main's, each
    /// least recently used first (a tenant over its quota looks here for
    /// its own).
    pub fn coldest(&self) -> impl Iterator<Item = &BlockKey> {
        self.probation.values().chain(self.main.values())
    }

    fn place(&mut self, key: BlockKey, bytes: u64, probation: bool) -> Place {
        self.clock += 1;
        let stamp = self.clock;
        if probation {
            self.probation_bytes += bytes;
            self.probation.insert(stamp, key);
        } else {
            self.main.insert(stamp, key);
        }
        Place { stamp, probation }
    }

    fn take(&mut self, place: Place, bytes: u64) {
        if place.probation {
            if self.probation.remove(&place.stamp).is_some() {
                self.probation_bytes -= bytes;
            }
        } else {
            self.main.remove(&place.stamp);
        }
    }
}

/// Blocks the drive dropped recently, by a seeded 64-bit fingerprint of
/// the key (two keys sharing one, about one pair in 2^64, only make one
/// look recently dropped), oldest first.
#[derive(Default)]
struct Ghosts {
    seed: foldhash::quality::RandomState,
    /// Fingerprints with the number of their latest entry in `order`.
    entries: HashMap<u64, u64, foldhash::quality::RandomState>,
    order: VecDeque<(u64, u64)>,
    next: u64,
}

impl Ghosts {
    fn remember(&mut self, key: &BlockKey, cap: usize) {
        let f = self.seed.hash_one(key);
        self.next += 1;
        self.entries.insert(f, self.next);
        self.order.push_back((f, self.next));
        while self.order.len() > cap {
            if let Some((old, n)) = self.order.pop_front() {
                // Only the latest entry of a fingerprint forgets it.
                if self.entries.get(&old) == Some(&n) {
                    self.entries.remove(&old);
                }
            }
        }
    }

    /// Whether `key` was dropped recently; forgets it.
    fn take(&mut self, key: &BlockKey) -> bool {
        let f = self.seed.hash_one(key);
        self.entries.remove(&f).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(i: u64) -> BlockKey {
        BlockKey::new(
            Namespace::new("drive").unwrap(),
            BlockHash::from_opaque(&i.to_le_bytes()),
        )
    }

    /// Stores `ids` in a drive of `capacity` one-unit blocks, evicting as
    /// a drive does; returns what it holds.
    struct Drive {
        order: DriveOrder,
        places: HashMap<BlockKey, Place>,
        capacity: usize,
    }

    impl Drive {
        fn new(order: Eviction, capacity: usize) -> Drive {
            Drive {
                order: DriveOrder::new(order, 0.25, capacity as u64),
                places: HashMap::new(),
                capacity,
            }
        }

        fn put(&mut self, i: u64, hot: bool) {
            let k = key(i);
            if self.places.contains_key(&k) {
                return;
            }
            while self.places.len() >= self.capacity {
                let victim = self.order.victim().unwrap().clone();
                let place = self.places.remove(&victim).unwrap();
                self.order.remove(&victim, place, 1, true);
            }
            let place = self.order.insert(&k, 1, hot);
            self.places.insert(k, place);
        }

        fn read(&mut self, i: u64) -> bool {
            let k = key(i);
            let Some(place) = self.places.get(&k).copied() else {
                return false;
            };
            let place = self.order.touch(&k, place, 1);
            self.places.insert(k, place);
            true
        }

        fn holds(&self, i: u64) -> bool {
            self.places.contains_key(&key(i))
        }
    }

    #[test]
    fn one_off_blocks_pass_through_probation_and_spare_main() {
        // A drive of 8, probation 2: two hot blocks, then a flood of 20
        // cold ones. Under 2Q the cold ones evict each other; under LRU
        // they push the hot ones out.
        for (order, kept) in [(Eviction::TwoQ, true), (Eviction::Lru, false)] {
            let mut d = Drive::new(order, 8);
            d.put(1, true);
            d.put(2, true);
            for i in 100..120 {
                d.put(i, false);
            }
            assert_eq!(d.holds(1) && d.holds(2), kept, "{order}");
            assert_eq!(d.order.len(), 8);
        }
    }

    #[test]
    fn probation_fills_a_drive_whose_main_part_is_empty() {
        let mut d = Drive::new(Eviction::TwoQ, 8);
        for i in 0..8 {
            d.put(i, false);
        }
        assert!((0..8).all(|i| d.holds(i)), "no room left unused");
        // A ninth evicts the least recently used; a read saves a block.
        assert!(d.read(0));
        d.put(8, false);
        assert!(d.holds(0) && !d.holds(1) && d.holds(8));
    }

    #[test]
    fn a_block_read_on_the_drive_or_dropped_and_demoted_again_enters_main() {
        let mut d = Drive::new(Eviction::TwoQ, 8);
        // Block 1 read from probation: main.
        d.put(1, false);
        assert!(d.read(1));
        // Block 2 dropped by a flood, then demoted again cold: it came
        // back, so main.
        d.put(2, false);
        for i in 100..110 {
            d.put(i, false);
        }
        assert!(!d.holds(2));
        d.put(2, false);
        for i in 200..220 {
            d.put(i, false);
        }
        assert!(d.holds(1), "read on the drive: main");
        assert!(d.holds(2), "dropped and back: main");
        // A drive's own removal is no eviction: the block is not a ghost.
        let mut d = Drive::new(Eviction::TwoQ, 8);
        d.put(3, false);
        let place = d.places.remove(&key(3)).unwrap();
        d.order.remove(&key(3), place, 1, false);
        d.put(3, false);
        for i in 300..320 {
            d.put(i, false);
        }
        assert!(!d.holds(3));
    }

    #[test]
    fn within_its_share_probation_gives_way_by_age_as_main_does() {
        let mut order = DriveOrder::new(Eviction::TwoQ, 0.25, 8);
        order.insert(&key(1), 1, false);
        order.insert(&key(2), 1, true);
        // Probation holds 1 of its 2: the drive's oldest block goes, though
        // it is probation's.
        assert_eq!(order.victim(), Some(&key(1)));
    }

    #[test]
    fn the_victim_is_probations_oldest_only_past_its_share() {
        let mut order = DriveOrder::new(Eviction::TwoQ, 0.25, 8);
        let main = order.insert(&key(1), 1, true);
        order.insert(&key(2), 1, false);
        // Probation holds 1 of its 2: main's oldest goes first.
        assert_eq!(order.victim(), Some(&key(1)));
        order.insert(&key(3), 1, false);
        order.insert(&key(4), 1, false);
        assert_eq!(order.victim(), Some(&key(2)));
        assert_eq!(
            order.coldest().cloned().collect::<Vec<_>>(),
            vec![key(2), key(3), key(4), key(1)]
        );
        order.remove(&key(1), main, 1, true);
        assert_eq!(order.len(), 3);
    }
}
