//! One framed connection to a daemon or the meta service. Requests are
//! written in order and answered in order, so a batch is pipelined: write
//! every request, read every response, on one socket, in one round trip.
//! The stream is a TCP connection or a QUIC stream; the frames are the same.

use std::io;
use std::time::Duration;

use mooncake_proto::message::Body;
use mooncake_proto::{ErrorCode, Header, Opcode, ProtoError, HEADER_LEN};
use tokio::io::{
    AsyncBufRead, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::net::TcpStream;

use crate::error::{CallError, ErrorSource};

const IO_BUFFER: usize = 64 << 10;

/// Either half of a connection's byte stream: a TCP socket's, a TLS
/// stream's or a QUIC stream's.
pub type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
pub type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// `attempt` to connect to `addr`, bounded by `timeout` (a `connect`
/// timeout past it).
pub(crate) async fn connecting<T>(
    side: ErrorSource,
    addr: &str,
    timeout: Duration,
    attempt: impl std::future::Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(CallError::Timeout {
            side,
            addr: addr.to_string(),
            op: "connect",
            timeout_ms: timeout.as_millis() as u64,
        }),
    }
}

/// A TCP connection to `addr` with Nagle off (small control frames and
/// pipelined requests must not wait for each other) and large buffers
/// (`sockbuf`); the caller bounds it.
pub(crate) async fn dial(addr: &str, side: ErrorSource) -> Result<TcpStream, CallError> {
    let io = |err| CallError::Io {
        side,
        addr: addr.to_string(),
        err,
    };
    let stream = TcpStream::connect(addr).await.map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    crate::sockbuf::enlarge(&stream, crate::sockbuf::TCP_BUFFER);
    Ok(stream)
}

/// A connection that sends requests and reads their responses.
pub struct Connection {
    addr: String,
    side: ErrorSource,
    reader: FrameReader,
    writer: FrameWriter,
}

/// The sending half: frames are buffered until `flush`.
pub struct FrameWriter {
    wr: BufWriter<WriteHalf>,
    next_id: u64,
}

/// The receiving half: checks that responses answer the requests in order
/// (request ids are sequential on a connection, from 1).
pub struct FrameReader {
    rd: BufReader<ReadHalf>,
    next_id: u64,
    ctx: (String, ErrorSource),
}

impl Connection {
    /// Connects within `timeout`, with Nagle off (small control frames and
    /// pipelined requests must not wait for each other).
    pub async fn connect(
        addr: &str,
        side: ErrorSource,
        timeout: Duration,
    ) -> Result<Self, CallError> {
        let stream = connecting(side, addr, timeout, dial(addr, side)).await?;
        let (rd, wr) = stream.into_split();
        Ok(Connection::from_halves(
            addr,
            side,
            Box::new(rd),
            Box::new(wr),
        ))
    }

