//! The daemon's link to the meta service: register, then report liveness,
//! pool use and self-initiated removals (evictions, corruption) in batches.
//! Reconnects with backoff; a meta service that is down never stalls the
//! data path.

use std::sync::Arc;
use std::time::Duration;

use mooncake_net::{Connection, ErrorSource};
use mooncake_proto::frame::{MAX_BATCH, MAX_CONTROL_BODY};
use mooncake_proto::message::{Body, EngineTag};
use mooncake_proto::message::{
    Empty, EventsRequest, HeartbeatRequest, HeartbeatResponse, InventoryRequest, LeaveRequest,
    RegisterRequest, RegisterResponse,
};
use mooncake_proto::Opcode;
use tokio_util::sync::CancellationToken;

use crate::pool::DramPool;
use crate::tiers::Tiers;
use crate::MetaTarget;

/// What the daemon remembers across sessions with (possibly different)
/// leaders.
#[derive(Default)]
struct Memory {
    /// The id the last leader gave us, offered to the next one.
    id: u32,
    /// The highest leader revision seen: an older leader is stale.
    revision: u64,
}

pub struct LinkConfig {
    pub target: MetaTarget,
    pub node: String,
    pub advertise: String,
    /// Transports served besides TCP, advertised at registration.
    pub endpoints: Vec<mooncake_proto::transport::Endpoint>,
    pub interval: Duration,
    /// Presented to a meta service that requires authentication.
    pub token: Option<String>,
    /// Whether this daemon requires a token of its clients (`auth`).
    pub requires_auth: bool,
    /// How the meta service is reached: plain TCP, or with `peer_ca` TLS
    /// over TCP or QUIC.
    pub dialer: mooncake_net::Dialer,
    /// The meta service this daemon is registered with, and its id there
    /// (0 while not registered).
    pub registered: tokio::sync::watch::Sender<Registration>,
}

/// The meta service a daemon is registered with, and the id it gave it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registration {
    /// 0 while not registered.
    pub id: u32,
    /// The meta service's address (the leader's, with etcd).
    pub meta: String,
}

/// How long a stopping daemon spends telling the meta service it leaves.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most bytes of engine tags in one inventory request.
const MAX_INVENTORY_TAG_BYTES: usize = MAX_CONTROL_BODY as usize / 2;

/// Keeps the daemon registered until `shutdown`, then tells the meta
/// service that it leaves.
pub async fn run(cfg: LinkConfig, tiers: Arc<Tiers>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    let mut memory = Memory::default();
    loop {
        let session = session(&cfg, &tiers, &mut memory, &shutdown);
        tokio::select! {
            result = session => {
                match result {
                    Ok(()) => break,
                    Err(err) => {
                        cfg.registered.send_replace(Registration::default());
                        tracing::warn!(%err, "meta link lost; reconnecting");
                    }
                }
            }
            _ = shutdown.cancelled() => break,
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => break,
        }
        backoff = (backoff * 2).min(Duration::from_millis(250));
    }
    // Nothing is admitted from now on (`admit`): the daemon leaves.
    cfg.registered.send_replace(Registration::default());
    if memory.id != 0 {
        leave(&cfg, memory.id).await;
    }
}

/// Tells the meta service that this daemon stops, so that its blocks leave
/// the index and no put is placed on it from now on, instead of after its
/// heartbeats run out. Bounded: a meta service that does not answer learns
/// it from the missing heartbeats.
async fn leave(cfg: &LinkConfig, daemon: u32) {
    let told = async {
        let addr = meta_addr(&cfg.target).await?;
        let mut conn = connect(cfg, &addr, LEAVE_TIMEOUT).await?;
        let req = LeaveRequest {
            daemon,
            addr: cfg.advertise.clone(),
        };
        conn.call::<Empty>(Opcode::Leave, &req, "leave").await?;
        Ok::<_, LinkError>(addr)
    };
    match tokio::time::timeout(LEAVE_TIMEOUT, told).await {
        Ok(Ok(meta)) => tracing::info!(daemon, %meta, "left the meta service"),
        Ok(Err(err)) => {
            tracing::warn!(daemon, %err, "could not tell the meta service that this daemon leaves")
        }
        Err(_) => tracing::warn!(
            daemon,
            "the meta service did not answer this daemon's leave within {LEAVE_TIMEOUT:?}"
        ),
    }
}

