//! TLS over TCP (rustls through tokio): the same frames as plain TCP, with
//! the certificates and settings QUIC uses (`crate::tls`). A server with
//! TLS on speaks nothing else on its TCP port: a peer that sends plain
//! frames is answered `TlsRequired` once, in clear, and closed, so that it
//! says in one line what is wrong instead of timing out.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use mooncake_proto::frame::MAGIC;
use mooncake_proto::{ErrorCode, Header, HEADER_LEN};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::conn::{connecting, dial, Connection, ReadHalf, WriteHalf};
use crate::error::{CallError, ErrorSource};
use crate::tls::{
    cert_name, client_crypto, server_crypto, server_name, ClientTls, ServerTls, TlsError,
};

/// How much a TLS connection encrypts ahead of its socket (rustls's
/// default: 64 KiB): records go out a `writev` of up to this much at a
/// time. 256 KiB made 4 MiB puts about 12% faster here, 128 KiB did not
/// (docs/benchmarks.md).
const SEND_BUFFER: usize = 256 << 10;

/// Opens TLS connections to servers whose certificates the client's CA
/// signed, presenting the client's own certificate for mutual TLS.
pub struct TlsConnector {
    inner: tokio_rustls::TlsConnector,
}

impl TlsConnector {
    /// Fails, in one line naming the file, if a certificate or key does
    /// not load.
    pub fn new(tls: &ClientTls) -> Result<Self, TlsError> {
        Ok(TlsConnector {
            inner: tokio_rustls::TlsConnector::from(Arc::new(client_crypto(tls)?)),
        })
    }

    /// A TLS connection to `addr`, handshake included, within `timeout`.
    /// The server's certificate must name the host part of `addr`.
    pub async fn connect(
        &self,
        addr: &str,
        side: ErrorSource,
        timeout: Duration,
    ) -> Result<Connection, CallError> {
        let (rd, wr) = self.stream(addr, side, timeout).await?;
        Ok(Connection::from_halves(addr, side, rd, wr))
    }

    /// The stream of such a connection, for callers that write their own
    /// bytes (a test sending half a frame).
    pub async fn stream(
        &self,
        addr: &str,
        side: ErrorSource,
        timeout: Duration,
    ) -> Result<(ReadHalf, WriteHalf), CallError> {
        let name = ServerName::try_from(server_name(addr)).map_err(|err| {
            CallError::Invalid(format!("{addr}: not a name a certificate can carry: {err}"))
        })?;
        let attempt = async {
            let stream = dial(addr, side).await?;
            let mut stream = self
                .inner
                .connect(name, stream)
                .await
                .map_err(|err| CallError::io(side, addr, explain(err)))?;
            stream.get_mut().1.set_buffer_limit(Some(SEND_BUFFER));
            Ok(stream)
        };
        let stream = connecting(side, addr, timeout, attempt).await?;
        let (rd, wr) = tokio::io::split(stream);
        Ok((Box::new(Explained(rd)), Box::new(Explained(wr))))
    }
}

/// A server's side: its certificate, and with mutual TLS the CA its
/// clients' certificates must be signed by.
pub struct TlsAcceptor {
    inner: tokio_rustls::TlsAcceptor,
}

/// An accepted connection after its handshake: both halves, and the name
/// the client's certificate gives it (mutual TLS), if any.
pub struct Accepted {
    pub recv: ReadHalf,
    pub send: WriteHalf,
    pub certified: Option<String>,
}

impl Accepted {
    /// A plain TCP connection's halves: nothing to verify.
    pub fn plain(recv: ReadHalf, send: WriteHalf) -> Self {
        Accepted {
            recv,
            send,
            certified: None,
        }
    }
}

impl TlsAcceptor {
    pub fn new(tls: &ServerTls) -> Result<Self, TlsError> {
        Ok(TlsAcceptor {
            inner: tokio_rustls::TlsAcceptor::from(Arc::new(server_crypto(tls)?)),
        })
    }

    /// The handshake on an accepted connection. The caller bounds it with
    /// a deadline. A peer that speaks plain frames is answered
    /// `TlsRequired` and refused.
    pub async fn accept(&self, mut stream: TcpStream) -> io::Result<Accepted> {
        let mut first = [0u8; 1];
        if stream.peek(&mut first).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed before its TLS handshake",
            ));
        }
        if first[0] == MAGIC[0] {
            let mut raw = [0u8; HEADER_LEN];
            stream.read_exact(&mut raw).await?;
            let reply = Header::error_reply(&raw, ErrorCode::TlsRequired as u16);
            stream.write_all(&reply).await?;
            stream.shutdown().await?;
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "plain frames on a TLS port: answered tls_required",
            ));
        }
        let mut stream = self.inner.accept(stream).await.map_err(explain)?;
        stream.get_mut().1.set_buffer_limit(Some(SEND_BUFFER));
        let certified = stream.get_ref().1.peer_certificates().and_then(cert_name);
        let (rd, wr) = tokio::io::split(stream);
        Ok(Accepted {
            recv: Box::new(Explained(rd)),
            send: Box::new(Explained(wr)),
            certified,
        })
    }
}

/// A TLS failure as an I/O error of kind `PermissionDenied` (a refused or
/// untrusted certificate, an alert from the peer, a peer that does not
/// speak TLS), so that callers tell "not allowed" from "not reachable";
/// other errors pass unchanged.
fn explain(err: io::Error) -> io::Error {
    let Some(tls) = err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return err;
    };
    let hint = match tls {
        rustls::Error::InvalidMessage(_) => " (does the server speak TLS on this port?)",
        _ => "",
    };
    io::Error::new(io::ErrorKind::PermissionDenied, format!("TLS: {tls}{hint}"))
}

/// One half of a TLS stream whose errors go through `explain`: with TLS
/// 1.3 a server refuses a client's certificate only after the client's
/// side of the handshake is done, so the refusal shows on the first read.
struct Explained<T>(T);

impl<T: AsyncRead + Unpin> AsyncRead for Explained<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf).map_err(explain)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Explained<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf).map_err(explain)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0)
            .poll_write_vectored(cx, bufs)
            .map_err(explain)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx).map_err(explain)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx).map_err(explain)
    }
}
