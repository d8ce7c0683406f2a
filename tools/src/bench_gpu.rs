//! `bench-gpu`: KV blocks put from and read into GPU memory through the
//! store, beside the GPU's own copies of the same bytes between pinned
//! host memory and the device (what `cudaMemcpy` from pinned memory
//! does), in one run. Before it measures, it checks: device pointers are
//! told from host ones, and blocks of sizes and splits that line up with
//! nothing come back byte for byte. Every measured get is checked too: the
//! bytes that reached the GPU are copied back and compared.

use std::time::Instant;

use mooncake_client::device::cuda::{Cuda, DeviceBuf};
use mooncake_client::device::{Device, Lane, Memory, Pinned, Span};
use mooncake_client::{Client, GetOutcome, PutOptions, PutOutcome};
use mooncake_proto::units::ByteSize;
use mooncake_proto::{BlockHash, Namespace};

use crate::exit::Failure;
use crate::Target;

#[derive(clap::Args, Debug)]
pub struct BenchGpuArgs {
    #[command(flatten)]
    target: Target,
    /// Block sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "256KiB,2MiB")]
    sizes: Vec<ByteSize>,
    /// Bytes of KV blocks moved per call, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "64MiB,1GiB")]
    totals: Vec<ByteSize>,
    /// Measured rounds of each; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The GPU (its CUDA ordinal).
    #[arg(long, default_value_t = 0)]
    gpu: i32,
    #[arg(long)]
    json: bool,
}

/// A failure of the GPU side, in one line.
fn gpu_failure(what: &str, err: impl std::fmt::Display) -> Failure {
    Failure::other(anyhow::anyhow!("{what}: {err}"))
}

pub async fn run(args: BenchGpuArgs) -> Result<(), Failure> {
    if args.rounds == 0 || args.sizes.iter().any(|s| s.0 == 0) {
        return Err(Failure::usage("--rounds and every size must be at least 1"));
    }
    let cuda = Cuda::load().map_err(|e| gpu_failure("no GPU", e))?;
    let gpu_name = cuda
        .device_name(args.gpu)
        .map_err(|e| gpu_failure("GPU", e))?;
    let client = crate::blocks::client(&args.target).await?;
    if client.config().shm_socket.is_some() {
        client
            .same_host_ready(std::time::Duration::from_secs(60))
            .await;
    }
    let device = client
        .device()
        .ok_or_else(|| gpu_failure("the client found no GPU", "see the log"))?;
    eprintln!(
        "{} ({gpu_name}); store path: {}",
        device.name(),
        match client.same_host_pages() {
            Some(pages) => format!("same-host shared pool, {pages} pages"),
            None => "network".to_string(),
        }
    );
    let ns = Namespace::new("bench/gpu").expect("a valid namespace");
    let run_id: u64 = rand::random();
    check(&client, &cuda, &ns, run_id, args.gpu).await?;
    eprintln!("check: device pointers told apart, odd sizes and splits byte for byte: ok");

    let largest = args.totals.iter().map(|t| t.0 as usize).max().unwrap_or(0);
    let mut lane = device
        .lane(args.gpu)
        .map_err(|e| gpu_failure("stream", e))?;
    let mut host = cuda
        .pinned(largest)
        .map_err(|e| gpu_failure("pinned memory", e))?;
    let src = cuda
        .alloc_device(args.gpu, largest)
        .map_err(|e| gpu_failure("device memory", e))?;
    let dst = cuda
        .alloc_device(args.gpu, largest)
        .map_err(|e| gpu_failure("device memory", e))?;
    for (i, b) in host.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7];
    }
    host_rates(&args, host.as_slice(), client.config().copy_threads);
    let mut round = 0u64;
    for total in &args.totals {
        let total = total.0 as usize;
        let mut part = cuda
            .pinned(total)
            .map_err(|e| gpu_failure("pinned memory", e))?;
        part.as_mut_slice()
            .copy_from_slice(&host.as_slice()[..total]);
        for size in &args.sizes {
            let size = size.0 as usize;
            let n = total / size;
            if n == 0 {
                continue;
            }
            let bytes = n * size;
            let mut rates: [Vec<f64>; 4] = Default::default();
            for _ in 0..args.rounds {
                round += 1;
                // The references: the GPU's own copies of the same bytes.
                let t = Instant::now();
                src.write(lane.as_mut(), 0, &part)
                    .map_err(|e| gpu_failure("copy up", e))?;
                rates[0].push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
                let t = Instant::now();
                src.read(lane.as_mut(), 0, &mut part)
                    .map_err(|e| gpu_failure("copy down", e))?;
                rates[1].push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);

                let keys: Vec<BlockHash> = (0..n)
                    .map(|i| BlockHash::from_opaque(format!("{run_id}-{round}-{i}").as_bytes()))
                    .collect();
                let from: Vec<(BlockHash, Vec<Span>)> = keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (*k, vec![Span::new(src.addr() + i * size, size)]))
                    .collect();
                let t = Instant::now();
                // SAFETY: `src` is device memory of `--gpu`, live for the call.
                let put = unsafe {
                    client
                        .put_spans(&ns, &from, None, &[], PutOptions::default())
                        .await
                }
                .map_err(Failure::from)?;
                rates[2].push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
                if let Some((i, o)) = put.iter().enumerate().find(|(_, o)| !o.is_stored()) {
                    return Err(gpu_failure("put from the GPU", format!("block {i}: {o:?}")));
                }
                let into: Vec<Vec<Span>> = (0..n)
                    .map(|i| vec![Span::new(dst.addr() + i * size, size)])
                    .collect();
                let t = Instant::now();
                // SAFETY: `dst` is device memory of `--gpu`, live for the
                // call; the spans are apart.
                let got = unsafe { client.get_into_spans(&ns, &keys, &into).await }
                    .map_err(Failure::from)?;
                rates[3].push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
                if let Some((i, o)) = got
                    .iter()
                    .enumerate()
                    .find(|(_, o)| **o != GetOutcome::Hit(size))
                {
                    return Err(gpu_failure("get into the GPU", format!("block {i}: {o:?}")));
                }
                same_bytes(&dst, lane.as_mut(), &cuda, &host.as_slice()[..bytes])?;
                client.remove(&ns, &keys).await.map_err(Failure::from)?;
            }
            let [up, down, put, get] = rates.map(median);
            print_row(&args, "put_from_gpu", size, n, put, down);
            print_row(&args, "get_into_gpu", size, n, get, up);
        }
    }
    Ok(())
}

