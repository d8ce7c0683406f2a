//! Blocks go in and come back byte for byte, through the real servers.

use std::sync::Arc;

use mooncake_client::{GetOutcome, PutOutcome};
use mooncake_proto::{BlockHash, BlockKey, Namespace, Opcode, PrefixHasher};
use mooncake_tests::{block_bytes, TestCluster};
use rand::{Rng, SeedableRng};

fn ns(name: &str) -> Namespace {
    Namespace::new(name).unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

/// A size between 1 KiB and 8 MiB, log-uniform (as many small as large).
fn random_size(rng: &mut impl Rng) -> usize {
    let exp = rng.gen_range(10.0..23.0f64);
    2f64.powf(exp) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_random_sized_blocks_round_trip_byte_for_byte() {
    // LRU: each round's blocks are read right after their put, and under
    // 2Q older rounds' blocks, read already, would outrank them.
    let cluster = TestCluster::start_lru(256 << 20).await;
    let client = cluster.client();
    let ns = ns("t/round-trip");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut written = Vec::new();
    // Rounds that each fit the pool: every block of a round must come back
    // exactly; older rounds may have been evicted, but never altered.
    for round in 0..20u64 {
        let blocks: Vec<(BlockHash, Vec<u8>)> = (0..100)
            .map(|i| {
                let id = round * 100 + i;
                (hash(id), block_bytes(id, random_size(&mut rng)))
            })
            .collect();
        let refs: Vec<(BlockHash, &[u8])> = blocks.iter().map(|(h, v)| (*h, &v[..])).collect();
        let outcomes = client.put(&ns, &refs).await.unwrap();
        assert!(
            outcomes.iter().all(|o| *o == PutOutcome::Stored),
            "round {round}: {outcomes:?}"
        );
        let hashes: Vec<BlockHash> = blocks.iter().map(|(h, _)| *h).collect();
        let mut bufs: Vec<Vec<u8>> = blocks.iter().map(|(_, v)| vec![0u8; v.len()]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = client.get_into(&ns, &hashes, &mut slices).await.unwrap();
        for ((outcome, buf), (_, expect)) in got.iter().zip(&bufs).zip(&blocks) {
            assert_eq!(*outcome, GetOutcome::Hit(expect.len()));
            assert!(buf == expect, "round {round}: bytes differ");
        }
        written.extend(blocks.into_iter().map(|(h, v)| (h, v.len(), round)));
    }
    assert_eq!(written.len(), 2000);
    let mut hits = 0;
    for (i, (h, len, _)) in written.iter().enumerate() {
        let key = mooncake_proto::BlockKey::new(ns.clone(), *h);
        if let Some(bytes) = client.get(&key).await.unwrap() {
            assert_eq!(bytes.len(), *len);
            assert!(
                bytes == block_bytes(i as u64, *len),
                "evicted-or-exact broken for block {i}"
            );
            hits += 1;
        }
    }
    assert!(hits > 0, "the most recent round must still be cached");
    assert_eq!(client.corrupt_reads(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_share_blocks_and_never_see_wrong_bytes() {
    let cluster = Arc::new(TestCluster::start(128 << 20).await);
    let ns = ns("t/concurrent");
    let mut tasks = Vec::new();
    for worker in 0..8u64 {
        let (cluster, ns) = (cluster.clone(), ns.clone());
        tasks.push(tokio::spawn(async move {
            let client = cluster.client();
            for i in 0..100u64 {
                // Half the keys are shared by every worker (same bytes),
                // half are the worker's own.
                let id = if i % 2 == 0 {
                    i
                } else {
                    1000 * (worker + 1) + i
                };
                let value = block_bytes(id, 4096 + (id as usize % 7) * 1024);
                let out = client.put(&ns, &[(hash(id), &value)]).await.unwrap()[0];
                assert!(
                    matches!(out, PutOutcome::Stored | PutOutcome::AlreadyExists),
                    "{out:?}"
                );
                let key = mooncake_proto::BlockKey::new(ns.clone(), hash(id));
                // A concurrent writer of a shared key may not have committed
                // yet: a miss is allowed, wrong bytes never.
                if let Some(got) = client.get(&key).await.unwrap() {
                    assert!(got == value, "worker {worker} read wrong bytes for {id}");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let client = cluster.client();
    let all: Vec<BlockHash> = (0..100).step_by(2).map(hash).collect();
    assert!(client.exists(&ns, &all).await.unwrap().iter().all(|e| *e));
}

#[tokio::test]
async fn match_prefix_counts_the_stored_head_of_a_chain() {
    let cluster = TestCluster::start(64 << 20).await;
    let client = cluster.client();
    let ns = ns("acme/llama-3-8b");
    let tokens: Vec<u32> = (0..16 * 10).collect();
    let chain = PrefixHasher::chain(b"", &tokens, 16, b"");
    let value = vec![7u8; 2048];
    let first_six: Vec<(BlockHash, &[u8])> = chain[..6].iter().map(|h| (*h, &value[..])).collect();
    client.put(&ns, &first_six).await.unwrap();
    // Block 8 is stored too, but after a gap it does not count.
    client.put(&ns, &[(chain[8], &value[..])]).await.unwrap();
    let m = client.match_prefix(&ns, &chain).await.unwrap();
    assert_eq!(m.matched, 6);
    assert_eq!(m.locations.len(), 6);
    assert!(m.locations.iter().all(|l| l.size == 2048));
    let other = Namespace::new("other/model").unwrap();
    assert_eq!(
        client.match_prefix(&other, &chain).await.unwrap().matched,
        0
    );
    assert_eq!(
        client.exists(&ns, &chain[5..9]).await.unwrap(),
        vec![true, false, false, true]
    );
}

#[tokio::test]
async fn remove_and_duplicate_puts_behave() {
    let cluster = TestCluster::start(64 << 20).await;
    let client = cluster.client();
    let ns = ns("t/remove");
    let v = block_bytes(1, 10_000);
    assert_eq!(
        client.put(&ns, &[(hash(1), &v)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    assert_eq!(
        client.put(&ns, &[(hash(1), &v)]).await.unwrap(),
        vec![PutOutcome::AlreadyExists]
    );
    assert_eq!(
        client.remove(&ns, &[hash(1), hash(2)]).await.unwrap(),
        vec![
            mooncake_proto::ErrorCode::Ok,
            mooncake_proto::ErrorCode::NotFound
        ]
    );
    let key = mooncake_proto::BlockKey::new(ns.clone(), hash(1));
    assert_eq!(client.get(&key).await.unwrap(), None);
    // The daemon freed the bytes, so the key can be stored again.
    assert_eq!(
        client.put(&ns, &[(hash(1), &v)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
    assert_eq!(client.get(&key).await.unwrap().unwrap(), v);
}

/// A cluster of one daemon whose leases last `ttl`.
async fn leasing_for(ttl: std::time::Duration) -> TestCluster {
    let daemon = mooncake_store_daemon::DaemonConfig {
        kv_lease_ttl: mooncake_proto::units::HumanDuration(ttl),
        ..mooncake_tests::daemon_config(64 << 20)
    };
    TestCluster::start_with(mooncake_tests::fast_meta(), vec![daemon]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_that_is_not_forced_leaves_a_leased_block_and_a_forced_one_takes_it() {
    use mooncake_proto::ErrorCode::{Leased, NotFound, Ok};
    let cluster = leasing_for(std::time::Duration::from_secs(600)).await;
    let client = cluster.client();
    let ns = ns("t/leased");
    let key = |i: u64| BlockKey::new(ns.clone(), hash(i));
    let (v1, v2) = (block_bytes(1, 10_000), block_bytes(2, 10_000));
    client
        .put(&ns, &[(hash(1), &v1), (hash(2), &v2)])
        .await
        .unwrap();
    // Found with a lease (Mooncake's batch_is_exist): that one stays.
    assert_eq!(
        client.exists_leased(&ns, &[hash(1)]).await.unwrap(),
        vec![true]
    );
    assert_eq!(
        client
            .remove_unleased(&ns, &[hash(1), hash(2), hash(3)])
            .await
            .unwrap(),
        vec![Leased, Ok, NotFound]
    );
    assert_eq!(client.get(&key(1)).await.unwrap().unwrap(), v1);
    assert_eq!(client.get(&key(2)).await.unwrap(), None);
    assert_eq!(client.remove(&ns, &[hash(1)]).await.unwrap(), vec![Ok]);
    assert_eq!(client.get(&key(1)).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_on_one_copy_keeps_every_copy_from_a_removal_not_forced() {
    use mooncake_client::{ErrorSource, PutOptions};
    use mooncake_proto::message::{KeysRequest, Statuses};
    use mooncake_proto::ErrorCode::{Leased, Ok};
    let on = |node: &str| mooncake_store_daemon::DaemonConfig {
        node: node.into(),
        kv_lease_ttl: mooncake_proto::units::HumanDuration(std::time::Duration::from_secs(600)),
        ..mooncake_tests::daemon_config(64 << 20)
    };
    let cluster =
        TestCluster::start_with(mooncake_tests::fast_meta(), vec![on("a"), on("b")]).await;
    let client = cluster.client();
    let ns = ns("t/leased-copies");
    let v = block_bytes(1, 10_000);
    let stored = client
        .put_with(&ns, &[(hash(1), &v), (hash(2), &v)], PutOptions::copies(2))
        .await
        .unwrap();
    assert_eq!(stored, vec![PutOutcome::Stored; 2]);
    // A lease on one copy only: the client that took it could not ask
    // the other daemon.
    let mut conn = mooncake_net::Connection::connect(
        &cluster.daemon_addr(1),
        ErrorSource::Daemon,
        std::time::Duration::from_secs(2),
    )
    .await
    .unwrap();
    let hold = KeysRequest {
        namespace: ns.clone(),
        hashes: vec![hash(1)],
    };
    let held: Statuses = conn.call(Opcode::Hold, &hold, "hold").await.unwrap();
    assert_eq!(held.codes, vec![Ok]);
    assert_eq!(
        client
            .remove_unleased(&ns, &[hash(1), hash(2)])
            .await
            .unwrap(),
        vec![Leased, Ok]
    );
    let found = client.lookup(&ns, &[hash(1), hash(2)]).await.unwrap();
    let kept = found.items[0].expect("the leased block stays");
    assert_eq!(
        kept.daemons.len(),
        2,
        "a copy went though a lease held the other"
    );
    assert!(found.items[1].is_none());
    for daemon in [0, 1] {
        let mut conn = mooncake_net::Connection::connect(
            &cluster.daemon_addr(daemon),
            ErrorSource::Daemon,
            std::time::Duration::from_secs(2),
        )
        .await
        .unwrap();
        let key = BlockKey::new(ns.clone(), hash(1));
        let asked = conn
            .call::<mooncake_proto::message::Empty>(
                Opcode::LeaseOf,
                &mooncake_proto::message::KeyRequest { key },
                "lease_of",
            )
            .await;
        match daemon {
            0 => assert!(asked.is_ok(), "daemon 0 holds its copy unleased: {asked:?}"),
            _ => assert!(
                matches!(
                    &asked,
                    Err(mooncake_client::ClientError::Server { code: Leased, .. })
                ),
                "daemon 1's copy is leased: {asked:?}"
            ),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_block_is_removed_without_force_once_its_lease_ends() {
    use mooncake_proto::ErrorCode::Ok;
    let cluster = leasing_for(std::time::Duration::from_millis(200)).await;
    let client = cluster.client();
    let ns = ns("t/lease-ends");
    let v = block_bytes(1, 10_000);
    client.put(&ns, &[(hash(1), &v)]).await.unwrap();
    assert_eq!(
        client.exists_leased(&ns, &[hash(1)]).await.unwrap(),
        vec![true]
    );
    let gone = mooncake_tests::eventually(std::time::Duration::from_secs(20), || async {
        client.remove_unleased(&ns, &[hash(1)]).await.unwrap() == vec![Ok]
    })
    .await;
    assert!(gone, "still refused long after its lease");
    let key = BlockKey::new(ns.clone(), hash(1));
    assert_eq!(client.get(&key).await.unwrap(), None);
}

#[tokio::test]
async fn a_buffer_too_small_is_an_error_not_a_truncated_block() {
    let cluster = TestCluster::start(64 << 20).await;
    let client = cluster.client();
    let ns = ns("t/small-buffer");
    let v = block_bytes(3, 8192);
    client.put(&ns, &[(hash(3), &v)]).await.unwrap();
    let mut small = [0u8; 100];
    let got = client
        .get_into(&ns, &[hash(3)], &mut [&mut small[..]])
        .await
        .unwrap();
    assert_eq!(
        got,
        vec![GetOutcome::Failed(mooncake_proto::ErrorCode::TooLarge)]
    );
}

#[tokio::test]
async fn client_metrics_count_what_the_worker_saw() {
    let cluster = TestCluster::start(16 << 20).await;
    let registry = prometheus::Registry::new();
    let cfg = mooncake_client::ClientConfig::new(cluster.meta_addr.clone())
        .with_metrics(&registry)
        .unwrap();
    let client = mooncake_client::Client::new(cfg);
    let ns = ns("t/client-metrics");
    let v = block_bytes(1, 3000);
    client
        .put(&ns, &[(hash(1), &v[..]), (hash(2), &v[..])])
        .await
        .unwrap();
    client.put(&ns, &[(hash(1), &v[..])]).await.unwrap();
    let mut a = vec![0u8; 3000];
    let mut b = vec![0u8; 3000];
    client
        .get_into(&ns, &[hash(1), hash(9)], &mut [&mut a[..], &mut b[..]])
        .await
        .unwrap();
    client.match_prefix(&ns, &[hash(1), hash(2)]).await.unwrap();
    let value = |name: &str, labels: &[(&str, &str)]| -> f64 {
        registry
            .gather()
            .iter()
            .find(|f| f.name() == name)
            .and_then(|f| {
                f.get_metric().iter().find(|m| {
                    labels.iter().all(|(k, v)| {
                        m.get_label()
                            .iter()
                            .any(|l| l.name() == *k && l.value() == *v)
                    })
                })
            })
            .map(|m| {
                if name.ends_with("_seconds") {
                    m.get_histogram().get_sample_count() as f64
                } else {
                    m.get_counter().get_value()
                }
            })
            .unwrap_or(-1.0)
    };
    assert_eq!(
        value(
            "mooncake_client_blocks_total",
            &[("op", "put"), ("result", "stored")]
        ),
        2.0
    );
    assert_eq!(
        value(
            "mooncake_client_blocks_total",
            &[("op", "put"), ("result", "exists")]
        ),
        1.0
    );
    assert_eq!(
        value(
            "mooncake_client_blocks_total",
            &[("op", "get"), ("result", "hit")]
        ),
        1.0
    );
    assert_eq!(
        value(
            "mooncake_client_blocks_total",
            &[("op", "get"), ("result", "miss")]
        ),
        1.0
    );
    assert_eq!(
        value("mooncake_client_bytes_total", &[("direction", "read")]),
        3000.0
    );
    assert_eq!(
        value("mooncake_client_bytes_total", &[("direction", "written")]),
        6000.0
    );
    assert_eq!(
        value("mooncake_client_request_duration_seconds", &[("op", "put")]),
        2.0
    );
    assert_eq!(
        value(
            "mooncake_client_request_duration_seconds",
            &[("op", "match_prefix")]
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_put_through_the_client_is_evicted_from_its_tail() {
    let cluster = TestCluster::start_lru(1 << 20).await;
    let client = cluster.client();
    let pool = cluster.daemons[0].handle.pool.clone();
    // Five blocks of 256 KiB: one more than a 1 MiB pool holds.
    let value = |i: u64| block_bytes(i, 256 << 10);
    let (a, b) = ([hash(301), hash(302), hash(303)], [hash(304), hash(305)]);
    let chain: Vec<Vec<u8>> = (301..304).map(value).collect();
    let blocks: Vec<(BlockHash, &[u8])> = a.iter().zip(&chain).map(|(h, v)| (*h, &v[..])).collect();
    let out = client
        .put_chain(&ns("t/chain"), None, &blocks)
        .await
        .unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    // Two unrelated blocks fill the pool past its capacity: one block
    // must go. Plain LRU would take the chain's head (the coldest);
    // prefix-aware eviction takes its tail.
    for (h, i) in b.iter().zip(304..) {
        let out = client
            .put(&ns("t/chain"), &[(*h, &value(i))])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored]);
    }
    let held = |h: &BlockHash| pool.contains(&BlockKey::new(ns("t/chain"), *h));
    assert!(
        held(&a[0]) && held(&a[1]),
        "the chain's head and middle stay"
    );
    assert!(!held(&a[2]), "the chain's tail was evicted");
    assert!(b.iter().all(held));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_put_again_after_its_eviction_goes_back_to_the_daemon_that_evicted_it() {
    // Three daemons of 1 MiB (four blocks of 256 KiB each), given 36
    // blocks: every pool is full and has evicted most of what it took.
    // A block stored again goes back where it was (its pool remembers the
    // key, and under 2Q keeps it as a block that came back), though new
    // blocks spread over all three.
    let cfg = mooncake_tests::daemon_config(1 << 20);
    let daemons = vec![cfg.clone(), cfg.clone(), cfg];
    let cluster = TestCluster::start_with(mooncake_tests::fast_meta(), daemons).await;
    let client = cluster.client();
    let ns = ns("t/back");
    let value = |i: u64| block_bytes(i, 256 << 10);
    let key = |i: u64| BlockKey::new(ns.clone(), hash(i));
    let holder = |i: u64| {
        let held = |d: &mooncake_tests::TestDaemon| d.handle.pool.contains(&key(i));
        cluster.daemons.iter().position(held)
    };
    let mut home = Vec::new();
    for i in 0..36 {
        let out = client.put(&ns, &[(hash(i), &value(i))]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
        home.push(holder(i).expect("just stored"));
    }
    for d in 0..3 {
        assert!(
            home.iter().filter(|h| **h == d).count() >= 6,
            "spread: {home:?}"
        );
    }
    let evicted: Vec<u64> = (0..36).filter(|i| holder(*i).is_none()).collect();
    assert!(evicted.len() >= 20, "{evicted:?}");
    // The meta service has heard of the evictions and of full pools.
    let hashes: Vec<BlockHash> = evicted.iter().map(|i| hash(*i)).collect();
    let known = mooncake_tests::eventually(std::time::Duration::from_secs(5), || async {
        let gone = client.exists(&ns, &hashes).await.unwrap();
        let stats = client.cluster_stats().await.unwrap();
        let full = stats.daemons.iter().all(|d| d.used * 10 >= d.capacity * 9);
        gone.iter().all(|e| !e) && full
    })
    .await;
    assert!(known, "evictions and full pools reported");
    // Those one daemon evicted, stored again one after the other: spread
    // in turn, two in three would land elsewhere.
    let from_one: Vec<u64> = evicted
        .into_iter()
        .filter(|i| home[*i as usize] == 1)
        .collect();
    assert!(from_one.len() >= 6, "{from_one:?}");
    for i in from_one {
        let out = client.put(&ns, &[(hash(i), &value(i))]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i} again");
        assert_eq!(
            holder(i),
            Some(home[i as usize]),
            "block {i} back where it was"
        );
        let got = client.get(&key(i)).await.unwrap().unwrap();
        assert_eq!(got, value(i));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_put_on_another_daemon_than_its_branch_point_is_judged_by_the_meta_service() {
    // Two daemons under 2Q. A conversation's first turn (block 1) lands on
    // one; its next turn (block 2, after a reader matched block 1) on the
    // other, which does not hold block 1 and takes the meta service's word
    // that the branch continues: into main, not probation.
    let cfg = mooncake_tests::daemon_config(1 << 20);
    let cluster =
        TestCluster::start_with(mooncake_tests::fast_meta(), vec![cfg.clone(), cfg]).await;
    let client = cluster.client();
    let ns = ns("t/branch");
    let value = block_bytes(1, 64 << 10);
    let key = |i: u64| BlockKey::new(ns.clone(), hash(i));
    let holder = |i: u64| {
        let held = |d: &mooncake_tests::TestDaemon| d.handle.pool.contains(&key(i));
        cluster.daemons.iter().position(held).expect("stored")
    };
    let admitted = || {
        let events = |d: &mooncake_tests::TestDaemon| d.handle.pool.eviction_events();
        cluster
            .daemons
            .iter()
            .map(|d| events(d).branch_admitted)
            .collect::<Vec<_>>()
    };
    let stored = vec![PutOutcome::Stored];
    let put = |parent: Option<u64>, i: u64| {
        let block = [(hash(i), value.as_slice())];
        let client = &client;
        let ns = &ns;
        async move {
            client
                .put_chain(ns, parent.map(hash), &block)
                .await
                .unwrap()
        }
    };
    assert_eq!(put(None, 1).await, stored);
    let matched = client.match_prefix(&ns, &[hash(1), hash(2)]).await.unwrap();
    assert_eq!(matched.matched, 1);
    // Blocks go to the least loaded daemon: block 2 to the one without
    // block 1.
    assert_eq!(put(Some(1), 2).await, stored);
    let (first, next) = (holder(1), holder(2));
    assert_ne!(first, next, "the branch landed beside its branch point");
    let mut want = [0, 0];
    want[next] = 1;
    assert_eq!(
        admitted(),
        want,
        "the branch entered main on the other daemon"
    );
    assert_eq!(client.get(&key(2)).await.unwrap().unwrap(), value);
    // A block after one no reader matched is no branch: judged by nobody.
    assert_eq!(put(None, 5).await, stored);
    assert_eq!(put(Some(5), 6).await, stored);
    assert_eq!(admitted(), want);
}
