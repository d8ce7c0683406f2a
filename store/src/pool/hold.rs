//! Keeping blocks from eviction: pins, which nest and last until as many
//! unpins, and leases for a time.
//!
//! A lease: a client that found a block (Mooncake's
//! `batch_is_exist`, which vLLM's scheduler calls before it plans a load)
//! keeps it from eviction until it has read it, or the lease runs out.
//! Unlike a pin, nobody ends a lease: it ends by itself, so a client that
//! goes away holds nothing for long. Taking a lease again extends it.
//!
//! A held block is off the LRU, as a pinned or leased one is; a heap of
//! deadlines (one entry per held block) puts it back when its lease ends,
//! checked before each eviction. Its recency is not changed by the lease:
//! it goes back where its last read left it.
//!
//! Leases hold at most half of the pool (`MAX_HELD_SHARE`): past it a
//! block is found but not held (`Busy`, counted), so that lookups of a
//! long queue of waiting requests, renewed at every scheduler step, never
//! leave puts without room (in Mooncake they can: every put is then
//! refused until leases end).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use mooncake_proto::BlockKey;

use super::{stored_mut, DramPool, Inner, PoolError, UNIT};

/// Leases hold at most 1 / this of the pool's units.
const MAX_HELD_SHARE: u64 = 2;

/// The deadlines of held blocks, earliest first.
#[derive(Default)]
pub(super) struct Holds {
    /// (deadline in ms since the pool's epoch, key): at most one entry
    /// per held block, whose own deadline may since have moved later.
    due: BinaryHeap<Reverse<(u64, BlockKey)>>,
    /// Blocks held now, and their units.
    pub(super) held: u64,
    pub(super) held_units: u64,
    /// Holds refused because leases held their share of the pool.
    refused: u64,
}

impl Holds {
    /// A held block of `units` left the pool, or its lease ended.
    pub(super) fn ended(&mut self, units: u64) {
        self.held -= 1;
        self.held_units -= units;
    }
}

impl DramPool {
    /// Keeps a block from eviction until as many `unpin`s.
    pub fn pin(&self, key: &BlockKey) -> Result<(), PoolError> {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let block = stored_mut(&mut inner.blocks, key)?;
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
        let block = stored_mut(&mut inner.blocks, key)?;
        if block.pins == 0 {
            return Ok(());
        }
        block.pins -= 1;
        if block.pins == 0 {
            inner.pinned -= 1;
            if block.evictable() {
                let (stamp, tenant, queue) = (block.stamp, block.tenant, block.queue);
                Self::lru_insert(inner, stamp, key, tenant, queue);
            }
        }
        Ok(())
    }

    /// Keeps a stored block from eviction until `until` (or later, if it
    /// is already held longer).
    pub fn hold(&self, key: &BlockKey, until: Instant) -> Result<(), PoolError> {
        let until = self.ms_since_epoch(until);
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let block = stored_mut(&mut inner.blocks, key)?;
        block.leased_until = block.leased_until.max(until);
        if block.held_until != 0 {
            block.held_until = block.held_until.max(until);
            return Ok(());
        }
        let units = inner.alloc.allocation_size(block.alloc) as u64;
        let cap = self.region.len() as u64 / UNIT / MAX_HELD_SHARE;
        if inner.holds.held_units + units > cap {
            self.expire_holds(inner);
            if inner.holds.held_units + units > cap {
                inner.holds.refused += 1;
                return Err(PoolError::Busy);
            }
        }
        let block = stored_mut(&mut inner.blocks, key)?;
        if block.evictable() {
            inner.lru.remove(block.stamp);
        }
        block.held_until = until;
        inner.holds.held += 1;
        inner.holds.held_units += units;
        inner.holds.due.push(Reverse((until, key.clone())));
        Ok(())
    }

    /// `remove`, refused (`Leased`) while a lease on the block runs, held
    /// or not (as Mooncake's leases refuse it).
    pub fn remove_unheld(&self, key: &BlockKey) -> Result<(), PoolError> {
        let now = self.ms_since_epoch(Instant::now());
        self.remove_unless(key, |b| b.leased_until > now)
    }

    /// Whether a lease runs on a stored block (as `remove_unheld` would
    /// find); `None` where the pool does not hold it.
    pub fn leased(&self, key: &BlockKey) -> Option<bool> {
        let now = self.ms_since_epoch(Instant::now());
        let inner = self.inner.lock();
        let block = inner.blocks.get(key).filter(|b| b.ready)?;
        Some(block.leased_until > now)
    }

    /// Holds refused since start because leases held their share of the
    /// pool.
    pub fn holds_refused(&self) -> u64 {
        self.inner.lock().holds.refused
    }

    /// Blocks held by leases that have not run out, as of the last
    /// eviction or `held` call.
    pub fn held(&self) -> u64 {
        let mut inner = self.inner.lock();
        self.expire_holds(&mut inner);
        inner.holds.held
    }

    /// Ends the leases that have run out: their blocks go back on the LRU
    /// (if nothing else keeps them off it).
    pub(super) fn expire_holds(&self, inner: &mut Inner) {
        if inner.holds.due.is_empty() {
            return;
        }
        let now = self.ms_since_epoch(Instant::now());
        while let Some(Reverse((due, _))) = inner.holds.due.peek() {
            if *due > now {
                break;
            }
            let Reverse((_, key)) = inner.holds.due.pop().expect("just peeked");
            let Some(block) = inner.blocks.get_mut(&key) else {
                continue;
            };
            if block.held_until == 0 {
                // Removed and stored again since: not held.
                continue;
            }
            if block.held_until > now {
                // Extended: due again later.
                let until = block.held_until;
                inner.holds.due.push(Reverse((until, key)));
                continue;
            }
            block.held_until = 0;
            let units = inner.alloc.allocation_size(block.alloc) as u64;
            inner.holds.ended(units);
            if block.evictable() {
                let (stamp, tenant, queue) = (block.stamp, block.tenant, block.queue);
                Self::lru_insert(inner, stamp, &key, tenant, queue);
            }
        }
    }

    /// Whole milliseconds from the pool's epoch to `at`, plus one: 0 is
    /// left to mean "not held".
    fn ms_since_epoch(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_millis() as u64 + 1
    }
}
