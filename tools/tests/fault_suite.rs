//! The fault suite: a mixed load (puts, gets, prefix matches; every byte
//! read checked against what was written) runs against a cluster of real
//! processes (etcd, two meta replicas, two daemons) while faults are
//! injected one at a time, then together. Per fault it reports operations
//! attempted, succeeded, missed and failed with a clean error, wrong bytes
//! returned (must be 0), the longest call (must stay within its deadline)
//! and the time until the cluster served a fresh put and get again (from
//! the kill for killed processes, from the restart or resume for etcd and
//! the stalled daemon).
//! Run with `--no-capture` to see the table. One daemon keeps an NVMe drive
//! on a small tmpfs of its own (a private mount namespace), which another
//! program fills. I/O errors need an injected engine: the NVMe tier's unit
//! tests cover them.

mod common;
use common::cluster::Cluster;
use mooncake_coord::Coordinator;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_client::{Client, ErrorSource, GetOutcome, PutOutcome};
use mooncake_proto::message::{PutStartRequest, PutStartResponse};
use mooncake_proto::{BlockHash, Namespace, Opcode, PrefixHasher};
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;

/// Deadline of every call of the load.
const DEADLINE: Duration = Duration::from_secs(2);
/// Pause after a fault recovered, before the next: longer than a deadline.
const SETTLE: Duration = Duration::from_millis(2500);

#[derive(Default)]
struct Stats {
    attempted: AtomicU64,
    ok: AtomicU64,
    missed: AtomicU64,
    failed: AtomicU64,
    wrong: AtomicU64,
    longest_us: AtomicU64,
}

impl Stats {
    fn record(&self, outcome: Outcome, took: Duration) {
        self.attempted.fetch_add(1, Ordering::Relaxed);
        let counter = match outcome {
            Outcome::Ok => &self.ok,
            Outcome::Missed => &self.missed,
            Outcome::Failed => &self.failed,
            Outcome::Wrong => &self.wrong,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.longest_us
            .fetch_max(took.as_micros() as u64, Ordering::Relaxed);
    }
}

#[derive(Clone, Copy)]
enum Outcome {
    Ok,
    Missed,
    Failed,
    Wrong,
}

fn ns() -> Namespace {
    Namespace::new("t/faults").unwrap()
}

fn hash(id: u64) -> BlockHash {
    BlockHash::from_opaque(&id.to_le_bytes())
}

/// A block's bytes follow from its id: a reader checks every one.
fn value(id: u64) -> Vec<u8> {
    let len = 1024 + (id.wrapping_mul(2654435761) % (60 << 10)) as usize;
    let seed = id.wrapping_mul(131) as usize;
    (0..len)
        .map(|j| seed.wrapping_add(j * 7 + j / 251) as u8)
        .collect()
}

struct Load {
    phase: AtomicUsize,
    phases: Vec<Stats>,
    written: Mutex<Vec<u64>>,
    next_id: AtomicU64,
    stop: AtomicBool,
}

async fn worker(load: Arc<Load>, client: Arc<Client>, chain: Vec<BlockHash>, seed: u64) {
    let mut rng = seed;
    while !load.stop.load(Ordering::Relaxed) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let started = Instant::now();
        let outcome = match rng % 10 {
            0..=3 => {
                let id = load.next_id.fetch_add(1, Ordering::Relaxed);
                match client.put(&ns(), &[(hash(id), &value(id))]).await {
                    Ok(out) if out[0] == PutOutcome::Stored => {
                        load.written.lock().push(id);
                        Outcome::Ok
                    }
                    _ => Outcome::Failed,
                }
            }
            4..=8 => {
                let id = {
                    let w = load.written.lock();
                    if w.is_empty() {
                        continue;
                    }
                    w[(rng >> 8) as usize % w.len()]
                };
                let want = value(id);
                let mut buf = vec![0u8; 64 << 10];
                match client
                    .get_into(&ns(), &[hash(id)], &mut [&mut buf[..]])
                    .await
                {
                    Ok(out) => match out[0] {
                        GetOutcome::Hit(n) if buf[..n] == want[..] => Outcome::Ok,
                        GetOutcome::Hit(_) => Outcome::Wrong,
                        GetOutcome::Miss => Outcome::Missed,
                        GetOutcome::Failed(_) => Outcome::Failed,
                    },
                    Err(_) => Outcome::Failed,
                }
            }
            _ => match client.match_prefix(&ns(), &chain).await {
                Ok(m) if m.matched <= chain.len() => Outcome::Ok,
                Ok(_) => Outcome::Wrong,
                Err(_) => Outcome::Failed,
            },
        };
        // An operation counts for the phase it ended in: phases are apart
        // by more than a deadline, so a fault's slow calls count for it.
        load.phases[load.phase.load(Ordering::Relaxed)].record(outcome, started.elapsed());
    }
}

