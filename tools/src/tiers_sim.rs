//! Two tiers offline: the daemon's DRAM pool (its own code, as `simulate`
//! drives it) with an NVMe tier behind it, kept as the daemon's NVMe tier
//! keeps its blocks (the drive's own eviction order, `nvme::DriveOrder`,
//! fed by the pool's demotions, read when DRAM misses, a block read
//! `promote_after` times copied back into DRAM). It answers what a drive
//! behind the pool buys, under each order, and which demoted blocks are
//! worth a drive's write.

use std::collections::HashMap;

use mooncake_proto::{BlockHash, BlockKey};
use mooncake_store_daemon::nvme::{DriveOrder, Place};
use mooncake_store_daemon::pool::{Demoted, Eviction};

use crate::trace::{Pool, Request, SimPool, SimResult};

/// Which evicted blocks go to the drive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Demote {
    /// Every evicted block (the daemon).
    All,
    /// Only blocks read while they were in DRAM; a block written and
    /// never read is dropped.
    Read,
}

/// The drive behind the pool.
#[derive(Debug, Clone, Copy)]
pub struct Nvme {
    /// Blocks it holds.
    pub capacity: usize,
    pub promote_after: u32,
    pub demote: Demote,
    /// The drive's order (the daemon's follows its `eviction`).
    pub order: Eviction,
    /// Under 2Q, probation's share of the drive (the daemon's
    /// `probation_share`).
    pub probation_share: f64,
}

/// A two-tier run: hits as `SimResult` counts them (a block in either tier
/// is a hit), and what the drive did.
#[derive(Debug, Default, Clone, Copy)]
pub struct TierResult {
    pub hits: SimResult,
    /// Blocks read from the drive (DRAM missed them).
    pub nvme_hits: u64,
    /// Blocks written to the drive.
    pub nvme_writes: u64,
}

/// The drive: its blocks, one unit each, in the daemon's order.
struct Drive {
    order: DriveOrder,
    places: HashMap<BlockKey, Place>,
    capacity: usize,
}

impl Drive {
    fn new(nvme: &Nvme) -> Drive {
        Drive {
            order: DriveOrder::new(nvme.order, nvme.probation_share, nvme.capacity as u64),
            places: HashMap::new(),
            capacity: nvme.capacity,
        }
    }

    fn contains(&self, key: &BlockKey) -> bool {
        self.places.contains_key(key)
    }

    /// A read from the drive.
    fn touch(&mut self, key: &BlockKey) {
        if let Some(place) = self.places.get_mut(key) {
            *place = self.order.touch(key, *place, 1);
        }
    }

    /// A demoted block; `true` if written.
    fn demote(&mut self, d: &Demoted, demote: Demote) -> bool {
        if self.contains(&d.key) || self.capacity == 0 || (demote == Demote::Read && !d.read) {
            return false;
        }
        while self.places.len() >= self.capacity {
            let Some(victim) = self.order.victim().cloned() else {
                break;
            };
            let place = self
                .places
                .remove(&victim)
                .expect("ordered blocks are held");
            self.order.remove(&victim, place, 1, true);
        }
        let place = self.order.insert(&d.key, 1, d.main);
        self.places.insert(d.key.clone(), place);
        true
    }
}

