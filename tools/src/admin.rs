//! The admin endpoint of every serving process: `GET /metrics` (Prometheus
//! text format) and `GET /health`. A deliberately small HTTP/1.1 responder:
//! one request per connection, bounded in size and time.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Encoder, Registry, TextEncoder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const MAX_REQUEST: usize = 8 << 10;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What `/health` says: healthy or not, and one line of detail.
pub type Health = Arc<dyn Fn() -> (bool, String) + Send + Sync>;

pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    health: Health,
    shutdown: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(err) => {
                    tracing::warn!(%err, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let (registry, health) = (registry.clone(), health.clone());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &registry, &health)).await;
        });
    }
}

async fn answer(
    mut stream: TcpStream,
    registry: &Registry,
    health: &Health,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() + n > MAX_REQUEST {
            return respond(&mut stream, 400, "text/plain", b"bad request\n").await;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf[..buf.iter().position(|b| *b == b'\r').unwrap_or(0)])
        .to_string();
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return respond(&mut stream, 405, "text/plain", b"only GET\n").await;
    }
    match path.split('?').next().unwrap_or("") {
        "/metrics" => {
            let mut out = Vec::new();
            let encoder = TextEncoder::new();
            if encoder.encode(&registry.gather(), &mut out).is_err() {
                return respond(&mut stream, 500, "text/plain", b"cannot encode metrics\n").await;
            }
            respond(&mut stream, 200, encoder.format_type(), &out).await
        }
        "/health" => {
            let (ok, detail) = health();
            let status = if ok { 200 } else { 503 };
            respond(
                &mut stream,
                status,
                "text/plain",
                format!("{detail}\n").as_bytes(),
            )
            .await
        }
        _ => {
            respond(
                &mut stream,
                404,
                "text/plain",
                b"not found: try /metrics or /health\n",
            )
            .await
        }
    }
}

async fn respond(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    stream.shutdown().await
}