/// Time until a fresh block can be put and read back, byte for byte.
async fn recovery(client: &Client, since: Instant, probe: u64) -> Option<Duration> {
    let id = u64::MAX - probe * 1000;
    let mut attempt = 0;
    while since.elapsed() < Duration::from_secs(30) {
        attempt += 1;
        let id = id - attempt;
        let stored = client.put(&ns(), &[(hash(id), &value(id))]).await;
        if matches!(stored.as_deref(), Ok([PutOutcome::Stored])) {
            let mut buf = vec![0u8; 64 << 10];
            let got = client
                .get_into(&ns(), &[hash(id)], &mut [&mut buf[..]])
                .await;
            if let Ok([GetOutcome::Hit(n)]) = got.as_deref() {
                if buf[..*n] == value(id)[..] {
                    return Some(since.elapsed());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// A writer that reserves a block, sends half of its bytes to the daemon
/// and vanishes: the block must never become visible.
async fn vanish_mid_put(cluster: &Cluster, meta: &str, id: u64) {
    let mut conn = cluster
        .dialer()
        .open(meta, ErrorSource::Meta, DEADLINE)
        .await
        .unwrap();
    let v = value(id);
    let placed: PutStartResponse = conn
        .call(
            Opcode::PutStart,
            &PutStartRequest {
                namespace: ns(),
                node: String::new(),
                replicas: 1,
                items: vec![mooncake_proto::message::ToPlace::unchained(
                    hash(id),
                    v.len() as u32,
                )],
            },
            "put_start",
        )
        .await
        .unwrap();
    let daemon = &placed.daemons[0].addr;
    let (_rd, mut raw) = cluster.raw_stream(daemon).await;
    let head = mooncake_proto::message::PutHead {
        key: mooncake_proto::BlockKey::new(ns(), hash(id)),
        checksum: mooncake_proto::checksum(&v),
        parent: None,
        continues: false,
        tag: None,
    };
    use mooncake_proto::message::Body;
    let body = head.to_bytes();
    let frame = mooncake_proto::Header::request(Opcode::Put, 1, (body.len() + v.len()) as u32);
    raw.write_all(&frame.encode()).await.unwrap();
    raw.write_all(&body).await.unwrap();
    raw.write_all(&v[..v.len() / 2]).await.unwrap();
    raw.flush().await.unwrap();
    drop(raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_one_at_a_time_then_together_never_return_wrong_bytes() {
    // Small pools, so that every daemon evicts (and the NVMe one demotes)
    // within seconds of load.
    faults(Cluster::start_sized(2, 2, "16MiB").await).await
}

/// The same faults with TLS on every TCP port (mutual TLS between the
/// servers): a TLS stream cut by a kill or a stall never yields wrong bytes
/// either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_faults_never_return_wrong_bytes() {
    faults(Cluster::start_tls(2, 2, "16MiB").await).await
}

async fn faults(mut cluster: Cluster) {
    let client = Arc::new(cluster.client(DEADLINE).await);
    let tokens: Vec<u32> = (0..128).collect();
    let chain = PrefixHasher::chain(b"faults", &tokens, 16, b"");
    let head: Vec<(BlockHash, Vec<u8>)> = chain.iter().map(|h| (*h, vec![7u8; 4096])).collect();
    let blocks: Vec<(BlockHash, &[u8])> = head.iter().map(|(h, v)| (*h, &v[..])).collect();
    client.put(&ns(), &blocks).await.unwrap();

    // A third daemon with a 16 MiB drive behind its DRAM, on a 64 MiB tmpfs
    // that a helper fills (and empties) when told to.
    let disk = cluster.logs.join("disk");
    std::fs::create_dir_all(&disk).unwrap();
    let addr = format!("127.0.0.1:{}", common::free_port());
    let mut args = cluster.daemon_args(&addr, "16MiB");
    args.extend(["--nvme".into(), "$MNT/drive.bin:16MiB".into()]);
    let script = format!(
        "mount -t tmpfs -o size=64m none \"$MNT\" || exit 99
         ( until [ -e \"{d}/fill\" ]; do sleep 0.05; done
           dd if=/dev/zero of=\"$MNT/filler\" bs=1M count=64 2>/dev/null
           until [ -e \"{d}/release\" ]; do sleep 0.05; done
           rm \"$MNT/filler\" ) &
         exec \"$0\" {}",
        args.iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(" "),
        d = disk.display()
    );
    std::fs::create_dir_all(disk.join("mnt")).unwrap();
    let p = {
        let log = cluster.logs.join("daemon-disk.log");
        let log = std::fs::File::create(log).unwrap();
        std::process::Command::new("unshare")
            .args(["-rm", "sh", "-c", &script, common::BIN])
            .env("MNT", disk.join("mnt"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    cluster
        .daemons
        .push((addr, common::cluster::Proc::from_child("daemon-disk", p)));
    cluster.wait_healthy(3, Duration::from_secs(15)).await;

    let names = [
        "none (baseline)",
        "daemon SIGKILL, restarted",
        "meta leader SIGKILL",
        "etcd stopped and restarted",
        "client gone mid-put",
        "daemon stalled (SIGSTOP 3 s)",
        "a daemon's disk filled, then freed",
        "all of them at once",
    ];
    let load = Arc::new(Load {
        phase: AtomicUsize::new(0),
        phases: names.iter().map(|_| Stats::default()).collect(),
        written: Mutex::new(Vec::new()),
        next_id: AtomicU64::new(1),
        stop: AtomicBool::new(false),
    });
    let workers: Vec<_> = (0..3)
        .map(|i| {
            tokio::spawn(worker(
                load.clone(),
                client.clone(),
                chain.clone(),
                0x9E37 + i,
            ))
        })
        .collect();
    let mut recovered = vec![Duration::ZERO; names.len()];
    let daemon_addr = |c: &Cluster, i: usize| c.daemons[i].0.clone();

    // 0: baseline.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 1: a daemon is killed and restarted on its address.
    load.phase.store(1, Ordering::Relaxed);
    let t = Instant::now();
    let addr = daemon_addr(&cluster, 0);
    cluster.daemons[0].1.kill9();
    tokio::time::sleep(SETTLE).await;
    cluster.spawn_daemon(&addr);
    recovered[1] = recovery(&client, t, 1)
        .await
        .expect("recovered from a daemon kill");
    tokio::time::sleep(SETTLE).await;

    // 2: the meta leader is killed; the standby takes over.
    load.phase.store(2, Ordering::Relaxed);
    let t = Instant::now();
    let leader = cluster.leader_index().await;
    cluster.metas[leader].1.kill9();
    recovered[2] = recovery(&client, t, 2).await.expect("a standby took over");
    cluster.spawn_meta();
    tokio::time::sleep(SETTLE).await;

    // 3: etcd is stopped for two seconds, then started again.
    load.phase.store(3, Ordering::Relaxed);
    cluster.etcd.kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = Instant::now();
    cluster.restart_etcd();
    recovered[3] = recovery(&client, t, 3)
        .await
        .expect("recovered after etcd returned");
    tokio::time::sleep(SETTLE).await;

    // 4: writers vanish in the middle of their values.
    load.phase.store(4, Ordering::Relaxed);
    let t = Instant::now();
    let leader = cluster
        .coordinator()
        .await
        .leader()
        .await
        .unwrap()
        .unwrap()
        .addr;
    for i in 0..5 {
        vanish_mid_put(&cluster, &leader, 1 << 40 | i).await;
    }
    recovered[4] = recovery(&client, t, 4)
        .await
        .expect("served after vanished writers");
    let half_written: Vec<BlockHash> = (0..5).map(|i| hash(1 << 40 | i)).collect();
    assert!(
        client
            .exists(&ns(), &half_written)
            .await
            .unwrap()
            .iter()
            .all(|e| !e),
        "a half-written block became visible"
    );
    tokio::time::sleep(SETTLE).await;

    // 5: a daemon accepts connections but never answers, for three seconds.
    load.phase.store(5, Ordering::Relaxed);
    let stalled = cluster.daemons.len() - 1;
    cluster.daemons[stalled].1.pause();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t = Instant::now();
    cluster.daemons[stalled].1.resume();
    recovered[5] = recovery(&client, t, 5)
        .await
        .expect("recovered from a stall");
    tokio::time::sleep(SETTLE).await;

    // 6: the NVMe daemon's filesystem fills (its drive takes no new
    // blocks: demotions are dropped, misses follow), then is freed.
    load.phase.store(6, Ordering::Relaxed);
    std::fs::write(disk.join("fill"), b"").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t = Instant::now();
    std::fs::write(disk.join("release"), b"").unwrap();
    let log = std::fs::read_to_string(cluster.logs.join("daemon-disk.log")).unwrap();
    assert!(
        log.contains("index filesystem nearly full"),
        "the drive noticed its full filesystem: {log}"
    );
    recovered[6] = recovery(&client, t, 6)
        .await
        .expect("served with a full disk");
    tokio::time::sleep(SETTLE).await;

    // 7: everything at once: a daemon killed, another stalled, the
    // leader killed, etcd restarted.
    load.phase.store(7, Ordering::Relaxed);
    let live: Vec<usize> = (0..cluster.daemons.len())
        .filter(|i| {
            cluster.daemons[*i]
                .1
                .child
                .try_wait()
                .ok()
                .flatten()
                .is_none()
        })
        .collect();
    let (killed, stalled) = (live[0], live[1]);
    let killed_addr = daemon_addr(&cluster, killed);
    cluster.daemons[killed].1.kill9();
    cluster.daemons[stalled].1.pause();
    let leader = cluster.leader_index().await;
    cluster.metas[leader].1.kill9();
    cluster.etcd.kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = Instant::now();
    cluster.restart_etcd();
    cluster.daemons[stalled].1.resume();
    cluster.spawn_daemon(&killed_addr);
    cluster.spawn_meta();
    recovered[7] = recovery(&client, t, 7)
        .await
        .expect("recovered from everything at once");
    tokio::time::sleep(SETTLE).await;

    load.stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }

    let over = if cluster.tls.is_some() {
        "TLS"
    } else {
        "plain TCP"
    };
    println!("\nfaults over {over}:");
    println!("\n| fault | attempted | ok | missed | failed (clean error) | wrong bytes | longest call | recovered in |");
    println!("|---|---|---|---|---|---|---|---|");
    for (i, (name, st)) in names.iter().zip(&load.phases).enumerate() {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        println!(
            "| {name} | {} | {} | {} | {} | {} | {:.0} ms | {} |",
            g(&st.attempted),
            g(&st.ok),
            g(&st.missed),
            g(&st.failed),
            g(&st.wrong),
            g(&st.longest_us) as f64 / 1000.0,
            if i == 0 {
                "-".to_string()
            } else {
                format!("{:.2} s", recovered[i].as_secs_f64())
            }
        );
    }
    for (name, st) in names.iter().zip(&load.phases) {
        assert_eq!(
            st.wrong.load(Ordering::Relaxed),
            0,
            "{name}: wrong bytes returned"
        );
        let longest = Duration::from_micros(st.longest_us.load(Ordering::Relaxed));
        assert!(
            longest <= DEADLINE + Duration::from_millis(500),
            "{name}: a call took {longest:?} with a {DEADLINE:?} deadline"
        );
        assert!(
            st.ok.load(Ordering::Relaxed) > 0,
            "{name}: nothing succeeded"
        );
    }
    let base = &load.phases[0];
    assert_eq!(
        base.failed.load(Ordering::Relaxed),
        0,
        "failures without a fault"
    );
}
