//! `simulate TRACE`: offline hit rates of a trace against cache size, for
//! exact LRU and the prefix-aware policy (tails first), beside Belady's MIN
//! (the farthest next use evicted: what knowing the future would keep) and
//! the trace's theoretical maximum, as a table and an SVG plot. No store
//! needed: it answers "how much cache does this traffic need, and how far
//! is each policy from the best possible".

use std::path::PathBuf;

use serde_json::json;

use crate::exit::Failure;
use crate::svg::{line_chart, Series};
use crate::trace;

#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// The trace: JSON lines with timestamp, input_length, hash_ids.
    trace: PathBuf,
    /// Tokens per block of the trace's hash_ids.
    #[arg(long, default_value_t = 512)]
    block_tokens: u64,
    /// Cache sizes tried, evenly spaced up to the trace's footprint.
    #[arg(long, default_value_t = 20)]
    points: usize,
    /// Cache sizes tried (blocks), instead of `--points`: e.g.
    /// 2000,4000,8000,16000.
    #[arg(long, value_delimiter = ',')]
    capacities: Vec<usize>,
    /// Write the curves here as an SVG plot.
    #[arg(long)]
    svg: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// Token hit rates at one cache size.
struct Row {
    cap: usize,
    lru: f64,
    aware: f64,
    min: f64,
}

pub fn run(args: SimulateArgs) -> Result<(), Failure> {
    if args.points == 0 || args.block_tokens == 0 {
        return Err(Failure::usage(
            "--points and --block-tokens must be at least 1",
        ));
    }
    let requests = trace::load(&args.trace, None)?;
    let footprint = trace::footprint(&requests);
    let max = trace::simulate_lru(&requests, None, args.block_tokens).token_hit_rate();
    let capacities: Vec<usize> = if args.capacities.is_empty() {
        (1..=args.points)
            .map(|i| (footprint * i / args.points).max(1))
            .collect()
    } else {
        args.capacities.clone()
    };
    if capacities.contains(&0) {
        return Err(Failure::usage("--capacities must be at least 1 block each"));
    }
    let rows: Vec<Row> = capacities
        .iter()
        .map(|&cap| Row {
            cap,
            lru: trace::simulate_lru(&requests, Some(cap), args.block_tokens).token_hit_rate(),
            aware: trace::simulate_prefix_aware(&requests, cap, args.block_tokens).token_hit_rate(),
            min: trace::simulate_belady(&requests, cap, args.block_tokens).token_hit_rate(),
        })
        .collect();
    if let Some(path) = &args.svg {
        let svg = line_chart(
            &format!(
                "Token hit rate against cache size ({} requests)",
                requests.len()
            ),
            "cache size (blocks)",
            "token hit rate",
            &[
                Series {
                    name: "Belady's MIN (knows the future)",
                    color: "#2ca02c",
                    points: rows.iter().map(|r| (r.cap as f64, r.min)).collect(),
                },
                Series {
                    name: "prefix-aware (tails first)",
                    color: "#1f77b4",
                    points: rows.iter().map(|r| (r.cap as f64, r.aware)).collect(),
                },
                Series {
                    name: "exact LRU",
                    color: "#d62728",
                    points: rows.iter().map(|r| (r.cap as f64, r.lru)).collect(),
                },
                Series {
                    name: "theoretical maximum",
                    color: "#999999",
                    points: vec![(0.0, max), (footprint as f64, max)],
                },
            ],
        );
        std::fs::write(path, svg)
            .map_err(|e| Failure::other(anyhow::anyhow!("cannot write {}: {e}", path.display())))?;
    }
    if args.json {
        let points: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({"capacity_blocks": r.cap, "lru_token_hit_rate": r.lru,
                            "prefix_aware_token_hit_rate": r.aware, "min_token_hit_rate": r.min})
            })
            .collect();
        println!(
            "{}",
            json!({"requests": requests.len(), "footprint_blocks": footprint,
                   "theoretical_token_hit_rate": max, "points": points})
        );
        return Ok(());
    }
    println!(
        "{} requests, footprint {} blocks, theoretical token hit rate {:.2}%",
        requests.len(),
        footprint,
        100.0 * max
    );
    println!(
        "{:>10} {:>8} {:>10} {:>14} {:>12} {:>12}",
        "blocks", "of max", "LRU", "prefix-aware", "Belady MIN", "gap closed"
    );
    for r in &rows {
        // How much of the distance from LRU to MIN the prefix-aware policy
        // covers.
        let closed = if r.min > r.lru {
            format!("{:.0}%", 100.0 * (r.aware - r.lru) / (r.min - r.lru))
        } else {
            "-".into()
        };
        println!(
            "{:>10} {:>7.0}% {:>9.2}% {:>13.2}% {:>11.2}% {:>12}",
            r.cap,
            100.0 * r.cap as f64 / footprint as f64,
            100.0 * r.lru,
            100.0 * r.aware,
            100.0 * r.min,
            closed
        );
    }
    if let Some(path) = &args.svg {
        println!("plot: {}", path.display());
    }
    Ok(())
}
