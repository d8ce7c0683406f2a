//! A client's leases and reservations on the DRAM pool, for the data paths
//! where the client moves the bytes itself: same-host shared memory (over
//! the daemon's Unix socket) and RDMA (over its RDMA control port). Either
//! way the connection carries the same requests: lease a block so that it
//! stays in place while the client reads it (`ShmGet`, `ShmRelease`),
//! reserve room and have the client's bytes verified and stored
//! (`ShmPut`, `ShmCommit`; or in one message into room held ahead,
//! `ShmRoom`, `ShmStore`: `rooms`), and note reads the client made
//! without a lease (`ShmTouch`). Everything a connection holds ends when
//! it goes away.
//! A same-host session also takes small puts with their bytes in the frame
//! (`Put`, as over TCP): one round trip instead of reserve and commit.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use mooncake_proto::message::{
    Body, EngineTag, KeyRequest, ShmCommitRequest, ShmLease, ShmPutRequest, ShmRelease,
    ShmRoomRequest, ShmSlot, ShmStoreRequest, ShmTouch,
};
use mooncake_proto::{BlockKey, ErrorCode, Header, Opcode, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::admit::Admitter;
use crate::pool::{PoolError, ReadLease, WriteSlot};
use crate::server::DataService;
use crate::tiers::Tiers;

mod admits;
mod rooms;

/// Leases (and reserved slots) one client may hold at once.
const MAX_LEASES: usize = 1 << 16;
/// Longest a writer waits for the demotion queue before its put evicts.
const BACKPRESSURE: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves one client's lease requests on `stream` until it goes away, sends
/// something else, or `shutdown`; counted in `sessions` meanwhile. Puts
/// with their bytes are taken where `puts` serves them: a same-host
/// session, whose client maps the pool and so may also hash the bytes it
/// wrote there itself and say their checksum at commit (`ShmCommitRequest`);
/// over RDMA only this daemon's CPU reads them, so it checks them.
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    tiers: &Arc<Tiers>,
    (puts, admitter): (Option<&DataService>, Option<&Admitter>),
    sessions: &prometheus::IntGauge,
    shutdown: &CancellationToken,
) -> io::Result<()> {
    sessions.inc();
    let _open = Open(sessions);
    // A request's header, body and a small put's bytes in one read where
    // they came together. Answers gather in `out`, written at once when no
    // whole request is left to read without waiting (a client keeps many
    // unanswered: one write for all their answers, not two each).
    let stream = &mut tokio::io::BufReader::with_capacity(64 << 10, stream);
    let mut out: Vec<u8> = Vec::with_capacity(4 << 10);
    let pool = &tiers.dram;
    let same_host = puts.is_some();
    // Every lease this client holds; all end when it goes away.
    let mut leases: HashMap<u64, ReadLease> = HashMap::new();
    // Blocks reserved and being written by this client; dropped (their
    // space freed) if it goes away before committing.
    // Each reserved slot, with the key and the engine's tag it was put with.
    let mut slots: HashMap<u64, (WriteSlot, BlockKey, Option<Arc<EngineTag>>)> = HashMap::new();
    // Room held ahead for blocks this client has not named yet.
    let mut rooms = rooms::Rooms::default();
    // Same-host puts of one round trip waiting for their admission; asked
    // about together before any later request is answered.
    let mut admits = admits::Admits::default();
    let mut next_lease = 1u64;
    loop {
        if !request_waits(stream.buffer()) {
            admits.settle(admitter, &mut rooms, tiers, &mut out).await;
            if !out.is_empty() {
                stream.write_all(&out).await?;
                out.clear();
            }
        }
        let mut raw = [0u8; HEADER_LEN];
        tokio::select! {
            read = stream.read_exact(&mut raw) => match read {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            },
            _ = shutdown.cancelled() => return Ok(()),
        }
        let parsed = Header::parse(&raw);
        if let (Ok(Some(h)), Some(service)) = (&parsed, puts) {
            if !h.response && h.opcode == Opcode::Put {
                // It answers, or ends the session on a broken frame: the
                // answers before it go first.
                admits.settle(admitter, &mut rooms, tiers, &mut out).await;
                stream.write_all(&out).await?;
                out.clear();
                service
                    .put_on(*h, stream)
                    .await
                    .map_err(|err| io::Error::other(err.to_string()))?;
                continue;
            }
        }
        let header = match parsed {
            Ok(Some(h))
                if !h.response
                    && matches!(
                        h.opcode,
                        Opcode::ShmGet
                            | Opcode::ShmRelease
                            | Opcode::ShmPut
                            | Opcode::ShmCommit
                            | Opcode::ShmTouch
                            | Opcode::ShmRoom
                            | Opcode::ShmStore
                            | Opcode::ShmAdmit
                    )
                    && (pool.serves_rooms()
                        || !matches!(
                            h.opcode,
                            Opcode::ShmRoom | Opcode::ShmStore | Opcode::ShmAdmit
                        )) =>
            {
                h
            }
            Ok(_) => {
                out.extend_from_slice(&Header::error_reply(&raw, ErrorCode::UnknownOpcode as u16));
                stream.write_all(&out).await?;
                return Ok(());
            }
            Err(err) => {
                out.extend_from_slice(&Header::error_reply(&raw, err.code() as u16));
                stream.write_all(&out).await?;
                return Ok(());
            }
        };
        let mut body = vec![0u8; header.body_len as usize];
        stream.read_exact(&mut body).await?;
        if header.opcode == Opcode::ShmAdmit {
            match (ShmStoreRequest::from_bytes(&body), admitter) {
                (Ok(req), Some(_)) if same_host => {
                    admits.take(header, req, &mut rooms, tiers);
                    continue;
                }
                // Without a meta service to ask, or with clients that must
                // show a token (which this socket does not carry): the
                // writer puts its blocks the usual way from now on.
                (Ok(_), _) => {
                    let h = Header::response(
                        header.opcode,
                        header.request_id,
                        ErrorCode::UnknownOpcode as u16,
                        0,
                    );
                    out.extend_from_slice(&h.encode());
                    continue;
                }
                (Err(err), _) => {
                    let h =
                        Header::response(header.opcode, header.request_id, err.code() as u16, 0);
                    out.extend_from_slice(&h.encode());
                    continue;
                }
            }
        }
        admits.settle(admitter, &mut rooms, tiers, &mut out).await;
        let (code, answer) = match header.opcode {
            Opcode::ShmGet => match KeyRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(_) if leases.len() >= MAX_LEASES => (ErrorCode::Busy, Vec::new()),
                Ok(req) => match in_dram(tiers, &req.key).await {
                    None => {
                        pool.note_get(false);
                        (ErrorCode::NotFound, Vec::new())
                    }
                    Some(lease) => {
                        pool.note_get(true);
                        tiers.hot.note(&req.key);
                        let id = next_lease;
                        next_lease += 1;
                        let answer = ShmLease {
                            lease: id,
                            offset: lease.byte_offset(),
                            len: lease.len() as u32,
                            checksum: lease.checksum(),
                        };
                        leases.insert(id, lease);
                        (ErrorCode::Ok, answer.to_bytes())
                    }
                },
            },
            Opcode::ShmPut => match ShmPutRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(_) if slots.len() >= MAX_LEASES => (ErrorCode::Busy, Vec::new()),
                Ok(req) if req.checksum.is_none() && !same_host => {
                    (ErrorCode::Malformed, Vec::new())
                }
                Ok(req) => {
                    let key = req.key.clone();
                    let reserved = tiers
                        .reserve_put(req.key, req.len, req.checksum, BACKPRESSURE)
                        .await;
                    match reserved {
                        Err(err) => (err.code(), Vec::new()),
                        Ok(mut slot) => {
                            slot.set_parent(req.parent);
                            slot.set_continues(req.continues);
                            let id = next_lease;
                            next_lease += 1;
                            let answer = ShmSlot {
                                slot: id,
                                offset: slot.byte_offset(),
                            };
                            slots.insert(id, (slot, key, req.tag));
                            (ErrorCode::Ok, answer.to_bytes())
                        }
                    }
                }
            },
            Opcode::ShmCommit => match ShmCommitRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) if req.checksum.is_some() && !same_host => {
                    (ErrorCode::Malformed, Vec::new())
                }
                Ok(req) => match slots.remove(&req.slot) {
                    None => (ErrorCode::NoReservation, Vec::new()),
                    Some((slot, key, tag)) => match commit(tiers, slot, req.checksum) {
                        Ok(()) => {
                            tiers.set_tag(&key, tag);
                            (ErrorCode::Ok, Vec::new())
                        }
                        Err(e) => (e.code(), Vec::new()),
                    },
                },
            },
            Opcode::ShmRoom => match ShmRoomRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) => (ErrorCode::Ok, rooms.reserve(tiers, req).to_bytes()),
            },
            Opcode::ShmStore => match ShmStoreRequest::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) => {
                    let (code, next) = rooms.store(tiers, req, same_host);
                    (code, next.map(|r| r.to_bytes()).unwrap_or_default())
                }
            },
            Opcode::ShmTouch => match ShmTouch::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) => {
                    for key in &req.keys {
                        if pool.touch(key) {
                            pool.note_get(true);
                            tiers.hot.note(key);
                        }
                    }
                    (ErrorCode::Ok, Vec::new())
                }
            },
            _ => match ShmRelease::from_bytes(&body) {
                Err(err) => (err.code(), Vec::new()),
                Ok(req) => {
                    for id in req.leases {
                        leases.remove(&id);
                    }
                    (ErrorCode::Ok, Vec::new())
                }
            },
        };
        let h = Header::response(
            header.opcode,
            header.request_id,
            code as u16,
            answer.len() as u32,
        );
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(&answer);
    }
}

