//! Listening: TCP connections (plain or TLS) and QUIC streams are
//! accepted, admitted under one budget, and each served by the frame loop
//! in a task the server tracks, so that a stopping server knows when its
//! last connection ended. A TLS handshake runs in that task, after the
//! admission and within the deadline of a connection without a token.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use std::future::Future;

use mooncake_net::quic::{accept_streams, IncomingStream};
use mooncake_net::tcp_tls::Accepted;
use mooncake_net::TlsAcceptor;
use mooncake_proto::auth::{Gate, TokenTable};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admit::{Admission, Limits, Refusal};
use crate::frames::{refuse, serve, Conn, Service};
use crate::metrics::{Counted, ServerMetrics};

/// One server: its service, its limits and admission, its metrics, and the
/// tasks of its connections.
pub struct Server<S: Service> {
    service: Arc<S>,
    /// Its name in logs: "data server", "meta service".
    name: &'static str,
    limits: Limits,
    tokens: Option<Arc<TokenTable>>,
    admission: Admission,
    metrics: Arc<ServerMetrics>,
    tasks: TaskTracker,
}

impl<S: Service> Server<S> {
    /// A server answering with `service`; with `tokens`, every connection
    /// must present one of them.
    pub fn new(
        name: &'static str,
        service: Arc<S>,
        limits: Limits,
        tokens: Option<Arc<TokenTable>>,
        metrics: Arc<ServerMetrics>,
    ) -> Arc<Self> {
        Arc::new(Server {
            admission: Admission::new(&limits, tokens.is_some()),
            service,
            name,
            limits,
            tokens,
            metrics,
            tasks: TaskTracker::new(),
        })
    }

    pub fn service(&self) -> &Arc<S> {
        &self.service
    }

    /// Accepts TCP connections on `listener` until `shutdown`; with `tls`,
    /// only TLS connections.
    pub async fn run_tcp(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Option<Arc<TlsAcceptor>>,
        shutdown: CancellationToken,
    ) {
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(err) => {
                        // Out of file descriptors and the like: back off, go on.
                        tracing::warn!(%err, server = self.name, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = shutdown.cancelled() => break,
            };
            if let Err(err) = stream.set_nodelay(true) {
                tracing::debug!(%peer, %err, "connection closed");
                continue;
            }
            mooncake_net::sockbuf::enlarge(&stream, mooncake_net::sockbuf::TCP_BUFFER);
            match &tls {
                None => {
                    let (rd, wr) = stream.into_split();
                    self.clone().connection(
                        peer,
                        async move { Ok(Accepted::plain(Box::new(rd), Box::new(wr))) },
                        shutdown.clone(),
                    );
                }
                Some(tls) => {
                    let tls = tls.clone();
                    self.clone().connection(
                        peer,
                        async move { tls.accept(stream).await },
                        shutdown.clone(),
                    );
                }
            }
        }
        tracing::info!(server = self.name, "stopped accepting TCP connections");
    }

    /// Serves QUIC streams on `endpoint` until `shutdown`, each as one TCP
    /// connection, under the same limits.
    pub async fn run_quic(self: Arc<Self>, endpoint: quinn::Endpoint, shutdown: CancellationToken) {
        let server = self.clone();
        let stop = shutdown.clone();
        let tasks = self.tasks.clone();
        accept_streams(endpoint, shutdown, &tasks, move |s: IncomingStream| {
            let opened = Accepted {
                recv: Box::new(s.recv),
                send: Box::new(s.send),
                certified: s.certified,
            };
            server
                .clone()
                .connection(s.peer, async move { Ok(opened) }, stop.clone());
        })
        .await;
    }

    /// Admits one connection and serves it in a tracked task, once `open`
    /// (a TLS handshake, or nothing) finished within the deadline of a
    /// connection without a token; refuses it with `busy` (counted) at a
    /// limit.
    fn connection<F>(self: Arc<Self>, peer: SocketAddr, open: F, shutdown: CancellationToken)
    where
        F: Future<Output = std::io::Result<Accepted>> + Send + 'static,
    {
        let admitted = self.admission.admit(peer);
        let within = self.limits.deadlines.auth;
        let tasks = self.tasks.clone();
        tasks.spawn(async move {
            let opened = match tokio::time::timeout(within, open).await {
                Ok(Ok(opened)) => opened,
                Ok(Err(err)) => {
                    tracing::info!(%peer, %err, server = self.name, "TLS handshake failed");
                    self.metrics.failed_handshakes.inc();
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, server = self.name, "TLS handshake did not finish within {within:?}");
                    self.metrics.failed_handshakes.inc();
                    return;
                }
            };
            let admitted = match admitted {
                Ok(a) => a,
                Err(refusal) => {
                    let limit = match refusal {
                        Refusal::Full => "max_connections",
                        Refusal::ClientFull => "max_connections_per_client",
                    };
                    tracing::warn!(%peer, server = self.name, "connection refused: {limit} reached");
                    self.metrics.refused_connections.inc();
                    refuse(opened.send).await;
                    return;
                }
            };
            // Counted down however the task ends, a panic included.
            let _open = Counted::new(&self.metrics.connections);
            let conn = Conn {
                service: &*self.service,
                session: self.service.session(peer),
                gate: Gate::bound_to(self.tokens.clone(), opened.certified),
                admitted,
                limits: &self.limits,
                metrics: &self.metrics,
                shutdown: &shutdown,
            };
            if let Err(err) = serve(conn, opened.recv, opened.send).await {
                tracing::debug!(%peer, %err, "connection closed");
            }
        });
    }

    /// Waits, at most `within`, until every connection of this server has
    /// ended (after its shutdown was cancelled: each finishes the request
    /// it is serving). `false` if some were still open.
    pub async fn drained(&self, within: Duration) -> bool {
        self.tasks.close();
        let drained = tokio::time::timeout(within, self.tasks.wait())
            .await
            .is_ok();
        if !drained {
            tracing::warn!(
                server = self.name,
                open = self.tasks.len(),
                "connections still open {within:?} after the stop"
            );
        }
        drained
    }
}
