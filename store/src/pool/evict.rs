//! What goes when room is needed: the eviction order and the eviction of
//! blocks from the pool, to the next tier if there is one.
//!
//! A block's key extends its parent's prefix, and a prefix match stops at
//! the first missing block: a block is worth something only while its
//! whole chain is stored, and a chain's head is worth more than its tail.
//! Both orders take chain *tails* (blocks no stored block extends) first,
//! the coldest block only when no tail is evictable.
//!
//! - [`Eviction::Lru`]: the least recently used tail goes first.
//! - [`Eviction::TwoQ`] (2Q, after Johnson and Shasha, VLDB 1994, made to
//!   know chains): a new block waits in a small *probation* queue
//!   (`probation_share` of the pool) and is promoted to the *main* queue
//!   when it is read again; most blocks of a serving trace are used once
//!   (a request's unique tail), and they now leave without pushing reused
//!   blocks out. While probation holds more than its share, its blocks go
//!   first (least recently used first); within its share they are as
//!   safe as main's, and the pool evicts as LRU does, over both queues.
//!   (Main evicting before probation whatever their ages, as in the
//!   original 2Q, kept blocks nobody read over the last turns of a
//!   conversation or an agent: 1.1 to 1.8 points under LRU on such
//!   workloads, `docs/benchmarks.md`.) An evicted
//!   key is remembered (`GHOSTS_PER_BLOCK` keys per stored block): when it
//!   is stored again it was reused after all, and enters main at once. A
//!   chain that continues (a conversation's next turn) follows its branch
//!   point: a block that ends a read prefix counts the branches put after
//!   it and how many of them were read again, and a new branch enters main
//!   while at least half came back (the first branch always does). A
//!   branch point on another daemon is judged by the meta service, which
//!   counts the same for the whole cluster (`meta/src/branches.rs`) and
//!   says so with the block's placement.
//!
//!   Probation's share grows past `probation_share` when readers come back
//!   for blocks it let go too early (a get that misses a block probation
//!   evicted recently grows it by that block: a workload that reads blocks
//!   soon after putting them, as a decode node reading what a prefill node
//!   put), and shrinks back when a block evicted from main is stored again
//!   (as in ARC, Megiddo and Modha, FAST 2003).

use std::collections::{BTreeSet, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault};

use super::*;

/// The eviction order of a pool (the daemon's `eviction` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
pub enum Eviction {
    /// Least recently used chain tail first.
    #[serde(rename = "lru")]
    Lru,
    /// Probation for new blocks, main for reused ones (see the module).
    #[default]
    #[serde(rename = "2q")]
    TwoQ,
}

impl Eviction {
    pub const ALL: [Eviction; 2] = [Eviction::Lru, Eviction::TwoQ];

    /// The name the config and the CLI use.
    pub fn name(self) -> &'static str {
        match self {
            Eviction::Lru => "lru",
            Eviction::TwoQ => "2q",
        }
    }
}

impl std::fmt::Display for Eviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The default share of the pool new blocks may hold under 2Q.
pub const PROBATION_SHARE: f64 = 0.05;
/// Evicted keys remembered per stored block (2Q), and at least this many.
const GHOSTS_PER_BLOCK: usize = 4;
const MIN_GHOSTS: usize = 1024;

/// Which queue a stored block is in (2Q; under LRU every block is main).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Queue {
    Probation,
    Main,
}

/// Where a block being committed goes (`DramPool::admit`).
pub(super) struct Admission {
    pub(super) queue: Queue,
    /// Admitted to main as a branch that comes back, or the rest of one.
    pub(super) continues: bool,
    /// The stamp of its stored parent, if `admit` looked it up (`Some`):
    /// `add_child` need not look again.
    pub(super) parent_stamp: Option<Option<u64>>,
    /// Its ghost fingerprint (2Q; 0 under LRU), kept with the block so
    /// that its eviction need not hash its key again.
    pub(super) fingerprint: u64,
}

/// What the eviction order did, since start (the daemon's metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvictionEvents {
    /// New blocks put in probation.
    pub probation_admitted: u64,
    /// Blocks evicted from probation, never read again: the filter at work.
    pub probation_evicted: u64,
    /// Probation blocks read again, promoted to main.
    pub promoted: u64,
    /// Blocks stored again soon after their eviction, straight into main.
    pub ghost_hits: u64,
    /// New branches that entered main because their branch point's
    /// branches come back.
    pub branch_admitted: u64,
    /// Gets that missed a block probation evicted recently (each grows
    /// probation by the block).
    pub early_eviction_reads: u64,
}

