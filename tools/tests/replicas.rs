//! Copies of a block on several hosts, as an operator runs them: a real
//! etcd, a meta replica and daemons as separate `mooncake-store` processes,
//! each daemon on a `--node` of its own (two on one node where the test
//! needs a host with two daemons), and a host lost by killing its daemon.

mod common;
use common::cluster::Cluster;
use common::free_port;

/// Whether `check` came to hold within `within`.
async fn eventually<F, Fut>(within: Duration, check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    common::eventually(within, check).await.is_some()
}

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_client::{Client, PutOptions, PutOutcome};
use mooncake_proto::{BlockHash, BlockKey, Namespace};

fn ns() -> Namespace {
    Namespace::new("t/replicas").unwrap()
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 13 + j * 5) as u8).collect()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

/// A cluster of one meta replica and a daemon per entry of `nodes`, on
/// that node; no block turns hot (the tests count copies).
async fn cluster_on(nodes: &[&str]) -> Cluster {
    let mut cluster = Cluster::start_with_meta(1, 0, "32MiB", "hot_copies = 1").await;
    for node in nodes {
        let addr = format!("127.0.0.1:{}", free_port());
        cluster.spawn_daemon_on(&addr, node);
    }
    cluster
        .wait_healthy(nodes.len(), Duration::from_secs(15))
        .await;
    cluster
}

async fn put_copies(client: &Client, ids: std::ops::Range<u64>, replicas: u8) -> Vec<PutOutcome> {
    let values: Vec<Vec<u8>> = ids.clone().map(|i| value(i, 4096)).collect();
    let blocks: Vec<(BlockHash, &[u8])> =
        ids.zip(&values).map(|(i, v)| (hash(i), &v[..])).collect();
    client
        .put_with(&ns(), &blocks, PutOptions::copies(replicas))
        .await
        .unwrap()
}

