//! `simulate TRACE`: offline hit rates of a trace against cache size: an
//! exact LRU, the daemon's own DRAM pool under each of its eviction orders
//! (`lru`, `2q`: the daemon's code, so what it predicts is what a daemon of
//! that size does), a frequency oracle (the fewest uses left evicted: what
//! knowing how often each block comes back would keep, the yardstick of
//! orders that rank by frequency) and Belady's MIN (the farthest next use
//! evicted: what knowing when would keep), with the trace's theoretical maximum,
//! as a table and an SVG plot. No store needed: it answers "how much cache
//! does this traffic need, and how far is each order from the best".

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use mooncake_store_daemon::pool::{Eviction, PROBATION_SHARE};
use serde_json::json;

use crate::exit::Failure;
use crate::svg::{line_chart, Series};
use crate::tiers_sim::{self, Demote, Nvme, TierResult};
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
    /// The daemon's `probation_share` under 2Q (what one would set in its
    /// config).
    #[arg(long, default_value_t = PROBATION_SHARE)]
    probation_share: f64,
    /// An NVMe tier of this many blocks behind each DRAM size (the
    /// daemon's 2q pool): adds, per size, the hit rate of both tiers with
    /// the drive in each order (`lru`, and `2q` as the daemon keeps it),
    /// with only the blocks read in DRAM demoted, the drive's writes for
    /// each, and an exact LRU and Belady's MIN of both sizes together.
    #[arg(long)]
    nvme: Option<usize>,
    /// With --nvme: reads from the drive after which a block is copied
    /// back into DRAM (the daemon's `promote_after`; 0: never).
    #[arg(long, default_value_t = 2)]
    promote_after: u32,
    /// Also split each cache size over this many daemons, as a cluster
    /// holds it: adds the hit rate of each order there (blocks placed as
    /// the meta service places them in a full cluster).
    #[arg(long)]
    daemons: Option<usize>,
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
    /// The daemon's pool, in the order of `Eviction::ALL`.
    pool: Vec<f64>,
    /// `trace::simulate_frequency_oracle`.
    freq: f64,
    min: f64,
    /// With a drive behind the pool.
    tiers: Option<Tiers>,
    /// The same memory over `--daemons` daemons, in the order of
    /// `Eviction::ALL`.
    cluster: Option<Vec<f64>>,
}

/// One DRAM size with a drive behind it.
struct Tiers {
    /// Every evicted block demoted, the drive an LRU (the daemon before
    /// the drive had its own 2Q).
    lru: TierResult,
    /// Every evicted block demoted, the drive in 2Q (the daemon).
    two_q: TierResult,
    /// Only blocks read in DRAM demoted, the drive in 2Q.
    read: TierResult,
    /// An exact LRU and MIN of the two sizes together.
    lru_of_both: f64,
    min_of_both: f64,
}

impl Row {
    fn pool(&self, order: Eviction) -> f64 {
        self.pool[order_index(order)]
    }

    /// Split over `--daemons` daemons, if asked.
    fn cluster(&self, order: Eviction) -> Option<f64> {
        Some(self.cluster.as_ref()?[order_index(order)])
    }
}

