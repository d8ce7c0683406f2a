//! Kill -9 while blocks are being written and demoted to NVMe, then start
//! again on the same NVMe file: every block the store reports is intact,
//! and none that was not completely written is reported.

mod common;
use common::{free_port, BIN};

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig};
use mooncake_proto::message::ListRequest;
use mooncake_proto::{BlockHash, BlockKey, Namespace};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn up(meta: &str, daemon: &str, nvme: &str) -> Killed {
    Killed(
        Command::new(BIN)
            .args([
                "up",
                "--meta-listen",
                meta,
                "--listen",
                daemon,
                "--admin",
                "",
                "--dram",
                "8MiB",
                "--nvme",
                nvme,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

async fn ready(client: &Client) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(st) = client.cluster_stats().await {
            if st.daemons.iter().any(|d| d.alive) {
                return;
            }
        }
        assert!(Instant::now() < deadline, "store did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

fn value(i: u64) -> Vec<u8> {
    (0..256 * 1024)
        .map(|j| (i as usize * 31 + j / 3) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_writing_leaves_only_intact_blocks_on_nvme() {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-crash-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let nvme = format!("{}:128MiB", dir.join("tier.bin").display());
    let (meta, daemon) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let ns = Namespace::new("t/crash").unwrap();

    let mut store = up(&meta, &daemon, &nvme);
    let client = Client::new(ClientConfig::new(meta.clone()).with_timeout(Duration::from_secs(2)));
    ready(&client).await;
    // Write 256 KiB blocks for a while (DRAM holds about 30: the rest is
    // demoted), then kill the process in the middle of it.
    let writer = {
        let ns = ns.clone();
        let client =
            Client::new(ClientConfig::new(meta.clone()).with_timeout(Duration::from_secs(2)));
        tokio::spawn(async move {
            let mut i = 0u64;
            while client.put(&ns, &[(hash(i), &value(i)[..])]).await.is_ok() {
                i += 1;
            }
            i
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    store.0.kill().unwrap();
    let _ = store.0.wait();
    let written = writer.await.unwrap();
    assert!(written > 60, "the load ran ({written} blocks)");

    let _store = up(&meta, &daemon, &nvme);
    let client = Client::new(ClientConfig::new(meta.clone()).with_timeout(Duration::from_secs(5)));
    ready(&client).await;
    let listed = client
        .list(&ListRequest {
            namespace: Some(ns.clone()),
            after: None,
            prefix: Vec::new(),
            daemon: 0,
            limit: 4096,
        })
        .await
        .unwrap()
        .entries;
    assert!(
        !listed.is_empty(),
        "blocks demoted before the crash are back"
    );
    let known: std::collections::HashMap<BlockHash, u64> =
        (0..written + 1).map(|i| (hash(i), i)).collect();
    for entry in &listed {
        let i = *known
            .get(&entry.key.hash)
            .expect("only keys that were written are reported");
        let got = client
            .get(&BlockKey::new(ns.clone(), entry.key.hash))
            .await
            .unwrap();
        assert_eq!(got.as_deref(), Some(&value(i)[..]), "block {i} is intact");
    }
    eprintln!(
        "{written} blocks written before kill -9; {} back after restart, all intact",
        listed.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
