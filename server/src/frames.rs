//! The frame loop every connection runs, whichever server and transport:
//! read a header (within the idle deadline, or the auth deadline for a peer
//! without a token), refuse what breaks the protocol, handle `Auth`, check
//! the sender's role, then hand the request to the server's [`Service`]
//! under the request deadline, and count it. Requests on one connection
//! are answered in order; answers are flushed once no further request is
//! already buffered, so that pipelined requests share writes.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mooncake_proto::auth::{AuthRequest, Gate, Identity};
use mooncake_proto::message::Body;
use mooncake_proto::{ErrorCode, Header, Opcode, ProtoError, HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio_util::sync::CancellationToken;

use crate::admit::{Admitted, Limits};
use crate::metrics::{Counted, ServerMetrics};

/// Read and write buffers of a connection.
pub const IO_BUFFER: usize = 64 << 10;

/// What one server does with the requests it is sent; the skeleton does
/// the rest (admission, deadlines, authentication, metrics).
pub trait Service: Send + Sync + 'static {
    /// What the service keeps per connection.
    type Session: Send;

    /// The state of a new connection from `peer`.
    fn session(&self, peer: SocketAddr) -> Self::Session;

    /// Whether the service answers `op`; any other opcode (but `Auth`) is
    /// refused as unknown and its connection closed.
    fn serves(&self, op: Opcode) -> bool;

    /// Serves one request whose header was read and whose sender `who` may
    /// send it: reads its whole body from `rd`, writes its whole answer to
    /// `wr`, and says which code it answered. A `ConnError::Protocol` is
    /// answered with its code by the skeleton, which then closes the
    /// connection; any other error closes it at once.
    fn handle<R, W>(
        &self,
        session: &mut Self::Session,
        header: Header,
        rd: &mut R,
        wr: &mut W,
        who: &Identity,
    ) -> impl Future<Output = Result<ErrorCode, ConnError>> + Send
    where
        R: AsyncRead + Unpin + Send,
        W: AsyncWrite + Unpin + Send;
}

/// Why a server closed a connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
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
    #[error("a request's body stopped arriving for {0:?}")]
    Stalled(Duration),
    #[error("refused: {0}")]
    Refused(ErrorCode),
}

/// Reads a request's body of `header.body_len` bytes and decodes it.
pub async fn read_body<B: Body, R: AsyncRead + Unpin>(
    header: Header,
    rd: &mut R,
) -> Result<B, ConnError> {
    let mut buf = vec![0u8; header.body_len as usize];
    rd.read_exact(&mut buf).await?;
    Ok(B::from_bytes(&buf)?)
}

/// Writes the answer to `header`: status `code` and `body`.
pub async fn reply<W: AsyncWrite + Unpin>(
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

/// Answers a request that broke the protocol with its error code; the
/// caller then closes the connection.
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

/// Tells a client turned away at a limit why: `busy`, within a second.
pub(crate) async fn refuse<W: AsyncWrite + Unpin>(mut stream: W) {
    let mut raw = [0u8; HEADER_LEN];
    raw[3] = Opcode::Ping as u8;
    let reply = Header::error_reply(&raw, ErrorCode::Busy as u16);
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&reply)).await;
}

/// One connection's parts, passed once.
pub(crate) struct Conn<'a, S: Service> {
    pub(crate) service: &'a S,
    pub(crate) session: S::Session,
    pub(crate) gate: Gate,
    pub(crate) admitted: Admitted,
    pub(crate) limits: &'a Limits,
    pub(crate) metrics: &'a ServerMetrics,
    pub(crate) shutdown: &'a CancellationToken,
}