/// A connection to the meta service at `addr`, authenticated if the
/// daemon has a token.
async fn connect(
    cfg: &LinkConfig,
    addr: &str,
    deadline: Duration,
) -> Result<Connection, LinkError> {
    let mut conn = cfg.dialer.open(addr, ErrorSource::Meta, deadline).await?;
    if let Some(token) = &cfg.token {
        with_deadline(addr, deadline, conn.authenticate(token)).await?;
    }
    Ok(conn)
}

/// Why a session with the meta service ended.
#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error("{0}")]
    Client(#[from] mooncake_net::CallError),
    #[error("no meta leader: {0}")]
    NoLeader(String),
    #[error("the meta service at {0} requires authentication and refuses a daemon that does not: start this daemon with `auth` (a token file) too")]
    OpenDaemon(String),
    #[error(
        "meta service at {addr} leads at revision {revision}, older than {seen}: stale, ignored"
    )]
    Stale {
        addr: String,
        revision: u64,
        seen: u64,
    },
}

async fn meta_addr(target: &MetaTarget) -> Result<String, LinkError> {
    match target {
        MetaTarget::Addr(addr) => Ok(addr.clone()),
        MetaTarget::Leader(c) => match c.leader().await {
            Ok(Some(leader)) => Ok(leader.addr),
            Ok(None) => Err(LinkError::NoLeader("none elected".into())),
            Err(err) => Err(LinkError::NoLeader(err.to_string())),
        },
        MetaTarget::None => Err(LinkError::NoLeader("no meta service configured".into())),
    }
}

/// One session with the leader: register, send the inventory (so that a
/// new leader rebuilds its index), then report until something breaks.
async fn session(
    cfg: &LinkConfig,
    tiers: &Tiers,
    memory: &mut Memory,
    shutdown: &CancellationToken,
) -> Result<(), LinkError> {
    let pool: &DramPool = &tiers.dram;
    let deadline = cfg.interval.max(Duration::from_secs(1)) * 3;
    let addr = meta_addr(&cfg.target).await?;
    let mut conn = connect(cfg, &addr, deadline).await?;
    let register = RegisterRequest {
        node: cfg.node.clone(),
        addr: cfg.advertise.clone(),
        capacity: pool.stats().capacity,
        id_hint: memory.id,
        endpoints: cfg.endpoints.clone(),
        requires_auth: cfg.requires_auth,
    };
    let answer = with_deadline(
        &addr,
        deadline,
        conn.call::<RegisterResponse>(Opcode::Register, &register, "register"),
    )
    .await
    .map_err(|err| match err {
        mooncake_net::CallError::Server {
            code: mooncake_proto::ErrorCode::Unauthorized,
            ..
        } if !cfg.requires_auth && cfg.token.is_some() => LinkError::OpenDaemon(addr.clone()),
        err => LinkError::Client(err),
    })?;
    if answer.revision < memory.revision {
        return Err(LinkError::Stale {
            addr,
            revision: answer.revision,
            seen: memory.revision,
        });
    }
    memory.revision = answer.revision;
    memory.id = answer.daemon;
    let id = answer.daemon;
    tiers.keep_tags(answer.keep_tags);
    // Removals from before the inventory are already reflected in it.
    tiers.forget_tags(&tiers.still_gone(pool.take_removed()));
    let inventory = tiers.inventory();
    let batches = inventory_batches(&inventory);
    with_deadline(
        &addr,
        deadline * (1 + batches.len() as u32 / 64),
        send_inventory(&mut conn, id, &batches),
    )
    .await?;
    tracing::info!(
        daemon = id,
        meta = %addr,
        revision = answer.revision,
        blocks = inventory.len(),
        "registered with the meta service"
    );
    cfg.registered.send_replace(Registration {
        id,
        meta: addr.clone(),
    });
    let mut tick = tokio::time::interval(cfg.interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = pool.removed_ready() => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
        let removed = tiers.still_gone(pool.take_removed());
        tiers.forget_tags(&removed);
        let moved = tiers.take_moved();
        // Removals first: a block removed and then put again is sent as
        // removed and then moved (to the tier it is in now).
        let rounds = removed
            .len()
            .div_ceil(MAX_BATCH)
            .max(moved.len().div_ceil(MAX_BATCH));
        for round in 0..rounds {
            let part = |n: usize| round * MAX_BATCH..((round + 1) * MAX_BATCH).min(n);
            let events = EventsRequest {
                daemon: id,
                removed: removed
                    .get(part(removed.len()))
                    .unwrap_or_default()
                    .to_vec(),
                moved: moved.get(part(moved.len())).unwrap_or_default().to_vec(),
            };
            with_deadline(
                &addr,
                deadline,
                conn.call::<Empty>(Opcode::Events, &events, "events"),
            )
            .await?;
        }
        let beat = HeartbeatRequest {
            daemon: id,
            stats: pool.stats(),
            hot: tiers.hot.take_top(),
        };
        let answer: HeartbeatResponse = with_deadline(
            &addr,
            deadline,
            conn.call(Opcode::Heartbeat, &beat, "heartbeat"),
        )
        .await?;
        // Readers looked for these after this daemon evicted them.
        for key in &answer.missed {
            pool.missed(key);
        }
    }
}