/// Replays `trace` through the pool and, behind it, `nvme`.
pub fn simulate(
    trace: &[Request],
    pool: Pool,
    nvme: Nvme,
    block_tokens: u64,
) -> anyhow::Result<TierResult> {
    let sim = SimPool::new(&pool)?;
    let dram = &sim.dram;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Demoted>(1 << 16);
    dram.demote_to(tx);
    let mut drive = Drive::new(&nvme);
    let mut reads: HashMap<BlockKey, u32> = HashMap::new();
    let mut r = TierResult::default();
    // Puts a block into DRAM (a new block, or one promoted), then takes
    // what that evicted to the drive.
    let mut put = |k: BlockKey,
                   parent: Option<BlockHash>,
                   drive: &mut Drive,
                   r: &mut TierResult|
     -> anyhow::Result<()> {
        sim.put(k, parent)?;
        while let Ok(d) = rx.try_recv() {
            dram.demotion_done(&d);
            if drive.demote(&d, nvme.demote) {
                r.nvme_writes += 1;
            }
        }
        dram.take_overflow();
        Ok(())
    };
    for req in trace {
        let keys: Vec<BlockKey> = req.hash_ids.iter().map(|id| sim.key(*id)).collect();
        let matched = keys
            .iter()
            .take_while(|k| dram.contains(k) || drive.contains(k))
            .count();
        r.hits.count(req, matched, block_tokens);
        for (i, k) in keys[..matched].iter().enumerate() {
            if dram.get(k).is_some() {
                continue;
            }
            r.nvme_hits += 1;
            drive.touch(k);
            let n = reads.entry(k.clone()).or_insert(0);
            *n += 1;
            if nvme.promote_after > 0 && *n >= nvme.promote_after {
                reads.remove(k);
                let parent = i.checked_sub(1).map(|p| keys[p].hash);
                put(k.clone(), parent, &mut drive, &mut r)?;
            }
        }
        let mut parent = matched.checked_sub(1).map(|i| keys[i].hash);
        for k in &keys[matched..] {
            put(k.clone(), parent, &mut drive, &mut r)?;
            parent = Some(k.hash);
        }
        // The prefix match stopped here: the daemon hears of it after
        // these puts (see simulate_pool).
        if let Some(k) = keys.get(matched) {
            dram.missed(k);
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_store_daemon::pool::Eviction;

    fn req(ids: &[u64]) -> Request {
        Request {
            timestamp: 0,
            input_length: ids.len() as u64 * 512,
            hash_ids: ids.to_vec(),
        }
    }

    fn nvme(capacity: usize, promote_after: u32, demote: Demote, order: Eviction) -> Nvme {
        Nvme {
            capacity,
            promote_after,
            demote,
            order,
            probation_share: 0.25,
        }
    }

    #[test]
    fn a_drive_behind_the_pool_hits_what_dram_evicted() {
        // 4 blocks of DRAM, 8 on the drive: the first chain is evicted
        // from DRAM by the second and read back from the drive.
        let trace = [req(&[1, 2, 3, 4]), req(&[5, 6, 7, 8]), req(&[1, 2, 3, 4])];
        let pool = || Pool::new(4, Eviction::Lru);
        for order in Eviction::ALL {
            let run = |capacity, demote| {
                simulate(&trace, pool(), nvme(capacity, 0, demote, order), 512).unwrap()
            };
            let none = run(0, Demote::All);
            assert_eq!(none.hits.hit_blocks, 0, "DRAM alone forgot the first chain");
            let all = run(8, Demote::All);
            assert_eq!(all.hits.hit_blocks, 4, "{order}");
            assert_eq!(all.nvme_hits, 4, "every hit read from the drive");
            assert!(all.nvme_writes >= 4);
            // Never read in DRAM: not worth a write under `Read`.
            let read = run(8, Demote::Read);
            assert_eq!((read.hits.hit_blocks, read.nvme_writes), (0, 0));
        }
    }

    #[test]
    fn a_2q_drive_keeps_what_left_drams_main_queue_while_one_off_blocks_churn() {
        // A 2Q pool of 2 blocks: blocks 1, 2 and 3 are each read once
        // after their put (main), so block 1 leaves DRAM from main. Then
        // 20 one-off blocks pass through DRAM's probation to the drive (8
        // blocks, 2 of them probation). Under 2Q the drive keeps block 1
        // in its main part; as an LRU it lets the one-offs push it out.
        let mut trace = Vec::new();
        for id in [1, 2, 3] {
            trace.push(req(&[id]));
            trace.push(req(&[id]));
        }
        for id in 10..30 {
            trace.push(req(&[id]));
        }
        trace.push(req(&[1]));
        let run = |order| {
            let r = simulate(
                &trace,
                Pool::new(2, Eviction::TwoQ),
                nvme(8, 0, Demote::All, order),
                512,
            )
            .unwrap();
            r.hits.hit_blocks
        };
        // The second read of blocks 1, 2 and 3 hit DRAM either way.
        assert_eq!(run(Eviction::Lru), 3);
        assert_eq!(run(Eviction::TwoQ), 4, "and block 1 on the drive");
    }

    #[test]
    fn a_block_read_often_from_the_drive_comes_back_to_dram() {
        let trace = [req(&[1]), req(&[2]), req(&[1]), req(&[1]), req(&[1])];
        let pool = || Pool::new(1, Eviction::Lru);
        let drive = |promote_after| nvme(8, promote_after, Demote::All, Eviction::Lru);
        let never = simulate(&trace, pool(), drive(0), 512).unwrap();
        assert_eq!((never.hits.hit_blocks, never.nvme_hits), (3, 3));
        // Read twice from the drive, block 1 goes back to DRAM (pushing 2
        // out): its third read is a DRAM hit.
        let twice = simulate(&trace, pool(), drive(2), 512).unwrap();
        assert_eq!((twice.hits.hit_blocks, twice.nvme_hits), (3, 2));
    }
}
