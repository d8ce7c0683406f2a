//! Group commit for the meta service's batch calls (a client's put
//! reservations and commits, a daemon's admissions). A call that finds none of its kind in flight goes at
//! once; calls that arrive while one is in flight queue, and the caller
//! whose request just finished sends them together as the next one. Puts
//! in flight at once share their reservations and commits (20,000
//! single-block puts, 8 in flight: 9,161 reservation and 10,220 commit
//! requests instead of 20,000 each), and nothing ever waits on a timer.
//!
//! One caller at a time leads (sends); when it has its own answer it hands
//! the lead to the oldest waiting caller. A caller dropped while leading
//! or while being handed the lead (its deadline passed) hands it on, so
//! the lead is never lost; the callers of a request dropped in flight get
//! an error (whether the meta service applied it is unknown).

use std::collections::VecDeque;
use std::future::Future;

use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::Namespace;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::{CallError, ErrorSource};

/// Queues calls of one kind: items `I` in, one answer `R` per item and a
/// part `S` shared by the whole request (the daemons it names) out.
pub struct Coalescer<I, R, S> {
    state: Mutex<State<I, R, S>>,
    /// Most items in one request.
    max_items: usize,
    /// Most weight in one request (`weigh` of its items summed: their
    /// bytes on the wire where items differ in size).
    max_weight: usize,
    weigh: fn(&I) -> usize,
}

struct State<I, R, S> {
    leading: bool,
    queue: VecDeque<Waiter<I, R, S>>,
}

struct Waiter<I, R, S> {
    namespace: Namespace,
    items: Vec<I>,
    tx: oneshot::Sender<Turn<I, R, S>>,
}

enum Turn<I, R, S> {
    Done(Result<(Vec<R>, S), CallError>),
    /// Lead now; the waiter's own call comes back to be queued again.
    Lead(Namespace, Vec<I>),
}

type Answer<R, S> = Result<(Vec<R>, S), CallError>;

impl<I, R, S: Clone> Default for Coalescer<I, R, S> {
    fn default() -> Self {
        Self::with_max_items(MAX_BATCH)
    }
}

impl<I, R, S: Clone> Coalescer<I, R, S> {
    pub fn with_max_items(max_items: usize) -> Self {
        Self::weighed(max_items, usize::MAX, |_| 0)
    }

    /// Requests of at most `max_items` items and `max_weight` of their
    /// `weigh` summed (a single caller's items go whatever they weigh).
    pub fn weighed(max_items: usize, max_weight: usize, weigh: fn(&I) -> usize) -> Self {
        Coalescer {
            state: Mutex::new(State {
                leading: false,
                queue: VecDeque::new(),
            }),
            max_items: max_items.max(1),
            max_weight,
            weigh,
        }
    }

    /// Answers `items` of `namespace`, sent with others queued meanwhile
    /// (of the same namespace) by `send`, which must answer one `R` per
    /// item, in order.
    pub async fn call<F, Fut>(&self, namespace: Namespace, items: Vec<I>, send: F) -> Answer<R, S>
    where
        F: Fn(Namespace, Vec<I>) -> Fut,
        Fut: Future<Output = Answer<R, S>>,
    {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut st = self.state.lock();
            st.queue.push_back(Waiter {
                namespace,
                items,
                tx,
            });
            !std::mem::replace(&mut st.leading, true)
        };
        let mut rx = if lead {
            rx
        } else {
            let mut waiting = Waiting {
                coalescer: self,
                rx: Some(rx),
            };
            let turn = waiting.rx.as_mut().expect("set above").await;
            waiting.rx = None;
            match turn {
                Ok(Turn::Done(answer)) => return answer,
                Ok(Turn::Lead(namespace, items)) => {
                    let (tx, rx) = oneshot::channel();
                    self.state.lock().queue.push_front(Waiter {
                        namespace,
                        items,
                        tx,
                    });
                    rx
                }
                Err(_) => return Err(abandoned()),
            }
        };
        let _lead = Lead { coalescer: self };
        loop {
            let batch = self.next_batch();
            if batch.is_empty() {
                // Only this caller's own entry can be missing: answered.
                break;
            }
            let namespace = batch[0].namespace.clone();
            let lens: Vec<usize> = batch.iter().map(|w| w.items.len()).collect();
            let mut items = Vec::with_capacity(lens.iter().sum());
            let mut txs = Vec::with_capacity(batch.len());
            for w in batch {
                items.extend(w.items);
                txs.push(w.tx);
            }
            let total = items.len();
            let answer = send(namespace, items).await;
            deliver(answer, total, &lens, txs);
            if let Ok(Turn::Done(answer)) = rx.try_recv() {
                return answer;
            }
        }
        match rx.try_recv() {
            Ok(Turn::Done(answer)) => answer,
            _ => Err(abandoned()),
        }
    }

    /// The oldest waiters of one namespace, up to `max_items` and
    /// `max_weight` (at least one waiter); callers that gave up are
    /// dropped, not sent.
    fn next_batch(&self) -> Vec<Waiter<I, R, S>> {
        let mut st = self.state.lock();
        st.queue.retain(|w| !w.tx.is_closed());
        let Some(first) = st.queue.front() else {
            return Vec::new();
        };
        let namespace = first.namespace.clone();
        let mut batch = Vec::new();
        let (mut items, mut weight) = (0, 0usize);
        let mut i = 0;
        while i < st.queue.len() {
            let w = &st.queue[i];
            if w.namespace != namespace {
                i += 1;
                continue;
            }
            let w_weight: usize = w.items.iter().map(self.weigh).sum();
            let over = items + w.items.len() > self.max_items
                || weight.saturating_add(w_weight) > self.max_weight;
            if !batch.is_empty() && over {
                break;
            }
            items += w.items.len();
            weight += w_weight;
            batch.push(st.queue.remove(i).expect("in range"));
        }
        batch
    }

    /// Gives the lead to the oldest caller still waiting, or lets it go.
    fn hand_on(&self) {
        let mut st = self.state.lock();
        while let Some(w) = st.queue.pop_front() {
            if w.tx.send(Turn::Lead(w.namespace, w.items)).is_ok() {
                return;
            }
        }
        st.leading = false;
    }
}

