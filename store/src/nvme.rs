//! The NVMe tier: blocks in extents of a file or device, written and read
//! with direct I/O through an [`IoEngine`], indexed by RocksDB so that a
//! restarted daemon finds every block it had.
//!
//! Crash consistency: a block's index entry is written only after its data
//! write completed, and removed before its extent is reused. A crash at any
//! point leaves either no entry (the extent is free space again on restart)
//! or an entry for completely written bytes; checksums catch the rest
//! (a read that fails its checksum is a miss, and the block is dropped).
//!
//! A block its writer tagged (the engine's own name for it, see
//! `EngineTag`) keeps its tag in a second index entry, written in one batch
//! with the block's, so that a restarted daemon's inventory names the
//! block as before.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use mooncake_proto::message::EngineTag;
use mooncake_proto::{checksum, BlockHash, BlockKey, Namespace};
use parking_lot::Mutex;

use crate::headroom::Headroom;
use crate::io::{AlignedBuf, IoEngine, IoKind, IoRequest, ALIGN};
use crate::pool::Eviction;
use crate::quota::{Quotas, MAX_QUOTA_SCAN};

pub use order::{DriveEvents, DriveOrder, Place};

/// Why a block could not be stored or read on the tier.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("block of {0} bytes does not fit the tier")]
    TooLarge(u64),
    #[error("no space left on the drive")]
    NoSpace,
    #[error("the index's filesystem is full; the drive takes no new blocks")]
    IndexFull,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("index: {0}")]
    Index(#[from] rocksdb::Error),
    #[error("its index {} is locked by another process (another daemon on this drive, or one still stopping)", .0.display())]
    InUse(std::path::PathBuf),
    /// The block was removed, or a newer write of its key began, while it
    /// was being written: it is not indexed, and its space is free again.
    #[error("removed or written again while being written")]
    Cancelled,
}

/// Where a block lives on the device, as the index records it, and the
/// block its prefix extends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    offset: u64,
    len: u32,
    checksum: u64,
    parent: Option<BlockHash>,
    /// Whether the index holds a tag entry for the block (not part of the
    /// record's bytes).
    tagged: bool,
}

impl Record {
    /// Bytes of a record without a parent (the only kind before parents
    /// were kept: such indexes still open); with one, 32 more.
    const LEN: usize = 20;

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::LEN + 32);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.checksum.to_le_bytes());
        if let Some(parent) = &self.parent {
            out.extend_from_slice(&parent.0);
        }
        out
    }

    fn decode(b: &[u8]) -> Option<Record> {
        let parent = match b.len() {
            Self::LEN => None,
            n if n == Self::LEN + 32 => Some(BlockHash(b[Self::LEN..].try_into().ok()?)),
            _ => return None,
        };
        Some(Record {
            offset: u64::from_le_bytes(b[..8].try_into().ok()?),
            len: u32::from_le_bytes(b[8..12].try_into().ok()?),
            checksum: u64::from_le_bytes(b[12..20].try_into().ok()?),
            parent,
            tagged: false,
        })
    }

    fn extent(&self) -> u64 {
        (self.len as u64).max(1).next_multiple_of(ALIGN as u64)
    }
}

/// Index key: namespace bytes, a zero byte, the 32-byte hash.
fn index_key(key: &BlockKey) -> Vec<u8> {
    let ns = key.namespace.as_str().as_bytes();
    let mut out = Vec::with_capacity(ns.len() + 1 + 32);
    out.extend_from_slice(ns);
    out.push(0);
    out.extend_from_slice(&key.hash.0);
    out
}

/// First byte of a tag entry's key (then the block's index key): no
/// namespace starts with it (it is not UTF-8), so tag entries sort after
/// every block's, and a daemon from before tags drops them on open as
/// entries it cannot read.
const TAG_ENTRY: u8 = 0xff;

fn tag_key(key: &BlockKey) -> Vec<u8> {
    let mut out = vec![TAG_ENTRY];
    out.extend_from_slice(&index_key(key));
    out
}

fn parse_index_key(b: &[u8]) -> Option<BlockKey> {
    let split = b.len().checked_sub(33)?;
    if b[split] != 0 {
        return None;
    }
    let ns = Namespace::new(std::str::from_utf8(&b[..split]).ok()?).ok()?;
    Some(BlockKey::new(
        ns,
        BlockHash(b[split + 1..].try_into().ok()?),
    ))
}

/// An index entry read back from RocksDB: the block's key and record, or
/// `None` for bytes that are not one (dropped on open, never trusted).
fn decode_entry(key: &[u8], value: &[u8]) -> Option<(BlockKey, Record)> {
    Some((parse_index_key(key)?, Record::decode(value)?))
}

