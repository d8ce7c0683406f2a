//! Store events, as a KV-aware router consumes them: a real ZeroMQ
//! subscriber decoding vLLM's `KVEventBatch` from `mooncake-store`
//! processes, through puts, evictions, removals, an overflowing queue and
//! the kill of the leading meta replica.

mod common;
use common::cluster::{scratch_dir, Cluster};
use common::events::{listed, raw, Subscriber};
use common::up::{metric, up};

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig, PutOptions, PutOutcome, Value};
use mooncake_proto::message::{EngineHash, EngineTag, Tier};
use mooncake_proto::{BlockHash, ErrorCode, Namespace};

fn ns() -> Namespace {
    Namespace::new("t/events").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

fn client(meta: &str) -> Client {
    Client::new(ClientConfig::new(meta.to_string()).with_timeout(Duration::from_secs(5)))
}

/// The hashes the store's index holds in the test's namespace.
async fn stored(client: &Client) -> BTreeSet<Vec<u8>> {
    let held = listed(client, &ns()).await;
    held.iter().map(|h| h.0.to_vec()).collect()
}

/// Follows `sub` until its picture is what the store holds.
async fn converge(sub: &mut Subscriber, client: &Client, within: Duration) -> BTreeSet<Vec<u8>> {
    common::events::converge(sub, within, async || stored(client).await, |p| p.all()).await
}

/// Puts `range` as chains of `chain` blocks (each chain's first block
/// names no parent), a chain a call.
async fn put_chains(client: &Client, range: std::ops::Range<u64>, len: usize, chain: usize) {
    let value = vec![7u8; len];
    let hashes: Vec<BlockHash> = range.map(hash).collect();
    for chunk in hashes.chunks(chain) {
        let blocks: Vec<(BlockHash, &[u8])> = chunk.iter().map(|h| (*h, &value[..])).collect();
        let out = client.put_chain(&ns(), None, &blocks).await.unwrap();
        assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    }
}

/// The parent block `i` of `put_chains(.., chain)` names.
fn chain_parent(i: u64, chain: u64) -> Option<Vec<u8>> {
    (i % chain != 0).then(|| hash(i - 1).0.to_vec())
}

/// The tokens `put_tagged_chains` tags block `i` with.
fn tokens(i: u64) -> Vec<u32> {
    (4 * i as u32..4 * i as u32 + 4).collect()
}

/// Puts blocks 0 to 39 of `len` bytes as 4 chains of 10, block `i` tagged
/// with the engine name `first_name + i` and `tokens(i)`.
async fn put_tagged_chains(client: &Client, len: usize, first_name: u64) {
    let value = vec![9u8; len];
    for chain in 0..4u64 {
        let ids: Vec<u64> = (chain * 10..chain * 10 + 10).collect();
        let blocks: Vec<(BlockHash, Value<'_>)> =
            ids.iter().map(|i| (hash(*i), Value::One(&value))).collect();
        let tags: Vec<_> = ids
            .iter()
            .map(|i| {
                let name = EngineHash::Int(first_name + i);
                Some(Arc::new(EngineTag::new(Some(name), tokens(*i)).unwrap()))
            })
            .collect();
        let out = client
            .put_tagged(&ns(), &blocks, Some(None), &tags, PutOptions::default())
            .await
            .unwrap();
        assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    }
}

async fn put_range(client: &Client, range: std::ops::Range<u64>, len: usize) {
    let value = vec![7u8; len];
    let hashes: Vec<BlockHash> = range.map(hash).collect();
    for chunk in hashes.chunks(8) {
        let blocks: Vec<(BlockHash, &[u8])> = chunk.iter().map(|h| (*h, &value[..])).collect();
        let out = client.put(&ns(), &blocks).await.unwrap();
        assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_sees_every_put_eviction_and_removal_in_order() {
    // LRU: under 2Q a block still being written can leave probation
    // before its put commits, and is then never visible (nor an event).
    let store = up("4MiB", Some("eviction = \"lru\"\n")).await;
    let client = client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    // 7.5 MiB of 64 KiB blocks into 4 MiB: the early ones are evicted.
    put_range(&client, 0..120, 64 << 10).await;
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert!(held.len() < 120, "some blocks were evicted");
    let victims: Vec<BlockHash> = held
        .iter()
        .take(5)
        .map(|h| BlockHash(h[..].try_into().unwrap()))
        .collect();
    let codes = client.remove(&ns(), &victims).await.unwrap();
    assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert_eq!(held.len(), sub.picture.all().len());

    let p = &sub.picture;
    // One term, opened by AllBlocksCleared, numbered without a gap.
    assert_eq!(p.clears, 1);
    assert!(
        p.seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "sequence numbers follow each other"
    );
    // Every block was stored, once, before it left; each that left, left
    // once: 120 stored, the evicted and the removed gone.
    let stored_count = p.log.iter().filter(|(_, _, s)| *s).count();
    assert_eq!(stored_count, 120);
    let removed: Vec<&Vec<u8>> = p
        .log
        .iter()
        .filter(|(_, _, s)| !s)
        .map(|(_, h, _)| h)
        .collect();
    assert_eq!(removed.len(), 120 - held.len());
    for victim in &victims {
        let at = |stored: bool| {
            p.log
                .iter()
                .position(|(_, h, s)| *s == stored && h[..] == victim.0[..])
                .expect("stored and removed")
        };
        assert!(at(true) < at(false), "stored before removed");
    }
    // Topic: prefix, host, namespace.
    let topics: BTreeSet<&String> = p.blocks.keys().collect();
    assert_eq!(topics.len(), 1, "{topics:?}");
    let topic = topics.into_iter().next().unwrap();
    assert!(
        topic.starts_with("kv@") && topic.ends_with("@t/events"),
        "{topic}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_is_published_with_its_parents_and_unrelated_blocks_without() {
    let store = up("64MiB", None).await;
    let client = client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    // A chain of 6 (0..6), extended later by 3 (6..9); 4 blocks put apart
    // in one batch (100..104).
    put_chains(&client, 0..6, 4096, 6).await;
    let value = vec![3u8; 4096];
    let tail: Vec<(BlockHash, &[u8])> = (6..9).map(|i| (hash(i), &value[..])).collect();
    let out = client.put_chain(&ns(), Some(hash(5)), &tail).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    put_range(&client, 100..104, 4096).await;
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert_eq!(held.len(), 13);
    let parent = |i: u64| sub.picture.parents.get(hash(i).0.as_slice()).cloned();
    for i in 0..9 {
        assert_eq!(parent(i), Some(chain_parent(i, 9)), "chain block {i}");
    }
    for i in 100..104 {
        assert_eq!(parent(i), Some(None), "block {i} extends no other");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_tags_name_its_blocks_their_parents_and_tokens_in_the_events() {
    let store = up("64MiB", None).await;
    let client = client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    let value = vec![5u8; 4096];
    let tag =
        |name: EngineHash, i: u64| Some(Arc::new(EngineTag::new(Some(name), tokens(i)).unwrap()));
    // A chain of 4 named by integers, then 2 more in a later put, named
    // by bytes, extending the first put's last block; then one block
    // whose tag carries only its tokens.
    let head: Vec<(BlockHash, Value<'_>)> = (0..4).map(|i| (hash(i), Value::One(&value))).collect();
    let head_tags: Vec<_> = (0..4).map(|i| tag(EngineHash::Int(1000 + i), i)).collect();
    let opts = PutOptions::default();
    let out = client
        .put_tagged(&ns(), &head, Some(None), &head_tags, opts)
        .await
        .unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    let page = |i: u64| EngineHash::Bytes(format!("page-{i}").into_bytes().into());
    let tail: Vec<(BlockHash, Value<'_>)> = (4..6).map(|i| (hash(i), Value::One(&value))).collect();
    let tail_tags: Vec<_> = (4..6).map(|i| tag(page(i), i)).collect();
    let out = client
        .put_tagged(&ns(), &tail, Some(Some(hash(3))), &tail_tags, opts)
        .await
        .unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
    let tokens_only = vec![Some(Arc::new(EngineTag::new(None, tokens(6)).unwrap()))];
    let one = [(hash(6), Value::One(&value))];
    let out = client
        .put_tagged(&ns(), &one, None, &tokens_only, opts)
        .await
        .unwrap();
    assert_eq!(out, [PutOutcome::Stored]);

    let names: Vec<Vec<u8>> = (0..4)
        .map(|i| raw(&EngineHash::Int(1000 + i)))
        .chain((4..6).map(|i| raw(&page(i))))
        .chain([hash(6).0.to_vec()])
        .collect();
    let all = names.iter().cloned().collect::<BTreeSet<_>>();
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.all() == all)
            .await,
        "the events name the blocks as their writer tagged them: {:?}",
        sub.picture.all()
    );
    let parent = |i: usize| sub.picture.parents[&names[i]].clone();
    assert_eq!(parent(0), None);
    for i in 1..6 {
        assert_eq!(
            parent(i),
            Some(names[i - 1].clone()),
            "block {i}'s parent by its engine name"
        );
    }
    for (i, name) in names.iter().enumerate() {
        assert_eq!(
            sub.picture.tokens[name],
            tokens(i as u64),
            "block {i}'s tokens"
        );
    }
    // Removed, a tagged block leaves under its engine's name.
    assert_eq!(
        client.remove(&ns(), &[hash(5)]).await.unwrap(),
        [ErrorCode::Ok]
    );
    let left: BTreeSet<Vec<u8>> = all.iter().filter(|n| **n != names[5]).cloned().collect();
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.all() == left)
            .await,
        "the removal names the engine's block: {:?}",
        sub.picture.all()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_fell_behind_recovers_through_the_replay_port() {
    let store = up("64MiB", None).await;
    let client = client(&store.meta);
    put_range(&client, 0..40, 4096).await;
    // A subscriber whose last batch is long gone (a router that restarted
    // with the number it had saved): the first live batch shows the gap.
    let mut sub = Subscriber::resume(&store.events, &store.replay, Some(0)).await;
    put_range(&client, 40..48, 4096).await;
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert_eq!(held.len(), 48);
    assert!(sub.gaps >= 1, "the gap was seen and filled");
    assert_eq!(sub.picture.clears, 1, "the replay began with the term");
    assert!(sub.picture.seqs.windows(2).all(|w| w[1] == w[0] + 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowing_queue_resynchronizes_subscribers_with_the_index() {
    // A queue of one change: a put of many blocks overflows it.
    let store = up("64MiB", Some("[meta]\nevents_queue = 1\n")).await;
    let client = client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    let value = vec![1u8; 1024];
    let hashes: Vec<BlockHash> = (0..512).map(hash).collect();
    let blocks: Vec<(BlockHash, &[u8])> = hashes.iter().map(|h| (*h, &value[..])).collect();
    let out = client.put(&ns(), &blocks).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored));
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert_eq!(held.len(), 512);
    let dropped = metric(&store.admin, "mooncake_meta_events_total{what=\"dropped\"}").await;
    let resyncs = metric(&store.admin, "mooncake_meta_events_total{what=\"resyncs\"}").await;
    eprintln!("changes dropped {dropped}, resyncs {resyncs}");
    if dropped > 0 {
        assert!(resyncs >= 1, "a dropped change is followed by a resync");
        assert!(sub.picture.clears >= 2, "the resync cleared, then restated");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_leader_is_killed_tagged_blocks_keep_their_engine_names_parents_and_tokens() {
    let mut cluster = Cluster::start_events(2, 1, "64MiB").await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let leader = cluster.leader_index().await;
    let (events, replay) = cluster.events.as_ref().unwrap()[leader].clone();
    let mut sub = Subscriber::connect(&events, &replay, 0).await;
    // Chains of 10 blocks, each named 5000 + i by its engine, 4 tokens each.
    put_tagged_chains(&client, 16 << 10, 5000).await;
    let name = |i: u64| raw(&EngineHash::Int(5000 + i));
    let all: BTreeSet<Vec<u8>> = (0..40).map(name).collect();
    assert!(
        sub.follow_until(Duration::from_secs(20), |p| p.all() == all)
            .await
    );

    cluster.metas[leader].1.kill9();
    cluster.wait_healthy(1, Duration::from_secs(30)).await;
    let new_leader = cluster.leader_index().await;
    assert_ne!(new_leader, leader);
    let (events, replay) = cluster.events.as_ref().unwrap()[new_leader].clone();
    let cleared = sub.picture.clears;
    sub.switch(&events, &replay).await;
    // The new term opens with AllBlocksCleared; the daemon's inventory
    // brings each block back under its engine's name.
    assert!(
        sub.follow_until(Duration::from_secs(30), |p| p.clears > cleared
            && p.all() == all)
            .await,
        "after the failover the events name the blocks as before: {} of 40 names, {} in all, {} clears",
        sub.picture.all().intersection(&all).count(),
        sub.picture.all().len(),
        sub.picture.clears
    );
    for i in 0..40u64 {
        let parent = (i % 10 != 0).then(|| name(i - 1));
        assert_eq!(sub.picture.parents[&name(i)], parent, "block {i}'s parent");
        assert_eq!(
            sub.picture.tokens[&name(i)],
            tokens(i),
            "block {i}'s tokens"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_leader_is_killed_a_subscriber_ends_with_exactly_the_stored_blocks() {
    // One daemon: a chain's blocks all on it (with two, placement spreads
    // a chain's blocks over both), so that its inventory's order shows.
    let mut cluster = Cluster::start_events(2, 1, "64MiB").await;
    let client = cluster.client(Duration::from_secs(5)).await;
    let leader = cluster.leader_index().await;
    let (events, replay) = cluster.events.as_ref().unwrap()[leader].clone();
    let mut sub = Subscriber::connect(&events, &replay, 0).await;
    put_chains(&client, 0..100, 16 << 10, 10).await;
    converge(&mut sub, &client, Duration::from_secs(20)).await;
    let first_term_last = *sub.picture.seqs.last().unwrap();

    cluster.metas[leader].1.kill9();
    // The standby leads once the old leader's lease ends; the daemons
    // report their blocks to it.
    cluster.wait_healthy(1, Duration::from_secs(30)).await;
    let new_leader = cluster.leader_index().await;
    assert_ne!(new_leader, leader);
    let (events, replay) = cluster.events.as_ref().unwrap()[new_leader].clone();
    sub.switch(&events, &replay).await;
    put_chains(&client, 100..120, 16 << 10, 10).await;
    let held = converge(&mut sub, &client, Duration::from_secs(30)).await;
    assert_eq!(held.len(), 120, "every block of the live daemon kept");
    // The new leader learnt each block's parent from the daemons'
    // inventories, and published a daemon's blocks parent first.
    for i in 0..120 {
        assert_eq!(
            sub.picture.parents.get(hash(i).0.as_slice()),
            Some(&chain_parent(i, 10)),
            "block {i}'s parent"
        );
    }
    // The daemon sends its inventory parent first.
    let hashes: Vec<BlockHash> = (0..120).map(hash).collect();
    let found = client.lookup(&ns(), &hashes).await.unwrap();
    let daemon_of: std::collections::HashMap<Vec<u8>, u32> = hashes
        .iter()
        .zip(&found.items)
        .map(|(h, l)| (h.0.to_vec(), l.unwrap().daemons.iter().next().unwrap()))
        .collect();
    let second_term = &sub.picture.log[sub.picture.cleared_at[1]..];
    let at = |h: &[u8]| {
        second_term
            .iter()
            .position(|(_, x, stored)| *stored && x[..] == h[..])
    };
    let mut checked = 0;
    for i in (0..100).filter(|i| i % 10 != 0) {
        let (child, parent) = (hash(i).0.to_vec(), hash(i - 1).0.to_vec());
        if daemon_of[&child] == daemon_of[&parent] {
            assert!(
                at(&parent).unwrap() < at(&child).unwrap(),
                "block {i}'s parent first"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 90, "every chain on the one daemon");
    assert_eq!(
        sub.picture.clears, 2,
        "the new term opened with AllBlocksCleared"
    );
    assert!(
        sub.picture.seqs.iter().any(|s| *s > first_term_last),
        "the new term's numbers are above the old one's"
    );
    assert!(
        sub.picture
            .log
            .iter()
            .all(|(topic, _, _)| topic.ends_with("@t/events")),
        "every batch names its namespace"
    );
}

/// Each block's tier as the index holds it (its one copy's).
async fn tiers(client: &Client, hashes: &[BlockHash]) -> Vec<Option<Tier>> {
    let found = client.lookup(&ns(), hashes).await.unwrap();
    found
        .items
        .iter()
        .map(|l| l.and_then(|l| l.daemons.with_tiers().next().map(|(_, t)| t)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_demoted_to_nvme_move_to_storage_in_events_lookups_and_route() {
    let dir = scratch_dir("events-nvme");
    let drive = dir.join("nvme.bin");
    let config = format!(
        "eviction = \"lru\"\nnvme = [\"{}:64MiB\"]\n",
        drive.display()
    );
    let store = up("4MiB", Some(&config)).await;
    let client = client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    // 7.5 MiB of 64 KiB blocks into 4 MiB of DRAM: the early ones are
    // demoted to the drive, and stay stored.
    put_range(&client, 0..120, 64 << 10).await;
    let hashes: Vec<BlockHash> = (0..120).map(hash).collect();
    let held = converge(&mut sub, &client, Duration::from_secs(20)).await;
    assert_eq!(held.len(), 120, "demoted, not dropped");
    // The index learns each demotion (with the daemon's next report), and
    // a subscriber sees the block leave CPU for STORAGE.
    let topic = sub.picture.blocks.keys().next().unwrap().clone();
    let on_storage = |p: &common::events::Picture| p.media.values().any(|t| *t == Tier::Nvme);
    let agreed = sub.follow_until(Duration::from_secs(20), on_storage).await;
    assert!(agreed, "some blocks reported on STORAGE");
    // Then the media match the index's tiers, block by block (the index
    // read again each round, as reports land).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let truth = tiers(&client, &hashes).await;
        let matches = |p: &common::events::Picture| {
            hashes
                .iter()
                .map(|h| p.media.get(&(topic.clone(), h.0.to_vec())).copied())
                .eq(truth.iter().copied())
        };
        if sub.follow_until(Duration::from_millis(500), matches).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the events' media never matched the index's tiers"
        );
    }
    let truth = tiers(&client, &hashes).await;
    let on_nvme = truth.iter().filter(|t| **t == Some(Tier::Nvme)).count() as u32;
    assert!(on_nvme > 0 && on_nvme < 120, "{on_nvme} of 120 on NVMe");
    assert_eq!(truth[0], Some(Tier::Nvme), "the oldest block was demoted");
    assert_eq!(truth[119], Some(Tier::Dram), "the newest is in DRAM");
    // A demoted block still reads back right (from the drive).
    let got = client
        .get(&mooncake_proto::BlockKey::new(ns(), hashes[0]))
        .await
        .unwrap();
    assert_eq!(got.as_deref(), Some(&vec![7u8; 64 << 10][..]));
    // `route` counts them: all 120 held on the one host, `on_nvme` of
    // them on NVMe only, the leading ones among them.
    let answer = client.route(&ns(), &hashes, &[], true, 0.1).await.unwrap();
    let host = &answer.hosts[0];
    assert_eq!((host.leading, host.held), (120, 120));
    let truth = tiers(&client, &hashes).await;
    let on_nvme = truth.iter().filter(|t| **t == Some(Tier::Nvme)).count() as u32;
    assert_eq!(host.held_nvme, on_nvme);
    assert_eq!(host.leading_nvme, on_nvme);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_and_restart_blocks_read_back_from_nvme_keep_their_engine_names_and_tokens() {
    let dir = scratch_dir("events-nvme-tags");
    let drive = dir.join("nvme.bin");
    let config = format!(
        "eviction = \"lru\"\nnvme = [\"{}:64MiB\"]\n",
        drive.display()
    );
    let mut store = up("4MiB", Some(&config)).await;
    let client = client(&store.meta);
    // Chains of 10 tagged blocks of 256 KiB, 10 MiB in all, into 4 MiB
    // of DRAM: the early ones are demoted to the drive, tags and all.
    put_tagged_chains(&client, 256 << 10, 7000).await;
    let name = |i: u64| EngineHash::Int(7000 + i);
    let hashes: Vec<BlockHash> = (0..40).map(hash).collect();
    let demoted = common::eventually(Duration::from_secs(20), async || {
        let truth = tiers(&client, &hashes).await;
        truth.iter().filter(|t| **t == Some(Tier::Nvme)).count() >= 10
    })
    .await;
    assert!(demoted.is_some(), "at least 10 of 40 blocks demoted");

    // Killed, then started again on the same drive: the blocks on it come
    // back, and the events name them as their writer did.
    store.kill9();
    let store = up("4MiB", Some(&config)).await;
    let client = self::client(&store.meta);
    let mut sub = Subscriber::connect(&store.events, &store.replay, 0).await;
    // The listing is read again each round, as the inventory lands.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (back, held) = loop {
        let back: Vec<BlockHash> = listed(&client, &ns()).await;
        let held: Vec<u64> = (0..40).filter(|i| back.contains(&hash(*i))).collect();
        let names: BTreeSet<Vec<u8>> = held.iter().map(|i| raw(&name(*i))).collect();
        let named = |p: &common::events::Picture| p.all() == names;
        if !held.is_empty() && sub.follow_until(Duration::from_millis(500), named).await {
            break (back, held);
        }
        assert!(
            Instant::now() < deadline,
            "the restarted store never named its {} blocks by their tags: {} names seen",
            held.len(),
            sub.picture.all().len()
        );
    };
    assert!(
        held.len() >= 10,
        "{} blocks back from the drive",
        held.len()
    );
    for i in &held {
        assert_eq!(
            sub.picture.tokens[&raw(&name(*i))],
            tokens(*i),
            "block {i}'s tokens"
        );
        if i % 10 != 0 && back.contains(&hash(i - 1)) {
            assert_eq!(
                sub.picture.parents[&raw(&name(*i))],
                Some(raw(&name(i - 1))),
                "block {i}'s parent"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_holds_its_events_ports_from_its_start_until_it_leads() {
    // A port that another process took while a replica stood by would stop
    // it when elected: at the failover it stands by for.
    let cluster = Cluster::start_events(2, 1, "64MiB").await;
    let standby = 1 - cluster.leader_index().await;
    // Standing by (its ports bound before it says so): a bounded wait.
    let log = cluster.logs.join(format!("meta-{standby}.log"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log).is_ok_and(|l| l.contains("standing by")) {
        assert!(
            Instant::now() < deadline,
            "the standby never stood by: {}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (events, replay) = cluster.events.as_ref().unwrap()[standby].clone();
    for addr in [events, replay] {
        let err = std::net::TcpListener::bind(&addr)
            .expect_err("a standby's events port was free for another process");
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{addr}: {err}");
    }
}
