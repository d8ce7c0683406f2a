//! The daemon's QUIC listener: TLS 1.3 (mutual when a client CA is set),
//! each bidirectional stream served like one TCP connection, under the
//! same limits. See `mooncake_client::transport::quic` for the client.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use mooncake_client::ServerTls;
use tokio_util::sync::CancellationToken;

use crate::server::Server;

/// Binds the QUIC endpoint (UDP) at `addr` with `tls`.
pub fn bind(addr: &str, tls: &ServerTls) -> Result<quinn::Endpoint, String> {
    let config = mooncake_client::transport::quic::server_config(tls).map_err(|e| e.to_string())?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("quic_listen {addr:?}: {e}"))?;
    quinn::Endpoint::server(config, addr).map_err(|e| format!("quic_listen {addr}: {e}"))
}

/// Accepts QUIC connections until `shutdown`, then closes the endpoint.
pub async fn run(endpoint: quinn::Endpoint, server: Arc<Server>, shutdown: CancellationToken) {
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => match incoming {
                Some(i) => i,
                None => break,
            },
            _ = shutdown.cancelled() => break,
        };
        let (server, shutdown) = (server.clone(), shutdown.clone());
        tokio::spawn(async move {
            let peer = incoming.remote_address();
            // A handshake that stalls (or a client certificate refused)
            // ends here, without holding any place.
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
            let certified = mooncake_client::transport::quic::peer_name(&conn);
            if let Some(name) = &certified {
                tracing::info!(%peer, client = %name, "QUIC client connected with a certificate");
            }
            serve_connection(conn, peer, certified, server, shutdown).await;
        });
    }
    endpoint.close(0u32.into(), b"daemon stopping");
    tracing::info!("QUIC server stopped accepting");
}

/// Serves each stream the client opens, as one connection each.
async fn serve_connection(
    conn: quinn::Connection,
    peer: SocketAddr,
    certified: Option<String>,
    server: Arc<Server>,
    shutdown: CancellationToken,
) {
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
                conn.close(0u32.into(), b"daemon stopping");
                return;
            }
        };
        let Some(admitted) = server.admit(peer) else {
            tokio::spawn(crate::server::refuse(send));
            continue;
        };
        let (server, shutdown, certified) = (server.clone(), shutdown.clone(), certified.clone());
        tokio::spawn(async move {
            server
                .serve_stream((recv, send), peer, certified, admitted, &shutdown)
                .await;
        });
    }
}
