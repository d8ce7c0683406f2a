//! The meta service's Prometheus metrics: requests and latency by
//! operation, prefix-match and lookup hit counts, and (read at scrape time
//! from the current term's state) the index size, daemons alive and role.
//! Built once per process and kept across leadership terms.

use std::sync::{Arc, Weak};

use mooncake_proto::message::ErrorCount;
use mooncake_proto::{ErrorCode, Opcode};
use parking_lot::RwLock;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, Opts, Registry,
};

use crate::server::State;

const OPS: [Opcode; 15] = [
    Opcode::Ping,
    Opcode::PutStart,
    Opcode::PutCommit,
    Opcode::Lookup,
    Opcode::MatchPrefix,
    Opcode::MetaRemove,
    Opcode::ClusterStat,
    Opcode::List,
    Opcode::MetaPin,
    Opcode::Register,
    Opcode::Heartbeat,
    Opcode::Events,
    Opcode::Inventory,
    Opcode::Leave,
    Opcode::Drain,
];
const CODES: usize = ErrorCode::COUNT;
/// Operations timed in a histogram.
const TIMED: [Opcode; 4] = [
    Opcode::PutStart,
    Opcode::PutCommit,
    Opcode::Lookup,
    Opcode::MatchPrefix,
];

pub struct MetaMetrics {
    requests: Vec<IntCounter>,
    latency: Vec<Histogram>,
    pub lookup_hits: IntCounter,
    pub lookup_misses: IntCounter,
    pub match_hits: IntCounter,
    pub match_misses: IntCounter,
    pub elections_won: IntCounter,
    term: Arc<RwLock<Option<Weak<State>>>>,
    tenant_requests: IntCounterVec,
    /// `OPS`' label values, made once (not per request).
    op_labels: Vec<String>,
}

fn op_label(op: Opcode) -> String {
    // "MatchPrefix" -> "match_prefix"
    let mut out = String::new();
    for (i, c) in op.name().chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

impl MetaMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Arc<Self>> {
        let requests = IntCounterVec::new(
            Opts::new(
                "mooncake_meta_requests_total",
                "Requests answered, by operation and status code.",
            ),
            &["op", "code"],
        )?;
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "mooncake_meta_request_duration_seconds",
                "Time to answer a request.",
            )
            .buckets(exponential_buckets(0.000_01, 2.0, 20)?),
            &["op"],
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
        let term = Arc::new(RwLock::new(None));
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(keys.clone()))?;
        registry.register(Box::new(elections.clone()))?;
        registry.register(Box::new(TermCollector::new(term.clone())?))?;
        let tenant_requests = IntCounterVec::new(
            Opts::new(
                "mooncake_meta_tenant_requests_total",
                "Requests answered for authenticated tenants, by tenant and operation.",
            ),
            &["tenant", "op"],
        )?;
        registry.register(Box::new(tenant_requests.clone()))?;
        let handles = OPS
            .iter()
            .flat_map(|op| {
                let requests = &requests;
                (0..CODES).map(move |c| {
                    let code = ErrorCode::from_u16(c as u16).map_or("unknown", ErrorCode::name);
                    requests.with_label_values(&[&op_label(*op), code])
                })
            })
            .collect();
        Ok(Arc::new(MetaMetrics {
            requests: handles,
            latency: TIMED
                .iter()
                .map(|op| latency.with_label_values(&[&op_label(*op)]))
                .collect(),
            lookup_hits: keys.with_label_values(&["lookup", "hit"]),
            lookup_misses: keys.with_label_values(&["lookup", "miss"]),
            match_hits: keys.with_label_values(&["match_prefix", "hit"]),
            match_misses: keys.with_label_values(&["match_prefix", "miss"]),
            elections_won: elections,
            term,
            tenant_requests,
            op_labels: OPS.iter().map(|op| op_label(*op)).collect(),
        }))
    }

    /// Counts one request of a tenant's client (none without a tenant).
    pub fn record_tenant(&self, who: &mooncake_proto::auth::Identity, op: Opcode) {
        let (Some(tenant), Some(i)) = (&who.tenant, OPS.iter().position(|o| *o == op)) else {
            return;
        };
        self.tenant_requests
            .with_label_values(&[&**tenant, &self.op_labels[i]])
            .inc();
    }

    pub fn record(&self, op: Opcode, code: ErrorCode, seconds: f64) {
        if let Some(i) = OPS.iter().position(|o| *o == op) {
            self.requests[i * CODES + (code as usize).min(CODES - 1)].inc();
        }
        if let Some(i) = TIMED.iter().position(|o| *o == op) {
            self.latency[i].observe(seconds);
        }
    }

    /// The most frequent error answers (not misses, which are normal).
    pub fn top_errors(&self, n: usize) -> Vec<ErrorCount> {
        let mut errors: Vec<ErrorCount> = OPS
            .iter()
            .enumerate()
            .flat_map(|(i, op)| (0..CODES).map(move |c| (i, *op, c)))
            .filter(|(_, _, c)| {
                !matches!(
                    ErrorCode::from_u16(*c as u16),
                    Some(ErrorCode::Ok | ErrorCode::NotFound | ErrorCode::AlreadyExists)
                )
            })
            .filter_map(|(i, op, c)| {
                let count = self.requests[i * CODES + c].get();
                (count > 0).then(|| ErrorCount {
                    op: op_label(op),
                    code: ErrorCode::from_u16(c as u16)
                        .map_or("unknown", ErrorCode::name)
                        .to_string(),
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
        let gauges = [
            &leader, &revision, &blocks, &bytes, &pending, &alive, &dead, &owed, &given_up,
        ];
        let descs = gauges
            .iter()
            .flat_map(|g| g.desc().into_iter().cloned())
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
                ] {
                    g.set(0);
                }
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
        ]
        .iter()
        .flat_map(|g| g.collect())
        .collect()
    }
}
