//! `route-sim TRACE`: the Mooncake paper's routing claim, on this store.
//! One daemon per simulated host (each its own `node`) and the meta
//! service run in this process; one simulated prefill instance per host
//! serves the trace in simulated time, and each request goes to an
//! instance chosen by one of three policies: at random, by the longest
//! prefix alone (the host holding most of the request's cached prefix),
//! or by `route` (prefix against load). Each policy runs on a fresh store.
//!
//! An instance serves its queue in order. A request's time on it is its
//! uncached tokens at `--prefill-tokens-per-sec`, plus the cached blocks
//! held on other hosts moved over `--link-gbps` at the modeled KV size;
//! its TTFT is that plus its wait. When a prefill finishes (in simulated
//! time) the instance puts the blocks it computed into the store from its
//! own host, and it reads the cached prefix before it starts: the store's
//! placement, eviction and index are the real ones, only time is
//! simulated. `docs/events.md` describes the model.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use mooncake_client::{Client, ClientConfig, GetOutcome};
use mooncake_local::LocalDaemon;
use mooncake_proto::message::RouteCandidate;
use mooncake_proto::units::{parse_duration, ByteSize};
use mooncake_proto::{BlockHash, Namespace};
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::exit::Failure;
use crate::replay::key;
use crate::svg::{line_chart, Series};
use crate::trace::{self, Request};

#[derive(clap::Args, Debug)]
pub struct RouteSimArgs {
    /// The trace: JSON lines with timestamp, input_length, hash_ids.
    trace: PathBuf,
    /// Hosts, each with one daemon and one prefill instance.
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// DRAM of each host's daemon.
    #[arg(long, default_value = "64MiB")]
    dram: ByteSize,
    /// Bytes a block takes in the store (the blocks stored stand in for
    /// the model's; their transfer time is modeled with
    /// --kv-bytes-per-token).
    #[arg(long, default_value = "8KiB")]
    block_bytes: ByteSize,
    /// Tokens per block of the trace's hash_ids.
    #[arg(long, default_value_t = 512)]
    block_tokens: u64,
    /// Prefill speed of one instance, in tokens per second.
    #[arg(long, default_value_t = 10_000.0)]
    prefill_tokens_per_sec: f64,
    /// KV cache bytes per token of the modeled model (Llama-3-70B:
    /// 327680), for the time a block takes to move between hosts.
    #[arg(long, default_value_t = 327_680)]
    kv_bytes_per_token: u64,
    /// The link between hosts, in Gbit/s.
    #[arg(long, default_value_t = 100.0)]
    link_gbps: f64,
    /// The time-to-first-token deadline.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    ttft_slo: Duration,
    /// Only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Seed of the random choices (the random policy, ties).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write each policy's TTFT distribution here, as an SVG plot.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    Random,
    Prefix,
    Route,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Random => "random",
            Policy::Prefix => "longest prefix",
            Policy::Route => "route (prefix vs load)",
        }
    }
}

/// What one policy's run measured.
#[derive(Default)]
struct Outcome {
    tokens: u64,
    hit_tokens: u64,
    hit_blocks: u64,
    /// Hit blocks held on the serving instance's own host.
    local_blocks: u64,
    /// Blocks the route answer counted that were gone when read.
    lost_blocks: u64,
    ttft: Vec<f64>,
    busy_seconds: f64,
    span_seconds: f64,
}

impl Outcome {
    fn quantile(&self, q: f64) -> f64 {
        let i = ((self.ttft.len() as f64 - 1.0) * q).round() as usize;
        self.ttft[i.min(self.ttft.len() - 1)]
    }
}

/// A prefill that will finish at `finish` (microseconds of simulated
/// time) on `host`, then put the blocks of request `req` from `from` on.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Finish {
    finish: u64,
    req: usize,
    host: usize,
    from: usize,
}

pub async fn run(args: RouteSimArgs) -> Result<(), Failure> {
    if args.hosts == 0 || args.block_tokens == 0 {
        return Err(Failure::usage(
            "--hosts and --block-tokens must be at least 1",
        ));
    }
    if !(args.prefill_tokens_per_sec > 0.0 && args.link_gbps > 0.0) {
        return Err(Failure::usage(
            "--prefill-tokens-per-sec and --link-gbps must be more than 0",
        ));
    }
    let trace = trace::load(&args.trace, args.limit).map_err(Failure::other)?;
    let mut results = Vec::new();
    for policy in [Policy::Random, Policy::Prefix, Policy::Route] {
        results.push((policy, simulate(policy, &trace, &args).await?));
    }
    report(&args, &results)?;
    Ok(())
}

/// The seconds one block takes to move between hosts.
fn block_transfer_seconds(args: &RouteSimArgs) -> f64 {
    (args.block_tokens * args.kv_bytes_per_token) as f64 * 8.0 / (args.link_gbps * 1e9)
}

