//! QUIC (quinn over rustls, TLS 1.3 only): for networks the cluster does
//! not trust. One QUIC connection per daemon, a stream per pooled
//! "connection", carrying the same frames as TCP. The daemon proves who it
//! is with a certificate signed by the CA the client trusts; with mutual
//! TLS on, the client does too, and a daemon refuses any client whose
//! certificate its client CA did not sign.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::CertificateDer;

use crate::conn::{connecting, Connection};
use crate::error::{CallError, ErrorSource};
use crate::tls::{
    cert_name, client_crypto, server_crypto, server_name, ClientTls, ServerTls, TlsError,
};

/// Flow-control windows sized for megabyte blocks in flight, and idle
/// connections noticed within seconds.
pub fn transport_config() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20))
        .receive_window(quinn::VarInt::from_u32(128 << 20))
        .send_window(128 << 20)
        .max_concurrent_bidi_streams(quinn::VarInt::from_u32(1024))
        .max_concurrent_uni_streams(quinn::VarInt::from_u32(0))
        .keep_alive_interval(Some(Duration::from_secs(5)))
        .max_idle_timeout(Some(
            quinn::IdleTimeout::try_from(Duration::from_secs(30)).expect("30 s fits"),
        ));
    Arc::new(t)
}

/// The client side: trusts `tls.ca`, presents `tls.identity` if set.
pub fn client_config(tls: &ClientTls) -> Result<quinn::ClientConfig, TlsError> {
    let crypto = QuicClientConfig::try_from(client_crypto(tls)?)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let mut out = quinn::ClientConfig::new(Arc::new(crypto));
    out.transport_config(transport_config());
    Ok(out)
}

/// The daemon side: its certificate, and mutual TLS if `client_ca` is set.
pub fn server_config(tls: &ServerTls) -> Result<quinn::ServerConfig, TlsError> {
    let crypto = QuicServerConfig::try_from(server_crypto(tls)?)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let mut out = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    out.transport_config(transport_config());
    Ok(out)
}

/// Binds a server endpoint (UDP) at `addr` with `tls`.
pub fn bind(addr: &str, tls: &ServerTls) -> Result<quinn::Endpoint, String> {
    let config = server_config(tls).map_err(|e| e.to_string())?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("QUIC address {addr:?}: {e}"))?;
    endpoint(addr, Some(config)).map_err(|e| format!("QUIC on {addr}: {e}"))
}

/// Socket buffers asked for on each end. The kernel's default (about
/// 200 KiB) overflows under a burst of megabyte blocks: the packets it
/// drops are losses to QUIC, which then halves its sending rate.
const UDP_BUFFER: usize = 16 << 20;

/// An endpoint on a UDP socket at `addr` with large buffers; a server if
/// `server` is given.
fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    let socket = std::net::UdpSocket::bind(addr)?;
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // Past net.core.rmem_max/wmem_max only with CAP_NET_ADMIN (the
        // FORCE options); else as much as those allow.
        // UDP has no buffer tuning of its own: as much as allowed.
        if crate::sockbuf::set(&socket, force, UDP_BUFFER).is_err() {
            let _ = crate::sockbuf::set(&socket, plain, UDP_BUFFER);
        }
    }
    let runtime = quinn::default_runtime()
        .ok_or_else(|| std::io::Error::other("QUIC needs a tokio runtime"))?;
    quinn::Endpoint::new(quinn::EndpointConfig::default(), server, socket, runtime)
}

/// One bidirectional stream a client opened: a server serves it exactly
/// as it serves one TCP connection.
pub struct IncomingStream {
    pub recv: quinn::RecvStream,
    pub send: quinn::SendStream,
    pub peer: SocketAddr,
    /// The client's name from its verified certificate (mutual TLS).
    pub certified: Option<String>,
}

