//! The router's question against several hosts with known contents: each
//! host's held and leading blocks of a request, and the cheapest host
//! under the documented cost, as the meta service answers `route`.

use std::collections::HashMap;

use mooncake_client::{Client, ClientConfig, PutOutcome};
use mooncake_proto::message::{RouteAnswer, RouteCandidate, RouteHost};
use mooncake_proto::{BlockHash, Namespace, PrefixHasher};
use mooncake_store_daemon::DaemonConfig;
use mooncake_tests::{daemon_config, fast_meta, TestCluster};

fn ns() -> Namespace {
    Namespace::new("t/route").unwrap()
}

fn on_node(node: &str) -> DaemonConfig {
    DaemonConfig {
        node: node.into(),
        ..daemon_config(64 << 20)
    }
}

/// A client that says it runs on `node`: its puts land there first.
fn writer(cluster: &TestCluster, node: &str) -> Client {
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone());
    cfg.node = node.into();
    Client::new(cfg)
}

async fn put(client: &Client, hashes: &[BlockHash]) {
    let value = vec![5u8; 4096];
    let blocks: Vec<(BlockHash, &[u8])> = hashes.iter().map(|h| (*h, &value[..])).collect();
    let out = client.put(&ns(), &blocks).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Stored), "{out:?}");
}

