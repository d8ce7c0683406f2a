//! `bench`: puts then gets of fixed-size blocks from concurrent workers,
//! reporting ops/s, GB/s and latency percentiles per operation and size.
//! Every byte read is verified by the client's checksum; misses and errors
//! are counted, never hidden.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use mooncake_client::{Client, ClientConfig, GetOutcome, PutOutcome};
use mooncake_local::LocalStore;
use mooncake_proto::units::ByteSize;
use mooncake_proto::{BlockHash, Namespace};
use serde::Serialize;
use tokio::net::TcpListener;

use crate::exit::Failure;
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    target: Target,
    /// Block sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "16KiB,256KiB,4MiB")]
    sizes: Vec<ByteSize>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Gets per size (puts: as many distinct blocks as fit in 60% of the pool, at most this many).
    #[arg(long, default_value_t = 2000)]
    ops: usize,
    /// Blocks per request.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Start a store inside this process (on free loopback ports) instead
    /// of using a running one.
    #[arg(long)]
    embedded: bool,
    /// Bytes of distinct blocks per size (default: 60% of the DRAM pools,
    /// at most --ops blocks). Larger than DRAM, gets exercise the NVMe tier.
    #[arg(long)]
    working_set: Option<ByteSize>,
    /// Leave the blocks stored afterwards (to fill a store for other tests).
    #[arg(long)]
    keep: bool,
    /// DRAM of the embedded store.
    #[arg(long, default_value = "2GiB")]
    dram: ByteSize,
    #[arg(long)]
    json: bool,
    /// Copies of each block put, on distinct hosts (0: the namespace's
    /// default).
    #[arg(long, default_value_t = 0)]
    replicas: u8,
    /// Gets pick blocks by a Zipf law of this exponent (a few hot blocks,
    /// a long tail), seeded per process; 0 reads them in turn.
    #[arg(long, default_value_t = 0.0)]
    zipf: f64,
    /// Names the blocks (default: random per run), so that several
    /// processes read the same ones: one puts them with --keep, the others
    /// read them with --reads-only.
    #[arg(long)]
    run_id: Option<u64>,
    /// Only the gets, of blocks another run with the same --run-id put
    /// and kept.
    #[arg(long)]
    reads_only: bool,
    /// Bytes of distinct memory the puts are written from, block after
    /// block (default: one block's, written again and again, as
    /// redis-benchmark and memtier do, so that it stays in the CPU's
    /// cache). An engine's KV pool is never in cache: give a request's
    /// bytes or more to measure puts as an engine makes them.
    #[arg(long)]
    put_from: Option<ByteSize>,
}

