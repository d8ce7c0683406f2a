//! The daemon's Prometheus metrics, built once with every label handle
//! resolved up front, so that the hot path only bumps atomics. Requests and
//! connections are counted by the server skeleton (`mooncake-server`);
//! pool gauges are read from the pool at scrape time.

use std::sync::Arc;

use mooncake_proto::Opcode;
use mooncake_server::{MetricsSpec, ServerMetrics};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    exponential_buckets, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::tiers::Tiers;

/// Every opcode a daemon serves.
pub(crate) const OPS: &[Opcode] = &[
    Opcode::Put,
    Opcode::Get,
    Opcode::Remove,
    Opcode::Pin,
    Opcode::Unpin,
    Opcode::DaemonStats,
    Opcode::Ping,
    Opcode::Verify,
    Opcode::Evict,
    Opcode::Fetch,
    Opcode::Hold,
    Opcode::RemoveUnleased,
    Opcode::LeaseOf,
];

pub struct DaemonMetrics {
    /// Requests and connections, as every server counts them.
    pub server: Arc<ServerMetrics>,
    pub bytes_read: IntCounter,
    pub bytes_written: IntCounter,
    /// Open sessions of clients that move block bytes themselves, each
    /// holding its leases: same-host shared memory and RDMA.
    pub shm_sessions: IntGauge,
    pub rdma_sessions: IntGauge,
    /// Same-host blocks this daemon asked the meta service to make visible
    /// (`crate::admit`), by outcome.
    pub admissions: IntCounterVec,
}

/// Latency buckets from 50 us to about 6.5 s.
pub fn latency_buckets() -> Vec<f64> {
    exponential_buckets(0.000_05, 2.0, 18).expect("valid buckets")
}

impl DaemonMetrics {
    /// Registers the daemon's metrics (its pool's, and its drives' I/O
    /// times) in `registry`.
    pub fn new(
        registry: &Registry,
        tiers: Arc<Tiers>,
        io_times: &crate::io::IoTimes,
    ) -> prometheus::Result<Arc<Self>> {
        let server = ServerMetrics::new(
            registry,
            MetricsSpec {
                prefix: "mooncake_daemon",
                ops: OPS,
                timed: &[Opcode::Get, Opcode::Put],
                buckets: latency_buckets(),
            },
        )?;
        let bytes = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_bytes_total",
                "Block bytes moved, by direction, tier and transport.",
            ),
            &["direction", "tier", "transport"],
        )?;
        registry.register(Box::new(bytes.clone()))?;
        let sessions = IntGaugeVec::new(
            Opts::new(
                "mooncake_daemon_lease_sessions",
                "Open sessions of clients that move block bytes themselves (same-host shared memory, RDMA), by path.",
            ),
            &["path"],
        )?;
        registry.register(Box::new(sessions.clone()))?;
        let admissions = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_admissions_total",
                "Same-host puts of one round trip: blocks this daemon asked the meta service to make visible, by outcome (admitted; exists: the meta service has it; refused: put the usual way; lost: the answer lost, the block dropped and reported gone).",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(admissions.clone()))?;
        registry.register(Box::new(PoolCollector::new(tiers)?))?;
        registry.register(Box::new(io_times.collector()))?;
        Ok(Arc::new(DaemonMetrics {
            server: Arc::new(server),
            bytes_read: bytes.with_label_values(&["read", "dram", "tcp"]),
            bytes_written: bytes.with_label_values(&["written", "dram", "tcp"]),
            shm_sessions: sessions.with_label_values(&["shm"]),
            rdma_sessions: sessions.with_label_values(&["rdma"]),
            admissions,
        }))
    }
}

