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

mod demotion;
mod evict;
mod hold;
mod lease;
#[cfg(test)]
mod props;
mod room;
mod shared;
mod tenants;
#[cfg(test)]
mod tests;

pub use demotion::Demoted;
pub use evict::{Eviction, EvictionEvents, PROBATION_SHARE};
use evict::{Ghosts, Lru, Queue};
pub use lease::{ReadLease, WriteSlot};
pub use room::Room;
use shared::SharedIndex;

/// The pool's maps of keys. Keys come from clients, so the hash is
/// seeded per process (foldhash's quality variant, as hashbrown's default
/// hasher is); std's SipHash cost a fifth of the pool's time at 1 KiB
/// blocks (`bench-pool`).
type KeyMap<K, V> = HashMap<K, V, foldhash::quality::RandomState>;

/// Allocation granularity: small enough for 1 KiB blocks, large enough that
/// a u32 of units spans a 1 TiB pool.
const UNIT: u64 = 256;
/// Keys dropped on the pool's own initiative, kept for the meta service
/// until it collects them; past this many, the oldest reports are lost
/// (the meta service then learns of those blocks by a miss).
const MAX_PENDING_REMOVALS: usize = 1 << 20;
/// Bytes of evicted blocks waiting in memory to be written to the next
/// tier that writers wait for (see `Tiers::room_to_demote`), at most; and
/// at most this share of the pool (`DramPool::demotion_bytes`). Those
/// bytes are memory beyond the pool, and blocks readable there: a queue
/// as large as a small pool would make the daemon a larger cache than its
/// `dram` says.
const DEMOTION_BYTES: u64 = 256 << 20;
const DEMOTION_SHARE: u64 = 8;
/// The hard limit: past it an evicted block is dropped unless the next tier
/// has it. The slack over what writers wait for absorbs evictions that
/// did not wait (promotions).
const DEMOTION_BYTES_MAX: u64 = 2 * DEMOTION_BYTES;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub capacity: u64,
    pub max_block: u64,
    /// Eviction starts when a put would fill the pool past this share,
    /// and frees only what the put needs.
    pub high_watermark: f64,
    /// Which blocks go first (see `evict`).
    pub eviction: Eviction,
    /// Under 2Q, the share of the pool blocks not yet read again may hold.
    pub probation_share: f64,
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
            eviction: Eviction::Lru,
            probation_share: PROBATION_SHARE,
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
    #[error("a lease holds the block")]
    Leased,
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
            PoolError::Leased => ErrorCode::Leased,
        }
    }
}

pub struct DramPool {
    region: Region,
    /// Where each ready block lies, for same-host readers (shared pools).
    index: Option<SharedIndex>,
    cfg: PoolConfig,
    inner: Mutex<Inner>,
    /// Lease deadlines count from here (`hold`).
    epoch: std::time::Instant,
    removed: Mutex<Vec<BlockKey>>,
    removed_notify: Notify,
    evictions: AtomicU64,
    corrupt: AtomicU64,
    /// Set by a fault-injection test: same-host sessions refuse rooms'
    /// requests, as a daemon older than rooms does (`room`).
    rooms_refused: std::sync::atomic::AtomicBool,
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
    /// The blocks in that queue, served until written.
    demoting: Mutex<demotion::Demoting>,
    demote_seq: AtomicU64,
}