/// Block indexes drawn by a Zipf law over `n` blocks: index 0 the hottest.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, exponent: f64) -> Self {
        let mut total = 0.0;
        let cdf = (1..=n)
            .map(|k| {
                total += 1.0 / (k as f64).powf(exponent);
                total
            })
            .collect::<Vec<f64>>();
        Zipf {
            cdf: cdf.into_iter().map(|c| c / total).collect(),
        }
    }

    fn sample(&self, u: f64) -> usize {
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

#[derive(Serialize)]
struct Row {
    op: &'static str,
    size: u64,
    ops: u64,
    seconds: f64,
    ops_per_sec: f64,
    gb_per_sec: f64,
    p50_us: u64,
    p99_us: u64,
    p999_us: u64,
    misses: u64,
    errors: u64,
    /// The same-host pool's pages, when the blocks moved through it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pool_pages: Option<String>,
}

pub async fn run(args: BenchArgs) -> Result<(), Failure> {
    if args.concurrency == 0 || args.batch == 0 || args.ops == 0 {
        return Err(Failure::usage(
            "--concurrency, --batch and --ops must be at least 1",
        ));
    }
    let embedded = match args.embedded {
        true => Some(start_embedded(args.dram).await?),
        false => None,
    };
    let client = Arc::new(match &embedded {
        Some(store) => {
            Client::new(ClientConfig::new(store.meta_addr()).with_timeout(args.target.timeout))
        }
        None => crate::blocks::client(&args.target).await?,
    });
    if client.config().shm_socket.is_some() {
        // Timed calls should not share a core with setting up the link.
        let started = std::time::Instant::now();
        let ready = client
            .same_host_ready(std::time::Duration::from_secs(60))
            .await;
        eprintln!(
            "same-host link {} in {:.1} s",
            if ready { "ready" } else { "not ready" },
            started.elapsed().as_secs_f64()
        );
    }
    // Page size decides how far the TLB reaches into the pool.
    let pool_pages = client.same_host_pages();
    let capacity = crate::blocks::live_capacity(&client).await?;
    let ns = Namespace::new("bench").expect("valid");
    let run_id: u64 = args.run_id.unwrap_or_else(rand::random);
    if args.reads_only && args.run_id.is_none() {
        return Err(Failure::usage(
            "--reads-only needs the --run-id of the run that put the blocks",
        ));
    }
    let opts = mooncake_client::PutOptions::copies(args.replicas);
    let mut rows = Vec::new();
    for size in &args.sizes {
        let size = size.0 as usize;
        let keys = match args.working_set {
            Some(bytes) => (bytes.0 as usize / size.max(1)).max(1),
            None => ((capacity as f64 * 0.6) as usize / size.max(1)).clamp(1, args.ops),
        };
        let hashes: Arc<Vec<BlockHash>> = Arc::new(
            (0..keys)
                .map(|i| BlockHash::from_opaque(format!("bench-{run_id}-{size}-{i}").as_bytes()))
                .collect(),
        );
        // Puts cycle through `sources` blocks of distinct bytes.
        let sources = args
            .put_from
            .map_or(1, |b| (b.0 as usize / size.max(1)).max(1));
        let value: Arc<Vec<u8>> =
            Arc::new((0..size * sources).map(|_| rand::random::<u8>()).collect());
        let bar = progress(&args, keys + args.ops, size);
        let puts = if args.reads_only { 0 } else { keys };
        let put = phase(&args, "put", size, puts, &bar, {
            let (client, ns, hashes, value) =
                (client.clone(), ns.clone(), hashes.clone(), value.clone());
            move |range: std::ops::Range<usize>, _buf: &mut Vec<Vec<u8>>| {
                let (client, ns, hashes, value) =
                    (client.clone(), ns.clone(), hashes.clone(), value.clone());
                async move {
                    let blocks: Vec<(BlockHash, &[u8])> = range
                        .map(|i| {
                            let at = i % sources * size;
                            (hashes[i], &value[at..at + size])
                        })
                        .collect();
                    match client.put_with(&ns, &blocks, opts).await {
                        Ok(outs) => outs.iter().fold((0, 0), |(m, e), o| match o {
                            PutOutcome::Stored
                            | PutOutcome::Short { .. }
                            | PutOutcome::AlreadyExists => (m, e),
                            PutOutcome::Failed(_) => (m, e + 1),
                        }),
                        Err(_) => (0, blocks.len() as u64),
                    }
                }
            }
        })
        .await;
        let zipf = Arc::new((args.zipf > 0.0).then(|| Zipf::new(keys, args.zipf)));
        let get = phase(&args, "get", size, args.ops, &bar, {
            let (client, ns, hashes) = (client.clone(), ns.clone(), hashes.clone());
            move |range: std::ops::Range<usize>, bufs: &mut Vec<Vec<u8>>| {
                let (client, ns, hashes) = (client.clone(), ns.clone(), hashes.clone());
                let zipf = zipf.clone();
                let n = range.len();
                while bufs.len() < n {
                    bufs.push(vec![0u8; size]);
                }
                let mut taken: Vec<Vec<u8>> = bufs.drain(..n).collect();
                let keys: Vec<BlockHash> = match zipf.as_ref() {
                    Some(z) => range
                        .map(|_| hashes[z.sample(rand::random::<f64>())])
                        .collect(),
                    None => range.map(|i| hashes[i % hashes.len()]).collect(),
                };
                async move {
                    let mut slices: Vec<&mut [u8]> = taken.iter_mut().map(|b| &mut b[..]).collect();
                    let counts = match client.get_into(&ns, &keys, &mut slices).await {
                        Ok(outs) => outs.iter().fold((0, 0), |(m, e), o| match o {
                            GetOutcome::Hit(_) => (m, e),
                            GetOutcome::Miss => (m + 1, e),
                            GetOutcome::Failed(_) => (m, e + 1),
                        }),
                        Err(_) => (0, keys.len() as u64),
                    };
                    drop(slices);
                    (counts, taken)
                }
            }
        })
        .await;
        bar.finish_and_clear();
        if !args.keep && !args.reads_only {
            let _ = client.remove(&ns, &hashes).await;
        }
        let rows_now = if args.reads_only {
            vec![get]
        } else {
            vec![put, get]
        };
        for mut row in rows_now {
            row.pool_pages = pool_pages.clone();
            rows.push(row);
        }
    }
    if let Some(store) = embedded {
        store.stop(Duration::from_secs(10)).await;
    }
    print_rows(&args, &rows);
    // Which paths the blocks really took (a path asked for and not
    // available falls back, and its rows measure the fallback).
    eprintln!("{}", moved_by(&client));
    Ok(())
}

/// A store of its own in this process, on loopback ports.
async fn start_embedded(dram: ByteSize) -> Result<LocalStore, Failure> {
    let meta_listener = TcpListener::bind("127.0.0.1:0").await?;
    let daemon_listener = TcpListener::bind("127.0.0.1:0").await?;
    let daemon = mooncake_store_daemon::DaemonConfig {
        dram,
        ..Default::default()
    };
    LocalStore::start(
        mooncake_meta::MetaConfig::default(),
        meta_listener,
        daemon,
        daemon_listener,
        &prometheus::Registry::new(),
        Duration::from_secs(10),
    )
    .await
    .map_err(|e| Failure::other(e.into()))
}

fn progress(args: &BenchArgs, total: usize, size: usize) -> ProgressBar {
    if args.json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>14} [{bar:30}] {pos}/{len} ops {per_sec}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("{} blocks", ByteSize(size as u64)));
    bar
}

