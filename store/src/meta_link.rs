//! The daemon's link to the meta service: register, then report liveness,
//! pool use and self-initiated removals (evictions, corruption) in batches.
//! Reconnects with backoff; a meta service that is down never stalls the
//! data path.

use std::sync::Arc;
use std::time::Duration;

use mooncake_client::{Connection, ErrorSource};
use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::message::{
    Empty, EventsRequest, HeartbeatRequest, RegisterRequest, RegisterResponse,
};
use mooncake_proto::Opcode;
use tokio_util::sync::CancellationToken;

use crate::pool::DramPool;

pub struct LinkConfig {
    pub meta_addr: String,
    pub node: String,
    pub advertise: String,
    pub interval: Duration,
}

pub async fn run(cfg: LinkConfig, pool: Arc<DramPool>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let session = session(&cfg, &pool, &shutdown);
        tokio::select! {
            result = session => {
                if let Err(err) = result {
                    tracing::warn!(meta = %cfg.meta_addr, %err, "meta link lost; reconnecting");
                }
            }
            _ = shutdown.cancelled() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn session(
    cfg: &LinkConfig,
    pool: &DramPool,
    shutdown: &CancellationToken,
) -> Result<(), mooncake_client::ClientError> {
    let deadline = cfg.interval.max(Duration::from_secs(1)) * 3;
    let mut conn = Connection::connect(&cfg.meta_addr, ErrorSource::Meta, deadline).await?;
    let register = RegisterRequest {
        node: cfg.node.clone(),
        addr: cfg.advertise.clone(),
        capacity: pool.stats().capacity,
    };
    let id = with_deadline(
        deadline,
        conn.call::<RegisterResponse>(Opcode::Register, &register, "register"),
    )
    .await?
    .daemon;
    tracing::info!(daemon = id, meta = %cfg.meta_addr, "registered with the meta service");
    let mut tick = tokio::time::interval(cfg.interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = pool.removed_ready() => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
        let removed = pool.take_removed();
        for chunk in removed.chunks(MAX_BATCH) {
            let events = EventsRequest {
                daemon: id,
                removed: chunk.to_vec(),
            };
            with_deadline(
                deadline,
                conn.call::<Empty>(Opcode::Events, &events, "events"),
            )
            .await?;
        }
        let beat = HeartbeatRequest {
            daemon: id,
            stats: pool.stats(),
        };
        with_deadline(
            deadline,
            conn.call::<Empty>(Opcode::Heartbeat, &beat, "heartbeat"),
        )
        .await?;
    }
}

async fn with_deadline<T>(
    deadline: Duration,
    fut: impl std::future::Future<Output = Result<T, mooncake_client::ClientError>>,
) -> Result<T, mooncake_client::ClientError> {
    tokio::time::timeout(deadline, fut)
        .await
        .unwrap_or_else(|_| {
            Err(mooncake_client::ClientError::Timeout {
                side: ErrorSource::Meta,
                addr: String::new(),
                op: "meta link",
                timeout_ms: deadline.as_millis() as u64,
            })
        })
}
