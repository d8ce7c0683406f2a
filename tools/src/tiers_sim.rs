//! Two tiers offline: the daemon's DRAM pool (its own code, as `simulate`
//! drives it) with an NVMe tier behind it, kept as the daemon's NVMe tier
//! keeps its blocks (an exact LRU of its capacity, fed by the pool's
//! demotions, read when DRAM misses, a block read `promote_after` times
//! copied back into DRAM). It answers what a drive behind the pool buys,
//! and which demoted blocks are worth a drive's write.

use std::collections::{BTreeMap, HashMap};

use mooncake_proto::{BlockHash, BlockKey};
use mooncake_store_daemon::pool::Demoted;

use crate::trace::{Pool, Request, SimPool, SimResult};

/// Which evicted blocks go to the drive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Demote {
    /// Every evicted block (the daemon today).
    All,
    /// Only blocks read while they were in DRAM; a block written and
    /// never read is dropped.
    Read,
    /// Every evicted block, but those never read in DRAM into a probation
    /// part of the drive of this share of it (an LRU of its own), so that
    /// one-off blocks churn there without pushing out the rest; a block
    /// read from probation moves to the main part.
    Split(f64),
}

/// The drive behind the pool.
#[derive(Debug, Clone, Copy)]
pub struct Nvme {
    /// Blocks it holds.
    pub capacity: usize,
    pub promote_after: u32,
    pub demote: Demote,
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

/// The drive: a main LRU, and a probation LRU under `Demote::Split`.
#[derive(Default)]
struct Drive {
    main: Lru,
    probation: Lru,
}

impl Drive {
    fn contains(&self, key: &BlockKey) -> bool {
        self.main.contains(key) || self.probation.contains(key)
    }

    /// A read from the drive: a probation block moves to main.
    fn touch(&mut self, key: &BlockKey, nvme: &Nvme) {
        if self.probation.remove(key) {
            let (main, _) = nvme.split();
            self.main.add(key, main);
        } else {
            self.main.touch(key);
        }
    }

    /// A demoted block; `true` if written.
    fn demote(&mut self, key: &BlockKey, read: bool, nvme: &Nvme) -> bool {
        if self.contains(key) {
            return false;
        }
        let (main, probation) = nvme.split();
        match nvme.demote {
            Demote::All => self.main.add(key, main),
            Demote::Read => read && self.main.add(key, main),
            Demote::Split(_) if read => self.main.add(key, main),
            Demote::Split(_) => self.probation.add(key, probation),
        }
    }
}

impl Nvme {
    /// Blocks of the main part and of probation.
    fn split(&self) -> (usize, usize) {
        match self.demote {
            Demote::Split(share) => {
                let probation = (self.capacity as f64 * share) as usize;
                (self.capacity - probation, probation)
            }
            _ => (self.capacity, 0),
        }
    }
}

/// The drive's blocks by recency: an exact LRU.
#[derive(Default)]
struct Lru {
    stamp_of: HashMap<BlockKey, u64>,
    by_stamp: BTreeMap<u64, BlockKey>,
    clock: u64,
}

impl Lru {
    fn contains(&self, key: &BlockKey) -> bool {
        self.stamp_of.contains_key(key)
    }

    fn remove(&mut self, key: &BlockKey) -> bool {
        match self.stamp_of.remove(key) {
            Some(stamp) => {
                self.by_stamp.remove(&stamp);
                true
            }
            None => false,
        }
    }

    fn touch(&mut self, key: &BlockKey) {
        self.clock += 1;
        if let Some(old) = self.stamp_of.insert(key.clone(), self.clock) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(self.clock, key.clone());
    }

    /// Adds a block, evicting the least recent past `capacity`; `false`
    /// if it was there already (no write).
    fn add(&mut self, key: &BlockKey, capacity: usize) -> bool {
        if self.contains(key) || capacity == 0 {
            return false;
        }
        while self.stamp_of.len() >= capacity {
            let Some((_, old)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&old);
        }
        self.touch(key);
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
    let mut drive = Drive::default();
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
            if drive.demote(&d.key, d.read, &nvme) {
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
            drive.touch(k, &nvme);
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

    #[test]
    fn a_drive_behind_the_pool_hits_what_dram_evicted() {
        // 4 blocks of DRAM, 8 on the drive: the first chain is evicted
        // from DRAM by the second and read back from the drive.
        let trace = [req(&[1, 2, 3, 4]), req(&[5, 6, 7, 8]), req(&[1, 2, 3, 4])];
        let nvme = |capacity, demote| Nvme {
            capacity,
            promote_after: 0,
            demote,
        };
        let pool = || Pool::new(4, Eviction::Lru);
        let none = simulate(&trace, pool(), nvme(0, Demote::All), 512).unwrap();
        assert_eq!(none.hits.hit_blocks, 0, "DRAM alone forgot the first chain");
        let all = simulate(&trace, pool(), nvme(8, Demote::All), 512).unwrap();
        assert_eq!(all.hits.hit_blocks, 4);
        assert_eq!(all.nvme_hits, 4, "every hit read from the drive");
        assert!(all.nvme_writes >= 4);
        // Never read in DRAM: not worth a write under `Read`.
        let read = simulate(&trace, pool(), nvme(8, Demote::Read), 512).unwrap();
        assert_eq!((read.hits.hit_blocks, read.nvme_writes), (0, 0));
    }

    #[test]
    fn under_split_one_off_blocks_churn_in_probation_and_spare_the_rest() {
        // One block of DRAM, a drive of 4 (1 of it probation). Block 1 is
        // read in DRAM (it goes to main when evicted); then one-off blocks
        // 10-13 pass through; block 1 is still on the drive.
        let trace = [
            req(&[1]),
            req(&[1]),
            req(&[10]),
            req(&[11]),
            req(&[12]),
            req(&[13]),
            req(&[14]),
            req(&[1]),
        ];
        let run = |demote| {
            let nvme = Nvme {
                capacity: 4,
                promote_after: 0,
                demote,
            };
            simulate(&trace, Pool::new(1, Eviction::Lru), nvme, 512).unwrap()
        };
        assert_eq!(run(Demote::All).hits.hit_blocks, 1, "only the DRAM hit");
        assert_eq!(
            run(Demote::Split(0.25)).hits.hit_blocks,
            2,
            "and the drive's"
        );
    }

    #[test]
    fn a_block_read_often_from_the_drive_comes_back_to_dram() {
        let trace = [req(&[1]), req(&[2]), req(&[1]), req(&[1]), req(&[1])];
        let pool = || Pool::new(1, Eviction::Lru);
        let nvme = |promote_after| Nvme {
            capacity: 8,
            promote_after,
            demote: Demote::All,
        };
        let never = simulate(&trace, pool(), nvme(0), 512).unwrap();
        assert_eq!((never.hits.hit_blocks, never.nvme_hits), (3, 3));
        // Read twice from the drive, block 1 goes back to DRAM (pushing 2
        // out): its third read is a DRAM hit.
        let twice = simulate(&trace, pool(), nvme(2), 512).unwrap();
        assert_eq!((twice.hits.hit_blocks, twice.nvme_hits), (3, 2));
    }
}
