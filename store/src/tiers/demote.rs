//! The background task that writes blocks evicted from DRAM to the NVMe
//! drives (demotion): a few writes in flight per drive, each block to the
//! least full drive; a block that cannot be written, or that a drive
//! evicts and DRAM does not hold, is reported gone.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use mooncake_proto::BlockKey;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Tiers, WRITES_PER_DRIVE};
use crate::nvme::TierError;
use crate::pool::Demoted;

impl Tiers {
    /// The drive for a new block: the least full, counting writes in
    /// flight; ties go to the drive the key hashes to, so that full drives
    /// share the churn.
    fn pick_drive(&self, key: &BlockKey, in_flight: &[u64]) -> usize {
        let n = self.nvme.len();
        let start = key.hash.0[0] as usize % n;
        let fill = |i: usize| {
            let d = &self.nvme[i];
            (d.used() + in_flight[i]) as f64 / d.capacity().max(1) as f64
        };
        (0..n)
            .map(|k| (start + k) % n)
            .fold(start, |best, i| if fill(i) < fill(best) { i } else { best })
    }
}

/// Writes demoted blocks to NVMe, a few at a time per drive; a block that
/// cannot be written, or that a drive evicts and DRAM does not hold, is
/// reported gone.
pub(super) async fn demoter(
    tiers: Arc<Tiers>,
    mut rx: mpsc::Receiver<Demoted>,
    shutdown: CancellationToken,
) {
    let max_in_flight = tiers.nvme.len() * WRITES_PER_DRIVE;
    let mut in_flight_bytes = vec![0u64; tiers.nvme.len()];
    let mut writes = FuturesUnordered::new();
    let mut open = true;
    while open || !writes.is_empty() {
        // Blocks evicted while the queue was full leave the daemon only if
        // no tier holds them.
        for key in tiers.dram.take_overflow() {
            if !tiers.contains(&key) {
                tiers.dram.report_removed(key);
            }
        }
        tokio::select! {
            d = rx.recv(), if open && writes.len() < max_in_flight => match d {
                Some(demoted) => {
                    if !tiers.dram.demotion_current(&demoted) {
                        // Removed on its way, or evicted again since (that
                        // later demotion is the one written).
                        tiers.dram.demotion_done(&demoted);
                        continue;
                    }
                    if tiers.on_nvme(&demoted.key) {
                        // Promoted earlier, still on its drive.
                        tiers.dram.demotion_done(&demoted);
                        tiers.note_moved(demoted.key);
                        continue;
                    }
                    let i = tiers.pick_drive(&demoted.key, &in_flight_bytes);
                    in_flight_bytes[i] += demoted.bytes.len() as u64;
                    let drive = tiers.nvme[i].clone();
                    let tag = tiers.tag_of(&demoted.key);
                    let hot = demoted.main || tiers.dram.read_on_its_way(&demoted);
                    writes.push(async move {
                        let written = drive
                            .put(
                                &demoted.key,
                                &demoted.bytes,
                                demoted.checksum,
                                (demoted.parent, tag.as_ref(), hot),
                            )
                            .await;
                        (i, demoted, written)
                    });
                }
                None => open = false,
            },
            Some((i, demoted, written)) = writes.next() => {
                let len = demoted.bytes.len() as u64;
                in_flight_bytes[i] -= len;
                let current = tiers.dram.demotion_current(&demoted);
                // A lease taken on its way holds it on the drive now.
                let lease = tiers.dram.lease_on_its_way(&demoted);
                if let (true, Ok(_), Some(until)) = (current, &written, lease) {
                    // Past the leases' share of the drive, not held from
                    // its eviction (a removal not forced is refused still).
                    let _held = tiers.nvme[i].hold(&demoted.key, until);
                }
                tiers.dram.demotion_done(&demoted);
                match written {
                    Ok(evicted) => {
                        if !current {
                            // Removed (or evicted again) after it was taken
                            // for writing, before its write began.
                            let key = &demoted.key;
                            tiers.drop_written(&tiers.nvme[i], key, demoted.checksum);
                            if !tiers.contains(key) && !tiers.dram.is_demoting(key) {
                                tiers.dram.report_removed(key.clone());
                            }
                        }
                        tiers.note_moved(demoted.key);
                        for key in evicted {
                            if !tiers.contains(&key) {
                                tiers.dram.report_removed(key);
                            }
                        }
                    }
                    // Removed, or written again, while being written:
                    // nothing of it is left, and nothing to report.
                    Err(TierError::Cancelled) => {}
                    Err(err) => {
                        if matches!(err, TierError::IndexFull) {
                            // Logged once, when the drive filled.
                            tracing::debug!(key = %demoted.key, %err, "demotion refused; block dropped");
                        } else {
                            tracing::warn!(key = %demoted.key, %err, "demotion to NVMe failed; block dropped");
                        }
                        if !tiers.contains(&demoted.key) {
                            tiers.dram.report_removed(demoted.key);
                        }
                    }
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
