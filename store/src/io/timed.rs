//! An engine that times each batch it submits, from submission to the
//! last result, into the daemon's histogram of drive I/O by kind
//! (`mooncake_daemon_nvme_io_seconds{op}`): what a drive read or write
//! took, queueing in the engine included, so that an operator sees
//! whether slow gets of blocks on NVMe are the drive's.

use std::time::Instant;

use futures::future::BoxFuture;
use prometheus::{Histogram, HistogramOpts, HistogramVec};

use super::{IoEngine, IoKind, IoRequest, IoResult};

/// The histogram of every drive's I/O, by kind; registered with the
/// daemon's metrics (`DaemonMetrics::new`).
#[derive(Clone)]
pub struct IoTimes {
    vec: HistogramVec,
    read: Histogram,
    write: Histogram,
}

impl IoTimes {
    pub fn new(buckets: Vec<f64>) -> prometheus::Result<Self> {
        let vec = HistogramVec::new(
            HistogramOpts::new(
                "mooncake_daemon_nvme_io_seconds",
                "NVMe drive reads and writes, from submission to completion (queueing in the I/O engine included), by op.",
            )
            .buckets(buckets),
            &["op"],
        )?;
        let (read, write) = (
            vec.with_label_values(&["read"]),
            vec.with_label_values(&["write"]),
        );
        Ok(IoTimes { vec, read, write })
    }

    /// The histograms, to register.
    pub fn collector(&self) -> HistogramVec {
        self.vec.clone()
    }

    fn of(&self, kind: IoKind) -> &Histogram {
        match kind {
            IoKind::Read => &self.read,
            IoKind::Write => &self.write,
        }
    }
}

/// `inner`, each batch timed into `times`.
pub struct Timed {
    inner: Box<dyn IoEngine>,
    times: IoTimes,
}

impl Timed {
    pub fn over(inner: Box<dyn IoEngine>, times: IoTimes) -> Self {
        Timed { inner, times }
    }
}

impl IoEngine for Timed {
    fn submit(&self, kind: IoKind, batch: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>> {
        let (began, took) = (Instant::now(), self.times.of(kind).clone());
        let io = self.inner.submit(kind, batch);
        Box::pin(async move {
            let done = io.await;
            took.observe(began.elapsed().as_secs_f64());
            done
        })
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{engine, open_direct, AlignedBuf, EngineKind, ALIGN};

    #[tokio::test]
    async fn each_batch_is_timed_under_its_kind() {
        let dir = std::env::temp_dir().join(format!(
            "mooncake-timed-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let inner = engine(EngineKind::Psync, open_direct(&dir.join("f")).unwrap(), 2).unwrap();
        let times = IoTimes::new(vec![0.001, 1.0]).unwrap();
        let timed = Timed::over(inner, times.clone());
        let request = |offset| IoRequest {
            offset,
            buf: AlignedBuf::zeroed(ALIGN),
        };
        let wrote = timed
            .submit(IoKind::Write, vec![request(0), request(ALIGN as u64)])
            .await;
        assert!(wrote
            .iter()
            .all(|(_, r)| r.as_ref().is_ok_and(|n| *n == ALIGN)));
        timed.submit(IoKind::Read, vec![request(0)]).await;
        timed.submit(IoKind::Read, vec![request(0)]).await;
        let count = |op| {
            times
                .collector()
                .with_label_values(&[op])
                .get_sample_count()
        };
        assert_eq!((count("write"), count("read")), (1, 2));
        assert_eq!(timed.name(), "pread/pwrite");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