/// Held by the leading caller: dropped (done, or the caller's deadline
/// passed), it hands the lead on.
struct Lead<'a, I, R, S: Clone> {
    coalescer: &'a Coalescer<I, R, S>,
}

impl<I, R, S: Clone> Drop for Lead<'_, I, R, S> {
    fn drop(&mut self) {
        self.coalescer.hand_on();
    }
}

/// Held by a waiting caller: dropped with the lead handed to it but not
/// yet taken, it hands the lead on.
struct Waiting<'a, I, R, S: Clone> {
    coalescer: &'a Coalescer<I, R, S>,
    rx: Option<oneshot::Receiver<Turn<I, R, S>>>,
}

impl<I, R, S: Clone> Drop for Waiting<'_, I, R, S> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if let Ok(Turn::Lead(..)) = rx.try_recv() {
                self.coalescer.hand_on();
            }
        }
    }
}

/// Splits one request's answer among its callers.
fn deliver<I, R, S: Clone>(
    answer: Answer<R, S>,
    total: usize,
    lens: &[usize],
    txs: Vec<oneshot::Sender<Turn<I, R, S>>>,
) {
    match answer {
        Ok((answers, shared)) if answers.len() == total => {
            let mut answers = answers.into_iter();
            for (tx, len) in txs.into_iter().zip(lens) {
                let mine: Vec<R> = answers.by_ref().take(*len).collect();
                let _ = tx.send(Turn::Done(Ok((mine, shared.clone()))));
            }
        }
        Ok((answers, _)) => {
            let err = CallError::Protocol {
                side: ErrorSource::Meta,
                addr: "meta service".into(),
                err: mooncake_proto::ProtoError::Invalid {
                    field: "response",
                    why: format!("{} answers to {total} items", answers.len()),
                },
            };
            for tx in txs {
                let _ = tx.send(Turn::Done(Err(err.duplicate())));
            }
        }
        Err(err) => {
            for tx in txs {
                let _ = tx.send(Turn::Done(Err(err.duplicate())));
            }
        }
    }
}

