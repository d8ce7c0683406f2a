//! The daemon's QUIC listener: TLS 1.3 (mutual when a client CA is set),
//! each bidirectional stream served like one TCP connection, under the
//! same limits. The acceptor is shared with the meta service
//! (`mooncake_client::transport::quic::accept_streams`).

use std::sync::Arc;

use mooncake_client::transport::quic::{accept_streams, IncomingStream};
use tokio_util::sync::CancellationToken;

use crate::server::Server;

/// Serves QUIC streams on `endpoint` until `shutdown`.
pub async fn run(endpoint: quinn::Endpoint, server: Arc<Server>, shutdown: CancellationToken) {
    let stop = shutdown.clone();
    accept_streams(endpoint, shutdown, move |s: IncomingStream| {
        let Some(admitted) = server.admit(s.peer) else {
            tokio::spawn(crate::server::refuse(s.send));
            return;
        };
        let (server, stop) = (server.clone(), stop.clone());
        tokio::spawn(async move {
            server
                .serve_stream((s.recv, s.send), s.peer, s.certified, admitted, &stop)
                .await;
        });
    })
    .await;
}
