//! The meta service's housekeeping: daemons that fall silent leave the
//! index, blocks left short of copies are repaired, hot blocks that cooled
//! drop their extra copies, and abandoned puts are reclaimed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_proto::{BlockKey, ErrorCode, Opcode};
use tokio_util::sync::CancellationToken;

use super::State;

const REAPER_PERIOD: Duration = Duration::from_millis(200);

impl State {
    /// Counts what a daemon's leaving cost and queues the blocks it left
    /// short of copies for repair.
    pub(super) fn lost(&self, gone: crate::index::Gone, now: Instant) {
        self.repairs
            .counts
            .lost
            .fetch_add(gone.blocks as u64, std::sync::atomic::Ordering::Relaxed);
        self.repair(gone.short, now);
    }

    /// Restores wanted copies (once due): blocks a rebuilt index holds
    /// with fewer copies than their namespace wants are repaired.
    pub(super) fn restore_wants_if_due(&self, now: Instant) {
        {
            let mut at = self.restore_wants_at.lock();
            if !at.is_some_and(|at| now >= at) {
                return;
            }
            *at = None;
        }
        let replicas = &self.replicas;
        let short = self
            .index
            .restore_wants(&|ns| crate::config::replicas_in(replicas, ns.as_str()));
        if !short.is_empty() {
            tracing::info!(
                blocks = short.len(),
                "blocks short of their namespace's copies after inventories; repairing"
            );
        }
        self.repair(short, now);
    }

    /// A daemon registered: its inventory follows, and its blocks get their
    /// wanted copies back a daemon TTL later (a restore already due waits
    /// for it too).
    pub(super) fn restore_wants_later(&self, now: Instant) {
        let later = now + self.daemon_ttl;
        let mut at = self.restore_wants_at.lock();
        *at = Some(at.map_or(later, |a| a.max(later)));
    }

    /// Queues blocks left short of copies for repair.
    pub(super) fn repair(&self, short: Vec<BlockKey>, now: Instant) {
        let dropped = self.repairs.add(short, now);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "the repair queue is full: blocks left short of copies"
            );
        }
    }

    /// Sends a daemon the removals it owes, in the background, one resend
    /// per daemon at a time.
    pub(super) fn resend_owed(self: &Arc<Self>, daemon: u32) {
        let Some(keys) = self.owed.start_resend(daemon) else {
            return;
        };
        let state = self.clone();
        tokio::spawn(async move {
            for key in keys {
                // Settled meanwhile by a put of the key there, whose copy
                // this removal would now take; while it is on its way, no
                // put there settles it (`OwedRemovals::settle_for_put`).
                if !state.owed.take_to_send(daemon, &key) {
                    continue;
                }
                let said = state.remove_on_daemon(daemon, key.clone()).await;
                state.owed.send_done(daemon, &key);
                if said != ErrorCode::Ok {
                    break;
                }
            }
            state.owed.sent(daemon);
        });
    }
}

/// Drops dead daemons' blocks from the index and reclaims abandoned puts.
pub async fn reaper(state: Arc<State>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(REAPER_PERIOD);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let now = Instant::now();
        state.restore_wants_if_due(now);
        for daemon in state.daemons.expire(state.daemon_ttl, now) {
            let gone = state.index.remove_daemon(daemon);
            state.misses.forget(daemon);
            tracing::warn!(
                daemon,
                copies = gone.copies,
                lost = gone.blocks,
                short = gone.short.len(),
                "daemon silent past its ttl: declared dead"
            );
            state.lost(gone, now);
        }
        // Hot blocks that cooled drop the copies they were given.
        let cooled = state.hot.cool(&state.index, now);
        if !cooled.is_empty() {
            tracing::info!(
                blocks = cooled.len(),
                "hot blocks cooled: their extra copies go"
            );
            let state = state.clone();
            tokio::spawn(async move {
                for (key, extra) in cooled {
                    for d in extra.iter() {
                        state.remove_on_daemon(d, key.clone()).await;
                    }
                }
            });
        }
        let Some(deadline) = now.checked_sub(state.put_timeout) else {
            continue;
        };
        let expired = state.index.expire_pending(deadline);
        // Names whose last entry went (removed, expired, evicted) go too.
        let freed = state.index.sweep_namespaces();
        if freed > 0 {
            tracing::debug!(freed, "namespaces no longer used were freed");
        }
        if !expired.is_empty() {
            tracing::info!(count = expired.len(), "abandoned puts reclaimed");
            let state = state.clone();
            tokio::spawn(async move {
                for (key, copies) in expired {
                    // The bytes may never have arrived: NotFound is fine.
                    for daemon in copies.iter() {
                        state.tell_daemon(daemon, Opcode::Remove, key.clone()).await;
                    }
                }
            });
        }
    }
}
