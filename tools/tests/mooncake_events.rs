//! Store events in Mooncake's format (`events_format = "mooncake"`), as
//! Mooncake's Conductor and Dynamo's shared-cache router read them: a real
//! ZeroMQ subscriber decoding the event maps from `mooncake-store`
//! processes, through tagged and plain puts, removals, a daemon that
//! stops while holding some blocks' only copies, and the kill of the
//! leading meta replica.

mod common;
use common::cluster::Cluster;
use common::events::listed;
use common::mooncake_events::Subscriber;
use common::up::up;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use mooncake_client::{Client, ClientConfig, PutOptions, PutOutcome, Value};
use mooncake_meta::events::mooncake::EventType;
use mooncake_proto::message::EngineTag;
use mooncake_proto::{BlockHash, ErrorCode, Namespace};

const TENANT: &str = "t/mooncake";

const FORMAT: &str = "events_format = \"mooncake\"\nevents_backend_id = \"pool-a\"\nevents_model_name = \"fallback-model\"\n";

fn ns() -> Namespace {
    Namespace::new(TENANT).unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

fn client(meta: &str) -> Client {
    Client::new(ClientConfig::new(meta.to_string()).with_timeout(Duration::from_secs(5)))
}

/// The 64 hex digits vLLM's connector writes for block `i`.
fn connector_hash(i: u64) -> String {
    format!("{:048x}{:016x}", 0xabcdefu64, 0x1000 + i)
}

/// vLLM's Mooncake connector key of block `i` at tensor-parallel rank 1.
fn connector_key(i: u64) -> String {
    format!(
        "Qwen/Qwen3-8B@tp_rank:1@pcp0@dcp0@pp_rank:0@{}",
        connector_hash(i)
    )
}

/// The object keys the index holds in the test's namespace: untagged
/// blocks go by their store hash in hex.
async fn stored(client: &Client) -> BTreeSet<String> {
    let held = listed(client, &ns()).await;
    held.iter().map(BlockHash::to_hex).collect()
}

/// Follows `sub` until its objects are what the store holds.
async fn converge(sub: &mut Subscriber, client: &Client, within: Duration) -> BTreeSet<String> {
    let objects = |p: &common::mooncake_events::Picture| p.objects(TENANT);
    common::events::converge(sub, within, async || stored(client).await, objects).await
}

async fn put_plain(client: &Client, range: std::ops::Range<u64>, replicas: u8) {
    let value = vec![3u8; 8192];
    let blocks: Vec<(BlockHash, &[u8])> = range.map(|i| (hash(i), &value[..])).collect();
    let out = client
        .put_with(&ns(), &blocks, PutOptions::copies(replicas))
        .await
        .unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
}

/// Puts blocks `range` under their connector keys (the hash of the key's
/// text, as the Python SDK stores a `str` key), one chain, each tagged
/// with its key and 16 tokens.
async fn put_keyed(client: &Client, range: std::ops::Range<u64>) {
    let value = vec![9u8; 8192];
    let blocks: Vec<(BlockHash, Value<'_>)> = range
        .clone()
        .map(|i| {
            let key = connector_key(i);
            (BlockHash::from_opaque(key.as_bytes()), Value::One(&value))
        })
        .collect();
    let tags: Vec<_> = range
        .map(|i| {
            let tokens = (16 * i as u32..16 * i as u32 + 16).collect();
            let tag = EngineTag::new(None, tokens).unwrap();
            Some(Arc::new(tag.with_key(&connector_key(i)).unwrap()))
        })
        .collect();
    let out = client
        .put_tagged(&ns(), &blocks, Some(None), &tags, PutOptions::default())
        .await
        .unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_are_published_under_their_keys_with_the_fields_of_mooncakes_format() {
    let store = up("64MiB", Some(&format!("[meta]\n{FORMAT}"))).await;
    let client = client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    put_keyed(&client, 0..4).await;
    put_plain(&client, 100..103, 1).await;
    let keys: BTreeSet<String> = (0..4)
        .map(connector_key)
        .chain((100..103).map(|i| hash(i).to_hex()))
        .collect();
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.objects(TENANT) == keys)
            .await,
        "every block stored under its key: {:?}",
        sub.picture.objects(TENANT)
    );
    let first = sub.picture.log.iter().find(|r| r.tenant_id == TENANT);
    assert_eq!(
        first.map(|r| r.event_type),
        Some(EventType::Cleared),
        "a tenant is cleared before its first block"
    );

    let key = connector_key(2);
    let r = sub.picture.stored(&key).unwrap();
    assert_eq!(
        r.model_name.as_deref(),
        Some("Qwen/Qwen3-8B"),
        "the key's model"
    );
    assert_eq!(
        r.connector_block_hash.as_deref(),
        Some(&connector_hash(2)[..])
    );
    assert_eq!(r.seq_hash, Some(0x1002), "the hash's last 8 bytes");
    assert_eq!((r.tp_rank, r.pp_rank), (Some(1), Some(0)));
    assert_eq!(r.block_size, Some(16), "the writer's tokens");
    assert_eq!(r.token_ids, (32..48).collect::<Vec<u32>>());
    assert_eq!(r.parent_hash, None, "a keyed block's parent is unknown");
    assert_eq!(
        (r.medium.as_deref(), &r.backend_id[..]),
        (Some("cpu"), "pool-a")
    );

    let plain = hash(101);
    let r = sub.picture.stored(&plain.to_hex()).unwrap();
    assert_eq!(
        r.model_name.as_deref(),
        Some("fallback-model"),
        "the config's"
    );
    let tail = u64::from_be_bytes(plain.0[24..].try_into().unwrap());
    assert_eq!(r.seq_hash, Some(tail), "the store hash's last 8 bytes");
    assert_eq!(
        (r.block_size, r.connector_block_hash.as_ref()),
        (None, None)
    );

    // Removed, a block leaves under the key it was stored under.
    let gone = [BlockHash::from_opaque(key.as_bytes()), plain];
    assert_eq!(
        client.remove(&ns(), &gone).await.unwrap(),
        [ErrorCode::Ok, ErrorCode::Ok]
    );
    let left: BTreeSet<String> = keys
        .iter()
        .filter(|k| **k != key && **k != plain.to_hex())
        .cloned()
        .collect();
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.objects(TENANT) == left)
            .await,
        "the removals name the objects: {:?}",
        sub.picture.objects(TENANT)
    );
    let removed: Vec<_> = sub
        .picture
        .log
        .iter()
        .filter(|r| r.event_type == EventType::Removed)
        .map(|r| (r.object_key.clone().unwrap(), r.medium.clone().unwrap()))
        .collect();
    assert_eq!(
        removed,
        [
            (key, "cpu".to_string()),
            (plain.to_hex(), "cpu".to_string())
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_is_available_until_its_last_copy_goes() {
    // Two hosts: a block's copies go on distinct ones.
    let mut cluster = Cluster::start_events_with(1, 0, "64MiB", FORMAT).await;
    for node in ["gpu-0", "gpu-1"] {
        let addr = format!("127.0.0.1:{}", common::free_port());
        cluster.spawn_daemon_on(&addr, node);
    }
    cluster.wait_healthy(2, Duration::from_secs(15)).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let (events, replay) = cluster.events.as_ref().unwrap()[0].clone();
    let mut sub = Subscriber::connect(&events, &replay, 0).await;
    // Blocks 0..20 on both daemons, 100..120 on one each.
    put_plain(&client, 0..20, 2).await;
    put_plain(&client, 100..120, 1).await;
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert_eq!(held.len(), 40);
    let stored_events = |p: &common::mooncake_events::Picture| {
        p.log
            .iter()
            .filter(|r| r.event_type == EventType::Stored)
            .count()
    };
    assert_eq!(
        stored_events(&sub.picture),
        40,
        "one event per block, not per copy"
    );

    // Stop the daemon that holds block 100, with SIGTERM: it deregisters,
    // and its copies leave the index at once.
    let singles: Vec<BlockHash> = (100..120).map(hash).collect();
    let found = client.lookup(&ns(), &singles).await.unwrap();
    let owner = |i: usize| {
        found.items[i]
            .as_ref()
            .unwrap()
            .daemons
            .iter()
            .next()
            .unwrap()
    };
    let victim = owner(0);
    let lost: BTreeSet<String> = (0..singles.len())
        .filter(|i| owner(*i) == victim)
        .map(|i| singles[i].to_hex())
        .collect();
    let stats = client.cluster_stats().await.unwrap();
    let addr = &stats.daemons.iter().find(|d| d.id == victim).unwrap().addr;
    let at = cluster.daemons.iter().position(|(a, _)| a == addr).unwrap();
    cluster.daemons[at].1.signal("-TERM");

    let expected: BTreeSet<String> = held.difference(&lost).cloned().collect();
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.objects(TENANT) == expected)
            .await,
        "the stopped daemon's only copies removed, and nothing else: {} held in the picture",
        sub.picture.objects(TENANT).len()
    );
    let removed: BTreeSet<String> = sub
        .picture
        .log
        .iter()
        .filter(|r| r.event_type == EventType::Removed)
        .filter_map(|r| r.object_key.clone())
        .collect();
    assert_eq!(removed, lost, "a block with a copy left stays available");
    assert_eq!(stored(&client).await, expected, "and the index agrees");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_leader_is_killed_a_subscriber_ends_with_exactly_the_stored_objects() {
    let mut cluster = Cluster::start_events_with(2, 1, "64MiB", FORMAT).await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let leader = cluster.leader_index().await;
    let (events, replay) = cluster.events.as_ref().unwrap()[leader].clone();
    let mut sub = Subscriber::connect(&events, &replay, 0).await;
    put_keyed(&client, 0..10).await;
    put_plain(&client, 100..110, 1).await;
    let mut expected: BTreeSet<String> = (0..10).map(connector_key).collect();
    expected.extend((100..110).map(|i| hash(i).to_hex()));
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.objects(TENANT) == expected)
            .await,
        "the first term's blocks"
    );
    let first_term_ids = sub.picture.log.last().unwrap().event_id;

    cluster.metas[leader].1.kill9();
    cluster.wait_healthy(1, Duration::from_secs(30)).await;
    let new_leader = cluster.leader_index().await;
    assert_ne!(new_leader, leader);
    let (events, replay) = cluster.events.as_ref().unwrap()[new_leader].clone();
    sub.switch(&events, &replay).await;
    put_plain(&client, 110..115, 1).await;
    expected.extend((110..115).map(|i| hash(i).to_hex()));
    assert!(
        sub.follow_until(Duration::from_secs(30), |p| p.objects(TENANT) == expected)
            .await,
        "the new leader's inventory, keys kept: {:?}",
        sub.picture.objects(TENANT)
    );
    assert_eq!(
        sub.picture.clears.get(TENANT),
        Some(&2),
        "the new term cleared the tenant before its inventory"
    );
    let r = sub.picture.stored(&connector_key(3)).unwrap();
    assert!(
        r.event_id > first_term_ids,
        "the new term's ids are above the old one's"
    );
    assert_eq!(
        (r.block_size, r.tp_rank),
        (Some(16), Some(1)),
        "the inventory kept the writer's tag"
    );
}