/// Recently evicted blocks (2Q), oldest first, with the queue each left
/// and the units it held. Kept by a 64-bit fingerprint of the key (a
/// seeded hash, computed once per block), not the key: a ghost takes 16
/// bytes in the map and 8 in the queue, and no key is cloned; two keys
/// sharing a fingerprint (about one pair in 2^64) only make one of them
/// look recently evicted.
#[derive(Default)]
pub(super) struct Ghosts {
    seed: foldhash::quality::RandomState,
    order: VecDeque<u64>,
    entries: HashMap<u64, Ghost, BuildHasherDefault<Fingerprint>>,
}

impl Ghosts {
    /// `key`'s fingerprint: computed once per block, when it is admitted
    /// (`Admission::fingerprint`), and kept with it for its eviction.
    pub(super) fn fingerprint(&self, key: &BlockKey) -> u64 {
        self.seed.hash_one(key)
    }

    fn remember(&mut self, f: u64, from: (Queue, u64), cap: usize) {
        if self.entries.insert(f, Ghost::new(from)).is_none() {
            self.order.push_back(f);
        }
        while self.order.len() > cap {
            if let Some(old) = self.order.pop_front() {
                self.entries.remove(&old);
            }
        }
    }

    /// Where the block of fingerprint `f` was evicted from recently, if it
    /// was; forgets it.
    fn take(&mut self, f: u64) -> Option<(Queue, u64)> {
        self.entries.remove(&f).map(Ghost::get)
    }

    fn get(&self, f: u64) -> Option<(Queue, u64)> {
        self.entries.get(&f).map(|g| g.get())
    }

    /// Keeps `f` remembered, with no units left to grow probation by: a
    /// reader's miss of it was counted (once, whether the daemon saw the
    /// get or the meta service told it of the lookup, or both).
    fn spend(&mut self, f: u64) {
        if let Some(g) = self.entries.get_mut(&f) {
            *g = Ghost::new((g.get().0, 0));
        }
    }
}

/// A ghost's queue (the top bit) and units (the rest), in 4 bytes: with
/// its fingerprint an entry of the map is 16 bytes, not 24.
#[derive(Clone, Copy)]
struct Ghost(u32);

impl Ghost {
    const MAIN: u32 = 1 << 31;

    fn new((queue, units): (Queue, u64)) -> Ghost {
        let units = units.min(u64::from(Self::MAIN - 1)) as u32;
        Ghost(units | if queue == Queue::Main { Self::MAIN } else { 0 })
    }

    fn get(self) -> (Queue, u64) {
        let queue = if self.0 & Self::MAIN != 0 {
            Queue::Main
        } else {
            Queue::Probation
        };
        (queue, u64::from(self.0 & !Self::MAIN))
    }
}

/// The hasher of fingerprints: they are seeded hashes already.
#[derive(Default)]
pub(super) struct Fingerprint(u64);

impl std::hash::Hasher for Fingerprint {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64s are hashed here; any other input still hashes.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Evictable blocks of one queue by last access, and the chain tails among
/// them (blocks no stored block names as its parent).
#[derive(Default)]
pub(super) struct Ranked {
    pub(super) all: BTreeSet<u64>,
    pub(super) tails: BTreeSet<u64>,
}

impl Ranked {
    /// Its coldest tail, else its coldest block.
    fn first(&self) -> Option<u64> {
        self.tails.first().or_else(|| self.all.first()).copied()
    }
}

/// Evictable blocks by last access (a stamp from the pool's clock): all of
/// them, those of each tenant with a quota (so that an over-quota tenant
/// finds its coldest block at once), and those of each 2Q queue (under LRU
/// every block is in main).
pub(super) struct Lru {
    /// Each with its tenant and its queue.
    pub(super) all: BTreeMap<u64, (BlockKey, Option<u16>, Queue)>,
    pub(super) by_tenant: Vec<BTreeSet<u64>>,
    pub(super) probation: Ranked,
    pub(super) main: Ranked,
}

impl Lru {
    pub(super) fn new(tenants: usize) -> Lru {
        Lru {
            all: BTreeMap::new(),
            by_tenant: vec![Default::default(); tenants],
            probation: Ranked::default(),
            main: Ranked::default(),
        }
    }

    fn ranked(&mut self, queue: Queue) -> &mut Ranked {
        match queue {
            Queue::Probation => &mut self.probation,
            Queue::Main => &mut self.main,
        }
    }

