//! Faults: corrupted pool bytes, a full pool, vanished writers, dead and
//! silent daemons. A miss or a clean error every time, never wrong bytes,
//! never a wait past the deadline.

use std::time::{Duration, Instant};

use mooncake_client::{ClientError, ErrorSource, GetOutcome, PutOutcome};
use mooncake_net::Connection;
use mooncake_proto::message::{Body, PutHead, PutStartRequest, PutStartResponse, Slot};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Header, Namespace, Opcode};
use mooncake_tests::{block_bytes, eventually, fast_meta, TestCluster};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

fn ns() -> Namespace {
    Namespace::new("t/faults").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

#[tokio::test]
async fn corrupted_pool_bytes_are_a_miss_and_the_block_is_dropped() {
    let cluster = TestCluster::start(16 << 20).await;
    let client = cluster.client();
    let value = block_bytes(1, 64 << 10);
    client.put(&ns(), &[(hash(1), &value)]).await.unwrap();
    let key = BlockKey::new(ns(), hash(1));
    let pool = &cluster.daemons[0].handle.pool;
    assert!(pool.flip_byte_for_test(&key, 12_345));

    let mut buf = vec![0u8; value.len()];
    let got = client
        .get_into(&ns(), &[hash(1)], &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(
        got,
        vec![GetOutcome::Miss],
        "corrupt bytes are never returned"
    );
    assert_eq!(client.corrupt_reads(), 1);
    // The client reports the mismatch; the daemon checks its copy, finds it
    // corrupt, and drops it.
    assert!(
        eventually(Duration::from_secs(3), || async {
            pool.corrupt_blocks() == 1
        })
        .await
    );
    assert!(!pool.contains(&key), "the daemon dropped the block");
    // The daemon reports the drop; the index forgets the block.
    assert!(
        eventually(Duration::from_secs(3), || async {
            !client.exists(&ns(), &[hash(1)]).await.unwrap()[0]
        })
        .await
    );
}

#[tokio::test]
async fn a_daemon_that_verifies_on_read_never_sends_corrupt_bytes() {
    let mut cfg = mooncake_tests::daemon_config(16 << 20);
    cfg.verify_on_read = true;
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    let client = cluster.client();
    let value = block_bytes(2, 32 << 10);
    client.put(&ns(), &[(hash(2), &value)]).await.unwrap();
    let key = BlockKey::new(ns(), hash(2));
    let pool = &cluster.daemons[0].handle.pool;
    assert!(pool.flip_byte_for_test(&key, 7));
    assert_eq!(client.get(&key).await.unwrap(), None);
    assert_eq!(
        pool.corrupt_blocks(),
        1,
        "caught by the daemon before sending"
    );
    assert!(!pool.contains(&key));
}

#[tokio::test]
async fn a_stale_location_hint_costs_a_lookup_not_a_wrong_block() {
    let cluster = TestCluster::start(16 << 20).await;
    let (reader, writer) = (cluster.client(), cluster.client());
    let key = BlockKey::new(ns(), hash(4));
    let old = block_bytes(40, 5000);
    let new = block_bytes(41, 7000);
    writer.put_one(&key, &old).await.unwrap();
    assert_eq!(reader.get(&key).await.unwrap().unwrap(), old);
    // Replaced behind the reader's back: its cached location now describes
    // bytes that no longer exist.
    writer.remove(&ns(), &[hash(4)]).await.unwrap();
    writer.put_one(&key, &new).await.unwrap();
    let mut buf = vec![0u8; 8000];
    let got = reader
        .get_into(&ns(), &[hash(4)], &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(new.len())]);
    assert_eq!(&buf[..new.len()], &new[..]);
    assert_eq!(reader.corrupt_reads(), 0, "staleness is not corruption");
    // Replaced again by a larger block: the whole-block get sizes its
    // buffer from the stale hint, notices, and asks the index again.
    let larger = block_bytes(42, 20_000);
    writer.remove(&ns(), &[hash(4)]).await.unwrap();
    writer.put_one(&key, &larger).await.unwrap();
    assert_eq!(reader.get(&key).await.unwrap().unwrap(), larger);
}

#[tokio::test]
async fn a_full_pool_evicts_the_coldest_blocks_but_never_pinned_ones() {
    let cluster = TestCluster::start_lru(8 << 20).await;
    let client = cluster.client();
    let value = vec![5u8; 1 << 20];
    client.put(&ns(), &[(hash(0), &value)]).await.unwrap();
    assert_eq!(
        client.pin(&ns(), &[hash(0)], true).await.unwrap(),
        vec![ErrorCode::Ok]
    );
    for i in 1..30 {
        let out = client.put(&ns(), &[(hash(i), &value)]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
    }
    let pool = &cluster.daemons[0].handle.pool;
    let stats = pool.stats();
    assert!(stats.used <= stats.capacity);
    assert!(stats.evictions >= 20);
    assert!(
        pool.contains(&BlockKey::new(ns(), hash(0))),
        "pinned block survived"
    );
    assert!(
        pool.contains(&BlockKey::new(ns(), hash(29))),
        "newest block present"
    );
    assert!(
        !pool.contains(&BlockKey::new(ns(), hash(1))),
        "coldest block evicted"
    );
    // Evictions reach the index: the evicted keys stop being reported.
    assert!(
        eventually(Duration::from_secs(3), || async {
            let e = client
                .exists(&ns(), &[hash(0), hash(1), hash(29)])
                .await
                .unwrap();
            e == vec![true, false, true]
        })
        .await
    );
    let key0 = BlockKey::new(ns(), hash(0));
    assert_eq!(client.get(&key0).await.unwrap().unwrap(), value);
    // Unpinned, it ages out like the rest.
    client.pin(&ns(), &[hash(0)], false).await.unwrap();
    for i in 100..120 {
        client.put(&ns(), &[(hash(i), &value)]).await.unwrap();
    }
    assert!(!pool.contains(&key0));
}

#[tokio::test]
async fn a_writer_that_vanishes_mid_value_leaves_nothing_behind() {
    let cluster = TestCluster::start(16 << 20).await;
    let pool = cluster.daemons[0].handle.pool.clone();
    let head = PutHead {
        key: BlockKey::new(ns(), hash(7)),
        checksum: 0,
        parent: None,
        continues: false,
        tag: None,
    }
    .to_bytes();
    let value_len = 1 << 20;
    let mut s = TcpStream::connect(cluster.daemon_addr(0)).await.unwrap();
    s.write_all(&Header::request(Opcode::Put, 1, (head.len() + value_len) as u32).encode())
        .await
        .unwrap();
    s.write_all(&head).await.unwrap();
    s.write_all(&vec![1u8; 100 << 10]).await.unwrap();
    assert!(eventually(Duration::from_secs(2), || async { pool.stats().used > 0 }).await);
    drop(s);
    assert!(
        eventually(Duration::from_secs(3), || async { pool.stats().used == 0 }).await,
        "space of the half-written block came back"
    );
    assert!(!pool.contains(&BlockKey::new(ns(), hash(7))));
}

#[tokio::test]
async fn an_abandoned_reservation_expires_and_frees_the_key() {
    let cluster = TestCluster::start(16 << 20).await;
    let client = cluster.client();
    // Phase one only, as a client that crashed right after it would.
    let mut conn = Connection::connect(
        &cluster.meta_addr,
        ErrorSource::Meta,
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    let start: PutStartResponse = conn
        .call(
            Opcode::PutStart,
            &PutStartRequest {
                namespace: ns(),
                node: String::new(),
                replicas: 0,
                items: vec![mooncake_proto::message::ToPlace::unchained(hash(9), 4096)],
            },
            "put_start",
        )
        .await
        .unwrap();
    assert!(matches!(start.slots[0], Slot::Place { .. }));
    drop(conn);
    assert_eq!(client.cluster_stats().await.unwrap().pending, 1);
    assert!(
        !client.exists(&ns(), &[hash(9)]).await.unwrap()[0],
        "pending is invisible"
    );
    let v = vec![3u8; 4096];
    assert_eq!(
        client.put(&ns(), &[(hash(9), &v)]).await.unwrap(),
        vec![PutOutcome::AlreadyExists]
    );
    // put_timeout is 500 ms in tests.
    assert!(
        eventually(Duration::from_secs(3), || async {
            client.cluster_stats().await.unwrap().pending == 0
        })
        .await
    );
    assert_eq!(
        client.put(&ns(), &[(hash(9), &v)]).await.unwrap(),
        vec![PutOutcome::Stored]
    );
}

#[tokio::test]
async fn a_dead_daemon_gives_errors_within_the_deadline_and_leaves_the_index() {
    let cluster = TestCluster::start(16 << 20).await;
    let timeout = Duration::from_secs(2);
    let client = cluster.client_with_timeout(timeout);
    let v = block_bytes(5, 10_000);
    client.put(&ns(), &[(hash(5), &v)]).await.unwrap();
    cluster.daemons[0].stop.cancel();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let started = Instant::now();
    let mut buf = vec![0u8; v.len()];
    let got = client
        .get_into(&ns(), &[hash(5)], &mut [&mut buf[..]])
        .await;
    assert!(started.elapsed() < timeout + Duration::from_millis(500));
    match got {
        Ok(out) => assert!(
            matches!(out[0], GetOutcome::Failed(_) | GetOutcome::Miss),
            "{out:?}"
        ),
        Err(err) => assert!(err.is_retryable(), "{err}"),
    }
    // Silent past its ttl (800 ms in tests): dead, and its blocks are gone.
    assert!(
        eventually(Duration::from_secs(3), || async {
            let st = client.cluster_stats().await.unwrap();
            st.daemons.iter().all(|d| !d.alive) && st.blocks == 0
        })
        .await
    );
    let out = client.put(&ns(), &[(hash(6), &v)]).await.unwrap();
    assert_eq!(
        out,
        vec![PutOutcome::Failed(ErrorCode::Unavailable)],
        "no daemon to place on"
    );
}

#[tokio::test]
async fn a_daemon_that_accepts_but_never_answers_costs_one_deadline() {
    let cluster = TestCluster::start_with(fast_meta(), vec![]).await;
    // A black hole: accepts connections, reads nothing, answers nothing.
    let hole = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            held.push(s);
        }
    });
    cluster.register_fake_daemon(hole_addr, vec![]).await;
    let timeout = Duration::from_millis(400);
    let client = cluster.client_with_timeout(timeout);
    let started = Instant::now();
    let result = client.put(&ns(), &[(hash(1), &[1u8; 300_000][..])]).await;
    let took = started.elapsed();
    assert!(
        matches!(result, Err(ClientError::Timeout { .. })),
        "{result:?}"
    );
    assert!(took < timeout + Duration::from_millis(300), "took {took:?}");
}

