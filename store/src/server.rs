//! The daemon's data service: what it answers on a connection (a TCP
//! connection, or a QUIC stream) once the server skeleton
//! (`mooncake-server`) has admitted it and read a request's header. Values
//! land straight in the pool and leave straight from it.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use mooncake_proto::auth::Identity;
use mooncake_proto::message::{Body, KeyRequest, KeysRequest, PutHead, Statuses};
use mooncake_proto::{ErrorCode, Header, Opcode, ProtoError, HEADER_LEN};
use mooncake_server::{read_body, reply, ConnError, Service, IO_BUFFER};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::metrics::DaemonMetrics;
use crate::tiers::Tiers;

/// How the daemon serves requests, beyond the limits every server applies.
#[derive(Debug, Clone)]
pub struct DataConfig {
    pub verify_on_read: bool,
    /// The server's `request_timeout`: a put waits at most half of it for
    /// room in the pool.
    pub request_timeout: Duration,
    /// A put whose value stops arriving for this long is dropped, and the
    /// room reserved for it freed.
    pub put_stall_timeout: Duration,
    /// How other daemons are called (`Fetch`).
    pub peers: crate::fetch::Peers,
    /// How long a `Hold` keeps a block from eviction.
    pub kv_lease_ttl: Duration,
}

/// The daemon's answers to block requests, whichever transport they came on.
pub struct DataService {
    pub tiers: Arc<Tiers>,
    pub cfg: DataConfig,
    pub metrics: Arc<DaemonMetrics>,
}

impl DataService {
    /// A `Put` with its bytes in the frame, on a same-host session: served
    /// as over TCP. Same-host sessions exist only on daemons without
    /// tokens, so the client may use every namespace.
    pub(crate) async fn put_on<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        header: Header,
        stream: &mut S,
    ) -> Result<ErrorCode, ConnError> {
        let (mut rd, mut wr) = tokio::io::split(stream);
        let who = Identity::open();
        handle_put(
            header,
            &mut rd,
            &mut wr,
            &self.tiers,
            &self.metrics,
            &self.cfg,
            &who,
        )
        .await
    }
}

impl Service for DataService {
    type Session = ();

    fn session(&self, _: std::net::SocketAddr) {}

    fn serves(&self, op: Opcode) -> bool {
        crate::metrics::OPS.contains(&op)
    }

    async fn handle<R, W>(
        &self,
        _: &mut (),
        header: Header,
        rd: &mut R,
        wr: &mut W,
        who: &Identity,
    ) -> Result<ErrorCode, ConnError>
    where
        R: AsyncRead + Unpin + Send,
        W: AsyncWrite + Unpin + Send,
    {
        handle(header, rd, wr, &self.tiers, &self.cfg, &self.metrics, who).await
    }
}