/// What recovery makes of an index entry, for the fuzzer: the key, the
/// offset, length and checksum, or `None`.
pub fn decode_index_entry(key: &[u8], value: &[u8]) -> Option<(BlockKey, u64, u32, u64)> {
    decode_entry(key, value).map(|(k, r)| (k, r.offset, r.len, r.checksum))
}

/// Free space of the device as extents (offset -> length), first fit,
/// coalesced on free.
#[derive(Debug, Default)]
struct Extents {
    free: BTreeMap<u64, u64>,
}

impl Extents {
    fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Extents { free }
    }

    fn allocate(&mut self, len: u64) -> Option<u64> {
        let (&at, &size) = self.free.iter().find(|(_, s)| **s >= len)?;
        self.free.remove(&at);
        if size > len {
            self.free.insert(at + len, size - len);
        }
        Some(at)
    }

    /// Marks `[at, at + len)` used (a block found by recovery).
    fn claim(&mut self, at: u64, len: u64) -> bool {
        let Some((&start, &size)) = self.free.range(..=at).next_back() else {
            return false;
        };
        if at + len > start + size {
            return false;
        }
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if start + size > at + len {
            self.free.insert(at + len, start + size - at - len);
        }
        true
    }

    fn release(&mut self, mut at: u64, mut len: u64) {
        if let Some((&prev, &size)) = self.free.range(..at).next_back() {
            if prev + size == at {
                self.free.remove(&prev);
                at = prev;
                len += size;
            }
        }
        if let Some(&next) = self.free.get(&(at + len)) {
            self.free.remove(&(at + len));
            len += next;
        }
        self.free.insert(at, len);
    }

    fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

struct State {
    extents: Extents,
    blocks: HashMap<BlockKey, (Record, Place)>,
    /// What goes when room is needed (`order`).
    order: DriveOrder,
    /// Bytes (extents) held by each tenant with a quota, writes in flight
    /// included.
    tenant_used: Vec<u64>,
    /// Blocks being written, each with the number of its write: a removal
    /// meanwhile, or a newer write of the key, takes it out, and the write
    /// then leaves no record (a removed block must not come back).
    writing: HashMap<BlockKey, u64>,
    next_write: u64,
    /// Leases on blocks here (`leases`): each keeps its block from a
    /// removal that is not forced, and from eviction within their share.
    leases: leases::Leases,
}

/// One NVMe tier: a file or device, its index, and the blocks in it.
pub struct NvmeTier {
    engine: Box<dyn IoEngine>,
    db: rocksdb::DB,
    capacity: u64,
    state: Mutex<State>,
    corrupt: AtomicU64,
    evictions: AtomicU64,
    io_errors: AtomicU64,
    headroom: Headroom,
    quotas: Quotas,
    /// The tags found on open, until the tiers take them (`take_tags`).
    recovered_tags: Mutex<Vec<(BlockKey, Arc<EngineTag>)>>,
}

impl NvmeTier {
    /// Writes the index's memory table to disk, so that a next daemon opens
    /// it without replaying its log.
    pub fn flush(&self) -> Result<(), TierError> {
        Ok(self.db.flush()?)
    }

