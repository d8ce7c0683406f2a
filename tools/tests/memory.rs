//! A server's memory stays bounded whatever its peers send: the resident
//! size (`VmRSS`) of real `mooncake-store` processes, read from `/proc`,
//! before and after a flood that grew them without bound before.
//!
//! The bounds are far from both sides: what the floods cost when nothing
//! bounded them (hundreds of MiB each) and what a server's own buffers and
//! allocator slack may add (a few MiB).
//!
//! And a daemon asked for a DRAM pool larger than the host can give refuses
//! to start, instead of filling memory until the OOM killer ends it (or a
//! process beside it).

mod common;
use common::cluster::{scratch_dir, Proc};
use common::{free_port, BIN};

use std::path::Path;
use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, ErrorSource, PutOutcome};
use mooncake_net::Connection;
use mooncake_proto::message::{Body, PutStartRequest};
use mooncake_proto::{BlockHash, Header, Namespace, Opcode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const MIB: u64 = 1 << 20;

/// The resident size of a process, in bytes.
fn rss(proc: &Proc) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", proc.child.id())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib * 1024
}

/// A meta service and a daemon as separate processes, on fresh ports;
/// `extra` goes to both (e.g. `--auth`), `meta_config` is the meta
/// service's config file text.
fn start(dir: &Path, extra: &[&str], meta_config: &str) -> (Proc, Proc, String, String) {
    let config = dir.join("meta.toml");
    std::fs::write(&config, meta_config).unwrap();
    let meta = format!("127.0.0.1:{}", free_port());
    let daemon = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["meta", "--listen", &meta, "--admin", ""];
    args.extend(["--config", config.to_str().unwrap()]);
    args.extend(extra);
    let meta_proc = Proc::spawn("meta", BIN, &args, dir);
    let mut args = vec!["daemon", "--meta", &meta, "--listen", &daemon];
    args.extend(["--admin", "", "--dram", "32MiB"]);
    args.extend(extra);
    let daemon_proc = Proc::spawn("daemon", BIN, &args, dir);
    (meta_proc, daemon_proc, meta, daemon)
}

