//! Random operations against a model of what the store must answer: a
//! daemon whose DRAM holds a few blocks over a drive that holds the rest
//! (so blocks move down and back while the operations run), a client on
//! its host (shared memory, puts admitted by the daemon) and one over TCP,
//! putting, reading, looking up (with and without a lease) and removing
//! the same few keys in a seeded order, two such walks at once (more than both tiers hold, so the
//! drive drops blocks too). Whatever the tiers did meanwhile:
//! a block read back is the one last put since the key was last removed,
//! byte for byte; a removed block is never read, found, nor refused as
//! stored already; anything else may be a miss.

use std::collections::HashMap;
use std::time::Duration;

use mooncake_client::{Client, ClientConfig, GetOutcome, PutOutcome};
use mooncake_proto::{BlockHash, ErrorCode, Namespace};
use mooncake_tests::{block_bytes, daemon_config, fast_meta, TestCluster};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KEYS: u64 = 40;
const OPS: usize = 4000;

fn ns() -> Namespace {
    Namespace::new("t/model").unwrap()
}

fn hash(k: u64) -> BlockHash {
    BlockHash::from_opaque(&k.to_le_bytes())
}

/// What the store may hold for a key.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Held {
    /// Nothing: never put, or removed since.
    Nothing,
    /// This version of the bytes, or nothing (evicted).
    AtMost { seed: u64, len: usize },
    /// Unknown: an operation on it failed (a timeout may or may not have
    /// taken effect), until it is removed again.
    Unknown,
}

struct Model {
    held: HashMap<u64, Held>,
    seed: u64,
    step: usize,
    /// Reads that found the last put's bytes, and reads and lookups of
    /// removed keys that found nothing: what was checked.
    hits: usize,
    absent: usize,
    /// Whether blocks were seen on the drive.
    went_down: bool,
    /// What each key went through, for a failure's message.
    history: HashMap<u64, Vec<String>>,
}

impl Model {
    fn get(&self, k: u64) -> Held {
        self.held.get(&k).copied().unwrap_or(Held::Nothing)
    }

    /// Notes what step did to key `k`.
    fn note(&mut self, k: u64, what: String) {
        let step = self.step;
        self.history
            .entry(k)
            .or_default()
            .push(format!("{step}: {what}"));
    }

    /// Where a check failed: the step, the key and what it went through.
    fn at(&self, k: u64, how: &str) -> String {
        let history = self.history.get(&k).map(Vec::as_slice).unwrap_or_default();
        let last = &history[history.len().saturating_sub(12)..];
        format!(
            "seed {}, step {}, key {k}, {how} (the key's last steps: {})",
            self.seed,
            self.step,
            last.join("; ")
        )
    }

    /// Checks a read of key `k` that found `got` (its bytes), by `how`.
    fn read(&mut self, k: u64, got: Option<&[u8]>, how: &str) {
        let Some(bytes) = got else {
            self.absent += usize::from(self.get(k) == Held::Nothing);
            self.note(k, format!("{how}: miss"));
            return;
        };
        self.hits += 1;
        self.note(k, format!("{how}: {} bytes", bytes.len()));
        let at = self.at(k, how);
        match self.get(k) {
            Held::Nothing => panic!("{at}: a removed block was read back"),
            Held::AtMost { seed, len } => assert!(
                bytes == block_bytes(seed, len),
                "{at}: read back other bytes than the last put ({} bytes)",
                bytes.len()
            ),
            Held::Unknown => {}
        }
    }

    /// Checks that key `k` was `found` by a lookup, by `how`.
    fn found(&mut self, k: u64, found: bool, how: &str) {
        self.note(k, format!("{how}: {found}"));
        self.absent += usize::from(!found && self.get(k) == Held::Nothing);
        let at = self.at(k, how);
        assert!(
            !(found && self.get(k) == Held::Nothing),
            "{at}: a removed block was found"
        );
    }
}

async fn get(client: &Client, k: u64) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 1 << 20];
    let got = client
        .get_into(&ns(), &[hash(k)], &mut [&mut buf[..]])
        .await
        .unwrap();
    match got[0] {
        GetOutcome::Hit(n) => Some(buf[..n].to_vec()),
        GetOutcome::Miss | GetOutcome::Failed(_) => None,
    }
}