    pub(super) fn insert(
        &mut self,
        stamp: u64,
        key: BlockKey,
        tenant: Option<u16>,
        tail: bool,
        queue: Queue,
    ) {
        if let Some(t) = tenant {
            self.by_tenant[t as usize].insert(stamp);
        }
        let ranked = self.ranked(queue);
        ranked.all.insert(stamp);
        if tail {
            ranked.tails.insert(stamp);
        }
        self.all.insert(stamp, (key, tenant, queue));
    }

    pub(super) fn remove(&mut self, stamp: u64) -> Option<BlockKey> {
        let (key, tenant, queue) = self.all.remove(&stamp)?;
        if let Some(t) = tenant {
            self.by_tenant[t as usize].remove(&stamp);
        }
        let ranked = self.ranked(queue);
        ranked.all.remove(&stamp);
        ranked.tails.remove(&stamp);
        Some(key)
    }

    /// Marks an evictable block a tail or not (its first child came, or
    /// its last one went); blocks not in the LRU are left alone.
    pub(super) fn set_tail(&mut self, stamp: u64, tail: bool) {
        let Some(&(_, _, queue)) = self.all.get(&stamp) else {
            return;
        };
        let ranked = self.ranked(queue);
        if tail {
            ranked.tails.insert(stamp);
        } else {
            ranked.tails.remove(&stamp);
        }
    }

    /// The next block to evict: the coldest tail, else the coldest block,
    /// of the whole pool; under 2Q, of probation alone while it holds more
    /// than its share.
    pub(super) fn pop_first(
        &mut self,
        order: Eviction,
        probation_over: bool,
    ) -> Option<(u64, BlockKey)> {
        let stamp = match order {
            Eviction::TwoQ if probation_over => {
                self.probation.first().or_else(|| self.main.first())?
            }
            Eviction::Lru | Eviction::TwoQ => {
                let tail = [self.probation.tails.first(), self.main.tails.first()];
                match tail.into_iter().flatten().min() {
                    Some(s) => *s,
                    None => *self.all.keys().next()?,
                }
            }
        };
        self.remove(stamp).map(|k| (stamp, k))
    }

    pub(super) fn coldest_of(&self, tenant: u16) -> Option<u64> {
        self.by_tenant[tenant as usize].first().copied()
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (&u64, &BlockKey)> {
        self.all.iter().map(|(s, (k, _, _))| (s, k))
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.all.len()
    }
}

impl DramPool {
    /// Evicts the next block in the pool's order; `false` if nothing is
    /// evictable.
    pub(super) fn evict_one(&self, inner: &mut Inner) -> bool {
        self.expire_holds(inner);
        let over = inner.probation_units > inner.probation_target;
        let Some((_, key)) = inner.lru.pop_first(self.cfg.eviction, over) else {
            return false;
        };
        self.evict(inner, key);
        true
    }

    /// Evicts the coldest evictable block of tenant `t`; `false` if none
    /// is found among the coldest `MAX_QUOTA_SCAN`.
    pub(super) fn evict_tenant_one(&self, inner: &mut Inner, t: u16) -> bool {
        self.expire_holds(inner);
        let Some(key) = inner.lru.coldest_of(t).and_then(|s| inner.lru.remove(s)) else {
            return false;
        };
        self.quota_evictions.fetch_add(1, Ordering::Relaxed);
        self.evict(inner, key);
        true
    }

    /// Puts an evictable block on the LRU, in its queue, as a tail if no
    /// stored block names it as parent.
    pub(super) fn lru_insert(
        inner: &mut Inner,
        stamp: u64,
        key: &BlockKey,
        tenant: Option<u16>,
        queue: Queue,
    ) {
        let tail = !inner.children.contains_key(key);
        inner.lru.insert(stamp, key.clone(), tenant, tail, queue);
    }