struct Inner {
    alloc: Allocator,
    blocks: KeyMap<BlockKey, Block>,
    /// Units held by each tenant of `PoolConfig::quotas`, in its order.
    tenant_used: Vec<u64>,
    /// Evictable blocks (ready, unpinned, unleased) by last access.
    lru: Lru,
    /// Stored (ready) blocks per parent key: a parent with any is not a
    /// chain tail. The parent itself need not be stored.
    children: KeyMap<BlockKey, u32>,
    /// Units held by blocks in 2Q's probation queue, and the most it
    /// holds before its own blocks go first (see `evict`).
    probation_units: u64,
    probation_target: u64,
    /// Keys evicted recently (2Q).
    ghosts: Ghosts,
    events: EvictionEvents,
    /// Removed blocks whose bytes are still leased by readers, by offset.
    doomed: HashMap<u32, Doomed>,
    clock: u64,
    used_units: u64,
    /// Units reserved by puts not committed yet (part of `used_units`).
    pending_units: u64,
    /// Units of rooms held for blocks not yet named (part of
    /// `pending_units`; see `room`).
    room_units: u64,
    /// The same per tenant (part of `tenant_used`).
    tenant_pending: Vec<u64>,
    pinned: u64,
    /// Blocks held by a lease for a time, and when each lease ends.
    holds: hold::Holds,
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
    /// Held from eviction until then, in ms since the pool's epoch (0:
    /// not held; see `hold`).
    held_until: u64,
    /// The end of the last lease a lookup took on it, in the same ms, held
    /// or not (past the leases' share of the pool a lease does not hold):
    /// until then a removal that is not forced leaves it.
    leased_until: u64,
    stamp: u64,
    /// The block whose prefix this one extends (same namespace), if the
    /// writer said.
    parent: Option<mooncake_proto::BlockHash>,
    /// 2Q's queue for it (main under LRU).
    queue: Queue,
    /// Read since it was stored.
    read: bool,
    /// Admitted to main as a branch whose branch point's branches come
    /// back, or as the rest of such a branch (2Q).
    continues: bool,
    /// As a branch point (a prefix a reader matched): branches put after
    /// it, and how many of those were read again.
    branches: u32,
    branch_hits: u32,
    /// Its ghost fingerprint once admitted under 2Q (0: not taken).
    fingerprint: u64,
}

impl Block {
    /// A block being written: invisible until committed.
    fn reserved(alloc: Allocation, tenant: Option<u16>, len: u64, checksum: Option<u64>) -> Block {
        Block {
            alloc,
            tenant,
            len: len as u32,
            // Set at commit where the writer says it only then.
            checksum: checksum.unwrap_or(0),
            ready: false,
            leases: 0,
            pins: 0,
            held_until: 0,
            leased_until: 0,
            stamp: 0,
            parent: None,
            queue: Queue::Main,
            read: false,
            continues: false,
            branches: 0,
            branch_hits: 0,
            fingerprint: 0,
        }
    }

    fn evictable(&self) -> bool {
        self.ready && self.leases == 0 && self.pins == 0 && self.held_until == 0
    }
}