/// Whether `buffered` holds a whole request (header and body) to serve
/// without reading: else the answers gathered go out first.
fn request_waits(buffered: &[u8]) -> bool {
    let Some(raw) = buffered.get(..HEADER_LEN) else {
        return false;
    };
    match Header::parse(raw) {
        // A put's value is read from the socket: its answers go first.
        Ok(Some(h)) => {
            h.opcode != Opcode::Put && buffered.len() >= HEADER_LEN + h.body_len as usize
        }
        // A broken header is answered at once.
        _ => true,
    }
}

/// Makes a written slot visible: checked against the checksum given at
/// reservation (`sum` none: this CPU hashes the bytes), or with the
/// checksum its same-host writer computed of them in place.
fn commit(tiers: &Tiers, slot: WriteSlot, sum: Option<u64>) -> Result<(), PoolError> {
    match sum {
        None => slot.commit(),
        Some(sum) => tiers.commit_put(slot, sum),
    }
}

/// Counts a session out when it ends, however it ends.
struct Open<'a>(&'a prometheus::IntGauge);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests;

/// The block in DRAM, read-leased; where a lease's read of it from a drive
/// is under way, once that read is done (the same-host reader then reads
/// DRAM, rather than fall back to a read of the drive over TCP).
async fn in_dram(tiers: &crate::tiers::Tiers, key: &mooncake_proto::BlockKey) -> Option<ReadLease> {
    match tiers.dram.get(key) {
        None if tiers.join_prefetch(key).await => tiers.dram.get(key),
        found => found,
    }
}
