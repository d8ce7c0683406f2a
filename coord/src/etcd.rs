//! Coordination through etcd, as etcd's own concurrency package does it: a
//! session is a lease kept alive in the background; leadership (etcd's
//! election API) and memberships are keys bound to that lease.
//!
//! The leader loses its lead only on a definite signal: etcd says the lease
//! expired, or the session's keep-alive stream reports it gone. While etcd
//! is merely unreachable, nobody else can be elected either, so the leader
//! goes on serving (and says so in its log).

use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, PutOptions};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::{Coordinator, CoordinatorError, LeaderInfo, Leadership, MemberKind};

/// How to reach etcd and how long a silent member stays alive.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Lease TTL: a leader or daemon that stops refreshing is gone after
    /// this long. Whole seconds, at least 1.
    pub ttl: Duration,
    /// Key prefix of this cluster, so that several share one etcd.
    pub prefix: String,
    /// How long `connect` and `register` keep trying an etcd that does not
    /// answer yet (a process started beside etcd, or before it); zero for
    /// one try. Either gives up with `Unavailable` once this has passed.
    pub wait: Duration,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdConfig {
            endpoints,
            ttl: Duration::from_secs(3),
            prefix: "/mooncake".into(),
            wait: Duration::ZERO,
        }
    }
}

#[derive(Clone)]
struct Session {
    lease: i64,
    lost: CancellationToken,
}

pub struct EtcdCoordinator {
    client: Client,
    cfg: EtcdConfig,
    session: Mutex<Session>,
    registrations: Mutex<Vec<(MemberKind, String)>>,
    /// Cancelled by `close`: the keep-alive task ends for good.
    closed: CancellationToken,
}

fn unavailable(err: impl std::fmt::Display) -> CoordinatorError {
    CoordinatorError::Unavailable(err.to_string())
}

