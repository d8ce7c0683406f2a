//! `bench-meta`: the meta service on its own. Prefix matches of 128-key
//! chains, the router's question (`route`) on the same chains, and two-phase
//! puts, in keys per second: once against the index in
//! this process on one core (the engine's ceiling), once over the wire
//! against a meta service (what a scheduler sees). No block data moves.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mooncake_client::{Client, ClientConfig, ErrorSource};
use mooncake_meta::Index;
use mooncake_net::Connection;
use mooncake_proto::message::{
    CommitItem, PutCommitRequest, PutStartRequest, PutStartResponse, Slot, Statuses, Tier, ToPlace,
};
use mooncake_proto::{BlockHash, BlockKey, Namespace, Opcode, PrefixHasher};
use serde_json::json;

use crate::exit::Failure;
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct BenchMetaArgs {
    #[command(flatten)]
    target: Target,
    /// Chains stored.
    #[arg(long, default_value_t = 2000)]
    chains: usize,
    /// Keys per chain (blocks per request).
    #[arg(long, default_value_t = 128)]
    chain_len: usize,
    /// Prefix-match requests over the wire.
    #[arg(long, default_value_t = 20000)]
    requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    #[arg(long)]
    json: bool,
}

fn chains(n: usize, len: usize, salt: u64) -> Vec<Vec<BlockHash>> {
    (0..n)
        .map(|c| {
            let tokens: Vec<u32> = (0..len as u32).collect();
            PrefixHasher::chain(format!("bench-meta-{salt}-{c}").as_bytes(), &tokens, 1, b"")
        })
        .collect()
}

pub async fn run(args: BenchMetaArgs) -> Result<(), Failure> {
    if args.chains == 0 || args.chain_len == 0 || args.concurrency == 0 {
        return Err(Failure::usage(
            "--chains, --chain-len and --concurrency must be at least 1",
        ));
    }
    let ns = Namespace::new("bench-meta").expect("valid");
    let salt: u64 = rand::random();
    let chains = Arc::new(chains(args.chains, args.chain_len, salt));
    let keys = args.chains * args.chain_len;

    // 1. The index alone, one core.
    let index = Index::new();
    for chain in chains.iter() {
        for h in chain {
            index.insert_visible(
                &BlockKey::new(ns.clone(), *h),
                (1, Tier::Dram),
                (64, 0),
                None,
            );
        }
    }
    let start = Instant::now();
    let mut looked = 0usize;
    let mut i = 0usize;
    while start.elapsed() < Duration::from_secs(1) {
        looked += index.match_prefix(&ns, &chains[i % chains.len()]).len();
        i += 1;
    }
    let local = looked as f64 / start.elapsed().as_secs_f64();
    let branches = branch_bookkeeping(&ns, &chains, salt);

    // 2. Two-phase puts over the wire (reserve, then commit as stored).
    let client = crate::blocks::client(&args.target).await?;
    let meta_addr = client.config().meta_addr.clone();
    let mut conn =
        Connection::connect(&meta_addr, ErrorSource::Meta, Duration::from_secs(2)).await?;
    if let Some(token) = &client.config().token {
        conn.authenticate(token).await?;
    }
    let start = Instant::now();
    for chain in chains.iter() {
        let req = PutStartRequest {
            namespace: ns.clone(),
            node: String::new(),
            replicas: 1,
            items: chain.iter().map(|h| ToPlace::unchained(*h, 64)).collect(),
        };
        let placed: PutStartResponse = conn.call(Opcode::PutStart, &req, "put_start").await?;
        let items = chain
            .iter()
            .enumerate()
            .zip(&placed.slots)
            .filter_map(|((i, h), s)| match s {
                Slot::Place { copies, .. } => Some(CommitItem {
                    hash: *h,
                    stored_on: *copies,
                    size: 64,
                    checksum: 0,
                    parent: i.checked_sub(1).map(|p| chain[p]),
                    tag: None,
                }),
                Slot::Skip(_) => None,
            })
            .collect();
        let commit = PutCommitRequest {
            namespace: ns.clone(),
            items,
        };
        let _: Statuses = conn.call(Opcode::PutCommit, &commit, "put_commit").await?;
    }
    let put_rate = keys as f64 / start.elapsed().as_secs_f64();

    // 3. Prefix matches, then the router's question, over the wire, from
    // concurrent callers.
    let client = Arc::new(Client::new(ClientConfig {
        location_cache: 0,
        ..client.config().clone()
    }));
    let (wire, hist, matched) = over_the_wire(&client, &chains, &ns, &args, Op::Match).await;
    let (route_rate, route_hist, routed) =
        over_the_wire(&client, &chains, &ns, &args, Op::Route).await;
    let expected = args.requests * args.chain_len;
    let _ = client
        .remove(&ns, &chains.iter().flatten().copied().collect::<Vec<_>>())
        .await;

    if args.json {
        println!(
            "{}",
            json!({"keys": keys, "chain_len": args.chain_len, "concurrency": args.concurrency,
                   "index_match_keys_per_sec_one_core": local,
                   "branches_match_keys_per_sec_one_core": branches,
                   "wire_put_start_commit_keys_per_sec": put_rate,
                   "wire_match_keys_per_sec": wire, "wire_match_p50_us": hist.value_at_quantile(0.5),
                   "wire_match_p99_us": hist.value_at_quantile(0.99),
                   "wire_route_keys_per_sec": route_rate,
                   "wire_route_p50_us": route_hist.value_at_quantile(0.5),
                   "wire_route_p99_us": route_hist.value_at_quantile(0.99),
                   "matched": matched, "routed": routed, "expected": expected})
        );
    } else {
        println!(
            "{} keys in {} chains of {}; {} in flight",
            keys, args.chains, args.chain_len, args.concurrency
        );
        println!(
            "index, in process, one core   match_prefix   {:>12.0} keys/s",
            local
        );
        println!(
            "branch counts, in process     match_prefix   {:>12.0} keys/s",
            branches
        );
        println!(
            "meta over TCP                 put (2 phases) {:>12.0} keys/s",
            put_rate
        );
        println!(
            "meta over TCP                 match_prefix   {:>12.0} keys/s   p50 {} us  p99 {} us per {}-key request",
            wire,
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.99),
            args.chain_len
        );
        println!(
            "meta over TCP                 route          {:>12.0} keys/s   p50 {} us  p99 {} us per {}-key request",
            route_rate,
            route_hist.value_at_quantile(0.5),
            route_hist.value_at_quantile(0.99),
            args.chain_len
        );
        if matched != expected || routed != expected {
            println!("warning: matched {matched} and routed {routed} keys of {expected} expected");
        }
    }
    Ok(())
}

