//! `replay TRACE`: drives a running store with a serving trace. For each
//! request: match its block chain, get the matched blocks, put the rest. It
//! reports the hit rates the store gave beside the trace's theoretical
//! maximum and an exact LRU of the same capacity, computed offline.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use mooncake_client::{Client, GetOutcome, PutOptions, PutOutcome};
use mooncake_proto::units::ByteSize;
use mooncake_proto::{BlockHash, Namespace};
use mooncake_store_daemon::pool::Eviction;
use parking_lot::Mutex;
use serde_json::json;

use crate::exit::Failure;
use crate::trace::{self, Request};
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    target: Target,
    /// The trace: JSON lines with timestamp, input_length, hash_ids.
    trace: PathBuf,
    /// Bytes of KV cache per token (Llama-3-70B: 327680); scale it down to
    /// fit the store you replay against.
    #[arg(long, default_value_t = 16)]
    bytes_per_token: u64,
    /// Tokens per block of the trace's hash_ids.
    #[arg(long, default_value_t = 512)]
    block_tokens: u64,
    /// Time compression: 10 replays ten times faster than recorded; 0
    /// ignores timestamps and goes as fast as the workers can.
    #[arg(long, default_value_t = 0.0)]
    speed: f64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Namespace of the replayed blocks (default: a fresh one per run, so
    /// that earlier runs do not inflate the hit rate).
    #[arg(short, long)]
    namespace: Option<String>,
    /// Leave the blocks stored afterwards.
    #[arg(long)]
    keep: bool,
    /// Publish blocks without naming their chain, so that daemons evict
    /// plain LRU: measures what prefix-aware eviction gains.
    #[arg(long)]
    unchained: bool,
    /// How each request calls the store: `chains` (a prefix match, then
    /// the rest of the chain put naming its parent); `engines`, as vLLM's
    /// and SGLang's Mooncake backends do (which of its keys exist, then
    /// the missing ones put naming no parent: the client names the
    /// parents the lookup implied); or `lmcache`, as LMCache's
    /// `mooncakestore` connector does (one key at a time until one is
    /// missing, then the rest put in one call, in order).
    #[arg(long, value_enum, default_value_t = Calls::Chains)]
    calls: Calls,
    #[arg(long)]
    json: bool,
}

/// How a replayed request calls the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Calls {
    /// As the Rust SDK's chains: a prefix match, then the rest of the
    /// chain put, each block naming its parent.
    Chains,
    /// As the serving engines' Mooncake backends (`mooncake.store`):
    /// which of the request's keys exist (the leading ones found are its
    /// prefix), then the missing ones put, naming no parent.
    Engines,
    /// As LMCache's `mooncakestore` connector: whether each key exists,
    /// one call a key, up to the first missing one (LMCache's
    /// `batched_async_contains`), then the rest put in one call
    /// (`batch_put_from`), in order, naming no parent.
    Lmcache,
}

/// How many leading keys of `chain` exist, asked one key a call.
async fn one_key_at_a_time(
    client: &Client,
    ns: &Namespace,
    chain: &[BlockHash],
) -> Result<usize, mooncake_client::ClientError> {
    for (i, hash) in chain.iter().enumerate() {
        if !client.exists(ns, std::slice::from_ref(hash)).await?[0] {
            return Ok(i);
        }
    }
    Ok(chain.len())
}

/// The block key of trace block `id` (also `route-sim`'s).
pub(crate) fn key(id: u64) -> BlockHash {
    let mut bytes = *b"trace-block-\0\0\0\0\0\0\0\0";
    bytes[12..].copy_from_slice(&id.to_le_bytes());
    BlockHash::from_opaque(&bytes)
}