/// Pool capacity and use, read from the pool when Prometheus scrapes.
/// It holds the tiers weakly: a registry that outlives the daemon (an
/// admin endpoint still answering while the daemon stops) must not keep
/// its tiers open, which a stopping daemon waits for (the NVMe index is
/// flushed and unlocked when the last holder lets go).
struct PoolCollector {
    tiers: std::sync::Weak<Tiers>,
    capacity: IntGaugeVec,
    used: IntGaugeVec,
    free: IntGaugeVec,
    blocks: IntGaugeVec,
    pinned: IntGaugeVec,
    held: IntGaugeVec,
    evictions: IntCounterVec,
    gets: IntCounterVec,
    moves: IntCounterVec,
    io_errors: IntCounterVec,
    drives_full: IntGauge,
    tenant_used: IntGaugeVec,
    tenant_quota: IntGaugeVec,
    quota_evictions: IntCounter,
    holds_refused: IntCounter,
    /// Blocks a lease found on a drive: brought back to DRAM, or not.
    prefetches: IntCounterVec,
    /// What 2Q did (`EvictionEvents`), by event.
    eviction_events: IntCounterVec,
    /// 2Q's probation: bytes held, and the most it holds now.
    probation: IntGaugeVec,
    /// The drives' 2Q (`DriveEvents`), by event, and their probation.
    nvme_events: IntCounterVec,
    nvme_probation: IntGaugeVec,
    unindexed: IntCounter,
    /// Bytes of the pool same-host writers hold as room for their next
    /// blocks (`pool::Room`).
    rooms: prometheus::IntGauge,
    corrupt: IntCounter,
    descs: Vec<Desc>,
}

impl PoolCollector {
    fn new(tiers: Arc<Tiers>) -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["tier"]);
        let capacity = gauge("mooncake_daemon_pool_capacity_bytes", "Pool size.")?;
        let used = gauge(
            "mooncake_daemon_pool_used_bytes",
            "Pool bytes allocated to blocks.",
        )?;
        let free = gauge("mooncake_daemon_pool_free_bytes", "Pool bytes free.")?;
        let blocks = gauge("mooncake_daemon_pool_blocks", "Blocks stored.")?;
        let pinned = gauge(
            "mooncake_daemon_pool_pinned_blocks",
            "Blocks pinned against eviction.",
        )?;
        let held = gauge(
            "mooncake_daemon_pool_held_blocks",
            "Blocks a client found and holds from eviction until it reads them (kv_lease_ttl).",
        )?;
        let evictions = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_evictions_total",
                "Blocks evicted to make room.",
            ),
            &["tier"],
        )?;
        let gets = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_gets_total",
                "Gets by result (hit or miss) and tier.",
            ),
            &["result", "tier"],
        )?;
        let corrupt = IntCounter::new(
            "mooncake_daemon_corrupt_blocks_total",
            "Blocks found corrupt (checksum mismatch) and dropped.",
        )?;
        let mut descs = Vec::new();
        for c in [&capacity, &used, &free, &blocks, &pinned, &held] {
            descs.extend(c.desc().into_iter().cloned());
        }
        descs.extend(evictions.desc().into_iter().cloned());
        descs.extend(gets.desc().into_iter().cloned());
        descs.extend(corrupt.desc().into_iter().cloned());
        let moves = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_tier_moves_total",
                "Blocks moved between tiers: demotions to NVMe, promotions to DRAM.",
            ),
            &["direction"],
        )?;
        descs.extend(moves.desc().into_iter().cloned());
        let io_errors = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_io_errors_total",
                "Failed reads and writes of a tier's device (a full disk included).",
            ),
            &["tier"],
        )?;
        descs.extend(io_errors.desc().into_iter().cloned());
        let drives_full = IntGauge::new(
            "mooncake_daemon_nvme_drives_full",
            "NVMe drives taking no new blocks because their index's filesystem is full.",
        )?;
        descs.extend(drives_full.desc().into_iter().cloned());
        let tenant_used = IntGaugeVec::new(
            Opts::new(
                "mooncake_daemon_tenant_used_bytes",
                "Bytes held by each tenant with a quota, by tier.",
            ),
            &["tenant", "tier"],
        )?;
        let tenant_quota = IntGaugeVec::new(
            Opts::new(
                "mooncake_daemon_tenant_quota_bytes",
                "Bytes each tenant with a quota may hold, by tier.",
            ),
            &["tenant", "tier"],
        )?;
        let quota_evictions = IntCounter::new(
            "mooncake_daemon_quota_evictions_total",
            "Blocks evicted because their tenant was over its DRAM share.",
        )?;
        for c in [&tenant_used, &tenant_quota] {
            descs.extend(c.desc().into_iter().cloned());
        }
        descs.extend(quota_evictions.desc().into_iter().cloned());
        let holds_refused = IntCounter::new(
            "mooncake_daemon_holds_refused_total",
            "Blocks a lookup found but could not hold from eviction: leases held half the DRAM pool, or half the block's drive.",
        )?;
        descs.extend(holds_refused.desc().into_iter().cloned());
        let prefetches = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_lease_prefetches_total",
                "Blocks a lease found only on the NVMe drives: brought back to DRAM \
                 for the reader, held there while leases have room (brought), or \
                 left on the drive: the queue full, or DRAM without room (skipped).",
            ),
            &["outcome"],
        )?;
        descs.extend(prefetches.desc().into_iter().cloned());
        let eviction_events = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_eviction_events_total",
                "What the 2q eviction order did in DRAM: new blocks put in probation \
                 (probation_admitted), evicted from it unread (probation_evicted), \
                 promoted to main when read again (promoted), stored again soon after \
                 their eviction (ghost_hit), admitted to main as a branch that comes \
                 back (branch_admitted), read after probation evicted it, growing \
                 probation (early_eviction_read).",
            ),
            &["event"],
        )?;
        descs.extend(eviction_events.desc().into_iter().cloned());
        let probation = IntGaugeVec::new(
            Opts::new(
                "mooncake_daemon_probation_bytes",
                "Under 2q: bytes of new blocks not read again yet (held), and the most \
                 probation holds before its own blocks go first (limit; grows past \
                 probation_share when readers come back for blocks it let go).",
            ),
            &["state"],
        )?;
        descs.extend(probation.desc().into_iter().cloned());
        let nvme_events = IntCounterVec::new(
            Opts::new(
                "mooncake_daemon_nvme_eviction_events_total",
                "What the 2q order of the NVMe drives did: blocks that left DRAM's \
                 probation unread put in the drives' probation (probation_admitted), \
                 probation blocks read from a drive and moved to its main part \
                 (promoted), blocks a drive dropped that came back, main at once \
                 (ghost_hit).",
            ),
            &["event"],
        )?;
        descs.extend(nvme_events.desc().into_iter().cloned());
        let nvme_probation = IntGaugeVec::new(
            Opts::new(
                "mooncake_daemon_nvme_probation_bytes",
                "Under 2q: bytes in the NVMe drives' probation (held), and the most it \
                 holds before its own blocks go first (limit: probation_share of each drive).",
            ),
            &["state"],
        )?;
        descs.extend(nvme_probation.desc().into_iter().cloned());
        let unindexed = IntCounter::new(
            "mooncake_daemon_shm_unindexed_blocks_total",
            "Blocks the same-host index had no room for (same-host clients lease those).",
        )?;
        descs.extend(unindexed.desc().into_iter().cloned());
        let rooms = prometheus::IntGauge::new(
            "mooncake_daemon_shm_room_bytes",
            "Pool bytes same-host writers hold as room for their next blocks \
             (counted as used; at most an eighth of the pool).",
        )?;
        descs.extend(rooms.desc().into_iter().cloned());
        Ok(PoolCollector {
            tenant_used,
            tenant_quota,
            quota_evictions,
            holds_refused,
            prefetches,
            eviction_events,
            probation,
            nvme_events,
            nvme_probation,
            unindexed,
            rooms,
            tiers: Arc::downgrade(&tiers),
            moves,
            io_errors,
            drives_full,
            capacity,
            used,
            free,
            blocks,
            pinned,
            held,
            evictions,
            gets,
            corrupt,
            descs,
        })
    }
}

