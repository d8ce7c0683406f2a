//! Hot blocks spread by themselves. Each heartbeat carries the blocks its
//! daemon served most since the last one; a block read at least
//! `hot_reads` times a second there is hot: it is given `hot_copies`
//! copies (on distinct hosts, as many as there are), which the repair task
//! makes at its pace; a client that reads it often looks its location up
//! again once that is `location_ttl` old, and finds them. A block not reported hot for `hot_cool` cools:
//! it goes back to the copies its writer asked for, and the extra ones are
//! dropped. At most `hot_blocks` blocks are hot at once, and the copies
//! they were given take at most `hot_share` of any daemon's pool.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mooncake_proto::message::Copies;
use mooncake_proto::BlockKey;
use parking_lot::Mutex;

use crate::index::Index;

#[derive(Debug, Clone)]
pub struct HotConfig {
    /// Reads a second at one daemon that make a block hot; 0: none is.
    pub reads_per_sec: u64,
    /// Copies a hot block gets.
    pub copies: u8,
    /// A hot block not reported hot for this long cools.
    pub cool: Duration,
    /// Most blocks hot at once.
    pub max_blocks: usize,
    /// Most of a daemon's pool the copies given to hot blocks may take.
    pub share: f64,
}

struct HotBlock {
    /// The copies its writer asked for, which it goes back to.
    base: u8,
    last_hot: Instant,
}

pub struct Hot {
    cfg: HotConfig,
    blocks: Mutex<HashMap<BlockKey, HotBlock>>,
    /// Blocks made hot and cooled this term, for the metrics.
    pub heated: AtomicU64,
    pub cooled: AtomicU64,
}

impl Hot {
    pub fn new(cfg: HotConfig) -> Self {
        Hot {
            cfg,
            blocks: Mutex::new(HashMap::new()),
            heated: AtomicU64::new(0),
            cooled: AtomicU64::new(0),
        }
    }

    fn enabled(&self) -> bool {
        self.cfg.reads_per_sec > 0 && self.cfg.copies > 1
    }

    /// Blocks hot now.
    pub fn len(&self) -> usize {
        self.blocks.lock().len()
    }

    pub fn is_hot(&self, key: &BlockKey) -> bool {
        self.blocks.lock().contains_key(key)
    }

    /// Whether `daemon` (of `capacity` bytes) may take another copy of
    /// `size` bytes for a hot block: the copies beyond what their writers
    /// asked for that it holds, added up from the index (at most
    /// `max_blocks` lookups; hot copies are made seldom), stay within
    /// `share` of its pool.
    pub fn has_room(&self, index: &Index, daemon: u32, capacity: u64, size: u64) -> bool {
        let budget = (capacity as f64 * self.cfg.share) as u64;
        let blocks: Vec<(BlockKey, u8)> = self
            .blocks
            .lock()
            .iter()
            .map(|(k, b)| (k.clone(), b.base))
            .collect();
        let mut held = 0u64;
        for (key, base) in blocks {
            if let Some(location) = index.lookup(&key.namespace, &[key.hash])[0] {
                let extra =
                    &location.daemons.as_slice()[usize::from(base).min(location.daemons.len())..];
                if extra.contains(&daemon) {
                    held += u64::from(location.size);
                }
            }
        }
        held + size <= budget
    }

    /// A daemon's report: `reads` of its most read blocks over `secs`, in
    /// a cluster of `hosts` hosts. Returns the blocks that just turned hot
    /// (their wanted copies raised): the repair task makes the copies.
    pub fn observe(
        &self,
        index: &Index,
        hosts: usize,
        reads: &[(BlockKey, u32)],
        secs: f64,
        now: Instant,
    ) -> Vec<BlockKey> {
        if !self.enabled() || secs <= 0.0 {
            return Vec::new();
        }
        let want = self.cfg.copies.min(hosts.min(u8::MAX as usize) as u8);
        let mut heated = Vec::new();
        let mut blocks = self.blocks.lock();
        for (key, n) in reads {
            if f64::from(*n) / secs < self.cfg.reads_per_sec as f64 {
                continue;
            }
            if let Some(b) = blocks.get_mut(key) {
                b.last_hot = now;
                continue;
            }
            if blocks.len() >= self.cfg.max_blocks {
                continue;
            }
            if let Some(base) = index.raise_want(key, want) {
                blocks.insert(
                    key.clone(),
                    HotBlock {
                        base,
                        last_hot: now,
                    },
                );
                heated.push(key.clone());
            }
        }
        self.heated
            .fetch_add(heated.len() as u64, Ordering::Relaxed);
        heated
    }

