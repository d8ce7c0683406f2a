//! `bench-memcpy`: the same-host ceiling for a get, one core copying
//! blocks from a source larger than the caches into a destination buffer,
//! as a client copies a block out of a daemon's shared pool. Reported in
//! the rows `bench` prints, so that scripts set them side by side.

use std::time::Instant;

use hdrhistogram::Histogram;
use mooncake_proto::units::ByteSize;

use crate::exit::Failure;

#[derive(clap::Args, Debug)]
pub struct BenchMemcpyArgs {
    /// Block sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "256KiB,4MiB")]
    sizes: Vec<ByteSize>,
    /// Bytes of source the copies walk through (past the caches).
    #[arg(long, default_value = "1GiB")]
    source: ByteSize,
    /// Copies per size.
    #[arg(long, default_value_t = 4000)]
    ops: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(args: BenchMemcpyArgs) -> Result<(), Failure> {
    let source_len = args.source.0 as usize;
    if args.ops == 0
        || args
            .sizes
            .iter()
            .any(|s| s.0 == 0 || s.0 as usize > source_len)
    {
        return Err(Failure::usage(
            "--ops must be at least 1 and every size between 1B and --source",
        ));
    }
    // Touched once, so that page faults are not what is measured.
    let source: Vec<u8> = (0..source_len).map(|i| (i * 31) as u8).collect();
    for size in &args.sizes {
        let size = size.0 as usize;
        let mut dst = vec![0u8; size];
        let slots = source_len / size;
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
        let started = Instant::now();
        for op in 0..args.ops {
            // A stride through the source, so consecutive copies do not
            // find the previous block in cache.
            let slot = (op * 7919) % slots;
            let t = Instant::now();
            dst.copy_from_slice(&source[slot * size..(slot + 1) * size]);
            std::hint::black_box(&mut dst);
            hist.record(t.elapsed().as_nanos().max(1) as u64)
                .expect("within bounds");
        }
        let seconds = started.elapsed().as_secs_f64();
        let gb = (args.ops * size) as f64 / seconds / 1e9;
        let (p50, p99) = (
            hist.value_at_quantile(0.5) as f64 / 1000.0,
            hist.value_at_quantile(0.99) as f64 / 1000.0,
        );
        if args.json {
            let row = serde_json::json!({
                "op": "memcpy", "size": size, "ops": args.ops, "seconds": seconds,
                "ops_per_sec": args.ops as f64 / seconds, "gb_per_sec": gb,
                "p50_us": p50.round() as u64, "p99_us": p99.round() as u64,
            });
            println!("{row}");
        } else {
            println!(
                "memcpy {:>8}: {gb:.2} GB/s, p50 {p50:.1} us, p99 {p99:.1} us",
                ByteSize(size as u64).to_string()
            );
        }
    }
    Ok(())
}