/// Runs `total` operations from `concurrency` workers, each call covering
/// up to `batch` consecutive indexes; `op` returns (misses, errors).
async fn phase<F, Fut, T>(
    args: &BenchArgs,
    name: &'static str,
    size: usize,
    total: usize,
    bar: &ProgressBar,
    op: F,
) -> Row
where
    F: Fn(std::ops::Range<usize>, &mut Vec<Vec<u8>>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: PhaseResult,
{
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (next, op, bar, batch) = (next.clone(), op.clone(), bar.clone(), args.batch);
            tokio::spawn(async move {
                let mut hist = latency_histogram();
                let (mut misses, mut errors) = (0u64, 0u64);
                let mut bufs = Vec::new();
                loop {
                    let first = next.fetch_add(batch, Ordering::Relaxed);
                    if first >= total {
                        break;
                    }
                    let range = first..(first + batch).min(total);
                    let n = range.len() as u64;
                    let t = Instant::now();
                    let ((m, e), returned) = op(range, &mut bufs).await.split();
                    hist.saturating_record(t.elapsed().as_micros() as u64);
                    bufs.extend(returned);
                    misses += m;
                    errors += e;
                    bar.inc(n);
                }
                (hist, misses, errors)
            })
        })
        .collect();
    let mut hist = latency_histogram();
    let (mut misses, mut errors) = (0, 0);
    for w in workers {
        if let Ok((h, m, e)) = w.await {
            hist.add(h).expect("same bounds");
            misses += m;
            errors += e;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Row {
        op: name,
        size: size as u64,
        ops: total as u64,
        seconds,
        ops_per_sec: total as f64 / seconds,
        // Only blocks that arrived count as bytes moved.
        gb_per_sec: (total.saturating_sub((misses + errors) as usize) * size) as f64
            / seconds
            / 1e9,
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
        p999_us: hist.value_at_quantile(0.999),
        misses,
        errors,
        pool_pages: None,
    }
}

/// One line: blocks read and written per transport (through shared
/// memory, also how many went into room held ahead, and how many of those
/// the daemon made visible itself: puts of one round trip), and
/// fallbacks.
fn moved_by(client: &Client) -> String {
    use mooncake_proto::transport::TransportKind;
    let t = client.transports();
    let mut parts: Vec<String> = TransportKind::ALL
        .into_iter()
        .filter(|k| t.reads(*k) + t.writes(*k) > 0)
        .map(|k| match k {
            TransportKind::Shm => format!(
                "{k} {} read, {} written ({} into room held ahead, {} in one round trip)",
                t.reads(k),
                t.writes(k),
                client.shm_room_writes(),
                client.shm_admitted()
            ),
            _ => format!("{k} {} read, {} written", t.reads(k), t.writes(k)),
        })
        .collect();
    for from in TransportKind::ALL {
        for to in TransportKind::ALL {
            let n = t.fallbacks(from, to);
            if n > 0 {
                parts.push(format!("{n} fallbacks {from} -> {to}"));
            }
        }
    }
    format!("blocks by transport: {}", parts.join("; "))
}

/// Latencies from 1 us to 10 min, 3 significant digits. Bounded, so that
/// recording never resizes (and `saturating_record` never clamps real data).
fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")
}

