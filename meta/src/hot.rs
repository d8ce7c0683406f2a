//! Hot blocks spread by themselves. Each heartbeat carries the blocks its
//! daemon served most since the last one; a block read at least
//! `hot_reads` times a second there is hot: it is given `hot_copies`
//! copies (on distinct hosts, as many as there are), which the repair task
//! makes at its pace, and clients find them when their cached location
//! expires (`location_ttl`). A block not reported hot for `hot_cool` cools:
//! it goes back to the copies its writer asked for, and the extra ones are
//! dropped. At most `hot_blocks` blocks are hot at once.

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