/// Accepts QUIC connections on `endpoint` until `shutdown` (each handshake
/// within 10 s, holding nothing until it completes) and hands every stream
/// their clients open to `on_stream`; then closes the endpoint. Each
/// connection is served in a task of `tasks`.
pub async fn accept_streams(
    endpoint: quinn::Endpoint,
    shutdown: tokio_util::sync::CancellationToken,
    tasks: &tokio_util::task::TaskTracker,
    on_stream: impl Fn(IncomingStream) + Send + Sync + 'static,
) {
    let on_stream = Arc::new(on_stream);
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => match incoming {
                Some(i) => i,
                None => break,
            },
            _ = shutdown.cancelled() => break,
        };
        let (on_stream, shutdown) = (on_stream.clone(), shutdown.clone());
        tasks.spawn(async move {
            let peer = incoming.remote_address();
            let conn = match tokio::time::timeout(Duration::from_secs(10), incoming).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(err)) => {
                    tracing::info!(%peer, %err, "QUIC handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, "QUIC handshake timed out");
                    return;
                }
            };
            let certified = peer_name(&conn);
            if let Some(name) = &certified {
                tracing::info!(%peer, client = %name, "QUIC client connected with a certificate");
            }
            loop {
                let (send, recv) = tokio::select! {
                    stream = conn.accept_bi() => match stream {
                        Ok(s) => s,
                        Err(err) => {
                            tracing::debug!(%peer, %err, "QUIC connection closed");
                            return;
                        }
                    },
                    _ = shutdown.cancelled() => {
                        conn.close(0u32.into(), b"stopping");
                        return;
                    }
                };
                on_stream(IncomingStream {
                    recv,
                    send,
                    peer,
                    certified: certified.clone(),
                });
            }
        });
    }
    endpoint.close(0u32.into(), b"stopping");
    tracing::info!("QUIC server stopped accepting");
}

/// QUIC connections per server, each on its own local endpoint (UDP
/// socket). One connection's packets are sealed, opened and acknowledged
/// by one task, which caps it at about 0.5 GB/s whatever the cores; streams
/// are spread over several so that a host's cores share the work.
const PATHS: usize = 4;

/// Opens streams to daemons over `PATHS` QUIC connections per daemon
/// address, in turn, each made on first use and again after it closes.
pub struct QuicConnector {
    config: quinn::ClientConfig,
    /// Local endpoints per path, one per address family, bound on first
    /// use (a socket needs the runtime).
    endpoints: tokio::sync::Mutex<Vec<[Option<quinn::Endpoint>; 2]>>,
    conns: tokio::sync::Mutex<HashMap<(String, usize), quinn::Connection>>,
    next: std::sync::atomic::AtomicUsize,
}

impl QuicConnector {
    pub fn new(tls: &ClientTls) -> Result<Self, TlsError> {
        Ok(QuicConnector {
            config: client_config(tls)?,
            endpoints: tokio::sync::Mutex::new(vec![[None, None]; PATHS]),
            conns: tokio::sync::Mutex::new(HashMap::new()),
            next: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// A new stream to the server at `addr` (its QUIC address), within
    /// `timeout`.
    pub async fn open(
        &self,
        addr: &str,
        side: ErrorSource,
        timeout: Duration,
    ) -> Result<Connection, CallError> {
        let io = |err: std::io::Error| CallError::io(side, addr, err);
        let path = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % PATHS;
        let attempt = async {
            let conn = self.connection(addr, path).await.map_err(io)?;
            let (send, recv) = conn.open_bi().await.map_err(|e| io(quic_error(&e)))?;
            Ok(Connection::from_halves(
                addr,
                side,
                Box::new(Explained {
                    recv,
                    conn: conn.clone(),
                }),
                Box::new(ExplainedSend { send, conn }),
            ))
        };
        connecting(side, addr, timeout, attempt).await
    }

    async fn connection(&self, addr: &str, path: usize) -> std::io::Result<quinn::Connection> {
        let mut conns = self.conns.lock().await;
        let key = (addr.to_string(), path);
        if let Some(conn) = conns.get(&key) {
            if conn.close_reason().is_none() {
                return Ok(conn.clone());
            }
        }
        let target: SocketAddr = tokio::net::lookup_host(addr)
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{addr} resolves to no address")))?;
        let endpoint = self.endpoint(target, path).await?;
        let name = server_name(addr);
        let conn = endpoint
            .connect_with(self.config.clone(), target, &name)
            .map_err(|e| std::io::Error::other(format!("quic: {e}")))?
            .await
            .map_err(|e| quic_error(&e))?;
        conns.insert(key, conn.clone());
        Ok(conn)
    }

    async fn endpoint(&self, target: SocketAddr, path: usize) -> std::io::Result<quinn::Endpoint> {
        let family = usize::from(target.is_ipv6());
        let mut endpoints = self.endpoints.lock().await;
        let endpoints = &mut endpoints[path];
        if let Some(e) = &endpoints[family] {
            return Ok(e.clone());
        }
        let bind: SocketAddr = if target.is_ipv6() {
            "[::]:0".parse().expect("literal")
        } else {
            "0.0.0.0:0".parse().expect("literal")
        };
        let endpoint = endpoint(bind, None)?;
        endpoints[family] = Some(endpoint.clone());
        Ok(endpoint)
    }
}

/// The name a peer's verified certificate gives it: its first DNS name
/// (`mooncake-store certs --client NAME` puts the name there). `None`
/// without a client certificate (mutual TLS off).
pub fn peer_name(conn: &quinn::Connection) -> Option<String> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?;
    cert_name(&certs)
}

/// A stream's receiving side whose errors say why its connection closed:
/// with TLS 1.3 a daemon refuses a client certificate only after the
/// client's side of the handshake is done, so a refusal first shows as a
/// failed read.
struct Explained {
    recv: quinn::RecvStream,
    conn: quinn::Connection,
}

impl tokio::io::AsyncRead for Explained {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.recv).poll_read(cx, buf) {
            std::task::Poll::Ready(Err(err)) => {
                std::task::Poll::Ready(Err(explain(&this.conn, err)))
            }
            other => other,
        }
    }
}