/// Serves one connection until it closes, the peer leaves, a deadline
/// passes or `shutdown` (between requests: one being served is finished).
pub(crate) async fn serve<S, R, W>(mut c: Conn<'_, S>, rd: R, wr: W) -> Result<(), ConnError>
where
    S: Service,
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let mut rd = BufReader::with_capacity(IO_BUFFER, rd);
    let mut wr = BufWriter::with_capacity(IO_BUFFER, wr);
    let deadlines = c.limits.deadlines;
    let request_timeout = c.limits.request_timeout;
    // A peer without a token is kept this long in all, its `Auth` included.
    let auth_deadline = tokio::time::Instant::now() + deadlines.auth;
    let evicted = c.admitted.evicted.clone();
    loop {
        if rd.buffer().len() < HEADER_LEN {
            wr.flush().await?;
        }
        let proven = c.gate.is_proven();
        let (until, expired) = if proven {
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
            _ = evicted.cancelled(), if !proven => return Err(ConnError::NoToken(deadlines.auth)),
            _ = c.shutdown.cancelled() => return Ok(()),
        }
        let header = match Header::parse(&raw) {
            Ok(Some(h)) if h.response => {
                let err = ProtoError::Invalid {
                    field: "flags",
                    why: "a response sent to a server".into(),
                };
                return Err(reject(&mut wr, &raw, err).await);
            }
            Ok(Some(h)) if h.opcode != Opcode::Auth && !c.service.serves(h.opcode) => {
                let err = ProtoError::UnknownOpcode(h.opcode as u8);
                return Err(reject(&mut wr, &raw, err).await);
            }
            Ok(Some(h)) => h,
            Ok(None) => unreachable!("a whole header was read"),
            Err(err) => return Err(reject(&mut wr, &raw, err).await),
        };
        // A peer without a token has until its auth deadline for anything.
        let until = if proven {
            tokio::time::Instant::now() + request_timeout
        } else {
            auth_deadline
        };
        let late = if proven {
            ConnError::Timeout(request_timeout)
        } else {
            ConnError::NoToken(deadlines.auth)
        };
        if header.opcode == Opcode::Auth {
            let read = tokio::select! {
                read = tokio::time::timeout_at(until, read_body::<AuthRequest, _>(header, &mut rd)) => read,
                _ = evicted.cancelled(), if !proven => return Err(ConnError::NoToken(deadlines.auth)),
            };
            let req = match read {
                Ok(Ok(r)) => r,
                Ok(Err(ConnError::Protocol(err))) => return Err(reject(&mut wr, &raw, err).await),
                Ok(Err(err)) => return Err(err),
                Err(_) => return Err(late),
            };
            let code = c.gate.present(&req.token);
            reply(&mut wr, header, code, &[]).await?;
            c.metrics.record(header.opcode, code, 0.0);
            if code != ErrorCode::Ok {
                // A wrong token: no second try on this connection.
                wr.flush().await?;
                return Err(ConnError::Refused(code));
            }
            // Proven: its place among peers without a token is free again.
            c.admitted.unproven = None;
            continue;
        }
        let who = match c.gate.admit(header.opcode) {
            Ok(who) => who,
            Err(code) => {
                // No token yet, or not the role: answer and close.
                wr.write_all(&Header::error_reply(&raw, code as u16))
                    .await?;
                wr.flush().await?;
                c.metrics.record(header.opcode, code, 0.0);
                return Err(ConnError::Refused(code));
            }
        };
        let started = Instant::now();
        let in_flight = Counted::new(&c.metrics.in_flight);
        let handled = tokio::select! {
            handled = tokio::time::timeout_at(
                until,
                c.service.handle(&mut c.session, header, &mut rd, &mut wr, who),
            ) => handled,
            _ = evicted.cancelled(), if !proven => return Err(ConnError::NoToken(deadlines.auth)),
        };
        drop(in_flight);
        match handled {
            Ok(Ok(code)) => {
                c.metrics
                    .record(header.opcode, code, started.elapsed().as_secs_f64());
                c.metrics.record_tenant(who, header.opcode);
            }
            Ok(Err(ConnError::Protocol(err))) => return Err(reject(&mut wr, &raw, err).await),
            Ok(Err(err)) => {
                let _ = wr.flush().await;
                return Err(err);
            }
            Err(_) => return Err(late),
        }
    }
}