    /// Opens the tier: `capacity` bytes of the data file through `engine`,
    /// and the index in `index_dir`, recovering every block it lists.
    /// Entries that do not fit the capacity (the tier was shrunk) or
    /// overlap are dropped.
    pub fn open(
        engine: Box<dyn IoEngine>,
        capacity: u64,
        index_dir: &Path,
    ) -> Result<Self, TierError> {
        let capacity = capacity / ALIGN as u64 * ALIGN as u64;
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        // Small flushes: the index's headroom on its filesystem must hold one.
        opts.set_write_buffer_size(4 << 20);
        let db = rocksdb::DB::open(&opts, index_dir).map_err(|err| {
            // Held by another process ("While lock file: ...") or by this one.
            if err.to_string().contains("LOCK: ") {
                TierError::InUse(index_dir.to_path_buf())
            } else {
                err.into()
            }
        })?;
        let headroom = Headroom::new(index_dir, index_dir.join("BALLAST"))?;
        let mut state = State {
            extents: Extents::new(capacity),
            blocks: HashMap::new(),
            order: DriveOrder::new(Eviction::Lru, 0.0, capacity),
            tenant_used: Vec::new(),
            writing: HashMap::new(),
            next_write: 0,
            leases: leases::Leases::default(),
        };
        let mut dropped = Vec::new();
        let mut tags = Vec::new();
        for item in db.iterator(rocksdb::IteratorMode::Start) {
            let (k, v) = item?;
            if k.first() == Some(&TAG_ENTRY) {
                // After every block's entry: its block is known by now.
                let tag = parse_index_key(&k[1..]).and_then(|key| {
                    let (rec, _) = state.blocks.get_mut(&key)?;
                    rec.tagged = true;
                    Some((key, EngineTag::from_wire(&v).ok()??))
                });
                match tag {
                    Some(tag) => tags.push(tag),
                    None => dropped.push(k),
                }
                continue;
            }
            match decode_entry(&k, &v) {
                Some((key, rec)) if state.extents.claim(rec.offset, rec.extent()) => {
                    let place = state.order.insert(&key, rec.extent(), true);
                    state.blocks.insert(key, (rec, place));
                }
                _ => dropped.push(k),
            }
        }
        for k in &dropped {
            db.delete(k)?;
        }
        if !dropped.is_empty() {
            tracing::warn!(
                dropped = dropped.len(),
                "unusable index entries dropped on open"
            );
        }
        tracing::info!(
            blocks = state.blocks.len(),
            tagged = tags.len(),
            capacity,
            "NVMe tier opened"
        );
        Ok(NvmeTier {
            engine,
            db,
            capacity,
            state: Mutex::new(state),
            corrupt: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            io_errors: AtomicU64::new(0),
            headroom,
            quotas: Quotas::default(),
            recovered_tags: Mutex::new(tags),
        })
    }

    /// The tags of the blocks found on open (once: a second call has none).
    pub fn take_tags(&self) -> Vec<(BlockKey, Arc<EngineTag>)> {
        std::mem::take(&mut *self.recovered_tags.lock())
    }

    /// Evicts in `order` (the daemon's `eviction`, with its
    /// `probation_share` of the drive under 2Q; LRU until this is called).
    /// Blocks already on the drive count as reused: they were kept across
    /// a restart, and which part they were in is not kept.
    pub fn with_order(mut self, order: Eviction, probation_share: f64) -> Self {
        let state = self.state.get_mut();
        let mut held: Vec<(Place, BlockKey, u64)> = state
            .blocks
            .iter()
            .map(|(k, (rec, place))| (*place, k.clone(), rec.extent()))
            .collect();
        held.sort_by_key(|(place, _, _)| place.stamp());
        state.order = DriveOrder::new(order, probation_share, self.capacity);
        for (_, key, extent) in held {
            let place = state.order.insert(&key, extent, true);
            if let Some((_, p)) = state.blocks.get_mut(&key) {
                *p = place;
            }
        }
        self
    }

    /// Gives tenants shares of this drive (see `quota`); blocks already on
    /// it count against them.
    pub fn with_quotas(mut self, quotas: Quotas) -> Self {
        let state = self.state.get_mut();
        state.tenant_used = vec![0; quotas.len()];
        for (key, (rec, _)) in &state.blocks {
            if let Some(t) = quotas.tenant_of(&key.namespace) {
                state.tenant_used[t as usize] += rec.extent();
            }
        }
        self.quotas = quotas;
        self
    }

    /// Each tenant with a quota: (tenant, bytes used, bytes allowed).
    pub fn tenant_usage(&self) -> Vec<(std::sync::Arc<str>, u64, u64)> {
        let state = self.state.lock();
        (0..self.quotas.len() as u16)
            .map(|t| {
                let used = state.tenant_used[t as usize];
                (
                    self.quotas.name(t).clone(),
                    used,
                    self.quotas.limit(t, self.capacity),
                )
            })
            .collect()
    }

    /// What the drive's order did since it opened, and its probation
    /// (bytes held, most it holds).
    pub fn order_stats(&self) -> (DriveEvents, (u64, u64)) {
        let state = self.state.lock();
        (state.order.events(), state.order.probation())
    }

    /// Drops a block from the index and frees its extent (the entry goes
    /// before the space can be reused), with its tenant's share.
    /// `evicted`: dropped for room (the order remembers it), not removed.
    fn drop_locked(
        &self,
        state: &mut State,
        key: &BlockKey,
        evicted: bool,
    ) -> Result<Record, TierError> {
        let (rec, place) = state.blocks.remove(key).expect("an indexed block");
        state.leases.end(key);
        state.order.remove(key, place, rec.extent(), evicted);
        if rec.tagged {
            let mut batch = rocksdb::WriteBatch::default();
            batch.delete(index_key(key));
            batch.delete(tag_key(key));
            self.db.write(batch)?;
        } else {
            self.db.delete(index_key(key))?;
        }
        state.extents.release(rec.offset, rec.extent());
        if let Some(t) = self.quotas.tenant_of(&key.namespace) {
            state.tenant_used[t as usize] -= rec.extent();
        }
        Ok(rec)
    }

