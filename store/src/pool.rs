//! The DRAM pool: a region carved by an offset allocator, an index of the
//! blocks in it, and LRU eviction between a high and a low watermark.
//!
//! A block is written through a [`WriteSlot`] (invisible until its checksum
//! verifies) and read through a [`ReadLease`] (which keeps its bytes in
//! place until dropped). Only blocks that are complete, unpinned and not
//! leased can be evicted. The lock is never held while bytes are copied or
//! hashed: the allocator guarantees slots and leases never overlap.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_proto::message::PoolStats;
use mooncake_proto::shm_index::{self, Digest, Entry, IndexTable};
use mooncake_proto::{checksum, BlockKey, ErrorCode};
use offset_allocator::{Allocation, Allocator};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::quota::Quotas;
use crate::region::Region;

/// Allocation granularity: small enough for 1 KiB blocks, large enough that
/// a u32 of units spans a 1 TiB pool.
const UNIT: u64 = 256;
/// Keys dropped on the pool's own initiative, kept for the meta service
/// until it collects them; past this many, the oldest reports are lost
/// (the meta service then learns of those blocks by a miss).
const MAX_PENDING_REMOVALS: usize = 1 << 20;
/// Bytes of evicted blocks waiting in memory to be written to the next
/// tier that writers wait for (see `Tiers::room_to_demote`).
const DEMOTION_BYTES: u64 = 256 << 20;
/// The hard limit: past it an evicted block is dropped unless the next tier
/// has it. The slack over `DEMOTION_BYTES` absorbs evictions that writers
/// did not wait for (promotions, fragmentation).
const DEMOTION_BYTES_MAX: u64 = 2 * DEMOTION_BYTES;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub capacity: u64,
    pub max_block: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub hugepages: bool,
    pub prefault: bool,
    /// Tenants with a share of the pool: a tenant's blocks never take more
    /// than its share; past it, its own coldest blocks go first.
    pub quotas: Quotas,
    /// Keep the pool in a memfd that same-host clients can map.
    pub shared: bool,
}

impl PoolConfig {
    /// A small pool for tests.
    pub fn with_capacity(capacity: u64) -> Self {
        PoolConfig {
            capacity,
            max_block: capacity,
            high_watermark: 0.95,
            low_watermark: 0.85,
            hugepages: false,
            prefault: false,
            quotas: Quotas::default(),
            shared: false,
        }
    }
}

/// The share of the pool that puts still receiving their bytes may hold.
pub const PENDING_SHARE: f64 = 0.25;
/// The share of that room one tenant's puts in progress may hold, so that
/// another tenant's puts always find some.
pub const TENANT_PENDING_SHARE: f64 = 0.5;

/// Why a block could not be stored, read or changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The pool holds these very bytes (same length and checksum).
    #[error("block is already stored")]
    AlreadyExists,
    /// Another put of the key is writing it now.
    #[error("block is being stored by another put")]
    Busy,
    #[error("block of {0} bytes exceeds the largest block accepted")]
    TooLarge(u64),
    #[error("no space: the rest of the pool is pinned, leased or being written")]
    NoSpace,
    #[error("bytes do not match the writer's checksum")]
    ChecksumMismatch,
    #[error("no such block")]
    NotFound,
    #[error("the block is pinned as many times as a pin count holds")]
    TooManyPins,
}

impl PoolError {
    pub fn code(self) -> ErrorCode {
        match self {
            PoolError::AlreadyExists => ErrorCode::AlreadyExists,
            PoolError::Busy => ErrorCode::Busy,
            PoolError::TooLarge(_) => ErrorCode::TooLarge,
            PoolError::NoSpace => ErrorCode::NoSpace,
            PoolError::ChecksumMismatch => ErrorCode::ChecksumMismatch,
            PoolError::NotFound => ErrorCode::NotFound,
            PoolError::TooManyPins => ErrorCode::TooLarge,
        }
    }
}

pub struct DramPool {
    region: Region,
    /// Where each ready block lies, for same-host readers (shared pools).
    index: Option<SharedIndex>,
    cfg: PoolConfig,
    inner: Mutex<Inner>,
    removed: Mutex<Vec<BlockKey>>,
    removed_notify: Notify,
    evictions: AtomicU64,
    corrupt: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    /// Where evicted blocks go instead of away (the NVMe tier), if set.
    demote: std::sync::OnceLock<tokio::sync::mpsc::Sender<Demoted>>,
    demotions: AtomicU64,
    /// Blocks evicted because their tenant was over its share.
    quota_evictions: AtomicU64,
    /// Evicted while the demotion queue was full: gone from DRAM, perhaps
    /// still on the next tier; the tiers decide whether to report them.
    overflow: Mutex<Vec<BlockKey>>,
    /// Bytes copied into the demotion queue and not yet written.
    demote_queued: AtomicU64,
}

/// The pool's block index, in its own memfd, mapped read-only by same-host
/// clients (see `mooncake_proto::shm_index`). Written under the pool's
/// lock, so there is one writer at a time.
struct SharedIndex {
    region: Region,
    table: IndexTable,
    /// Ready blocks left out because their bucket was full (readers lease
    /// those).
    unindexed: AtomicU64,
}

impl SharedIndex {
    fn new(pool_bytes: u64) -> std::io::Result<SharedIndex> {
        let buckets = shm_index::buckets_for(pool_bytes);
        let region = Region::shared(shm_index::bytes_for(buckets), false, true)?;
        // SAFETY: a fresh page-aligned mapping of the right size that lives
        // as long as the table (both are fields of this struct, and the
        // table is only used through it).
        let table = unsafe { IndexTable::init(region.ptr(), buckets) };
        Ok(SharedIndex {
            region,
            table,
            unindexed: AtomicU64::new(0),
        })
    }

