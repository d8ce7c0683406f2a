//! `bench-memcpy`: the same-host ceiling for a get, one core copying
//! blocks from a source larger than the caches into a destination buffer,
//! as a client copies a block out of a daemon's shared pool. Reported in
//! the rows `bench` prints, so that scripts set them side by side. Three
//! rows a size: libc's memcpy into a destination at the source's offset
//! in a 4 KiB page (`memcpy`, the ceiling), the same 16 bytes further
//! (`memcpy_16_off`: glibc 2.36 on AMD EPYC copies 8 KiB to a few MiB 5x
//! slower there), and the store's own copy-and-checksum there
//! (`copy_checksum_16_off`, what a same-host get does).

use std::time::Instant;

use hdrhistogram::Histogram;
use mooncake_proto::units::ByteSize;

use mooncake_proto::checksum::copy_with_checksum;

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
        // Room to place the destination at the source's offset in its 4 KiB
        // page, and 16 bytes past it: a buffer from `malloc` (16 bytes into
        // a page) against a page-aligned block of the pool.
        let mut dst = vec![0u8; size + 4096 + 16];
        let same = (source.as_ptr() as usize).wrapping_sub(dst.as_ptr() as usize) % 4096;
        for (op, offset) in [
            ("memcpy", same),
            ("memcpy_16_off", same + 16),
            ("copy_checksum_16_off", same + 16),
        ] {
            let out = &mut dst[offset..offset + size];
            let row = measure(&source, size, args.ops, |src| {
                if op.starts_with("copy_checksum") {
                    std::hint::black_box(copy_with_checksum(out, src));
                } else {
                    out.copy_from_slice(src);
                }
                std::hint::black_box(&mut *out);
            });
            print_row(op, size, args.ops, row, args.json);
        }
    }
    Ok(())
}

/// Seconds, p50 and p99 (us) of `ops` calls of `copy`, each on a block of
/// `size` bytes taken at a stride through `source`, so that consecutive
/// copies do not find the previous block in cache.
fn measure(source: &[u8], size: usize, ops: usize, mut copy: impl FnMut(&[u8])) -> (f64, f64, f64) {
    let slots = source.len() / size;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let started = Instant::now();
    for op in 0..ops {
        let slot = (op * 7919) % slots;
        let t = Instant::now();
        copy(&source[slot * size..(slot + 1) * size]);
        hist.record(t.elapsed().as_nanos().max(1) as u64)
            .expect("within bounds");
    }
    (
        started.elapsed().as_secs_f64(),
        hist.value_at_quantile(0.5) as f64 / 1000.0,
        hist.value_at_quantile(0.99) as f64 / 1000.0,
    )
}

fn print_row(op: &str, size: usize, ops: usize, (seconds, p50, p99): (f64, f64, f64), json: bool) {
    let gb = (ops * size) as f64 / seconds / 1e9;
    if json {
        let row = serde_json::json!({
            "op": op, "size": size, "ops": ops, "seconds": seconds,
            "ops_per_sec": ops as f64 / seconds, "gb_per_sec": gb,
            "p50_us": p50.round() as u64, "p99_us": p99.round() as u64,
        });
        println!("{row}");
    } else {
        println!(
            "{op:<20} {:>8}: {gb:.2} GB/s, p50 {p50:.1} us, p99 {p99:.1} us",
            ByteSize(size as u64).to_string()
        );
    }
}