async fn run(seed: u64) {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-model-{}-{seed}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = daemon_config(4 << 20);
    cfg.nvme = vec![format!("{}:8MiB", dir.join("drive.bin").display())];
    cfg.shm_socket = Some(dir.join("daemon.sock"));
    cfg.kv_lease_ttl = mooncake_proto::units::HumanDuration(Duration::from_millis(300));
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    let tcp = cluster.client_with_timeout(Duration::from_secs(5));
    let mut same_host = ClientConfig::new(cluster.meta_addr.clone());
    same_host = same_host.with_timeout(Duration::from_secs(5));
    same_host.shm_socket = Some(dir.join("daemon.sock"));
    let shm = Client::new(same_host);
    let clients = [("tcp", &tcp), ("shm", &shm)];
    let handle = &cluster.daemons[0].handle;
    // Two walks at once, each on half the keys: each its own model, the
    // tiers moving both halves' blocks.
    let half = KEYS / 2;
    let (a, b) = tokio::join!(
        walk(clients, handle, seed, 0..half),
        walk(clients, handle, seed + (1 << 32), half..KEYS)
    );
    assert!(
        a.went_down || b.went_down,
        "seed {seed}: no block went to the drive"
    );
    let (hits, absent) = (a.hits + b.hits, a.absent + b.absent);
    let (prefetched, dropped) = (
        handle.lease_prefetches().0,
        handle.nvme_totals().unwrap().evictions,
    );
    eprintln!(
        "seed {seed}: {hits} blocks read back, {absent} removed ones not found, \
         {prefetched} brought back from the drive by a lease, {dropped} dropped by the drive"
    );
    assert!(hits > 0 && absent > 0, "seed {seed}: nothing checked");
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `OPS` steps on `keys`, in the order `seed` gives, checked against a
/// model of its own.
async fn walk(
    clients: [(&str, &Client); 2],
    handle: &mooncake_store_daemon::DaemonHandle,
    seed: u64,
    keys: std::ops::Range<u64>,
) -> Model {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = Model {
        held: HashMap::new(),
        seed,
        step: 0,
        hits: 0,
        absent: 0,
        went_down: false,
        history: HashMap::new(),
    };
    let mut version = 0u64;
    for step in 0..OPS {
        model.step = step;
        let k = rng.gen_range(keys.clone());
        let (how, client) = clients[rng.gen_range(0..2)];
        match rng.gen_range(0..10) {
            0..=2 => {
                version += 1;
                let len = [64 << 10, 256 << 10, 512 << 10][rng.gen_range(0..3)];
                let value_seed = k << 32 | version;
                let value = block_bytes(value_seed, len);
                let out = client.put(&ns(), &[(hash(k), &value[..])]).await.unwrap();
                model.note(k, format!("put v{version} of {len} by {how}: {:?}", out[0]));
                let now = match (out[0], model.get(k)) {
                    (PutOutcome::Stored, _) => Held::AtMost {
                        seed: value_seed,
                        len,
                    },
                    (PutOutcome::AlreadyExists, Held::Nothing) => panic!(
                        "{}: a removed block is still stored",
                        model.at(k, &format!("put by {how}"))
                    ),
                    (PutOutcome::AlreadyExists, held) => held,
                    (PutOutcome::Short { .. } | PutOutcome::Failed(_), _) => Held::Unknown,
                };
                model.held.insert(k, now);
            }
            3..=5 => model.read(k, get(client, k).await.as_deref(), &format!("get by {how}")),
            6 => {
                let found = client.exists(&ns(), &[hash(k)]).await.unwrap()[0];
                model.found(k, found, &format!("lookup by {how}"));
            }
            7 => {
                let found = client.exists_leased(&ns(), &[hash(k)]).await.unwrap()[0];
                model.found(k, found, &format!("leased lookup by {how}"));
            }
            8 => {
                let status = client.remove(&ns(), &[hash(k)]).await.unwrap()[0];
                model.note(k, format!("remove by {how}: {status:?}"));
                let now = match status {
                    ErrorCode::Ok | ErrorCode::NotFound => Held::Nothing,
                    _ => Held::Unknown,
                };
                model.held.insert(k, now);
            }
            _ => {
                let status = client.remove_unleased(&ns(), &[hash(k)]).await.unwrap()[0];
                model.note(k, format!("unleased remove by {how}: {status:?}"));
                match status {
                    ErrorCode::Ok | ErrorCode::NotFound => {
                        model.held.insert(k, Held::Nothing);
                    }
                    ErrorCode::Leased => {}
                    _ => {
                        model.held.insert(k, Held::Unknown);
                    }
                }
            }
        }
        model.went_down |= handle.nvme_blocks_per_drive()[0] > 0;
    }
    model
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_read_back_are_the_last_put_and_removed_ones_never_come_back_seed_1() {
    run(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_read_back_are_the_last_put_and_removed_ones_never_come_back_seed_2() {
    run(2).await;
}