/// An etcd call's failure in a few words: gRPC's message and the innermost
/// cause (`tcp connect error: Connection refused (os error 111)`), rather
/// than the whole chain of wrapped errors in their debug form.
fn etcd_failed(err: etcd_client::Error) -> CoordinatorError {
    let (mut said, mut cause): (String, Option<&(dyn std::error::Error + 'static)>) = match &err {
        etcd_client::Error::GRpcStatus(status) if !status.message().is_empty() => (
            status.message().to_string(),
            std::error::Error::source(status),
        ),
        other => (other.to_string(), std::error::Error::source(other)),
    };
    let mut innermost = None;
    while let Some(c) = cause {
        innermost = Some(c.to_string());
        cause = c.source();
    }
    if let Some(root) = innermost.filter(|r| !said.contains(r.as_str())) {
        said = format!("{said}: {root}");
    }
    CoordinatorError::Unavailable(said)
}

impl EtcdCoordinator {
    /// Connects, opens a session, and keeps it (and this node's
    /// registrations) alive in the background for as long as the returned
    /// coordinator lives.
    pub async fn connect(cfg: EtcdConfig) -> Result<Arc<Self>, CoordinatorError> {
        let ttl = cfg.ttl.max(Duration::from_secs(1));
        let what = format!("etcd at {:?}", cfg.endpoints);
        let (client, session) = retry_within(cfg.wait, &what, || async {
            let opts = ConnectOptions::new()
                .with_connect_timeout(ttl)
                .with_keep_alive(ttl / 3, ttl);
            let client =
                tokio::time::timeout(ttl * 2, Client::connect(cfg.endpoints.clone(), Some(opts)))
                    .await
                    .map_err(|_| unavailable(format!("{what} did not answer")))?
                    .map_err(etcd_failed)?;
            let session = open_session(&client, ttl).await?;
            Ok((client, session))
        })
        .await?;
        let this = Arc::new(EtcdCoordinator {
            client,
            cfg: EtcdConfig { ttl, ..cfg },
            session: Mutex::new(session.clone()),
            registrations: Mutex::new(Vec::new()),
            closed: CancellationToken::new(),
        });
        tokio::spawn(keep_alive(
            Arc::downgrade(&this),
            session,
            this.closed.clone(),
        ));
        Ok(this)
    }

    /// Revokes the session: this node's lead and memberships end now
    /// rather than at the lease's expiry (a graceful stop).
    pub async fn close(&self) {
        self.closed.cancel();
        let session = self.session.lock().clone();
        session.lost.cancel();
        let mut client = self.client.clone();
        let _ = tokio::time::timeout(self.cfg.ttl, client.lease_revoke(session.lease)).await;
    }

    fn election(&self) -> String {
        format!("{}/election", self.cfg.prefix)
    }

    fn member_key(&self, kind: MemberKind, addr: &str) -> String {
        format!("{}/members/{}/{}", self.cfg.prefix, kind.dir(), addr)
    }

    async fn put_member(
        &self,
        kind: MemberKind,
        addr: &str,
        lease: i64,
    ) -> Result<(), CoordinatorError> {
        let mut client = self.client.clone();
        let put = client.put(
            self.member_key(kind, addr),
            addr,
            Some(PutOptions::new().with_lease(lease)),
        );
        tokio::time::timeout(self.cfg.ttl, put)
            .await
            .map_err(|_| unavailable("etcd put timed out"))?
            .map_err(etcd_failed)?;
        Ok(())
    }
}

async fn open_session(client: &Client, ttl: Duration) -> Result<Session, CoordinatorError> {
    let mut client = client.clone();
    let grant = tokio::time::timeout(ttl, client.lease_grant(ttl.as_secs() as i64, None))
        .await
        .map_err(|_| unavailable("etcd lease grant timed out"))?
        .map_err(etcd_failed)?;
    Ok(Session {
        lease: grant.id(),
        lost: CancellationToken::new(),
    })
}

/// Refreshes the session's lease every third of its TTL. When etcd reports
/// it expired, the session is lost (its leader must stop) and a new one is
/// opened, re-registering this node's memberships.
async fn keep_alive(
    coordinator: Weak<EtcdCoordinator>,
    mut session: Session,
    closed: CancellationToken,
) {
    loop {
        let Some(this) = coordinator.upgrade() else {
            return;
        };
        let (client, ttl) = (this.client.clone(), this.cfg.ttl);
        drop(this);
        refresh_until_lost(client.clone(), &session, ttl).await;
        if closed.is_cancelled() {
            return;
        }
        session.lost.cancel();
        tracing::warn!(
            lease = session.lease,
            "etcd session expired: leadership and memberships lost"
        );
        // A new session, with backoff, for as long as the coordinator lives.
        let mut backoff = Duration::from_millis(200);
        session = loop {
            let Some(this) = coordinator.upgrade() else {
                return;
            };
            match open_session(&this.client, ttl).await {
                Ok(new) => {
                    *this.session.lock() = new.clone();
                    let regs = this.registrations.lock().clone();
                    for (kind, addr) in regs {
                        if let Err(err) = this.put_member(kind, &addr, new.lease).await {
                            tracing::warn!(%err, %addr, "re-registration failed");
                        }
                    }
                    tracing::info!(lease = new.lease, "new etcd session");
                    break new;
                }
                Err(err) => tracing::warn!(%err, "cannot open an etcd session yet"),
            }
            drop(this);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(ttl);
        };
    }
}

/// Keeps one lease alive; returns once etcd says it is gone (or the
/// session was ended on purpose).
async fn refresh_until_lost(mut client: Client, session: &Session, ttl: Duration) {
    let period = ttl / 3;
    let mut stream = None;
    let mut unreachable_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = session.lost.cancelled() => return,
        }
        if stream.is_none() {
            match tokio::time::timeout(period, client.lease_keep_alive(session.lease)).await {
                Ok(Ok(pair)) => stream = Some(pair),
                Ok(Err(err)) if lease_gone(&err) => return,
                _ => {
                    note_unreachable(&mut unreachable_since);
                    continue;
                }
            }
        }
        let (keeper, responses) = stream.as_mut().expect("just set");
        let round = async {
            keeper.keep_alive().await?;
            responses.message().await
        };
        match tokio::time::timeout(period, round).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                if unreachable_since.take().is_some() {
                    tracing::info!("etcd reachable again; session kept");
                }
            }
            Ok(Ok(Some(_))) => return, // TTL 0: the lease expired
            Ok(Err(err)) if lease_gone(&err) => return,
            _ => {
                stream = None;
                note_unreachable(&mut unreachable_since);
            }
        }
    }
}