/// Each block's copies, as the nodes of the daemons holding them.
async fn nodes_of(client: &Client, ids: std::ops::Range<u64>) -> Vec<Vec<String>> {
    let hashes: Vec<BlockHash> = ids.map(hash).collect();
    let found = client.lookup(&ns(), &hashes).await.unwrap();
    let st = client.cluster_stats().await.unwrap();
    let node: HashMap<u32, String> = st.daemons.iter().map(|d| (d.id, d.node.clone())).collect();
    found
        .items
        .iter()
        .map(|l| {
            l.expect("stored")
                .daemons
                .iter()
                .map(|d| node[&d].clone())
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_land_on_distinct_hosts_and_all_go_with_a_removal() {
    // gpu-3 runs two daemons: they are one host, never two copies.
    let cluster = cluster_on(&["gpu-1", "gpu-2", "gpu-3", "gpu-3"]).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let two = put_copies(&client, 0..20, 2).await;
    assert!(two.iter().all(|o| *o == PutOutcome::Stored), "{two:?}");
    let three = put_copies(&client, 20..40, 3).await;
    assert!(three.iter().all(|o| *o == PutOutcome::Stored), "{three:?}");
    for (want, range) in [(2, 0..20), (3, 20..40)] {
        for nodes in nodes_of(&client, range).await {
            let mut distinct = nodes.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), want, "copies on distinct hosts: {nodes:?}");
        }
    }
    // Four asked of three hosts: stored three times, and said so.
    let four = put_copies(&client, 40..41, 4).await;
    assert_eq!(four, vec![PutOutcome::Short { copies: 3 }]);
    let st = client.cluster_stats().await.unwrap();
    assert_eq!((st.blocks, st.copies), (41, 20 * 2 + 20 * 3 + 3));
    // Every copy reads back right, and a removal takes them all.
    for i in 0..41 {
        let got = client.get(&BlockKey::new(ns(), hash(i))).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(i, 4096)[..]), "block {i}");
    }
    let removed = client.remove(&ns(), &[hash(20)]).await.unwrap();
    assert_eq!(removed, vec![mooncake_proto::ErrorCode::Ok]);
    // Daemons report what they hold with their heartbeats: wait for them.
    let settled = eventually(Duration::from_secs(10), || async {
        let st = client.cluster_stats().await.unwrap();
        st.daemons.iter().map(|d| d.blocks).sum::<u64>() == st.copies
    })
    .await;
    assert!(settled, "the daemons hold exactly the index's copies");
    assert_eq!(
        client.cluster_stats().await.unwrap().copies,
        20 * 2 + 19 * 3 + 3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_host_loses_no_block_that_had_two_copies_and_they_are_copied_again() {
    let mut cluster = cluster_on(&["gpu-1", "gpu-2", "gpu-3"]).await;
    let timeout = Duration::from_secs(5);
    let writer = cluster.client(timeout).await;
    const BLOCKS: u64 = 96;
    let out = put_copies(&writer, 0..BLOCKS, 2).await;
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    // The host most copies are on is the one lost.
    let mut count: HashMap<u32, u64> = HashMap::new();
    let hashes: Vec<BlockHash> = (0..BLOCKS).map(hash).collect();
    for l in writer.lookup(&ns(), &hashes).await.unwrap().items {
        for d in l.unwrap().daemons.iter() {
            *count.entry(d).or_default() += 1;
        }
    }
    let st = writer.cluster_stats().await.unwrap();
    let (victim_id, _) = count.iter().max_by_key(|(_, n)| **n).unwrap();
    let victim_addr = st
        .daemons
        .iter()
        .find(|d| d.id == *victim_id)
        .unwrap()
        .addr
        .clone();
    let victim = cluster
        .daemons
        .iter()
        .position(|(a, _)| *a == victim_addr)
        .unwrap();

    // Readers verify every block round after round, each with a client of
    // its own (whose cached locations still name the lost daemon).
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::new();
    for r in 0..3 {
        let client = cluster.client(timeout).await;
        let (stop, rounds) = (stop.clone(), rounds.clone());
        readers.push(tokio::spawn(async move {
            // A call past its deadline comes back as a timeout error.
            let (mut misses, mut wrong, mut errors) = (0u64, 0u64, Vec::new());
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for i in (0..BLOCKS).map(|i| (i + r * 31) % BLOCKS) {
                    match client.get(&BlockKey::new(ns(), hash(i))).await {
                        Ok(Some(bytes)) if bytes == value(i, 4096) => {}
                        Ok(Some(_)) => wrong += 1,
                        Ok(None) => misses += 1,
                        Err(err) => errors.push(format!("block {i}: {err}")),
                    }
                }
                round += 1;
                rounds.fetch_add(1, Ordering::Relaxed);
            }
            (round, misses, wrong, errors)
        }));
    }
    // Every reader is under way before the kill, and reads on for at least
    // two full rounds each after the daemon's lease has run out (its copies
    // then leave the index, and locations come back with one copy).
    let at = |n: u64| {
        let rounds = rounds.clone();
        async move {
            while rounds.load(Ordering::Relaxed) < n {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    at(3).await;
    cluster.daemons[victim].1.kill9();
    let gone = eventually(Duration::from_secs(20), || async {
        writer
            .cluster_stats()
            .await
            .is_ok_and(|st| st.daemons.iter().filter(|d| d.alive).count() == 2)
    })
    .await;
    assert!(gone, "the killed daemon leaves the cluster with its lease");
    let now = rounds.load(Ordering::Relaxed);
    at(now + 2 * 3).await;
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        let (round, misses, wrong, errors) = reader.await.unwrap();
        assert!(round >= 2, "every reader read");
        assert_eq!(misses, 0, "a block with a surviving copy is never missed");
        assert_eq!(wrong, 0, "no wrong bytes");
        assert!(
            errors.is_empty(),
            "no error, no call past its deadline: {errors:?}"
        );
    }
    // Every block that lost a copy gets it back, on the surviving host
    // that lacked one, fetched from the other and checked.
    let lost = count[victim_id];
    let started = Instant::now();
    let repaired = eventually(Duration::from_secs(60), || async {
        writer
            .cluster_stats()
            .await
            .is_ok_and(|st| st.blocks == BLOCKS && st.copies == 2 * BLOCKS)
    })
    .await;
    assert!(repaired, "every block back to two copies");
    eprintln!(
        "repair: {lost} copies made again within {:.2} s of the kill being seen",
        started.elapsed().as_secs_f64()
    );
    let fresh = cluster.client(timeout).await;
    for nodes in nodes_of(&fresh, 0..BLOCKS).await {
        assert_eq!(nodes.len(), 2);
        assert_ne!(nodes[0], nodes[1], "on two hosts");
    }
    for i in 0..BLOCKS {
        let got = fresh.get(&BlockKey::new(ns(), hash(i))).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(i, 4096)[..]), "block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_back_empty_gets_its_lost_copies_made_again() {
    let mut cluster = cluster_on(&["gpu-1", "gpu-2", "gpu-3"]).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    const BLOCKS: u64 = 48;
    let out = put_copies(&client, 0..BLOCKS, 2).await;
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    let held = eventually(Duration::from_secs(10), || async {
        client
            .cluster_stats()
            .await
            .is_ok_and(|st| st.daemons.iter().all(|d| d.blocks > 0))
    })
    .await;
    assert!(held, "every daemon reports copies");
    // Killed and started again at once, at the same address: it registers
    // again (before its lease ends) with an empty pool.
    let addr = cluster.daemons[0].0.clone();
    cluster.daemons[0].1.kill9();
    cluster.daemons.remove(0);
    cluster.spawn_daemon_on(&addr, "gpu-1");
    // Registered again: the daemon at that address holds nothing.
    let empty = eventually(Duration::from_secs(20), || async {
        client.cluster_stats().await.is_ok_and(|st| {
            st.daemons
                .iter()
                .any(|d| d.addr == addr && d.alive && d.blocks == 0)
        })
    })
    .await;
    assert!(empty, "the daemon came back empty");
    let back = eventually(Duration::from_secs(60), || async {
        client
            .cluster_stats()
            .await
            .is_ok_and(|st| st.blocks == BLOCKS && st.copies == 2 * BLOCKS)
    })
    .await;
    assert!(back, "every block back to two copies");
    for i in 0..BLOCKS {
        let got = client.get(&BlockKey::new(ns(), hash(i))).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(i, 4096)[..]), "block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_block_gets_copies_on_every_host_and_drops_them_when_it_cools() {
    // Hot past 20 reads a second at a daemon; cool after 2 s without.
    let meta = "hot_reads = 20\nhot_copies = 3\nhot_cool = \"2s\"";
    let mut cluster = Cluster::start_with_meta(1, 0, "32MiB", meta).await;
    for node in ["gpu-1", "gpu-2", "gpu-3"] {
        let addr = format!("127.0.0.1:{}", free_port());
        cluster.spawn_daemon_on(&addr, node);
    }
    cluster.wait_healthy(3, Duration::from_secs(15)).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let out = put_copies(&client, 0..4, 1).await;
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    let copies_of = |i: u64| {
        let client = &client;
        async move {
            let found = client.lookup(&ns(), &[hash(i)]).await.unwrap();
            found.items[0].map_or(0, |l| l.daemons.len())
        }
    };
    // Block 0 is read over and over (every read checked) until the meta
    // service has given it a copy on each of the three hosts.
    let key = BlockKey::new(ns(), hash(0));
    let reader = cluster.client(Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while copies_of(0).await < 3 {
        assert!(
            Instant::now() < deadline,
            "the hot block never got three copies"
        );
        for _ in 0..50 {
            let got = reader.get(&key).await.unwrap();
            assert_eq!(got.as_deref(), Some(&value(0, 4096)[..]));
        }
    }
    assert_eq!(
        copies_of(1).await,
        1,
        "a block nobody reads keeps its one copy"
    );
    // Its readers find the new copies once their cached location expires,
    // and spread over them; every read stays right.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    for _ in 0..200 {
        let got = reader.get(&key).await.unwrap();
        assert_eq!(got.as_deref(), Some(&value(0, 4096)[..]));
    }
    // Daemons report their hits with their heartbeats: wait for them.
    let spread = eventually(Duration::from_secs(10), || async {
        let st = client.cluster_stats().await.unwrap();
        st.daemons.iter().filter(|d| d.hits > 0).count() == 3
    })
    .await;
    assert!(spread, "reads reach every copy");
    // Nobody reads it now: it cools and goes back to one copy.
    let cooled = eventually(Duration::from_secs(30), || async {
        copies_of(0).await == 1
    })
    .await;
    assert!(cooled, "the cooled block dropped its extra copies");
    let got = client.get(&key).await.unwrap();
    assert_eq!(got.as_deref(), Some(&value(0, 4096)[..]));
}

/// An operator drains a host before taking it out: its blocks (one copy
/// each) are copied to the other hosts while it still serves, `drain
/// --wait` returns once they are, and the host then dies without a single
/// miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_host_can_be_killed_without_a_miss() {
    let mut cluster = cluster_on(&["a", "b", "c"]).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    const BLOCKS: u64 = 90;
    let stored = put_copies(&client, 0..BLOCKS, 1).await;
    assert!(
        stored.iter().all(|o| *o == PutOutcome::Stored),
        "{stored:?}"
    );
    let st = client.cluster_stats().await.unwrap();
    let hashes: Vec<BlockHash> = (0..BLOCKS).map(hash).collect();
    let found = client.lookup(&ns(), &hashes).await.unwrap();
    let mut count: HashMap<u32, usize> = HashMap::new();
    for l in &found.items {
        *count
            .entry(l.expect("stored").daemons.first().unwrap())
            .or_default() += 1;
    }
    let (victim, on_it) = count.into_iter().max_by_key(|(_, n)| *n).unwrap();
    assert!(on_it > 0, "the drained daemon holds blocks");
    let out = std::process::Command::new(common::BIN)
        .args(["drain", &victim.to_string(), "--wait", "30s", "--json"])
        .args(["--etcd", &cluster.etcd_url])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("\"not_copied\":0"), "{said}");
    let settled = eventually(Duration::from_secs(10), || async {
        client
            .cluster_stats()
            .await
            .is_ok_and(|st| st.repairing == 0)
    })
    .await;
    assert!(settled, "no block waits for a copy any more");
    let at = cluster
        .daemons
        .iter()
        .position(|(addr, _)| st.daemons.iter().any(|d| d.id == victim && d.addr == *addr))
        .expect("the drained daemon is one of the cluster's");
    cluster.daemons[at].1.kill9();
    for i in 0..BLOCKS {
        let got = client.get(&BlockKey::new(ns(), hash(i))).await.unwrap();
        assert_eq!(got, Some(value(i, 4096)), "block {i} after its host died");
    }
}

