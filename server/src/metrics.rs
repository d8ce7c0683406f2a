//! What every server counts about its connections and requests, under its
//! own prefix (`mooncake_daemon_`, `mooncake_meta_`): requests answered by
//! operation and status code, their latency, requests per tenant, open
//! connections, requests in flight, and connections refused at a limit.
//! Every label handle is resolved up front, so that serving a request only
//! bumps atomics.

use mooncake_proto::auth::Identity;
use mooncake_proto::{ErrorCode, Opcode};
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

const CODES: usize = ErrorCode::COUNT;

/// Which requests a server counts, and how it times them.
#[derive(Debug, Clone)]
pub struct MetricsSpec {
    /// Metric name prefix, e.g. `mooncake_daemon`.
    pub prefix: &'static str,
    /// The operations the server answers (others are not counted).
    pub ops: &'static [Opcode],
    /// Those whose latency is recorded.
    pub timed: &'static [Opcode],
    /// Latency histogram buckets, in seconds.
    pub buckets: Vec<f64>,
}

pub struct ServerMetrics {
    spec: MetricsSpec,
    /// `ops.len() * CODES` counters, by operation then code.
    requests: Vec<IntCounter>,
    latency: Vec<Histogram>,
    tenant_requests: IntCounterVec,
    /// `ops`' label values, made once (not per request).
    op_labels: Vec<String>,
    pub connections: IntGauge,
    pub in_flight: IntGauge,
    pub refused_connections: IntCounter,
    pub failed_handshakes: IntCounter,
}

/// An opcode as a label: `MatchPrefix` -> `match_prefix`.
pub fn op_label(op: Opcode) -> String {
    let mut out = String::new();
    for (i, c) in op.name().chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

fn code_name(i: usize) -> &'static str {
    ErrorCode::from_u16(i as u16).map_or("unknown", ErrorCode::name)
}

impl ServerMetrics {
    /// Registers the request and connection metrics of `spec` in `registry`.
    pub fn new(registry: &Registry, spec: MetricsSpec) -> prometheus::Result<Self> {
        let p = spec.prefix;
        let requests = IntCounterVec::new(
            Opts::new(
                format!("{p}_requests_total"),
                "Requests answered, by operation and status code.",
            ),
            &["op", "code"],
        )?;
        let latency = HistogramVec::new(
            HistogramOpts::new(
                format!("{p}_request_duration_seconds"),
                "Time to serve a request, header to answer.",
            )
            .buckets(spec.buckets.clone()),
            &["op"],
        )?;
        let tenant_requests = IntCounterVec::new(
            Opts::new(
                format!("{p}_tenant_requests_total"),
                "Requests answered for authenticated tenants, by tenant and operation.",
            ),
            &["tenant", "op"],
        )?;
        let connections = IntGauge::new(format!("{p}_connections"), "Open client connections.")?;
        let in_flight = IntGauge::new(format!("{p}_requests_in_flight"), "Requests being served.")?;
        let refused = IntCounter::new(
            format!("{p}_refused_connections_total"),
            "Connections refused at max_connections or max_connections_per_client.",
        )?;
        let failed_handshakes = IntCounter::new(
            format!("{p}_failed_handshakes_total"),
            "TCP connections closed before serving: a TLS handshake that failed (an untrusted certificate, plain frames on a TLS port) or did not finish within auth_timeout.",
        )?;
        registry.register(Box::new(failed_handshakes.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(tenant_requests.clone()))?;
        registry.register(Box::new(connections.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(refused.clone()))?;
        let op_labels: Vec<String> = spec.ops.iter().map(|op| op_label(*op)).collect();
        let handles = op_labels
            .iter()
            .flat_map(|op| {
                let requests = &requests;
                (0..CODES).map(move |c| requests.with_label_values(&[op.as_str(), code_name(c)]))
            })
            .collect();
        Ok(ServerMetrics {
            requests: handles,
            latency: spec
                .timed
                .iter()
                .map(|op| latency.with_label_values(&[&op_label(*op)]))
                .collect(),
            spec,
            tenant_requests,
            op_labels,
            connections,
            in_flight,
            refused_connections: refused,
            failed_handshakes,
        })
    }

    /// Counts one answered request, and its latency if `op` is timed.
    pub fn record(&self, op: Opcode, code: ErrorCode, seconds: f64) {
        if let Some(i) = self.spec.ops.iter().position(|o| *o == op) {
            self.requests[i * CODES + (code as usize).min(CODES - 1)].inc();
        }
        if let Some(i) = self.spec.timed.iter().position(|o| *o == op) {
            self.latency[i].observe(seconds);
        }
    }

    /// Counts one request of a tenant's client (none without a tenant).
    pub fn record_tenant(&self, who: &Identity, op: Opcode) {
        let (Some(tenant), Some(i)) = (&who.tenant, self.spec.ops.iter().position(|o| *o == op))
        else {
            return;
        };
        self.tenant_requests
            .with_label_values(&[&**tenant, &self.op_labels[i]])
            .inc();
    }

    /// Requests of `op` answered with `code` so far.
    pub fn answered(&self, op: Opcode, code: ErrorCode) -> u64 {
        self.spec.ops.iter().position(|o| *o == op).map_or(0, |i| {
            self.requests[i * CODES + (code as usize).min(CODES - 1)].get()
        })
    }

    /// The operations counted, in order.
    pub fn ops(&self) -> &'static [Opcode] {
        self.spec.ops
    }
}

/// A gauge held one higher while this lives (a panic included).
pub(crate) struct Counted<'a>(&'a IntGauge);

impl<'a> Counted<'a> {
    pub(crate) fn new(gauge: &'a IntGauge) -> Self {
        gauge.inc();
        Counted(gauge)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_labels_are_snake_case() {
        assert_eq!(op_label(Opcode::MatchPrefix), "match_prefix");
        assert_eq!(op_label(Opcode::DaemonStats), "daemon_stats");
        assert_eq!(op_label(Opcode::Get), "get");
    }

    #[test]
    fn requests_are_counted_by_op_and_code_and_tenant() {
        let registry = Registry::new();
        let metrics = ServerMetrics::new(
            &registry,
            MetricsSpec {
                prefix: "test",
                ops: &[Opcode::Get, Opcode::Put],
                timed: &[Opcode::Get],
                buckets: vec![0.001, 0.01],
            },
        )
        .unwrap();
        metrics.record(Opcode::Get, ErrorCode::Ok, 0.0005);
        metrics.record(Opcode::Get, ErrorCode::NotFound, 0.0005);
        metrics.record(Opcode::Get, ErrorCode::Ok, 0.0005);
        // Not one of `ops`: not counted, and no panic.
        metrics.record(Opcode::Ping, ErrorCode::Ok, 0.0);
        assert_eq!(metrics.answered(Opcode::Get, ErrorCode::Ok), 2);
        assert_eq!(metrics.answered(Opcode::Get, ErrorCode::NotFound), 1);
        assert_eq!(metrics.answered(Opcode::Put, ErrorCode::Ok), 0);
        assert_eq!(metrics.answered(Opcode::Ping, ErrorCode::Ok), 0);
        let who = Identity {
            tenant: Some("acme".into()),
            ..Identity::open()
        };
        metrics.record_tenant(&who, Opcode::Put);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        assert!(
            text.contains(r#"test_requests_total{code="ok",op="get"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"test_tenant_requests_total{op="put",tenant="acme"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("test_request_duration_seconds_count{op=\"get\"} 3"),
            "{text}"
        );
    }
}
