//! Client-side Prometheus metrics, for applications that expose a registry:
//! what the worker saw (latency end to end, hits and misses), beside what
//! the servers report.

use std::sync::Arc;

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts,
    Registry,
};

use mooncake_proto::transport::TransportKind;

use crate::client::{GetOutcome, PutOutcome};

pub struct ClientMetrics {
    get_seconds: Histogram,
    put_seconds: Histogram,
    match_seconds: Histogram,
    get_hit: IntCounter,
    get_miss: IntCounter,
    get_failed: IntCounter,
    put_stored: IntCounter,
    put_exists: IntCounter,
    put_short: IntCounter,
    put_failed: IntCounter,
    bytes_read: IntCounter,
    bytes_written: IntCounter,
    pub(crate) corrupt: IntCounter,
    fallbacks: IntCounterVec,
}

impl ClientMetrics {
    /// Registers the client's metrics in the application's registry.
    pub fn new(registry: &Registry) -> prometheus::Result<Arc<Self>> {
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "mooncake_client_request_duration_seconds",
                "Time of a client call (a whole batch), as the worker saw it.",
            )
            .buckets(exponential_buckets(0.000_05, 2.0, 18)?),
            &["op"],
        )?;
        let blocks = IntCounterVec::new(
            Opts::new(
                "mooncake_client_blocks_total",
                "Blocks asked for, by operation and result.",
            ),
            &["op", "result"],
        )?;
        let bytes = IntCounterVec::new(
            Opts::new(
                "mooncake_client_bytes_total",
                "Block bytes moved by this client.",
            ),
            &["direction"],
        )?;
        let corrupt = IntCounter::new(
            "mooncake_client_corrupt_reads_total",
            "Blocks whose bytes failed their checksum on arrival (each was a miss).",
        )?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(blocks.clone()))?;
        registry.register(Box::new(bytes.clone()))?;
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "mooncake_client_transport_fallbacks_total",
                "Times a better data path could not be used and another was, by transport.",
            ),
            &["from", "to"],
        )?;
        registry.register(Box::new(corrupt.clone()))?;
        registry.register(Box::new(fallbacks.clone()))?;
        Ok(Arc::new(ClientMetrics {
            get_seconds: latency.with_label_values(&["get"]),
            put_seconds: latency.with_label_values(&["put"]),
            match_seconds: latency.with_label_values(&["match_prefix"]),
            get_hit: blocks.with_label_values(&["get", "hit"]),
            get_miss: blocks.with_label_values(&["get", "miss"]),
            get_failed: blocks.with_label_values(&["get", "failed"]),
            put_stored: blocks.with_label_values(&["put", "stored"]),
            put_exists: blocks.with_label_values(&["put", "exists"]),
            put_short: blocks.with_label_values(&["put", "short"]),
            put_failed: blocks.with_label_values(&["put", "failed"]),
            bytes_read: bytes.with_label_values(&["read"]),
            bytes_written: bytes.with_label_values(&["written"]),
            corrupt,
            fallbacks,
        }))
    }

    pub(crate) fn gets(&self, seconds: f64, outcomes: &[GetOutcome]) {
        self.get_seconds.observe(seconds);
        for o in outcomes {
            match o {
                GetOutcome::Hit(n) => {
                    self.get_hit.inc();
                    self.bytes_read.inc_by(*n as u64);
                }
                GetOutcome::Miss => self.get_miss.inc(),
                GetOutcome::Failed(_) => self.get_failed.inc(),
            }
        }
    }

    pub(crate) fn puts(
        &self,
        seconds: f64,
        outcomes: &[PutOutcome],
        sizes: impl Iterator<Item = usize>,
    ) {
        self.put_seconds.observe(seconds);
        for (o, size) in outcomes.iter().zip(sizes) {
            match o {
                PutOutcome::Stored => {
                    self.put_stored.inc();
                    self.bytes_written.inc_by(size as u64);
                }
                PutOutcome::Short { .. } => {
                    self.put_short.inc();
                    self.bytes_written.inc_by(size as u64);
                }
                PutOutcome::AlreadyExists => self.put_exists.inc(),
                PutOutcome::Failed(_) => self.put_failed.inc(),
            }
        }
    }

    pub(crate) fn fell_back(&self, from: TransportKind, to: TransportKind) {
        self.fallbacks
            .with_label_values(&[from.name(), to.name()])
            .inc();
    }

    pub(crate) fn matched(&self, seconds: f64) {
        self.match_seconds.observe(seconds);
    }
}