/// The leader dies, and a host with it: the new leader rebuilds its index
/// from the surviving daemons (which know where copies are, not how many
/// were wanted), and still brings every block back to the copies its
/// namespace wants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_lost_with_a_host_during_a_failover_are_made_again() {
    let meta = "hot_copies = 1\n[meta.replicas]\n\"*\" = 2";
    let mut cluster = Cluster::start_with_meta(2, 0, "32MiB", meta).await;
    for node in ["a", "b", "c"] {
        let addr = format!("127.0.0.1:{}", free_port());
        cluster.spawn_daemon_on(&addr, node);
    }
    cluster.wait_healthy(3, Duration::from_secs(15)).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    const BLOCKS: u64 = 30;
    let stored = put_copies(&client, 0..BLOCKS, 0).await;
    assert!(
        stored.iter().all(|o| *o == PutOutcome::Stored),
        "{stored:?}"
    );
    assert!(nodes_of(&client, 0..BLOCKS)
        .await
        .iter()
        .all(|n| n.len() == 2));
    let leader = cluster.leader_index().await;
    cluster.metas[leader].1.kill9();
    cluster.daemons[2].1.kill9();
    cluster.wait_healthy(2, Duration::from_secs(30)).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let back = eventually(Duration::from_secs(30), || async {
        let hashes: Vec<BlockHash> = (0..BLOCKS).map(hash).collect();
        client.lookup(&ns(), &hashes).await.is_ok_and(|found| {
            found
                .items
                .iter()
                .all(|l| l.is_some_and(|l| l.daemons.len() == 2))
        })
    })
    .await;
    assert!(back, "every block has two copies again, on hosts a and b");
    for i in 0..BLOCKS {
        let got = client.get(&BlockKey::new(ns(), hash(i))).await.unwrap();
        assert_eq!(got, Some(value(i, 4096)), "block {i}");
    }
}

