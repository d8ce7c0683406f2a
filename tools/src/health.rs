//! `mooncake-store health`: asks a server's admin port for `/health`, for
//! a container's health check (the image has no HTTP client). Exit 0 when
//! a server answers 200, 1 when one answers otherwise, 3 when none
//! answers.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::exit::Failure;

#[derive(clap::Args, Debug)]
pub struct HealthArgs {
    /// Admin addresses to ask, comma separated; the first that answers
    /// decides. Default: this host's meta and daemon admin ports.
    #[arg(
        long,
        env = "MOONCAKE_ADMIN",
        value_delimiter = ',',
        default_value = "127.0.0.1:9070,127.0.0.1:9071"
    )]
    admin: Vec<String>,
}

/// Deadline of each address's answer (a health check's own timeout is
/// longer).
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

pub async fn run(args: HealthArgs) -> Result<(), Failure> {
    let mut unreachable = Vec::new();
    for addr in &args.admin {
        match tokio::time::timeout(ANSWER_WITHIN, ask(addr)).await {
            Ok(Ok((200, detail))) => {
                println!("{addr}: {detail}");
                return Ok(());
            }
            Ok(Ok((status, detail))) => {
                return Err(Failure::other(anyhow::anyhow!(
                    "{addr} is unhealthy (HTTP {status}): {detail}"
                )))
            }
            Ok(Err(err)) => unreachable.push(format!("{addr}: {err}")),
            Err(_) => unreachable.push(format!("{addr}: no answer within {ANSWER_WITHIN:?}")),
        }
    }
    Err(Failure::connection(format!(
        "no admin port answered ({})",
        unreachable.join("; ")
    )))
}

/// One `GET /health`: the status code and the body's first line.
async fn ask(addr: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nConnection: close\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    stream.take(64 << 10).read_to_end(&mut answer).await?;
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("not an HTTP answer"))?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").trim();
    Ok((status, body.lines().next().unwrap_or("").to_string()))
}
