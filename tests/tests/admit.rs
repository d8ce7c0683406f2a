//! Same-host puts in one round trip (`ShmAdmit`): a block written into
//! room held ahead is made visible by the daemon itself, and is visible to
//! every client once its put returns; what the meta service will not admit
//! (a block stored already, a namespace of several copies) is put the
//! usual way, with the usual outcome; a removal never leaves an admitted
//! block behind.

use std::time::Duration;

use mooncake_client::{Client, ClientConfig, GetOutcome, PutOutcome};
use mooncake_meta::MetaConfig;
use mooncake_proto::{BlockHash, Namespace};
use mooncake_tests::{block_bytes, daemon_config, fast_meta, TestCluster};

fn ns() -> Namespace {
    Namespace::new("t/admit").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

fn scratch() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-admit-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn cluster_with_shm(dir: &std::path::Path, meta: MetaConfig) -> TestCluster {
    let mut cfg = daemon_config(64 << 20);
    cfg.shm_socket = Some(dir.join("daemon.sock"));
    TestCluster::start_with(meta, vec![cfg]).await
}

fn same_host_client(cluster: &TestCluster, dir: &std::path::Path) -> Client {
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(5));
    cfg.shm_socket = Some(dir.join("daemon.sock"));
    Client::new(cfg)
}

async fn read_back(reader: &Client, i: u64, n: usize) {
    let mut buf = vec![0u8; n];
    let got = reader
        .get_into(&ns(), &[hash(i)], &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(n)], "block {i}");
    assert!(buf == block_bytes(i, n), "block {i} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_puts_after_the_first_are_admitted_by_the_daemon_and_visible_to_every_client_at_once(
) {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, fast_meta()).await;
    let writer = same_host_client(&cluster, &dir);
    let other = cluster.client();
    for i in 0..20u64 {
        let value = block_bytes(i, 50_000);
        let out = writer.put(&ns(), &[(hash(i), &value[..])]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
        // Visible once the put returns, to a client of another path.
        assert_eq!(
            other.exists(&ns(), &[hash(i)]).await.unwrap(),
            vec![true],
            "block {i}"
        );
        read_back(&other, i, 50_000).await;
    }
    // The first put reserved and committed at the meta service (and got
    // room ahead); every later one went into that room and was admitted.
    assert_eq!(writer.shm_writes(), 20);
    assert_eq!(writer.shm_admitted(), 19);
    // A batch of a chain: admitted too, each block read back right.
    let values: Vec<Vec<u8>> = (20..30).map(|i| block_bytes(i, 50_000)).collect();
    let blocks: Vec<(BlockHash, &[u8])> = (20..30u64)
        .map(|i| (hash(i), &values[(i - 20) as usize][..]))
        .collect();
    let out = writer
        .put_chain(&ns(), Some(hash(19)), &blocks)
        .await
        .unwrap();
    assert_eq!(out, vec![PutOutcome::Stored; 10]);
    assert!(
        writer.shm_admitted() > 19,
        "a batch with room held is admitted"
    );
    for i in 20..30 {
        read_back(&other, i, 50_000).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_stored_already_is_answered_as_such_and_not_stored_twice() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, fast_meta()).await;
    let writer = same_host_client(&cluster, &dir);
    for i in 0..3u64 {
        let value = block_bytes(i, 50_000);
        writer.put(&ns(), &[(hash(i), &value[..])]).await.unwrap();
    }
    let admitted = writer.shm_admitted();
    assert_eq!(admitted, 2);
    let blocks_before = cluster.daemons[0].handle.pool.stats().blocks;
    // Stored by another client meanwhile: the meta service's answer.
    let value = block_bytes(7, 50_000);
    let out = cluster
        .client()
        .put(&ns(), &[(hash(7), &value[..])])
        .await
        .unwrap();
    assert_eq!(out, vec![PutOutcome::Stored]);
    for i in [1, 7] {
        let value = block_bytes(i, 50_000);
        let out = writer.put(&ns(), &[(hash(i), &value[..])]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::AlreadyExists], "block {i}");
    }
    assert_eq!(writer.shm_admitted(), admitted, "nothing admitted twice");
    assert_eq!(
        cluster.daemons[0].handle.pool.stats().blocks,
        blocks_before + 1
    );
    read_back(&cluster.client(), 1, 50_000).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_of_several_copies_is_put_the_usual_way() {
    let dir = scratch();
    let mut meta = fast_meta();
    meta.replicas.insert(ns().as_str().to_string(), 2);
    let cluster = cluster_with_shm(&dir, meta).await;
    let writer = same_host_client(&cluster, &dir);
    for i in 0..4u64 {
        let value = block_bytes(i, 50_000);
        let out = writer.put(&ns(), &[(hash(i), &value[..])]).await.unwrap();
        // One host: one copy of the two the namespace keeps, placed and
        // committed by the meta service.
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
        read_back(&cluster.client(), i, 50_000).await;
    }
    assert_eq!(writer.shm_admitted(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_admitted_block_is_gone_for_every_client() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, fast_meta()).await;
    let writer = same_host_client(&cluster, &dir);
    for i in 0..6u64 {
        let value = block_bytes(i, 50_000);
        writer.put(&ns(), &[(hash(i), &value[..])]).await.unwrap();
    }
    assert_eq!(writer.shm_admitted(), 5);
    let other = cluster.client();
    let removed = other.remove(&ns(), &[hash(3), hash(4)]).await.unwrap();
    assert_eq!(removed, vec![mooncake_proto::ErrorCode::Ok; 2]);
    assert_eq!(
        other
            .exists(&ns(), &[hash(2), hash(3), hash(4)])
            .await
            .unwrap(),
        vec![true, false, false]
    );
    assert!(!cluster.daemons[0]
        .handle
        .pool
        .contains(&mooncake_proto::BlockKey::new(ns(), hash(3))));
    // Put again, admitted again.
    let value = block_bytes(3, 50_000);
    let out = writer.put(&ns(), &[(hash(3), &value[..])]).await.unwrap();
    assert_eq!(out, vec![PutOutcome::Stored]);
    assert_eq!(writer.shm_admitted(), 6);
    read_back(&other, 3, 50_000).await;
    let _ = std::fs::remove_dir_all(&dir);
}