impl Collector for PoolCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(tiers) = self.tiers.upgrade() else {
            // Stopped: nothing of the pool to report any more.
            return Vec::new();
        };
        let tiers = &tiers;
        let pool = &tiers.dram;
        let st = pool.stats();
        let t = ["dram"];
        self.capacity.with_label_values(&t).set(st.capacity as i64);
        self.used.with_label_values(&t).set(st.used as i64);
        self.free
            .with_label_values(&t)
            .set(st.capacity.saturating_sub(st.used) as i64);
        self.blocks.with_label_values(&t).set(st.blocks as i64);
        self.pinned.with_label_values(&t).set(st.pinned as i64);
        self.held.with_label_values(&t).set(pool.held() as i64);
        let bump = |c: prometheus::IntCounter, now: u64| c.inc_by(now.saturating_sub(c.get()));
        bump(self.evictions.with_label_values(&t), st.evictions);
        // The pool counts gets the daemon served from any tier; NVMe counts
        // its own, so DRAM's are the difference.
        let (nvme_hits, nvme_misses) = tiers.nvme_gets();
        bump(
            self.gets.with_label_values(&["hit", "dram"]),
            st.hits.saturating_sub(nvme_hits),
        );
        bump(
            self.gets.with_label_values(&["miss", "dram"]),
            st.misses + nvme_hits,
        );
        bump(self.moves.with_label_values(&["demote"]), pool.demotions());
        bump(
            self.moves.with_label_values(&["promote"]),
            tiers.promotions(),
        );
        let mut corrupt = pool.corrupt_blocks();
        let mut holds_refused = pool.holds_refused();
        if let Some(nvme) = tiers.nvme_totals() {
            let n = ["nvme"];
            self.capacity
                .with_label_values(&n)
                .set(nvme.capacity as i64);
            self.used.with_label_values(&n).set(nvme.used as i64);
            self.free
                .with_label_values(&n)
                .set(nvme.capacity.saturating_sub(nvme.used) as i64);
            self.blocks.with_label_values(&n).set(nvme.blocks as i64);
            self.held.with_label_values(&n).set(nvme.holds.0 as i64);
            holds_refused += nvme.holds.1;
            bump(self.evictions.with_label_values(&n), nvme.evictions);
            bump(self.gets.with_label_values(&["hit", "nvme"]), nvme_hits);
            bump(self.gets.with_label_values(&["miss", "nvme"]), nvme_misses);
            bump(self.io_errors.with_label_values(&n), nvme.io_errors);
            self.drives_full.set(nvme.full as i64);
            corrupt += nvme.corrupt;
            for (event, n) in [
                ("probation_admitted", nvme.events.probation_admitted),
                ("promoted", nvme.events.promoted),
                ("ghost_hit", nvme.events.ghost_hits),
            ] {
                bump(self.nvme_events.with_label_values(&[event]), n);
            }
            let (held, limit) = nvme.probation;
            self.nvme_probation
                .with_label_values(&["held"])
                .set(held as i64);
            self.nvme_probation
                .with_label_values(&["limit"])
                .set(limit as i64);
        }
        self.corrupt
            .inc_by(corrupt.saturating_sub(self.corrupt.get()));
        for (tier, usage) in [
            ("dram", pool.tenant_usage()),
            ("nvme", tiers.nvme_tenant_usage()),
        ] {
            for (tenant, used, limit) in usage {
                self.tenant_used
                    .with_label_values(&[&tenant, tier])
                    .set(used as i64);
                self.tenant_quota
                    .with_label_values(&[&tenant, tier])
                    .set(limit as i64);
            }
        }
        bump(self.quota_evictions.clone(), pool.quota_evictions());
        bump(self.holds_refused.clone(), holds_refused);
        let (brought, skipped) = tiers.prefetches();
        bump(self.prefetches.with_label_values(&["brought"]), brought);
        bump(self.prefetches.with_label_values(&["skipped"]), skipped);
        let ev = pool.eviction_events();
        for (event, n) in [
            ("probation_admitted", ev.probation_admitted),
            ("probation_evicted", ev.probation_evicted),
            ("promoted", ev.promoted),
            ("ghost_hit", ev.ghost_hits),
            ("branch_admitted", ev.branch_admitted),
            ("early_eviction_read", ev.early_eviction_reads),
        ] {
            bump(self.eviction_events.with_label_values(&[event]), n);
        }
        let (held, limit) = pool.probation();
        self.probation.with_label_values(&["held"]).set(held as i64);
        self.probation
            .with_label_values(&["limit"])
            .set(limit as i64);
        bump(self.unindexed.clone(), pool.unindexed_blocks());
        self.rooms.set(pool.room_bytes() as i64);
        let mut out = Vec::new();
        for c in [
            &self.capacity,
            &self.used,
            &self.free,
            &self.blocks,
            &self.pinned,
            &self.held,
        ] {
            out.extend(c.collect());
        }
        out.extend(self.evictions.collect());
        out.extend(self.holds_refused.collect());
        if pool.eviction() == crate::pool::Eviction::TwoQ {
            out.extend(self.eviction_events.collect());
            out.extend(self.probation.collect());
        }
        out.extend(self.gets.collect());
        out.extend(self.moves.collect());
        if tiers.nvme_totals().is_some() {
            out.extend(self.io_errors.collect());
            out.extend(self.drives_full.collect());
            out.extend(self.prefetches.collect());
            if pool.eviction() == crate::pool::Eviction::TwoQ {
                out.extend(self.nvme_events.collect());
                out.extend(self.nvme_probation.collect());
            }
        }
        out.extend(self.corrupt.collect());
        if pool.shared_index().is_some() {
            out.extend(self.unindexed.collect());
            out.extend(self.rooms.collect());
        }
        if !pool.tenant_usage().is_empty() || !tiers.nvme_tenant_usage().is_empty() {
            out.extend(self.tenant_used.collect());
            out.extend(self.tenant_quota.collect());
            out.extend(self.quota_evictions.collect());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{DramPool, PoolConfig};
    use prometheus::Encoder;

    fn render(registry: &Registry) -> String {
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn metrics_render_with_pool_gauges_read_at_scrape() {
        let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
        let registry = Registry::new();
        // The daemon holds its tiers; the metrics only look at them.
        let tiers = Tiers::dram_only(pool);
        let m = DaemonMetrics::new(
            &registry,
            tiers.clone(),
            &crate::io::IoTimes::new(vec![1.0]).unwrap(),
        )
        .unwrap();
        m.server
            .record(Opcode::Get, mooncake_proto::ErrorCode::NotFound, 0.001);
        let acme = mooncake_proto::auth::Identity {
            name: "acme-workers".into(),
            role: mooncake_proto::auth::Role::Client,
            tenant: Some("acme".into()),
        };
        m.server.record_tenant(&acme, Opcode::Get);
        m.server
            .record_tenant(&mooncake_proto::auth::Identity::open(), Opcode::Get);
        let text = render(&registry);
        assert!(
            text.contains("mooncake_daemon_requests_total{code=\"not_found\",op=\"get\"} 1"),
            "{text}"
        );
        assert!(text.contains("mooncake_daemon_pool_capacity_bytes{tier=\"dram\"} 1048576"));
        assert!(
            text.contains("mooncake_daemon_tenant_requests_total{op=\"get\",tenant=\"acme\"} 1"),
            "{text}"
        );
        assert!(text.contains("mooncake_daemon_request_duration_seconds_bucket{op=\"get\""));
        // An LRU pool has no 2Q events to show.
        assert!(!text.contains("mooncake_daemon_eviction_events_total"));
        // Once the daemon has let go of its tiers, the pool is not reported.
        drop(tiers);
        let text = render(&registry);
        assert!(
            !text.contains("mooncake_daemon_pool_capacity_bytes"),
            "{text}"
        );
        assert!(text.contains("mooncake_daemon_requests_total"));
    }

    #[test]
    fn a_two_q_pool_reports_what_its_eviction_order_did() {
        let cfg = PoolConfig {
            eviction: crate::pool::Eviction::TwoQ,
            high_watermark: 1.0,
            ..PoolConfig::with_capacity(1 << 20)
        };
        let pool = Arc::new(DramPool::new(cfg).unwrap());
        // Eight 256 KiB blocks through a 1 MiB pool (room for four), the
        // first read once: it is promoted and stays, and the others pass
        // through probation.
        let value = vec![7u8; 256 << 10];
        let sum = mooncake_proto::checksum(&value);
        let key = |i: u8| {
            mooncake_proto::BlockKey::new(
                mooncake_proto::Namespace::new("m").unwrap(),
                mooncake_proto::BlockHash::from_opaque(&[i]),
            )
        };
        for i in 0..8 {
            let mut slot = pool.reserve(key(i), value.len() as u64, sum).unwrap();
            slot.buf_mut().copy_from_slice(&value);
            slot.commit().unwrap();
            if i == 0 {
                drop(pool.get(&key(0)));
            }
        }
        let registry = Registry::new();
        let tiers = Tiers::dram_only(pool);
        let _m = DaemonMetrics::new(
            &registry,
            tiers.clone(),
            &crate::io::IoTimes::new(vec![1.0]).unwrap(),
        )
        .unwrap();
        let text = render(&registry);
        for line in [
            "mooncake_daemon_eviction_events_total{event=\"probation_admitted\"} 8",
            "mooncake_daemon_eviction_events_total{event=\"promoted\"} 1",
            "mooncake_daemon_eviction_events_total{event=\"probation_evicted\"} 4",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(tiers.dram.contains(&key(0)), "the block read again stays");
    }
}