/// Resolves the meta service to whatever address the test sets.
struct SetLeader(parking_lot::Mutex<String>);

impl mooncake_client::MetaResolver for SetLeader {
    fn resolve(&self) -> futures::future::BoxFuture<'_, Result<String, String>> {
        Box::pin(async move { Ok(self.0.lock().clone()) })
    }
}

#[tokio::test]
async fn a_client_refuses_a_leader_older_than_one_it_has_seen() {
    use mooncake_coord::{EmbeddedCoordinator, Leadership};
    use mooncake_meta::MetaMetrics;
    use std::sync::Arc;
    use tokio_util::sync::CancellationToken;

    let coordinator = Arc::new(EmbeddedCoordinator::new());
    let start = |revision: u64, stop: CancellationToken| {
        let coordinator = coordinator.clone();
        async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let leadership = Leadership {
                revision,
                lost: CancellationToken::new(),
            };
            let metrics = MetaMetrics::new(&prometheus::Registry::new()).unwrap();
            mooncake_meta::serve(
                fast_meta(),
                listener,
                leadership,
                coordinator,
                metrics,
                stop,
            )
            .unwrap()
        }
    };
    let (new_stop, old_stop) = (CancellationToken::new(), CancellationToken::new());
    let new = start(5, new_stop.clone()).await;
    let old = start(3, old_stop.clone()).await;

    let resolver = Arc::new(SetLeader(parking_lot::Mutex::new(new.addr.to_string())));
    let cfg = mooncake_client::ClientConfig::new("")
        .with_timeout(Duration::from_millis(600))
        .with_resolver(resolver.clone())
        .await
        .unwrap();
    let client = mooncake_client::Client::new(cfg);
    assert_eq!(client.ping().await.unwrap(), 5);

    // The leader at revision 5 goes away; the only one left is older.
    *resolver.0.lock() = old.addr.to_string();
    new_stop.cancel();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        client.ping().await.is_err(),
        "a client that saw revision 5 must refuse revision 3"
    );
    // A client that never saw a newer leader talks to it happily.
    let fresh =
        mooncake_client::Client::new(mooncake_client::ClientConfig::new(old.addr.to_string()));
    assert_eq!(fresh.ping().await.unwrap(), 3);
    old_stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_daemon_leaves_at_once_and_puts_go_to_the_others() {
    // A daemon ttl far past this test: only the daemon's leave can take it
    // out of the index in time.
    let mut meta = fast_meta();
    meta.daemon_ttl = mooncake_proto::units::HumanDuration(Duration::from_secs(600));
    let cluster = TestCluster::start_with(
        meta,
        vec![
            mooncake_tests::daemon_config(16 << 20),
            mooncake_tests::daemon_config(16 << 20),
        ],
    )
    .await;
    let client = cluster.client();
    let v = block_bytes(7, 4096);
    let first: Vec<BlockHash> = (100..140).map(hash).collect();
    let blocks: Vec<(BlockHash, &[u8])> = first.iter().map(|h| (*h, &v[..])).collect();
    client.put(&ns(), &blocks).await.unwrap();
    let mut cluster = cluster;
    let leaving = cluster.daemons.pop().unwrap();
    let staying = cluster.daemon_addr(0);
    let held_by_leaving: Vec<BlockHash> = first
        .iter()
        .copied()
        .filter(|h| leaving.handle.pool.contains(&BlockKey::new(ns(), *h)))
        .collect();
    assert!(!held_by_leaving.is_empty(), "puts spread over both daemons");
    leaving.stop.cancel();
    leaving.handle.join().await;

    let st = client.cluster_stats().await.unwrap();
    assert_eq!(st.daemons.len(), 1, "{:?}", st.daemons);
    assert_eq!(st.daemons[0].addr, staying);
    let exists = client.exists(&ns(), &held_by_leaving).await.unwrap();
    assert!(exists.iter().all(|e| !e), "its blocks left with it");
    // Every new put lands on the daemon that stays.
    let next: Vec<BlockHash> = (200..240).map(hash).collect();
    let blocks: Vec<(BlockHash, &[u8])> = next.iter().map(|h| (*h, &v[..])).collect();
    let out = client.put(&ns(), &blocks).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
}