    fn publish(&self, key: &BlockKey, entry: Entry) {
        if !self.table.publish(Digest::of(key), entry) {
            self.unindexed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn withdraw(&self, key: &BlockKey) {
        self.table.withdraw(Digest::of(key));
    }
}

/// A block evicted from DRAM on its way to the next tier: its bytes were
/// copied out before its DRAM space was freed.
pub struct Demoted {
    pub key: BlockKey,
    pub bytes: Vec<u8>,
    pub checksum: u64,
    /// Its parent, kept with it on the next tier so that it comes back
    /// into DRAM as part of its chain (prefix-aware eviction).
    pub parent: Option<mooncake_proto::BlockHash>,
}

struct Inner {
    alloc: Allocator,
    blocks: HashMap<BlockKey, Block>,
    /// Units held by each tenant of `PoolConfig::quotas`, in its order.
    tenant_used: Vec<u64>,
    /// Evictable blocks (ready, unpinned, unleased) by last access.
    lru: Lru,
    /// Stored (ready) blocks per parent key: a parent with any is not a
    /// chain tail. The parent itself need not be stored.
    children: HashMap<BlockKey, u32>,
    /// Removed blocks whose bytes are still leased by readers, by offset.
    doomed: HashMap<u32, Doomed>,
    clock: u64,
    used_units: u64,
    /// Units reserved by puts not committed yet (part of `used_units`).
    pending_units: u64,
    /// The same per tenant (part of `tenant_used`).
    tenant_pending: Vec<u64>,
    pinned: u64,
}

/// Evictable blocks by last access (a stamp from the pool's clock), and
/// the same per tenant with a quota, so that an over-quota tenant finds its
/// coldest block at once.
///
/// Eviction is prefix-aware: a block's key extends its parent's prefix,
/// and a block whose children are stored is worth more than a chain's tail
/// (a prefix match stops at the first missing block, so a parent evicted
/// before its children strands them). The coldest *tail* (no stored child)
/// goes first; the coldest block of all only when no tail is evictable.
struct Lru {
    all: BTreeMap<u64, (BlockKey, Option<u16>)>,
    by_tenant: Vec<std::collections::BTreeSet<u64>>,
    /// The stamps in `all` of blocks no stored block names as its parent.
    tails: std::collections::BTreeSet<u64>,
}

impl Lru {
    fn new(tenants: usize) -> Lru {
        Lru {
            all: BTreeMap::new(),
            by_tenant: vec![Default::default(); tenants],
            tails: Default::default(),
        }
    }

    fn insert(&mut self, stamp: u64, key: BlockKey, tenant: Option<u16>, tail: bool) {
        if let Some(t) = tenant {
            self.by_tenant[t as usize].insert(stamp);
        }
        if tail {
            self.tails.insert(stamp);
        }
        self.all.insert(stamp, (key, tenant));
    }

    fn remove(&mut self, stamp: u64) -> Option<BlockKey> {
        let (key, tenant) = self.all.remove(&stamp)?;
        if let Some(t) = tenant {
            self.by_tenant[t as usize].remove(&stamp);
        }
        self.tails.remove(&stamp);
        Some(key)
    }

    /// Marks an evictable block a tail or not (its first child came, or
    /// its last one went); blocks not in the LRU are left alone.
    fn set_tail(&mut self, stamp: u64, tail: bool) {
        if !self.all.contains_key(&stamp) {
            return;
        }
        if tail {
            self.tails.insert(stamp);
        } else {
            self.tails.remove(&stamp);
        }
    }

    /// The next block to evict: the coldest tail, else the coldest block.
    fn pop_first(&mut self) -> Option<(u64, BlockKey)> {
        let stamp = match self.tails.first() {
            Some(s) => *s,
            None => *self.all.keys().next()?,
        };
        self.remove(stamp).map(|k| (stamp, k))
    }

    fn coldest_of(&self, tenant: u16) -> Option<u64> {
        self.by_tenant[tenant as usize].first().copied()
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (&u64, &BlockKey)> {
        self.all.iter().map(|(s, (k, _))| (s, k))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.all.len()
    }
}

struct Block {
    alloc: Allocation,
    /// Index of its tenant in `PoolConfig::quotas`, if it has a quota.
    tenant: Option<u16>,
    len: u32,
    checksum: u64,
    ready: bool,
    leases: u32,
    pins: u32,
    stamp: u64,
    /// The block whose prefix this one extends (same namespace), if the
    /// writer said.
    parent: Option<mooncake_proto::BlockHash>,
}

impl Block {
    fn evictable(&self) -> bool {
        self.ready && self.leases == 0 && self.pins == 0
    }
}

struct Doomed {
    alloc: Allocation,
    tenant: Option<u16>,
    leases: u32,
}

impl DramPool {
    pub fn new(cfg: PoolConfig) -> std::io::Result<Self> {
        let units = (cfg.capacity / UNIT).min(u32::MAX as u64) as u32;
        let len = (units as u64 * UNIT) as usize;
        let region = if cfg.shared {
            Region::shared(len, cfg.hugepages, cfg.prefault)?
        } else {
            Region::new(len, cfg.hugepages, cfg.prefault)?
        };
        // One allocation per block of at least 1 KiB, at most 4M of them.
        let max_allocs = (cfg.capacity / 1024).clamp(1024, 4 << 20) as u32;
        let tenants = cfg.quotas.len();
        let index = if cfg.shared {
            Some(SharedIndex::new(region.len() as u64)?)
        } else {
            None
        };
        Ok(DramPool {
            region,
            index,
            cfg,
            inner: Mutex::new(Inner {
                alloc: Allocator::with_max_allocs(units, max_allocs),
                blocks: HashMap::new(),
                tenant_used: vec![0; tenants],
                lru: Lru::new(tenants),
                children: HashMap::new(),
                doomed: HashMap::new(),
                clock: 0,
                used_units: 0,
                pending_units: 0,
                tenant_pending: vec![0; tenants],
                pinned: 0,
            }),
            removed: Mutex::new(Vec::new()),
            removed_notify: Notify::new(),
            evictions: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            demote: std::sync::OnceLock::new(),
            demotions: AtomicU64::new(0),
            quota_evictions: AtomicU64::new(0),
            overflow: Mutex::new(Vec::new()),
            demote_queued: AtomicU64::new(0),
        })
    }

    /// Where the pool's memory starts and its length in bytes (what an RDMA
    /// NIC registers); block offsets count from its start.
    pub fn memory(&self) -> (std::ptr::NonNull<u8>, usize) {
        (self.region.ptr(), self.region.len())
    }

    /// The memfd and size of a shared pool (`PoolConfig::shared`).
    pub fn shared_region(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        self.region.fd().map(|fd| (fd, self.region.len() as u64))
    }

    /// The memfd and size of a shared pool's block index.
    pub fn shared_index(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        let index = self.index.as_ref()?;
        let fd = index.region.fd()?;
        Some((fd, index.region.len() as u64))
    }

    /// Ready blocks the shared index had no room for since start.
    pub fn unindexed_blocks(&self) -> u64 {
        self.index
            .as_ref()
            .map_or(0, |i| i.unindexed.load(Ordering::Relaxed))
    }

    fn unpublish(&self, key: &BlockKey) {
        if let Some(index) = &self.index {
            index.withdraw(key);
        }
    }

    pub fn uses_hugepages(&self) -> bool {
        self.region.uses_hugepages()
    }

    pub fn max_block(&self) -> u64 {
        self.cfg.max_block
    }

    /// Reserves room for a block; the block stays invisible until the
    /// slot's bytes are written and `commit` verifies them. Evicts least
    /// recently used blocks when the pool is past its high watermark.
    ///
    /// A put is the key's current version: bytes still held under the key
    /// that differ from it (a removal that never reached this daemon, a
    /// block that outlived its meta entry) are stale and are replaced.
    /// `AlreadyExists` means exactly these bytes are stored; a put of the
    /// key still being written by another is `Busy`.
    pub fn reserve(
        self: &Arc<Self>,
        key: BlockKey,
        len: u64,
        checksum: u64,
    ) -> Result<WriteSlot, PoolError> {
        if len > self.cfg.max_block {
            return Err(PoolError::TooLarge(len));
        }
        let units = len.div_ceil(UNIT).max(1) as u32;
        let mut inner = self.inner.lock();
        let capacity_units = self.region.len() as u64 / UNIT;
        // Room held by puts whose bytes have not all arrived is capped, so
        // that headers without values cannot push out the stored blocks:
        // past the cap a put waits its turn (`Busy`) instead of evicting.
        // The first put in progress always gets room.
        let pending_cap = (capacity_units as f64 * PENDING_SHARE) as u64;
        if inner.pending_units > 0 && inner.pending_units + u64::from(units) > pending_cap {
            return Err(PoolError::Busy);
        }
        // And one tenant's at most a share of that room: its first put in
        // progress always gets room too.
        let tenant = self.cfg.quotas.tenant_of(&key.namespace);
        if let Some(t) = tenant {
            let held = inner.tenant_pending[t as usize];
            let cap = (pending_cap as f64 * TENANT_PENDING_SHARE) as u64;
            if held > 0 && held + u64::from(units) > cap {
                return Err(PoolError::Busy);
            }
        }
        if let Some(held) = inner.blocks.get(&key) {
            if !held.ready {
                return Err(PoolError::Busy);
            }
            if u64::from(held.len) == len && held.checksum == checksum {
                return Err(PoolError::AlreadyExists);
            }
            // Not reported as removed: the meta service already has this
            // put as the key's version here, and must keep it.
            let stale = inner.blocks.remove(&key).expect("just found");
            self.discard(&mut inner, &key, stale);
            tracing::info!(%key, "put replaces other bytes held under its key");
        }
        let high = (capacity_units as f64 * self.cfg.high_watermark) as u64;
        let low = (capacity_units as f64 * self.cfg.low_watermark) as u64;
        // With a next tier, evict only what this block needs: every evicted
        // block is copied to the demotion queue, and a burst down to the low
        // watermark would overflow it.
        let target = if self.demote.get().is_some() {
            high
        } else {
            low
        };
        if inner.used_units + units as u64 > high {
            while inner.used_units + units as u64 > target {
                if !self.evict_one(&mut inner) {
                    break;
                }
            }
        }
        if let Some(t) = tenant {
            // Over its share, a tenant makes room from its own blocks.
            let limit = self.cfg.quotas.limit(t, capacity_units);
            if units as u64 > limit {
                return Err(PoolError::NoSpace);
            }
            while inner.tenant_used[t as usize] + units as u64 > limit {
                if !self.evict_tenant_one(&mut inner, t) {
                    return Err(PoolError::NoSpace);
                }
            }
        }
        let alloc = loop {
            if let Some(a) = inner.alloc.allocate(units) {
                break a;
            }
            // Fragmentation or watermark slack: make more room, one block
            // at a time, until it fits or nothing more can go.
            if !self.evict_one(&mut inner) {
                return Err(PoolError::NoSpace);
            }
        };
        let size = inner.alloc.allocation_size(alloc) as u64;
        inner.used_units += size;
        inner.pending_units += size;
        if let Some(t) = tenant {
            inner.tenant_used[t as usize] += size;
            inner.tenant_pending[t as usize] += size;
        }
        inner.blocks.insert(
            key.clone(),
            Block {
                alloc,
                tenant,
                len: len as u32,
                checksum,
                ready: false,
                leases: 0,
                pins: 0,
                stamp: 0,
                parent: None,
            },
        );
        Ok(WriteSlot {
            pool: self.clone(),
            parent: None,
            key,
            offset: alloc.offset as u64 * UNIT,
            len: len as usize,
            checksum,
            committed: false,
        })
    }

    fn evict_one(&self, inner: &mut Inner) -> bool {
        let Some((_, key)) = inner.lru.pop_first() else {
            return false;
        };
        self.evict(inner, key);
        true
    }

    /// Evicts the coldest evictable block of tenant `t`; `false` if none
    /// is found among the coldest `MAX_QUOTA_SCAN`.
    fn evict_tenant_one(&self, inner: &mut Inner, t: u16) -> bool {
        let Some(key) = inner.lru.coldest_of(t).and_then(|s| inner.lru.remove(s)) else {
            return false;
        };
        self.quota_evictions.fetch_add(1, Ordering::Relaxed);
        self.evict(inner, key);
        true
    }

    /// A put is no longer in progress: committed, or dropped.
    fn written(inner: &mut Inner, alloc: Allocation, tenant: Option<u16>) {
        let size = inner.alloc.allocation_size(alloc) as u64;
        inner.pending_units -= size;
        if let Some(t) = tenant {
            inner.tenant_pending[t as usize] -= size;
        }
    }

    /// Frees a block's space (and its tenant's share).
    fn free(inner: &mut Inner, alloc: Allocation, tenant: Option<u16>) {
        let size = inner.alloc.allocation_size(alloc) as u64;
        inner.used_units -= size;
        if let Some(t) = tenant {
            inner.tenant_used[t as usize] -= size;
        }
        inner.alloc.free(alloc);
    }

    /// Puts an evictable block on the LRU, as a tail if no stored block
    /// names it as parent.
    fn lru_insert(inner: &mut Inner, stamp: u64, key: &BlockKey, tenant: Option<u16>) {
        let tail = !inner.children.contains_key(key);
        inner.lru.insert(stamp, key.clone(), tenant, tail);
    }

    /// A stored block naming `parent` arrived: the parent is no tail now.
    fn add_child(inner: &mut Inner, key: &BlockKey, parent: mooncake_proto::BlockHash) {
        let parent = BlockKey::new(key.namespace.clone(), parent);
        let count = inner.children.entry(parent.clone()).or_insert(0);
        *count += 1;
        if *count == 1 {
            if let Some(p) = inner.blocks.get(&parent) {
                inner.lru.set_tail(p.stamp, false);
            }
        }
    }

    /// A stored block naming `parent` left: the parent may be a tail again.
    fn remove_child(inner: &mut Inner, key: &BlockKey, parent: mooncake_proto::BlockHash) {
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

    /// Evicts a block already taken off the LRU.
    fn evict(&self, inner: &mut Inner, key: BlockKey) {
        let block = inner.blocks.remove(&key).expect("lru entries are indexed");
        debug_assert!(block.evictable());
        self.unpublish(&key);
        if let Some(parent) = block.parent {
            Self::remove_child(inner, &key, parent);
        }
        // Demotion: the bytes leave for the next tier before the space is
        // freed. A full demotion queue drops the block (a miss later).
        let mut kept = false;
        let budget_left =
            self.demote_queued.load(Ordering::Relaxed) + block.len as u64 <= DEMOTION_BYTES_MAX;
        if let Some(next) = self.demote.get().filter(|_| budget_left) {
            let offset = block.alloc.offset as usize * UNIT as usize;
            // SAFETY: an evictable block has no lease and no writer.
            let bytes = unsafe { self.region.slice(offset, block.len as usize) }.to_vec();
            let demoted = Demoted {
                key: key.clone(),
                bytes,
                checksum: block.checksum,
                parent: block.parent,
            };
            kept = next.try_send(demoted).is_ok();
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

    /// Blocks evicted while the demotion queue was full.
    pub fn take_overflow(&self) -> Vec<BlockKey> {
        std::mem::take(&mut *self.overflow.lock())
    }

    /// Sends evicted blocks to `next` (the NVMe tier's writer) instead of
    /// dropping them. Set once, at start.
    pub fn demote_to(&self, next: tokio::sync::mpsc::Sender<Demoted>) {
        let _ = self.demote.set(next);
    }

    /// Whether the demotion queue can take `len` more bytes of evicted
    /// blocks (a block larger than the budget fits an empty queue).
    pub fn has_demotion_room(&self, len: u64) -> bool {
        let queued = self.demote_queued.load(Ordering::Relaxed);
        self.demote.get().is_some_and(|tx| {
            tx.capacity() >= tx.max_capacity() / 4
                && (queued == 0 || queued + len <= DEMOTION_BYTES)
        })
    }

    /// The demoter wrote (or gave up on) a demoted block of `len` bytes.
    pub fn demotion_done(&self, len: u64) {
        self.demote_queued.fetch_sub(len, Ordering::Relaxed);
    }

    /// Whether storing `extra` more bytes would start an eviction.
    pub fn would_evict(&self, extra: u64) -> bool {
        let inner = self.inner.lock();
        let capacity_units = self.region.len() as u64 / UNIT;
        let high = (capacity_units as f64 * self.cfg.high_watermark) as u64;
        inner.used_units + extra.div_ceil(UNIT) > high
    }

    /// Each tenant with a quota: (tenant, bytes used, bytes allowed).
    pub fn tenant_usage(&self) -> Vec<(Arc<str>, u64, u64)> {
        let inner = self.inner.lock();
        let capacity = self.region.len() as u64;
        (0..self.cfg.quotas.len() as u16)
            .map(|t| {
                let used = inner.tenant_used[t as usize] * UNIT;
                (
                    self.cfg.quotas.name(t).clone(),
                    used,
                    self.cfg.quotas.limit(t, capacity),
                )
            })
            .collect()
    }

    /// Blocks evicted because their tenant was over its share.
    pub fn quota_evictions(&self) -> u64 {
        self.quota_evictions.load(Ordering::Relaxed)
    }

    /// Blocks sent to the next tier since start.
    pub fn demotions(&self) -> u64 {
        self.demotions.load(Ordering::Relaxed)
    }

    /// Tells the meta service (with the next report) that a block is gone
    /// from this daemon.
    pub fn report_removed(&self, key: BlockKey) {
        let mut removed = self.removed.lock();
        if removed.len() >= MAX_PENDING_REMOVALS {
            removed.remove(0);
        }
        removed.push(key);
        drop(removed);
        self.removed_notify.notify_one();
    }

    /// Keys dropped by eviction or corruption since the last call.
    pub fn take_removed(&self) -> Vec<BlockKey> {
        std::mem::take(&mut *self.removed.lock())
    }

    /// Resolves when `take_removed` has something to return.
    pub async fn removed_ready(&self) {
        self.removed_notify.notified().await
    }

    /// A lease on a stored block: its bytes stay in place, and it is not
    /// evicted, until the lease is dropped. Counts as an access for LRU.
    pub fn get(self: &Arc<Self>, key: &BlockKey) -> Option<ReadLease> {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let clock = inner.clock;
        let block = inner.blocks.get_mut(key)?;
        if !block.ready {
            return None;
        }
        let was_evictable = block.evictable();
        let old_stamp = block.stamp;
        block.leases += 1;
        block.stamp = clock;
        let lease = ReadLease {
            pool: self.clone(),
            key: key.clone(),
            offset: block.alloc.offset,
            len: block.len as usize,
            checksum: block.checksum,
        };
        if was_evictable {
            inner.lru.remove(old_stamp);
        }
        Some(lease)
    }

    fn release(&self, key: &BlockKey, offset: u32) {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        if let Some(block) = inner.blocks.get_mut(key) {
            if block.alloc.offset == offset {
                block.leases -= 1;
                if block.evictable() {
                    let (stamp, tenant) = (block.stamp, block.tenant);
                    Self::lru_insert(inner, stamp, key, tenant);
                }
                return;
            }
        }
        let doomed = inner
            .doomed
            .get_mut(&offset)
            .expect("a lease whose block left the index is doomed");
        doomed.leases -= 1;
        if doomed.leases == 0 {
            let doomed = inner.doomed.remove(&offset).expect("just found");
            Self::free(inner, doomed.alloc, doomed.tenant);
        }
    }

    /// Drops a stored block. Its space comes back once no reader holds it.
    pub fn remove(&self, key: &BlockKey) -> Result<(), PoolError> {
        let mut inner = self.inner.lock();
        match inner.blocks.get(key) {
            Some(b) if b.ready => {}
            _ => return Err(PoolError::NotFound),
        }
        let block = inner.blocks.remove(key).expect("just found");
        self.discard(&mut inner, key, block);
        Ok(())
    }

    /// Lets go of a stored block taken out of the index.
    fn discard(&self, inner: &mut Inner, key: &BlockKey, block: Block) {
        self.unpublish(key);
        if block.evictable() {
            inner.lru.remove(block.stamp);
        }
        if let Some(parent) = block.parent {
            Self::remove_child(inner, key, parent);
        }
        if block.pins > 0 {
            inner.pinned -= 1;
        }
        if block.leases > 0 {
            inner.doomed.insert(
                block.alloc.offset,
                Doomed {
                    alloc: block.alloc,
                    tenant: block.tenant,
                    leases: block.leases,
                },
            );
        } else {
            Self::free(inner, block.alloc, block.tenant);
        }
    }

    /// Drops a block whose bytes failed their checksum, and reports it.
    pub fn drop_corrupt(&self, lease: &ReadLease) {
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.inner.lock();
        let matches = inner
            .blocks
            .get(&lease.key)
            .is_some_and(|b| b.alloc.offset == lease.offset);
        if matches {
            let block = inner.blocks.remove(&lease.key).expect("just found");
            self.discard(&mut inner, &lease.key, block);
            drop(inner);
            tracing::error!(key = %lease.key, "block failed its checksum in DRAM; dropped");
            self.report_removed(lease.key.clone());
        }
    }

    /// Keeps a block from eviction until as many `unpin`s.
    pub fn pin(&self, key: &BlockKey) -> Result<(), PoolError> {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let block = inner
            .blocks
            .get_mut(key)
            .filter(|b| b.ready)
            .ok_or(PoolError::NotFound)?;
        // Pins nest; past u32::MAX of them a pin is refused, not wrapped
        // (which would make a pinned block evictable).
        let pins = block.pins.checked_add(1).ok_or(PoolError::TooManyPins)?;
        if block.evictable() {
            inner.lru.remove(block.stamp);
        }
        if block.pins == 0 {
            inner.pinned += 1;
        }
        block.pins = pins;
        Ok(())
    }

    /// Undoes one `pin`; unpinning an unpinned block is a no-op.
    pub fn unpin(&self, key: &BlockKey) -> Result<(), PoolError> {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let block = inner
            .blocks
            .get_mut(key)
            .filter(|b| b.ready)
            .ok_or(PoolError::NotFound)?;
        if block.pins == 0 {
            return Ok(());
        }
        block.pins -= 1;
        if block.pins == 0 {
            inner.pinned -= 1;
            if block.evictable() {
                let (stamp, tenant) = (block.stamp, block.tenant);
                Self::lru_insert(inner, stamp, key, tenant);
            }
        }
        Ok(())
    }

    /// Every stored block, as the meta service needs it to rebuild its
    /// index: (key, size, checksum).
    pub fn inventory(&self) -> Vec<(BlockKey, u32, u64)> {
        let inner = self.inner.lock();
        inner
            .blocks
            .iter()
            .filter(|(_, b)| b.ready)
            .map(|(k, b)| (k.clone(), b.len, b.checksum))
            .collect()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.inner.lock().blocks.get(key).is_some_and(|b| b.ready)
    }

    /// The parent a stored block names (prefix-aware eviction keeps it
    /// from being evicted before this block).
    pub fn parent_of(&self, key: &BlockKey) -> Option<mooncake_proto::BlockHash> {
        let inner = self.inner.lock();
        inner
            .blocks
            .get(key)
            .filter(|b| b.ready)
            .and_then(|b| b.parent)
    }

    pub fn stats(&self) -> PoolStats {
        let inner = self.inner.lock();
        PoolStats {
            capacity: self.region.len() as u64,
            used: inner.used_units * UNIT,
            blocks: inner.blocks.values().filter(|b| b.ready).count() as u64,
            pinned: inner.pinned,
            evictions: self.evictions.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }

    /// A same-host client read the block through the shared index: it
    /// counts as a use for LRU, as a leased read does. `false` if the
    /// block is gone.
    pub fn touch(&self, key: &BlockKey) -> bool {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        inner.clock += 1;
        let clock = inner.clock;
        let Some(block) = inner.blocks.get_mut(key).filter(|b| b.ready) else {
            return false;
        };
        let (old, tenant, evictable) = (block.stamp, block.tenant, block.evictable());
        block.stamp = clock;
        if evictable {
            inner.lru.remove(old);
            Self::lru_insert(inner, clock, key, tenant);
        }
        true
    }

    /// Counts a client's get as a hit or a miss (for stats and metrics).
    pub fn note_get(&self, hit: bool) {
        let counter = if hit { &self.hits } else { &self.misses };
        counter.fetch_add(1, Ordering::Relaxed);
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

    /// Blocks found corrupt on read since start.
    pub fn corrupt_blocks(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }

    /// Flips one byte of a stored block in place, to prove that corruption
    /// is caught on read. Only for fault-injection tests.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn flip_byte_for_test(&self, key: &BlockKey, index: usize) -> bool {
        let inner = self.inner.lock();
        let Some(block) = inner.blocks.get(key) else {
            return false;
        };
        if index >= block.len as usize {
            return false;
        }
        let offset = block.alloc.offset as u64 * UNIT;
        // SAFETY: the block is inside the region; a racing reader sees
        // either byte, and the checksum catches the flip either way.
        let bytes = unsafe { self.region.slice_mut(offset as usize, block.len as usize) };
        bytes[index] ^= 0xff;
        true
    }
}

/// Exclusive room for one block's bytes. Dropped without `commit` (the
/// writer vanished mid-transfer), it frees its space at once.
pub struct WriteSlot {
    pool: Arc<DramPool>,
    key: BlockKey,
    /// The block this one extends, as its writer said (see `Lru`).
    parent: Option<mooncake_proto::BlockHash>,
    offset: u64,
    len: usize,
    checksum: u64,
    committed: bool,
}

impl WriteSlot {
    /// Where the block's bytes go in the pool's region.
    pub fn byte_offset(&self) -> u64 {
        self.offset
    }

    /// Names the block whose prefix this one extends (same namespace).
    pub fn set_parent(&mut self, parent: Option<mooncake_proto::BlockHash>) {
        self.parent = parent;
    }

    pub fn buf_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocator gave this range to this slot alone; no
        // lease exists until the block is committed.
        unsafe { self.pool.region.slice_mut(self.offset as usize, self.len) }
    }

    /// Verifies the bytes against the writer's checksum and makes the block
    /// visible; on a mismatch the space is freed.
    pub fn commit(mut self) -> Result<(), PoolError> {
        let sum = checksum(self.buf_mut());
        self.commit_hashed(sum)
    }

    /// `commit`, for a writer that already hashed the bytes in this slot
    /// as they landed (`sum` must be the checksum of `buf_mut()`).
    pub fn commit_hashed(mut self, sum: u64) -> Result<(), PoolError> {
        if sum != self.checksum {
            return Err(PoolError::ChecksumMismatch);
        }
        let mut inner = self.pool.inner.lock();
        let inner = &mut *inner;
        inner.clock += 1;
        let block = inner
            .blocks
            .get_mut(&self.key)
            .expect("a reserved block stays indexed until committed or dropped");
        block.ready = true;
        block.stamp = inner.clock;
        block.parent = self.parent;
        let (tenant, alloc) = (block.tenant, block.alloc);
        DramPool::written(inner, alloc, tenant);
        if let Some(parent) = self.parent {
            DramPool::add_child(inner, &self.key, parent);
        }
        DramPool::lru_insert(inner, inner.clock, &self.key, tenant);
        if let Some(index) = &self.pool.index {
            let entry = Entry {
                offset: self.offset,
                len: self.len as u64,
                checksum: self.checksum,
            };
            index.publish(&self.key, entry);
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for WriteSlot {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut inner = self.pool.inner.lock();
        let block = inner.blocks.remove(&self.key).expect("reserved block");
        DramPool::written(&mut inner, block.alloc, block.tenant);
        DramPool::free(&mut inner, block.alloc, block.tenant);
    }
}

/// A reader's hold on a block's bytes.
pub struct ReadLease {
    pool: Arc<DramPool>,
    key: BlockKey,
    offset: u32,
    len: usize,
    checksum: u64,
}

impl ReadLease {
    /// Where the bytes start in the pool's region.
    pub fn byte_offset(&self) -> u64 {
        self.offset as u64 * UNIT
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: a leased block is neither freed nor rewritten until every
        // lease on it is dropped.
        unsafe {
            self.pool
                .region
                .slice(self.offset as usize * UNIT as usize, self.len)
        }
    }

    pub fn checksum(&self) -> u64 {
        self.checksum
    }

    /// Whether the bytes still match the writer's checksum.
    pub fn verify(&self) -> bool {
        checksum(self.bytes()) == self.checksum
    }
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        self.pool.release(&self.key, self.offset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(i: u32) -> BlockKey {
        in_ns("test", i)
    }

    fn in_ns(ns: &str, i: u32) -> BlockKey {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&i.to_le_bytes());
        BlockKey::new(Namespace::new(ns).unwrap(), BlockHash(h))
    }

    fn pool(capacity: u64) -> Arc<DramPool> {
        Arc::new(DramPool::new(PoolConfig::with_capacity(capacity)).unwrap())
    }

    fn put(pool: &Arc<DramPool>, k: BlockKey, fill: u8, len: usize) -> Result<(), PoolError> {
        let value = vec![fill; len];
        let mut slot = pool.reserve(k, len as u64, checksum(&value))?;
        slot.buf_mut().copy_from_slice(&value);
        slot.commit()
    }

    #[test]
    fn a_tenant_over_its_share_evicts_its_own_blocks_first() {
        let cfg = PoolConfig {
            quotas: Quotas::new([("acme".into(), 0.25)]),
            ..PoolConfig::with_capacity(1 << 20)
        };
        let p = Arc::new(DramPool::new(cfg).unwrap());
        // Another tenant's blocks, colder than all of acme's.
        for i in 0..4 {
            put(&p, in_ns("globex", i), 1, 64 << 10).unwrap();
        }
        // Acme writes twice its share (256 KiB) of 32 KiB blocks.
        for i in 0..16 {
            put(&p, in_ns("acme/llama", i), 2, 32 << 10).unwrap();
            let (_, used, limit) = p.tenant_usage()[0].clone();
            assert!(used <= limit, "acme at {used} of {limit}");
        }
        for i in 0..4 {
            assert!(
                p.contains(&in_ns("globex", i)),
                "globex's block {i} was evicted for acme"
            );
        }
        assert!(
            !p.contains(&in_ns("acme/llama", 0)),
            "acme's coldest went first"
        );
        assert!(p.contains(&in_ns("acme/llama", 15)));
        assert_eq!(p.quota_evictions(), 8);
        // A block larger than the whole share is refused.
        assert_eq!(
            put(&p, in_ns("acme", 99), 3, 300 << 10),
            Err(PoolError::NoSpace)
        );
    }

    #[test]
    fn one_tenants_puts_in_progress_leave_room_for_anothers() {
        let cfg = PoolConfig {
            quotas: Quotas::new([("acme".into(), 1.0), ("globex".into(), 1.0)]),
            ..PoolConfig::with_capacity(1 << 20)
        };
        let p = Arc::new(DramPool::new(cfg).unwrap());
        // Headers without values, 16 KiB each: acme may hold half of the
        // quarter of the pool that puts in progress may hold (128 KiB).
        let mut held = Vec::new();
        let refused = loop {
            match p.reserve(in_ns("acme", held.len() as u32), 16 << 10, 0) {
                Ok(slot) => held.push(slot),
                Err(err) => break err,
            }
        };
        assert_eq!(refused, PoolError::Busy);
        assert_eq!(held.len(), 8, "acme's puts in progress: 128 KiB");
        // Globex's puts still find room, up to the rest of the quarter.
        let globex: Vec<_> = (0..8)
            .map(|i| p.reserve(in_ns("globex", i), 16 << 10, 0))
            .collect::<Result<_, _>>()
            .expect("the rest of the room is globex's to take");
        assert_eq!(
            p.reserve(in_ns("globex", 99), 16 << 10, 0).err(),
            Some(PoolError::Busy),
            "and no more than the whole quarter"
        );
        drop(held);
        put(&p, in_ns("acme", 100), 1, 16 << 10).expect("room again once acme's heads go");
        drop(globex);
        assert_eq!(p.inner.lock().tenant_pending, vec![0, 0]);
    }

    #[test]
    fn put_then_get_returns_the_same_bytes() {
        let p = pool(1 << 20);
        put(&p, key(1), 7, 5000).unwrap();
        let lease = p.get(&key(1)).unwrap();
        assert_eq!(lease.bytes(), &vec![7u8; 5000][..]);
        assert!(lease.verify());
        assert_eq!(put(&p, key(1), 7, 5000), Err(PoolError::AlreadyExists));
    }

    #[test]
    fn a_pin_count_never_wraps() {
        let p = pool(1 << 20);
        put(&p, key(1), 7, 100).unwrap();
        p.pin(&key(1)).unwrap();
        p.inner.lock().blocks.get_mut(&key(1)).unwrap().pins = u32::MAX;
        assert_eq!(p.pin(&key(1)), Err(PoolError::TooManyPins));
        assert_eq!(
            p.inner.lock().blocks[&key(1)].pins,
            u32::MAX,
            "not wrapped to 0"
        );
        assert_eq!(p.evict_bytes(1 << 20).1, 0, "still pinned: nothing evicted");
        assert!(p.contains(&key(1)));
    }

    #[test]
    fn a_put_of_other_bytes_replaces_what_the_key_held() {
        let p = pool(1 << 20);
        put(&p, key(1), 7, 5000).unwrap();
        let old_reader = p.get(&key(1)).unwrap();
        put(&p, key(1), 8, 10).unwrap();
        let lease = p.get(&key(1)).unwrap();
        assert_eq!(lease.bytes(), &[8u8; 10][..], "the new bytes, not the old");
        assert!(lease.verify());
        assert_eq!(
            old_reader.bytes(),
            &vec![7u8; 5000][..],
            "a reader of the old block keeps its bytes until it lets go"
        );
        assert!(
            p.take_removed().is_empty(),
            "not a removal for the meta service: the key lives on, with new bytes"
        );
        let writing = p.reserve(key(2), 100, 0).unwrap();
        assert_eq!(
            p.reserve(key(2), 100, 0).err(),
            Some(PoolError::Busy),
            "a put in progress is neither replaced nor reported stored"
        );
        drop(writing);
    }

    #[test]
    fn uncommitted_slot_is_invisible_and_its_space_comes_back() {
        let p = pool(1 << 20);
        let slot = p.reserve(key(1), 4096, 0).unwrap();
        assert!(p.get(&key(1)).is_none());
        assert!(p.stats().used >= 4096);
        drop(slot);
        assert_eq!(p.stats().used, 0);
        assert!(p.get(&key(1)).is_none());
    }

    #[test]
    fn wrong_checksum_is_refused_and_frees_space() {
        let p = pool(1 << 20);
        let mut slot = p.reserve(key(1), 100, 12345).unwrap();
        slot.buf_mut().fill(1);
        assert_eq!(slot.commit(), Err(PoolError::ChecksumMismatch));
        assert!(!p.contains(&key(1)));
        assert_eq!(p.stats().used, 0);
    }

    #[test]
    fn full_pool_evicts_least_recently_used_first() {
        let p = pool(64 << 10);
        // 56 KiB: under the high watermark (95% of 64 KiB).
        for i in 0..7 {
            put(&p, key(i), i as u8, 8 << 10).unwrap();
        }
        // Touch block 0 so that block 1 is now the coldest.
        drop(p.get(&key(0)).unwrap());
        put(&p, key(100), 1, 8 << 10).unwrap();
        assert!(p.contains(&key(0)), "recently read block survived");
        assert!(!p.contains(&key(1)), "coldest block was evicted");
        assert!(p.stats().evictions >= 1);
        assert!(p.take_removed().contains(&key(1)));
        assert!(p.stats().used <= p.stats().capacity);
    }

    #[test]
    fn chain_tails_are_evicted_before_the_blocks_they_extend() {
        // Room for 4 blocks of 64 KiB (and the watermarks leave 3).
        let p = pool(4 * (64 << 10));
        let put_child = |k: u32, parent: Option<u32>| {
            let value = vec![k as u8; 64 << 10];
            let mut slot = p
                .reserve(key(k), value.len() as u64, checksum(&value))
                .unwrap();
            slot.buf_mut().copy_from_slice(&value);
            slot.set_parent(parent.map(|q| key(q).hash));
            slot.commit().unwrap();
        };
        // A chain 1 <- 2 <- 3, oldest first: plain LRU would evict 1, the
        // head every prefix match needs, and strand 2 and 3.
        put_child(1, None);
        put_child(2, Some(1));
        put_child(3, Some(2));
        put_child(4, None);
        assert!(
            p.contains(&key(1)) && p.contains(&key(2)),
            "the chain's head and middle stay"
        );
        assert!(!p.contains(&key(3)), "the chain's tail went first");
        // With 3 gone, 2 is the chain's tail, and colder than 4.
        put_child(5, None);
        assert!(!p.contains(&key(2)));
        assert!(
            p.contains(&key(1)) && p.contains(&key(4)),
            "the head outlives its tail"
        );
    }

    #[test]
    fn pinned_and_leased_blocks_are_never_evicted() {
        let p = pool(64 << 10);
        put(&p, key(0), 0, 16 << 10).unwrap();
        put(&p, key(1), 1, 16 << 10).unwrap();
        p.pin(&key(0)).unwrap();
        let lease = p.get(&key(1)).unwrap();
        for i in 10..30 {
            let _ = put(&p, key(i), 2, 8 << 10);
        }
        assert!(p.contains(&key(0)));
        assert!(p.contains(&key(1)));
        assert_eq!(lease.bytes(), &vec![1u8; 16 << 10][..]);
        // With everything else pinned or leased, a block that needs their
        // space gets a clean NoSpace.
        assert_eq!(put(&p, key(99), 3, 60 << 10), Err(PoolError::NoSpace));
        drop(lease);
        p.unpin(&key(0)).unwrap();
        put(&p, key(99), 3, 40 << 10).unwrap();
        assert!(!p.contains(&key(0)) || !p.contains(&key(1)));
    }

    #[test]
    fn removed_block_stays_readable_while_leased() {
        let p = pool(1 << 20);
        put(&p, key(1), 9, 4096).unwrap();
        let lease = p.get(&key(1)).unwrap();
        p.remove(&key(1)).unwrap();
        assert!(p.get(&key(1)).is_none());
        // Its space is still held: a new block cannot overwrite the bytes.
        put(&p, key(2), 1, 4096).unwrap();
        assert_eq!(lease.bytes(), &vec![9u8; 4096][..]);
        drop(lease);
        p.remove(&key(2)).unwrap();
        assert_eq!(p.stats().used, 0);
    }

    #[test]
    fn flipped_byte_fails_verification_and_is_dropped() {
        let p = pool(1 << 20);
        put(&p, key(1), 5, 2048).unwrap();
        assert!(p.flip_byte_for_test(&key(1), 100));
        let lease = p.get(&key(1)).unwrap();
        assert!(!lease.verify());
        p.drop_corrupt(&lease);
        drop(lease);
        assert!(!p.contains(&key(1)));
        assert_eq!(p.corrupt_blocks(), 1);
        assert_eq!(p.stats().used, 0);
    }

    #[test]
    fn inventory_lists_only_committed_blocks() {
        let p = pool(1 << 20);
        put(&p, key(1), 1, 100).unwrap();
        let _writing = p.reserve(key(2), 100, 0).unwrap();
        let inv = p.inventory();
        assert_eq!(inv.len(), 1);
        assert_eq!((inv[0].0.clone(), inv[0].1), (key(1), 100));
    }

    #[test]
    fn evict_bytes_frees_the_coldest_first_and_reports_them() {
        let p = pool(1 << 20);
        for i in 0..4 {
            put(&p, key(i), 0, 10 << 10).unwrap();
        }
        let (freed, blocks) = p.evict_bytes(15 << 10);
        assert_eq!(blocks, 2);
        assert!(freed >= 15 << 10);
        assert!(!p.contains(&key(0)) && !p.contains(&key(1)) && p.contains(&key(2)));
        assert_eq!(p.take_removed(), vec![key(0), key(1)]);
    }

    #[test]
    fn oversized_block_is_refused_without_allocating() {
        let p = pool(1 << 20);
        assert_eq!(
            put(&p, key(1), 0, 2 << 20),
            Err(PoolError::TooLarge(2 << 20))
        );
        assert_eq!(p.stats().used, 0);
    }

    #[test]
    fn random_workload_never_overlaps_or_leaks() {
        use rand::{Rng, SeedableRng};
        let p = pool(1 << 20);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for i in 0..3000u32 {
            let len = rng.gen_range(1..64 << 10);
            let fill = (i % 251) as u8;
            let _ = put(&p, key(i), fill, len);
            if rng.gen_bool(0.1) {
                let _ = p.remove(&key(rng.gen_range(0..=i)));
            }
            let probe = key(rng.gen_range(0..=i));
            if let Some(lease) = p.get(&probe) {
                let expect =
                    (u32::from_le_bytes(probe.hash.0[..4].try_into().unwrap()) % 251) as u8;
                assert!(
                    lease.bytes().iter().all(|b| *b == expect),
                    "overlap detected"
                );
            }
            assert!(p.stats().used <= p.stats().capacity);
        }
        for i in 0..3000 {
            let _ = p.remove(&key(i));
        }
        assert_eq!(p.stats().used, 0, "space leaked");
        assert_eq!(p.stats().blocks, 0);
    }
}

/// Properties of the pool under any sequence of operations: blocks never
/// overlap, no byte leaks, capacity is never exceeded, and what is pinned or
/// leased is never evicted.
#[cfg(test)]
mod props {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Put {
            key: u8,
            len: u32,
        },
        /// A writer that reserves and vanishes before committing.
        Abandon {
            key: u8,
            len: u32,
        },
        Remove {
            key: u8,
        },
        Pin {
            key: u8,
        },
        Unpin {
            key: u8,
        },
        Lease {
            key: u8,
        },
        Release {
            nth: u8,
        },
        /// A read through the shared index, told to the pool.
        Touch {
            key: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let key = 0u8..48;
        let len = prop_oneof![1u32..300, 1u32..20_000, 20_000u32..70_000];
        prop_oneof![
            4 => (key.clone(), len.clone()).prop_map(|(key, len)| Op::Put { key, len }),
            1 => (key.clone(), len).prop_map(|(key, len)| Op::Abandon { key, len }),
            2 => key.clone().prop_map(|key| Op::Remove { key }),
            1 => key.clone().prop_map(|key| Op::Pin { key }),
            1 => key.clone().prop_map(|key| Op::Unpin { key }),
            2 => key.clone().prop_map(|key| Op::Lease { key }),
            1 => key.prop_map(|key| Op::Touch { key }),
            2 => any::<u8>().prop_map(|nth| Op::Release { nth }),
        ]
    }

    /// Even keys belong to tenant `quota` (30% of the pool), odd ones to a
    /// namespace without a quota.
    fn key(i: u8) -> BlockKey {
        let ns = if i % 2 == 0 { "quota/model" } else { "free" };
        BlockKey::new(Namespace::new(ns).unwrap(), BlockHash::from_opaque(&[i]))
    }

    /// The pool's own accounting agrees with its blocks, and its shared
    /// index shows exactly its ready blocks, where they are.
    fn check(pool: &DramPool) {
        let inner = pool.inner.lock();
        if let Some(index) = &pool.index {
            assert_eq!(index.unindexed.load(Ordering::Relaxed), 0);
            for k in 0..=u8::MAX {
                let key = key(k);
                let want = inner.blocks.get(&key).filter(|b| b.ready).map(|b| Entry {
                    offset: b.alloc.offset as u64 * UNIT,
                    len: b.len as u64,
                    checksum: b.checksum,
                });
                assert_eq!(
                    index.table.lookup(Digest::of(&key)),
                    want,
                    "the index disagrees about block {k}"
                );
            }
        }
        let mut spans: Vec<(u64, u64)> = inner
            .blocks
            .values()
            .map(|b| b.alloc)
            .chain(inner.doomed.values().map(|d| d.alloc))
            .map(|a| (a.offset as u64, inner.alloc.allocation_size(a) as u64))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:?}");
        }
        let allocated: u64 = spans.iter().map(|(_, n)| n).sum();
        assert_eq!(
            allocated, inner.used_units,
            "allocated units leak or double count"
        );
        let pending: u64 = inner
            .blocks
            .values()
            .filter(|b| !b.ready)
            .map(|b| inner.alloc.allocation_size(b.alloc) as u64)
            .sum();
        assert_eq!(pending, inner.pending_units, "room of puts in progress");
        for (t, held) in inner.tenant_pending.iter().enumerate() {
            let want: u64 = inner
                .blocks
                .values()
                .filter(|b| !b.ready && b.tenant == Some(t as u16))
                .map(|b| inner.alloc.allocation_size(b.alloc) as u64)
                .sum();
            assert_eq!(*held, want, "tenant {t}'s room of puts in progress");
        }
        assert!(
            inner.used_units * UNIT <= pool.region.len() as u64,
            "over capacity"
        );
        for (t, stamps) in inner.lru.by_tenant.iter().enumerate() {
            let want: std::collections::BTreeSet<u64> = inner
                .lru
                .all
                .iter()
                .filter(|(_, (_, tenant))| *tenant == Some(t as u16))
                .map(|(s, _)| *s)
                .collect();
            assert_eq!(stamps, &want, "tenant {t}'s LRU differs from the pool's");
        }
        for (k, tenant) in inner.lru.all.values() {
            assert_eq!(
                inner.blocks[k].tenant, *tenant,
                "LRU entry of the wrong tenant"
            );
        }
        for (stamp, k) in inner.lru.iter() {
            let b = &inner.blocks[k];
            assert!(
                b.evictable() && b.stamp == *stamp,
                "an unevictable block in the LRU"
            );
        }
        let evictable = inner.blocks.values().filter(|b| b.evictable()).count();
        assert_eq!(
            evictable,
            inner.lru.len(),
            "an evictable block missing from the LRU"
        );
        let pinned = inner.blocks.values().filter(|b| b.pins > 0).count() as u64;
        assert_eq!(pinned, inner.pinned);
        let mut children: HashMap<BlockKey, u32> = HashMap::new();
        for (k, b) in inner.blocks.iter().filter(|(_, b)| b.ready) {
            if let Some(p) = b.parent {
                *children
                    .entry(BlockKey::new(k.namespace.clone(), p))
                    .or_insert(0) += 1;
            }
        }
        assert_eq!(
            children, inner.children,
            "children counts differ from the blocks"
        );
        let tails: std::collections::BTreeSet<u64> = inner
            .lru
            .all
            .iter()
            .filter(|(_, (k, _))| !children.contains_key(k))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(
            tails, inner.lru.tails,
            "tails are the evictable blocks without children"
        );
        let capacity_units = pool.region.len() as u64 / UNIT;
        for t in 0..pool.cfg.quotas.len() {
            let held: u64 = inner
                .blocks
                .values()
                .filter(|b| b.tenant == Some(t as u16))
                .map(|b| b.alloc)
                .chain(
                    inner
                        .doomed
                        .values()
                        .filter(|d| d.tenant == Some(t as u16))
                        .map(|d| d.alloc),
                )
                .map(|a| inner.alloc.allocation_size(a) as u64)
                .sum();
            assert_eq!(held, inner.tenant_used[t], "tenant accounting");
            assert!(
                held <= pool.cfg.quotas.limit(t as u16, capacity_units),
                "tenant over its share"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn any_sequence_keeps_the_pool_consistent(ops in proptest::collection::vec(op(), 1..200)) {
            let cfg = PoolConfig {
                quotas: Quotas::new([("quota".into(), 0.3)]),
                shared: true,
                ..PoolConfig::with_capacity(1 << 20)
            };
            let pool = Arc::new(DramPool::new(cfg).unwrap());
            let mut leases: Vec<ReadLease> = Vec::new();
            let mut pinned: std::collections::HashSet<u8> = Default::default();
            for op in ops {
                match op {
                    Op::Put { key: k, len } => {
                        let value = vec![k; len as usize];
                        if let Ok(mut slot) = pool.reserve(key(k), len as u64, checksum(&value)) {
                            // Whatever the key held before (pinned or not)
                            // was replaced.
                            pinned.remove(&k);
                            slot.buf_mut().copy_from_slice(&value);
                            // Chains 0, 2, 4, ... and 1, 3, 5, ... (one
                            // namespace each).
                            slot.set_parent(k.checked_sub(2).map(|p| key(p).hash));
                            slot.commit().unwrap();
                        }
                    }
                    Op::Abandon { key: k, len } => {
                        if pool.reserve(key(k), len as u64, 0).is_ok() {
                            pinned.remove(&k);
                        }
                    }
                    Op::Remove { key: k } => {
                        if pool.remove(&key(k)).is_ok() {
                            pinned.remove(&k);
                        }
                    }
                    Op::Pin { key: k } => {
                        if !pinned.contains(&k) && pool.pin(&key(k)).is_ok() {
                            pinned.insert(k);
                        }
                    }
                    Op::Unpin { key: k } => {
                        if pinned.remove(&k) {
                            pool.unpin(&key(k)).unwrap();
                        }
                    }
                    Op::Lease { key: k } => leases.extend(pool.get(&key(k))),
                    Op::Touch { key: k } => {
                        let ready = pool.contains(&key(k));
                        prop_assert_eq!(pool.touch(&key(k)), ready);
                    }
                    Op::Release { nth } => {
                        if !leases.is_empty() {
                            let i = nth as usize % leases.len();
                            leases.swap_remove(i);
                        }
                    }
                }
                check(&pool);
                for k in &pinned {
                    prop_assert!(pool.contains(&key(*k)), "pinned block {k} was evicted");
                }
                for lease in &leases {
                    // A leased block's bytes stay in place, removed or not.
                    prop_assert!(lease.verify(), "leased bytes changed under a reader");
                }
            }
            drop(leases);
            for k in 0..48 {
                let _ = pool.unpin(&key(k));
                let _ = pool.remove(&key(k));
            }
            check(&pool);
            prop_assert_eq!(pool.stats().used, 0, "bytes leaked after everything was removed");
        }
    }
}
