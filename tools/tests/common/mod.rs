//! Helpers shared by the tests that run the `mooncake-store` binary.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::net::TcpListener;

pub mod cluster;
pub mod events;
pub mod mooncake_events;
pub mod store;
pub mod up;

pub const BIN: &str = env!("CARGO_BIN_EXE_mooncake-store");

/// A path in the repository, resolved at run time (a build cache may be
/// shared by checkouts in different places).
pub fn repo(rel: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"))
        .join("..")
        .join(rel)
}

/// Ports handed to servers the tests start: below the kernel's ephemeral
/// range (32768 and up here), so that no outgoing connection takes one
/// between its pick and its server's bind, and picked at random, so that
/// tests running at once (and a port a killed server left) rarely meet:
/// the kernel's own pick (`bind(0)`) hands consecutive callers nearby
/// ports, and hands a just-released port straight out again.
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A loopback port free right now, for TCP and UDP (QUIC) alike, and
/// never one this process handed out before: a cluster's servers get
/// their ports before any of them binds, so a port free at each pick
/// could otherwise go to two of them (seen: a daemon given its meta
/// replica's port, "Address already in use").
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TEST_PORTS.start + rand::random::<u16>() % (TEST_PORTS.end - TEST_PORTS.start);
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if given.contains(&port) {
            continue;
        }
        let tcp = TcpListener::bind(("127.0.0.1", port));
        let udp = std::net::UdpSocket::bind(("127.0.0.1", port));
        if tcp.is_ok() && udp.is_ok() {
            given.push(port);
            return port;
        }
    }
}

/// Polls `check` every 50 ms until it holds (how long that took) or
/// `within` has passed (`None`).
pub async fn eventually<F, Fut>(
    within: std::time::Duration,
    mut check: F,
) -> Option<std::time::Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    None
}