/// What this host's CPUs do with the same bytes, to read the rows
/// against: one core's memcpy, and the checksum on one core and on the
/// client's `copy_threads`.
fn host_rates(args: &BenchGpuArgs, bytes: &[u8], threads: usize) {
    let mut copy = vec![0u8; bytes.len()];
    copy.copy_from_slice(bytes); // the pages, touched before the clock runs
    let gbs = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let memcpy = gbs(&mut || copy.copy_from_slice(std::hint::black_box(bytes)));
    let one = gbs(&mut || {
        std::hint::black_box(mooncake_proto::checksum(bytes));
    });
    let per = bytes.len().div_ceil(threads.max(1)).max(1);
    let many = gbs(&mut || {
        std::thread::scope(|s| {
            for part in bytes.chunks(per) {
                s.spawn(move || std::hint::black_box(mooncake_proto::checksum(part)));
            }
        })
    });
    if args.json {
        let row = serde_json::json!({
            "op": "host", "bytes": bytes.len(), "memcpy_gb_per_sec": memcpy,
            "checksum_gb_per_sec": one, "checksum_threads": threads,
            "checksum_threads_gb_per_sec": many,
        });
        println!("{row}");
    } else {
        println!(
            "host ({}): memcpy {memcpy:.2} GB/s on one core; checksum {one:.2} GB/s on one core, {many:.2} GB/s on {threads}",
            ByteSize(bytes.len() as u64)
        );
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One row: the store's rate beside the GPU's copy of the same bytes in
/// the same direction (device to host for puts, host to device for gets).
fn print_row(args: &BenchGpuArgs, op: &str, size: usize, n: usize, gbs: f64, reference: f64) {
    let ratio = gbs / reference;
    let total = ByteSize((n * size) as u64);
    if args.json {
        let row = serde_json::json!({
            "op": op, "size": size, "blocks": n, "bytes": n * size,
            "gb_per_sec": gbs, "copy_gb_per_sec": reference, "of_copy": ratio,
        });
        println!("{row}");
    } else {
        println!(
            "{op:<13} {:>7} x {n:>5} ({total}): {gbs:6.2} GB/s, pinned copy {reference:6.2} GB/s, {:.0}% of it",
            ByteSize(size as u64).to_string(),
            ratio * 100.0
        );
    }
}

/// Copies `dst` back to the host and compares it with `want`.
fn same_bytes(
    dst: &DeviceBuf,
    lane: &mut dyn Lane,
    cuda: &Cuda,
    want: &[u8],
) -> Result<(), Failure> {
    let mut back = cuda
        .pinned(want.len())
        .map_err(|e| gpu_failure("pinned memory", e))?;
    dst.read(lane, 0, &mut back)
        .map_err(|e| gpu_failure("copy down", e))?;
    match back.as_slice().iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(at) => Err(gpu_failure(
            "wrong bytes on the GPU",
            format!("the first differs at byte {at}"),
        )),
    }
}

/// Device pointers are told apart, and blocks of odd sizes, split in
/// pieces at odd places, go up and down byte for byte.
async fn check(
    client: &Client,
    cuda: &Cuda,
    ns: &Namespace,
    run_id: u64,
    gpu: i32,
) -> Result<(), Failure> {
    let sizes = [1usize, 4095, 65_537, (2 << 20) + 3, 31];
    let total: usize = sizes.iter().sum();
    let src = cuda
        .alloc_device(gpu, total)
        .map_err(|e| gpu_failure("device memory", e))?;
    let dst = cuda
        .alloc_device(gpu, total)
        .map_err(|e| gpu_failure("device memory", e))?;
    let mut host: Pinned = cuda
        .pinned(total)
        .map_err(|e| gpu_failure("pinned memory", e))?;
    for (i, b) in host.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
    }
    let heap = Box::new([0u8; 64]);
    let kinds = [
        client.memory_of(src.addr()),
        client.memory_of(src.addr() + total - 1),
        client.memory_of(host.as_ptr() as usize),
        client.memory_of(heap.as_ptr() as usize),
    ];
    if kinds
        != [
            Memory::Device(gpu),
            Memory::Device(gpu),
            Memory::Host,
            Memory::Host,
        ]
    {
        return Err(gpu_failure("pointer classification", format!("{kinds:?}")));
    }
    let mut lane = cuda.lane(gpu).map_err(|e| gpu_failure("stream", e))?;
    src.write(lane.as_mut(), 0, &host)
        .map_err(|e| gpu_failure("copy up", e))?;
    let mut at = 0;
    let mut from = Vec::new();
    let mut into = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let key = BlockHash::from_opaque(format!("{run_id}-check-{i}").as_bytes());
        let (k, j) = (n / 3, n / 2);
        from.push((
            key,
            vec![
                Span::new(src.addr() + at, k),
                Span::new(src.addr() + at + k, n - k),
            ],
        ));
        into.push(vec![
            Span::new(dst.addr() + at, j),
            Span::new(dst.addr() + at + j, n - j),
        ]);
        at += n;
    }
    // SAFETY: live device memory of `gpu`, for the calls; spans apart.
    let put = unsafe {
        client
            .put_spans(ns, &from, None, &[], PutOptions::default())
            .await
    }
    .map_err(Failure::from)?;
    if put.iter().any(|o| *o != PutOutcome::Stored) {
        return Err(gpu_failure("check: put from the GPU", format!("{put:?}")));
    }
    let keys: Vec<BlockHash> = from.iter().map(|b| b.0).collect();
    // The store holds what the GPU held.
    for (i, key) in keys.iter().enumerate() {
        let start: usize = sizes[..i].iter().sum();
        let stored = client
            .get(&mooncake_proto::BlockKey::new(ns.clone(), *key))
            .await
            .map_err(Failure::from)?;
        if stored.as_deref() != Some(&host.as_slice()[start..start + sizes[i]]) {
            return Err(gpu_failure(
                "check: the stored block",
                format!("block {i} differs"),
            ));
        }
    }
    // SAFETY: as above.
    let got = unsafe { client.get_into_spans(ns, &keys, &into).await }.map_err(Failure::from)?;
    let want: Vec<GetOutcome> = sizes.iter().map(|&n| GetOutcome::Hit(n)).collect();
    if got != want {
        return Err(gpu_failure("check: get into the GPU", format!("{got:?}")));
    }
    same_bytes(&dst, lane.as_mut(), cuda, host.as_slice())?;
    client.remove(ns, &keys).await.map_err(Failure::from)?;
    Ok(())
}
