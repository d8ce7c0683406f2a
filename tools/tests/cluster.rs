//! A cluster on one machine, as an operator runs it: a real etcd, two meta
//! replicas and three daemons as separate `mooncake-store` processes, and
//! faults made by killing and pausing real processes.

mod common;
use common::cluster::{Cluster, TTL};
use common::eventually;

use std::collections::HashSet;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_client::{Client, GetOutcome, PutOutcome};
use mooncake_coord::Coordinator;
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace, PrefixHasher};

fn ns() -> Namespace {
    Namespace::new("t/cluster").unwrap()
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

async fn put_blocks(client: &Client, range: std::ops::Range<u64>, len: usize) -> Vec<BlockHash> {
    let hashes: Vec<BlockHash> = range
        .clone()
        .map(|i| BlockHash::from_opaque(&i.to_le_bytes()))
        .collect();
    let values: Vec<Vec<u8>> = range.map(|i| value(i, len)).collect();
    let blocks: Vec<(BlockHash, &[u8])> = hashes
        .iter()
        .zip(&values)
        .map(|(h, v)| (*h, &v[..]))
        .collect();
    let out = client.put(&ns(), &blocks).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    hashes
}

async fn all_visible(client: &Client, hashes: &[BlockHash]) -> bool {
    client
        .exists(&ns(), hashes)
        .await
        .map(|e| e.iter().all(|x| *x))
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_spread_across_three_daemons_and_read_back_right() {
    let cluster = Cluster::start(2, 3).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let hashes = put_blocks(&client, 0..90, 64 << 10).await;
    let locs = client.lookup(&ns(), &hashes).await.unwrap();
    let used: HashSet<u32> = locs
        .items
        .iter()
        .flatten()
        .flat_map(|l| l.daemons.iter())
        .collect();
    assert_eq!(used.len(), 3, "blocks spread over every daemon");
    for (i, h) in hashes.iter().enumerate() {
        let got = client.get(&BlockKey::new(ns(), *h)).await.unwrap().unwrap();
        assert!(got == value(i as u64, 64 << 10));
    }
    let tokens: Vec<u32> = (0..64).collect();
    let chain = PrefixHasher::chain(b"", &tokens, 16, b"");
    let v = vec![1u8; 1000];
    let head: Vec<(BlockHash, &[u8])> = chain[..3].iter().map(|h| (*h, &v[..])).collect();
    client.put(&ns(), &head).await.unwrap();
    assert_eq!(client.match_prefix(&ns(), &chain).await.unwrap().matched, 3);
    // The standby registers with etcd on its own schedule.
    let standby = eventually(Duration::from_secs(10), || async {
        client
            .cluster_stats()
            .await
            .is_ok_and(|st| st.standbys.len() == 1)
    })
    .await;
    assert!(standby.is_some(), "the other replica stands by");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_under_load_loses_no_block_of_live_daemons() {
    let mut cluster = Cluster::start(2, 3).await;
    let timeout = Duration::from_secs(3);
    let client = Arc::new(cluster.client(timeout).await);
    let hashes = put_blocks(&client, 0..200, 16 << 10).await;

    // A load that verifies every byte and times every call.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (wrong, errors, slowest_ms) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let load = {
        let (client, hashes, stop) = (client.clone(), hashes.clone(), stop.clone());
        let (wrong, errors, slowest_ms) = (wrong.clone(), errors.clone(), slowest_ms.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            let mut buf = vec![0u8; 16 << 10];
            while !stop.load(Ordering::Relaxed) {
                let n = (i % 200) as usize;
                let started = Instant::now();
                match client
                    .get_into(&ns(), &[hashes[n]], &mut [&mut buf[..]])
                    .await
                {
                    Ok(out) => {
                        if let GetOutcome::Hit(len) = out[0] {
                            if buf[..len] != value(n as u64, 16 << 10)[..] {
                                wrong.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let extra = BlockHash::from_opaque(format!("load-{i}").as_bytes());
                let _ = client.put(&ns(), &[(extra, &[7u8; 1000][..])]).await;
                slowest_ms.fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
                i += 1;
            }
            i
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;

    let old = cluster.leader_index().await;
    let killed_at = Instant::now();
    cluster.metas[old].1.kill9();
    let coordinator = cluster.coordinator().await;
    let old_addr = cluster.metas[old].0.clone();
    let new_leader = eventually(Duration::from_secs(10), || async {
        matches!(coordinator.leader().await, Ok(Some(l)) if l.addr != old_addr)
    })
    .await
    .expect("a standby takes over");
    let visible = eventually(Duration::from_secs(10), || all_visible(&client, &hashes))
        .await
        .expect("every block of the live daemons is found again");
    stop.store(true, Ordering::Relaxed);
    let rounds = load.await.unwrap();
    eprintln!(
        "failover: new leader {:?} after the kill, all {} blocks visible {:?} after the kill; load: {rounds} rounds, {} errors, slowest call {} ms",
        new_leader,
        hashes.len(),
        killed_at.elapsed().min(new_leader + visible),
        errors.load(Ordering::Relaxed),
        slowest_ms.load(Ordering::Relaxed),
    );
    assert!(
        new_leader <= TTL * 2,
        "standby led after {new_leader:?}, more than 2x the lease TTL"
    );
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "no wrong bytes, ever");
    // A round is one get and one put, each under the client deadline.
    assert!(slowest_ms.load(Ordering::Relaxed) <= 2 * timeout.as_millis() as u64 + 500);
    assert!(rounds > 10, "the load kept running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_daemon_leaves_the_index_within_its_lease_ttl() {
    let mut cluster = Cluster::start(1, 3).await;
    let client = cluster.client(Duration::from_secs(3)).await;
    let hashes = put_blocks(&client, 0..60, 4096).await;
    let locs = client.lookup(&ns(), &hashes).await.unwrap();
    let victim_addr = cluster.daemons[0].0.clone();
    let st = client.cluster_stats().await.unwrap();
    let victim = st
        .daemons
        .iter()
        .find(|d| d.addr == victim_addr)
        .unwrap()
        .id;
    let on_victim: Vec<BlockHash> = hashes
        .iter()
        .zip(&locs.items)
        .filter(|(_, l)| l.unwrap().daemons.contains(victim))
        .map(|(h, _)| *h)
        .collect();
    assert!(!on_victim.is_empty());
    let killed_at = Instant::now();
    cluster.daemons[0].1.kill9();
    let gone = eventually(Duration::from_secs(10), || async {
        client
            .exists(&ns(), &on_victim)
            .await
            .unwrap()
            .iter()
            .all(|e| !e)
    })
    .await
    .expect("blocks of the dead daemon leave the index");
    eprintln!(
        "dead daemon's {} blocks unindexed {:?} after the kill",
        on_victim.len(),
        killed_at.elapsed().min(gone)
    );
    assert!(gone <= TTL + Duration::from_secs(1), "took {gone:?}");
    for h in &on_victim {
        assert_eq!(
            client.get(&BlockKey::new(ns(), *h)).await.unwrap(),
            None,
            "a miss"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_paused_data_is_served_and_the_cluster_recovers() {
    let cluster = Cluster::start(2, 2).await;
    let client = cluster.client(Duration::from_secs(3)).await;
    let hashes = put_blocks(&client, 0..40, 8192).await;
    cluster.etcd.pause();
    let paused_at = Instant::now();
    let mut served = 0;
    while paused_at.elapsed() < TTL + Duration::from_secs(1) {
        for (i, h) in hashes.iter().enumerate().step_by(7) {
            if let Some(bytes) = client.get(&BlockKey::new(ns(), *h)).await.unwrap() {
                assert!(bytes == value(i as u64, 8192));
                served += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.etcd.resume();
    assert!(
        served > 0,
        "stored data kept being served while etcd was paused"
    );
    cluster.wait_healthy(2, Duration::from_secs(20)).await;
    let client = cluster.client(Duration::from_secs(3)).await;
    let recovered = eventually(Duration::from_secs(10), || all_visible(&client, &hashes)).await;
    assert!(
        recovered.is_some(),
        "every block visible again after etcd returned"
    );
    put_blocks(&client, 1000..1010, 4096).await;
}

/// A host that boots while etcd is down (or before it): its meta replica
/// and daemon wait for etcd instead of exiting, and join once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_started_while_etcd_is_down_wait_for_it_and_join() {
    let mut cluster = Cluster::start(1, 1).await;
    cluster.etcd.kill9();
    cluster.spawn_meta();
    let addr = format!("127.0.0.1:{}", common::free_port());
    cluster.spawn_daemon(&addr);
    for log in ["meta-1.log", "daemon-1.log"] {
        let path = cluster.logs.join(log);
        let waiting = eventually(Duration::from_secs(15), || async {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            text.contains("waiting for etcd")
        })
        .await;
        assert!(waiting.is_some(), "{log} says it waits for etcd");
    }
    cluster.restart_etcd();
    cluster.wait_healthy(2, Duration::from_secs(30)).await;
    let coordinator = cluster.coordinator().await;
    let metas = eventually(Duration::from_secs(10), || async {
        let m = coordinator.members(mooncake_coord::MemberKind::Meta).await;
        m.is_ok_and(|m| m.len() == 2)
    })
    .await;
    assert!(metas.is_some(), "both meta replicas registered");
    let client = cluster.client(Duration::from_secs(3)).await;
    put_blocks(&client, 0..20, 4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_registers_again_with_an_empty_pool() {
    let mut cluster = Cluster::start(1, 2).await;
    let client = cluster.client(Duration::from_secs(3)).await;
    let hashes = put_blocks(&client, 0..40, 4096).await;
    let addr = cluster.daemons[0].0.clone();
    cluster.daemons[0].1.kill9();
    let id = {
        let st = client.cluster_stats().await.unwrap();
        st.daemons.iter().find(|d| d.addr == addr).unwrap().id
    };
    // Back at once, well within its lease TTL: its registration (not its
    // death) must clear its old entries, with the same id kept.
    let restarted_at = Instant::now();
    cluster.spawn_daemon(&addr);
    let cleared = eventually(TTL, || async {
        let locs = client.lookup(&ns(), &hashes).await.unwrap();
        locs.items.iter().flatten().all(|l| !l.daemons.contains(id))
    })
    .await;
    assert!(
        cleared.is_some(),
        "no block is indexed on the restarted daemon, whose DRAM started empty"
    );
    assert!(
        restarted_at.elapsed() < TTL,
        "cleared by re-registration, before the TTL"
    );
    let st = client.cluster_stats().await.unwrap();
    let restarted = st.daemons.iter().find(|d| d.addr == addr).unwrap();
    assert!(restarted.alive);
    assert_eq!(restarted.id, id, "same address, same id");
    let mut found = 0;
    for h in &hashes {
        if client
            .get(&BlockKey::new(ns(), *h))
            .await
            .unwrap()
            .is_some()
        {
            found += 1;
        }
    }
    assert!(
        found > 0 && found < hashes.len(),
        "the other daemon's blocks are still served"
    );
    put_blocks(&client, 500..540, 4096).await;
}

/// Whether `key` reads back as `want` once the index has it again
/// (`None`: it never came back within `within`).
async fn reads_back(client: &Client, hash: BlockHash, within: Duration) -> Option<Vec<u8>> {
    let key = BlockKey::new(ns(), hash);
    let start = Instant::now();
    while start.elapsed() < within {
        if let Ok(Some(bytes)) = client.get(&key).await {
            return Some(bytes);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

async fn put_value(client: &Client, hash: BlockHash, value: &[u8]) -> PutOutcome {
    client.put(&ns(), &[(hash, value)]).await.unwrap()[0]
}

/// Waits until a new leader serves an index rebuilt from the daemons (the
/// probe block, stored before, is found again), and returns a new client,
/// which knows no location from before: what it reads, the leader answered.
async fn rebuilt(cluster: &Cluster, probe: BlockHash) -> Client {
    let client = cluster.client(Duration::from_secs(3)).await;
    assert!(
        reads_back(&client, probe, Duration::from_secs(30))
            .await
            .is_some(),
        "the new leader rebuilt its index from the daemon's inventory"
    );
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_key_stays_removed_across_daemon_restart_failover_and_a_new_meta() {
    let mut cluster = Cluster::start(2, 1).await;
    let client = cluster.client(Duration::from_secs(3)).await;
    let h = |name: &str| BlockHash::from_opaque(name.as_bytes());
    let addr = cluster.daemons[0].0.clone();
    let id = {
        let st = client.cluster_stats().await.unwrap();
        st.daemons.iter().find(|d| d.addr == addr).unwrap().id
    };
    let on_it = |hash: BlockHash| {
        let client = &client;
        async move {
            let locs = client.lookup(&ns(), &[hash]).await.unwrap();
            locs.items[0]
                .as_ref()
                .is_some_and(|l| l.daemons.contains(id))
        }
    };
    // A pin and an unpin of a block on the daemon leave the meta service a
    // pooled connection to it, which the daemon's restart then breaks.
    let mut warm = None;
    for i in 0..8 {
        let hash = h(&format!("warm{i}"));
        assert_eq!(put_value(&client, hash, b"x").await, PutOutcome::Stored);
        if on_it(hash).await {
            warm = Some(hash);
            break;
        }
    }
    let warm = warm.expect("a block placed on each daemon in turn");
    client.pin(&ns(), &[warm], true).await.unwrap();
    client.pin(&ns(), &[warm], false).await.unwrap();
    cluster.daemons[0].1.kill9();
    cluster.spawn_daemon(&addr);
    // Registered again (its old entries cleared, it alive): a put placed
    // on it before that would be dropped with its previous life's entries.
    let up = eventually(Duration::from_secs(20), || async {
        let st = client.cluster_stats().await.unwrap();
        let alive = st.daemons.iter().any(|d| d.addr == addr && d.alive);
        alive && !on_it(warm).await
    })
    .await;
    assert!(up.is_some(), "the restarted daemon registers again");
    let up = eventually(Duration::from_secs(20), || async {
        client
            .put(&ns(), &[(h("probe"), &b"probe"[..])])
            .await
            .is_ok_and(|o| o[0] == PutOutcome::Stored)
    })
    .await;
    assert!(up.is_some(), "the restarted daemon takes puts");

    assert_eq!(
        put_value(&client, h("R2"), b"OLD value").await,
        PutOutcome::Stored
    );
    assert_eq!(
        client.remove(&ns(), &[h("R2")]).await.unwrap(),
        vec![ErrorCode::Ok],
        "the first call to the restarted daemon reaches it, and it confirms"
    );
    assert_eq!(
        put_value(&client, h("R2"), b"NEW value!").await,
        PutOutcome::Stored
    );
    let key = BlockKey::new(ns(), h("R2"));
    assert_eq!(
        client.get(&key).await.unwrap().as_deref(),
        Some(&b"NEW value!"[..])
    );
    assert_eq!(
        put_value(&client, h("R3"), b"removed").await,
        PutOutcome::Stored
    );
    assert_eq!(
        client.remove(&ns(), &[h("R3")]).await.unwrap(),
        vec![ErrorCode::Ok]
    );

    // Failover: the standby rebuilds the index from the daemon.
    let leader = cluster.leader_index().await;
    cluster.metas[leader].1.kill9();
    let client = rebuilt(&cluster, h("probe")).await;
    assert_eq!(
        client.get(&key).await.unwrap().as_deref(),
        Some(&b"NEW value!"[..])
    );
    assert_eq!(
        client.get(&BlockKey::new(ns(), h("R3"))).await.unwrap(),
        None
    );

    // A new replica, then the current leader killed: the new one leads.
    cluster.spawn_meta();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let leader = cluster.leader_index().await;
    cluster.metas[leader].1.kill9();
    let client = rebuilt(&cluster, h("probe")).await;
    assert_eq!(
        client.get(&key).await.unwrap().as_deref(),
        Some(&b"NEW value!"[..])
    );
    assert_eq!(
        client.get(&BlockKey::new(ns(), h("R3"))).await.unwrap(),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_its_daemon_cannot_confirm_is_reported_and_still_happens() {
    // A lease far longer than the meta service's call to the daemon (2 s):
    // the paused daemon stays registered however slowly this machine runs,
    // so the removal reaches it and times out, rather than finding the
    // daemon's blocks already gone with its lease.
    let mut cluster = Cluster::start_with(2, 1, "64MiB", "30s").await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let h = |name: &str| BlockHash::from_opaque(name.as_bytes());
    assert_eq!(
        put_value(&client, h("probe"), b"probe").await,
        PutOutcome::Stored
    );
    assert_eq!(
        put_value(&client, h("R4"), b"doomed").await,
        PutOutcome::Stored
    );
    cluster.daemons[0].1.pause();
    let codes = client.remove(&ns(), &[h("R4")]).await.unwrap();
    cluster.daemons[0].1.resume();
    assert!(
        matches!(codes[..], [ErrorCode::Timeout | ErrorCode::Unavailable]),
        "a paused daemon cannot confirm: {codes:?}{}",
        cluster.log_tails(30)
    );
    let key = BlockKey::new(ns(), h("R4"));
    assert_eq!(
        client.get(&key).await.unwrap(),
        None,
        "out of the index at once"
    );
    // The daemon answers again and is told; a failover rebuilds the index
    // from what it holds, which must not include the removed key.
    let told = eventually(Duration::from_secs(20), || async {
        client
            .cluster_stats()
            .await
            .is_ok_and(|st| st.daemons.iter().all(|d| d.alive))
    })
    .await;
    assert!(told.is_some(), "the daemon is alive again");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leader = cluster.leader_index().await;
    cluster.metas[leader].1.kill9();
    let client = rebuilt(&cluster, h("probe")).await;
    assert_eq!(
        client.get(&key).await.unwrap(),
        None,
        "removed stays removed"
    );
}
