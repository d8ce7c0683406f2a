//! The trace commands as a user runs them: `replay` against a running
//! store, `simulate` and `route-sim` on their own, each on a small
//! synthetic trace whose answers are known.

mod common;
use common::cluster::Cluster;
use common::store::{run, succeeded, Store, FRESH};
use common::BIN;

use std::process::{Command, Stdio};

/// A trace in the Mooncake format with reused prefixes: 200 requests over
/// 20 "documents", each request a document's first blocks plus its own.
fn synthetic_trace(path: &std::path::Path) {
    let mut lines = String::new();
    let mut next_private = 10_000u64;
    for i in 0..200u64 {
        let doc = (i * 7) % 20;
        let shared = 1 + (i % 5);
        let mut ids: Vec<u64> = (0..shared).map(|b| doc * 100 + b).collect();
        for _ in 0..(i % 3) {
            ids.push(next_private);
            next_private += 1;
        }
        let input = ids.len() as u64 * 512 - (i % 300);
        lines.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {input}, \"output_length\": 8, \"hash_ids\": {ids:?}}}\n",
            i * 10
        ));
    }
    std::fs::write(path, lines).unwrap();
}

/// A scratch folder of this test process named for `what`, holding the
/// small synthetic trace (`trace.jsonl`).
fn dir_with_trace(what: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("mooncake-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    synthetic_trace(&trace);
    (dir, trace)
}

fn json_u64(json: &str, field: &str) -> u64 {
    let at = json
        .find(&format!("\"{field}\":"))
        .unwrap_or_else(|| panic!("no {field} in {json}"));
    json[at + field.len() + 3..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn replay_with_room_for_everything_hits_exactly_the_theoretical_maximum() {
    let store = Store::up();
    let dir = std::env::temp_dir().join(format!("mooncake-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let synthetic = dir.join("trace.jsonl");
    synthetic_trace(&synthetic);
    let mut traces = vec![(synthetic.clone(), "200")];
    // The Mooncake trace shipped beside the project, when it is there.
    let shipped = common::repo("../shared/data/synthetic_trace.jsonl");
    if shipped.exists() {
        traces.push((shipped.to_path_buf(), "400"));
    }
    for (trace, limit) in traces {
        let json = replay_one_at_a_time(&store.meta, &trace, limit, &[]);
        assert_eq!(
            json_u64(&json, "hit_tokens"),
            json_u64(&json, "theoretical_hit_tokens"),
            "{}: {json}",
            trace.display()
        );
        assert!(json_u64(&json, "hit_tokens") > 0);
        assert_eq!(json_u64(&json, "wrong_bytes"), 0);
        assert_eq!(json_u64(&json, "errors"), 0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `replay --json` of a trace's first `limit` requests, one at a time, in
/// 1 KiB blocks (2 bytes a token), with `extra` arguments.
fn replay_one_at_a_time(
    meta: &str,
    trace: &std::path::Path,
    limit: &str,
    extra: &[&str],
) -> String {
    let mut args = vec![
        "replay",
        trace.to_str().unwrap(),
        "--workers",
        "1",
        "--bytes-per-token",
        "2",
        "--limit",
        limit,
        "--json",
    ];
    args.extend(extra);
    let out = run(meta, &args, None);
    succeeded(&out);
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn json_f64(json: &str, field: &str) -> f64 {
    let at = json
        .find(&format!("\"{field}\":"))
        .unwrap_or_else(|| panic!("no {field} in {json}"));
    json[at + field.len() + 3..]
        .split([',', '}'])
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// `simulate --json` of `trace` with `args`: its output.
fn simulate_json(trace: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["simulate", trace.to_str().unwrap(), "--json"])
        .args(args)
        .output()
        .unwrap();
    succeeded(&out);
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The Mooncake trace's first 1,500 requests, in `dir`; where that trace
/// is not beside the repository (a fresh clone), 1,500 requests of the
/// CLI's own shared-prompt trace (seed 1).
fn first_1500_requests(dir: &std::path::Path) -> std::path::PathBuf {
    let shipped = common::repo("../shared/data/synthetic_trace.jsonl");
    let trace = dir.join("trace.jsonl");
    if shipped.exists() {
        let all = std::fs::read_to_string(&shipped).unwrap();
        let head: Vec<&str> = all.lines().take(1500).collect();
        std::fs::write(&trace, head.join("\n") + "\n").unwrap();
    } else {
        let made = Command::new(BIN)
            .args(["gen-trace", "shared-prompt", "--requests", "1500", "--out"])
            .arg(&trace)
            .output()
            .unwrap();
        succeeded(&made);
    }
    trace
}

#[test]
fn a_daemon_hits_what_simulate_predicts_for_its_eviction_order() {
    // The Mooncake trace's first 1,500 requests through a pool of 2,048
    // 1 KiB blocks (2 bytes a token, 512 tokens a block) under each order:
    // the store's own hit rate is within half a point of what `simulate`
    // (the daemon's pool driven offline) predicts, and 2Q's beats LRU's.
    // Where the Mooncake trace is not beside the repository (a fresh
    // clone), the CLI's own shared-prompt trace (seed 1), on which
    // `simulate` puts 2Q 2.5 points above LRU at this size.
    let dir = std::env::temp_dir().join(format!("mooncake-orders-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = first_1500_requests(&dir);
    let mut rates = Vec::new();
    for order in ["lru", "2q"] {
        let config = dir.join(format!("{order}.toml"));
        std::fs::write(&config, format!("[daemon]\neviction = \"{order}\"\n")).unwrap();
        let store = Store::up_sized("2MiB", &["--config", config.to_str().unwrap()]);
        let json = replay_one_at_a_time(&store.meta, &trace, "1500", &[]);
        assert_eq!(json_u64(&json, "errors"), 0, "{json}");
        assert_eq!(json_u64(&json, "wrong_bytes"), 0, "{json}");
        let store_rate = json_f64(&json, "token_hit_rate");
        let predicted = json_f64(&json, &format!("simulated_{order}_token_hit_rate"));
        assert!(
            (store_rate - predicted).abs() <= 0.005,
            "{order}: store {store_rate} vs simulated {predicted}: {json}"
        );
        rates.push(store_rate);
    }
    assert!(rates[1] > rates[0], "2q {} vs lru {}", rates[1], rates[0]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_of_daemons_hits_what_simulate_predicts_for_it() {
    // The same 1,500 requests through four daemons of 1 MiB (4,096 blocks
    // of 1 KiB in all, 2Q): the cluster's hit rate is within a point of
    // `simulate --daemons 4`, which places blocks as the meta service
    // does. Before the meta service placed blocks by how much of its pool
    // each daemon was given so far, the daemon that had just reported its
    // evictions took every new block of a full cluster; and before a block
    // stored again went back to the daemon that evicted it, it started in
    // probation wherever it landed. Together they cost a 4-daemon cluster
    // 3 to 6 points of the Mooncake trace's hit rate.
    let dir = std::env::temp_dir().join(format!("mooncake-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = first_1500_requests(&dir);
    let cluster = Cluster::start_sized(1, 4, "1MiB").await;
    let json = replay_one_at_a_time(&cluster.metas[0].0, &trace, "1500", &[]);
    assert_eq!(json_u64(&json, "errors"), 0, "{json}");
    assert_eq!(json_u64(&json, "wrong_bytes"), 0, "{json}");
    let sim = simulate_json(&trace, &["--capacities", "4096", "--daemons", "4"]);
    let predicted = json_f64(&sim, "2q_token_hit_rate");
    let store_rate = json_f64(&json, "token_hit_rate");
    assert!(
        (store_rate - predicted).abs() <= 0.01,
        "cluster {store_rate} vs simulated {predicted}: {json} {sim}{}",
        cluster.log_tails(5)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_daemon_keeps_the_conversations_that_engines_put_as_lru_would_and_as_simulate_predicts() {
    // 3,000 requests of the CLI's own conversation trace (seed 1), through
    // a 2Q daemon of 2,048 1 KiB blocks, called as the serving engines'
    // Mooncake backends call it: which of a request's keys exist, then the
    // missing ones put naming no parent. The client names the parent each
    // lookup implied (`client/src/lineage.rs`) and the meta service takes a
    // lookup's leading found keys as a prefix, so a conversation's next
    // turn is kept in main: the daemon hits what `simulate` predicts for
    // chains, and as much as an LRU of its size. Without that, every block
    // an engine put waited in probation: 72.2% against 73.8% predicted.
    let dir = std::env::temp_dir().join(format!("mooncake-engines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("chat.jsonl");
    let made = Command::new(BIN)
        .args([
            "gen-trace",
            "chat",
            "--requests",
            "3000",
            "--seed",
            "1",
            "--out",
        ])
        .arg(&trace)
        .output()
        .unwrap();
    succeeded(&made);
    let store = Store::up_sized("2MiB", &[]);
    let json = replay_one_at_a_time(&store.meta, &trace, "3000", &["--calls", "engines"]);
    assert_eq!(json_u64(&json, "errors"), 0, "{json}");
    assert_eq!(json_u64(&json, "wrong_bytes"), 0, "{json}");
    let store_rate = json_f64(&json, "token_hit_rate");
    let predicted = json_f64(&json, "simulated_2q_token_hit_rate");
    let lru = json_f64(&json, "lru_token_hit_rate");
    assert!(
        (store_rate - predicted).abs() <= 0.005,
        "store {store_rate} vs simulated {predicted}: {json}"
    );
    assert!(
        store_rate >= lru - 0.005,
        "store {store_rate} vs lru {lru}: {json}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The value of the series `series` on `admin`'s `/metrics` (0 if none).
fn scrape(admin: &str, series: &str) -> u64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(admin).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[test]
fn a_daemon_with_a_drive_hits_what_simulate_predicts_and_drops_no_evicted_block() {
    // The Mooncake trace's first 1,500 requests (the shared-prompt trace
    // where it is absent) one at a time through 2 MiB of DRAM (2,048
    // blocks of 1 KiB) and a drive of 8,000 blocks (4 KiB extents): the
    // store's hit rate is within half a point of `simulate --nvme`'s, and
    // every block DRAM evicts goes to the drive. The drive's writes fall
    // behind the puts, and the puts wait for them: none is dropped for a
    // full demotion queue, and that queue (blocks readable in memory
    // beyond the pool) stays small beside the pool. (Before, puts that the
    // pool could place only by evicting went ahead and dropped a block in
    // six, 4.7 points short on the whole trace; and a queue of 4,096
    // blocks, twice this pool, hit 1.8 points above the simulation.)
    let dir = std::env::temp_dir().join(format!("mooncake-demote-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = first_1500_requests(&dir);
    let drive = format!("{}:32000KiB", dir.join("drive.bin").display());
    let store = Store::launch("2MiB", &["--nvme", &drive, "--admin", FRESH], &[]);
    let json = replay_one_at_a_time(&store.meta, &trace, "1500", &[]);
    assert_eq!(json_u64(&json, "errors"), 0, "{json}");
    assert_eq!(json_u64(&json, "wrong_bytes"), 0, "{json}");
    let admin = &store.fresh[0];
    let series = |name: &str| scrape(admin, name);
    let evicted = series("mooncake_daemon_evictions_total{tier=\"dram\"}");
    let demoted = series("mooncake_daemon_tier_moves_total{direction=\"demote\"}");
    // Both traces turn the pool over several times (the Mooncake trace's
    // first 1,500 requests evict over 10,000 blocks, shared-prompt's about
    // 6,300): the drive is exercised, not a corner of it.
    assert!(evicted > 2 * 2048, "DRAM evicted only {evicted} blocks");
    assert_eq!(demoted, evicted, "evicted from DRAM, not sent to the drive");
    assert!(series("mooncake_daemon_gets_total{result=\"hit\",tier=\"nvme\"}") > 0);
    // The drive's own I/O is timed: every demotion written, reads too.
    let timed = |op: &str| {
        series(&format!(
            "mooncake_daemon_nvme_io_seconds_count{{op=\"{op}\"}}"
        ))
    };
    assert!(timed("write") > 0 && timed("read") > 0);

    let sim = simulate_json(&trace, &["--capacities", "2048", "--nvme", "8000"]);
    let predicted = json_f64(&sim, "drive_2q_token_hit_rate");
    let dram_only = json_f64(&sim, "daemon_2q_token_hit_rate");
    let store_rate = json_f64(&json, "token_hit_rate");
    assert!(
        (store_rate - predicted).abs() <= 0.005,
        "store {store_rate} vs simulated {predicted}: {json} {sim}"
    );
    assert!(predicted > dram_only + 0.01, "the drive adds hits: {sim}");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_sweeps_cache_sizes_and_plots_them() {
    let (dir, trace) = dir_with_trace("sim");
    let svg = dir.join("plot.svg");
    let out = Command::new(BIN)
        .args([
            "simulate",
            trace.to_str().unwrap(),
            "--points",
            "5",
            "--json",
            "--svg",
        ])
        .arg(&svg)
        .output()
        .unwrap();
    succeeded(&out);
    let json = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(json.matches("capacity_blocks").count(), 5);
    // At the full footprint, both policies reach the theoretical maximum.
    let max = json
        .split("\"theoretical_token_hit_rate\":")
        .nth(1)
        .unwrap();
    let max: f64 = max.split([',', '}']).next().unwrap().parse().unwrap();
    for policy in ["lru", "frequency_oracle", "min", "daemon_lru", "daemon_2q"] {
        let key = format!("\"{policy}_token_hit_rate\":");
        let last = json.rsplit(key.as_str()).next().unwrap();
        let last: f64 = last.split([',', '}']).next().unwrap().parse().unwrap();
        assert!((last - max).abs() < 1e-12, "{policy}: {last} vs {max}");
    }
    // Belady's MIN and the frequency oracle are drawn beside LRU, the
    // daemon's two orders and the maximum.
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.matches("<polyline").count() == 6);
    assert!(plot.contains("frequency oracle"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_pool_times_the_orders_asked_and_compares_with_lru_only_where_timed() {
    let (dir, trace) = dir_with_trace("bench-pool");
    let bench = |orders: &str| {
        let out = Command::new(BIN)
            .args(["bench-pool", trace.to_str().unwrap()])
            .args(["--capacities", "50,100", "--rounds", "1", "--json"])
            .args(["--orders", orders])
            .output()
            .unwrap();
        succeeded(&out);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["points"].as_array().unwrap().clone()
    };
    // One order alone: each size timed once, with nothing to compare to.
    let alone = bench("2q");
    assert_eq!(alone.len(), 2);
    for p in &alone {
        assert_eq!(p["eviction"], "2q");
        assert!(p["ops_per_sec"].as_f64().unwrap() > 0.0);
        assert!(p["vs_lru"].is_null(), "{p}");
    }
    // Both: in the order asked, each against LRU's rate at its size.
    let both = bench("2q,lru");
    let names: Vec<&str> = both
        .iter()
        .map(|p| p["eviction"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["2q", "lru", "2q", "lru"]);
    for pair in both.chunks(2) {
        let ratio =
            pair[0]["ops_per_sec"].as_f64().unwrap() / pair[1]["ops_per_sec"].as_f64().unwrap();
        assert!((pair[0]["vs_lru"].as_f64().unwrap() - ratio).abs() < 1e-9);
        assert_eq!(pair[1]["vs_lru"].as_f64(), Some(1.0));
    }
    // An order that does not exist: a usage error naming the ones that do.
    let out = Command::new(BIN)
        .args(["bench-pool", trace.to_str().unwrap(), "--orders", "fifo"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the orders are lru and 2q"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn route_sim_compares_policies_on_a_trace_with_exact_hits_and_times() {
    // Ten requests 100 s apart (every prefill done before the next
    // arrives), each four shared blocks and one of its own: the first
    // hits nothing, the others four blocks of five.
    let (dir, trace) = dir_with_trace("route-sim");
    let lines: String = (0..10)
        .map(|i| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": 2560, \"output_length\": 1, \"hash_ids\": [0, 1, 2, 3, {}]}}\n",
                i * 100_000,
                100 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines).unwrap();
    let plot = dir.join("ttft.svg");
    let out = Command::new(BIN)
        .args([
            "route-sim",
            trace.to_str().unwrap(),
            "--hosts",
            "3",
            "--dram",
            "8MiB",
        ])
        .args(["--plot", plot.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    succeeded(&out);
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let policies = result["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["random", "longest prefix", "route (prefix vs load)"]
    );
    for p in policies {
        assert_eq!(p["requests"].as_u64(), Some(10));
        // 9 requests x 4 blocks x 512 tokens of 10 x 2560.
        assert!(
            (p["token_hit_rate"].as_f64().unwrap() - 0.72).abs() < 1e-9,
            "{p}"
        );
        assert_eq!(p["over_slo"].as_u64(), Some(0));
    }
    for p in &policies[1..] {
        assert_eq!(p["local_hit_share"].as_f64(), Some(1.0), "{p}");
        // One block to prefill at 10,000 tokens/s, nothing to move or wait for.
        assert!(
            (p["ttft_p50_s"].as_f64().unwrap() - 0.0512).abs() < 1e-9,
            "{p}"
        );
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("route (prefix vs load)"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn output_into_a_closed_pipe_ends_the_command_quietly() {
    // `simulate TRACE | head`: the reader is gone before the table comes.
    let (dir, trace) = dir_with_trace("pipe");
    let mut child = Command::new(BIN)
        .args(["simulate", trace.to_str().unwrap(), "--points", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
