//! A single-host store (`mooncake-store up`) as a test's own process,
//! and its Prometheus series.

use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig};

use super::cluster::{scratch_dir, Proc, Scratch};
use super::{free_port, BIN};

/// A single-host store (`up`) publishing events, its daemon heartbeating
/// every 100 ms; its meta, events, replay and admin addresses.
pub struct Up {
    proc: Proc,
    /// Its config and log; dropped after it is killed.
    _logs: Scratch,
    pub meta: String,
    pub events: String,
    pub replay: String,
    pub admin: String,
}

/// Starts `up` with `dram` of memory and `config` added to its `[daemon]`
/// table (a `[meta]` table may follow); returns once its daemon is alive.
/// A start that lost one of its ports to another process (picked free,
/// taken before `up` bound it) is retried on new ones.
pub async fn up(dram: &str, config: Option<&str>) -> Up {
    let logs = scratch_dir("up");
    let config_path = logs.join("store.toml");
    std::fs::write(
        &config_path,
        format!(
            "[daemon]\nhugepages = false\nprefault = false\nheartbeat_interval = \"100ms\"\n{}",
            config.unwrap_or("")
        ),
    )
    .unwrap();
    for _ in 0..3 {
        let address = || format!("127.0.0.1:{}", free_port());
        let (meta, events, replay, admin, daemon) =
            (address(), address(), address(), address(), address());
        let log = logs.join("up.log");
        let before = std::fs::metadata(&log).map_or(0, |m| m.len() as usize);
        let args = [
            "up",
            "--config",
            config_path.to_str().unwrap(),
            "--meta-listen",
            &meta,
            "--listen",
            &daemon,
            "--dram",
            dram,
            "--admin",
            &admin,
            "--events",
            &events,
            "--events-replay",
            &replay,
        ];
        let mut proc = Proc::spawn("up", BIN, &args, &logs);
        let client =
            Client::new(ClientConfig::new(meta.to_string()).with_timeout(Duration::from_secs(5)));
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if client
                .cluster_stats()
                .await
                .is_ok_and(|st| st.daemons.iter().any(|d| d.alive))
            {
                return Up {
                    proc,
                    _logs: logs,
                    meta,
                    events,
                    replay,
                    admin,
                };
            }
            if proc.child.try_wait().unwrap().is_some() {
                break;
            }
            assert!(Instant::now() < deadline, "store not up; logs in {logs:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // It exited: on a port taken meanwhile, again on new ones.
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let why = text.get(before..).unwrap_or_default();
        assert!(why.contains("in use"), "up exited: {why}");
    }
    panic!("up found a port taken three times over; logs in {logs:?}");
}

impl Up {
    /// Kills the store (SIGKILL): no ordered stop, nothing flushed.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }
}

/// The value of the first series of `/metrics` on `admin` that starts with
/// `series` (0 if none).
pub async fn metric(admin: &str, series: &str) -> u64 {
    let body = tokio::task::spawn_blocking({
        let admin = admin.to_string();
        move || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(&admin).unwrap();
            write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).unwrap();
            body
        }
    })
    .await
    .unwrap();
    body.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}