async fn simulate(
    policy: Policy,
    trace: &[Request],
    args: &RouteSimArgs,
) -> Result<Outcome, Failure> {
    let store = Hosts::start(args.hosts, args.dram).await?;
    let ns = Namespace::new("route-sim").expect("valid");
    let rate = args.prefill_tokens_per_sec;
    let block_prefill = args.block_tokens as f64 / rate;
    let transfer = block_transfer_seconds(args);
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut busy = vec![0.0f64; args.hosts];
    let mut pending: BinaryHeap<Reverse<Finish>> = BinaryHeap::new();
    let mut out = Outcome::default();
    let value = vec![7u8; args.block_bytes.0 as usize];
    let bar = progress(args, trace.len(), policy);
    for (i, req) in trace.iter().enumerate() {
        let now = req.timestamp as f64 / 1000.0;
        // Prefills done by now publish their blocks.
        while pending
            .peek()
            .is_some_and(|f| f.0.finish as f64 / 1e6 <= now)
        {
            let Reverse(done) = pending.pop().expect("peeked");
            let chain: Vec<BlockHash> =
                trace[done.req].hash_ids.iter().map(|id| key(*id)).collect();
            store
                .put(done.host, &ns, &chain[done.from..], &value)
                .await?;
        }
        let chain: Vec<BlockHash> = req.hash_ids.iter().map(|id| key(*id)).collect();
        let candidates: Vec<RouteCandidate> = (0..args.hosts)
            .map(|h| RouteCandidate {
                node: Hosts::node(h),
                queue: ((busy[h] - now).max(0.0) / block_prefill).round() as u32,
            })
            .collect();
        let answer = store.clients[0]
            .route(&ns, &chain, &candidates, false, transfer / block_prefill)
            .await?;
        let pick = match policy {
            Policy::Random => rng.gen_range(0..args.hosts),
            Policy::Prefix => {
                let most = answer.hosts.iter().map(|h| h.held).max().unwrap_or(0);
                let holders: Vec<usize> = (0..args.hosts)
                    .filter(|h| answer.hosts[*h].held == most)
                    .collect();
                holders[rng.gen_range(0..holders.len())]
            }
            Policy::Route => answer.best.unwrap_or(0) as usize,
        };
        // The instance reads the cached prefix (and finds what is gone).
        let matched = answer.matched as usize;
        let read = store.read(pick, &ns, &chain[..matched], &value).await?;
        out.lost_blocks += (matched - read) as u64;
        let held = (answer.hosts[pick].held as usize).min(read);
        let hit_tokens = trace::hit_tokens(req, read, args.block_tokens);
        let service =
            (req.input_length - hit_tokens) as f64 / rate + (read - held) as f64 * transfer;
        let start = busy[pick].max(now);
        busy[pick] = start + service;
        out.busy_seconds += service;
        out.ttft.push(busy[pick] - now);
        out.tokens += req.input_length;
        out.hit_tokens += hit_tokens;
        out.hit_blocks += read as u64;
        out.local_blocks += held as u64;
        pending.push(Reverse(Finish {
            finish: (busy[pick] * 1e6) as u64,
            req: i,
            host: pick,
            from: read,
        }));
        bar.inc(1);
    }
    bar.finish_and_clear();
    out.span_seconds = busy.iter().copied().fold(
        trace.last().map_or(0.0, |r| r.timestamp as f64 / 1000.0),
        f64::max,
    );
    out.ttft.sort_by(f64::total_cmp);
    store.stop().await;
    Ok(out)
}

fn progress(args: &RouteSimArgs, total: usize, policy: Policy) -> ProgressBar {
    if args.json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:30}] {pos}/{len} requests {per_sec}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(policy.name());
    bar
}

