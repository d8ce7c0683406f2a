//! The fallback engine: positioned reads and writes (pread/pwrite) on a few
//! threads, for kernels without io_uring. Same contract as the ring.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use super::{check_aligned, AlignedBuf, IoEngine, IoKind, IoRequest, IoResult};

struct Job {
    kind: IoKind,
    req: IoRequest,
    index: usize,
    batch: Arc<BatchState>,
}

struct BatchState {
    results: Mutex<Vec<Option<IoResult>>>,
    remaining: AtomicUsize,
    done: Mutex<Option<oneshot::Sender<Vec<IoResult>>>>,
}

pub struct PsyncEngine {
    tx: mpsc::Sender<Job>,
}

impl PsyncEngine {
    /// `depth` transfers at once, on as many threads (at most 64).
    pub fn new(file: File, depth: u32) -> io::Result<Self> {
        let threads = depth.clamp(1, 64) as usize;
        let (tx, rx) = mpsc::channel::<Job>(threads * 4);
        let rx = Arc::new(Mutex::new(rx));
        let file = Arc::new(file);
        for i in 0..threads {
            let (rx, file) = (rx.clone(), file.clone());
            std::thread::Builder::new()
                .name(format!("mooncake-psync-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().blocking_recv();
                    let Some(job) = job else { return };
                    run(&file, job);
                })?;
        }
        Ok(PsyncEngine { tx })
    }
}

fn transfer(file: &File, kind: IoKind, offset: u64, buf: &mut AlignedBuf) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        let n = match kind {
            IoKind::Read => file.read_at(&mut buf.as_mut_slice()[done..], at),
            IoKind::Write => file.write_at(&buf.as_slice()[done..], at),
        };
        match n {
            Ok(0) => break, // end of file
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn run(file: &File, job: Job) {
    let Job {
        kind,
        mut req,
        index,
        batch,
    } = job;
    let result = check_aligned(&req).and_then(|()| transfer(file, kind, req.offset, &mut req.buf));
    batch.results.lock()[index] = Some((req.buf, result));
    if batch.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        let results = std::mem::take(&mut *batch.results.lock())
            .into_iter()
            .map(|r| r.expect("all done"))
            .collect();
        if let Some(done) = batch.done.lock().take() {
            let _ = done.send(results);
        }
    }
}

impl IoEngine for PsyncEngine {
    fn submit(&self, kind: IoKind, reqs: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>> {
        let tx = self.tx.clone();
        Box::pin(async move {
            if reqs.is_empty() {
                return Vec::new();
            }
            let (done, answer) = oneshot::channel();
            let batch = Arc::new(BatchState {
                results: Mutex::new((0..reqs.len()).map(|_| None).collect()),
                remaining: AtomicUsize::new(reqs.len()),
                done: Mutex::new(Some(done)),
            });
            for (index, req) in reqs.into_iter().enumerate() {
                let job = Job {
                    kind,
                    req,
                    index,
                    batch: batch.clone(),
                };
                if let Err(mpsc::error::SendError(job)) = tx.send(job).await {
                    // The engine stopped: fail this request in place.
                    job.batch.results.lock()[job.index] =
                        Some((job.req.buf, Err(io::Error::other("pread engine stopped"))));
                    job.batch.remaining.fetch_sub(1, Ordering::AcqRel);
                }
            }
            answer.await.unwrap_or_default()
        })
    }

    fn name(&self) -> &'static str {
        "pread/pwrite"
    }
}