/// A stored (committed) block, to change what may evict it.
fn stored_mut<'a>(
    blocks: &'a mut KeyMap<BlockKey, Block>,
    key: &BlockKey,
) -> Result<&'a mut Block, PoolError> {
    blocks
        .get_mut(key)
        .filter(|b| b.ready)
        .ok_or(PoolError::NotFound)
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
        let probation_target = (region.len() as u64 / UNIT) as f64 * cfg.probation_share;
        let probation_target = probation_target as u64;
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
                blocks: KeyMap::default(),
                tenant_used: vec![0; tenants],
                lru: Lru::new(tenants),
                children: KeyMap::default(),
                probation_units: 0,
                probation_target,
                ghosts: Ghosts::default(),
                events: EvictionEvents::default(),
                doomed: HashMap::new(),
                clock: 0,
                used_units: 0,
                pending_units: 0,
                room_units: 0,
                tenant_pending: vec![0; tenants],
                pinned: 0,
                holds: Default::default(),
            }),
            epoch: std::time::Instant::now(),
            removed: Mutex::new(Vec::new()),
            removed_notify: Notify::new(),
            evictions: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            rooms_refused: std::sync::atomic::AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            demote: std::sync::OnceLock::new(),
            demotions: AtomicU64::new(0),
            quota_evictions: AtomicU64::new(0),
            overflow: Mutex::new(Vec::new()),
            demote_queued: AtomicU64::new(0),
            demoting: Mutex::new(Default::default()),
            demote_seq: AtomicU64::new(0),
        })
    }

    /// Where the pool's memory starts and its length in bytes (what an RDMA
    /// NIC registers); block offsets count from its start.
    pub fn memory(&self) -> (std::ptr::NonNull<u8>, usize) {
        (self.region.ptr(), self.region.len())
    }

    /// What pages back the pool, in words (see `Region::pages`).
    pub fn pages(&self) -> String {
        self.region.pages()
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
        self.reserve_for(key, len, Some(checksum))
    }

    /// `reserve`, for a writer that says its checksum only once it has
    /// hashed its bytes in the slot (`None`; `WriteSlot::commit_hashed`).
    /// Bytes already held under the key cannot be told the same then, so
    /// they are replaced.
    pub fn reserve_for(
        self: &Arc<Self>,
        key: BlockKey,
        len: u64,
        checksum: Option<u64>,
    ) -> Result<WriteSlot, PoolError> {
        if len > self.cfg.max_block {
            return Err(PoolError::TooLarge(len));
        }
        let units = len.div_ceil(UNIT).max(1) as u32;
        let mut inner = self.inner.lock();
        // Room held by puts whose bytes have not all arrived is capped, so
        // that headers without values cannot push out the stored blocks:
        // past the cap a put waits its turn (`Busy`) instead of evicting.
        // The first put in progress always gets room. Rooms held ahead for
        // same-host writers (`room`) have a cap of their own.
        let pending_cap = self.pending_cap();
        let in_progress = inner.pending_units - inner.room_units;
        if in_progress > 0 && in_progress + u64::from(units) > pending_cap {
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
        self.replace_held(&mut inner, &key, len, checksum)?;
        self.below_high_watermark(&mut inner, units);
        if let Some(t) = tenant {
            self.tenant_room(&mut inner, t, units.into())?;
        }
        let alloc = self.allocate(&mut inner, units)?;
        let size = inner.alloc.allocation_size(alloc) as u64;
        if let Some(t) = tenant {
            inner.tenant_used[t as usize] += size;
            inner.tenant_pending[t as usize] += size;
        }
        inner
            .blocks
            .insert(key.clone(), Block::reserved(alloc, tenant, len, checksum));
        Ok(WriteSlot::new(self, key, alloc, len, checksum))
    }

    /// Units that puts in progress may hold (`PENDING_SHARE`).
    fn pending_cap(&self) -> u64 {
        ((self.region.len() as u64 / UNIT) as f64 * PENDING_SHARE) as u64
    }

    /// Makes way for a put of `key`: `AlreadyExists` if exactly these
    /// bytes are held (`len`, `checksum`), `Busy` while another put writes
    /// the key; other bytes held under it are stale and dropped. Not
    /// reported as removed: the meta service already has this put as the
    /// key's version here, and must keep it.
    fn replace_held(
        &self,
        inner: &mut Inner,
        key: &BlockKey,
        len: u64,
        checksum: Option<u64>,
    ) -> Result<(), PoolError> {
        if let Some(held) = inner.blocks.get(key) {
            if !held.ready {
                return Err(PoolError::Busy);
            }
            if u64::from(held.len) == len && Some(held.checksum) == checksum {
                return Err(PoolError::AlreadyExists);
            }
            let stale = inner.blocks.remove(key).expect("just found");
            self.discard(inner, key, stale);
            tracing::info!(%key, "put replaces other bytes held under its key");
        }
        Ok(())
    }

    /// Evicts until `units` more fit under the high watermark, or nothing
    /// more can go. Only what this block needs: a burst down to a lower
    /// mark would leave memory empty that could hold blocks still to be
    /// hit (and, with a next tier, overflow the demotion queue).
    fn below_high_watermark(&self, inner: &mut Inner, units: u32) {
        let capacity_units = self.region.len() as u64 / UNIT;
        let high = (capacity_units as f64 * self.cfg.high_watermark) as u64;
        while inner.used_units + units as u64 > high {
            if !self.evict_one(inner) {
                break;
            }
        }
    }

    /// Space for `units`, evicting what fragmentation takes; counted as
    /// used and as a put in progress (its tenant's share is the caller's).
    fn allocate(&self, inner: &mut Inner, units: u32) -> Result<Allocation, PoolError> {
        let alloc = loop {
            if let Some(a) = inner.alloc.allocate(units) {
                break a;
            }
            // Fragmentation or watermark slack: make more room, one block
            // at a time, until it fits or nothing more can go.
            if !self.evict_one(inner) {
                return Err(PoolError::NoSpace);
            }
        };
        let size = inner.alloc.allocation_size(alloc) as u64;
        inner.used_units += size;
        inner.pending_units += size;
        Ok(alloc)
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
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        inner.clock += 1;
        let clock = inner.clock;
        let Some(block) = inner.blocks.get_mut(key).filter(|b| b.ready) else {
            self.note_miss(inner, key);
            return None;
        };
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
        let credit = self.mark_read(
            block,
            &mut inner.probation_units,
            &mut inner.events,
            &inner.alloc,
        );
        if was_evictable {
            inner.lru.remove(old_stamp);
        }
        if let Some(parent) = credit {
            Self::credit_branch(inner, key, parent);
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
                    let (stamp, tenant, queue) = (block.stamp, block.tenant, block.queue);
                    Self::lru_insert(inner, stamp, key, tenant, queue);
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
        self.remove_unless(key, |_| false)
    }

    /// `remove`, refused (`Leased`) where `held` says so of the block.
    fn remove_unless(
        &self,
        key: &BlockKey,
        held: impl Fn(&Block) -> bool,
    ) -> Result<(), PoolError> {
        let mut inner = self.inner.lock();
        match inner.blocks.get(key) {
            Some(b) if b.ready && held(b) => return Err(PoolError::Leased),
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
        Self::leave_queue(inner, &block);
        if block.evictable() {
            inner.lru.remove(block.stamp);
        }
        if let Some(parent) = block.parent {
            Self::remove_child(inner, key, parent);
        }
        if block.pins > 0 {
            inner.pinned -= 1;
        }
        if block.held_until != 0 {
            let units = inner.alloc.allocation_size(block.alloc) as u64;
            inner.holds.ended(units);
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

    /// Every stored block, as the meta service needs it to rebuild its
    /// index: key, size, checksum and the parent it names.
    pub fn inventory(&self) -> Vec<(BlockKey, u32, u64, Option<mooncake_proto::BlockHash>)> {
        let inner = self.inner.lock();
        inner
            .blocks
            .iter()
            .filter(|(_, b)| b.ready)
            .map(|(k, b)| (k.clone(), b.len, b.checksum, b.parent))
            .collect()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.inner.lock().blocks.get(key).is_some_and(|b| b.ready)
    }

    /// Whether `key` is stored or being written.
    pub fn names(&self, key: &BlockKey) -> bool {
        self.inner.lock().blocks.contains_key(key)
    }

    /// A reader looked for `key` and did not find it (a lookup at the meta
    /// service, or a prefix match that stopped there): as a get that
    /// misses it, this grows probation if probation evicted it recently.
    pub fn missed(&self, key: &BlockKey) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if !inner.blocks.get(key).is_some_and(|b| b.ready) {
            self.note_miss(inner, key);
        }
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
        let credit = self.mark_read(
            block,
            &mut inner.probation_units,
            &mut inner.events,
            &inner.alloc,
        );
        let queue = block.queue;
        if evictable {
            inner.lru.remove(old);
            Self::lru_insert(inner, clock, key, tenant, queue);
        }
        if let Some(parent) = credit {
            Self::credit_branch(inner, key, parent);
        }
        true
    }

    /// Counts a client's get as a hit or a miss (for stats and metrics).
    pub fn note_get(&self, hit: bool) {
        let counter = if hit { &self.hits } else { &self.misses };
        counter.fetch_add(1, Ordering::Relaxed);
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
