//! Leases on a drive's blocks. A lease that finds a block only on a drive
//! (vLLM's scheduler looks a request's blocks up, and its worker loads
//! them a step or more later) holds it there as Mooncake's leases hold an
//! object: the drive's eviction passes over it, and a removal that is not
//! forced is refused, until the lease ends. The lease ends by itself; a
//! block that leaves the drive takes its lease with it, so the leases
//! never outnumber the blocks.
//!
//! Eviction looks at `MAX_PASSED_OVER` blocks at most for one write,
//! passing over the leased ones (each goes to the recent end of its part
//! of the order, so that the next write does not meet it first again);
//! where all of them are leased the write finds no room, and its block is
//! not written (a demotion then drops it, as on any drive without room).

use std::collections::HashMap;
use std::time::Instant;

use mooncake_proto::BlockKey;

use super::{NvmeTier, State};

/// Blocks one write looks at, at most, for one to evict that no lease holds.
const MAX_PASSED_OVER: usize = 64;

/// Whether a lease on `key` runs at `now`.
pub(super) fn runs(leased: &HashMap<BlockKey, Instant>, key: &BlockKey, now: Instant) -> bool {
    leased.get(key).is_some_and(|until| *until > now)
}

impl NvmeTier {
    /// Holds a stored block until `until` (or later, where it is held
    /// longer already); `false` where the drive does not hold it.
    pub fn hold(&self, key: &BlockKey, until: Instant) -> bool {
        let mut state = self.state.lock();
        if !state.blocks.contains_key(key) {
            return false;
        }
        let due = state.leased.entry(key.clone()).or_insert(until);
        *due = (*due).max(until);
        true
    }

    /// Whether a lease holds `key` on this drive now.
    pub fn leased(&self, key: &BlockKey) -> bool {
        runs(&self.state.lock().leased, key, Instant::now())
    }

    /// The block to evict for room: the order's victim, passing over
    /// leased ones; `None` where the drive is empty or the first
    /// `MAX_PASSED_OVER` victims are all leased.
    pub(super) fn unleased_victim(state: &mut State) -> Option<BlockKey> {
        let now = Instant::now();
        for _ in 0..MAX_PASSED_OVER {
            let victim = state.order.victim()?.clone();
            if !runs(&state.leased, &victim, now) {
                return Some(victim);
            }
            let (rec, place) = state.blocks[&victim];
            let place = state.order.pass_over(&victim, place, rec.extent());
            state.blocks.insert(victim, (rec, place));
        }
        None
    }
}
