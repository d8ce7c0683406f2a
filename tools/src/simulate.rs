//! `simulate TRACE`: offline hit rates of a trace against cache size, for
//! exact LRU and the prefix-aware policy (tails first), with the trace's
//! theoretical maximum, as a table and an SVG plot. No store needed: it
//! answers "how much cache does this traffic need, and which policy".

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
    /// Write the curves here as an SVG plot.
    #[arg(long)]
    svg: Option<PathBuf>,
    #[arg(long)]
    json: bool,
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
    let rows: Vec<(usize, f64, f64)> = (1..=args.points)
        .map(|i| {
            let cap = (footprint * i / args.points).max(1);
            let lru = trace::simulate_lru(&requests, Some(cap), args.block_tokens).token_hit_rate();
            let aware =
                trace::simulate_prefix_aware(&requests, cap, args.block_tokens).token_hit_rate();
            (cap, lru, aware)
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
                    name: "prefix-aware (tails first)",
                    color: "#1f77b4",
                    points: rows.iter().map(|(c, _, a)| (*c as f64, *a)).collect(),
                },
                Series {
                    name: "exact LRU",
                    color: "#d62728",
                    points: rows.iter().map(|(c, l, _)| (*c as f64, *l)).collect(),
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
            .map(|(c, l, a)| json!({"capacity_blocks": c, "lru_token_hit_rate": l, "prefix_aware_token_hit_rate": a}))
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
        "{:>10} {:>8} {:>10} {:>14} {:>8}",
        "blocks", "of max", "LRU", "prefix-aware", "gain"
    );
    for (cap, lru, aware) in &rows {
        println!(
            "{:>10} {:>7.0}% {:>9.2}% {:>13.2}% {:>+7.2}",
            cap,
            100.0 * *cap as f64 / footprint as f64,
            100.0 * lru,
            100.0 * aware,
            100.0 * (aware - lru)
        );
    }
    if let Some(path) = &args.svg {
        println!("plot: {}", path.display());
    }
    Ok(())
}
