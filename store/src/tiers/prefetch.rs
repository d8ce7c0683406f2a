//! Blocks a lease found only on the NVMe drives, brought back to DRAM
//! before their reader comes. A lease says a read follows (vLLM's
//! scheduler looks a request's blocks up, and its worker loads them a
//! scheduler step or more later): a block found on a drive is read from
//! it in that gap, put back in DRAM and held there for the rest of its
//! lease, so that the load is a DRAM hit (through shared memory on the
//! same host) instead of a drive read, and no eviction of the drive takes
//! it meanwhile.
//!
//! Bounded: at most `MAX_QUEUED` blocks wait (more are not brought, and
//! counted), `READS_IN_FLIGHT` drive reads at once, and a block comes back
//! only where the demotion queue has room for what its place in DRAM
//! evicts (as for a put, waiting `ROOM_WAIT` at most). A daemon set never
//! to promote (`promote_after = 0`) brings nothing back either.
//!
//! A get that comes before its block is back reads the drive once with
//! the lease: it waits for a read under way (`JOIN_WAIT` at most), or does
//! one not begun yet itself, bringing the block back as the lease asked.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use mooncake_proto::BlockKey;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Tiers;

/// Blocks waiting to be brought back, at most.
const MAX_QUEUED: usize = 4096;
/// Drive reads for leases in flight at once.
const READS_IN_FLIGHT: usize = 8;
/// Longest a block brought back waits for the demotion queue to have room
/// for what its place in DRAM evicts.
const ROOM_WAIT: Duration = Duration::from_secs(1);
/// Longest a get of a block being brought back waits for that read, rather
/// than read the drive itself (a read of a few MiB takes milliseconds).
pub(super) const JOIN_WAIT: Duration = Duration::from_millis(50);

/// Blocks to bring back to DRAM, each with the end of its lease, and those
/// being read now: a block is read once however often it is leased
/// meanwhile (vLLM looks a waiting request up again at every step).
#[derive(Default)]
pub(super) struct Queue {
    state: Mutex<State>,
    wake: Notify,
    /// Told each time a read is done, for gets waiting on one (`joined`).
    read_done: Notify,
}

#[derive(Default)]
struct State {
    waiting: HashMap<BlockKey, Instant>,
    reading: HashMap<BlockKey, Instant>,
}

impl Queue {
    /// Asks for `key` to come back to DRAM and be held until `until`;
    /// `false` where the queue is full. A key already waiting keeps the
    /// later of its two deadlines.
    fn push(&self, key: &BlockKey, until: Instant) -> bool {
        let mut state = self.state.lock();
        if let Some(due) = state.waiting.get_mut(key) {
            *due = (*due).max(until);
            return true;
        }
        if state.waiting.len() >= MAX_QUEUED {
            return false;
        }
        state.waiting.insert(key.clone(), until);
        drop(state);
        self.wake.notify_one();
        true
    }

    /// Up to `n` waiting blocks that are not being read, taken off the
    /// queue and marked read until `done`.
    fn take(&self, n: usize) -> Vec<(BlockKey, Instant)> {
        let mut state = self.state.lock();
        let State { waiting, reading } = &mut *state;
        let keys: Vec<BlockKey> = waiting
            .keys()
            .filter(|k| !reading.contains_key(*k))
            .take(n)
            .cloned()
            .collect();
        keys.into_iter()
            .filter_map(|k| {
                let (k, until) = waiting.remove_entry(&k)?;
                reading.insert(k.clone(), until);
                Some((k, until))
            })
            .collect()
    }

    /// Takes `key` off the waiting blocks, to be read now by the caller
    /// (marked read until `done`); its lease's deadline, or `None` if it
    /// was not waiting (or is being read already).
    fn take_key(&self, key: &BlockKey) -> Option<Instant> {
        let mut state = self.state.lock();
        if state.reading.contains_key(key) {
            return None;
        }
        let (key, until) = state.waiting.remove_entry(key)?;
        state.reading.insert(key, until);
        Some(until)
    }

