//! The daemon's tiers together: DRAM first, then NVMe, on one or more
//! drives. Evicted DRAM blocks are demoted to NVMe (their bytes copied out
//! before the space is freed, written by a background task, `demote`, that
//! keeps a few writes in flight per drive, and serving the block from the
//! queue until it is written); NVMe hits are served from the drive that
//! holds the block and promoted back to DRAM after a configurable number of
//! hits. A block may be in DRAM and on one drive; it leaves the daemon (and
//! the meta service is told) only when no tier holds it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mooncake_proto::message::{EngineTag, KeepTags, Tier};
use mooncake_proto::BlockKey;
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::nvme::NvmeTier;
use crate::pool::{DramPool, PoolError, Room, WriteSlot};

mod admitting;
mod demote;
mod prefetch;

/// Blocks waiting to be written to NVMe. The pool's byte budget is the real
/// bound; this only caps the count of small blocks.
const DEMOTION_QUEUE: usize = 4096;
/// Demotion writes in flight per drive.
const WRITES_PER_DRIVE: usize = 2;
/// Hit counts kept for promotion; past this many blocks the counts restart.
const MAX_TRACKED_HITS: usize = 1 << 20;

pub struct Tiers {
    pub dram: Arc<DramPool>,
    pub nvme: Vec<Arc<NvmeTier>>,
    promote_after: u32,
    /// Writers that make DRAM evict pass one at a time, each once the
    /// demotion queue has room for what it will evict.
    evict_gate: tokio::sync::Mutex<()>,
    hits: Mutex<HashMap<BlockKey, u32>>,
    nvme_hits: AtomicU64,
    nvme_misses: AtomicU64,
    promotions: AtomicU64,
    /// Blocks a lease found on a drive, to bring back to DRAM (`None`:
    /// no drives, or a daemon that never promotes).
    prefetch: Option<prefetch::Queue>,
    prefetched: AtomicU64,
    prefetch_skipped: AtomicU64,
    /// Reads per block, for the meta service's hot blocks.
    pub hot: crate::hot::HotReads,
    /// Blocks whose fastest tier may have changed since the last report.
    moved: Mutex<Vec<BlockKey>>,
    /// Shared by a promotion while it checks that a lower tier still holds
    /// the bytes it read and puts them in DRAM; exclusive for dropping a
    /// lower tier's copy (a removal, a put of other bytes). So a block
    /// removed while it was being read from a drive does not come back.
    below: RwLock<()>,
    /// What the engine calls each block its writer tagged, while any tier
    /// holds it, for the inventory a new meta leader rebuilds its events
    /// from. A block demoted to a drive keeps its tag there, and a
    /// restarted daemon reads it back.
    tags: Mutex<HashMap<BlockKey, Arc<EngineTag>>>,
    /// Whether any block was ever tagged: untagged puts then skip the
    /// lock above.
    tagged: std::sync::atomic::AtomicBool,
    /// What of the tags is kept (`KeepTags` as a number): what the meta
    /// service's events use (its answer to each registration says), so
    /// that a cluster without events spends no memory on them.
    keep_tags: std::sync::atomic::AtomicU8,
    /// Blocks being admitted (`admitting`), and whether a removal came for
    /// each meanwhile.
    admitting: Mutex<HashMap<BlockKey, bool>>,
}

/// A block of the inventory a daemon sends the meta service.
pub use mooncake_proto::message::InventoryItem as InventoryBlock;

/// The NVMe drives summed, for metrics and stats.
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmeTotals {
    pub drives: usize,
    pub capacity: u64,
    pub used: u64,
    pub blocks: usize,
    pub evictions: u64,
    pub corrupt: u64,
    pub io_errors: u64,
    /// Drives taking no new blocks: their index's filesystem is full.
    pub full: usize,
    /// What the drives' 2Q did (all zero under LRU).
    pub events: crate::nvme::DriveEvents,
    /// Bytes in the drives' probation, and the most it holds.
    pub probation: (u64, u64),
    /// Leases keeping blocks from the drives' eviction, and leases found
    /// past their share of a drive (not held).
    pub holds: (u64, u64),
}

impl Tiers {
    pub fn dram_only(dram: Arc<DramPool>) -> Arc<Self> {
        Arc::new(Self::new(dram, Vec::new(), 0))
    }

