//! A real Prometheus scrapes a real store, with the scrape config and the
//! alert rules shipped in deploy/prometheus.

mod common;
use common::{free_port, BIN};

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain HTTP GET; returns (status, body).
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The single value of an instant query, once Prometheus has one.
fn query(prom: &str, q: &str) -> Option<f64> {
    let (status, body) = http_get(prom, &format!("/api/v1/query?query={}", encode(q)))?;
    if status != 200 {
        return None;
    }
    // {"status":"success","data":{"resultType":"vector","result":[{"metric":{...},"value":[t,"V"]}]}}
    let at = body.find("\"value\":[")?;
    let rest = &body[at..];
    let v = rest.split('"').nth(3)?;
    v.parse().ok()
}

fn wait_for(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_real_prometheus_scrapes_the_store_with_the_shipped_config() {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-prom-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (meta, daemon, admin) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let mut up = Killed(
        Command::new(BIN)
            .args([
                "up",
                "--meta-listen",
                &meta,
                "--listen",
                &daemon,
                "--admin",
                &admin,
                "--dram",
                "64MiB",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut banner = String::new();
    BufReader::new(up.0.stdout.as_mut().unwrap())
        .read_line(&mut banner)
        .unwrap();
    assert!(
        banner.contains(&format!("http://{admin}/metrics")),
        "{banner}"
    );

    // Some traffic, so that request counters exist.
    let put = Command::new(BIN)
        .args(["put", "--meta", &meta, "scraped-block"])
        .stdin(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"hello prometheus")?;
            c.wait()
        })
        .unwrap();
    assert!(put.success());

    // A short load: 40 puts and 40 gets of 4 KiB blocks, all verified.
    let bench = Command::new(BIN)
        .args([
            "bench",
            "--meta",
            &meta,
            "--sizes",
            "4KiB",
            "--ops",
            "40",
            "--concurrency",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );

    let (status, body) = http_get(&admin, "/health").unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, body) = http_get(&admin, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(
        body.contains("mooncake_daemon_requests_total{code=\"ok\",op=\"put\"} 41"),
        "{body}"
    );
    assert_eq!(http_get(&admin, "/nope").unwrap().0, 404);
    // The exposition passes Prometheus's own linter.
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    lint.stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let lint = lint.wait_with_output().unwrap();
    assert!(
        lint.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );

    // The shipped config, pointed at this store, scraping every second.
    let shipped = common::repo("deploy/prometheus").display().to_string();
    let config = std::fs::read_to_string(format!("{shipped}/prometheus.yml"))
        .unwrap()
        .replace("127.0.0.1:9070", &admin)
        .replace("127.0.0.1:9071", &admin)
        .replace("scrape_interval: 15s", "scrape_interval: 1s")
        .replace("evaluation_interval: 15s", "evaluation_interval: 1s");
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    std::fs::copy(format!("{shipped}/alerts.yml"), dir.join("alerts.yml")).unwrap();
    let prom = format!("127.0.0.1:{}", free_port());
    let _prometheus = Killed(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus is installed by tools/setup.sh"),
    );

    wait_for("the scrape to succeed", Duration::from_secs(30), || {
        query(&prom, "up{job=\"mooncake-daemon\"}") == Some(1.0)
    });
    wait_for(
        "pool capacity in Prometheus",
        Duration::from_secs(15),
        || {
            query(
                &prom,
                "mooncake_daemon_pool_capacity_bytes{job=\"mooncake-daemon\",tier=\"dram\"}",
            ) == Some((64u64 << 20) as f64)
        },
    );
    wait_for(
        "the meta job's first scrape",
        Duration::from_secs(15),
        || query(&prom, "up{job=\"mooncake-meta\"}") == Some(1.0),
    );
    // The counters moved by exactly the load: 1 + 40 puts, 40 gets, all hits.
    let daemon = |m: &str| query(&prom, &format!("sum({m}{{job=\"mooncake-daemon\"}})"));
    assert_eq!(
        query(
            &prom,
            "sum(mooncake_daemon_requests_total{job=\"mooncake-daemon\",op=\"put\",code=\"ok\"})"
        ),
        Some(41.0)
    );
    assert_eq!(
        query(
            &prom,
            "sum(mooncake_daemon_requests_total{job=\"mooncake-daemon\",op=\"get\",code=\"ok\"})"
        ),
        Some(40.0)
    );
    assert_eq!(daemon("mooncake_daemon_gets_total"), Some(40.0));
    assert_eq!(
        query(
            &prom,
            "sum(mooncake_daemon_gets_total{job=\"mooncake-daemon\",result=\"hit\"})"
        ),
        Some(40.0)
    );
    assert_eq!(
        query(
            &prom,
            "sum(mooncake_daemon_bytes_total{job=\"mooncake-daemon\",direction=\"read\"})"
        ),
        Some((40 * 4096) as f64)
    );
    assert_eq!(
        query(
            &prom,
            "sum(mooncake_daemon_bytes_total{job=\"mooncake-daemon\",direction=\"written\"})"
        ),
        Some((16 + 40 * 4096) as f64)
    );
    assert_eq!(
        query(&prom, "mooncake_meta_leader{job=\"mooncake-meta\"}"),
        Some(1.0)
    );
    assert_eq!(
        query(&prom, "mooncake_meta_index_blocks{job=\"mooncake-meta\"}"),
        Some(1.0)
    );
    let (_, rules) = http_get(&prom, "/api/v1/rules").unwrap();
    assert!(
        rules.contains("MooncakeNoMetaLeader"),
        "the shipped alert rules load: {rules}"
    );

    // Every query of the shipped Grafana dashboard runs in Prometheus.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::repo("deploy/grafana/mooncake-store.json")).unwrap(),
    )
    .unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 15);
    for expr in &exprs {
        let (status, body) =
            http_get(&prom, &format!("/api/v1/query?query={}", encode(expr))).unwrap();
        assert_eq!(status, 200, "dashboard query {expr:?} failed: {body}");
    }
    // The panels an on-call engineer reads first show data.
    assert_eq!(query(&prom, "max(mooncake_meta_daemons_alive)"), Some(1.0));
    assert_eq!(query(&prom, "max(mooncake_meta_leader)"), Some(1.0));
    let _ = std::fs::remove_dir_all(&dir);
}