    /// Where the index lives for a data file: beside it.
    pub fn index_dir_for(data: &Path) -> PathBuf {
        let mut name = data
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        name.push(".index");
        data.with_file_name(name)
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.state.lock().blocks.contains_key(key)
    }

    pub fn blocks(&self) -> usize {
        self.state.lock().blocks.len()
    }

    /// The length and checksum of the block stored under `key`, if any.
    pub fn record_of(&self, key: &BlockKey) -> Option<(u32, u64)> {
        self.state
            .lock()
            .blocks
            .get(key)
            .map(|(r, _)| (r.len, r.checksum))
    }

    /// The parent the block was stored with, if it is here and had one.
    pub fn parent_of(&self, key: &BlockKey) -> Option<BlockHash> {
        self.state
            .lock()
            .blocks
            .get(key)
            .and_then(|(r, _)| r.parent)
    }

    pub fn used(&self) -> u64 {
        self.capacity - self.state.lock().extents.free_bytes()
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn corrupt_blocks(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }

    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Whether the drive refuses new blocks because its index's filesystem
    /// is full.
    pub fn is_full(&self) -> bool {
        self.headroom.is_full()
    }

    /// Failed device reads and writes since open.
    pub fn io_errors(&self) -> u64 {
        self.io_errors.load(Ordering::Relaxed)
    }

    fn io_failed(&self, err: io::Error) -> TierError {
        self.io_errors.fetch_add(1, Ordering::Relaxed);
        if err.raw_os_error() == Some(libc::ENOSPC) {
            TierError::NoSpace
        } else {
            TierError::Io(err)
        }
    }

    /// Every block on the tier: (key, size, checksum), for inventories.
    /// Every block on the drive: key, size, checksum and the parent it
    /// names.
    pub fn inventory(&self) -> Vec<(BlockKey, u32, u64, Option<BlockHash>)> {
        let state = self.state.lock();
        state
            .blocks
            .iter()
            .map(|(k, (r, _))| (k.clone(), r.len, r.checksum, r.parent))
            .collect()
    }

    /// Stores a block (a demotion from DRAM, or a direct put), with the
    /// parent and tag it was written with, and whether it is `hot` (it
    /// left DRAM's main queue: see `order`). Evicts in the drive's order
    /// if it is full; returns the keys it evicted. `Cancelled` where the
    /// key was removed, or written again, before this write ended.
    pub async fn put(
        &self,
        key: &BlockKey,
        value: &[u8],
        sum: u64,
        (parent, tag, hot): (Option<BlockHash>, Option<&Arc<EngineTag>>, bool),
    ) -> Result<Vec<BlockKey>, TierError> {
        let extent = (value.len() as u64).max(1).next_multiple_of(ALIGN as u64);
        if extent > self.capacity || value.len() > u32::MAX as usize {
            return Err(TierError::TooLarge(value.len() as u64));
        }
        if !self.headroom.admits_writes() {
            return Err(TierError::IndexFull);
        }
        let tenant = self.quotas.tenant_of(&key.namespace);
        let (offset, evicted, write) = {
            let mut state = self.state.lock();
            if state.blocks.contains_key(key) {
                return Ok(Vec::new());
            }
            let mut evicted = Vec::new();
            if let Some(t) = tenant {
                // Over its share, a tenant makes room from its own blocks.
                let limit = self.quotas.limit(t, self.capacity);
                if extent > limit {
                    return Err(TierError::NoSpace);
                }
                while state.tenant_used[t as usize] + extent > limit {
                    let now = Instant::now();
                    let victim = state
                        .order
                        .coldest()
                        .take(MAX_QUOTA_SCAN)
                        .find(|k| {
                            self.quotas.tenant_of(&k.namespace) == Some(t)
                                && !state.leases.holds(k, now)
                        })
                        .cloned();
                    let Some(victim) = victim else {
                        return Err(TierError::NoSpace);
                    };
                    self.drop_locked(&mut state, &victim, true)?;
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                    evicted.push(victim);
                }
            }
            let offset = loop {
                if let Some(at) = state.extents.allocate(extent) {
                    break at;
                }
                let Some(victim) = Self::unleased_victim(&mut state) else {
                    return Err(TierError::NoSpace);
                };
                self.drop_locked(&mut state, &victim, true)?;
                self.evictions.fetch_add(1, Ordering::Relaxed);
                evicted.push(victim);
            };
            if let Some(t) = tenant {
                state.tenant_used[t as usize] += extent;
            }
            let write = state.next_write;
            state.next_write += 1;
            // A write of the key still in flight is older: this one wins.
            state.writing.insert(key.clone(), write);
            (offset, evicted, write)
        };
        let mut buf = AlignedBuf::zeroed(extent as usize);
        buf.as_mut_slice()[..value.len()].copy_from_slice(value);
        let written = self
            .engine
            .submit(IoKind::Write, vec![IoRequest { offset, buf }])
            .await
            .pop()
            .map(|(_, r)| r)
            .unwrap_or_else(|| Err(io::Error::other("no result")));
        let record = Record {
            offset,
            len: value.len() as u32,
            checksum: sum,
            parent,
            tagged: tag.is_some(),
        };
        let mut state = self.state.lock();
        // Indexed under the lock, so that a removal either comes first
        // (and this write leaves nothing) or finds the record.
        let indexed = match written {
            _ if state.writing.get(key) != Some(&write) => Err(TierError::Cancelled),
            Ok(n) if n as u64 == extent => self.index(key, &record, tag),
            Ok(n) => Err(self.io_failed(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("short write: {n} of {extent} bytes"),
            ))),
            Err(e) => Err(self.io_failed(e)),
        };
        if state.writing.get(key) == Some(&write) {
            state.writing.remove(key);
        }
        match indexed {
            Ok(()) => {
                let place = state.order.insert(key, extent, hot);
                state.blocks.insert(key.clone(), (record, place));
                Ok(evicted)
            }
            Err(err) => {
                state.extents.release(offset, extent);
                if let Some(t) = tenant {
                    state.tenant_used[t as usize] -= extent;
                }
                Err(err)
            }
        }
    }

