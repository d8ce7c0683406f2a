//! Lost copies made again. A daemon that dies, leaves or comes back empty
//! takes its copies with it; each block it leaves with fewer copies than its
//! writer asked for is queued here, and a background task has a daemon on
//! another host fetch the block from a surviving copy (`Fetch`: the target
//! reads it from the source and checks it against the block's checksum),
//! then adds that copy to the index. Copies are made one at a time, paced
//! to `repair_rate` bytes a second so that repairs never crowd out the
//! reads they protect.
//!
//! A daemon being drained counts as leaving: its blocks are queued when
//! the drain starts, and each gets its wanted copies on other hosts (read
//! from the draining daemon when it holds the only copy), so that the host
//! can then be stopped without a miss.
//!
//! A key waits `SETTLE` in the queue first: a daemon that registers again
//! sends its inventory right after, and its copies come back by themselves.
//! Each key is looked at again when its turn comes (it may have been
//! removed, evicted, or repaired since), and a copy that arrives when the
//! block needs it no more is dropped again.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_proto::message::FetchRequest;
use mooncake_proto::{BlockKey, ErrorCode, Opcode};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::server::State;

/// How long a queued key waits before it is repaired.
const SETTLE: Duration = Duration::from_secs(1);
/// Deadline of one fetch, end to end (the daemon gives itself half of its
/// request timeout, 5 s by default).
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The keys waiting for a copy, oldest first, at most `cap` of them.
pub struct Repairs {
    queue: Mutex<VecDeque<(BlockKey, Instant)>>,
    cap: usize,
    wake: tokio::sync::Notify,
    /// Bytes a second; 0: no repair.
    rate: u64,
    pub counts: RepairCounts,
}

/// What repairs did this term, read by the metrics at scrape time.
#[derive(Default)]
pub struct RepairCounts {
    /// Copies made again and added to the index.
    pub made: AtomicU64,
    /// Fetches that failed (the block stays short; it is queued again
    /// only by the next loss).
    pub failed: AtomicU64,
    /// Blocks that found no host to take a copy.
    pub unplaceable: AtomicU64,
    /// Keys not queued: the queue was full.
    pub dropped: AtomicU64,
    /// Blocks whose last copy went with a daemon (recomputed, not repaired).
    pub lost: AtomicU64,
}

fn bump(n: &AtomicU64) {
    n.fetch_add(1, Ordering::Relaxed);
}

impl Repairs {
    pub fn new(cap: usize, rate: u64) -> Self {
        Repairs {
            queue: Mutex::new(VecDeque::new()),
            cap,
            wake: tokio::sync::Notify::new(),
            rate,
            counts: RepairCounts::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.rate > 0
    }

    /// Queues blocks left short of copies; returns how many did not fit.
    pub fn add(&self, keys: Vec<BlockKey>, now: Instant) -> usize {
        if keys.is_empty() || !self.enabled() {
            return 0;
        }
        let mut queue = self.queue.lock();
        let room = self.cap.saturating_sub(queue.len());
        let dropped = keys.len().saturating_sub(room);
        queue.extend(keys.into_iter().take(room).map(|k| (k, now)));
        drop(queue);
        self.counts
            .dropped
            .fetch_add(dropped as u64, Ordering::Relaxed);
        self.wake.notify_one();
        dropped
    }

    /// Keys waiting.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// The oldest key that has settled, or how long until one has.
    fn next(&self, now: Instant) -> Result<BlockKey, Option<Duration>> {
        let mut queue = self.queue.lock();
        match queue.front() {
            None => Err(None),
            Some((_, at)) if now.duration_since(*at) < SETTLE => {
                Err(Some(SETTLE - now.duration_since(*at)))
            }
            Some(_) => Ok(queue.pop_front().expect("just seen").0),
        }
    }
}

/// Repairs queued keys until `stop`.
pub async fn run(state: Arc<State>, stop: CancellationToken) {
    let repairs = &state.repairs;
    loop {
        let key = match repairs.next(Instant::now()) {
            Ok(key) => key,
            Err(wait) => {
                let wait = wait.unwrap_or(Duration::from_secs(1));
                tokio::select! {
                    _ = repairs.wake.notified() => {}
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => return,
                }
                continue;
            }
        };
        let started = Instant::now();
        let moved = tokio::select! {
            moved = repair(&state, &key) => moved,
            _ = stop.cancelled() => return,
        };
        // Pace to the rate: a block of `moved` bytes takes its share of a
        // second, whatever the fetch itself took.
        let share = Duration::from_secs_f64(moved as f64 / repairs.rate as f64);
        if let Some(rest) = share.checked_sub(started.elapsed()) {
            tokio::select! {
                _ = tokio::time::sleep(rest) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}

/// Brings one block back to the copies it wants, not counting those on
/// draining daemons (they still serve as sources); returns the bytes moved.
async fn repair(state: &State, key: &BlockKey) -> u64 {
    let counts = &state.repairs.counts;
    let leaving = |d: u32| state.daemons.is_draining(d);
    let mut moved = 0;
    while let Some((location, want)) = state.index.short_of_copies(key, &leaving) {
        // A hot block's copies stay within each daemon's share for them.
        let size = u64::from(location.size);
        let hot = state.hot.is_hot(key);
        let allow = |daemon: u32, capacity: u64| {
            !hot || state.hot.has_room(&state.index, daemon, capacity, size)
        };
        let Some(target) = state.daemons.place_beside(size, &location.daemons, &allow) else {
            tracing::debug!(%key, want, have = location.daemons.len(), "no host can take another copy");
            bump(&counts.unplaceable);
            return moved;
        };
        // A copy that stays is the better source; a draining daemon's
        // copy is read when it is the only one.
        let source = location
            .daemons
            .iter()
            .find(|d| !leaving(*d))
            .or_else(|| location.daemons.first())
            .expect("a short block has a copy");
        let Some(from) = state.daemon_call_addr(source) else {
            bump(&counts.failed);
            return moved;
        };
        let req = FetchRequest {
            key: key.clone(),
            from,
            size: location.size,
            checksum: location.checksum,
        };
        let code = state
            .call_daemon(target, Opcode::Fetch, &req, FETCH_TIMEOUT)
            .await;
        if code != ErrorCode::Ok {
            tracing::warn!(%key, source, target, %code, "a lost copy could not be made again");
            bump(&counts.failed);
            return moved;
        }
        moved += u64::from(location.size);
        if state
            .index
            .add_copy(key, (target, location.size, location.checksum), &leaving)
        {
            bump(&counts.made);
        } else {
            // Removed, replaced or repaired meanwhile: the copy goes (owed
            // until the daemon confirms, so that it cannot come back with
            // the daemon's next inventory).
            state.remove_on_daemon(target, key.clone()).await;
            return moved;
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(i: u8) -> BlockKey {
        BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]))
    }

    #[test]
    fn keys_wait_to_settle_and_the_queue_is_bounded() {
        let r = Repairs::new(2, 1 << 20);
        let t = Instant::now();
        assert_eq!(
            r.add(vec![key(1), key(2), key(3)], t),
            1,
            "one over the cap"
        );
        assert_eq!(r.len(), 2);
        assert_eq!(r.next(t), Err(Some(SETTLE)), "not settled yet");
        assert_eq!(r.next(t + SETTLE), Ok(key(1)));
        assert_eq!(r.next(t + SETTLE), Ok(key(2)));
        assert_eq!(r.next(t + SETTLE), Err(None));
        let off = Repairs::new(2, 0);
        assert_eq!(off.add(vec![key(1)], t), 0);
        assert_eq!(off.len(), 0, "repair off: nothing queued");
    }
}