fn report(args: &RouteSimArgs, results: &[(Policy, Outcome)]) -> Result<(), Failure> {
    let slo = args.ttft_slo.as_secs_f64();
    let missed = |o: &Outcome| o.ttft.iter().filter(|t| **t > slo).count();
    let share = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    if args.json {
        let rows: Vec<_> = results
            .iter()
            .map(|(p, o)| {
                json!({"policy": p.name(), "token_hit_rate": share(o.hit_tokens, o.tokens),
                       "local_hit_share": share(o.local_blocks, o.hit_blocks),
                       "ttft_p50_s": o.quantile(0.5), "ttft_p99_s": o.quantile(0.99),
                       "over_slo": missed(o), "requests": o.ttft.len(),
                       "lost_blocks": o.lost_blocks,
                       "utilization": o.busy_seconds / (o.span_seconds * args.hosts as f64)})
            })
            .collect();
        println!(
            "{}",
            json!({"hosts": args.hosts, "ttft_slo_s": slo, "policies": rows})
        );
    } else {
        println!(
            "{} requests, {} hosts ({} of DRAM each), prefill {} tokens/s per instance, a block moves in {:.1} ms ({} Gbit/s), TTFT deadline {:?}",
            results[0].1.ttft.len(),
            args.hosts,
            args.dram,
            args.prefill_tokens_per_sec,
            block_transfer_seconds(args) * 1000.0,
            args.link_gbps,
            args.ttft_slo
        );
        println!(
            "{:<24} {:>9} {:>11} {:>10} {:>10} {:>12} {:>6}",
            "policy", "token hit", "local hits", "TTFT p50", "TTFT p99", "over SLO", "busy"
        );
        for (p, o) in results {
            println!(
                "{:<24} {:>8.1}% {:>10.1}% {:>9.2}s {:>9.2}s {:>6} ({:>4.1}%) {:>5.0}%",
                p.name(),
                100.0 * share(o.hit_tokens, o.tokens),
                100.0 * share(o.local_blocks, o.hit_blocks),
                o.quantile(0.5),
                o.quantile(0.99),
                missed(o),
                100.0 * missed(o) as f64 / o.ttft.len() as f64,
                100.0 * o.busy_seconds / (o.span_seconds * args.hosts as f64)
            );
        }
    }
    if let Some(path) = &args.plot {
        // TTFT against the share of requests served within it, up to the
        // worst policy's p99.
        let x_max = results
            .iter()
            .map(|(_, o)| o.quantile(0.99))
            .fold(slo, f64::max);
        let colors = ["#d62728", "#1f77b4", "#2ca02c"];
        let series: Vec<Series<'_>> = results
            .iter()
            .zip(colors)
            .map(|((p, o), color)| Series {
                name: p.name(),
                color,
                points: (0..=200)
                    .map(|k| {
                        let x = x_max * k as f64 / 200.0;
                        let within = o.ttft.partition_point(|t| *t <= x);
                        (x, within as f64 / o.ttft.len() as f64)
                    })
                    .collect(),
            })
            .collect();
        let svg = line_chart(
            &format!("TTFT by routing policy ({} hosts)", args.hosts),
            "time to first token (s)",
            "requests served within it",
            &series,
        );
        std::fs::write(path, svg)
            .map_err(|e| Failure::other(anyhow::anyhow!("{}: {e}", path.display())))?;
        if !args.json {
            println!("plot: {}", path.display());
        }
    }
    Ok(())
}

/// The simulated hosts' store: a meta service and one daemon per host in
/// this process, and a client on each host.
struct Hosts {
    clients: Vec<Client>,
    daemons: Vec<LocalDaemon>,
    meta_stop: CancellationToken,
    meta: mooncake_meta::MetaHandle,
}

impl Hosts {
    fn node(h: usize) -> String {
        format!("host-{h}")
    }

    async fn start(hosts: usize, dram: ByteSize) -> Result<Hosts, Failure> {
        let registry = prometheus::Registry::new();
        let meta_stop = CancellationToken::new();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let meta = mooncake_local::start_meta(
            mooncake_meta::MetaConfig::default(),
            listener,
            &registry,
            meta_stop.clone(),
        )
        .await
        .map_err(|e| Failure::other(e.into()))?;
        let mut daemons = Vec::new();
        let mut clients = Vec::new();
        for h in 0..hosts {
            let cfg = mooncake_store_daemon::DaemonConfig {
                node: Self::node(h),
                dram,
                meta: Some(meta.addr.to_string()),
                heartbeat_interval: mooncake_proto::units::HumanDuration(Duration::from_millis(
                    200,
                )),
                ..Default::default()
            };
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            // A registry each: their metrics would share names in one.
            let daemon = LocalDaemon::start(
                cfg,
                listener,
                &prometheus::Registry::new(),
                CancellationToken::new(),
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| Failure::other(e.into()))?;
            daemons.push(daemon);
            let mut cfg =
                ClientConfig::new(meta.addr.to_string()).with_timeout(Duration::from_secs(10));
            cfg.node = Self::node(h);
            clients.push(Client::new(cfg));
        }
        Ok(Hosts {
            clients,
            daemons,
            meta_stop,
            meta,
        })
    }

    /// Host `h`'s instance publishes blocks it computed.
    async fn put(
        &self,
        h: usize,
        ns: &Namespace,
        hashes: &[BlockHash],
        value: &[u8],
    ) -> Result<(), Failure> {
        let blocks: Vec<(BlockHash, &[u8])> = hashes.iter().map(|k| (*k, value)).collect();
        for chunk in blocks.chunks(256) {
            self.clients[h].put(ns, chunk).await?;
        }
        Ok(())
    }

    /// Host `h`'s instance reads a cached prefix; how many leading blocks
    /// it got.
    async fn read(
        &self,
        h: usize,
        ns: &Namespace,
        hashes: &[BlockHash],
        value: &[u8],
    ) -> Result<usize, Failure> {
        if hashes.is_empty() {
            return Ok(0);
        }
        let mut bufs: Vec<Vec<u8>> = hashes.iter().map(|_| vec![0u8; value.len()]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = self.clients[h].get_into(ns, hashes, &mut slices).await?;
        Ok(got
            .iter()
            .take_while(|g| matches!(g, GetOutcome::Hit(_)))
            .count())
    }

    async fn stop(self) {
        for d in self.daemons {
            d.shut_down().await;
        }
        self.meta_stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.meta.join()).await;
    }
}
