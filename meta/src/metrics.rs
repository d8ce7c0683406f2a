//! The meta service's Prometheus metrics: requests and latency by
//! operation, prefix-match and lookup hit counts, and (read at scrape time
//! from the current term's state) the index size, daemons alive and role.
//! Built once per process and kept across leadership terms.

use std::sync::{Arc, Weak};

use mooncake_proto::message::ErrorCount;
use mooncake_proto::{ErrorCode, Opcode};
use mooncake_server::metrics::op_label;
use mooncake_server::{MetricsSpec, ServerMetrics};
use parking_lot::RwLock;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    exponential_buckets, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::server::State;

/// Every opcode the meta service answers.
const OPS: &[Opcode] = &[
    Opcode::Ping,
    Opcode::PutStart,
    Opcode::PutCommit,
    Opcode::Admit,
    Opcode::Lookup,
    Opcode::MatchPrefix,
    Opcode::MetaRemove,
    Opcode::MetaRemoveUnleased,
    Opcode::ClusterStat,
    Opcode::List,
    Opcode::MetaPin,
    Opcode::Register,
    Opcode::Heartbeat,
    Opcode::Events,
    Opcode::Inventory,
    Opcode::Leave,
    Opcode::Drain,
    Opcode::Route,
];
const CODES: usize = ErrorCode::COUNT;
/// Operations timed in a histogram.
const TIMED: &[Opcode] = &[
    Opcode::PutStart,
    Opcode::PutCommit,
    Opcode::Admit,
    Opcode::Lookup,
    Opcode::MatchPrefix,
];

pub struct MetaMetrics {
    /// Requests and connections, as every server counts them.
    pub server: Arc<ServerMetrics>,
    pub lookup_hits: IntCounter,
    pub lookup_misses: IntCounter,
    pub match_hits: IntCounter,
    pub match_misses: IntCounter,
    pub elections_won: IntCounter,
    /// The store events' counters.
    pub events: crate::events::EventCounters,
    term: Arc<RwLock<Option<Weak<State>>>>,
}

impl MetaMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Arc<Self>> {
        let server = ServerMetrics::new(
            registry,
            MetricsSpec {
                prefix: "mooncake_meta",
                ops: OPS,
                timed: TIMED,
                buckets: exponential_buckets(0.000_01, 2.0, 20)?,
            },
        )?;
        let keys = IntCounterVec::new(
            Opts::new(
                "mooncake_meta_keys_total",
                "Keys asked about, by operation and result (hit or miss).",
            ),
            &["op", "result"],
        )?;
        let elections = IntCounter::new(
            "mooncake_meta_elections_won_total",
            "Times this replica became the leader.",
        )?;
        let events = IntCounterVec::new(
            Opts::new(
                "mooncake_meta_events_total",
                "Store events: batches published, block changes dropped (queue full), \
                 resyncs of subscribers, replay requests answered.",
            ),
            &["what"],
        )?;
        let term = Arc::new(RwLock::new(None));
        registry.register(Box::new(keys.clone()))?;
        registry.register(Box::new(events.clone()))?;
        registry.register(Box::new(elections.clone()))?;
        registry.register(Box::new(TermCollector::new(term.clone())?))?;
        Ok(Arc::new(MetaMetrics {
            server: Arc::new(server),
            lookup_hits: keys.with_label_values(&["lookup", "hit"]),
            lookup_misses: keys.with_label_values(&["lookup", "miss"]),
            match_hits: keys.with_label_values(&["match_prefix", "hit"]),
            match_misses: keys.with_label_values(&["match_prefix", "miss"]),
            elections_won: elections,
            events: crate::events::EventCounters {
                batches: events.with_label_values(&["batches"]),
                dropped: events.with_label_values(&["dropped"]),
                resyncs: events.with_label_values(&["resyncs"]),
                replays: events.with_label_values(&["replays"]),
            },
            term,
        }))
    }

    /// The most frequent error answers (not misses, which are normal).
    pub fn top_errors(&self, n: usize) -> Vec<ErrorCount> {
        let mut errors: Vec<ErrorCount> = OPS
            .iter()
            .flat_map(|op| {
                (0..CODES).filter_map(move |c| Some((*op, ErrorCode::from_u16(c as u16)?)))
            })
            .filter(|(_, code)| {
                !matches!(
                    code,
                    ErrorCode::Ok | ErrorCode::NotFound | ErrorCode::AlreadyExists
                )
            })
            .filter_map(|(op, code)| {
                let count = self.server.answered(op, code);
                (count > 0).then(|| ErrorCount {
                    op: op_label(op),
                    code: code.name().to_string(),
                    count,
                })
            })
            .collect();
        errors.sort_by_key(|e| std::cmp::Reverse(e.count));
        errors.truncate(n);
        errors
    }

    /// The state of the term now being served (read at scrape time).
    pub(crate) fn set_term(&self, state: &Arc<State>) {
        *self.term.write() = Some(Arc::downgrade(state));
        self.elections_won.inc();
    }
}

/// Index size, daemons and role of the current term, read when scraped.
struct TermCollector {
    term: Arc<RwLock<Option<Weak<State>>>>,
    leader: IntGauge,
    revision: IntGauge,
    blocks: IntGauge,
    bytes: IntGauge,
    pending: IntGauge,
    alive: IntGauge,
    dead: IntGauge,
    owed: IntGauge,
    given_up: IntGauge,
    copies: IntGauge,
    repair_queue: IntGauge,
    hot: IntGauge,
    /// What repairs of lost copies did this term, by outcome.
    repairs: IntGaugeVec,
    descs: Vec<Desc>,
}

