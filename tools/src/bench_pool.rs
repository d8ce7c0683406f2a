//! `bench-pool TRACE`: what an eviction order costs. The daemon's DRAM pool
//! serves a trace's reads and puts (as `simulate` drives it; a put copies
//! and checksums its block, a read leases it) under each order, the orders
//! taking turns round after round in one run; it reports each order's
//! median block operations per second and how far it is from LRU's. At
//! 1 KiB blocks bookkeeping, not bytes, dominates: the worst case for an
//! order's cost.

use std::path::PathBuf;
use std::time::Instant;

use mooncake_proto::units::ByteSize;
use mooncake_store_daemon::pool::Eviction;
use serde_json::json;

use crate::exit::Failure;
use crate::trace;

#[derive(clap::Args, Debug)]
pub struct BenchPoolArgs {
    /// The trace: JSON lines with timestamp, input_length, hash_ids.
    trace: PathBuf,
    /// Pool sizes (blocks), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2000,16000")]
    capacities: Vec<usize>,
    /// Bytes of each block.
    #[arg(long, default_value = "1KiB")]
    block_size: ByteSize,
    /// Runs of the whole trace per order and size; the median is kept.
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// The orders timed, comma separated (one alone: to profile it, for
    /// example under `valgrind --tool=cachegrind`, which counts
    /// instructions the same whatever else the machine runs).
    #[arg(long, value_delimiter = ',', default_value = "lru,2q", value_parser = order)]
    orders: Vec<Eviction>,
    #[arg(long)]
    json: bool,
}

fn order(name: &str) -> Result<Eviction, String> {
    Eviction::ALL
        .into_iter()
        .find(|o| o.name() == name)
        .ok_or_else(|| format!("{name:?}: the orders are lru and 2q"))
}

pub fn run(args: BenchPoolArgs) -> Result<(), Failure> {
    if args.rounds == 0 || args.capacities.contains(&0) {
        return Err(Failure::usage(
            "--rounds and every --capacities entry must be at least 1",
        ));
    }
    let block_bytes = args.block_size.0 as usize;
    if !(1024..=(64 << 20)).contains(&block_bytes) {
        return Err(Failure::usage("--block-size must be 1KiB to 64MiB"));
    }
    let requests = trace::load(&args.trace, None)?;
    let mut rows = Vec::new();
    for &cap in &args.capacities {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); args.orders.len()];
        for _ in 0..args.rounds {
            for (i, &order) in args.orders.iter().enumerate() {
                let pool = trace::Pool {
                    block_bytes,
                    ..trace::Pool::new(cap, order)
                };
                let sim = trace::SimPool::new(&pool).map_err(Failure::other)?;
                let started = Instant::now();
                let r = trace::replay_pool(&requests, &sim, 512).map_err(Failure::other)?;
                // One get or one put per block of each request.
                rates[i].push(r.blocks as f64 / started.elapsed().as_secs_f64());
            }
        }
        let medians: Vec<f64> = rates
            .iter_mut()
            .map(|r| {
                r.sort_by(f64::total_cmp);
                r[r.len() / 2]
            })
            .collect();
        rows.push((cap, medians));
    }
    // Against LRU's rate, where LRU was timed.
    let lru = args.orders.iter().position(|o| *o == Eviction::Lru);
    let vs_lru = |medians: &[f64], ops: f64| lru.map(|l| ops / medians[l]);
    if args.json {
        let points: Vec<_> = rows
            .iter()
            .flat_map(|(cap, medians)| {
                args.orders.iter().zip(medians).map(move |(order, ops)| {
                    json!({"capacity_blocks": cap, "eviction": order.name(),
                           "ops_per_sec": ops, "vs_lru": vs_lru(medians, *ops)})
                })
            })
            .collect();
        println!(
            "{}",
            json!({"requests": requests.len(), "rounds": args.rounds,
                   "block_bytes": block_bytes, "points": points})
        );
        return Ok(());
    }
    println!(
        "{} requests, {} blocks, median of {} runs per order",
        requests.len(),
        args.block_size,
        args.rounds
    );
    println!(
        "{:>10} {:>9} {:>16} {:>8}",
        "blocks", "eviction", "block ops/s", "vs lru"
    );
    for (cap, medians) in &rows {
        for (order, ops) in args.orders.iter().zip(medians) {
            let against = vs_lru(medians, *ops)
                .map_or("-".to_string(), |r| format!("{:.1}%", 100.0 * (r - 1.0)));
            println!(
                "{:>10} {:>9} {:>16.0} {:>8}",
                cap,
                order.name(),
                ops,
                against
            );
        }
    }
    Ok(())
}