    /// A connection over any ordered byte stream (a QUIC stream).
    pub fn from_halves(addr: &str, side: ErrorSource, rd: ReadHalf, wr: WriteHalf) -> Self {
        Connection {
            addr: addr.to_string(),
            side,
            reader: FrameReader {
                rd: BufReader::with_capacity(IO_BUFFER, rd),
                next_id: 1,
                ctx: (addr.to_string(), side),
            },
            writer: FrameWriter {
                wr: BufWriter::with_capacity(IO_BUFFER, wr),
                next_id: 1,
            },
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Both halves at once, to write a batch while reading its answers
    /// (so that neither side's socket buffer can fill and stall the other).
    pub fn split(&mut self) -> (&mut FrameWriter, &mut FrameReader) {
        (&mut self.writer, &mut self.reader)
    }

    /// Whether every request sent has been answered: only such a
    /// connection may go back to a pool.
    pub fn is_idle(&self) -> bool {
        self.writer.next_id == self.reader.next_id
    }

    /// Whether an idle connection was closed or broken by its peer since
    /// its last call: nothing may be readable on it, so end of stream, an
    /// error or stray bytes all mean it cannot carry another call. Looks
    /// without waiting; a close the runtime has not seen yet reads as alive
    /// (`ConnPool::call` retries once for that).
    pub fn peer_gone(&mut self) -> bool {
        use futures::FutureExt;
        use tokio::io::AsyncBufReadExt;
        self.reader.rd.fill_buf().now_or_never().is_some()
    }

    /// Presents a token (`Opcode::Auth`), as the first request on a
    /// connection to a server that requires one.
    pub async fn authenticate(&mut self, token: &str) -> Result<(), CallError> {
        let req = mooncake_proto::auth::AuthRequest {
            token: token.to_string(),
        };
        self.call::<mooncake_proto::message::Empty>(Opcode::Auth, &req, "auth")
            .await
            .map(|_| ())
    }

    /// One request, one response, for control messages.
    pub async fn call<Resp: Body>(
        &mut self,
        op: Opcode,
        req: &impl Body,
        name: &'static str,
    ) -> Result<Resp, CallError> {
        let body = req.to_bytes();
        self.writer
            .send(op, &body, &[])
            .await
            .map_err(|e| self.io(e))?;
        self.writer.flush().await.map_err(|e| self.io(e))?;
        let header = self.reader.next_header(op).await?;
        let bytes = self.reader.body(header.body_len as usize).await?;
        if header.status != ErrorCode::Ok as u16 {
            return Err(self.reader.status_error(header.status, name));
        }
        Resp::from_bytes(&bytes).map_err(|err| CallError::Protocol {
            side: self.side,
            addr: self.addr.clone(),
            err,
        })
    }

    fn io(&self, err: io::Error) -> CallError {
        CallError::io(self.side, &self.addr, err)
    }
}

impl FrameWriter {
    /// Buffers one request whose body is `body` followed by `value` (a
    /// large value bypasses the buffer and goes straight to the socket).
    pub async fn send(&mut self, op: Opcode, body: &[u8], value: &[u8]) -> io::Result<u64> {
        self.send_pieces(op, body, &[value]).await
    }

    /// `send`, with a value made of pieces joined in order (each large one
    /// straight from where it lies).
    pub async fn send_pieces(
        &mut self,
        op: Opcode,
        body: &[u8],
        value: &[&[u8]],
    ) -> io::Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let value_len: usize = value.iter().map(|p| p.len()).sum();
        let len = u32::try_from(body.len() + value_len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
        self.wr
            .write_all(&Header::request(op, id, len).encode())
            .await?;
        self.wr.write_all(body).await?;
        for piece in value.iter().filter(|p| !p.is_empty()) {
            self.wr.write_all(piece).await?;
        }
        Ok(id)
    }

    pub async fn flush(&mut self) -> io::Result<()> {
        self.wr.flush().await
    }
}

impl FrameReader {
    /// Reads the next response header and checks it answers the oldest
    /// request in flight.
    pub async fn next_header(&mut self, op: Opcode) -> Result<Header, CallError> {
        let id = self.next_id;
        let mut raw = [0u8; HEADER_LEN];
        self.rd.read_exact(&mut raw).await.map_err(|e| self.io(e))?;
        let header = Header::parse(&raw)
            .map_err(|err| CallError::Protocol {
                side: self.ctx.1,
                addr: self.ctx.0.clone(),
                err,
            })?
            .expect("a full header was read");
        if !header.response || header.request_id != id || header.opcode != op {
            return Err(self.protocol(&format!(
                "expected the response to {} #{id}, got {:?}",
                op.name(),
                header
            )));
        }
        self.next_id += 1;
        Ok(header)
    }

    /// Reads a whole control body (bounded by the header's checked limit).
    pub async fn body(&mut self, len: usize) -> Result<Vec<u8>, CallError> {
        let mut buf = vec![0u8; len];
        self.rd.read_exact(&mut buf).await.map_err(|e| self.io(e))?;
        Ok(buf)
    }

    /// Reads exactly `buf.len()` bytes into the caller's buffer.
    pub async fn read_into(&mut self, buf: &mut [u8]) -> Result<(), CallError> {
        self.read_direct(buf).await.map_err(|e| self.io(e))
    }

    /// Fills `buf` with what the read buffer holds, then straight from the
    /// stream: a value's bytes land in the caller's buffer in one copy (the
    /// kernel's), not two (the kernel's into the read buffer, then ours
    /// out of it), and in reads as large as the socket has ready.
    async fn read_direct(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let held = self.rd.buffer();
        let n = held.len().min(buf.len());
        buf[..n].copy_from_slice(&held[..n]);
        std::pin::Pin::new(&mut self.rd).consume(n);
        if n < buf.len() {
            // The read buffer is empty now: reading past it keeps order.
            self.rd.get_mut().read_exact(&mut buf[n..]).await?;
        }
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes into the caller's buffer and returns
    /// their checksum, hashing each piece as it lands (still in cache).
    pub async fn read_into_hashed(&mut self, buf: &mut [u8]) -> Result<u64, CallError> {
        self.read_into_pieces_hashed([buf]).await
    }

    /// `read_into_hashed` for a value spread over pieces, in order: their
    /// checksum as if they were one buffer.
    pub async fn read_into_pieces_hashed<'p>(
        &mut self,
        pieces: impl IntoIterator<Item = &'p mut [u8]>,
    ) -> Result<u64, CallError> {
        let mut running = mooncake_proto::checksum::Running::default();
        for piece in pieces {
            for step in piece.chunks_mut(mooncake_proto::checksum::CHUNK) {
                self.read_direct(step).await.map_err(|e| self.io(e))?;
                running.update(step);
            }
        }
        Ok(running.finish())
    }

    /// Reads and drops `len` bytes (a response the caller cannot take).
    pub async fn discard(&mut self, mut len: usize) -> Result<(), CallError> {
        let mut scratch = [0u8; 8192];
        while len > 0 {
            let n = len.min(scratch.len());
            self.rd
                .read_exact(&mut scratch[..n])
                .await
                .map_err(|e| self.io(e))?;
            len -= n;
        }
        Ok(())
    }

    pub fn status_error(&self, status: u16, op: &'static str) -> CallError {
        let code = ErrorCode::from_u16(status).unwrap_or(ErrorCode::Internal);
        if code == ErrorCode::TlsRequired {
            return CallError::Refused {
                side: self.ctx.1,
                addr: self.ctx.0.clone(),
                why: "this port speaks TLS only: connect with the CA that signed its certificate (clients: --tls-ca or tls_ca; servers: peer_ca)".to_string(),
            };
        }
        CallError::Server {
            side: self.ctx.1,
            addr: self.ctx.0.clone(),
            op,
            code,
        }
    }

    pub fn protocol(&self, why: &str) -> CallError {
        CallError::Protocol {
            side: self.ctx.1,
            addr: self.ctx.0.clone(),
            err: ProtoError::Invalid {
                field: "response",
                why: why.to_string(),
            },
        }
    }

    fn io(&self, err: io::Error) -> CallError {
        CallError::io(self.ctx.1, &self.ctx.0, err)
    }
}
