//! The daemon's tiers together: DRAM first, NVMe second. Evicted DRAM blocks
//! are demoted to NVMe (their bytes copied out before the space is freed,
//! written by a background task); NVMe hits are served from the device and
//! promoted back to DRAM after a configurable number of hits. A block may be
//! in both tiers; it leaves the daemon (and the meta service is told) only
//! when no tier holds it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_proto::BlockKey;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::nvme::NvmeTier;
use crate::pool::{Demoted, DramPool};

/// Blocks waiting to be written to NVMe: beyond this, demotion drops them.
const DEMOTION_QUEUE: usize = 64;
/// Hit counts kept for promotion; past this many blocks the counts restart.
const MAX_TRACKED_HITS: usize = 1 << 20;

pub struct Tiers {
    pub dram: Arc<DramPool>,
    pub nvme: Option<Arc<NvmeTier>>,
    promote_after: u32,
    hits: Mutex<HashMap<BlockKey, u32>>,
    nvme_hits: AtomicU64,
    nvme_misses: AtomicU64,
    promotions: AtomicU64,
}

impl Tiers {
    pub fn dram_only(dram: Arc<DramPool>) -> Arc<Self> {
        Arc::new(Tiers {
            dram,
            nvme: None,
            promote_after: 0,
            hits: Mutex::new(HashMap::new()),
            nvme_hits: AtomicU64::new(0),
            nvme_misses: AtomicU64::new(0),
            promotions: AtomicU64::new(0),
        })
    }

    /// DRAM over NVMe, with demotion on eviction; a block read from NVMe
    /// `promote_after` times goes back to DRAM (0: never).
    pub fn with_nvme(
        dram: Arc<DramPool>,
        nvme: Arc<NvmeTier>,
        promote_after: u32,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(DEMOTION_QUEUE);
        dram.demote_to(tx);
        let tiers = Arc::new(Tiers {
            dram,
            nvme: Some(nvme),
            promote_after,
            hits: Mutex::new(HashMap::new()),
            nvme_hits: AtomicU64::new(0),
            nvme_misses: AtomicU64::new(0),
            promotions: AtomicU64::new(0),
        });
        tokio::spawn(demoter(tiers.clone(), rx, shutdown));
        tiers
    }

    /// Backpressure for writers: when a put of `size` bytes would make DRAM
    /// evict, wait (at most `limit`) until the demotion queue has room, so
    /// that evicted blocks go to NVMe at its speed instead of being dropped.
    pub async fn room_to_demote(&self, size: u64, limit: std::time::Duration) {
        if self.nvme.is_none() || !self.dram.would_evict(size) {
            return;
        }
        let deadline = tokio::time::Instant::now() + limit;
        while self
            .dram
            .demotion_room()
            .is_some_and(|room| room < DEMOTION_QUEUE / 4)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// A block from NVMe (DRAM missed it): its bytes and checksum.
    pub async fn get_nvme(&self, key: &BlockKey) -> Option<(Vec<u8>, u64)> {
        let nvme = self.nvme.as_ref()?;
        let found = match nvme.get(key).await {
            Ok(found) => found,
            Err(err) => {
                tracing::warn!(%key, %err, "NVMe read failed; a miss");
                None
            }
        };
        let Some((bytes, sum)) = found else {
            self.nvme_misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        self.nvme_hits.fetch_add(1, Ordering::Relaxed);
        let room = self.dram.demotion_room().unwrap_or(0);
        if self.promote_after > 0
            && self.count_hit(key) >= self.promote_after
            && room >= DEMOTION_QUEUE / 4
        {
            self.promote(key, &bytes, sum);
        }
        Some((bytes, sum))
    }

    fn count_hit(&self, key: &BlockKey) -> u32 {
        let mut hits = self.hits.lock();
        if hits.len() >= MAX_TRACKED_HITS {
            hits.clear();
        }
        let n = hits.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    }

    /// Copies a hot block back into DRAM (it stays on NVMe too).
    fn promote(&self, key: &BlockKey, bytes: &[u8], sum: u64) {
        self.hits.lock().remove(key);
        if let Ok(mut slot) = self.dram.reserve(key.clone(), bytes.len() as u64, sum) {
            slot.buf_mut().copy_from_slice(bytes);
            if slot.commit().is_ok() {
                self.promotions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.dram.contains(key) || self.nvme.as_ref().is_some_and(|n| n.contains(key))
    }

    /// Removes a block from every tier; `false` if none held it.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let in_dram = self.dram.remove(key).is_ok();
        let on_nvme = self.nvme.as_ref().is_some_and(|n| {
            n.remove(key).unwrap_or_else(|err| {
                tracing::warn!(%key, %err, "NVMe removal failed");
                false
            })
        });
        in_dram || on_nvme
    }

    /// Every block the daemon holds, in any tier: (key, size, checksum).
    pub fn inventory(&self) -> Vec<(BlockKey, u32, u64)> {
        let mut all = self.dram.inventory();
        if let Some(nvme) = &self.nvme {
            let in_dram: std::collections::HashSet<BlockKey> =
                all.iter().map(|(k, _, _)| k.clone()).collect();
            all.extend(
                nvme.inventory()
                    .into_iter()
                    .filter(|(k, _, _)| !in_dram.contains(k)),
            );
        }
        all
    }

    pub fn nvme_gets(&self) -> (u64, u64) {
        (
            self.nvme_hits.load(Ordering::Relaxed),
            self.nvme_misses.load(Ordering::Relaxed),
        )
    }

    pub fn promotions(&self) -> u64 {
        self.promotions.load(Ordering::Relaxed)
    }
}

/// Writes demoted blocks to NVMe; a block that cannot be written, or that
/// NVMe evicts and DRAM does not hold, is reported gone.
async fn demoter(tiers: Arc<Tiers>, mut rx: mpsc::Receiver<Demoted>, shutdown: CancellationToken) {
    let nvme = tiers.nvme.clone().expect("a demoter has an NVMe tier");
    loop {
        // Blocks evicted while the queue was full leave the daemon only if
        // no tier holds them.
        for key in tiers.dram.take_overflow() {
            if !tiers.contains(&key) {
                tiers.dram.report_removed(key);
            }
        }
        let demoted = tokio::select! {
            d = rx.recv() => match d { Some(d) => d, None => return },
            _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => continue,
            _ = shutdown.cancelled() => return,
        };
        let written = nvme
            .put(&demoted.key, &demoted.bytes, demoted.checksum)
            .await;
        tiers.dram.demotion_done(demoted.bytes.len() as u64);
        match written {
            Ok(evicted) => {
                for key in evicted {
                    if !tiers.dram.contains(&key) {
                        tiers.dram.report_removed(key);
                    }
                }
            }
            Err(err) => {
                tracing::warn!(key = %demoted.key, %err, "demotion to NVMe failed; block dropped");
                if !tiers.dram.contains(&demoted.key) {
                    tiers.dram.report_removed(demoted.key);
                }
            }
        }
    }
}