    /// Cools the blocks not reported hot lately; returns each with the
    /// extra copies taken out of the index, which their daemons drop.
    pub fn cool(&self, index: &Index, now: Instant) -> Vec<(BlockKey, Copies)> {
        let mut out = Vec::new();
        self.blocks.lock().retain(|key, b| {
            if now.duration_since(b.last_hot) < self.cfg.cool {
                return true;
            }
            let extra = index.lower_want(key, b.base);
            if !extra.is_empty() {
                out.push((key.clone(), extra));
            }
            self.cooled.fetch_add(1, Ordering::Relaxed);
            false
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clients::Client;
    use crate::index::none_leaving;
    use mooncake_proto::message::CommitItem;
    use mooncake_proto::{BlockHash, Namespace};

    fn hot(share: f64) -> Hot {
        Hot::new(HotConfig {
            reads_per_sec: 10,
            copies: 3,
            cool: Duration::from_secs(1),
            max_blocks: 8,
            share,
        })
    }

    /// A visible block of 10 bytes on daemon 1, wanting one copy.
    fn stored(index: &Index, i: u8) -> BlockKey {
        let key = BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]));
        let client = Client::of([10, 0, 0, 1].into());
        index.reserve(
            &key.namespace,
            key.hash,
            (10, Copies::one(1), 1),
            client,
            Instant::now(),
        );
        let item = CommitItem {
            hash: key.hash,
            stored_on: Copies::one(1),
            size: 10,
            checksum: 7,
            parent: None,
            tag: None,
        };
        index.commit(&key.namespace, &item);
        key
    }

    #[test]
    fn a_block_read_often_enough_turns_hot_within_its_budget_and_cools() {
        let (index, hot) = (Index::new(), hot(0.1));
        let (a, b) = (stored(&index, 1), stored(&index, 2));
        let t = Instant::now();
        // 30 reads in 1 s is hot; 5 is not.
        let heated = hot.observe(&index, 3, &[(a.clone(), 30), (b.clone(), 5)], 1.0, t);
        assert_eq!(heated, vec![a.clone()]);
        assert!(hot.is_hot(&a) && !hot.is_hot(&b));
        assert_eq!(
            index
                .short_of_copies(&a, &none_leaving)
                .map(|(_, want)| want),
            Some(3)
        );
        // Daemon 2 gets a hot copy of 10 bytes: its 10% of 100 is taken.
        assert!(hot.has_room(&index, 2, 100, 10));
        assert!(index.add_copy(&a, (2, 10, 7), &none_leaving));
        assert!(!hot.has_room(&index, 2, 100, 10), "its share is used");
        assert!(hot.has_room(&index, 3, 100, 10), "another daemon's is not");
        assert!(
            hot.has_room(&index, 1, 100, 10),
            "the writer's copy is no hot copy"
        );
        // Reported hot again, it stays; then it cools and drops the copy.
        assert!(hot
            .observe(&index, 3, &[(a.clone(), 30)], 1.0, t)
            .is_empty());
        assert!(hot.cool(&index, t + Duration::from_millis(500)).is_empty());
        let cooled = hot.cool(&index, t + Duration::from_secs(2));
        assert_eq!(cooled, vec![(a.clone(), Copies::one(2))]);
        let loc = index.lookup(&a.namespace, &[a.hash])[0].unwrap();
        assert_eq!(loc.daemons, Copies::one(1));
        assert_eq!(hot.len(), 0);
    }
}
