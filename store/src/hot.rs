//! Which blocks this daemon serves most, told to the meta service with each
//! heartbeat so that it can give hot blocks more copies. One read in
//! `SAMPLE` is counted (a get stays one atomic add), in a table of at most
//! `MAX_KEYS` blocks (a block first seen when it is full is not counted:
//! the hot ones are counted long before).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_proto::BlockKey;
use parking_lot::Mutex;

/// One read in this many is counted.
const SAMPLE: u64 = 4;
/// Most blocks counted between two heartbeats.
const MAX_KEYS: usize = 4096;
/// Most blocks a heartbeat reports.
pub const TOP: usize = 32;

#[derive(Default)]
pub struct HotReads {
    counts: Mutex<HashMap<BlockKey, u32>>,
    reads: AtomicU64,
}

impl HotReads {
    /// A client read `key`.
    pub fn note(&self, key: &BlockKey) {
        if self.reads.fetch_add(1, Ordering::Relaxed) % SAMPLE != 0 {
            return;
        }
        let mut counts = self.counts.lock();
        if let Some(n) = counts.get_mut(key) {
            *n = n.saturating_add(1);
        } else if counts.len() < MAX_KEYS {
            counts.insert(key.clone(), 1);
        }
    }

    /// The most read blocks since the last call, hottest first, with about
    /// how many reads each had; the counts start again.
    pub fn take_top(&self) -> Vec<(BlockKey, u32)> {
        let counts = std::mem::take(&mut *self.counts.lock());
        let mut top: Vec<(BlockKey, u32)> = counts.into_iter().collect();
        top.sort_unstable_by_key(|(_, n)| std::cmp::Reverse(*n));
        top.truncate(TOP);
        for (_, n) in &mut top {
            *n = n.saturating_mul(SAMPLE as u32);
        }
        top
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(i: u32) -> BlockKey {
        BlockKey::new(
            Namespace::new("t").unwrap(),
            BlockHash::from_opaque(&i.to_le_bytes()),
        )
    }

    #[test]
    fn the_most_read_blocks_come_first_and_counts_start_again() {
        let hot = HotReads::default();
        for _ in 0..400 {
            hot.note(&key(1));
        }
        for i in 0..200 {
            hot.note(&key(2 + i / 100));
        }
        let top = hot.take_top();
        assert_eq!(top[0].0, key(1));
        assert_eq!(top[0].1, 400, "sampled, then scaled back");
        assert_eq!((top.len(), top[1].1, top[2].1), (3, 100, 100));
        assert!(hot.take_top().is_empty(), "counts start again");
    }
}
