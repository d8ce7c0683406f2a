//! What the language bindings (Python, C) share: one runtime for blocking
//! calls, Mooncake-compatible status codes, and the checks on raw memory a
//! caller hands in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use mooncake_proto::ErrorCode;

use crate::{ClientError, GetOutcome, PutOutcome};

/// The runtime blocking calls run on, started on first use:
/// `MOONCAKE_THREADS` worker threads, by default half the cores (at least
/// one), like the CLI, which leaves the other half to the GPU worker.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let threads = std::env::var("MOONCAKE_THREADS")
            .ok()
            .and_then(|t| t.parse::<usize>().ok())
            .filter(|t| *t > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
            });
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("mooncake-client")
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

/// Calls running on the runtime's workers now (see `block_on`).
static ON_WORKERS: AtomicUsize = AtomicUsize::new(0);

/// Runs `fut` on the runtime's worker threads and waits here until it is
/// done: the way bindings call the client from a thread of their own.
/// Where the future runs matters: polled on the caller's thread (the
/// runtime's own `block_on`), every socket event the runtime's workers see
/// wakes that thread, about a hundred thread switches for a batch of 32
/// MiB; on a worker, the caller is woken once, when the call is over.
/// But a worker runs its calls one after another: a caller that finds as
/// many calls on the workers as there are workers polls its own call, as
/// before, so that several callers still move bytes in parallel.
pub fn block_on<F>(fut: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send + 'static,
{
    struct Slot;
    impl Drop for Slot {
        fn drop(&mut self) {
            ON_WORKERS.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let rt = runtime();
    if ON_WORKERS.fetch_add(1, Ordering::Relaxed) >= rt.metrics().num_workers() {
        ON_WORKERS.fetch_sub(1, Ordering::Relaxed);
        return rt.block_on(fut);
    }
    let _slot = Slot;
    let fut: std::pin::Pin<Box<dyn std::future::Future<Output = F::Output> + Send + '_>> =
        Box::pin(fut);
    // SAFETY: the task may borrow from the caller's stack because the
    // caller waits below until the task is over: it completed, or the
    // runtime dropped it (shutdown), or it panicked and was dropped; a
    // JoinHandle resolves only after the task's future is gone.
    let fut: std::pin::Pin<Box<dyn std::future::Future<Output = F::Output> + Send + 'static>> =
        unsafe { std::mem::transmute(fut) };
    let task = rt.spawn(fut);
    match futures::executor::block_on(task) {
        Ok(out) => out,
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(err) => panic!("the client's runtime dropped a call: {err}"),
    }
}

/// Status codes of batch calls: `0` or a byte count on success, negative
/// on failure, with the values of Mooncake's own client where a meaning
/// matches, so that code written against it keeps working.
pub mod status {
    use super::*;

    pub const OK: i64 = 0;
    pub const INTERNAL_ERROR: i64 = -1;
    pub const NO_AVAILABLE_HANDLE: i64 = -200;
    pub const INVALID_KEY: i64 = -400;
    pub const WRITE_FAIL: i64 = -500;
    pub const INVALID_PARAMS: i64 = -600;
    /// The caller may not do this (no valid token, or another tenant's
    /// namespace).
    pub const ILLEGAL_CLIENT: i64 = -601;
    pub const OBJECT_NOT_FOUND: i64 = -704;
    /// A lease holds the object: a removal without `force` leaves it.
    pub const OBJECT_HAS_LEASE: i64 = -706;
    pub const TRANSFER_FAIL: i64 = -800;
    pub const RPC_FAIL: i64 = -900;

    /// Every code with its name, for bindings that export them.
    pub const NAMED: [(&str, i64); 11] = [
        ("OK", OK),
        ("INTERNAL_ERROR", INTERNAL_ERROR),
        ("NO_AVAILABLE_HANDLE", NO_AVAILABLE_HANDLE),
        ("INVALID_KEY", INVALID_KEY),
        ("WRITE_FAIL", WRITE_FAIL),
        ("INVALID_PARAMS", INVALID_PARAMS),
        ("ILLEGAL_CLIENT", ILLEGAL_CLIENT),
        ("OBJECT_NOT_FOUND", OBJECT_NOT_FOUND),
        ("OBJECT_HAS_LEASE", OBJECT_HAS_LEASE),
        ("TRANSFER_FAIL", TRANSFER_FAIL),
        ("RPC_FAIL", RPC_FAIL),
    ];

    /// The status of a store error code.
    pub fn of_code(code: ErrorCode) -> i64 {
        match code {
            ErrorCode::Ok | ErrorCode::AlreadyExists => OK,
            ErrorCode::NotFound => OBJECT_NOT_FOUND,
            ErrorCode::Leased => OBJECT_HAS_LEASE,
            ErrorCode::NoSpace | ErrorCode::Busy => NO_AVAILABLE_HANDLE,
            ErrorCode::TooLarge | ErrorCode::Malformed => INVALID_PARAMS,
            ErrorCode::ChecksumMismatch | ErrorCode::Corrupt => TRANSFER_FAIL,
            // The block was evicted (or its reservation expired) before its
            // commit: the write failed, and may be tried again.
            ErrorCode::NoReservation => WRITE_FAIL,
            ErrorCode::Timeout | ErrorCode::Unavailable => RPC_FAIL,
            ErrorCode::Unauthorized => ILLEGAL_CLIENT,
            _ => INTERNAL_ERROR,
        }
    }

    /// The status of every key of a call that failed as a whole.
    pub fn of_error(err: &ClientError) -> i64 {
        match err {
            ClientError::Server { code, .. } => of_code(*code),
            ClientError::Refused { .. } => ILLEGAL_CLIENT,
            ClientError::Invalid(_) => INVALID_PARAMS,
            _ => RPC_FAIL,
        }
    }

    pub fn of_put(outcome: PutOutcome) -> i64 {
        match outcome {
            // Stored on fewer hosts than asked is stored: the block is
            // visible and readable (the shortfall is counted and logged).
            PutOutcome::Stored | PutOutcome::Short { .. } | PutOutcome::AlreadyExists => OK,
            PutOutcome::Failed(ErrorCode::ChecksumMismatch) => WRITE_FAIL,
            PutOutcome::Failed(code) => of_code(code),
        }
    }

    /// Bytes read, or a negative status (`OBJECT_NOT_FOUND` for a miss).
    pub fn of_get(outcome: GetOutcome) -> i64 {
        match outcome {
            GetOutcome::Hit(n) => n as i64,
            GetOutcome::Miss => OBJECT_NOT_FOUND,
            GetOutcome::Failed(code) => of_code(code),
        }
    }
}

/// For each `(address, length)` span, whether it overlaps another one: two
/// destinations of one call must not, or both would be written at once.
pub fn overlapping(spans: &[(usize, usize)]) -> Vec<bool> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    order.sort_unstable_by_key(|&i| spans[i].0);
    let mut out = vec![false; spans.len()];
    // (end, index) of the span reaching furthest so far.
    let mut reach: Option<(usize, usize)> = None;
    for i in order {
        let (at, len) = spans[i];
        let end = at.saturating_add(len);
        if let Some((far, j)) = reach {
            if at < far {
                out[i] = true;
                out[j] = true;
            }
        }
        if reach.is_none_or(|(far, _)| end > far) {
            reach = Some((end, i));
        }
    }
    out
}

/// Runs `f` on the items not `refused` and answers `refused_status` for the
/// others, in the original order.
pub fn except<T>(
    items: Vec<T>,
    refused: &[bool],
    refused_status: i64,
    f: impl FnOnce(Vec<T>) -> Vec<i64>,
) -> Vec<i64> {
    let kept: Vec<T> = items
        .into_iter()
        .zip(refused)
        .filter(|(_, r)| !**r)
        .map(|(item, _)| item)
        .collect();
    let mut done = f(kept).into_iter();
    refused
        .iter()
        .map(|r| {
            if *r {
                refused_status
            } else {
                done.next().unwrap_or(refused_status)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test, not three: the calls on the workers are counted for the
    /// whole process, and tests of one binary may run at once.
    #[test]
    fn calls_run_on_the_workers_up_to_their_number_then_on_their_callers() {
        // One call: on a worker, borrowing the caller's memory.
        let mut buf = vec![0u8; 1000];
        let caller = std::thread::current().id();
        let (ran_on, name) = block_on(async {
            tokio::task::yield_now().await;
            buf.iter_mut().for_each(|b| *b = 7);
            let me = std::thread::current();
            (me.id(), me.name().map(str::to_string))
        });
        assert_ne!(ran_on, caller);
        assert_eq!(name.as_deref(), Some("mooncake-client"));
        assert!(buf.iter().all(|b| *b == 7));

        // A panic inside a call reaches its caller, and frees its place.
        let got = std::panic::catch_unwind(|| block_on(async { panic!("inside the call") }));
        let err = got.expect_err("the panic reaches the caller");
        assert_eq!(err.downcast_ref::<&str>(), Some(&"inside the call"));

        // Two callers more than workers: each call holds its place until
        // every caller has one, so the first `workers` run on the workers
        // and the last two on their callers.
        let workers = runtime().metrics().num_workers();
        let callers = workers + 2;
        let all_in = std::sync::Arc::new(std::sync::Barrier::new(callers));
        let on_callers = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..callers {
                s.spawn(|| {
                    let caller = std::thread::current().id();
                    let all_in = all_in.clone();
                    let ran_on = block_on(async move {
                        let me = std::thread::current().id();
                        if me == caller {
                            all_in.wait();
                        } else {
                            // A worker waits without blocking its runtime.
                            let wait = tokio::task::spawn_blocking(move || {
                                all_in.wait();
                            });
                            wait.await.unwrap();
                        }
                        me
                    });
                    if ran_on == caller {
                        on_callers.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(on_callers.into_inner(), 2);
    }

    #[test]
    fn a_block_evicted_before_its_commit_is_a_write_failure_not_a_corrupt_transfer() {
        use status::*;
        assert_eq!(of_code(ErrorCode::NoReservation), WRITE_FAIL);
        assert_eq!(of_code(ErrorCode::ChecksumMismatch), TRANSFER_FAIL);
        assert_eq!(
            of_code(ErrorCode::Busy),
            NO_AVAILABLE_HANDLE,
            "back-pressure"
        );
        assert_eq!(of_code(ErrorCode::Unavailable), RPC_FAIL);
    }

    #[test]
    fn overlaps_are_marked_on_both_sides_and_neighbours_are_not() {
        let spans = [
            (100, 10),
            (0, 50),
            (40, 20),
            (200, 0),
            (110, 5),
            (300, 100),
            (350, 1),
        ];
        assert_eq!(
            overlapping(&spans),
            vec![false, true, true, false, false, true, true]
        );
    }

    #[test]
    fn except_keeps_the_order() {
        let out = except(vec![1, 2, 3, 4], &[false, true, false, true], -9, |kept| {
            assert_eq!(kept, vec![1, 3]);
            kept.into_iter().map(|k| k * 10).collect()
        });
        assert_eq!(out, vec![10, -9, 30, -9]);
    }
}
