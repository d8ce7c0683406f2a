//! A copy made again: at the meta service's request (`Fetch`), this daemon
//! reads a block from another daemon that holds it, straight into room
//! reserved in its own pool, and stores it only if the bytes hash to the
//! checksum the index holds. Nothing of a failed fetch stays: the reserved
//! room is freed when the slot drops.

use std::time::Duration;

use mooncake_net::{CallError, Dialer, ErrorSource};
use mooncake_proto::message::{Body, FetchRequest, KeyRequest, GET_HEAD_LEN};
use mooncake_proto::{ErrorCode, Opcode};

use crate::tiers::Tiers;
use crate::PoolError;

/// How this daemon calls the others: as it calls the meta service.
#[derive(Clone)]
pub struct Peers {
    pub dialer: Dialer,
    /// Presented to daemons that require authentication (role cluster).
    pub token: Option<String>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish_non_exhaustive()
    }
}

impl Default for Peers {
    fn default() -> Self {
        Peers {
            dialer: Dialer::Tcp,
            token: None,
        }
    }
}

/// Fetches `req`'s block from `req.from` within `within`; the answer says
/// what became of it (`Ok`: stored, or already held with these bytes).
pub async fn fetch(req: FetchRequest, tiers: &Tiers, peers: &Peers, within: Duration) -> ErrorCode {
    if tiers.contains(&req.key) {
        return ErrorCode::Ok;
    }
    let from = req.from.clone();
    match tokio::time::timeout(within, copy(req, tiers, peers, within)).await {
        Ok(Ok(())) => ErrorCode::Ok,
        Ok(Err(Failed::Pool(PoolError::AlreadyExists))) => ErrorCode::Ok,
        Ok(Err(Failed::Pool(err))) => err.code(),
        Ok(Err(Failed::Call(err))) => {
            tracing::warn!(%from, %err, "fetching a block from another daemon failed");
            err.code().unwrap_or(ErrorCode::Unavailable)
        }
        Ok(Err(Failed::Code(code))) => code,
        Err(_) => ErrorCode::Timeout,
    }
}

enum Failed {
    Pool(PoolError),
    Call(CallError),
    Code(ErrorCode),
}

impl From<CallError> for Failed {
    fn from(err: CallError) -> Self {
        Failed::Call(err)
    }
}

async fn copy(
    req: FetchRequest,
    tiers: &Tiers,
    peers: &Peers,
    within: Duration,
) -> Result<(), Failed> {
    let mut conn = peers
        .dialer
        .open(&req.from, ErrorSource::Daemon, within)
        .await?;
    if let Some(token) = &peers.token {
        conn.authenticate(token).await?;
    }
    let mut slot = tiers
        .reserve_put(
            req.key.clone(),
            u64::from(req.size),
            Some(req.checksum),
            within / 2,
        )
        .await
        .map_err(Failed::Pool)?;
    let (writer, reader) = conn.split();
    let ask = KeyRequest { key: req.key }.to_bytes();
    let sent = async {
        writer.send(Opcode::Get, &ask, &[]).await?;
        writer.flush().await
    };
    sent.await
        .map_err(|e| Failed::Call(CallError::io(ErrorSource::Daemon, &req.from, e)))?;
    let header = reader.next_header(Opcode::Get).await?;
    if header.status != ErrorCode::Ok as u16 {
        return Err(Failed::Code(
            ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal),
        ));
    }
    if header.body_len as usize != GET_HEAD_LEN + req.size as usize {
        // Other bytes under the key there: not the block the index names.
        return Err(Failed::Code(ErrorCode::ChecksumMismatch));
    }
    let mut head = [0u8; GET_HEAD_LEN];
    reader.read_into(&mut head).await?;
    let sum = reader.read_into_hashed(slot.buf_mut()).await?;
    slot.commit_hashed(sum).map_err(Failed::Pool)
}