/// With TLS on every port (mutual TLS between the servers), a lost copy is
/// still made again: the target daemon fetches it from the surviving one
/// over TLS, with its peer certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_lost_copy_is_fetched_again_from_a_surviving_one() {
    let mut cluster = Cluster::start_tls(1, 0, "32MiB").await;
    for node in ["a", "b", "c"] {
        let addr = format!("127.0.0.1:{}", free_port());
        cluster.spawn_daemon_on(&addr, node);
    }
    cluster.wait_healthy(3, Duration::from_secs(15)).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    const BLOCKS: u64 = 24;
    let out = put_copies(&client, 0..BLOCKS, 2).await;
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    cluster.daemons[0].1.kill9();
    let lost = cluster.daemons[0].0.clone();
    let back = eventually(Duration::from_secs(30), || async {
        let hashes: Vec<BlockHash> = (0..BLOCKS).map(hash).collect();
        let (Ok(found), Ok(st)) = (
            client.lookup(&ns(), &hashes).await,
            client.cluster_stats().await,
        ) else {
            return false;
        };
        let dead: Vec<u32> = st
            .daemons
            .iter()
            .filter(|d| d.addr == lost)
            .map(|d| d.id)
            .collect();
        found.items.iter().all(|l| {
            l.is_some_and(|l| l.daemons.len() == 2 && !l.daemons.iter().any(|d| dead.contains(&d)))
        })
    })
    .await;
    assert!(
        back,
        "every block has two copies again, none on the dead host"
    );
    for i in 0..BLOCKS {
        let got = client.get(&BlockKey::new(ns(), hash(i))).await.unwrap();
        assert_eq!(got, Some(value(i, 4096)), "block {i}");
    }
}
