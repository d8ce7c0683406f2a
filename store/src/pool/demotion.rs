//! Demotion: blocks evicted from DRAM are copied out and queued for the
//! next tier (NVMe), within a bound of queued bytes that writers wait for.

use super::*;

/// A block evicted from DRAM on its way to the next tier: its bytes were
/// copied out before its DRAM space was freed.
pub struct Demoted {
    pub key: BlockKey,
    pub bytes: Vec<u8>,
    pub checksum: u64,
    /// Its parent, kept with it on the next tier so that it comes back
    /// into DRAM as part of its chain (prefix-aware eviction).
    pub parent: Option<mooncake_proto::BlockHash>,
    /// Read while it was in DRAM.
    pub read: bool,
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
                && (queued == 0 || queued + len <= DEMOTION_BYTES)
        })
    }

    /// The demoter wrote (or gave up on) a demoted block of `len` bytes.
    pub fn demotion_done(&self, len: u64) {
        self.demote_queued.fetch_sub(len, Ordering::Relaxed);
    }

    /// Blocks sent to the next tier since start.
    pub fn demotions(&self) -> u64 {
        self.demotions.load(Ordering::Relaxed)
    }
}