async fn handle<R, W>(
    header: Header,
    rd: &mut R,
    wr: &mut W,
    tiers: &Arc<Tiers>,
    cfg: &DataConfig,
    metrics: &DaemonMetrics,
    who: &Identity,
) -> Result<ErrorCode, ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let pool = &tiers.dram;
    match header.opcode {
        Opcode::Put => handle_put(header, rd, wr, tiers, metrics, cfg, who).await,
        Opcode::Get => {
            let req: KeyRequest = read_body(header, rd).await?;
            if !who.may_use(&req.key.namespace) {
                return reply(wr, header, ErrorCode::Unauthorized, &[]).await;
            }
            handle_get(header, req, wr, tiers, cfg.verify_on_read, metrics).await
        }
        Opcode::Verify => {
            let req: KeyRequest = read_body(header, rd).await?;
            if !who.may_use(&req.key.namespace) {
                return reply(wr, header, ErrorCode::Unauthorized, &[]).await;
            }
            let code = match pool.get(&req.key) {
                None => ErrorCode::NotFound,
                Some(lease) if lease.verify() => ErrorCode::Ok,
                Some(lease) => {
                    pool.drop_corrupt(&lease);
                    ErrorCode::Corrupt
                }
            };
            reply(wr, header, code, &[]).await
        }
        Opcode::Evict => {
            let req: mooncake_proto::message::EvictRequest = read_body(header, rd).await?;
            let (bytes, blocks) = pool.evict_bytes(req.bytes);
            tracing::info!(bytes, blocks, "evicted on an operator's request");
            let answer = mooncake_proto::message::EvictResponse { bytes, blocks };
            reply(wr, header, ErrorCode::Ok, &answer.to_bytes()).await
        }
        Opcode::Remove | Opcode::RemoveUnleased | Opcode::LeaseOf | Opcode::Pin | Opcode::Unpin => {
            let req: KeyRequest = read_body(header, rd).await?;
            if !who.may_use(&req.key.namespace) {
                return reply(wr, header, ErrorCode::Unauthorized, &[]).await;
            }
            let result = match header.opcode {
                Opcode::Remove => {
                    if tiers.remove(&req.key) {
                        Ok(())
                    } else {
                        Err(crate::PoolError::NotFound)
                    }
                }
                Opcode::RemoveUnleased => match tiers.remove_unleased(&req.key) {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(crate::PoolError::NotFound),
                    Err(err) => Err(err),
                },
                Opcode::LeaseOf => match tiers.lease_of(&req.key) {
                    Some(false) => Ok(()),
                    Some(true) => Err(crate::PoolError::Leased),
                    None => Err(crate::PoolError::NotFound),
                },
                Opcode::Pin => pool.pin(&req.key),
                _ => pool.unpin(&req.key),
            };
            let code = result.err().map_or(ErrorCode::Ok, |e| e.code());
            reply(wr, header, code, &[]).await
        }
        Opcode::Hold => {
            let req: KeysRequest = read_body(header, rd).await?;
            if !who.may_use(&req.namespace) {
                return reply(wr, header, ErrorCode::Unauthorized, &[]).await;
            }
            let until = std::time::Instant::now() + cfg.kv_lease_ttl;
            let codes = req
                .hashes
                .iter()
                .map(|hash| {
                    let key = mooncake_proto::BlockKey::new(req.namespace.clone(), *hash);
                    tiers
                        .hold(&key, until)
                        .err()
                        .map_or(ErrorCode::Ok, |e| e.code())
                })
                .collect();
            reply(wr, header, ErrorCode::Ok, &Statuses { codes }.to_bytes()).await
        }
        Opcode::Fetch => {
            // The meta service's call (role cluster, checked by the server).
            let req: mooncake_proto::message::FetchRequest = read_body(header, rd).await?;
            let (within, size) = (cfg.request_timeout / 2, u64::from(req.size));
            let code = crate::fetch::fetch(req, tiers, &cfg.peers, within).await;
            if code == ErrorCode::Ok {
                metrics.bytes_written.inc_by(size);
            }
            reply(wr, header, code, &[]).await
        }
        Opcode::DaemonStats => {
            let _: mooncake_proto::message::Empty = read_body(header, rd).await?;
            reply(wr, header, ErrorCode::Ok, &pool.stats().to_bytes()).await
        }
        Opcode::Ping => {
            let _: mooncake_proto::message::Empty = read_body(header, rd).await?;
            reply(wr, header, ErrorCode::Ok, &[]).await
        }
        // A meta-service opcode sent to a daemon.
        other => Err(ProtoError::UnknownOpcode(other as u8).into()),
    }
}

async fn handle_put<R, W>(
    header: Header,
    rd: &mut R,
    wr: &mut W,
    tiers: &Tiers,
    metrics: &DaemonMetrics,
    cfg: &DataConfig,
    who: &Identity,
) -> Result<ErrorCode, ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let body_len = header.body_len as usize;
    let truncated = |needed| ConnError::Protocol(ProtoError::Truncated { needed });
    if body_len < 2 {
        return Err(truncated(2 - body_len));
    }
    let mut head = [0u8; PutHead::MAX_LEN];
    rd.read_exact(&mut head[..2]).await?;
    let mut len = 2 + PutHead::rest_len(u16::from_le_bytes([head[0], head[1]]))?;
    if body_len < len {
        return Err(truncated(len - body_len));
    }
    rd.read_exact(&mut head[2..len]).await?;
    let tag = PutHead::tag_len(head[len - 4..len].try_into().expect("4 bytes"))?;
    if body_len < len + tag {
        return Err(truncated(len + tag - body_len));
    }
    rd.read_exact(&mut head[len..len + tag]).await?;
    len += tag;
    let put = PutHead::from_bytes(&head[..len])?;
    let value_len = body_len - len;
    if !who.may_use(&put.key.namespace) {
        discard(rd, value_len, cfg.put_stall_timeout).await?;
        return reply(wr, header, ErrorCode::Unauthorized, &[]).await;
    }
    let key = put.key.clone();
    let reserved = tiers
        .reserve_put(
            put.key,
            value_len as u64,
            Some(put.checksum),
            cfg.request_timeout / 2,
        )
        .await;
    match reserved {
        Ok(mut slot) => {
            slot.set_parent(put.parent);
            slot.set_continues(put.continues);
            // A client that vanishes here, or whose bytes stop coming,
            // drops the slot: nothing becomes visible and the space is
            // freed at once. Each piece is hashed as it lands, in cache.
            let mut running = mooncake_proto::checksum::Running::default();
            let stall = cfg.put_stall_timeout;
            for piece in slot.buf_mut().chunks_mut(mooncake_proto::checksum::CHUNK) {
                match tokio::time::timeout(stall, rd.read_exact(piece)).await {
                    Ok(read) => read?,
                    Err(_) => return Err(ConnError::Stalled(stall)),
                };
                running.update(piece);
            }
            let code = slot
                .commit_hashed(running.finish())
                .err()
                .map_or(ErrorCode::Ok, |e| e.code());
            if code == ErrorCode::Ok {
                metrics.bytes_written.inc_by(value_len as u64);
                tiers.set_tag(&key, put.tag);
            }
            reply(wr, header, code, &[]).await
        }
        Err(crate::PoolError::TooLarge(_)) => {
            // Not worth draining: refuse and close.
            reply(wr, header, ErrorCode::TooLarge, &[]).await?;
            Err(ConnError::Refused(ErrorCode::TooLarge))
        }
        Err(err) => {
            discard(rd, value_len, cfg.put_stall_timeout).await?;
            reply(wr, header, err.code(), &[]).await
        }
    }
}

