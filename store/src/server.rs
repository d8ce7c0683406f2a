//! The daemon's data server. One task per connection (a TCP connection, or
//! a QUIC stream: see `quic.rs`) reads requests in order and answers each
//! before reading the next; clients pipeline many on one stream. Values
//! land straight in the pool and leave straight from it.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_proto::auth::{AuthRequest, Gate, Identity, TokenTable};
use mooncake_proto::limits::{Deadlines, PerClient, Unproven, UnprovenSlot};
use mooncake_proto::message::{Body, KeyRequest, PutHead};
use mooncake_proto::{ErrorCode, Header, Opcode, ProtoError, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::metrics::DaemonMetrics;
use crate::tiers::Tiers;

const IO_BUFFER: usize = 64 << 10;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub max_connections: usize,
    pub request_timeout: Duration,
    pub verify_on_read: bool,
    /// Tokens accepted; `None`: no authentication.
    pub tokens: Option<Arc<TokenTable>>,
    /// Most connections from one client address.
    pub max_connections_per_client: usize,
    /// How long a connection may go without a token, or without a request.
    pub deadlines: Deadlines,
    /// A put whose value stops arriving for this long is dropped, and the
    /// room reserved for it freed.
    pub put_stall_timeout: Duration,
    /// With `tokens`: most connections at once without a valid token yet.
    pub max_unauthenticated: usize,
}

/// Why a connection was closed by the server.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("protocol violation: {0}")]
    Protocol(#[from] ProtoError),
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("request not finished within {0:?}")]
    Timeout(Duration),
    #[error("no valid token within {0:?}")]
    NoToken(Duration),
    #[error("idle for {0:?}")]
    Idle(Duration),
    #[error("a put's value stopped arriving for {0:?}")]
    Stalled(Duration),
    #[error("refused: {0}")]
    Refused(ErrorCode),
}

/// What every connection shares, whichever transport it came on: the
/// tiers, the limits (one budget of connections for TCP and QUIC), the
/// metrics.
pub struct Server {
    tiers: Arc<Tiers>,
    cfg: ServerConfig,
    metrics: Arc<DaemonMetrics>,
    permits: Arc<Semaphore>,
    per_client: Arc<PerClient>,
    unproven: Arc<Unproven>,
}

/// A connection admitted under the limits; dropping it frees its place.
pub(crate) struct Admitted {
    _permit: tokio::sync::OwnedSemaphorePermit,
    _slot: mooncake_proto::limits::ClientSlot,
    /// Held until the connection presents a valid token (auth on).
    unproven: Option<UnprovenSlot>,
    /// Cancelled if the connection is still without a token when a newer
    /// one needs its place.
    evicted: CancellationToken,
}

impl Server {
    pub fn new(tiers: Arc<Tiers>, cfg: ServerConfig, metrics: Arc<DaemonMetrics>) -> Arc<Self> {
        Arc::new(Server {
            tiers,
            permits: Arc::new(Semaphore::new(cfg.max_connections)),
            per_client: PerClient::new(cfg.max_connections_per_client),
            unproven: Unproven::new(cfg.max_unauthenticated),
            cfg,
            metrics,
        })
    }

    /// A place for one more connection from `peer`, or `None` (counted,
    /// logged) when a limit is reached.
    pub(crate) fn admit(&self, peer: std::net::SocketAddr) -> Option<Admitted> {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection refused: max_connections reached");
            self.metrics.refused_connections.inc();
            return None;
        };
        let Some(slot) = self.per_client.admit(peer.ip()) else {
            tracing::warn!(%peer, "connection refused: max_connections_per_client reached");
            self.metrics.refused_connections.inc();
            return None;
        };
        // With auth on, a place among peers without a token yet (the
        // oldest of them is closed if none is free).
        let evicted = CancellationToken::new();
        let unproven = self.cfg.tokens.as_ref().map(|_| {
            let evicted = evicted.clone();
            self.unproven.admit(move || evicted.cancel())
        });
        Some(Admitted {
            _permit: permit,
            _slot: slot,
            unproven,
            evicted,
        })
    }

    /// Serves one admitted connection until it closes. `certified`: the
    /// client's name from its verified certificate (mutual TLS), to which
    /// the connection's token must belong.
    pub(crate) async fn serve_stream<R, W>(
        &self,
        (rd, wr): (R, W),
        peer: std::net::SocketAddr,
        certified: Option<String>,
        mut admitted: Admitted,
        shutdown: &CancellationToken,
    ) where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        // Counted down however the task ends, a panic included.
        let _open = Counted::new(&self.metrics.connections);
        let gate = Gate::bound_to(self.cfg.tokens.clone(), certified);
        let served = serve(
            rd,
            wr,
            gate,
            (&mut admitted.unproven, &admitted.evicted),
            &self.tiers,
            &self.cfg,
            &self.metrics,
            shutdown,
        )
        .await;
        if let Err(err) = served {
            tracing::debug!(%peer, %err, "connection closed");
        }
        drop(admitted);
    }
}

