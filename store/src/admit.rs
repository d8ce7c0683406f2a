//! Admissions: blocks that clients of this host wrote into room held
//! ahead (`ShmAdmit`), made visible at the meta service by the daemon
//! itself (`Admit`), so that the writer's put is one round trip to this
//! daemon instead of a reservation and a commit at the meta service
//! around it.
//!
//! A block is admitted before it goes into the pool, and goes in after:
//! a removal that reaches the daemon in between is noted (`Tiers::admitting`)
//! and the block is dropped instead, so a removed block never comes back.
//! Where the meta service's answer is lost (a timeout, a broken
//! connection, a new leader), whether it made the block visible is not
//! known: the block is dropped and reported gone, which takes it out of
//! the index if it was put there.

use std::sync::Arc;
use std::time::Duration;

use mooncake_net::coalesce::Coalescer;
use mooncake_net::{CallError, ConnPool, Dialer, ErrorSource};
use mooncake_proto::frame::{MAX_BATCH, MAX_CONTROL_BODY};
use mooncake_proto::message::{CommitItem, Copies, PutCommitRequest, PutStartResponse, Slot};
use mooncake_proto::{ErrorCode, Namespace, Opcode};
use tokio::sync::watch;

use crate::meta_link::Registration;

/// Longest an admission waits for the meta service's answer (at most half
/// the daemon's `request_timeout`).
pub const ADMIT_TIMEOUT: Duration = Duration::from_secs(2);
/// Idle connections kept to the meta service for admissions.
const MAX_IDLE: usize = 8;

/// Engine tags' bytes of an item: a request carries at most half a control
/// frame of them.
fn tag_bytes(item: &CommitItem) -> usize {
    item.tag
        .as_deref()
        .map_or(0, mooncake_proto::message::EngineTag::encoded_len)
}

/// Makes same-host blocks visible at the meta service this daemon is
/// registered with.
pub struct Admitter {
    dialer: Dialer,
    token: Option<Arc<str>>,
    registered: watch::Receiver<Registration>,
    /// Connections to the meta service registered with, and its address.
    pool: parking_lot::Mutex<Option<(String, Arc<ConnPool>)>>,
    /// Longest an admission waits for its answer.
    timeout: Duration,
    /// Blocks asked about, by outcome.
    outcomes: prometheus::IntCounterVec,
    /// Admissions of sessions asking at once, sent together.
    batches: Coalescer<CommitItem, Slot, ()>,
}

/// What became of a block asked about, as counted.
#[derive(Clone, Copy)]
pub enum Outcome {
    Admitted,
    Exists,
    Refused,
    Lost,
}

/// Why blocks were not admitted.
#[derive(Debug)]
pub enum NotAdmitted {
    /// Not asked (no registration), or refused whole: nothing is visible.
    Refused(ErrorCode),
    /// Asked, and the answer was lost: some may be visible.
    Unknown(CallError),
}

impl Admitter {
    pub fn new(
        dialer: Dialer,
        token: Option<String>,
        registered: watch::Receiver<Registration>,
        (timeout, outcomes): (Duration, prometheus::IntCounterVec),
    ) -> Self {
        Admitter {
            dialer,
            token: token.map(Arc::from),
            registered,
            pool: parking_lot::Mutex::new(None),
            timeout,
            outcomes,
            batches: Coalescer::weighed(MAX_BATCH, MAX_CONTROL_BODY as usize / 2, tag_bytes),
        }
    }

    /// Counts a block's outcome.
    pub fn count(&self, outcome: Outcome) {
        let label = match outcome {
            Outcome::Admitted => "admitted",
            Outcome::Exists => "exists",
            Outcome::Refused => "refused",
            Outcome::Lost => "lost",
        };
        self.outcomes.with_label_values(&[label]).inc();
    }

    /// Admits `items` (`stored_on` is filled in) of `namespace` on this
    /// daemon: a slot each, as the meta service answered. Sessions asking
    /// at once share requests (`Coalescer`: one in flight, the others'
    /// items go together in the next).
    pub async fn admit(
        &self,
        namespace: &Namespace,
        items: Vec<CommitItem>,
    ) -> Result<Vec<Slot>, NotAdmitted> {
        let call = self
            .batches
            .call(namespace.clone(), items, |ns, items| self.send(ns, items));
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok((slots, ()))) => Ok(slots),
            // Not sent, or refused whole: nothing is visible.
            Ok(Err(CallError::Server { code, .. })) => Err(NotAdmitted::Refused(code)),
            Ok(Err(err)) => Err(NotAdmitted::Unknown(err)),
            Err(_) => Err(NotAdmitted::Unknown(CallError::Timeout {
                side: ErrorSource::Meta,
                addr: self.registered.borrow().meta.clone(),
                op: "admit",
                timeout_ms: self.timeout.as_millis() as u64,
            })),
        }
    }

    /// One `Admit` request to the meta service registered with. Errors
    /// that say nothing was sent (not registered, no connection) come as
    /// `Server` errors, as a refusal does.
    async fn send(
        &self,
        namespace: Namespace,
        items: Vec<CommitItem>,
    ) -> Result<(Vec<Slot>, ()), CallError> {
        let Registration { id, meta } = self.registered.borrow().clone();
        let not_sent = |meta: &str| CallError::Server {
            side: ErrorSource::Meta,
            addr: meta.to_string(),
            op: "admit",
            code: ErrorCode::Unavailable,
        };
        if id == 0 {
            return Err(not_sent(&meta));
        }
        let n = items.len();
        let req = PutCommitRequest {
            namespace,
            items: items
                .into_iter()
                .map(|it| CommitItem {
                    stored_on: Copies::one(id),
                    ..it
                })
                .collect(),
        };
        let pool = self.pool_for(&meta);
        // Never sent twice: a first try that did reach the meta service
        // would make a second answer `AlreadyExists`.
        let (mut conn, _) = pool.get().await.map_err(|_| not_sent(&meta))?;
        match conn
            .call::<PutStartResponse>(Opcode::Admit, &req, "admit")
            .await
        {
            Ok(answer) if answer.slots.len() == n => {
                pool.put_back(conn);
                Ok((answer.slots, ()))
            }
            Ok(_) => Err(CallError::Protocol {
                side: ErrorSource::Meta,
                addr: meta,
                err: mooncake_proto::ProtoError::Invalid {
                    field: "response",
                    why: "an admission answered for another number of blocks".into(),
                },
            }),
            Err(err) => {
                if matches!(err, CallError::Server { .. }) {
                    pool.put_back(conn);
                }
                Err(err)
            }
        }
    }

    /// The connections to `meta`, new ones where the daemon registered
    /// with another meta service since.
    fn pool_for(&self, meta: &str) -> Arc<ConnPool> {
        let mut pool = self.pool.lock();
        match &*pool {
            Some((addr, p)) if addr == meta => p.clone(),
            _ => {
                let p = Arc::new(
                    ConnPool::new(meta.to_string(), ErrorSource::Meta, self.timeout, MAX_IDLE)
                        .with_token(self.token.clone())
                        .with_dialer(self.dialer.clone()),
                );
                *pool = Some((meta.to_string(), p.clone()));
                p
            }
        }
    }
}