/// A daemon that stores nothing: it answers every request `Ok` with an
/// empty body, except removals, each answered only once `release` lets
/// one go.
async fn daemon_holding_removals(release: std::sync::Arc<tokio::sync::Semaphore>) -> String {
    use tokio::io::AsyncReadExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let release = release.clone();
            tokio::spawn(async move {
                let mut raw = [0u8; mooncake_proto::HEADER_LEN];
                while s.read_exact(&mut raw).await.is_ok() {
                    let Ok(Some(h)) = Header::parse(&raw) else {
                        return;
                    };
                    let mut body = vec![0u8; h.body_len as usize];
                    if s.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    if h.opcode == Opcode::Remove {
                        release.acquire().await.unwrap().forget();
                    }
                    let answer = Header::response(h.opcode, h.request_id, 0, 0);
                    if s.write_all(&answer.encode()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_not_put_again_until_its_forced_removal_reached_its_daemons() {
    // Put again while its removal is on its way, a key could be placed on
    // the daemon still holding the same bytes ("already stored"), which
    // then drops them: the index would name a copy that is gone.
    let cluster = TestCluster::start_with(fast_meta(), vec![]).await;
    let release = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let addr = daemon_holding_removals(release.clone()).await;
    cluster.register_fake_daemon(addr, vec![]).await;
    let client = cluster.client();
    let v = [7u8; 4096];
    let (ns, blocks) = (ns(), [(hash(1), &v[..])]);
    let put = || client.put(&ns, &blocks);
    assert_eq!(put().await.unwrap(), vec![PutOutcome::Stored]);
    let remover = cluster.client();
    let removal = tokio::spawn(async move { remover.remove(&self::ns(), &[hash(1)]).await });
    // The removal is out of the index once the key is no longer found.
    let out = eventually(Duration::from_secs(10), || async {
        !client.exists(&ns, &[hash(1)]).await.unwrap()[0]
    })
    .await;
    assert!(out, "the removal never began");
    assert_eq!(
        put().await.unwrap(),
        vec![PutOutcome::Failed(ErrorCode::Busy)],
        "put again while its daemon was not told yet"
    );
    release.add_permits(1);
    assert_eq!(removal.await.unwrap().unwrap(), vec![ErrorCode::Ok]);
    assert_eq!(put().await.unwrap(), vec![PutOutcome::Stored]);
}