impl TermCollector {
    fn new(term: Arc<RwLock<Option<Weak<State>>>>) -> prometheus::Result<Self> {
        let leader = IntGauge::new(
            "mooncake_meta_leader",
            "1 while this replica leads, 0 while it stands by.",
        )?;
        let revision = IntGauge::new(
            "mooncake_meta_leader_revision",
            "Election revision of the current term.",
        )?;
        let blocks = IntGauge::new("mooncake_meta_index_blocks", "Visible blocks in the index.")?;
        let bytes = IntGauge::new(
            "mooncake_meta_index_bytes",
            "Bytes of the visible blocks in the index.",
        )?;
        let pending = IntGauge::new(
            "mooncake_meta_index_pending",
            "Puts reserved and not yet committed.",
        )?;
        let alive = IntGauge::new(
            "mooncake_meta_daemons_alive",
            "Daemons heard from within their TTL.",
        )?;
        let dead = IntGauge::new(
            "mooncake_meta_daemons_dead",
            "Daemons declared dead this term.",
        )?;
        let owed = IntGauge::new(
            "mooncake_meta_removals_owed",
            "Removals a daemon has not confirmed yet (sent again when it answers).",
        )?;
        let given_up = IntGauge::new(
            "mooncake_meta_removals_given_up",
            "Unconfirmed removals dropped this term because too many were owed.",
        )?;
        let copies = IntGauge::new(
            "mooncake_meta_index_copies",
            "Copies of the visible blocks (a block on three hosts counts three).",
        )?;
        let repair_queue = IntGauge::new(
            "mooncake_meta_repair_queue",
            "Blocks short of the copies they want, waiting for a new one.",
        )?;
        let hot = IntGauge::new(
            "mooncake_meta_hot_blocks",
            "Blocks read often enough to have been given more copies.",
        )?;
        let repairs = IntGaugeVec::new(
            Opts::new(
                "mooncake_meta_repairs",
                "Copies this term: made again (lost, or for a hot block), failed, unplaceable \
                 (no host to take one), dropped (the repair queue was full); blocks lost (their \
                 last copy gone with a daemon), turned hot, cooled (their extra copies dropped).",
            ),
            &["what"],
        )?;
        let gauges = [
            &leader,
            &revision,
            &blocks,
            &bytes,
            &pending,
            &alive,
            &dead,
            &owed,
            &given_up,
            &copies,
            &repair_queue,
            &hot,
        ];
        let descs = gauges
            .iter()
            .flat_map(|g| g.desc().into_iter().cloned())
            .chain(repairs.desc().into_iter().cloned())
            .collect();
        Ok(TermCollector {
            term,
            leader,
            revision,
            blocks,
            bytes,
            pending,
            alive,
            dead,
            owed,
            given_up,
            copies,
            repair_queue,
            hot,
            repairs,
            descs,
        })
    }
}

impl Collector for TermCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let state = self.term.read().as_ref().and_then(Weak::upgrade);
        match state.filter(|s| s.is_serving()) {
            Some(state) => {
                let st = state.index.stats();
                let daemons = state.daemons.infos();
                let alive = daemons.iter().filter(|d| d.alive).count();
                self.leader.set(1);
                self.revision.set(state.revision() as i64);
                self.blocks.set(st.visible as i64);
                self.bytes.set(st.bytes as i64);
                self.pending.set(st.pending as i64);
                self.alive.set(alive as i64);
                self.dead.set((daemons.len() - alive) as i64);
                let (owed, given_up) = state.owed_removals();
                self.owed.set(owed as i64);
                self.given_up.set(given_up as i64);
                self.copies.set(st.copies as i64);
                self.repair_queue.set(state.repairs.len() as i64);
                self.hot.set(state.hot.len() as i64);
                let counts = &state.repairs.counts;
                for (what, n) in [
                    ("made", &counts.made),
                    ("failed", &counts.failed),
                    ("unplaceable", &counts.unplaceable),
                    ("dropped", &counts.dropped),
                    ("lost", &counts.lost),
                    ("hot", &state.hot.heated),
                    ("cooled", &state.hot.cooled),
                ] {
                    let n = n.load(std::sync::atomic::Ordering::Relaxed);
                    self.repairs.with_label_values(&[what]).set(n as i64);
                }
            }
            None => {
                for g in [
                    &self.leader,
                    &self.blocks,
                    &self.bytes,
                    &self.pending,
                    &self.alive,
                    &self.dead,
                    &self.owed,
                    &self.given_up,
                    &self.copies,
                    &self.repair_queue,
                    &self.hot,
                ] {
                    g.set(0);
                }
                self.repairs.reset();
            }
        }
        [
            &self.leader,
            &self.revision,
            &self.blocks,
            &self.bytes,
            &self.pending,
            &self.alive,
            &self.dead,
            &self.owed,
            &self.given_up,
            &self.copies,
            &self.repair_queue,
            &self.hot,
        ]
        .iter()
        .flat_map(|g| g.collect())
        .chain(self.repairs.collect())
        .collect()
    }
}