async fn handle_get<W: AsyncWrite + Unpin>(
    header: Header,
    req: KeyRequest,
    wr: &mut W,
    tiers: &Tiers,
    verify: bool,
    metrics: &DaemonMetrics,
) -> Result<ErrorCode, ConnError> {
    let pool = &tiers.dram;
    let mut found = pool.get(&req.key);
    if found.is_none() && tiers.join_prefetch(&req.key).await {
        // A lease's read of it from a drive was under way: now in DRAM.
        found = pool.get(&req.key);
    }
    let Some(lease) = found else {
        // Not in DRAM: the NVMe tier, if any, may hold it.
        let Some((bytes, sum)) = tiers.get_nvme(&req.key).await else {
            pool.note_get(false);
            return reply(wr, header, ErrorCode::NotFound, &[]).await;
        };
        pool.note_get(true);
        tiers.hot.note(&req.key);
        write_found(wr, header, sum, &bytes).await?;
        metrics.bytes_read.inc_by(bytes.len() as u64);
        return Ok(ErrorCode::Ok);
    };
    if verify && !lease.verify() {
        pool.drop_corrupt(&lease);
        pool.note_get(false);
        return reply(wr, header, ErrorCode::Corrupt, &[]).await;
    }
    pool.note_get(true);
    tiers.hot.note(&req.key);
    let bytes = lease.bytes();
    write_found(wr, header, lease.checksum(), bytes).await?;
    metrics.bytes_read.inc_by(bytes.len() as u64);
    Ok(ErrorCode::Ok)
}

/// Writes a found block: the response header, its checksum, its bytes.
/// The head goes out with the bytes in one vectored write: written on its
/// own, a head in front of a value larger than the write buffer would be
/// flushed as a segment of its own, a system call and a wake-up of the
/// reader per get for 32 bytes.
async fn write_found<W: AsyncWrite + Unpin>(
    wr: &mut W,
    header: Header,
    checksum: u64,
    value: &[u8],
) -> io::Result<()> {
    let len = (mooncake_proto::message::GET_HEAD_LEN + value.len()) as u32;
    let h = Header::response(Opcode::Get, header.request_id, ErrorCode::Ok as u16, len);
    let mut head = [0u8; HEADER_LEN + mooncake_proto::message::GET_HEAD_LEN];
    head[..HEADER_LEN].copy_from_slice(&h.encode());
    head[HEADER_LEN..].copy_from_slice(&checksum.to_le_bytes());
    let mut sent = 0;
    while sent < head.len() {
        let n = wr
            .write_vectored(&[IoSlice::new(&head[sent..]), IoSlice::new(value)])
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    wr.write_all(&value[sent - head.len()..]).await
}

/// Reads and drops a refused put's value; a value that stops arriving for
/// `stall` ends the connection.
async fn discard<R: AsyncRead + Unpin>(
    rd: &mut R,
    mut len: usize,
    stall: Duration,
) -> Result<(), ConnError> {
    let mut scratch = vec![0u8; len.min(IO_BUFFER)];
    while len > 0 {
        let n = len.min(scratch.len());
        match tokio::time::timeout(stall, rd.read_exact(&mut scratch[..n])).await {
            Ok(read) => read?,
            Err(_) => return Err(ConnError::Stalled(stall)),
        };
        len -= n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::io::BufWriter;

    /// A socket that takes at most 5 bytes a call, so that the head of a
    /// response is cut between calls.
    #[derive(Default)]
    struct Trickle(Vec<u8>);

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = buf.len().min(5);
            self.0.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_found_block_is_written_whole_however_the_socket_cuts_it() {
        let request = Header::request(Opcode::Get, 7, 0);
        let value: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let mut sink = Trickle::default();
        write_found(&mut sink, request, 0xfeed, &value)
            .await
            .unwrap();
        let head = Header::parse(sink.0[..HEADER_LEN].try_into().unwrap())
            .unwrap()
            .unwrap();
        assert!(head.response);
        assert_eq!(head.request_id, 7);
        assert_eq!(head.body_len as usize, 8 + value.len());
        assert_eq!(sink.0[HEADER_LEN..HEADER_LEN + 8], 0xfeed_u64.to_le_bytes());
        assert_eq!(sink.0[HEADER_LEN + 8..], value[..]);
        // Through the daemon's write buffer, as served.
        let mut buffered = BufWriter::with_capacity(64, Trickle::default());
        write_found(&mut buffered, request, 1, &value)
            .await
            .unwrap();
        buffered.flush().await.unwrap();
        assert_eq!(buffered.get_ref().0.len(), HEADER_LEN + 8 + value.len());
        assert_eq!(buffered.get_ref().0[HEADER_LEN + 8..], value[..]);
    }
}
