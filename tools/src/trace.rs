//! Workload traces in the Mooncake format (one JSON object a line:
//! `timestamp` in ms, `input_length`, `output_length`, `hash_ids`), and the
//! offline caches a replay is compared with: an unbounded one (the trace's
//! theoretical prefix hit rate), an exact LRU of a given capacity, and two
//! that know the future: Belady's MIN (when each block is used next) and a
//! frequency oracle (how often each block is used from now on).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use mooncake_meta::branches::{Branches, Put, DEFAULT_CAP as BRANCHES_CAP};
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use mooncake_store_daemon::pool::{Eviction, PoolConfig, PROBATION_SHARE};
use mooncake_store_daemon::{DramPool, PoolError};
use serde::Deserialize;

/// One request of a trace.
#[derive(Debug, Clone, Deserialize)]
pub struct Request {
    /// Arrival, in milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u64,
    /// Prefix block ids: equal ids are the same reusable block.
    pub hash_ids: Vec<u64>,
}

pub fn load(path: &Path, limit: Option<usize>) -> anyhow::Result<Vec<Request>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open trace {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line =
            line.with_context(|| format!("{}: cannot read line {}", path.display(), n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let req: Request = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}: not a trace request", path.display(), n + 1))?;
        out.push(req);
    }
    anyhow::ensure!(!out.is_empty(), "{}: no requests", path.display());
    Ok(out)
}

/// Tokens of a request served from cache when its first `blocks` blocks hit.
pub fn hit_tokens(req: &Request, blocks: usize, block_tokens: u64) -> u64 {
    (blocks as u64 * block_tokens).min(req.input_length)
}

/// Token and block hits of a cache simulated over a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SimResult {
    pub hit_tokens: u64,
    pub tokens: u64,
    pub hit_blocks: u64,
    pub blocks: u64,
}