/// What one call of a phase returns: (misses, errors), and buffers to reuse.
trait PhaseResult {
    fn split(self) -> ((u64, u64), Vec<Vec<u8>>);
}

impl PhaseResult for (u64, u64) {
    fn split(self) -> ((u64, u64), Vec<Vec<u8>>) {
        (self, Vec::new())
    }
}

impl PhaseResult for ((u64, u64), Vec<Vec<u8>>) {
    fn split(self) -> ((u64, u64), Vec<Vec<u8>>) {
        self
    }
}

fn print_rows(args: &BenchArgs, rows: &[Row]) {
    if args.json {
        for r in rows {
            println!("{}", serde_json::to_string(r).expect("serializable"));
        }
        return;
    }
    let pages = rows.first().and_then(|r| r.pool_pages.as_deref());
    println!(
        "concurrency {}, {} block(s) per request, every get verified by checksum{}",
        args.concurrency,
        args.batch,
        pages.map_or(String::new(), |p| format!("; same-host pool pages: {p}"))
    );
    println!(
        "{:<4} {:>8} {:>7} {:>10} {:>7} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "op", "size", "ops", "ops/s", "GB/s", "p50 us", "p99 us", "p999 us", "misses", "errors"
    );
    for r in rows {
        println!(
            "{:<4} {:>8} {:>7} {:>10.0} {:>7.2} {:>9} {:>9} {:>9} {:>7} {:>7}",
            r.op,
            ByteSize(r.size).to_string(),
            r.ops,
            r.ops_per_sec,
            r.gb_per_sec,
            r.p50_us,
            r.p99_us,
            r.p999_us,
            r.misses,
            r.errors
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Zipf;

    #[test]
    fn zipf_draws_favour_the_first_blocks_as_the_law_says() {
        let z = Zipf::new(100, 1.0);
        let mut counts = [0u32; 100];
        for i in 0..100_000 {
            counts[z.sample((i as f64 + 0.5) / 100_000.0)] += 1;
        }
        // Harmonic number H(100) is about 5.187: block 0 takes 1/H of the
        // draws, block 1 half of that.
        let share = |k: usize| f64::from(counts[k]) / 100_000.0;
        assert!((share(0) - 1.0 / 5.187).abs() < 0.005, "{}", share(0));
        assert!((share(1) - 0.5 / 5.187).abs() < 0.005, "{}", share(1));
        assert!(counts.iter().all(|c| *c > 0), "every block drawn");
        assert_eq!(z.sample(1.0), 99);
    }
}
