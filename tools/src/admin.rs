//! The admin endpoint of every serving process: `GET /metrics` (Prometheus
//! text format; with a metrics token, only for a request that presents it)
//! and `GET /health`. A deliberately small HTTP/1.1 responder: one request
//! per connection, bounded in size and time, at most `MAX_CONNECTIONS` at
//! once.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Encoder, Registry, TextEncoder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const MAX_REQUEST: usize = 8 << 10;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 64;

/// What `/health` says: healthy or not, and one line of detail.
pub type Health = Arc<dyn Fn() -> (bool, String) + Send + Sync>;

pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    health: Health,
    metrics_token: Option<Arc<str>>,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            continue;
        };
        let (registry, health, token) = (registry.clone(), health.clone(), metrics_token.clone());
        tokio::spawn(async move {
            let answered = answer(stream, &registry, &health, token.as_deref());
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answered).await;
            drop(permit);
        });
    }
}

async fn answer(
    mut stream: TcpStream,
    registry: &Registry,
    health: &Health,
    metrics_token: Option<&str>,
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
            if let Some(token) = metrics_token {
                if !presents(&buf, token) {
                    return respond(
                        &mut stream,
                        401,
                        "text/plain",
                        b"a metrics token is required\n",
                    )
                    .await;
                }
            }
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

/// Whether the request's head carries `Authorization: Bearer TOKEN`.
fn presents(head: &[u8], token: &str) -> bool {
    use mooncake_proto::auth::token_digest;
    let want = token_digest(token);
    String::from_utf8_lossy(head).lines().any(|line| {
        let Some((name, value)) = line.split_once(':') else {
            return false;
        };
        let value = value.trim();
        name.trim().eq_ignore_ascii_case("authorization")
            && value.len() > 7
            && value[..7].eq_ignore_ascii_case("bearer ")
            // Compared as digests: the time taken says nothing of the token.
            && token_digest(value[7..].trim()) == want
    })
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
        401 => "Unauthorized",
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: std::net::SocketAddr, path: &str, auth: Option<&str>) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out.lines().next().unwrap_or("").to_string()
    }

    #[tokio::test]
    async fn with_a_token_metrics_need_it_and_health_does_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let health: Health = Arc::new(|| (true, "ok".into()));
        let token = Some(Arc::from("s3cret"));
        tokio::spawn(serve(
            listener,
            Registry::new(),
            health,
            token,
            stop.clone(),
        ));
        assert!(get(addr, "/metrics", None).await.contains("401"));
        assert!(get(addr, "/metrics", Some("Bearer wrong"))
            .await
            .contains("401"));
        assert!(get(addr, "/metrics", Some("Basic s3cret"))
            .await
            .contains("401"));
        assert!(get(addr, "/metrics", Some("Bearer s3cret"))
            .await
            .contains("200"));
        assert!(get(addr, "/metrics", Some("bearer  s3cret "))
            .await
            .contains("200"));
        assert!(get(addr, "/health", None).await.contains("200"));
        stop.cancel();
    }
}