/// For the callers of a request whose sender's deadline passed with it in
/// flight: whether the meta service applied it is unknown.
fn abandoned() -> CallError {
    CallError::Io {
        side: ErrorSource::Meta,
        addr: "meta service".into(),
        err: std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "sent with another call's request, abandoned at that call's deadline",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    fn ns(name: &str) -> Namespace {
        Namespace::new(name).unwrap()
    }

    /// Answers each item with itself times ten, after `delay`, and counts
    /// requests.
    async fn times_ten(sent: &AtomicUsize, delay: Duration, items: Vec<u32>) -> Answer<u32, usize> {
        sent.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        let n = items.len();
        Ok((items.into_iter().map(|i| i * 10).collect(), n))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_calls_share_requests_and_each_gets_its_own_answers() {
        let c = Arc::new(Coalescer::<u32, u32, usize>::default());
        let sent = Arc::new(AtomicUsize::new(0));
        let calls: Vec<_> = (0..64u32)
            .map(|k| {
                let (c, sent) = (c.clone(), sent.clone());
                tokio::spawn(async move {
                    let items = vec![k * 3, k * 3 + 1, k * 3 + 2];
                    let got = c
                        .call(ns("a"), items, |_, items| {
                            times_ten(&sent, Duration::from_millis(5), items)
                        })
                        .await
                        .unwrap();
                    assert_eq!(got.0, vec![k * 30, k * 30 + 10, k * 30 + 20]);
                    assert!(got.1 >= 3, "the whole request's part");
                })
            })
            .collect();
        for call in calls {
            call.await.unwrap();
        }
        let requests = sent.load(Ordering::SeqCst);
        assert!(requests < 64, "{requests} requests for 64 calls");
        assert!(!c.state.lock().leading, "the lead is let go when idle");
    }

    #[tokio::test]
    async fn namespaces_never_share_a_request_and_batches_respect_the_cap() {
        let c = Arc::new(Coalescer::<u32, u32, Vec<u32>>::with_max_items(4));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let send = |namespace: Namespace, items: Vec<u32>| {
            let seen = seen.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                seen.lock().push((namespace.to_string(), items.len()));
                Ok((items.clone(), items))
            }
        };
        let calls = (0..12u32).map(|k| {
            let space = if k % 2 == 0 { "even" } else { "odd" };
            c.call(ns(space), vec![k, k], send)
        });
        let answers = futures::future::join_all(calls).await;
        for (k, a) in answers.into_iter().enumerate() {
            let (mine, whole) = a.unwrap();
            assert_eq!(mine, vec![k as u32, k as u32]);
            assert!(whole.iter().all(|i| i % 2 == k as u32 % 2), "{whole:?}");
        }
        assert!(seen.lock().iter().all(|(_, n)| *n <= 4));
    }

    #[tokio::test(start_paused = true)]
    async fn requests_stay_within_their_weight_and_a_heavy_caller_still_goes_alone() {
        // Each item weighs its value: a tagged commit weighs its bytes.
        let c = Coalescer::<u32, u32, ()>::weighed(100, 10, |i| *i as usize);
        let sent = Mutex::new(Vec::new());
        let send = |_: Namespace, items: Vec<u32>| {
            sent.lock().push(items.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok((items, ()))
            }
        };
        // The first call leads; the others queue behind its request.
        let calls = [vec![1], vec![4], vec![4], vec![4], vec![30], vec![2]];
        let answers = futures::future::join_all(
            calls
                .iter()
                .map(|items| c.call(ns("a"), items.clone(), send)),
        )
        .await;
        for (items, answer) in calls.iter().zip(answers) {
            assert_eq!(&answer.unwrap().0, items);
        }
        let sent = sent.into_inner();
        assert_eq!(
            sent,
            [vec![1], vec![4, 4], vec![4], vec![30], vec![2]],
            "at most 10 a request, unless one caller's items weigh more"
        );
    }

    #[tokio::test]
    async fn an_error_reaches_every_caller_of_the_request() {
        let c = Coalescer::<u32, u32, ()>::default();
        let send = |_: Namespace, _: Vec<u32>| async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Err::<(Vec<u32>, ()), _>(CallError::Invalid("refused".into()))
        };
        let answers =
            futures::future::join_all((0..5).map(|k| c.call(ns("a"), vec![k], send))).await;
        assert!(answers
            .iter()
            .all(|a| matches!(a, Err(CallError::Invalid(why)) if why == "refused")));
        let short = |_: Namespace, _: Vec<u32>| async { Ok((vec![1], ())) };
        assert!(matches!(
            c.call(ns("a"), vec![1, 2], short).await,
            Err(CallError::Protocol { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_dropped_while_leading_hands_the_lead_on() {
        let c = Arc::new(Coalescer::<u32, u32, ()>::default());
        let slow = |_: Namespace, items: Vec<u32>| async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok((items, ()))
        };
        // The leader gives up (its deadline) while its request is out.
        let leader =
            tokio::time::timeout(Duration::from_millis(100), c.call(ns("a"), vec![1], slow));
        let follower = {
            let c = c.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                c.call(ns("a"), vec![2], |_, items: Vec<u32>| async move {
                    Ok((items, ()))
                })
                .await
            })
        };
        assert!(leader.await.is_err(), "the leader timed out");
        let got = tokio::time::timeout(Duration::from_secs(30), follower)
            .await
            .expect("the follower is not stranded")
            .unwrap()
            .unwrap();
        assert_eq!(got.0, vec![2]);
        assert!(!c.state.lock().leading);
    }

    #[tokio::test(start_paused = true)]
    async fn callers_of_a_request_abandoned_in_flight_get_an_error() {
        let c = Arc::new(Coalescer::<u32, u32, ()>::default());
        let slow = |_: Namespace, items: Vec<u32>| async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok((items, ()))
        };
        // A leads; B and C queue behind A's request; A, answered, hands
        // the lead to B, which sends B and C together and then gives up
        // (its deadline) with that request in flight.
        let a = c.call(ns("a"), vec![1], slow);
        let (cb, cc) = (c.clone(), c.clone());
        let b = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            tokio::time::timeout(Duration::from_millis(500), cb.call(ns("a"), vec![2], slow)).await
        });
        let rider = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            cc.call(ns("a"), vec![3], slow).await
        });
        assert_eq!(a.await.unwrap().0, vec![1]);
        assert!(b.await.unwrap().is_err(), "B timed out");
        match tokio::time::timeout(Duration::from_secs(5), rider)
            .await
            .expect("the rider does not hang")
            .unwrap()
        {
            Err(CallError::Io { err, .. }) => {
                assert_eq!(err.kind(), std::io::ErrorKind::TimedOut)
            }
            other => panic!("{other:?}"),
        }
        assert!(!c.state.lock().leading);
    }
}