    /// Writes a block's index entry, and its tag's in the same batch.
    fn index(
        &self,
        key: &BlockKey,
        record: &Record,
        tag: Option<&Arc<EngineTag>>,
    ) -> Result<(), TierError> {
        let Some(tag) = tag else {
            return Ok(self.db.put(index_key(key), record.encode())?);
        };
        let mut batch = rocksdb::WriteBatch::default();
        batch.put(index_key(key), record.encode());
        batch.put(tag_key(key), EngineTag::to_wire(&Some(tag.clone())));
        Ok(self.db.write(batch)?)
    }

    /// Reads a block, verified against its checksum; `Ok(None)` on a miss
    /// (including a block that failed its checksum, which is dropped).
    pub async fn get(&self, key: &BlockKey) -> Result<Option<(Vec<u8>, u64)>, TierError> {
        let record = {
            let mut state = self.state.lock();
            let Some((rec, place)) = state.blocks.get(key).copied() else {
                return Ok(None);
            };
            let place = state.order.touch(key, place, rec.extent());
            state.blocks.insert(key.clone(), (rec, place));
            rec
        };
        let buf = AlignedBuf::zeroed(record.extent() as usize);
        let (buf, result) = self
            .engine
            .submit(
                IoKind::Read,
                vec![IoRequest {
                    offset: record.offset,
                    buf,
                }],
            )
            .await
            .pop()
            .ok_or_else(|| io::Error::other("no result"))?;
        let n = result.map_err(|e| self.io_failed(e))?;
        let bytes = &buf.as_slice()[..(record.len as usize).min(n)];
        if bytes.len() != record.len as usize || checksum(bytes) != record.checksum {
            if self.state.lock().blocks.get(key).map(|(r, _)| *r) != Some(record) {
                // Evicted, removed or written again while it was read: its
                // room may hold another block's bytes by now. A miss.
                return Ok(None);
            }
            self.corrupt.fetch_add(1, Ordering::Relaxed);
            tracing::error!(%key, "block failed its checksum on NVMe; dropped");
            self.remove_record(key, record)?;
            return Ok(None);
        }
        Ok(Some((bytes.to_vec(), record.checksum)))
    }

    /// Drops a block, and stops a write of it in flight from leaving a
    /// record; `false` if it was neither stored nor being written.
    pub fn remove(&self, key: &BlockKey) -> Result<bool, TierError> {
        let mut state = self.state.lock();
        let writing = state.writing.remove(key).is_some();
        if !state.blocks.contains_key(key) {
            return Ok(writing);
        }
        self.drop_locked(&mut state, key, false)?;
        Ok(true)
    }

    fn remove_record(&self, key: &BlockKey, record: Record) -> Result<(), TierError> {
        let mut state = self.state.lock();
        if state.blocks.get(key).is_some_and(|(r, _)| *r == record) {
            self.drop_locked(&mut state, key, false)?;
        }
        Ok(())
    }
}

mod leases;
mod order;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