fn host<'a>(answer: &'a RouteAnswer, node: &str) -> &'a RouteHost {
    answer.hosts.iter().find(|h| h.node == node).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_answers_each_hosts_prefix_and_the_cheapest_host() {
    let cluster = TestCluster::start_with(
        fast_meta(),
        vec![on_node("gpu-a"), on_node("gpu-b"), on_node("gpu-c")],
    )
    .await;
    let tokens: Vec<u32> = (0..12 * 16).collect();
    let chain = PrefixHasher::chain(b"model", &tokens, 16, b"");
    assert_eq!(chain.len(), 12);
    // Blocks 0-5 written on gpu-a, 6-9 on gpu-b; 10 and 11 nowhere.
    put(&writer(&cluster, "gpu-a"), &chain[..6]).await;
    put(&writer(&cluster, "gpu-b"), &chain[6..10]).await;

    // Where the index says each block is, by host: the expected answer.
    let client = cluster.client();
    let stats = client.cluster_stats().await.unwrap();
    let node_of: HashMap<u32, String> = stats
        .daemons
        .iter()
        .map(|d| (d.id, d.node.clone()))
        .collect();
    let located = client.lookup(&ns(), &chain).await.unwrap();
    let nodes: Vec<Option<&str>> = located
        .items
        .iter()
        .map(|l| l.map(|l| node_of[&l.daemons.first().unwrap()].as_str()))
        .collect();
    let expect: Vec<Option<&str>> = [Some("gpu-a"); 6]
        .into_iter()
        .chain([Some("gpu-b"); 4])
        .chain([None, None])
        .collect();
    assert_eq!(nodes, expect, "each writer's blocks on its own host");

    let all = client.route(&ns(), &chain, &[], true, 0.1).await.unwrap();
    assert_eq!((all.blocks, all.matched), (12, 10));
    let names: Vec<&str> = all.hosts.iter().map(|h| h.node.as_str()).collect();
    assert_eq!(
        names,
        ["gpu-a", "gpu-b", "gpu-c"],
        "every live host, by name"
    );
    let (a, b, c) = (
        host(&all, "gpu-a"),
        host(&all, "gpu-b"),
        host(&all, "gpu-c"),
    );
    assert_eq!((a.leading, a.held, a.daemons), (6, 6, 1));
    assert_eq!((b.leading, b.held), (0, 4));
    assert_eq!((c.leading, c.held), (0, 0));
    // 2 blocks to prefill everywhere, plus 0.1 for each block moved in.
    assert_eq!(
        (a.cost_milli, b.cost_milli, c.cost_milli),
        (2400, 2600, 3000)
    );
    assert_eq!(all.best, Some(0));
    assert_eq!(a.capacity, 64 << 20, "{a:?}");

    // A queue on gpu-a (the router's knowledge) sends the request to gpu-b.
    let queued = [
        RouteCandidate {
            node: "gpu-a".into(),
            queue: 1,
        },
        RouteCandidate {
            node: "gpu-b".into(),
            queue: 0,
        },
    ];
    let answer = client
        .route(&ns(), &chain, &queued, false, 0.1)
        .await
        .unwrap();
    assert_eq!(answer.hosts.len(), 2);
    assert_eq!(answer.hosts[0].cost_milli, 3400);
    assert_eq!(answer.best, Some(1));

    // Free transfers: every host holding the prefix is as good; the one
    // holding more wins the tie.
    let free = client.route(&ns(), &chain, &[], true, 0.0).await.unwrap();
    assert!(free.hosts.iter().all(|h| h.cost_milli == 2000));
    assert_eq!(free.best, Some(0));

    // A host with no daemon is a candidate that holds nothing.
    let gone = [RouteCandidate {
        node: "gpu-z".into(),
        queue: 0,
    }];
    let answer = client
        .route(&ns(), &chain, &gone, false, 0.1)
        .await
        .unwrap();
    assert_eq!((answer.hosts[0].daemons, answer.hosts[0].held), (0, 0));
    assert_eq!(answer.hosts[0].cost_milli, 3000);
    // Every host, with a queue given for one of them, which comes first.
    let answer = client
        .route(&ns(), &chain, &queued[..1], true, 0.1)
        .await
        .unwrap();
    let names: Vec<&str> = answer.hosts.iter().map(|h| h.node.as_str()).collect();
    assert_eq!(names, ["gpu-a", "gpu-b", "gpu-c"]);
    assert_eq!(answer.hosts[0].queue, 1);
    assert_eq!(answer.best, Some(1));
    // No candidates and not every host: nothing to judge.
    let none = client.route(&ns(), &chain, &[], false, 0.1).await.unwrap();
    assert!(none.hosts.is_empty() && none.best.is_none());

    // A chain with nothing stored: all prefill, no host better.
    let other = PrefixHasher::chain(b"other", &tokens, 16, b"");
    let cold = client.route(&ns(), &other, &[], true, 0.1).await.unwrap();
    assert_eq!(cold.matched, 0);
    assert!(cold
        .hosts
        .iter()
        .all(|h| h.cost_milli == 12_000 && h.held == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_names_the_serving_instance_on_each_host_and_takes_it_as_a_candidate() {
    let meta = mooncake_meta::MetaConfig {
        instances: [("gpu-a", "prefill-0"), ("gpu-b", "prefill-1")]
            .into_iter()
            .map(|(n, i)| (n.to_string(), i.to_string()))
            .collect(),
        ..fast_meta()
    };
    let cluster = TestCluster::start_with(meta, vec![on_node("gpu-a"), on_node("gpu-b")]).await;
    let tokens: Vec<u32> = (0..4 * 16).collect();
    let chain = PrefixHasher::chain(b"model", &tokens, 16, b"");
    put(&writer(&cluster, "gpu-b"), &chain[..3]).await;
    let client = cluster.client();
    let all = client.route(&ns(), &chain, &[], true, 0.1).await.unwrap();
    let named: Vec<(&str, &str)> = all
        .hosts
        .iter()
        .map(|h| (h.node.as_str(), h.instance.as_str()))
        .collect();
    assert_eq!(named, [("gpu-a", "prefill-0"), ("gpu-b", "prefill-1")]);
    assert_eq!(all.best, Some(1));
    // Asked by instance: the answer is that instance's host.
    let by_instance = [RouteCandidate {
        node: "prefill-1".into(),
        queue: 0,
    }];
    let answer = client
        .route(&ns(), &chain, &by_instance, false, 0.1)
        .await
        .unwrap();
    let h = &answer.hosts[0];
    assert_eq!(
        (h.node.as_str(), h.instance.as_str(), h.held),
        ("gpu-b", "prefill-1", 3)
    );
}