/// Runs `attempt` until it succeeds or `wait` has passed (at least once),
/// with backoff; says once, in the log, that it is waiting for `what`.
async fn retry_within<T, F, Fut>(
    wait: Duration,
    what: &str,
    mut attempt: F,
) -> Result<T, CoordinatorError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, CoordinatorError>>,
{
    let deadline = tokio::time::Instant::now() + wait;
    let mut backoff = Duration::from_millis(100);
    let mut said = false;
    loop {
        let err = match attempt().await {
            Ok(done) => return Ok(done),
            Err(err) => err,
        };
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(err);
        }
        if !said {
            said = true;
            tracing::warn!(%err, "waiting for {what} (at most {wait:?})");
        }
        tokio::time::sleep(backoff.min(deadline - now)).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// etcd's answer for a lease that expired (or was revoked).
fn lease_gone(err: &etcd_client::Error) -> bool {
    err.to_string().contains("lease not found")
}

fn note_unreachable(since: &mut Option<tokio::time::Instant>) {
    if since.is_none() {
        *since = Some(tokio::time::Instant::now());
        tracing::warn!("etcd unreachable: keeping the current session and serving on");
    }
}

impl Coordinator for EtcdCoordinator {
    fn campaign(&self, addr: String) -> BoxFuture<'_, Result<Leadership, CoordinatorError>> {
        Box::pin(async move {
            let session = self.session.lock().clone();
            let mut client = self.client.clone();
            let won = tokio::select! {
                won = client.campaign(self.election(), addr.clone(), session.lease) => match won {
                    Ok(won) => won,
                    Err(err) => {
                        if lease_gone(&err) {
                            // The keep-alive task opens a new session.
                            session.lost.cancel();
                        }
                        return Err(etcd_failed(err));
                    }
                },
                _ = session.lost.cancelled() => {
                    return Err(unavailable("etcd session expired while campaigning"));
                }
            };
            let key = won
                .leader()
                .ok_or_else(|| unavailable("campaign answered without a leader key"))?;
            Ok(Leadership {
                revision: key.rev() as u64,
                lost: session.lost.clone(),
            })
        })
    }

    fn leader(&self) -> BoxFuture<'_, Result<Option<LeaderInfo>, CoordinatorError>> {
        Box::pin(async move {
            let mut client = self.client.clone();
            let answer = tokio::time::timeout(self.cfg.ttl, client.leader(self.election()))
                .await
                .map_err(|_| unavailable("etcd leader query timed out"))?;
            match answer {
                Ok(resp) => Ok(resp.kv().and_then(|kv| {
                    Some(LeaderInfo {
                        addr: kv.value_str().ok()?.to_string(),
                        revision: kv.create_revision() as u64,
                    })
                })),
                Err(err) if err.to_string().contains("no leader") => Ok(None),
                Err(err) => Err(etcd_failed(err)),
            }
        })
    }

    fn register(
        &self,
        kind: MemberKind,
        addr: String,
    ) -> BoxFuture<'_, Result<(), CoordinatorError>> {
        Box::pin(async move {
            let what = format!("registering {addr} in etcd");
            retry_within(self.cfg.wait, &what, || async {
                let lease = self.session.lock().lease;
                self.put_member(kind, &addr, lease).await
            })
            .await?;
            self.registrations.lock().push((kind, addr));
            Ok(())
        })
    }

    fn members(&self, kind: MemberKind) -> BoxFuture<'_, Result<Vec<String>, CoordinatorError>> {
        Box::pin(async move {
            let mut client = self.client.clone();
            let prefix = format!("{}/members/{}/", self.cfg.prefix, kind.dir());
            let got = tokio::time::timeout(
                self.cfg.ttl,
                client.get(prefix, Some(GetOptions::new().with_prefix())),
            )
            .await
            .map_err(|_| unavailable("etcd get timed out"))?
            .map_err(etcd_failed)?;
            Ok(got
                .kvs()
                .iter()
                .filter_map(|kv| kv.value_str().ok().map(str::to_string))
                .collect())
        })
    }
}