    fn new(dram: Arc<DramPool>, nvme: Vec<Arc<NvmeTier>>, promote_after: u32) -> Self {
        Tiers {
            dram,
            nvme,
            promote_after,
            evict_gate: tokio::sync::Mutex::new(()),
            hits: Mutex::new(HashMap::new()),
            nvme_hits: AtomicU64::new(0),
            nvme_misses: AtomicU64::new(0),
            promotions: AtomicU64::new(0),
            prefetch: None,
            prefetched: AtomicU64::new(0),
            prefetch_skipped: AtomicU64::new(0),
            hot: Default::default(),
            moved: Mutex::new(Vec::new()),
            below: RwLock::new(()),
            tags: Mutex::new(HashMap::new()),
            tagged: std::sync::atomic::AtomicBool::new(false),
            keep_tags: std::sync::atomic::AtomicU8::new(KeepTags::WithKeys as u8),
            admitting: Mutex::new(HashMap::new()),
        }
    }

    /// DRAM over NVMe drives, with demotion on eviction; a block read from
    /// NVMe `promote_after` times, or found there by a lease, goes back to
    /// DRAM (0: never). The demoter and the lease's reads run in tasks of
    /// `tasks` until `shutdown`, the demoter writing what it was given
    /// before it ends.
    pub fn with_nvme(
        dram: Arc<DramPool>,
        drives: Vec<Arc<NvmeTier>>,
        promote_after: u32,
        (tasks, shutdown): (&TaskTracker, CancellationToken),
    ) -> Arc<Self> {
        assert!(!drives.is_empty(), "an NVMe tier has at least one drive");
        let (tx, rx) = mpsc::channel(DEMOTION_QUEUE);
        dram.demote_to(tx);
        let mut tiers = Self::new(dram, drives, promote_after);
        if promote_after > 0 {
            tiers.prefetch = Some(prefetch::Queue::default());
        }
        let found: HashMap<_, _> = tiers.nvme.iter().flat_map(|d| d.take_tags()).collect();
        if !found.is_empty() {
            tiers.tagged.store(true, Ordering::Relaxed);
            *tiers.tags.lock() = found;
        }
        let tiers = Arc::new(tiers);
        tasks.spawn(demote::demoter(tiers.clone(), rx, shutdown.clone()));
        tasks.spawn(prefetch::run(tiers.clone(), shutdown));
        tiers
    }

    /// Flushes every NVMe drive's index (the daemon is stopping).
    pub fn close(&self) {
        for drive in &self.nvme {
            if let Err(err) = drive.flush() {
                tracing::warn!(%err, "NVMe index flush failed on stop; its log replays on the next open");
            }
        }
    }

    /// Backpressure for writers: a put of `size` bytes that makes DRAM
    /// evict waits (at most `limit`) until the demotion queue has room for
    /// what it evicts, so that evicted blocks go to NVMe at the drives'
    /// speed instead of being dropped. Hold the guard until the space is
    /// reserved. `None`: no eviction, or the wait ran out (the put goes
    /// on, and a block evicted without room is dropped).
    pub async fn room_to_demote(
        &self,
        size: u64,
        limit: Duration,
    ) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        // A put that fits without evicting needs no room in the queue; but
        // one that cannot be placed (the allocator's fragmentation and
        // size classes, which `would_evict` does not see) evicts all the
        // same, so a full queue makes every put wait.
        if self.nvme.is_empty()
            || (!self.dram.would_evict(size) && self.dram.has_demotion_room(size))
        {
            return None;
        }
        let deadline = tokio::time::Instant::now() + limit;
        let gate = tokio::time::timeout_at(deadline, self.evict_gate.lock())
            .await
            .ok()?;
        while !self.dram.has_demotion_room(size) {
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Some(gate)
    }

