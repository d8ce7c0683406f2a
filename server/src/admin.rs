//! The admin endpoint of every serving process: `GET /metrics` (Prometheus
//! text format; with a metrics token, only for a request that presents it)
//! and `GET /health`; a meta service's also `GET /get_all_segments`, the
//! live daemons' addresses one a line, which is what SGLang's Mooncake
//! backend asks of Mooncake's master to know a store is up
//! (`check_server`): empty until a daemon has registered. A deliberately small HTTP/1.1 responder: one request
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

/// What `/get_all_segments` lists (a meta service's admin endpoint only).
pub type Segments = Arc<dyn Fn() -> Vec<String> + Send + Sync>;

/// What the endpoint answers besides `/metrics`.
#[derive(Clone)]
pub struct Views {
    pub health: Health,
    pub segments: Option<Segments>,
}

pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    views: Views,
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
        let (registry, views, token) = (registry.clone(), views.clone(), metrics_token.clone());
        tokio::spawn(async move {
            let answered = answer(stream, &registry, &views, token.as_deref());
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answered).await;
            drop(permit);
        });
    }
}

async fn answer(
    mut stream: TcpStream,
    registry: &Registry,
    views: &Views,
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
        "/get_all_segments" if views.segments.is_some() => {
            let segments = views.segments.as_ref().expect("just matched")();
            let body: String = segments.iter().map(|s| format!("{s}\n")).collect();
            respond(&mut stream, 200, "text/plain", body.as_bytes()).await
        }
        "/health" => {
            let (ok, detail) = (views.health)();
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

    /// The status line of a GET.
    async fn get(addr: std::net::SocketAddr, path: &str, auth: Option<&str>) -> String {
        let out = response(addr, path, auth).await;
        out.lines().next().unwrap_or("").to_string()
    }

    async fn response(addr: std::net::SocketAddr, path: &str, auth: Option<&str>) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    fn views(segments: Option<Segments>) -> Views {
        Views {
            health: Arc::new(|| (true, "ok".into())),
            segments,
        }
    }

    #[tokio::test]
    async fn a_meta_service_lists_its_live_daemons_as_mooncakes_master_does() {
        let stop = CancellationToken::new();
        let daemons = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
        let listed = daemons.clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let meta = listener.local_addr().unwrap();
        let segments: Segments = Arc::new(move || listed.lock().clone());
        tokio::spawn(serve(
            listener,
            Registry::new(),
            views(Some(segments)),
            None,
            stop.clone(),
        ));
        let body = |r: String| r.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        assert_eq!(
            body(response(meta, "/get_all_segments", None).await),
            "",
            "none yet"
        );
        daemons
            .lock()
            .extend(["10.0.0.1:7071".to_string(), "10.0.0.2:7071".to_string()]);
        assert_eq!(
            body(response(meta, "/get_all_segments", None).await),
            "10.0.0.1:7071\n10.0.0.2:7071\n"
        );
        // A daemon's endpoint has no such list.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let daemon = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            Registry::new(),
            views(None),
            None,
            stop.clone(),
        ));
        assert!(get(daemon, "/get_all_segments", None).await.contains("404"));
        stop.cancel();
    }

    #[tokio::test]
    async fn with_a_token_metrics_need_it_and_health_does_not() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let token = Some(Arc::from("s3cret"));
        tokio::spawn(serve(
            listener,
            Registry::new(),
            views(None),
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