fn order_index(order: Eviction) -> usize {
    let i = Eviction::ALL.iter().position(|o| *o == order);
    i.expect("every order is simulated")
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
    if !(args.probation_share > 0.0 && args.probation_share < 1.0) {
        return Err(Failure::usage(
            "--probation-share must be above 0 and below 1",
        ));
    }
    if capacities.contains(&0) {
        return Err(Failure::usage("--capacities must be at least 1 block each"));
    }
    if let Some(n) = args.daemons {
        if n < 2 || capacities.iter().any(|c| *c < n) {
            return Err(Failure::usage(
                "--daemons must be at least 2, and at most the smallest cache size",
            ));
        }
    }
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(capacities.len() as u64).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} cache sizes {elapsed}")
                .expect("a valid template"),
        )
    };
    let mut rows = Vec::with_capacity(capacities.len());
    for &cap in &capacities {
        let pool = |order| trace::Pool {
            probation_share: args.probation_share,
            ..trace::Pool::new(cap, order)
        };
        let mut rates = Vec::new();
        for order in Eviction::ALL {
            let r = trace::simulate_pool(&requests, pool(order), args.block_tokens)
                .map_err(Failure::other)?;
            rates.push(r.token_hit_rate());
        }
        let cluster = match args.daemons {
            Some(n) => Some(
                Eviction::ALL
                    .iter()
                    .map(|order| {
                        trace::simulate_cluster(&requests, pool(*order), n, args.block_tokens)
                            .map(|r| r.token_hit_rate())
                    })
                    .collect::<anyhow::Result<Vec<f64>>>()
                    .map_err(Failure::other)?,
            ),
            None => None,
        };
        let tiers = match args.nvme {
            Some(drive) => Some(tiers(&args, &requests, cap, drive)?),
            None => None,
        };
        rows.push(Row {
            cap,
            lru: trace::simulate_lru(&requests, Some(cap), args.block_tokens).token_hit_rate(),
            pool: rates,
            freq: trace::simulate_frequency_oracle(&requests, cap, args.block_tokens)
                .token_hit_rate(),
            min: trace::simulate_belady(&requests, cap, args.block_tokens).token_hit_rate(),
            tiers,
            cluster,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(path) = &args.svg {
        let mut series = vec![
            Series {
                name: "Belady's MIN",
                color: "#2ca02c",
                points: rows.iter().map(|r| (r.cap as f64, r.min)).collect(),
            },
            Series {
                name: "frequency oracle",
                color: "#9467bd",
                points: rows.iter().map(|r| (r.cap as f64, r.freq)).collect(),
            },
            Series {
                name: "daemon, 2q",
                color: "#1f77b4",
                points: rows
                    .iter()
                    .map(|r| (r.cap as f64, r.pool(Eviction::TwoQ)))
                    .collect(),
            },
            Series {
                name: "daemon, lru",
                color: "#ff7f0e",
                points: rows
                    .iter()
                    .map(|r| (r.cap as f64, r.pool(Eviction::Lru)))
                    .collect(),
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
        ];
        let split = args.daemons.map(|n| {
            [
                (Eviction::TwoQ, format!("{n} daemons, 2q"), "#17becf"),
                (Eviction::Lru, format!("{n} daemons, lru"), "#e377c2"),
            ]
        });
        for (order, name, color) in split.iter().flatten() {
            let points = rows
                .iter()
                .filter_map(|r| Some((r.cap as f64, r.cluster(*order)?)));
            series.push(Series {
                name,
                color,
                points: points.collect(),
            });
        }
        let svg = line_chart(
            &format!(
                "Token hit rate against cache size ({} requests)",
                requests.len()
            ),
            "cache size (blocks)",
            "token hit rate",
            &series,
        );
        std::fs::write(path, svg)
            .map_err(|e| Failure::other(anyhow::anyhow!("cannot write {}: {e}", path.display())))?;
    }
    if args.json {
        let points: Vec<_> = rows
            .iter()
            .map(|r| {
                let mut point = json!({"capacity_blocks": r.cap, "lru_token_hit_rate": r.lru,
                                       "frequency_oracle_token_hit_rate": r.freq,
                                       "min_token_hit_rate": r.min});
                for order in Eviction::ALL {
                    point[format!("daemon_{order}_token_hit_rate")] = json!(r.pool(order));
                }
                if let (Some(n), Some(_)) = (args.daemons, &r.cluster) {
                    let mut split = json!({"count": n});
                    for order in Eviction::ALL {
                        split[format!("{order}_token_hit_rate")] = json!(r.cluster(order));
                    }
                    point["daemons"] = split;
                }
                if let Some(t) = &r.tiers {
                    point["nvme"] = json!({
                        "drive_2q_token_hit_rate": t.two_q.hits.token_hit_rate(),
                        "drive_2q_nvme_writes": t.two_q.nvme_writes,
                        "drive_2q_nvme_hit_blocks": t.two_q.nvme_hits,
                        "drive_lru_token_hit_rate": t.lru.hits.token_hit_rate(),
                        "drive_lru_nvme_writes": t.lru.nvme_writes,
                        "drive_lru_nvme_hit_blocks": t.lru.nvme_hits,
                        "demote_read_token_hit_rate": t.read.hits.token_hit_rate(),
                        "demote_read_nvme_writes": t.read.nvme_writes,
                        "demote_read_nvme_hit_blocks": t.read.nvme_hits,
                        "lru_token_hit_rate": t.lru_of_both,
                        "min_token_hit_rate": t.min_of_both,
                    });
                }
                point
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
        "{:>10} {:>8} {:>10} {:>12} {:>11} {:>12} {:>12} {:>12}",
        "blocks",
        "of max",
        "exact LRU",
        "daemon lru",
        "daemon 2q",
        "freq oracle",
        "Belady MIN",
        "2q closes"
    );
    for r in &rows {
        // How much of the distance from exact LRU to MIN 2Q covers.
        let closed = if r.min > r.lru {
            format!(
                "{:.0}%",
                100.0 * (r.pool(Eviction::TwoQ) - r.lru) / (r.min - r.lru)
            )
        } else {
            "-".into()
        };
        println!(
            "{:>10} {:>7.0}% {:>9.2}% {:>11.2}% {:>10.2}% {:>11.2}% {:>11.2}% {:>12}",
            r.cap,
            100.0 * r.cap as f64 / footprint as f64,
            100.0 * r.lru,
            100.0 * r.pool(Eviction::Lru),
            100.0 * r.pool(Eviction::TwoQ),
            100.0 * r.freq,
            100.0 * r.min,
            closed
        );
    }
    if let Some(n) = args.daemons {
        print_cluster(&rows, n);
    }
    if let Some(drive) = args.nvme {
        print_tiers(&rows, drive, args.promote_after);
    }
    if let Some(path) = &args.svg {
        println!("plot: {}", path.display());
    }
    Ok(())
}

fn print_cluster(rows: &[Row], n: usize) {
    println!();
    println!("the same memory over {n} daemons, blocks placed as the meta service places them:");
    println!(
        "{:>10} {:>12} {:>16} {:>11} {:>15}",
        "blocks",
        "daemon lru",
        format!("{n} daemons lru"),
        "daemon 2q",
        format!("{n} daemons 2q")
    );
    for r in rows {
        let (Some(lru), Some(two_q)) = (r.cluster(Eviction::Lru), r.cluster(Eviction::TwoQ)) else {
            continue;
        };
        println!(
            "{:>10} {:>11.2}% {:>15.2}% {:>10.2}% {:>14.2}%",
            r.cap,
            100.0 * r.pool(Eviction::Lru),
            100.0 * lru,
            100.0 * r.pool(Eviction::TwoQ),
            100.0 * two_q,
        );
    }
}

/// The daemon's 2q pool of `cap` blocks with a drive of `drive` blocks
/// behind it, with the drive in each order and under each demotion choice.
fn tiers(
    args: &SimulateArgs,
    requests: &[trace::Request],
    cap: usize,
    drive: usize,
) -> Result<Tiers, Failure> {
    let run = |demote, order| {
        let pool = trace::Pool {
            probation_share: args.probation_share,
            ..trace::Pool::new(cap, Eviction::TwoQ)
        };
        let nvme = Nvme {
            capacity: drive,
            promote_after: args.promote_after,
            demote,
            order,
            probation_share: args.probation_share,
        };
        tiers_sim::simulate(requests, pool, nvme, args.block_tokens).map_err(Failure::other)
    };
    let both = cap + drive;
    Ok(Tiers {
        lru: run(Demote::All, Eviction::Lru)?,
        two_q: run(Demote::All, Eviction::TwoQ)?,
        read: run(Demote::Read, Eviction::TwoQ)?,
        lru_of_both: trace::simulate_lru(requests, Some(both), args.block_tokens).token_hit_rate(),
        min_of_both: trace::simulate_belady(requests, both, args.block_tokens).token_hit_rate(),
    })
}

fn print_tiers(rows: &[Row], drive: usize, promote_after: u32) {
    println!();
    println!(
        "with an NVMe tier of {drive} blocks behind the daemon's 2q pool (promote after {promote_after} drive reads), the drive as an LRU and in 2q (the daemon):"
    );
    println!(
        "{:>10} {:>10} {:>13} {:>11} {:>13} {:>11} {:>13} {:>11} {:>13} {:>12}",
        "DRAM",
        "DRAM only",
        "drive lru",
        "writes",
        "drive 2q",
        "writes",
        "2q, read",
        "writes",
        "LRU of both",
        "MIN of both"
    );
    for r in rows {
        let Some(t) = &r.tiers else {
            continue;
        };
        println!(
            "{:>10} {:>9.2}% {:>12.2}% {:>11} {:>12.2}% {:>11} {:>12.2}% {:>11} {:>12.2}% {:>11.2}%",
            r.cap,
            100.0 * r.pool(Eviction::TwoQ),
            100.0 * t.lru.hits.token_hit_rate(),
            t.lru.nvme_writes,
            100.0 * t.two_q.hits.token_hit_rate(),
            t.two_q.nvme_writes,
            100.0 * t.read.hits.token_hit_rate(),
            t.read.nvme_writes,
            100.0 * t.lru_of_both,
            100.0 * t.min_of_both,
        );
    }
}