/// A stream's error, as the reason its connection closed if it did.
fn explain(conn: &quinn::Connection, err: std::io::Error) -> std::io::Error {
    match conn.close_reason() {
        Some(reason) => quic_error(&reason),
        None => std::io::Error::new(err.kind(), format!("quic: {err}")),
    }
}

/// A stream's sending side whose errors say why its connection closed: a
/// refused certificate can show first as a failed write (see `Explained`).
struct ExplainedSend {
    send: quinn::SendStream,
    conn: quinn::Connection,
}

impl ExplainedSend {
    fn explain<T>(
        conn: &quinn::Connection,
        result: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        result.map_err(|err| explain(conn, err))
    }
}

impl tokio::io::AsyncWrite for ExplainedSend {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let result = tokio::io::AsyncWrite::poll_write(std::pin::Pin::new(&mut this.send), cx, buf);
        Self::explain(&this.conn, result)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let result = tokio::io::AsyncWrite::poll_write_vectored(
            std::pin::Pin::new(&mut this.send),
            cx,
            bufs,
        );
        Self::explain(&this.conn, result)
    }

    fn is_write_vectored(&self) -> bool {
        tokio::io::AsyncWrite::is_write_vectored(&self.send)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        let result = tokio::io::AsyncWrite::poll_flush(std::pin::Pin::new(&mut this.send), cx);
        Self::explain(&this.conn, result)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = &mut *self;
        let result = tokio::io::AsyncWrite::poll_shutdown(std::pin::Pin::new(&mut this.send), cx);
        Self::explain(&this.conn, result)
    }
}

/// A QUIC connection's end as an I/O error: of kind `PermissionDenied`
/// when TLS refused it (codes 0x100-0x1ff carry a TLS alert: a certificate
/// missing, untrusted or for another name), so that callers tell "not
/// allowed" from "not reachable".
fn quic_error(err: &quinn::ConnectionError) -> std::io::Error {
    let code = match err {
        quinn::ConnectionError::TransportError(e) => Some(e.code),
        quinn::ConnectionError::ConnectionClosed(c) => Some(c.error_code),
        _ => None,
    };
    let tls = code.is_some_and(|c| (0x100..0x200).contains(&u64::from(c)));
    let kind = if tls {
        std::io::ErrorKind::PermissionDenied
    } else {
        std::io::ErrorKind::Other
    };
    std::io::Error::new(kind, format!("quic: {err}"))
}