/// What a prefix match adds to the index's walk: the meta service's
/// branch counts (`meta/src/branches.rs`), full (as many branch points
/// and branches as they hold, then each chain's first half matched and
/// its second half put after it), on one core, in keys per second.
fn branch_bookkeeping(ns: &Namespace, chains: &[Vec<BlockHash>], salt: u64) -> f64 {
    use mooncake_meta::branches::{Branches, Put, DEFAULT_CAP};
    let branches = Branches::new(DEFAULT_CAP);
    let put_after = |chain: &[BlockHash], from: usize| -> Vec<Put> {
        (from..chain.len())
            .map(|i| Put {
                hash: chain[i],
                parent: i.checked_sub(1).map(|p| chain[p]),
                placed: true,
                returning: false,
            })
            .collect()
    };
    for pair in self::chains(DEFAULT_CAP, 2, salt ^ 1) {
        branches.matched(ns, &pair, 1);
        branches.judge(ns, &put_after(&pair, 1));
    }
    for chain in chains {
        let half = chain.len() / 2;
        branches.matched(ns, chain, half);
        branches.judge(ns, &put_after(chain, half));
    }
    let start = Instant::now();
    let mut looked = 0usize;
    let mut i = 0usize;
    while start.elapsed() < Duration::from_secs(1) {
        let chain = &chains[i % chains.len()];
        branches.matched(ns, chain, chain.len());
        looked += chain.len();
        i += 1;
    }
    looked as f64 / start.elapsed().as_secs_f64()
}

#[derive(Clone, Copy)]
enum Op {
    Match,
    Route,
}

/// `args.requests` calls of `op`, one chain each, `args.concurrency` at a
/// time: keys matched per second, the latency of each call, keys matched.
async fn over_the_wire(
    client: &Arc<Client>,
    chains: &Arc<Vec<Vec<BlockHash>>>,
    ns: &Namespace,
    args: &BenchMetaArgs,
    op: Op,
) -> (f64, Histogram<u64>, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (client, chains, next, ns) =
                (client.clone(), chains.clone(), next.clone(), ns.clone());
            let total = args.requests;
            tokio::spawn(async move {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
                let mut matched = 0usize;
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        break;
                    }
                    let chain = &chains[n % chains.len()];
                    let t = Instant::now();
                    matched += match op {
                        Op::Match => client.match_prefix(&ns, chain).await.map(|m| m.matched),
                        Op::Route => client
                            .route(&ns, chain, &[], true, 0.1)
                            .await
                            .map(|r| r.matched as usize),
                    }
                    .unwrap_or(0);
                    hist.saturating_record(t.elapsed().as_micros() as u64);
                }
                (hist, matched)
            })
        })
        .collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
    let mut matched = 0;
    for w in workers {
        if let Ok((h, m)) = w.await {
            hist.add(h).expect("same bounds");
            matched += m;
        }
    }
    (
        matched as f64 / start.elapsed().as_secs_f64(),
        hist,
        matched,
    )
}