/// A gauge held one higher while this lives.
struct Counted<'a>(&'a prometheus::IntGauge);

impl<'a> Counted<'a> {
    fn new(gauge: &'a prometheus::IntGauge) -> Self {
        gauge.inc();
        Counted(gauge)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Accepts TCP connections until `shutdown`.
pub async fn run(listener: TcpListener, server: Arc<Server>, shutdown: CancellationToken) {
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(err) => {
                    // Out of file descriptors and the like: back off, go on.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let Some(admitted) = server.admit(peer) else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let (server, shutdown) = (server.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(err) = stream.set_nodelay(true) {
                tracing::debug!(%peer, %err, "connection closed");
                return;
            }
            let (rd, wr) = stream.into_split();
            server
                .serve_stream((rd, wr), peer, None, admitted, &shutdown)
                .await;
        });
    }
    tracing::info!("data server stopped accepting");
}

/// Tells an over-limit client why it is being turned away.
pub(crate) async fn refuse<W: AsyncWrite + Unpin>(mut stream: W) {
    let mut raw = [0u8; HEADER_LEN];
    raw[3] = Opcode::Ping as u8;
    let reply = Header::error_reply(&raw, ErrorCode::Busy as u16);
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&reply)).await;
}

#[expect(
    clippy::too_many_arguments,
    reason = "the connection's parts, passed once"
)]
async fn serve<R, W>(
    rd: R,
    wr: W,
    mut gate: Gate,
    (unproven, evicted): (&mut Option<UnprovenSlot>, &CancellationToken),
    tiers: &Arc<Tiers>,
    cfg: &ServerConfig,
    metrics: &DaemonMetrics,
    shutdown: &CancellationToken,
) -> Result<(), ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut rd = BufReader::with_capacity(IO_BUFFER, rd);
    let mut wr = BufWriter::with_capacity(IO_BUFFER, wr);
    let deadlines = cfg.deadlines;
    // A peer without a token is kept this long in all, its `Auth` included.
    let auth_deadline = tokio::time::Instant::now() + deadlines.auth;
    loop {
        // Answers are batched while more requests are already buffered.
        if rd.buffer().len() < HEADER_LEN {
            wr.flush().await?;
        }
        let (until, expired) = if gate.is_proven() {
            (
                tokio::time::Instant::now() + deadlines.idle,
                ConnError::Idle(deadlines.idle),
            )
        } else {
            (auth_deadline, ConnError::NoToken(deadlines.auth))
        };
        let mut raw = [0u8; HEADER_LEN];
        tokio::select! {
            read = tokio::time::timeout_at(until, rd.read_exact(&mut raw)) => match read {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(expired),
            },
            _ = evicted.cancelled(), if !gate.is_proven() => return Err(ConnError::NoToken(deadlines.auth)),
            _ = shutdown.cancelled() => return Ok(()),
        }
        let header = match Header::parse(&raw) {
            Ok(Some(h)) if !h.response => h,
            Ok(_) => {
                let err = ProtoError::Invalid {
                    field: "flags",
                    why: "a response sent to a server".into(),
                };
                return Err(reject(&mut wr, &raw, err).await);
            }
            Err(err) => return Err(reject(&mut wr, &raw, err).await),
        };
        if header.opcode == Opcode::Auth {
            let until = if gate.is_proven() {
                tokio::time::Instant::now() + cfg.request_timeout
            } else {
                auth_deadline
            };
            let read = tokio::select! {
                read = tokio::time::timeout_at(until, read_body(header, &mut rd)) => read,
                _ = evicted.cancelled(), if !gate.is_proven() => {
                    return Err(ConnError::NoToken(deadlines.auth))
                }
            };
            let req: AuthRequest = match read {
                Ok(Ok(r)) => r,
                Ok(Err(ConnError::Protocol(err))) => return Err(reject(&mut wr, &raw, err).await),
                Ok(Err(err)) => return Err(err),
                Err(_) => return Err(ConnError::NoToken(deadlines.auth)),
            };
            let code = gate.present(&req.token);
            reply(&mut wr, header, code, &[]).await?;
            metrics.record(header.opcode, code, 0.0);
            if code != ErrorCode::Ok {
                wr.flush().await?;
                return Err(ConnError::Refused(code));
            }
            // Proven: its place among peers without a token is free again.
            *unproven = None;
            continue;
        }
        let who = match gate.admit(header.opcode) {
            Ok(who) => who,
            Err(code) => {
                // No token yet, or not the role: answer and close.
                wr.write_all(&Header::error_reply(&raw, code as u16))
                    .await?;
                wr.flush().await?;
                metrics.record(header.opcode, code, 0.0);
                return Err(ConnError::Refused(code));
            }
        };
        let started = Instant::now();
        let in_flight = Counted::new(&metrics.in_flight);
        let handled = tokio::time::timeout(
            cfg.request_timeout,
            handle(header, &mut rd, &mut wr, tiers, cfg, metrics, who),
        )
        .await;
        drop(in_flight);
        match handled {
            Ok(Ok(code)) => {
                metrics.record(header.opcode, code, started.elapsed().as_secs_f64());
                metrics.record_tenant(who, header.opcode);
            }
            Ok(Err(ConnError::Protocol(err))) => return Err(reject(&mut wr, &raw, err).await),
            Ok(Err(err)) => {
                let _ = wr.flush().await;
                return Err(err);
            }
            Err(_) => return Err(ConnError::Timeout(cfg.request_timeout)),
        }
    }
}