    /// Where a block about to be committed goes (2Q; under LRU, main):
    /// main if it was evicted recently or branches off a prefix whose
    /// branches come back, as its parent if it continues a chain being put,
    /// else probation. `said`: the meta service judged that it continues a
    /// branch that comes back, which it follows where its parent is not
    /// here to judge by (in a cluster, mostly on another daemon).
    pub(super) fn admit(
        &self,
        inner: &mut Inner,
        key: &BlockKey,
        parent: Option<mooncake_proto::BlockHash>,
        said: bool,
    ) -> Admission {
        let mut admission = Admission {
            queue: Queue::Main,
            continues: false,
            parent_stamp: None,
            fingerprint: 0,
        };
        if self.cfg.eviction != Eviction::TwoQ {
            return admission;
        }
        admission.fingerprint = inner.ghosts.fingerprint(key);
        if let Some((from, units)) = inner.ghosts.take(admission.fingerprint) {
            inner.events.ghost_hits += 1;
            if from == Queue::Main {
                // Main was too small for it: give probation's room back.
                let floor = self.probation_floor();
                inner.probation_target = inner.probation_target.saturating_sub(units).max(floor);
            }
            return admission;
        }
        let parent = parent.and_then(|p| {
            inner
                .blocks
                .get_mut(&BlockKey::new(key.namespace.clone(), p))
                .filter(|b| b.ready)
        });
        admission.parent_stamp = Some(parent.as_ref().map(|p| p.stamp));
        admission.continues = match parent {
            // A branch point: a prefix a reader matched.
            Some(p) if p.read => {
                let back = 2 * u64::from(p.branch_hits) >= u64::from(p.branches);
                p.branches = p.branches.saturating_add(1);
                if back {
                    inner.events.branch_admitted += 1;
                }
                back
            }
            // The chain being put goes on.
            Some(p) => p.continues,
            None => {
                if said {
                    inner.events.branch_admitted += 1;
                }
                said
            }
        };
        if !admission.continues {
            admission.queue = Queue::Probation;
            inner.events.probation_admitted += 1;
        }
        admission
    }

    /// Probation's share as configured, in units: it never shrinks below.
    pub(super) fn probation_floor(&self) -> u64 {
        let capacity_units = self.region.len() as u64 / UNIT;
        (capacity_units as f64 * self.cfg.probation_share) as u64
    }

    /// A get missed `key`: if probation evicted it recently, probation was
    /// too small for how soon this workload reads what it puts.
    pub(super) fn note_miss(&self, inner: &mut Inner, key: &BlockKey) {
        if self.cfg.eviction != Eviction::TwoQ {
            return;
        }
        let f = inner.ghosts.fingerprint(key);
        if let Some((Queue::Probation, units @ 1..)) = inner.ghosts.get(f) {
            let capacity_units = self.region.len() as u64 / UNIT;
            inner.probation_target = (inner.probation_target + units).min(capacity_units);
            inner.events.early_eviction_reads += 1;
            inner.ghosts.spend(f);
        }
    }

    /// Bytes in probation, and the most it holds before giving way.
    pub fn probation(&self) -> (u64, u64) {
        let inner = self.inner.lock();
        (inner.probation_units * UNIT, inner.probation_target * UNIT)
    }

    /// A stored block was read: out of probation (2Q), and on its first
    /// read the parent to credit (`credit_branch`).
    pub(super) fn mark_read(
        &self,
        block: &mut Block,
        probation_units: &mut u64,
        events: &mut EvictionEvents,
        alloc: &Allocator,
    ) -> Option<mooncake_proto::BlockHash> {
        if self.cfg.eviction != Eviction::TwoQ {
            // Only noted (a demoted block says whether it was read).
            block.read = true;
            return None;
        }
        if block.queue == Queue::Probation {
            block.queue = Queue::Main;
            *probation_units -= alloc.allocation_size(block.alloc) as u64;
            events.promoted += 1;
        }
        if block.read {
            return None;
        }
        block.read = true;
        block.parent
    }

    /// A block put after `parent` was read again: if `parent` is a branch
    /// point, one of its branches came back.
    pub(super) fn credit_branch(
        inner: &mut Inner,
        key: &BlockKey,
        parent: mooncake_proto::BlockHash,
    ) {
        let parent = BlockKey::new(key.namespace.clone(), parent);
        if let Some(p) = inner.blocks.get_mut(&parent).filter(|p| p.branches > 0) {
            p.branch_hits = p.branch_hits.saturating_add(1);
        }
    }

    /// A block leaves the pool's index: its probation room is free.
    pub(super) fn leave_queue(inner: &mut Inner, block: &Block) {
        if block.queue == Queue::Probation {
            inner.probation_units -= inner.alloc.allocation_size(block.alloc) as u64;
        }
    }

