//! `bench-io`: random direct reads through the NVMe tier's I/O engines, to
//! compare with fio on the same file, block size and queue depth
//! (`tools/bench/io.sh` runs both side by side).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mooncake_proto::units::{parse_duration, ByteSize};
use mooncake_store_daemon::io::{self, AlignedBuf, EngineKind, IoKind, IoRequest};
use serde_json::json;

use crate::exit::Failure;

#[derive(clap::Args, Debug)]
pub struct BenchIoArgs {
    /// File (or block device) to read; created and filled if smaller.
    #[arg(long)]
    file: PathBuf,
    /// Bytes of the file the reads spread over.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Bytes per read.
    #[arg(long, default_value = "256KiB")]
    block: ByteSize,
    /// Reads in flight.
    #[arg(long, default_value_t = 32)]
    depth: u32,
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    seconds: Duration,
    /// Engines to run, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "uring,psync")]
    engine: Vec<String>,
    #[arg(long)]
    json: bool,
}

fn kind(name: &str) -> Result<EngineKind, Failure> {
    match name {
        "uring" | "io_uring" => Ok(EngineKind::Uring),
        "psync" => Ok(EngineKind::Psync),
        other => Err(Failure::usage(format!(
            "unknown engine {other:?}: uring or psync"
        ))),
    }
}

pub async fn run(args: BenchIoArgs) -> Result<(), Failure> {
    let block = args.block.0 as usize;
    if block == 0 || block % io::ALIGN != 0 || args.size.0 < block as u64 || args.depth == 0 {
        return Err(Failure::usage(format!(
            "--block must be a positive multiple of {} and at most --size; --depth at least 1",
            io::ALIGN
        )));
    }
    let blocks = args.size.0 / block as u64;
    fill(&args, blocks).await?;
    for name in &args.engine {
        let file = io::open_direct(&args.file)?;
        let engine = Arc::new(io::engine(kind(name)?, file, args.depth)?);
        let deadline = Instant::now() + args.seconds;
        let started = Instant::now();
        let workers: Vec<_> = (0..args.depth)
            .map(|_| {
                let engine = engine.clone();
                tokio::spawn(async move {
                    let mut hist =
                        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
                    let (mut bytes, mut errors) = (0u64, 0u64);
                    let mut buf = Some(AlignedBuf::zeroed(block));
                    while Instant::now() < deadline {
                        let offset = rand::random::<u64>() % blocks * block as u64;
                        let req = IoRequest {
                            offset,
                            buf: buf.take().expect("returned"),
                        };
                        let t = Instant::now();
                        let (b, result) = engine
                            .submit(IoKind::Read, vec![req])
                            .await
                            .pop()
                            .expect("one result");
                        hist.saturating_record(t.elapsed().as_micros() as u64);
                        match result {
                            Ok(n) => bytes += n as u64,
                            Err(_) => errors += 1,
                        }
                        buf = Some(b);
                    }
                    (hist, bytes, errors)
                })
            })
            .collect();
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
        let (mut bytes, mut errors) = (0u64, 0u64);
        for w in workers {
            if let Ok((h, b, e)) = w.await {
                hist.add(h).expect("same bounds");
                bytes += b;
                errors += e;
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let row = json!({"engine": engine.name(), "block": block, "depth": args.depth,
            "gb_per_sec": bytes as f64 / secs / 1e9, "iops": hist.len() as f64 / secs,
            "p50_us": hist.value_at_quantile(0.5), "p99_us": hist.value_at_quantile(0.99), "errors": errors});
        if args.json {
            println!("{row}");
        } else {
            println!(
                "{:<13} {} random reads, depth {}: {:.2} GB/s, {:.0} IOPS, p50 {} us, p99 {} us, {} errors",
                engine.name(),
                ByteSize(block as u64),
                args.depth,
                bytes as f64 / secs / 1e9,
                hist.len() as f64 / secs,
                hist.value_at_quantile(0.5),
                hist.value_at_quantile(0.99),
                errors
            );
        }
    }
    Ok(())
}

/// Writes the file up to `--size` with direct 4 MiB writes, if it is shorter.
async fn fill(args: &BenchIoArgs, blocks: u64) -> Result<(), Failure> {
    let want = blocks * args.block.0;
    let have = std::fs::metadata(&args.file).map(|m| m.len()).unwrap_or(0);
    if have >= want {
        return Ok(());
    }
    let file = io::open_direct(&args.file)?;
    let engine = io::engine(EngineKind::Psync, file, 8)?;
    let chunk = 4usize << 20;
    let mut offset = have / chunk as u64 * chunk as u64;
    while offset < want {
        let batch: Vec<IoRequest> = (0..8)
            .map(|i| offset + i * chunk as u64)
            .filter(|o| *o < want)
            .map(|o| {
                let mut buf = AlignedBuf::zeroed(chunk);
                buf.as_mut_slice().fill((o / chunk as u64) as u8 | 1);
                IoRequest { offset: o, buf }
            })
            .collect();
        let n = batch.len() as u64;
        for (_, r) in engine.submit(IoKind::Write, batch).await {
            r.map_err(|e| {
                Failure::other(anyhow::anyhow!("cannot fill {}: {e}", args.file.display()))
            })?;
        }
        offset += n * chunk as u64;
    }
    Ok(())
}
