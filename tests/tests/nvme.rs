//! DRAM over NVMe through the daemon: a working set larger than DRAM is
//! served from NVMe (two drives) byte for byte, DRAM stays within its pool,
//! and a restarted daemon brings its NVMe blocks back to the index.

use std::time::Duration;

use mooncake_client::{GetOutcome, PutOutcome};
use mooncake_proto::{BlockHash, Namespace};
use mooncake_tests::{block_bytes, daemon_config, eventually, fast_meta, TestCluster};

fn ns() -> Namespace {
    Namespace::new("t/nvme").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

/// A new folder for a test's drives.
fn drive_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-{test}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_working_set_four_times_dram_is_served_from_nvme_and_survives_a_restart() {
    let dir = drive_dir("tier");
    let mut cfg = daemon_config(8 << 20);
    cfg.nvme = vec![
        format!("{}:32MiB", dir.join("drive0.bin").display()),
        format!("{}:48MiB", dir.join("drive1.bin").display()),
    ];
    cfg.nvme_engine = mooncake_store_daemon::io::EngineKind::Uring;
    let mut cluster = TestCluster::start_with(fast_meta(), vec![cfg.clone()]).await;
    let client = cluster.client();
    let block = 1 << 20;
    let n = 32u64; // 32 MiB: four times the DRAM pool
    for i in 0..n {
        let out = client
            .put(&ns(), &[(hash(i), &block_bytes(i, block))])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
    }
    let pool = cluster.daemons[0].handle.pool.clone();
    assert!(
        pool.stats().used <= pool.stats().capacity,
        "DRAM stays within its pool"
    );
    // Demotions are written in the background: wait until the index still
    // lists every block (none was dropped), then read them all back.
    let hashes: Vec<BlockHash> = (0..n).map(hash).collect();
    assert!(
        eventually(Duration::from_secs(5), || async {
            client
                .exists(&ns(), &hashes)
                .await
                .unwrap()
                .iter()
                .all(|e| *e)
        })
        .await,
        "every block stays indexed while it moves to NVMe"
    );
    for i in 0..n {
        let mut buf = vec![0u8; block];
        let got = client
            .get_into(&ns(), &[hash(i)], &mut [&mut buf[..]])
            .await
            .unwrap();
        assert_eq!(got, vec![GetOutcome::Hit(block)], "block {i}");
        assert!(buf == block_bytes(i, block), "block {i} bytes");
    }
    let on_drives = cluster.daemons[0].handle.nvme_blocks_per_drive();
    assert!(
        on_drives.len() == 2 && on_drives.iter().all(|n| *n > 0),
        "demotions spread over both drives: {on_drives:?}"
    );
    let totals = cluster.daemons[0].handle.nvme_totals().unwrap();
    assert_eq!(totals.capacity, 80 << 20);
    assert_eq!(totals.io_errors, 0);
    // Under the default 2q every block left DRAM's probation unread, so it
    // entered a drive's probation, and its one read from the drive moved
    // it to the drive's main part.
    let ev = totals.events;
    assert!(ev.probation_admitted > 0 && ev.ghost_hits == 0, "{ev:?}");
    assert_eq!(ev.promoted, ev.probation_admitted, "{ev:?}");
    assert_eq!(totals.probation.0, 0, "nothing left in probation");

    // Stop the daemon and start a new one on the same NVMe file: the blocks
    // it had on NVMe are found again and reported to the meta service.
    cluster.daemons[0].stop.cancel();
    let old = cluster.daemons.remove(0);
    let old_addr = old.handle.addr.to_string();
    old.handle.join().await;
    cluster.add_daemon(cfg).await;
    let client = cluster.client();
    // The old process (at its old address) is declared dead within its TTL.
    assert!(
        eventually(Duration::from_secs(5), || async {
            let st = client.cluster_stats().await.unwrap();
            st.daemons.iter().all(|d| d.addr != old_addr || !d.alive)
        })
        .await
    );
    let visible = eventually(Duration::from_secs(5), || async {
        client
            .exists(&ns(), &hashes)
            .await
            .unwrap()
            .iter()
            .filter(|e| **e)
            .count()
            >= (n - 8) as usize
    })
    .await;
    assert!(
        visible,
        "the NVMe-resident blocks came back after the restart"
    );
    let mut back = 0;
    for i in 0..n {
        if let Some(bytes) = client
            .get(&mooncake_proto::BlockKey::new(ns(), hash(i)))
            .await
            .unwrap()
        {
            assert!(bytes == block_bytes(i, block), "block {i} after restart");
            back += 1;
        }
    }
    assert!(
        back >= (n - 8) as usize,
        "only blocks that lived in DRAM alone may be gone: {back} of {n}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A block demoted to NVMe and promoted back comes back with its parent, so
/// that prefix-aware eviction still sees it as part of its chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_promoted_from_nvme_keeps_its_parent() {
    let dir = drive_dir("promote");
    let mut cfg = daemon_config(4 << 20);
    cfg.nvme = vec![format!("{}:32MiB", dir.join("drive.bin").display())];
    cfg.promote_after = 2;
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    let client = cluster.client();
    let block = 512 << 10;
    // A chain of 4 blocks, then 16 unrelated ones: the chain goes to NVMe.
    let chain: Vec<(BlockHash, Vec<u8>)> = (0..4u64)
        .map(|i| (hash(100 + i), block_bytes(100 + i, block)))
        .collect();
    let refs: Vec<(BlockHash, &[u8])> = chain.iter().map(|(h, v)| (*h, &v[..])).collect();
    let out = client.put_chain(&ns(), None, &refs).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    for i in 0..16u64 {
        let out = client
            .put(&ns(), &[(hash(i), &block_bytes(i, block))])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored]);
    }
    let pool = cluster.daemons[0].handle.pool.clone();
    let child = mooncake_proto::BlockKey::new(ns(), hash(102));
    assert!(
        eventually(Duration::from_secs(5), || async {
            !pool.contains(&child) && cluster.daemons[0].handle.nvme_blocks_per_drive()[0] > 0
        })
        .await,
        "the chain was demoted"
    );
    // Two reads from NVMe promote it.
    for _ in 0..2 {
        let got = client.get(&child).await.unwrap().unwrap();
        assert_eq!(got, block_bytes(102, block));
    }
    assert!(
        eventually(Duration::from_secs(5), || async { pool.contains(&child) }).await,
        "promoted"
    );
    assert_eq!(pool.parent_of(&child), Some(hash(101)));
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stopped daemon lets go of its NVMe drive even while the metrics
/// registry it reported into lives on (an admin endpoint still answering
/// while its process stops), so that a next daemon opens the same drive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_daemon_releases_its_drive_while_its_metrics_registry_lives_on() {
    let dir = drive_dir("release");
    let mut cfg = daemon_config(8 << 20);
    cfg.nvme = vec![format!("{}:16MiB", dir.join("drive.bin").display())];
    let start = |stop: tokio_util::sync::CancellationToken, registry: prometheus::Registry| {
        let cfg = cfg.clone();
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            mooncake_store_daemon::start(cfg, listener, None, &registry, stop).await
        }
    };
    // Kept to the end of the test, as an admin endpoint keeps its own.
    let registry = prometheus::Registry::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let first = start(stop.clone(), registry.clone())
        .await
        .expect("first daemon");
    assert!(
        !registry.gather().is_empty(),
        "the daemon reports into the registry"
    );
    stop.cancel();
    first.join().await;
    let second = start(
        tokio_util::sync::CancellationToken::new(),
        prometheus::Registry::new(),
    )
    .await;
    assert!(
        second.is_ok(),
        "the drive is still held: {:?}",
        second.err().map(|e| e.to_string())
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lease that finds a block only on the drive (vLLM's scheduler looking
/// a request up) brings it back to DRAM and holds it there, so that the
/// load that follows reads DRAM, however much is put meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_a_lease_finds_on_nvme_is_brought_back_and_held_for_its_reader() {
    let dir = drive_dir("prefetch");
    let mut cfg = daemon_config(4 << 20);
    cfg.nvme = vec![format!("{}:64MiB", dir.join("drive.bin").display())];
    // Long enough that only the lease's own rule can end it in this test.
    cfg.kv_lease_ttl = mooncake_proto::units::HumanDuration(Duration::from_secs(600));
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    let client = cluster.client();
    let block = 512 << 10;
    let fill = |from: u64| {
        let client = &client;
        async move {
            for i in from..from + 16 {
                let out = client
                    .put(&ns(), &[(hash(i), &block_bytes(i, block))])
                    .await
                    .unwrap();
                assert_eq!(out, vec![PutOutcome::Stored]);
            }
        }
    };
    let wanted = hash(7);
    client
        .put(&ns(), &[(wanted, &block_bytes(7, block))])
        .await
        .unwrap();
    fill(100).await;
    let pool = cluster.daemons[0].handle.pool.clone();
    let key = mooncake_proto::BlockKey::new(ns(), wanted);
    assert!(
        eventually(Duration::from_secs(10), || async {
            !pool.contains(&key) && cluster.daemons[0].handle.nvme_blocks_per_drive()[0] > 0
        })
        .await,
        "the block was demoted"
    );
    assert_eq!(
        client.exists_leased(&ns(), &[wanted]).await.unwrap(),
        vec![true]
    );
    assert!(
        eventually(Duration::from_secs(10), || async { pool.contains(&key) }).await,
        "brought back to DRAM"
    );
    assert_eq!(cluster.daemons[0].handle.lease_prefetches(), (1, 0));
    assert!(pool.held() >= 1, "and held");
    // Twice the pool put meanwhile: the held block stays in DRAM.
    fill(200).await;
    fill(300).await;
    assert!(pool.contains(&key), "held through the puts");
    let got = client.get(&key).await.unwrap().unwrap();
    assert!(got == block_bytes(7, block));
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}
