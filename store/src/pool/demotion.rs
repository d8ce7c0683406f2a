//! Demotion: blocks evicted from DRAM are copied out and queued for the
//! next tier (NVMe), within a bound of queued bytes that writers wait for.

use std::time::Instant;

use super::*;

/// A block evicted from DRAM on its way to the next tier: its bytes were
/// copied out before its DRAM space was freed.
pub struct Demoted {
    pub key: BlockKey,
    /// Shared with the pool's table of blocks on their way, which serves
    /// reads of them until they are written.
    pub bytes: Arc<[u8]>,
    pub checksum: u64,
    /// Its parent, kept with it on the next tier so that it comes back
    /// into DRAM as part of its chain (prefix-aware eviction).
    pub parent: Option<mooncake_proto::BlockHash>,
    /// Read while it was in DRAM.
    pub read: bool,
    /// It left DRAM's main queue (read, or admitted as reused; under LRU
    /// every block): the drive's 2Q keeps it in its main part.
    pub main: bool,
    /// Tells this demotion from a later one of the same key.
    seq: u64,
}

/// Blocks evicted and not yet written to the next tier: their bytes,
/// checksum and demotion number, by key.
pub(super) type Demoting = HashMap<BlockKey, InFlight>;

/// A block on its way to the next tier.
pub(super) struct InFlight {
    seq: u64,
    bytes: Arc<[u8]>,
    checksum: u64,
    /// Read on its way: the next tier keeps it as a block read there.
    read: bool,
    /// Removed on its way: not served, and not written (or, where its
    /// write had begun, dropped from the drive once written).
    removed: bool,
    /// The end of a lease taken on its way, which its drive keeps once
    /// it is written (`lease_on_its_way`).
    leased_until: Option<Instant>,
}

impl DramPool {
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
                && (queued == 0 || queued + len <= self.demotion_bytes())
        })
    }

    /// Bytes of evicted blocks the demotion queue holds before writers
    /// wait: an eighth of the pool, at most 256 MiB.
    pub(super) fn demotion_bytes(&self) -> u64 {
        (self.region.len() as u64 / DEMOTION_SHARE).min(DEMOTION_BYTES)
    }

    /// The demoter wrote (or gave up on) a demoted block: it is no longer
    /// served from the queue.
    pub fn demotion_done(&self, done: &Demoted) {
        self.demote_queued
            .fetch_sub(done.bytes.len() as u64, Ordering::Relaxed);
        let mut demoting = self.demoting.lock();
        if demoting.get(&done.key).is_some_and(|f| f.seq == done.seq) {
            demoting.remove(&done.key);
        }
    }

    /// Whether `demoted` was read on its way to the next tier (served by
    /// `get_demoting`): its drive then keeps it as a block read there, as
    /// if the read had come after the write.
    pub fn read_on_its_way(&self, demoted: &Demoted) -> bool {
        self.demoting
            .lock()
            .get(&demoted.key)
            .is_some_and(|f| f.seq == demoted.seq && f.read)
    }

    /// Whether a block evicted from DRAM is still on its way to the next
    /// tier (not counted as a read).
    pub fn is_demoting(&self, key: &BlockKey) -> bool {
        self.demoting.lock().get(key).is_some_and(|f| !f.removed)
    }

    /// A block evicted from DRAM and still on its way to the next tier:
    /// its bytes and checksum, so that a read between its eviction and its
    /// write is a hit.
    pub fn get_demoting(&self, key: &BlockKey) -> Option<(Arc<[u8]>, u64)> {
        let mut demoting = self.demoting.lock();
        let f = demoting.get_mut(key).filter(|f| !f.removed)?;
        f.read = true;
        Some((f.bytes.clone(), f.checksum))
    }

    /// Leases a block on its way to the next tier until `until` (or
    /// later); `false` where it is not on its way.
    pub fn hold_demoting(&self, key: &BlockKey, until: Instant) -> bool {
        let mut demoting = self.demoting.lock();
        let Some(f) = demoting.get_mut(key).filter(|f| !f.removed) else {
            return false;
        };
        f.leased_until = f.leased_until.max(Some(until));
        true
    }

    /// Whether a lease holds a block on its way to the next tier now.
    pub fn demoting_leased(&self, key: &BlockKey) -> bool {
        let now = Instant::now();
        let demoting = self.demoting.lock();
        demoting
            .get(key)
            .and_then(|f| f.leased_until)
            .is_some_and(|until| until > now)
    }

    /// The end of a lease taken on `demoted` on its way, for its drive to
    /// keep (ask before `demotion_done`).
    pub fn lease_on_its_way(&self, demoted: &Demoted) -> Option<Instant> {
        let demoting = self.demoting.lock();
        let f = demoting.get(&demoted.key)?;
        (f.seq == demoted.seq).then_some(f.leased_until)?
    }

    /// The checksum of a block on its way to the next tier (not counted
    /// as a read).
    pub fn demoting_checksum(&self, key: &BlockKey) -> Option<u64> {
        let demoting = self.demoting.lock();
        demoting.get(key).filter(|f| !f.removed).map(|f| f.checksum)
    }

    /// The block was removed while on its way to the next tier: it is no
    /// longer served from the queue, and the demoter does not write it
    /// (`demotion_current`); `true` if it was on its way.
    pub fn cancel_demotion(&self, key: &BlockKey) -> bool {
        match self.demoting.lock().get_mut(key) {
            Some(f) if !f.removed => {
                f.removed = true;
                true
            }
            _ => false,
        }
    }

    /// Whether `demoted` is still the block to write to the next tier:
    /// neither removed since its eviction nor followed by a later
    /// demotion of its key.
    pub fn demotion_current(&self, demoted: &Demoted) -> bool {
        self.demoting
            .lock()
            .get(&demoted.key)
            .is_some_and(|f| f.seq == demoted.seq && !f.removed)
    }

    /// Queues an evicted block for the next tier (`false`: the queue is
    /// full, and the block is dropped), serving it meanwhile.
    pub(super) fn send_demoted(
        &self,
        next: &tokio::sync::mpsc::Sender<Demoted>,
        key: BlockKey,
        bytes: &[u8],
        (checksum, parent, read, main): (u64, Option<mooncake_proto::BlockHash>, bool, bool),
    ) -> bool {
        let seq = self.demote_seq.fetch_add(1, Ordering::Relaxed);
        let bytes: Arc<[u8]> = Arc::from(bytes);
        self.demoting.lock().insert(
            key.clone(),
            InFlight {
                seq,
                bytes: bytes.clone(),
                checksum,
                read: false,
                removed: false,
                leased_until: None,
            },
        );
        let demoted = Demoted {
            key,
            bytes,
            checksum,
            parent,
            read,
            main,
            seq,
        };
        match next.try_send(demoted) {
            Ok(()) => true,
            Err(err) => {
                let back = err.into_inner();
                let mut demoting = self.demoting.lock();
                if demoting.get(&back.key).is_some_and(|f| f.seq == seq) {
                    demoting.remove(&back.key);
                }
                false
            }
        }
    }

    /// Blocks evicted and not yet written to the next tier (or given up).
    pub fn demotions_waiting(&self) -> usize {
        self.demoting.lock().len()
    }

    /// Blocks sent to the next tier since start.
    pub fn demotions(&self) -> u64 {
        self.demotions.load(Ordering::Relaxed)
    }
}