impl SimResult {
    /// Counts one request whose first `matched` blocks were cached.
    pub fn count(&mut self, req: &Request, matched: usize, block_tokens: u64) {
        self.tokens += req.input_length;
        self.hit_tokens += hit_tokens(req, matched, block_tokens);
        self.blocks += req.hash_ids.len() as u64;
        self.hit_blocks += matched as u64;
    }

    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.hit_tokens, self.tokens)
    }
    pub fn block_hit_rate(&self) -> f64 {
        ratio(self.hit_blocks, self.blocks)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// How many leading blocks of `req` a cache holds (`held`): a prefix
/// match stops at the first block missing.
fn leading(req: &Request, held: impl Fn(&u64) -> bool) -> usize {
    req.hash_ids.iter().take_while(|id| held(id)).count()
}

/// Replays the trace through an exact LRU cache of `capacity` blocks
/// (`None`: unbounded). Each request matches its longest cached prefix,
/// touches those blocks, then inserts the rest of its chain in order, as
/// the store's replay does.
pub fn simulate_lru(trace: &[Request], capacity: Option<usize>, block_tokens: u64) -> SimResult {
    let mut stamp_of: HashMap<u64, u64> = HashMap::new();
    let mut by_stamp: BTreeMap<u64, u64> = BTreeMap::new();
    let mut clock = 0u64;
    let mut r = SimResult::default();
    for req in trace {
        let matched = leading(req, |id| stamp_of.contains_key(id));
        r.count(req, matched, block_tokens);
        for id in &req.hash_ids {
            clock += 1;
            if let Some(old) = stamp_of.insert(*id, clock) {
                by_stamp.remove(&old);
            }
            by_stamp.insert(clock, *id);
            if let Some(cap) = capacity {
                while stamp_of.len() > cap {
                    let (_, victim) = by_stamp.pop_first().expect("non-empty");
                    stamp_of.remove(&victim);
                }
            }
        }
    }
    r
}

/// A daemon's DRAM pool, as `simulate_pool` runs it.
#[derive(Debug, Clone, Copy)]
pub struct Pool {
    /// Blocks it holds.
    pub capacity: usize,
    pub order: Eviction,
    pub probation_share: f64,
    /// Bytes of each block (the pool holds `capacity` of them).
    pub block_bytes: usize,
}

impl Pool {
    /// A pool of `capacity` blocks with the daemon's default settings.
    pub fn new(capacity: usize, order: Eviction) -> Pool {
        Pool {
            capacity,
            order,
            probation_share: PROBATION_SHARE,
            block_bytes: 1024,
        }
    }
}

/// Replays the trace through the daemon's own DRAM pool, holding
/// `capacity` blocks and evicting in `order`, driven as `replay` drives a
/// daemon: each request reads its longest stored prefix, then puts the
/// rest of its chain, each block naming its parent. What this predicts is
/// what a daemon of that capacity does: it is the daemon's code.
pub fn simulate_pool(
    trace: &[Request],
    pool: Pool,
    block_tokens: u64,
) -> anyhow::Result<SimResult> {
    replay_pool(trace, &SimPool::new(&pool)?, block_tokens)
}

/// `simulate_pool` through a pool already made (`bench-pool` times only
/// this: the reads and puts, not the pool's creation).
pub fn replay_pool(
    trace: &[Request],
    sim: &SimPool,
    block_tokens: u64,
) -> anyhow::Result<SimResult> {
    let mut r = SimResult::default();
    for req in trace {
        let matched = req
            .hash_ids
            .iter()
            .take_while(|id| sim.dram.contains(&sim.key(**id)))
            .count();
        for id in &req.hash_ids[..matched] {
            drop(sim.dram.get(&sim.key(*id)));
        }
        r.count(req, matched, block_tokens);
        let mut parent = matched
            .checked_sub(1)
            .map(|i| sim.key(req.hash_ids[i]).hash);
        for id in &req.hash_ids[matched..] {
            let k = sim.key(*id);
            sim.put(k.clone(), parent)?;
            parent = Some(k.hash);
        }
        // The prefix match stopped at this block: the meta service tells
        // the daemon that evicted it, whose probation grows if it let the
        // block go too early (`meta/src/misses.rs`). The daemon hears of it
        // with its next heartbeat, after this request put the block again
        // (which takes its ghost: then nothing grows).
        if let Some(id) = req.hash_ids.get(matched) {
            sim.dram.missed(&sim.key(*id));
        }
    }
    Ok(r)
}

/// `simulate_pool` with the same memory split over `daemons` daemons of
/// `pool.capacity / daemons` blocks each, their blocks placed as the meta
/// service places them in a full cluster of equal daemons
/// (`meta/src/daemons.rs`): a new block to the daemon given the fewest
/// blocks so far, a block stored again to the daemon that evicted it (the
/// meta service remembers the last 65,536 evictions; this, every one). A
/// request matches its prefix across all of them, as `replay` against such
/// a cluster does.
pub fn simulate_cluster(
    trace: &[Request],
    pool: Pool,
    daemons: usize,
    block_tokens: u64,
) -> anyhow::Result<SimResult> {
    anyhow::ensure!(
        daemons >= 1 && pool.capacity >= daemons,
        "{} blocks cannot be split over {daemons} daemons",
        pool.capacity
    );
    let each = Pool {
        capacity: pool.capacity / daemons,
        ..pool
    };
    let pools = (0..daemons)
        .map(|_| SimPool::new(&each))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The daemon each block was last placed on (it is there, or that
    // daemon evicted it), and the blocks each was given.
    let mut home: HashMap<u64, usize> = HashMap::new();
    let mut given = vec![0u64; daemons];
    let held = |home: &HashMap<u64, usize>, id: u64| {
        home.get(&id)
            .is_some_and(|d| pools[*d].dram.contains(&pools[*d].key(id)))
    };
    // The meta service's judgement of which new blocks continue a branch
    // that comes back, which a daemon follows where it does not hold the
    // block's parent (`meta/src/branches.rs`).
    let branches = Branches::new(BRANCHES_CAP);
    let ns = pools[0].key(0).namespace;
    let mut r = SimResult::default();
    for req in trace {
        let matched = req
            .hash_ids
            .iter()
            .take_while(|id| held(&home, **id))
            .count();
        for id in &req.hash_ids[..matched] {
            let p = &pools[home[id]];
            drop(p.dram.get(&p.key(*id)));
        }
        r.count(req, matched, block_tokens);
        let hashes: Vec<BlockHash> = req
            .hash_ids
            .iter()
            .map(|id| pools[0].key(*id).hash)
            .collect();
        branches.matched(&ns, &hashes, matched);
        let puts: Vec<Put> = (matched..hashes.len())
            .map(|i| {
                let placed = !held(&home, req.hash_ids[i]);
                Put {
                    hash: hashes[i],
                    parent: i.checked_sub(1).map(|p| hashes[p]),
                    placed,
                    // Placed here before and evicted since.
                    returning: placed && home.contains_key(&req.hash_ids[i]),
                }
            })
            .collect();
        let judged = branches.judge(&ns, &puts);
        for ((id, put), continues) in req.hash_ids[matched..].iter().zip(&puts).zip(judged) {
            if !put.placed {
                continue;
            }
            let d = match home.get(id) {
                Some(evicted_by) => *evicted_by,
                None => (0..daemons).min_by_key(|d| given[*d]).expect("a daemon"),
            };
            given[d] += 1;
            let key = pools[d].key(*id);
            pools[d].put_judged(key, put.parent, continues)?;
            home.insert(*id, d);
        }
        // As `replay_pool`: the meta service tells the daemon that evicted
        // the block the match stopped at, after this request's puts.
        if let Some(id) = req.hash_ids.get(matched) {
            if let Some(d) = home.get(id) {
                pools[*d].dram.missed(&pools[*d].key(*id));
            }
        }
    }
    Ok(r)
}

/// The daemon's DRAM pool as the simulations drive it: blocks of the
/// pool's size, written as the daemon writes them (so that a put costs
/// its copy and checksum), keyed by trace id.
pub struct SimPool {
    pub dram: Arc<DramPool>,
    value: Vec<u8>,
    sum: u64,
    ns: Namespace,
}

impl SimPool {
    pub fn new(pool: &Pool) -> anyhow::Result<SimPool> {
        // At least 1 KiB: the smallest block the pool gives one allocation.
        let block = pool.block_bytes.max(1024);
        let cfg = PoolConfig {
            eviction: pool.order,
            probation_share: pool.probation_share,
            high_watermark: 1.0,
            ..PoolConfig::with_capacity((pool.capacity * block) as u64)
        };
        let value: Vec<u8> = (0..block).map(|i| i as u8).collect();
        Ok(SimPool {
            dram: Arc::new(DramPool::new(cfg)?),
            sum: mooncake_proto::checksum(&value),
            value,
            ns: Namespace::new("simulate").expect("a valid namespace"),
        })
    }

    pub fn key(&self, id: u64) -> BlockKey {
        BlockKey::new(self.ns.clone(), BlockHash::from_opaque(&id.to_le_bytes()))
    }

    /// Stores a block after `parent` (kept if already there).
    pub fn put(&self, key: BlockKey, parent: Option<BlockHash>) -> anyhow::Result<()> {
        self.put_judged(key, parent, false)
    }

    /// `put`, with the meta service's judgement that the block continues a
    /// branch that comes back (`WriteSlot::set_continues`).
    pub fn put_judged(
        &self,
        key: BlockKey,
        parent: Option<BlockHash>,
        continues: bool,
    ) -> anyhow::Result<()> {
        match self.dram.reserve(key, self.value.len() as u64, self.sum) {
            Ok(mut slot) => {
                slot.buf_mut().copy_from_slice(&self.value);
                slot.set_parent(parent);
                slot.set_continues(continues);
                slot.commit()?;
                Ok(())
            }
            Err(PoolError::AlreadyExists) => Ok(()),
            Err(e) => anyhow::bail!("the pool refused a block: {e}"),
        }
    }
}

/// Belady's MIN: with the whole future known, a full cache evicts the
/// block whose next use is farthest away (one never used again first, the
/// block just written included). A yardstick, not a policy: no cache that
/// only knows the past keeps more of the blocks that are used again.
pub fn simulate_belady(trace: &[Request], capacity: usize, block_tokens: u64) -> SimResult {
    let accesses: Vec<u64> = trace
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    // For each access, the position of the same block's next access.
    let mut next = vec![usize::MAX; accesses.len()];
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, id) in accesses.iter().enumerate().rev() {
        if let Some(j) = seen.insert(*id, i) {
            next[i] = j;
        }
    }
    // Cached blocks and their next use; the heap holds (next use, block),
    // entries made stale by a later access skipped when popped.
    let mut cached: HashMap<u64, usize> = HashMap::new();
    let mut heap: std::collections::BinaryHeap<(usize, u64)> = Default::default();
    let mut r = SimResult::default();
    let mut pos = 0;
    for req in trace {
        let matched = leading(req, |id| cached.contains_key(id));
        r.count(req, matched, block_tokens);
        for id in &req.hash_ids {
            let n = next[pos];
            pos += 1;
            cached.insert(*id, n);
            heap.push((n, *id));
            while cached.len() > capacity {
                let (n, victim) = heap.pop().expect("a full cache has entries");
                if cached.get(&victim) == Some(&n) {
                    cached.remove(&victim);
                }
            }
        }
    }
    r
}

/// A frequency oracle: knowing how many more times each block will be
/// used (but not when), a full cache evicts the block with the fewest uses
/// left; among equals the most recently used, which within a chain (read
/// and written head first) is its tail. A yardstick for orders that rank
/// blocks by how often they come back (LFU, TinyLFU, 2Q's two queues):
/// none can know a block's future frequency better than this. Where uses
/// come at random times (as on the Mooncake trace, whose gaps between a
/// document's uses have a coefficient of variation of about 1) when a
/// block comes back is not in its past either, so this is about the best
/// an order that knows only the past can do; only MIN, which knows when,
/// gets further.
pub fn simulate_frequency_oracle(
    trace: &[Request],
    capacity: usize,
    block_tokens: u64,
) -> SimResult {
    let mut uses_left: HashMap<u64, u64> = HashMap::new();
    for id in trace.iter().flat_map(|r| r.hash_ids.iter()) {
        *uses_left.entry(*id).or_default() += 1;
    }
    // Cached blocks with their rank, and the ranks in eviction order: the
    // fewest uses left first, then the latest access (a falling clock).
    let mut cached: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut ranked: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
    let mut clock = u64::MAX;
    let mut r = SimResult::default();
    for req in trace {
        let matched = leading(req, |id| cached.contains_key(id));
        r.count(req, matched, block_tokens);
        for id in &req.hash_ids {
            clock -= 1;
            let left = uses_left.get_mut(id).expect("every id is counted");
            *left -= 1;
            let rank = (*left, clock);
            if let Some((l, c)) = cached.insert(*id, rank) {
                ranked.remove(&(l, c, *id));
            }
            ranked.insert((rank.0, rank.1, *id));
            while cached.len() > capacity {
                let (_, _, victim) = ranked.pop_first().expect("a full cache has entries");
                cached.remove(&victim);
            }
        }
    }
    r
}

/// Distinct blocks in the trace: the cache size that misses nothing.
pub fn footprint(trace: &[Request]) -> usize {
    let mut ids: Vec<u64> = trace
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64], input: u64) -> Request {
        Request {
            timestamp: 0,
            input_length: input,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn unbounded_cache_hits_every_reused_prefix() {
        let trace = [
            req(&[1, 2, 3], 1500),
            req(&[1, 2, 4], 1400),
            req(&[9, 2], 1000),
        ];
        let r = simulate_lru(&trace, None, 512);
        // Request 2 reuses blocks 1 and 2 (1024 tokens); request 3 starts
        // with a new block, so its block 2 does not count.
        assert_eq!(r.hit_tokens, 1024);
        assert_eq!(r.tokens, 3900);
        assert_eq!((r.hit_blocks, r.blocks), (2, 8));
    }

    #[test]
    fn a_small_lru_forgets_the_oldest_blocks() {
        let trace = [req(&[1, 2], 1024), req(&[3, 4], 1024), req(&[1, 2], 1024)];
        assert_eq!(simulate_lru(&trace, Some(2), 512).hit_blocks, 0);
        assert_eq!(simulate_lru(&trace, Some(4), 512).hit_blocks, 2);
        assert_eq!(footprint(&trace), 4);
    }

    #[test]
    fn the_daemons_orders_keep_shared_heads_that_lru_drops() {
        // A hot two-block head (1, 2) followed by ever new tails, between
        // one-off requests: LRU with room for 3 keeps evicting the head;
        // tails first keeps it, and so does 2Q once the head is read again.
        let mut trace = Vec::new();
        for i in 0..20u64 {
            trace.push(req(&[1, 2, 100 + i], 1536));
            trace.push(req(&[50 + i], 512));
        }
        let lru = simulate_lru(&trace, Some(3), 512);
        let all = footprint(&trace);
        for order in Eviction::ALL {
            let pool = simulate_pool(&trace, Pool::new(3, order), 512).unwrap();
            assert!(
                pool.hit_tokens > lru.hit_tokens,
                "{order}: {pool:?} vs {lru:?}"
            );
            // With room for everything, each equals the theoretical maximum.
            assert_eq!(
                simulate_pool(&trace, Pool::new(all, order), 512).unwrap(),
                simulate_lru(&trace, None, 512),
                "{order}"
            );
        }
    }

    #[test]
    fn two_q_keeps_reused_blocks_that_one_off_requests_push_out_of_lru() {
        // Three 4-block documents read in turn, two one-off 4-block
        // requests after each: 32 other blocks between two reads of a
        // document, room for 20. LRU and tails first never keep a document
        // that long; 2Q lets the one-offs pass through probation and keeps
        // the documents in main from their second read on.
        let mut trace = Vec::new();
        let mut fresh = 1000u64;
        for round in 0..30u64 {
            let doc = round % 3;
            trace.push(req(&[doc * 4, doc * 4 + 1, doc * 4 + 2, doc * 4 + 3], 2048));
            for _ in 0..2 {
                trace.push(req(&[fresh, fresh + 1, fresh + 2, fresh + 3], 2048));
                fresh += 4;
            }
        }
        let lru = simulate_pool(&trace, Pool::new(20, Eviction::Lru), 512).unwrap();
        assert_eq!(lru.hit_tokens, 0, "{lru:?}");
        let two_q = simulate_pool(&trace, Pool::new(20, Eviction::TwoQ), 512).unwrap();
        // Every document read from the third round of reads on hits whole.
        assert_eq!(two_q.hit_tokens, 2048 * (30 - 6), "{two_q:?}");
    }

    #[test]
    fn belady_keeps_what_is_used_again() {
        // Room for 2 of 3 blocks used in turn: LRU always evicts the block
        // needed next and never hits. MIN evicts the one needed farthest
        // away (block 3 itself, each round) and hits blocks 1 and 2 in
        // each of the 9 rounds after the first.
        let mut trace = Vec::new();
        for _ in 0..10 {
            for id in [1, 2, 3] {
                trace.push(req(&[id], 512));
            }
        }
        assert_eq!(simulate_lru(&trace, Some(2), 512).hit_blocks, 0);
        assert_eq!(simulate_belady(&trace, 2, 512).hit_blocks, 18);
        // With room for everything it is the theoretical maximum.
        let long: Vec<Request> = (0..200u64)
            .map(|i| req(&[i % 7, 100 + i % 13, 1000 + i], 1536))
            .collect();
        assert_eq!(
            simulate_belady(&long, footprint(&long), 512),
            simulate_lru(&long, None, 512)
        );
    }

    #[test]
    fn the_frequency_oracle_drops_blocks_never_used_again_and_chains_from_the_tail() {
        // Room for 2: block 1 comes back, 2 and 3 never do. LRU has let 1
        // go by then; the oracle evicts 2 and 3 as they come.
        let trace = [
            req(&[1], 512),
            req(&[2], 512),
            req(&[3], 512),
            req(&[1], 512),
        ];
        assert_eq!(simulate_lru(&trace, Some(2), 512).hit_blocks, 0);
        assert_eq!(simulate_frequency_oracle(&trace, 2, 512).hit_blocks, 1);
        // A three-block chain read twice with room for 2: every block has
        // one use left, and the tail goes, so the second read matches the
        // two leading blocks (evicting the head would match none).
        let chain = [req(&[1, 2, 3], 1536), req(&[1, 2, 3], 1536)];
        assert_eq!(simulate_frequency_oracle(&chain, 2, 512).hit_blocks, 2);
        // It knows how often, not when: blocks 1 and 2 come back three
        // times each, block 3 twice but at once. The oracle drops 3 (6
        // hits); MIN keeps it for its two next uses and gives up one read
        // of block 2 for them (7 hits).
        let when: Vec<Request> = [1, 2, 3, 3, 3, 1, 2, 1, 2, 1, 2]
            .iter()
            .map(|id| req(&[*id], 512))
            .collect();
        assert_eq!(simulate_frequency_oracle(&when, 2, 512).hit_blocks, 6);
        assert_eq!(simulate_belady(&when, 2, 512).hit_blocks, 7);
        // With room for everything it is the theoretical maximum.
        let all = footprint(&when);
        assert_eq!(
            simulate_frequency_oracle(&when, all, 512),
            simulate_lru(&when, None, 512)
        );
    }

    #[test]
    fn partial_last_block_counts_only_its_tokens() {
        assert_eq!(hit_tokens(&req(&[1, 2], 700), 2, 512), 700);
    }
}