/// A client once a put through the cluster succeeds.
async fn ready(meta: &str, token: Option<&str>, ns: &Namespace) -> Client {
    let mut cfg = ClientConfig::new(meta);
    cfg.token = token.map(Into::into);
    let client = Client::new(cfg);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let put = client
            .put(ns, &[(BlockHash::from_opaque(b"ready"), &b"up"[..])])
            .await;
        if put.is_ok_and(|o| matches!(o[0], PutOutcome::Stored | PutOutcome::AlreadyExists)) {
            return client;
        }
        assert!(Instant::now() < deadline, "the cluster never took a put");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The cluster still serves: a new block is stored.
async fn stores_a_new_block(client: &Client, ns: &Namespace) {
    let hash = BlockHash::from_opaque(b"after");
    let put = client.put(ns, &[(hash, &b"still here"[..])]).await.unwrap();
    assert_eq!(put, vec![PutOutcome::Stored]);
}

/// Opens `n` connections to `addr` and on each announces an `Auth` body of
/// 4 MiB, then sends up to 3 MiB of it, as long as the server reads.
/// Returns the connections, still open on this side.
async fn drip_oversized_auth(addr: &str, n: usize) -> Vec<TcpStream> {
    let chunk = vec![b'x'; 256 << 10];
    let mut conns = Vec::new();
    for _ in 0..n {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        let header = Header::request(Opcode::Auth, 1, 4 << 20).encode();
        if conn.write_all(&header).await.is_ok() {
            for _ in 0..12 {
                let sent = tokio::time::timeout(Duration::from_secs(2), conn.write_all(&chunk));
                if !matches!(sent.await, Ok(Ok(()))) {
                    break;
                }
            }
        }
        conns.push(conn);
    }
    conns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_auth_bodies_leave_both_servers_memory_where_it_was() {
    let dir = scratch_dir("memory-auth");
    let token = "mc_memory_cluster_token";
    let digest = mooncake_proto::auth::token_digest(token);
    let tokens = dir.join("tokens.toml");
    std::fs::write(
        &tokens,
        format!("[[tokens]]\nname = \"storage\"\nsha256 = \"{digest}\"\nrole = \"cluster\"\n"),
    )
    .unwrap();
    let auth = ["--auth", tokens.to_str().unwrap(), "--token", token];
    let (meta, daemon, meta_addr, daemon_addr) = start(&dir, &auth, "");
    let ns = Namespace::new("memory").unwrap();
    let client = ready(&meta_addr, Some(token), &ns).await;
    let before = (rss(&meta), rss(&daemon));
    // 64 peers each try to make a server hold 3 MiB: 192 MiB if it did.
    let at_meta = drip_oversized_auth(&meta_addr, 64).await;
    let at_daemon = drip_oversized_auth(&daemon_addr, 64).await;
    let after = (rss(&meta), rss(&daemon));
    eprintln!(
        "RSS (MiB) meta {} -> {}, daemon {} -> {}",
        before.0 / MIB,
        after.0 / MIB,
        before.1 / MIB,
        after.1 / MIB
    );
    for (who, before, after) in [
        ("meta service", before.0, after.0),
        ("daemon", before.1, after.1),
    ] {
        assert!(
            after < before + 32 * MIB,
            "the {who} grew from {} to {} MiB",
            before / MIB,
            after / MIB
        );
    }
    stores_a_new_block(&client, &ns).await;
    drop((at_meta, at_daemon));
}

/// Sends `requests` put starts over `conn`, `window` at a time, each in a
/// namespace of its own with `per` keys, and never commits one: the number
/// of keys placed.
async fn flood_reservations(conn: &mut Connection, round: u32, requests: u32, per: u32) -> u64 {
    const WINDOW: u32 = 256;
    let mut placed = 0;
    let (writer, reader) = conn.split();
    for first in (0..requests).step_by(WINDOW as usize) {
        let last = (first + WINDOW).min(requests);
        for i in first..last {
            let req = PutStartRequest {
                namespace: Namespace::new(format!("flood/{round}/{i}")).unwrap(),
                node: String::new(),
                replicas: 1,
                items: (0..per)
                    .map(|k| {
                        mooncake_proto::message::ToPlace::unchained(
                            BlockHash::from_opaque(&k.to_le_bytes()),
                            4096,
                        )
                    })
                    .collect(),
            };
            writer
                .send(Opcode::PutStart, &req.to_bytes(), &[])
                .await
                .unwrap();
        }
        writer.flush().await.unwrap();
        for _ in first..last {
            let header = reader.next_header(Opcode::PutStart).await.unwrap();
            let body = reader.body(header.body_len as usize).await.unwrap();
            let answer = mooncake_proto::message::PutStartResponse::from_bytes(&body).unwrap();
            placed += answer
                .slots
                .iter()
                .filter(|s| matches!(s, mooncake_proto::message::Slot::Place { .. }))
                .count() as u64;
        }
    }
    placed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_namespaces_and_reservations_leave_the_meta_services_memory_bounded() {
    // Reservations expire after a second; one client may hold 10,000.
    let config = "[meta]\nput_timeout = \"1s\"\nmax_pending_puts_per_client = 10000\n";
    let dir = scratch_dir("memory-flood");
    let (meta, _daemon, meta_addr, _) = start(&dir, &[], config);
    let ns = Namespace::new("memory").unwrap();
    let client = ready(&meta_addr, None, &ns).await;
    let mut conn = Connection::connect(&meta_addr, ErrorSource::Meta, Duration::from_secs(2))
        .await
        .unwrap();
    let before = rss(&meta);
    // Each round asks for 400,000 reservations in 50,000 namespaces: with
    // nothing to bound them, 45 MiB more each round (a release build).
    let mut peaks = Vec::new();
    for round in 0..3 {
        let started = std::time::Instant::now();
        let placed = flood_reservations(&mut conn, round, 50_000, 8).await;
        // At most 10,000 held at once, and each is let go a second after it
        // was placed: a round that lasts E seconds (a loaded host makes it
        // long) can place 10,000 for each second it spans, never more.
        let spans = started.elapsed().as_secs() + 1;
        assert!(
            placed <= 10_000 * spans,
            "round {round}: {placed} placed in under {spans} s"
        );
        peaks.push(rss(&meta));
        // Its reservations expire, and their namespaces go with them.
        tokio::time::sleep(Duration::from_millis(2500)).await;
    }
    let grown: Vec<u64> = peaks
        .iter()
        .map(|p| p.saturating_sub(before) / MIB)
        .collect();
    eprintln!(
        "RSS {} MiB, grown by {grown:?} MiB after each flood",
        before / MIB
    );
    assert!(
        peaks.iter().all(|p| *p < before + 24 * MIB),
        "the meta service grew by {grown:?} MiB over three floods (from {} MiB)",
        before / MIB
    );
    stores_a_new_block(&client, &ns).await;
}

/// This host's `MemTotal`, in bytes.
fn mem_total() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    kib * 1024
}

#[test]
fn a_pool_larger_than_the_hosts_memory_is_refused_at_start_in_one_line() {
    // More than all of the memory, and a size the config accepts (1 TiB).
    let asked_gib = mem_total().div_ceil(1 << 30) + 1;
    if asked_gib > 1024 {
        return;
    }
    let dram = format!("{asked_gib}GiB");
    let (meta, daemon) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let runs = [
        vec!["up", "--meta-listen", &meta, "--listen", &daemon],
        vec!["daemon", "--meta", &meta, "--listen", &daemon],
    ];
    for args in runs {
        let out = std::process::Command::new(BIN)
            .args(&args)
            .args(["--admin", "", "--dram", &dram])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {err}", args[0]);
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ")
                && last.contains(&format!("a DRAM pool of {dram} does not fit"))
                && (last.contains("MemAvailable") || last.contains("cgroup")),
            "{}: {err}",
            args[0]
        );
        // Refused before any of it was mapped: nothing was filled.
        assert!(!err.contains("filling the DRAM pool"), "{}: {err}", args[0]);
    }
}
