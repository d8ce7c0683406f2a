//! The `mooncake-store` binary as a user runs it: `up` in one process, the
//! block commands from another, and a clean stop on SIGTERM.

mod common;
use common::store::{run, succeeded, Store, FRESH};
use common::{free_port, BIN};

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn put_get_stat_ls_rm_through_the_binary_then_a_clean_stop() {
    let mut store = Store::up();
    let meta = store.meta.clone();
    let value: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();

    let out = run(&meta, &["put", "-n", "acme/m1", "prompt-1"], Some(&value));
    succeeded(&out);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("stored "));

    let out = run(&meta, &["get", "-n", "acme/m1", "prompt-1"], None);
    assert!(out.status.success());
    assert!(out.stdout == value, "get returns the bytes put");

    let dir = std::env::temp_dir().join(format!("mooncake-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("block.bin");
    let out = run(
        &meta,
        &[
            "get",
            "-n",
            "acme/m1",
            "prompt-1",
            "-o",
            file.to_str().unwrap(),
        ],
        None,
    );
    assert!(out.status.success());
    assert_eq!(std::fs::read(&file).unwrap(), value);
    let _ = std::fs::remove_dir_all(&dir);

    let out = run(&meta, &["stat", "--json"], None);
    let stat = String::from_utf8_lossy(&out.stdout);
    assert!(stat.contains("\"blocks\":1"), "{stat}");

    let out = run(&meta, &["ls", "-n", "acme/m1"], None);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);

    // Two copies asked of a one-host store: one stored, and said so.
    let out = run(
        &meta,
        &["put", "--replicas", "2", "two", "--json"],
        Some(b"x"),
    );
    succeeded(&out);
    let put = String::from_utf8_lossy(&out.stdout);
    assert!(
        put.contains("\"outcome\":\"short\"") && put.contains("\"copies\":1"),
        "{put}"
    );
    let out = run(&meta, &["ls", "--json"], None);
    let ls = String::from_utf8_lossy(&out.stdout);
    assert!(ls.lines().all(|l| l.contains("\"daemons\":[1]")), "{ls}");
    let out = run(&meta, &["put", "--replicas", "5", "five"], Some(b"x"));
    assert_eq!(out.status.code(), Some(2), "5 copies is a usage error");
    let out = run(&meta, &["rm", "two"], None);
    succeeded(&out);

    let out = run(&meta, &["rm", "-n", "acme/m1", "prompt-1"], None);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("removed "));
    let out = run(&meta, &["get", "-n", "acme/m1", "prompt-1"], None);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: not found"), "{err}");
    assert_eq!(err.lines().count(), 1, "errors are one line");

    // SIGTERM: a graceful stop, exit status 0.
    let pid = store.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = store.child.try_wait().unwrap() {
            assert!(status.success(), "stopped with {status}");
            break;
        }
        assert!(Instant::now() < deadline, "did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn errors_say_what_to_do_and_exit_with_distinct_codes() {
    let dead = format!("127.0.0.1:{}", free_port());
    let out = run(&dead, &["stat"], None);
    assert_eq!(out.status.code(), Some(3), "cannot reach the store");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mooncake-store up"), "{err}");
    assert_eq!(err.lines().count(), 1);

    let out = run(&dead, &["put", "-n", "bad namespace", "k"], Some(b"x"));
    assert_eq!(out.status.code(), Some(2), "usage error");

    let out = Command::new(BIN)
        .args(["bench", "--concurrency", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_client_pointed_at_a_daemon_instead_of_the_meta_service_is_told_so_in_one_line() {
    let store = Store::up();
    let out = run(&store.daemon, &["get", "k"], None);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a wrong address is a usage error"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{} is a storage daemon, not the meta service",
            store.daemon
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_bad_daemon_setting_stops_up_and_daemon_before_anything_starts() {
    let meta = format!("127.0.0.1:{}", free_port());
    let listen = format!("127.0.0.1:{}", free_port());
    let up = [
        "up",
        "--meta-listen",
        &meta,
        "--listen",
        &listen,
        "--admin",
        "",
    ];
    let daemon = [
        "daemon", "--meta", &meta, "--listen", &listen, "--admin", "",
    ];
    let socket = format!("/nonexistent-{}/shm.sock", std::process::id());
    let drive = format!("/nonexistent-{}/drive.bin", std::process::id());
    let drive_spec = format!("{drive}:1GiB");
    let bad = [
        (["--dram", "0"], "[daemon] dram = 0B".to_string()),
        (
            ["--shm-socket", &socket],
            format!("[daemon] shm_socket = {socket}: no directory"),
        ),
        (
            ["--nvme", &drive_spec],
            format!("[daemon] nvme = {drive}: no directory"),
        ),
    ];
    for args in [&up[..], &daemon[..]] {
        for (setting, says) in &bad {
            let args: Vec<&str> = args.iter().chain(setting).copied().collect();
            refused_at_start(&args, says);
        }
    }
}

/// Runs the binary with `args` and holds it to a usage error at start:
/// exit 2, one line on stderr that says `says`, nothing on stdout (no
/// server announced it was up).
fn refused_at_start(args: &[&str], says: &str) {
    let out = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line: {args:?}: {err}"
    );
    assert!(err.contains(says), "{err}");
    assert!(out.stdout.is_empty(), "{args:?}");
}

#[test]
fn a_config_file_that_does_not_parse_is_one_line_with_where_it_went_wrong() {
    let dir = common::cluster::scratch_dir("bad-config");
    let path = dir.join("store.toml");
    std::fs::write(&path, "[daemon]\ndram = \"lots\"\n").unwrap();
    let missing = dir.join("missing.toml");
    for (file, says) in [
        (&path, "line 2, column 8: \"lots\" is not a size"),
        (&missing, "cannot read"),
    ] {
        refused_at_start(&["up", "--config", file.to_str().unwrap()], says);
    }
}

#[test]
fn a_value_larger_than_any_daemon_takes_is_refused_with_its_size() {
    let store = Store::up_sized("4MiB", &[]);
    let value = vec![7u8; 5 << 20];
    let out = run(&store.meta, &["put", "huge"], Some(&value));
    assert_eq!(out.status.code(), Some(4), "refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("too_large: 5MiB is more than any daemon takes"),
        "{err}"
    );
    // The store keeps serving.
    succeeded(&run(&store.meta, &["put", "small"], Some(b"bytes")));
}

#[test]
fn a_dead_daemon_is_exit_3_and_one_line_for_get_and_put() {
    let meta = format!("127.0.0.1:{}", free_port());
    let daemon = format!("127.0.0.1:{}", free_port());
    let spawn = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _meta = Killed(spawn(&["meta", "--listen", &meta, "--admin", ""]));
    let mut daemon_proc = Killed(spawn(&[
        "daemon", "--meta", &meta, "--listen", &daemon, "--dram", "16MiB", "--admin", "",
    ]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !run(&meta, &["put", "probe"], Some(b"x")).status.success() {
        assert!(Instant::now() < deadline, "the store did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(run(&meta, &["put", "kept"], Some(b"value"))
        .status
        .success());
    let _ = daemon_proc.0.kill();
    let _ = daemon_proc.0.wait();
    // Within the daemon's TTL the meta service still places blocks on it
    // and knows the key there: the daemon is what cannot be reached.
    for (args, stdin) in [
        (&["get", "kept"][..], None),
        (&["put", "new"][..], Some(&b"v"[..])),
    ] {
        let out = run(&meta, args, stdin);
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.code() == Some(1) && args[0] == "get" {
            // Already dropped from the index: a plain miss.
            continue;
        }
        assert_eq!(out.status.code(), Some(3), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
    }
}

#[test]
fn hash_prints_the_documented_test_vectors() {
    let out = Command::new(BIN)
        .args([
            "hash",
            "--block-tokens",
            "4",
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
            "6",
            "7",
            "8",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let keys: Vec<&str> = text
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap())
        .collect();
    assert_eq!(
        keys,
        [
            "bdf2fd341809efae94ae22d1233ca3ac4b0492bd8005a073b8c0cb47db1f741c",
            "01f8357aa6686646a99da02ac8c1c213946adbc69efcf6d9d796f0fb9a96dd01",
        ]
    );
    let out = Command::new(BIN)
        .args(["hash", "--json", "--block-tokens", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"1,2\n3 4 5")?;
            c.wait_with_output()
        })
        .unwrap();
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(json.contains("\"unhashed_tail_tokens\":1"), "{json}");
}

#[test]
fn bench_runs_against_an_embedded_store_and_reports_json() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--embedded",
            "--dram",
            "64MiB",
            "--sizes",
            "4KiB,64KiB",
            "--ops",
            "200",
            // Puts from 16 distinct 64 KiB blocks (and 256 of 4 KiB).
            "--put-from",
            "1MiB",
            "--json",
        ])
        .output()
        .unwrap();
    succeeded(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows.len(), 4, "{text}");
    for row in rows {
        assert!(
            row.contains("\"misses\":0") && row.contains("\"errors\":0"),
            "{row}"
        );
        assert!(row.contains("\"p99_us\""));
    }
}

#[test]
fn bench_through_shared_memory_says_how_many_puts_went_into_room_held_ahead_in_one_round_trip() {
    let socket = std::env::temp_dir().join(format!("mooncake-cli-bench-{}.sock", free_port()));
    let socket = socket.to_str().unwrap();
    let store = Store::up_with(&["--shm-socket", socket]);
    let out = Command::new(BIN)
        .args(["bench", "--meta", &store.meta, "--shm-socket", socket])
        .args(["--sizes", "64KiB", "--ops", "40", "--concurrency", "1"])
        .output()
        .unwrap();
    succeeded(&out);
    // One block at a time on one connection: the first reserves its own
    // room and asks for room ahead; each later one goes into it, and the
    // daemon makes it visible itself.
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("shm 40 read, 40 written (39 into room held ahead, 39 in one round trip)"),
        "{text}"
    );
    let _ = std::fs::remove_file(socket);
}

#[test]
fn operators_pin_evict_drain_and_list_by_prefix() {
    let store = Store::up();
    let meta = store.meta.clone();
    let mut hashes = Vec::new();
    for i in 0..5 {
        let out = run(
            &meta,
            &["put", "--json", &format!("op-{i}")],
            Some(&vec![i as u8; 50_000]),
        );
        let line = String::from_utf8_lossy(&out.stdout).to_string();
        let key = line.split("\"key\":\"").nth(1).unwrap()[..64].to_string();
        hashes.push(key);
    }
    // A get that the daemon serves counts in its hit rate; one the index
    // already answers as a miss never reaches a daemon.
    assert!(run(&meta, &["get", "op-0"], None).status.success());
    assert!(!run(&meta, &["get", "never-stored"], None).status.success());

    let out = run(&meta, &["ls", "--prefix", &hashes[3][..4]], None);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(listed.contains(&hashes[3]), "{listed}");
    assert!(run(&meta, &["ls", "--prefix", "xyz"], None).status.code() == Some(2));

    let out = run(&meta, &["pin", "op-2"], None);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("pinned"));
    let out = run(&meta, &["evict", "1", "--bytes", "1GiB", "--json"], None);
    let evicted = String::from_utf8_lossy(&out.stdout);
    assert!(
        evicted.contains("\"blocks\":4"),
        "all but the pinned block: {evicted}"
    );
    // The daemon reports its evictions; the index follows.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = run(&meta, &["ls", "--json"], None);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.lines().count() == 1 && text.contains(&hashes[2]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "index still lists evicted blocks: {text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = run(&meta, &["unpin", "op-2"], None);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("unpinned"));

    let out = run(&meta, &["drain", "1", "--evict"], None);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 of its 1 blocks evicted"),
        "{out:?}"
    );
    let out = run(&meta, &["stat"], None);
    let stat = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(stat.contains("draining"), "{stat}");
    assert!(
        stat.contains("hit rate  100.0% (1 hits, 0 misses"),
        "{stat}"
    );
    let out = run(&meta, &["put", "new-block"], Some(b"x"));
    assert_eq!(
        out.status.code(),
        Some(4),
        "no daemon takes blocks while draining"
    );
    let out = run(&meta, &["stat", "--json"], None);
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(
        json.contains("\"draining\":true") && json.contains("\"hits\":1"),
        "{json}"
    );
    assert!(run(&meta, &["drain", "1", "--undo"], None).status.success());
    assert!(run(&meta, &["put", "new-block"], Some(b"x"))
        .status
        .success());
}

#[test]
fn bench_io_reads_a_file_through_both_engines() {
    let dir = std::env::temp_dir().join(format!("mooncake-bench-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tier.bin");
    let out = Command::new(BIN)
        .args([
            "bench-io",
            "--file",
            file.to_str().unwrap(),
            "--size",
            "16MiB",
            "--block",
            "64KiB",
        ])
        .args(["--depth", "4", "--seconds", "300ms", "--json"])
        .output()
        .unwrap();
    succeeded(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert!(rows[0].contains("io_uring") && rows[1].contains("pread/pwrite"));
    assert!(rows.iter().all(|r| r.contains("\"errors\":0")));
    assert_eq!(
        std::fs::metadata(&file).unwrap().len(),
        16 << 20,
        "filled to --size"
    );
    let bad = Command::new(BIN)
        .args([
            "bench-io",
            "--file",
            file.to_str().unwrap(),
            "--block",
            "1000",
        ])
        .output()
        .unwrap();
    assert_eq!(
        bad.status.code(),
        Some(2),
        "a misaligned block size is a usage error"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `health` (the image's health check) answers 0 for a server whose admin
/// port says it is healthy, 3 in one line where no admin port answers.
#[test]
fn health_asks_the_admin_port() {
    let admin = format!("127.0.0.1:{}", free_port());
    let mut up = Command::new(BIN)
        .args(["up", "--admin", &admin, "--dram", "16MiB"])
        .args(["--meta-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let health = |addrs: &str| {
        Command::new(BIN)
            .args(["health", "--admin", addrs])
            .output()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = health(&admin);
    while !out.status.success() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        out = health(&admin);
    }
    let _ = up.kill();
    let _ = up.wait();
    succeeded(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
    let dead = format!("127.0.0.1:{}", free_port());
    let out = health(&dead);
    assert_eq!(out.status.code(), Some(3));
    let why = String::from_utf8_lossy(&out.stderr);
    assert_eq!(why.trim_end().lines().count(), 1, "{why}");
    assert!(why.contains(&dead), "{why}");
}

#[test]
fn route_names_the_host_holding_a_prompts_prefix_as_the_readme_shows() {
    let store = Store::up();
    // The README's pipeline: `hash` the prompt's tokens, `route` the keys.
    let tokens: String = (0..64).map(|t| format!("{t} ")).collect();
    let hashed = Command::new(BIN)
        .args(["hash", "--block-tokens", "16"])
        .args(tokens.split_whitespace())
        .output()
        .unwrap();
    succeeded(&hashed);
    let keys: Vec<String> = String::from_utf8_lossy(&hashed.stdout)
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
        .collect();
    assert_eq!(keys.len(), 4);
    for key in &keys[..3] {
        succeeded(&run(&store.meta, &["put", key], Some(b"kv")));
    }
    let mut args = vec!["route", "--json"];
    args.extend(keys.iter().map(String::as_str));
    let out = run(&store.meta, &args, None);
    succeeded(&out);
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (answer["blocks"].as_u64(), answer["matched"].as_u64()),
        (Some(4), Some(3))
    );
    let host = &answer["hosts"][0];
    assert_eq!(
        (host["leading"].as_u64(), host["held"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(answer["best"], host["node"]);
    assert_eq!(host["cost"].as_f64(), Some(1.0), "one block to prefill");
    // A queue on a host that is not a candidate is a usage error.
    let mut bad = vec!["route", "--candidates", "a", "--queue", "b=1"];
    bad.extend(keys.iter().map(String::as_str));
    let out = run(&store.meta, &bad, None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--queue names b"));
}

#[test]
fn events_follows_the_store_events_from_the_terms_start() {
    let store = Store::up_with(&["--events", FRESH, "--events-replay", FRESH]);
    let (events, replay) = (&store.fresh[0], &store.fresh[1]);
    succeeded(&run(
        &store.meta,
        &["put", "-n", "t/events", "k1"],
        Some(b"v"),
    ));
    let out = Command::new(BIN)
        .args(["events", "--events", events, "--replay", replay])
        .args(["--from-start", "--count", "2", "--keys", "--json"])
        .output()
        .unwrap();
    succeeded(&out);
    let batches: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0]["events"][0]["type"], "AllBlocksCleared");
    assert_eq!(batches[0]["topic"], "kv");
    let stored = &batches[1]["events"][0];
    assert_eq!(stored["type"], "BlockStored");
    let key = mooncake_proto::BlockHash::from_opaque(b"k1").to_hex();
    assert_eq!(stored["block_hashes"][0].as_str(), Some(key.as_str()));
    assert!(batches[1]["topic"].as_str().unwrap().ends_with("@t/events"));
    assert_eq!(
        batches[1]["seq"].as_u64(),
        batches[0]["seq"].as_u64().map(|s| s + 1)
    );
    // Nothing publishing there: exit 3 within the connect timeout.
    let out = Command::new(BIN)
        .args(["events", "--events", &format!("127.0.0.1:{}", free_port())])
        .args(["--connect-timeout", "1s"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no answer within"));
}

#[test]
fn a_server_whose_etcd_never_answers_gives_up_after_etcd_wait_with_exit_code_3() {
    let etcd = format!("http://127.0.0.1:{}", free_port());
    for role in ["meta", "daemon"] {
        let listen = format!("127.0.0.1:{}", free_port());
        let out = Command::new(BIN)
            .args([
                role,
                "--etcd",
                &etcd,
                "--listen",
                &listen,
                "--etcd-wait",
                "1s",
            ])
            .args(["--admin", ""])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{role}: {err}");
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(last.contains("is etcd running"), "{role}: {err}");
        // gRPC's message and the root cause, not the wrapped errors' chain.
        assert!(last.contains("Connection refused"), "{role}: {err}");
        assert!(!last.contains("tonic::"), "{role}: {err}");
        assert!(
            err.contains("waiting for etcd"),
            "{role} said it waited: {err}"
        );
    }
}

#[test]
fn a_meta_replica_whose_port_is_taken_stops_at_start_not_at_a_failover() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    // No etcd answers there either: the port is what it says.
    let etcd = format!("http://127.0.0.1:{}", free_port());
    let out = Command::new(BIN)
        .args(["meta", "--etcd", &etcd, "--listen", &addr, "--admin", ""])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(&addr) && err.contains("meta service"), "{err}");
}

#[test]
fn bench_gpu_says_in_one_line_that_this_host_has_no_gpu() {
    if mooncake_client::device::cuda::Cuda::load().is_ok() {
        // A GPU host: `tools/gpu-check.sh` runs the command there.
        return;
    }
    let out = Command::new(BIN)
        .args(["bench-gpu", "--meta", "127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("no GPU") && err.contains("libcuda.so.1"),
        "{err}"
    );
}