    /// `key` was read (and brought back, or not).
    fn done(&self, key: &BlockKey) {
        self.state.lock().reading.remove(key);
        self.read_done.notify_waiters();
    }

    /// Waits, at most `within`, for a read of `key` under way to be done;
    /// `false` if none is under way, or it was not done in time.
    async fn joined(&self, key: &BlockKey, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        if !self.state.lock().reading.contains_key(key) {
            return false;
        }
        loop {
            let done = self.read_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !self.state.lock().reading.contains_key(key) {
                return true;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return false;
            }
        }
    }
}

impl Tiers {
    /// A lease found `key` on a drive (or on its way there): bring it back
    /// to DRAM and hold it until `until`, in the background.
    pub(super) fn prefetch(&self, key: &BlockKey, until: Instant) {
        let Some(queue) = &self.prefetch else {
            return;
        };
        if !queue.push(key, until) {
            self.prefetch_skipped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A get missed `key` in DRAM where a lease asked for it to come back
    /// from a drive: a read under way is waited for (at most `JOIN_WAIT`),
    /// and one not begun yet is done now, for this get, rather than the
    /// drive being read twice. Whether it was done: the block is then
    /// back in DRAM and held, unless DRAM had no room for it.
    pub async fn join_prefetch(&self, key: &BlockKey) -> bool {
        let Some(queue) = &self.prefetch else {
            return false;
        };
        if let Some(until) = queue.take_key(key) {
            // Done however this ends (a get's connection may go meanwhile).
            let _reading = Reading { queue, key };
            self.bring_back(key, until, JOIN_WAIT).await;
            return true;
        }
        queue.joined(key, JOIN_WAIT).await
    }

    /// Reads `key` from the drive (or the demotion queue), puts it back in
    /// DRAM and holds it there until `until` (where leases hold less than
    /// their share of DRAM: else it comes back unheld, newest in DRAM's
    /// order, as a put). Nothing where the lease has run out, the block
    /// is in DRAM already (then only held), no tier has it, or DRAM could
    /// not take it without dropping what it evicts.
    async fn bring_back(&self, key: &BlockKey, until: Instant, room_wait: Duration) {
        if until <= Instant::now() || self.dram.hold(key, until).is_ok() {
            return;
        }
        let drive = self.nvme.iter().find(|d| d.contains(key));
        let stored = drive
            .and_then(|d| d.record_of(key))
            .map(|(len, _)| u64::from(len));
        if let Some(len) = stored {
            if !self.demotion_room_within(len, room_wait).await {
                // Not read at all while writes keep the drives busy: vLLM
                // looks a waiting request up again at every step, and each
                // lookup would read its blocks again for nothing.
                self.prefetch_skipped.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let lower = match self.dram.get_demoting(key) {
            Some((bytes, sum)) => Some((bytes.to_vec(), sum)),
            None => match drive {
                Some(drive) => super::read_drive(drive, key).await,
                None => None,
            },
        };
        let Some((bytes, sum)) = lower else {
            return;
        };
        let len = bytes.len() as u64;
        // As a put: what its place in DRAM evicts must have room to go to
        // the drives (waiting a little for the demotion queue).
        let _gate = self.room_to_demote(len, room_wait).await;
        let no_room = self.dram.would_evict(len) && !self.dram.has_demotion_room(len);
        if self.dram.contains(key) || no_room {
            // Put again meanwhile (that copy is the current one), or no
            // room: read where it lies.
            let _ = self.dram.hold(key, until);
            self.prefetch_skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self.promote(key, &bytes, sum) {
            self.prefetched.fetch_add(1, Ordering::Relaxed);
            let _ = self.dram.hold(key, until);
        }
    }

    /// Whether a block of `len` bytes can come into DRAM without dropping
    /// what it evicts (the demotion queue has room for it), waiting at
    /// most `within` for that.
    async fn demotion_room_within(&self, len: u64, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while self.dram.would_evict(len) && !self.dram.has_demotion_room(len) {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        true
    }

    /// Blocks brought back to DRAM for a lease, and those a lease found on
    /// a drive that were not (the queue full, or DRAM without room).
    pub fn prefetches(&self) -> (u64, u64) {
        (
            self.prefetched.load(Ordering::Relaxed),
            self.prefetch_skipped.load(Ordering::Relaxed),
        )
    }
}

/// A read a get took off the queue: marked done when it ends.
struct Reading<'a> {
    queue: &'a Queue,
    key: &'a BlockKey,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.queue.done(self.key);
    }
}

/// Brings back what leases found on the drives, a few reads at a time,
/// until `shutdown`.
pub(super) async fn run(tiers: Arc<Tiers>, shutdown: CancellationToken) {
    let Some(queue) = tiers.prefetch.as_ref() else {
        return;
    };
    let mut reads = FuturesUnordered::new();
    loop {
        for (key, until) in queue.take(READS_IN_FLIGHT - reads.len()) {
            let tiers = tiers.clone();
            reads.push(async move {
                tiers.bring_back(&key, until, ROOM_WAIT).await;
                key
            });
        }
        tokio::select! {
            Some(key) = reads.next(), if !reads.is_empty() => queue.done(&key),
            _ = queue.wake.notified(), if reads.len() < READS_IN_FLIGHT => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, Namespace};

    fn key(i: u32) -> BlockKey {
        BlockKey::new(
            Namespace::new("t").unwrap(),
            BlockHash::from_opaque(&i.to_le_bytes()),
        )
    }

    #[test]
    fn the_queue_keeps_each_key_once_with_its_latest_deadline_and_refuses_past_its_bound() {
        let q = Queue::default();
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(5);
        assert!(q.push(&key(1), now));
        assert!(q.push(&key(1), later));
        assert!(q.push(&key(1), now), "an earlier deadline changes nothing");
        assert_eq!(q.take(10), vec![(key(1), later)]);
        assert!(q.take(10).is_empty(), "taken off the queue");
        for i in 0..MAX_QUEUED as u32 {
            assert!(q.push(&key(i), now));
        }
        assert!(!q.push(&key(u32::MAX), now), "full");
        assert!(q.push(&key(0), later), "a key waiting already is no more");
        assert_eq!(q.take(3).len(), 3);
        assert!(q.push(&key(u32::MAX), now), "room again");
    }

    #[test]
    fn a_block_being_read_is_not_taken_again_until_its_read_is_done() {
        let q = Queue::default();
        let now = Instant::now();
        assert!(q.push(&key(1), now));
        assert_eq!(q.take(8), vec![(key(1), now)]);
        // Leased again while it is read: it waits, not read twice at once.
        assert!(q.push(&key(1), now));
        assert!(q.push(&key(2), now));
        assert_eq!(q.take(8), vec![(key(2), now)]);
        q.done(&key(1));
        assert_eq!(q.take(8), vec![(key(1), now)]);
    }

    #[tokio::test]
    async fn a_get_joins_a_read_under_way_and_waits_no_longer_than_asked() {
        let q = std::sync::Arc::new(Queue::default());
        let (now, long) = (Instant::now(), Duration::from_secs(60));
        assert!(!q.joined(&key(1), long).await, "no read under way");
        assert!(q.push(&key(1), now + long));
        assert!(!q.joined(&key(1), long).await, "waiting, not read yet");
        assert_eq!(q.take(8).len(), 1);
        let (q2, k) = (q.clone(), key(1));
        let join = tokio::spawn(async move { q2.joined(&k, long).await });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        q.done(&key(2));
        q.done(&key(1));
        assert!(join.await.unwrap(), "the read was done");
        // A read that does not end: the get gives up after its wait.
        assert!(q.push(&key(3), now + long));
        assert_eq!(q.take(8).len(), 1);
        assert!(!q.joined(&key(3), Duration::from_millis(5)).await);
        // Not read yet: a get takes it off the queue and reads it itself.
        assert!(q.push(&key(4), now + long));
        assert_eq!(q.take_key(&key(4)), Some(now + long));
        assert!(q.take(8).is_empty(), "taken by the get");
        assert_eq!(q.take_key(&key(4)), None, "being read");
        q.done(&key(4));
    }
}
