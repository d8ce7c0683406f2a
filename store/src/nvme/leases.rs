//! Leases on a drive's blocks. A lease that finds a block only on a drive
//! (vLLM's scheduler looks a request's blocks up, and its worker loads
//! them a step or more later) holds it there as Mooncake's leases hold an
//! object: the drive's eviction passes over it, and a removal that is not
//! forced is refused, until the lease ends. The lease ends by itself; a
//! block that leaves the drive takes its lease with it, so the leases
//! never outnumber the blocks.
//!
//! Leases keep at most half of the drive's bytes from eviction
//! (`MAX_HELD_SHARE`, as in DRAM): past it a block is found but not held
//! (`Busy`, counted), so that the lookups of a long queue of waiting
//! requests never leave the drive without room for demotions. Such a
//! lease still keeps the block from a removal that is not forced. A heap
//! of ends (one entry per held lease, checked before each hold and each
//! eviction) gives a lease's bytes back when it ends.
//!
//! Eviction looks at `MAX_PASSED_OVER` blocks at most for one write,
//! passing over the held ones (each goes to the recent end of its part of
//! the order, so that the next write does not meet it first again); where
//! all of them are held the write finds no room, and its block is not
//! written (a demotion then drops it, as on any drive without room).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use mooncake_proto::BlockKey;

use super::{NvmeTier, State};

/// Blocks one write looks at, at most, for one to evict that no lease holds.
const MAX_PASSED_OVER: usize = 64;
/// Leases keep at most 1 / this of a drive's bytes from eviction.
const MAX_HELD_SHARE: u64 = 2;

/// A lease on one of the drive's blocks.
pub(super) struct Lease {
    pub(super) until: Instant,
    /// Its block's extent, kept from eviction; 0: found past the leases'
    /// share of the drive, kept only from a removal that is not forced.
    pub(super) held: u64,
}

/// The leases on one drive's blocks.
#[derive(Default)]
pub(super) struct Leases {
    pub(super) by_key: HashMap<BlockKey, Lease>,
    /// (end, key) of held leases, earliest first: at most one entry per
    /// held lease, whose own end may since have moved later; and entries of
    /// leases that left with their blocks, dropped when they come up.
    pub(super) due: BinaryHeap<Reverse<(Instant, BlockKey)>>,
    /// Held leases, and the bytes they hold.
    pub(super) held: u64,
    pub(super) held_bytes: u64,
    /// Leases found past the leases' share of the drive, not held.
    refused: u64,
}

impl Leases {
    /// Whether a lease on `key` runs at `now` (held or not): a removal
    /// that is not forced is refused.
    pub(super) fn runs(&self, key: &BlockKey, now: Instant) -> bool {
        self.by_key.get(key).is_some_and(|l| l.until > now)
    }

    /// Whether a lease keeps `key` from eviction at `now`.
    pub(super) fn holds(&self, key: &BlockKey, now: Instant) -> bool {
        self.by_key
            .get(key)
            .is_some_and(|l| l.held > 0 && l.until > now)
    }

    /// Leases `key` (an extent of `bytes`) at `now` until `until`, or later
    /// where it is leased longer already; whether the lease keeps it from
    /// eviction (`false`: the held leases have their share, `capacity / 2`).
    pub(super) fn take(
        &mut self,
        key: &BlockKey,
        (until, now): (Instant, Instant),
        bytes: u64,
        capacity: u64,
    ) -> bool {
        self.expire(now);
        let share = capacity / MAX_HELD_SHARE;
        let lease = self
            .by_key
            .entry(key.clone())
            .or_insert(Lease { until, held: 0 });
        lease.until = lease.until.max(until);
        if lease.held > 0 {
            return true;
        }
        if self.held_bytes + bytes > share {
            self.refused += 1;
            return false;
        }
        lease.held = bytes;
        self.held += 1;
        self.held_bytes += bytes;
        self.due.push(Reverse((lease.until, key.clone())));
        true
    }

    /// Ends the held leases whose end has come, giving their bytes back.
    pub(super) fn expire(&mut self, now: Instant) {
        while let Some(Reverse((due, _))) = self.due.peek() {
            if *due > now {
                return;
            }
            let Some(Reverse((_, key))) = self.due.pop() else {
                return;
            };
            let Some(lease) = self.by_key.get(&key) else {
                continue; // left with its block
            };
            match (lease.held, lease.until > now) {
                (0, _) => {} // an entry of a lease that left, taken again unheld
                (_, true) => self.due.push(Reverse((lease.until, key))),
                (held, false) => {
                    self.by_key.remove(&key);
                    self.held -= 1;
                    self.held_bytes -= held;
                }
            }
        }
    }

    /// `key`'s block left the drive: its lease goes with it.
    pub(super) fn end(&mut self, key: &BlockKey) {
        if let Some(lease) = self.by_key.remove(key) {
            if lease.held > 0 {
                self.held -= 1;
                self.held_bytes -= lease.held;
            }
        }
    }
}

impl NvmeTier {
    /// Leases a stored block until `until` (or later, where it is leased
    /// longer already): `None` where the drive does not hold it, else
    /// whether the lease keeps it from eviction (`false`: leases hold half
    /// the drive already; a removal that is not forced is refused still).
    pub fn hold(&self, key: &BlockKey, until: Instant) -> Option<bool> {
        let mut state = self.state.lock();
        let state = &mut *state;
        let (rec, _) = state.blocks.get(key)?;
        let when = (until, Instant::now());
        Some(state.leases.take(key, when, rec.extent(), self.capacity))
    }

    /// Whether a lease holds `key` on this drive now (held from eviction or
    /// not: a removal that is not forced is refused).
    pub fn leased(&self, key: &BlockKey) -> bool {
        self.state.lock().leases.runs(key, Instant::now())
    }

    /// Leases that keep blocks from eviction now (some may have ended
    /// since the last hold or eviction), and leases found past their share
    /// of the drive since it opened.
    pub fn holds(&self) -> (u64, u64) {
        let state = self.state.lock();
        (state.leases.held, state.leases.refused)
    }

    /// The block to evict for room: the order's victim, passing over
    /// held ones; `None` where the drive is empty or the first
    /// `MAX_PASSED_OVER` victims are all held.
    pub(super) fn unleased_victim(state: &mut State) -> Option<BlockKey> {
        let now = Instant::now();
        state.leases.expire(now);
        for _ in 0..MAX_PASSED_OVER {
            let victim = state.order.victim()?.clone();
            if !state.leases.holds(&victim, now) {
                return Some(victim);
            }
            let (rec, place) = state.blocks[&victim];
            let place = state.order.pass_over(&victim, place, rec.extent());
            state.blocks.insert(victim, (rec, place));
        }
        None
    }
}