    /// A block DRAM missed, from NVMe or on its way there (evicted and not
    /// written yet): its bytes and checksum.
    pub async fn get_nvme(&self, key: &BlockKey) -> Option<(Vec<u8>, u64)> {
        if let Some((bytes, sum)) = self.dram.get_demoting(key) {
            self.nvme_hits.fetch_add(1, Ordering::Relaxed);
            return Some((bytes.to_vec(), sum));
        }
        let drive = self.nvme.iter().find(|d| d.contains(key))?;
        let Some((bytes, sum)) = read_drive(drive, key).await else {
            self.nvme_misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        self.nvme_hits.fetch_add(1, Ordering::Relaxed);
        if self.promote_after > 0
            && self.count_hit(key) >= self.promote_after
            && self.dram.has_demotion_room(bytes.len() as u64)
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

    /// Copies a block read from below back into DRAM (it stays on NVMe
    /// too); whether it went.
    fn promote(&self, key: &BlockKey, bytes: &[u8], sum: u64) -> bool {
        self.hits.lock().remove(key);
        // Removed, or replaced by a put of other bytes, since it was read:
        // those bytes are not the block's any more. Checked and put in
        // DRAM under `below`, so that neither happens in between.
        let below = self.below.read();
        if !self.holds_below(key, sum) {
            return false;
        }
        let Ok(mut slot) = self.dram.reserve(key.clone(), bytes.len() as u64, sum) else {
            return false;
        };
        slot.buf_mut().copy_from_slice(bytes);
        slot.set_parent(self.nvme.iter().find_map(|d| d.parent_of(key)));
        if slot.commit().is_err() {
            return false;
        }
        drop(below);
        self.promotions.fetch_add(1, Ordering::Relaxed);
        self.note_moved(key.clone());
        true
    }

    /// Room in DRAM for a put of `key` (its writer's length and checksum),
    /// waiting up to `backpressure` for the demotion queue as
    /// `room_to_demote` says. The put is the key's current version: a copy
    /// of other bytes under the key on a drive is stale and goes (DRAM's
    /// own is replaced by `DramPool::reserve`); `AlreadyExists` means a
    /// tier holds exactly these bytes. A writer that says its checksum
    /// only at commit (`None`) commits with `commit_put`, which then does
    /// the drive's part.
    pub async fn reserve_put(
        &self,
        key: BlockKey,
        len: u64,
        checksum: Option<u64>,
        backpressure: Duration,
    ) -> Result<WriteSlot, PoolError> {
        if let Some(checksum) = checksum {
            if self.drop_stale_on_nvme(&key, len, checksum)? && !self.dram.contains(&key) {
                return Err(PoolError::AlreadyExists);
            }
        }
        let _gate = self.room_to_demote(len, backpressure).await;
        self.dram.reserve_for(key, len, checksum)
    }

    /// Room for a same-host writer's next block of up to `len` bytes
    /// (`DramPool::reserve_room`), where taking it waits for nothing: with
    /// a next tier, not while the demotion queue lacks room for what it
    /// may evict (a put would wait there, `room_to_demote`).
    pub fn reserve_room(&self, len: u64) -> Option<Room> {
        if !self.nvme.is_empty() && !self.dram.has_demotion_room(len) {
            return None;
        }
        self.dram.reserve_room(len).ok()
    }

    /// Names the block written into `room` (`DramPool::fill_room`), first
    /// dropping a copy of other bytes under its key on a drive, as
    /// `reserve_put` does; `AlreadyExists` where a drive holds these.
    pub fn fill_room(
        &self,
        room: Room,
        key: BlockKey,
        len: u64,
        checksum: u64,
    ) -> Result<WriteSlot, (PoolError, Room)> {
        match self.drop_stale_on_nvme(&key, len, checksum) {
            Err(err) => Err((err, room)),
            Ok(true) if !self.dram.contains(&key) => Err((PoolError::AlreadyExists, room)),
            Ok(_) => self.dram.fill_room(room, key, len, Some(checksum)),
        }
    }

    /// Makes a put visible whose writer hashed its bytes where they lie in
    /// `slot` (`sum`; `WriteSlot::commit_hashed`), first dropping a copy of
    /// other bytes under its key on a drive, as `reserve_put` does for a
    /// writer that said its checksum before writing.
    pub fn commit_put(&self, slot: WriteSlot, sum: u64) -> Result<(), PoolError> {
        self.drop_stale_on_nvme(slot.key(), slot.len() as u64, sum)?;
        slot.commit_hashed(sum)
    }

    /// Drops what the drives hold under `key` unless it is these bytes
    /// (`len`, `checksum`); whether a drive holds exactly them.
    fn drop_stale_on_nvme(
        &self,
        key: &BlockKey,
        len: u64,
        checksum: u64,
    ) -> Result<bool, PoolError> {
        let mut same = false;
        // Taken only where a copy goes (rare), not for every put.
        let mut below = None;
        for drive in &self.nvme {
            match drive.record_of(key) {
                Some((l, sum)) if u64::from(l) == len && sum == checksum => same = true,
                Some(_) => {
                    below.get_or_insert_with(|| self.below.write());
                    tracing::info!(%key, "put replaces other bytes held under its key on NVMe");
                    if let Err(err) = drive.remove(key) {
                        tracing::warn!(%key, %err, "NVMe removal of a replaced block failed");
                        return Err(PoolError::Busy);
                    }
                }
                None => {}
            }
        }
        Ok(same)
    }

    /// Remembers that `key` went from one tier to another, for the meta
    /// service (`take_moved`).
    fn note_moved(&self, key: BlockKey) {
        let mut moved = self.moved.lock();
        if moved.len() >= MAX_TRACKED_HITS {
            // A tier the index then shows stale costs a label, not a block.
            moved.remove(0);
        }
        moved.push(key);
    }

    /// The blocks whose fastest tier changed since the last call, with
    /// that tier as it is now (a block that left every tier is reported
    /// removed instead).
    pub fn take_moved(&self) -> Vec<(BlockKey, Tier)> {
        let keys = std::mem::take(&mut *self.moved.lock());
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        keys.into_iter()
            .filter(|k| seen.insert(k.clone()))
            .filter_map(|k| {
                let tier = self.tier_of(&k)?;
                Some((k, tier))
            })
            .collect()
    }

    /// The fastest tier that holds `key`.
    pub fn tier_of(&self, key: &BlockKey) -> Option<Tier> {
        if self.dram.contains(key) {
            Some(Tier::Dram)
        } else if self.on_nvme(key) {
            Some(Tier::Nvme)
        } else {
            None
        }
    }

    fn on_nvme(&self, key: &BlockKey) -> bool {
        self.nvme.iter().any(|d| d.contains(key))
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.dram.contains(key) || self.on_nvme(key)
    }

    /// Of the blocks reported gone since the last report (`reported`),
    /// those the meta service is to drop: not one this daemon holds again,
    /// or is storing again (put, admitted, on its way to a drive), since
    /// its report was written. The meta service drops whatever copy of
    /// the key it lists here, so a report of a copy replaced since would
    /// take the new copy out of its index while this daemon keeps serving
    /// it, and a removal would then find nothing to remove.
    pub fn still_gone(&self, mut reported: Vec<BlockKey>) -> Vec<BlockKey> {
        reported.retain(|key| {
            !(self.dram.names(key)
                || self.dram.is_demoting(key)
                || self.on_nvme(key)
                || self.is_admitting(key))
        });
        reported
    }

    /// Records what the engine calls a block just stored (`None`: its
    /// writer attached nothing, and a tag of bytes it replaced goes).
    pub fn set_tag(&self, key: &BlockKey, tag: Option<Arc<EngineTag>>) {
        let keep = self.keep_tags.load(Ordering::Relaxed);
        let tag = match tag {
            Some(_) if keep == KeepTags::No as u8 => return,
            Some(tag) if keep == KeepTags::WithoutKeys as u8 => EngineTag::without_key(tag),
            tag => tag,
        };
        match tag {
            Some(tag) => {
                self.tagged.store(true, Ordering::Relaxed);
                self.tags.lock().insert(key.clone(), tag);
            }
            None if !self.tagged.load(Ordering::Relaxed) => {}
            None => {
                self.tags.lock().remove(key);
            }
        }
    }

    /// The tag kept for `key`, if any.
    fn tag_of(&self, key: &BlockKey) -> Option<Arc<EngineTag>> {
        if !self.tagged.load(Ordering::Relaxed) {
            return None;
        }
        self.tags.lock().get(key).cloned()
    }

    /// Forgets the tags of blocks reported gone, unless a tier holds the
    /// key again (put anew since).
    pub fn forget_tags(&self, gone: &[BlockKey]) {
        if !self.tagged.load(Ordering::Relaxed) {
            return;
        }
        for key in gone {
            if !self.contains(key) {
                self.tags.lock().remove(key);
            }
        }
    }

    /// Keeps as much of the tags from now on as `keep` says, dropping
    /// what is kept beyond it.
    pub fn keep_tags(&self, keep: KeepTags) {
        let was = self.keep_tags.swap(keep as u8, Ordering::Relaxed);
        if keep as u8 >= was || !self.tagged.load(Ordering::Relaxed) {
            return;
        }
        let mut tags = self.tags.lock();
        match keep {
            KeepTags::No => tags.clear(),
            _ => tags.retain(|_, tag| match EngineTag::without_key(tag.clone()) {
                Some(bare) => {
                    *tag = bare;
                    true
                }
                None => false,
            }),
        }
    }

    /// Tags kept, for tests of their bound.
    pub fn tags_kept(&self) -> usize {
        self.tags.lock().len()
    }

    /// Leases a stored block until `until`: kept in DRAM until then. A
    /// block already on its way to the NVMe drives, or only there, is
    /// held there (no eviction of the drive takes it while leases hold
    /// less than half of it, and no removal that is not forced), and
    /// brought back to DRAM and held there in the background
    /// (`prefetch`); `NotFound` where no tier has it, `Busy` where leases
    /// hold their share of the DRAM pool or of its drive.
    pub fn hold(&self, key: &BlockKey, until: std::time::Instant) -> Result<(), PoolError> {
        match self.dram.hold(key, until) {
            Err(PoolError::NotFound) => {
                // On its way first: a demotion written meanwhile hands its
                // lease to its drive before it stops being on its way.
                let demoting = self.dram.hold_demoting(key, until);
                let on_drive = self.nvme.iter().find_map(|d| d.hold(key, until));
                if !demoting && on_drive.is_none() {
                    return Err(PoolError::NotFound);
                }
                self.prefetch(key, until);
                match (demoting, on_drive) {
                    // Found, but leases hold their share of the drive.
                    (false, Some(false)) => Err(PoolError::Busy),
                    _ => Ok(()),
                }
            }
            held => held,
        }
    }

    /// Removes a block from every tier, with a demotion or a drive write
    /// of it in flight; `false` if none held it.
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.remove_from_all(key, false).unwrap_or(false)
    }

    /// `remove`, but `Leased` (and nothing removed) while a lease holds
    /// the block, in whichever tier it found it.
    pub fn remove_unleased(&self, key: &BlockKey) -> Result<bool, PoolError> {
        self.remove_from_all(key, true)
    }

    /// Whether a lease holds `key` in any tier (as `remove_unleased`
    /// would find); `None` where no tier holds it.
    pub fn lease_of(&self, key: &BlockKey) -> Option<bool> {
        let below = self.leased_below(key);
        match self.dram.leased(key) {
            Some(leased) => Some(leased || below),
            None if below => Some(true),
            None => (self.contains(key) || self.dram.is_demoting(key)).then_some(false),
        }
    }

    /// Whether a lease holds `key` on its way to a drive, or on one.
    fn leased_below(&self, key: &BlockKey) -> bool {
        self.dram.demoting_leased(key) || self.nvme.iter().any(|d| d.leased(key))
    }

    fn remove_from_all(&self, key: &BlockKey, unleased: bool) -> Result<bool, PoolError> {
        let below = self.below.write();
        self.removed_while_admitted(key);
        if unleased && self.leased_below(key) {
            return Err(PoolError::Leased);
        }
        let in_dram = match unleased {
            true => self.dram.remove_unheld(key),
            false => self.dram.remove(key),
        };
        let in_dram = match in_dram {
            Err(PoolError::Leased) => return Err(PoolError::Leased),
            removed => removed.is_ok(),
        };
        let demoting = self.dram.cancel_demotion(key);
        let mut on_nvme = false;
        for drive in &self.nvme {
            on_nvme |= drive.remove(key).unwrap_or_else(|err| {
                tracing::warn!(%key, %err, "NVMe removal failed");
                false
            });
        }
        drop(below);
        self.forget_tags(std::slice::from_ref(key));
        Ok(in_dram || demoting || on_nvme)
    }

    /// Whether a lower tier (a drive, the demotion queue) holds `key` with
    /// checksum `sum`.
    fn holds_below(&self, key: &BlockKey, sum: u64) -> bool {
        self.dram.demoting_checksum(key) == Some(sum)
            || self
                .nvme
                .iter()
                .any(|d| d.record_of(key).is_some_and(|(_, s)| s == sum))
    }

    /// Drops `drive`'s copy of `key` if it has checksum `sum`: a demotion
    /// written after its block was removed or evicted again.
    fn drop_written(&self, drive: &NvmeTier, key: &BlockKey, sum: u64) {
        let _below = self.below.write();
        if drive.record_of(key).is_some_and(|(_, s)| s == sum) {
            if let Err(err) = drive.remove(key) {
                tracing::warn!(%key, %err, "NVMe removal of a block removed on its way failed");
            }
        }
    }

    /// Every block the daemon holds, with the fastest tier that holds it,
    /// a chain's blocks parent first (`parents_first`).
    pub fn inventory(&self) -> Vec<InventoryBlock> {
        let tags = self.tags.lock().clone();
        let block = |(key, size, checksum, parent), tier| InventoryBlock {
            tag: tags.get(&key).cloned(),
            key,
            size,
            checksum,
            tier,
            parent,
        };
        let mut all: Vec<InventoryBlock> = self
            .dram
            .inventory()
            .into_iter()
            .map(|b| block(b, Tier::Dram))
            .collect();
        if !self.nvme.is_empty() {
            let mut seen: std::collections::HashSet<BlockKey> =
                all.iter().map(|b| b.key.clone()).collect();
            for drive in &self.nvme {
                for b in drive.inventory() {
                    if seen.insert(b.0.clone()) {
                        all.push(block(b, Tier::Nvme));
                    }
                }
            }
        }
        parents_first(all)
    }

    /// The drives summed; `None` without an NVMe tier.
    pub fn nvme_totals(&self) -> Option<NvmeTotals> {
        if self.nvme.is_empty() {
            return None;
        }
        Some(self.nvme.iter().fold(
            NvmeTotals {
                drives: self.nvme.len(),
                ..Default::default()
            },
            |t, d| {
                let (events, (held, limit)) = d.order_stats();
                NvmeTotals {
                    capacity: t.capacity + d.capacity(),
                    used: t.used + d.used(),
                    blocks: t.blocks + d.blocks(),
                    evictions: t.evictions + d.evictions(),
                    corrupt: t.corrupt + d.corrupt_blocks(),
                    io_errors: t.io_errors + d.io_errors(),
                    full: t.full + d.is_full() as usize,
                    events: crate::nvme::DriveEvents {
                        probation_admitted: t.events.probation_admitted + events.probation_admitted,
                        promoted: t.events.promoted + events.promoted,
                        ghost_hits: t.events.ghost_hits + events.ghost_hits,
                    },
                    probation: (t.probation.0 + held, t.probation.1 + limit),
                    holds: {
                        let (held, refused) = d.holds();
                        (t.holds.0 + held, t.holds.1 + refused)
                    },
                    ..t
                }
            },
        ))
    }

    /// Each tenant with an NVMe quota, summed over the drives: (tenant,
    /// bytes used, bytes allowed).
    pub fn nvme_tenant_usage(&self) -> Vec<(Arc<str>, u64, u64)> {
        let mut total: Vec<(Arc<str>, u64, u64)> = Vec::new();
        for drive in &self.nvme {
            for (i, (tenant, used, limit)) in drive.tenant_usage().into_iter().enumerate() {
                match total.get_mut(i) {
                    Some(t) => {
                        t.1 += used;
                        t.2 += limit;
                    }
                    None => total.push((tenant, used, limit)),
                }
            }
        }
        total
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

/// A block's bytes and checksum from `drive`; `None` where it does not
/// have them or could not read them (logged).
async fn read_drive(drive: &NvmeTier, key: &BlockKey) -> Option<(Vec<u8>, u64)> {
    match drive.get(key).await {
        Ok(found) => found,
        Err(err) => {
            tracing::warn!(%key, %err, "NVMe read failed; a miss");
            None
        }
    }
}

/// Orders blocks so that each comes after its parent where the daemon holds
/// the parent too: the meta service publishes a rebuilt index's blocks to
/// event subscribers in this order, and a router that links a block to its
/// parent must have seen the parent first.
fn parents_first(blocks: Vec<InventoryBlock>) -> Vec<InventoryBlock> {
    let at: std::collections::HashMap<&BlockKey, usize> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| (&b.key, i))
        .collect();
    let parent_at = |i: usize| {
        let b: &InventoryBlock = &blocks[i];
        let parent = BlockKey::new(b.key.namespace.clone(), b.parent?);
        at.get(&parent).copied()
    };
    let mut placed = vec![false; blocks.len()];
    let mut order = Vec::with_capacity(blocks.len());
    let mut line = Vec::new();
    for start in 0..blocks.len() {
        // Up the chain to the first ancestor placed already (or not held).
        let mut i = start;
        while !placed[i] {
            placed[i] = true;
            line.push(i);
            match parent_at(i) {
                Some(p) => i = p,
                None => break,
            }
        }
        order.extend(line.drain(..).rev());
    }
    let mut slots: Vec<Option<InventoryBlock>> = blocks.into_iter().map(Some).collect();
    order
        .into_iter()
        .map(|i| slots[i].take().expect("each block placed once"))
        .collect()
}

#[cfg(test)]
mod tests;
