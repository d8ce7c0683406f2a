//! The io_uring engine: one ring, driven by a dedicated thread that keeps
//! up to `depth` transfers in flight and hands each batch's results back to
//! the async caller when its last transfer completes.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use futures::future::BoxFuture;
use io_uring::{opcode, types, IoUring};
use tokio::sync::{mpsc, oneshot};

use super::{check_aligned, IoEngine, IoKind, IoRequest, IoResult};

struct Batch {
    kind: IoKind,
    reqs: Vec<IoRequest>,
    done: oneshot::Sender<Vec<IoResult>>,
}

pub struct UringEngine {
    tx: mpsc::Sender<Batch>,
}

impl UringEngine {
    /// Fails (with the kernel's error) where io_uring is unavailable; the
    /// caller falls back to the pread/pwrite engine.
    pub fn new(file: File, depth: u32) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        let ring = IoUring::new(depth.next_power_of_two().max(2))?;
        let (tx, rx) = mpsc::channel(1024);
        std::thread::Builder::new()
            .name("mooncake-uring".into())
            .spawn(move || drive(ring, file, depth as usize, rx))?;
        Ok(UringEngine { tx })
    }
}

impl IoEngine for UringEngine {
    fn submit(&self, kind: IoKind, reqs: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>> {
        let tx = self.tx.clone();
        Box::pin(async move {
            let n = reqs.len();
            let (done, answer) = oneshot::channel();
            if n == 0 {
                return Vec::new();
            }
            if let Err(mpsc::error::SendError(batch)) = tx.send(Batch { kind, reqs, done }).await {
                return batch
                    .reqs
                    .into_iter()
                    .map(|r| (r.buf, Err(io::Error::other("io_uring engine stopped"))))
                    .collect();
            }
            answer.await.unwrap_or_default()
        })
    }

    fn name(&self) -> &'static str {
        "io_uring"
    }
}

/// Results of one batch, filled as its transfers complete.
struct Gather {
    results: Vec<Option<IoResult>>,
    remaining: usize,
    done: oneshot::Sender<Vec<IoResult>>,
}

fn finish(batches: &mut HashMap<u64, Gather>, id: u64, index: usize, result: IoResult) {
    let gather = batches.get_mut(&id).expect("batch in flight");
    gather.results[index] = Some(result);
    gather.remaining -= 1;
    if gather.remaining == 0 {
        let gather = batches.remove(&id).expect("just found");
        let results = gather
            .results
            .into_iter()
            .map(|r| r.expect("all done"))
            .collect();
        let _ = gather.done.send(results);
    }
}

fn drive(mut ring: IoUring, file: File, depth: usize, mut rx: mpsc::Receiver<Batch>) {
    let fd = types::Fd(file.as_raw_fd());
    let mut batches: HashMap<u64, Gather> = HashMap::new();
    let mut queue: VecDeque<(u64, usize, IoKind, IoRequest)> = VecDeque::new();
    let mut slots: Vec<Option<(u64, usize, super::AlignedBuf)>> =
        (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut next_id = 0u64;
    let mut open = true;
    let mut take = |batch: Batch, batches: &mut HashMap<u64, Gather>, queue: &mut VecDeque<_>| {
        let id = next_id;
        next_id += 1;
        batches.insert(
            id,
            Gather {
                results: (0..batch.reqs.len()).map(|_| None).collect(),
                remaining: batch.reqs.len(),
                done: batch.done,
            },
        );
        for (i, req) in batch.reqs.into_iter().enumerate() {
            queue.push_back((id, i, batch.kind, req));
        }
    };
    loop {
        let in_flight = depth - free.len();
        if open && in_flight == 0 && queue.is_empty() {
            match rx.blocking_recv() {
                Some(b) => take(b, &mut batches, &mut queue),
                None => open = false,
            }
        }
        while open {
            match rx.try_recv() {
                Ok(b) => take(b, &mut batches, &mut queue),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        if !open && depth == free.len() && queue.is_empty() {
            return;
        }
        // Fill the ring.
        let mut pushed = 0;
        while let Some(slot) = free.last().copied() {
            let Some((id, index, kind, mut req)) = queue.pop_front() else {
                break;
            };
            if let Err(err) = check_aligned(&req) {
                finish(&mut batches, id, index, (req.buf, Err(err)));
                continue;
            }
            let len = req.buf.len() as u32;
            let ptr = req.buf.as_mut_ptr();
            let entry = match kind {
                IoKind::Read => opcode::Read::new(fd, ptr, len).offset(req.offset).build(),
                IoKind::Write => opcode::Write::new(fd, ptr, len).offset(req.offset).build(),
            }
            .user_data(slot as u64);
            // SAFETY: the buffer stays in `slots` (owned, unmoved heap
            // memory) until its completion is reaped below.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                queue.push_front((id, index, kind, req));
                break;
            }
            free.pop();
            slots[slot] = Some((id, index, req.buf));
            pushed += 1;
        }
        if depth == free.len() {
            continue;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
            Err(err) => {
                tracing::error!(%err, pushed, "io_uring submit failed");
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
        }
        for cqe in ring.completion() {
            let slot = cqe.user_data() as usize;
            let (id, index, buf) = slots[slot]
                .take()
                .expect("a completion for a slot in flight");
            free.push(slot);
            let res = cqe.result();
            let result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
                Ok(res as usize)
            };
            finish(&mut batches, id, index, (buf, result));
        }
    }
}