/// The inventory cut into requests of at most `MAX_BATCH` blocks and
/// `MAX_INVENTORY_TAG_BYTES` of engine tags (at least one block each), so
/// that each fits a control frame.
fn inventory_batches(
    inventory: &[crate::tiers::InventoryBlock],
) -> Vec<&[crate::tiers::InventoryBlock]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, block) in inventory.iter().enumerate() {
        let tag = block.tag.as_deref().map_or(0, EngineTag::encoded_len);
        if i > start && (i - start == MAX_BATCH || bytes + tag > MAX_INVENTORY_TAG_BYTES) {
            out.push(&inventory[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += tag;
    }
    if start < inventory.len() {
        out.push(&inventory[start..]);
    }
    out
}

/// Streams the inventory in batches, pipelined: every batch is written
/// while the acknowledgements of earlier ones are read.
async fn send_inventory(
    conn: &mut Connection,
    daemon: u32,
    chunks: &[&[crate::tiers::InventoryBlock]],
) -> Result<(), mooncake_net::CallError> {
    let addr = conn.addr().to_string();
    let (writer, reader) = conn.split();
    let write = async {
        for chunk in chunks {
            let items = chunk.to_vec();
            let body = InventoryRequest { daemon, items }.to_bytes();
            writer.send(Opcode::Inventory, &body, &[]).await?;
        }
        writer.flush().await
    };
    let read = async {
        for _ in chunks {
            let header = reader.next_header(Opcode::Inventory).await?;
            reader.discard(header.body_len as usize).await?;
            if header.status != 0 {
                return Err(reader.status_error(header.status, "inventory"));
            }
        }
        Ok(())
    };
    let (written, read) = tokio::join!(write, read);
    written.map_err(|err| mooncake_net::CallError::Io {
        side: ErrorSource::Meta,
        addr,
        err,
    })?;
    read
}

async fn with_deadline<T>(
    addr: &str,
    deadline: Duration,
    fut: impl std::future::Future<Output = Result<T, mooncake_net::CallError>>,
) -> Result<T, mooncake_net::CallError> {
    tokio::time::timeout(deadline, fut)
        .await
        .unwrap_or_else(|_| {
            Err(mooncake_net::CallError::Timeout {
                side: ErrorSource::Meta,
                addr: addr.to_string(),
                op: "meta link",
                timeout_ms: deadline.as_millis() as u64,
            })
        })
}