    /// A stored block naming `parent` arrived: the parent is no tail now.
    /// `stamp`: the parent's stamp if already looked up (`Some(None)`: not
    /// stored).
    pub(super) fn add_child(
        inner: &mut Inner,
        key: &BlockKey,
        parent: mooncake_proto::BlockHash,
        stamp: Option<Option<u64>>,
    ) {
        let parent = BlockKey::new(key.namespace.clone(), parent);
        let count = inner.children.entry(parent.clone()).or_insert(0);
        *count += 1;
        if *count == 1 {
            let stamp = stamp.unwrap_or_else(|| inner.blocks.get(&parent).map(|p| p.stamp));
            if let Some(stamp) = stamp {
                inner.lru.set_tail(stamp, false);
            }
        }
    }

    /// A stored block naming `parent` left: the parent may be a tail again.
    pub(super) fn remove_child(
        inner: &mut Inner,
        key: &BlockKey,
        parent: mooncake_proto::BlockHash,
    ) {
        let parent = BlockKey::new(key.namespace.clone(), parent);
        let Some(count) = inner.children.get_mut(&parent) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            inner.children.remove(&parent);
            if let Some(p) = inner.blocks.get(&parent) {
                inner.lru.set_tail(p.stamp, true);
            }
        }
    }

    /// The pool's eviction order.
    pub fn eviction(&self) -> Eviction {
        self.cfg.eviction
    }

    /// What the eviction order did since start.
    pub fn eviction_events(&self) -> EvictionEvents {
        self.inner.lock().events
    }

    /// Evicts a block already taken off the LRU.
    pub(super) fn evict(&self, inner: &mut Inner, key: BlockKey) {
        let block = inner.blocks.remove(&key).expect("lru entries are indexed");
        debug_assert!(block.evictable());
        if block.queue == Queue::Probation {
            inner.events.probation_evicted += 1;
        }
        Self::leave_queue(inner, &block);
        self.unpublish(&key);
        if let Some(parent) = block.parent {
            Self::remove_child(inner, &key, parent);
        }
        if self.cfg.eviction == Eviction::TwoQ {
            let cap = (inner.blocks.len() * GHOSTS_PER_BLOCK).max(MIN_GHOSTS);
            let units = inner.alloc.allocation_size(block.alloc) as u64;
            let f = match block.fingerprint {
                0 => inner.ghosts.fingerprint(&key),
                f => f,
            };
            inner.ghosts.remember(f, (block.queue, units), cap);
        }
        // Demotion: the bytes leave for the next tier before the space is
        // freed. A full demotion queue drops the block (a miss later).
        let mut kept = false;
        let budget_left =
            self.demote_queued.load(Ordering::Relaxed) + block.len as u64 <= DEMOTION_BYTES_MAX;
        if let Some(next) = self.demote.get().filter(|_| budget_left) {
            let offset = block.alloc.offset as usize * UNIT as usize;
            // SAFETY: an evictable block has no lease and no writer.
            let bytes = unsafe { self.region.slice(offset, block.len as usize) };
            let main = block.queue == Queue::Main;
            let about = (block.checksum, block.parent, block.read, main);
            kept = self.send_demoted(next, key.clone(), bytes, about);
            if kept {
                self.demotions.fetch_add(1, Ordering::Relaxed);
                self.demote_queued
                    .fetch_add(block.len as u64, Ordering::Relaxed);
            }
        }
        let overflowed = !kept && self.demote.get().is_some();
        Self::free(inner, block.alloc, block.tenant);
        self.evictions.fetch_add(1, Ordering::Relaxed);
        if overflowed {
            let mut overflow = self.overflow.lock();
            if overflow.len() < MAX_PENDING_REMOVALS {
                overflow.push(key);
            }
        } else if !kept {
            self.report_removed(key);
        }
    }

    /// Whether storing `extra` more bytes would start an eviction.
    pub fn would_evict(&self, extra: u64) -> bool {
        let inner = self.inner.lock();
        let capacity_units = self.region.len() as u64 / UNIT;
        let high = (capacity_units as f64 * self.cfg.high_watermark) as u64;
        inner.used_units + extra.div_ceil(UNIT) > high
    }

    /// Evicts the coldest evictable blocks until `bytes` are freed (or none
    /// is left); returns the bytes and blocks freed.
    pub fn evict_bytes(&self, bytes: u64) -> (u64, u64) {
        let mut inner = self.inner.lock();
        let start = inner.used_units;
        let mut blocks = 0;
        while (start - inner.used_units) * UNIT < bytes && self.evict_one(&mut inner) {
            blocks += 1;
        }
        ((start - inner.used_units) * UNIT, blocks)
    }
}