/// Answers a request that broke the protocol with its error code, then the
/// caller closes the connection.
async fn reject<W: AsyncWrite + Unpin>(
    wr: &mut W,
    raw: &[u8; HEADER_LEN],
    err: ProtoError,
) -> ConnError {
    let reply = Header::error_reply(raw, err.code() as u16);
    let _ = wr.write_all(&reply).await;
    let _ = wr.flush().await;
    ConnError::Protocol(err)
}

async fn handle<R, W>(
    header: Header,
    rd: &mut R,
    wr: &mut W,
    tiers: &Arc<Tiers>,
    cfg: &ServerConfig,
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
        Opcode::Remove | Opcode::Pin | Opcode::Unpin => {
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
                Opcode::Pin => pool.pin(&req.key),
                _ => pool.unpin(&req.key),
            };
            let code = result.err().map_or(ErrorCode::Ok, |e| e.code());
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

async fn read_body<B: Body, R: AsyncRead + Unpin>(
    header: Header,
    rd: &mut R,
) -> Result<B, ConnError> {
    let mut buf = vec![0u8; header.body_len as usize];
    rd.read_exact(&mut buf).await?;
    Ok(B::from_bytes(&buf)?)
}

async fn reply<W: AsyncWrite + Unpin>(
    wr: &mut W,
    header: Header,
    code: ErrorCode,
    body: &[u8],
) -> Result<ErrorCode, ConnError> {
    let h = Header::response(
        header.opcode,
        header.request_id,
        code as u16,
        body.len() as u32,
    );
    wr.write_all(&h.encode()).await?;
    wr.write_all(body).await?;
    Ok(code)
}

async fn handle_put<R, W>(
    header: Header,
    rd: &mut R,
    wr: &mut W,
    tiers: &Tiers,
    metrics: &DaemonMetrics,
    cfg: &ServerConfig,
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
    let rest = PutHead::rest_len(u16::from_le_bytes([head[0], head[1]]))?;
    if body_len < 2 + rest {
        return Err(truncated(2 + rest - body_len));
    }
    rd.read_exact(&mut head[2..2 + rest]).await?;
    let put = PutHead::from_bytes(&head[..2 + rest])?;
    let value_len = body_len - 2 - rest;
    if !who.may_use(&put.key.namespace) {
        discard(rd, value_len, cfg.put_stall_timeout).await?;
        return reply(wr, header, ErrorCode::Unauthorized, &[]).await;
    }
    let reserved = tiers
        .reserve_put(
            put.key,
            value_len as u64,
            put.checksum,
            cfg.request_timeout / 2,
        )
        .await;
    match reserved {
        Ok(mut slot) => {
            slot.set_parent(put.parent);
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
    let Some(lease) = pool.get(&req.key) else {
        // Not in DRAM: the NVMe tier, if any, may hold it.
        let Some((bytes, sum)) = tiers.get_nvme(&req.key).await else {
            pool.note_get(false);
            return reply(wr, header, ErrorCode::NotFound, &[]).await;
        };
        pool.note_get(true);
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