/// The bytes of block `id`: every 8-byte word depends on the id and its
/// position, so a block read under the wrong key never passes.
fn fill(id: u64, buf: &mut [u8]) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let word = (id ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

#[derive(Default)]
struct Totals {
    hit_tokens: AtomicU64,
    tokens: AtomicU64,
    hit_blocks: AtomicU64,
    blocks: AtomicU64,
    lost_after_match: AtomicU64,
    wrong: AtomicU64,
    errors: AtomicU64,
    read: AtomicU64,
    written: AtomicU64,
}

struct Latencies {
    matches: Histogram<u64>,
    gets: Histogram<u64>,
    puts: Histogram<u64>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")
}

pub async fn run(args: ReplayArgs) -> Result<(), Failure> {
    if args.workers == 0 || args.block_tokens == 0 || args.bytes_per_token == 0 || args.speed < 0.0
    {
        return Err(Failure::usage(
            "--workers, --block-tokens and --bytes-per-token must be at least 1, --speed at least 0",
        ));
    }
    let requests = Arc::new(trace::load(&args.trace, args.limit)?);
    let block_size = (args.bytes_per_token * args.block_tokens) as usize;
    let client = Arc::new(crate::blocks::client(&args.target).await?);
    let capacity = crate::blocks::live_capacity(&client).await?;
    let ns_name = args
        .namespace
        .clone()
        .unwrap_or_else(|| format!("replay-{:016x}", rand::random::<u64>()));
    let ns = Namespace::new(ns_name).map_err(|e| Failure::usage(format!("--namespace: {e}")))?;

    let totals = Arc::new(Totals::default());
    let latencies = Arc::new(Mutex::new(Latencies {
        matches: histogram(),
        gets: histogram(),
        puts: histogram(),
    }));
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(requests.len() as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "replay [{bar:30}] {pos}/{len} requests {per_sec} eta {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar
    };
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..args.workers)
        .map(|_| {
            let (requests, client, ns, totals, latencies, next, bar) = (
                requests.clone(),
                client.clone(),
                ns.clone(),
                totals.clone(),
                latencies.clone(),
                next.clone(),
                bar.clone(),
            );
            let (speed, block_tokens, calls) = (args.speed, args.block_tokens, args.calls);
            let chained = !args.unchained && calls == Calls::Chains;
            tokio::spawn(async move {
                let mut value = vec![0u8; block_size];
                let mut bufs: Vec<Vec<u8>> = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(req) = requests.get(i) else { break };
                    if speed > 0.0 {
                        let due = started
                            + Duration::from_secs_f64(req.timestamp as f64 / 1000.0 / speed);
                        tokio::time::sleep_until(due.into()).await;
                    }
                    one_request(
                        &client,
                        &ns,
                        req,
                        (block_tokens, chained, calls),
                        &mut value,
                        &mut bufs,
                        &totals,
                        &latencies,
                    )
                    .await;
                    bar.inc(1);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    bar.finish_and_clear();

    let theoretical = trace::simulate_lru(&requests, None, args.block_tokens);
    // What the store should give: its pool holds this many blocks (the
    // default high watermark fills all of it), and `simulate` runs the
    // daemon's own pool at that size under each eviction order.
    let capacity_blocks = (capacity / block_size as u64) as usize;
    let lru = trace::simulate_lru(&requests, Some(capacity_blocks), args.block_tokens);
    let mut daemon = Vec::new();
    for order in Eviction::ALL {
        let pool = trace::Pool::new(capacity_blocks.max(1), order);
        let r = trace::simulate_pool(&requests, pool, args.block_tokens).map_err(Failure::other)?;
        daemon.push((order, r));
    }
    let footprint = trace::footprint(&requests);
    if !args.keep {
        let mut ids: Vec<u64> = requests
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let hashes: Vec<BlockHash> = ids.into_iter().map(key).collect();
        let _ = client.remove(&ns, &hashes).await;
    }
    let t = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let token_rate = t(&totals.hit_tokens) as f64 / t(&totals.tokens).max(1) as f64;
    let block_rate = t(&totals.hit_blocks) as f64 / t(&totals.blocks).max(1) as f64;
    let lat = latencies.lock();
    let q = |h: &Histogram<u64>, p: f64| h.value_at_quantile(p);
    if args.json {
        let mut out = json!({
                "requests": requests.len(), "workers": args.workers, "speed": args.speed,
                "block_bytes": block_size, "seconds": elapsed,
                "requests_per_sec": requests.len() as f64 / elapsed,
                "token_hit_rate": token_rate, "block_hit_rate": block_rate,
                "hit_tokens": t(&totals.hit_tokens), "tokens": t(&totals.tokens),
                "theoretical_token_hit_rate": theoretical.token_hit_rate(),
                "theoretical_hit_tokens": theoretical.hit_tokens,
                "lru_capacity_blocks": capacity_blocks, "footprint_blocks": footprint,
                "lru_token_hit_rate": lru.token_hit_rate(), "lru_block_hit_rate": lru.block_hit_rate(),
                "bytes_read": t(&totals.read), "bytes_written": t(&totals.written),
                "lost_after_match": t(&totals.lost_after_match), "wrong_bytes": t(&totals.wrong),
                "errors": t(&totals.errors),
                "match_p50_us": q(&lat.matches, 0.5), "match_p99_us": q(&lat.matches, 0.99),
                "get_p50_us": q(&lat.gets, 0.5), "get_p99_us": q(&lat.gets, 0.99),
                "put_p50_us": q(&lat.puts, 0.5), "put_p99_us": q(&lat.puts, 0.99),
        });
        for (order, r) in &daemon {
            out[format!("simulated_{order}_token_hit_rate")] = json!(r.token_hit_rate());
            out[format!("simulated_{order}_block_hit_rate")] = json!(r.block_hit_rate());
        }
        println!("{out}");
        return Ok(());
    }
    let moved = t(&totals.read) + t(&totals.written);
    println!(
        "replayed {} requests in {:.1} s with {} workers: {:.0} requests/s, {:.2} GB/s ({} blocks of {})",
        requests.len(),
        elapsed,
        args.workers,
        requests.len() as f64 / elapsed,
        moved as f64 / elapsed / 1e9,
        t(&totals.blocks),
        ByteSize(block_size as u64)
    );
    let simulated = |rate: fn(&trace::SimResult) -> f64| {
        daemon
            .iter()
            .map(|(order, r)| format!("   daemon {order} {:>6.2}%", 100.0 * rate(r)))
            .collect::<String>()
    };
    println!(
        "token hit rate  {:>6.2}%   theoretical max {:>6.2}%   exact LRU of {} blocks {:>6.2}%{}   (simulated; footprint {} blocks)",
        100.0 * token_rate,
        100.0 * theoretical.token_hit_rate(),
        capacity_blocks,
        100.0 * lru.token_hit_rate(),
        simulated(trace::SimResult::token_hit_rate),
        footprint
    );
    println!(
        "block hit rate  {:>6.2}%   theoretical max {:>6.2}%   exact LRU {:>6.2}%{}",
        100.0 * block_rate,
        100.0 * theoretical.block_hit_rate(),
        100.0 * lru.block_hit_rate(),
        simulated(trace::SimResult::block_hit_rate)
    );
    if args.workers > 1 && footprint <= capacity_blocks && token_rate < theoretical.token_hit_rate()
    {
        println!(
            "                (below the maximum with room for every block: with {} requests in flight, one that shares a prefix with a request still being served misses the blocks that request has not stored yet; --workers 1 replays one at a time)",
            args.workers
        );
    }
    println!(
        "bytes           read {}, written {}",
        ByteSize(t(&totals.read)),
        ByteSize(t(&totals.written))
    );
    for (name, h) in [
        ("match", &lat.matches),
        ("get", &lat.gets),
        ("put", &lat.puts),
    ] {
        println!(
            "{name:<6} latency  p50 {:>7} us   p99 {:>7} us   p999 {:>7} us",
            q(h, 0.5),
            q(h, 0.99),
            q(h, 0.999)
        );
    }
    println!(
        "matched then gone: {}   wrong bytes: {}   errors: {}",
        t(&totals.lost_after_match),
        t(&totals.wrong),
        t(&totals.errors)
    );
    Ok(())
}

#[allow(
    clippy::too_many_arguments,
    reason = "one request's whole context, kept flat on purpose"
)]
async fn one_request(
    client: &Client,
    ns: &Namespace,
    req: &Request,
    (block_tokens, chained, calls): (u64, bool, Calls),
    value: &mut [u8],
    bufs: &mut Vec<Vec<u8>>,
    totals: &Totals,
    latencies: &Mutex<Latencies>,
) {
    let chain: Vec<BlockHash> = req.hash_ids.iter().map(|id| key(*id)).collect();
    totals.tokens.fetch_add(req.input_length, Ordering::Relaxed);
    totals
        .blocks
        .fetch_add(chain.len() as u64, Ordering::Relaxed);

    let t = Instant::now();
    let matched = match calls {
        Calls::Chains => client.match_prefix(ns, &chain).await.map(|m| m.matched),
        Calls::Engines => client
            .exists(ns, &chain)
            .await
            .map(|found| found.iter().take_while(|f| **f).count()),
        Calls::Lmcache => one_key_at_a_time(client, ns, &chain).await,
    };
    let matched = match matched {
        Ok(m) => m,
        Err(_) => {
            totals.errors.fetch_add(1, Ordering::Relaxed);
            0
        }
    };
    latencies
        .lock()
        .matches
        .saturating_record(t.elapsed().as_micros() as u64);

    // Read the matched head into buffers; a block evicted since the match
    // ends the usable prefix there.
    let mut usable = matched;
    if matched > 0 {
        let block = value.len();
        while bufs.len() < matched {
            bufs.push(vec![0u8; block]);
        }
        let t = Instant::now();
        let mut slices: Vec<&mut [u8]> = bufs[..matched].iter_mut().map(|b| &mut b[..]).collect();
        let outcomes = client.get_into(ns, &chain[..matched], &mut slices).await;
        latencies
            .lock()
            .gets
            .saturating_record(t.elapsed().as_micros() as u64);
        match outcomes {
            Ok(outcomes) => {
                usable = outcomes
                    .iter()
                    .take_while(|o| matches!(o, GetOutcome::Hit(_)))
                    .count();
                for (id, buf) in req.hash_ids.iter().zip(bufs.iter()).take(usable) {
                    fill(*id, value);
                    if buf[..] != value[..] {
                        totals.wrong.fetch_add(1, Ordering::Relaxed);
                    }
                }
                totals
                    .read
                    .fetch_add((usable * block) as u64, Ordering::Relaxed);
                totals
                    .lost_after_match
                    .fetch_add((matched - usable) as u64, Ordering::Relaxed);
            }
            Err(_) => {
                usable = 0;
                totals.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    totals.hit_tokens.fetch_add(
        trace::hit_tokens(req, usable, block_tokens),
        Ordering::Relaxed,
    );
    totals
        .hit_blocks
        .fetch_add(usable as u64, Ordering::Relaxed);

    // Publish what had to be computed: the blocks after the usable head.
    if usable < chain.len() {
        let missing: Vec<Vec<u8>> = req.hash_ids[usable..]
            .iter()
            .map(|id| {
                let mut v = vec![0u8; value.len()];
                fill(*id, &mut v);
                v
            })
            .collect();
        let blocks: Vec<(BlockHash, &[u8])> = chain[usable..]
            .iter()
            .zip(&missing)
            .map(|(h, v)| (*h, &v[..]))
            .collect();
        let t = Instant::now();
        // As a chain: the daemons then evict it from its tail.
        let parent = usable.checked_sub(1).map(|i| chain[i]);
        let put = match (chained, calls) {
            (true, _) => client.put_chain(ns, parent, &blocks).await,
            (false, Calls::Chains) => client.put(ns, &blocks).await,
            // `mooncake.store`'s puts: in order, naming no parent.
            (false, Calls::Engines | Calls::Lmcache) => {
                let opts = PutOptions {
                    in_order: true,
                    ..Default::default()
                };
                client.put_with(ns, &blocks, opts).await
            }
        };
        match put {
            Ok(outs) => {
                let stored = outs.iter().filter(|o| **o == PutOutcome::Stored).count();
                totals
                    .written
                    .fetch_add((stored * value.len()) as u64, Ordering::Relaxed);
                if outs.iter().any(|o| matches!(o, PutOutcome::Failed(_))) {
                    totals.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(_) => {
                totals.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        latencies
            .lock()
            .puts
            .saturating_record(t.elapsed().as_micros() as u64);
    }
}
