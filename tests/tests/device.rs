//! Blocks put from and read into device (GPU) memory, with a GPU played in
//! host memory by `HostStandIn` behind the same trait as CUDA's: its
//! copies run only when their lane is waited on (so staging reused too
//! early shows as wrong bytes), it refuses copies from memory that is not
//! pinned, and it fails the copy it is told to. Over TCP and through the
//! same-host shared pool; byte for byte at sizes and splits that do not
//! line up with anything (through the shared pool, gets copy straight from
//! the pool, registered with the GPU); a failed copy fails its blocks,
//! never leaves a partial block stored or reported read.

use std::sync::Arc;
use std::time::Duration;

use mooncake_client::device::{DeviceChoice, HostStandIn, Memory, Span};
use mooncake_client::{Client, ClientConfig, GetOutcome, PutOptions, PutOutcome};
use mooncake_proto::{BlockHash, ErrorCode, Namespace};
use mooncake_tests::{block_bytes, daemon_config, fast_meta, TestCluster};

fn ns() -> Namespace {
    Namespace::new("t/device").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

/// A client whose GPU is `gpu`, with stages of `staging` bytes (small, so
/// that a batch takes several turns of both stages).
fn client_on(
    meta: &str,
    gpu: &HostStandIn,
    staging: usize,
    shm: Option<&std::path::Path>,
) -> Client {
    let mut cfg = ClientConfig::new(meta.to_string()).with_timeout(Duration::from_secs(10));
    cfg.device = DeviceChoice::Given(Arc::new(gpu.clone()));
    cfg.device_staging = staging;
    cfg.shm_socket = shm.map(|p| p.to_path_buf());
    Client::new(cfg)
}

/// A store whose daemon (`dram` bytes) serves same-host clients on a
/// socket in a directory of its own (`name`, removed by the caller): the
/// cluster, the socket and the directory.
async fn with_shared_pool(
    dram: u64,
    name: &str,
) -> (TestCluster, std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("mooncake-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("daemon.sock");
    let mut cfg = daemon_config(dram);
    cfg.shm_socket = Some(socket.clone());
    let cluster = TestCluster::start_with(fast_meta(), vec![cfg]).await;
    (cluster, socket, dir)
}

/// Block sizes that line up with no page, chunk or stage size.
const SIZES: [usize; 7] = [1, 4095, 65_537, 200_003, 31, 300_001, 12_288];

/// For each size, a device region holding `block_bytes(seed + i, n)`,
/// and the block as pieces of it: split in two unequal halves (K and V)
/// for even `i`, whole for odd.
fn device_blocks(gpu: &HostStandIn, seed: u64) -> (Vec<usize>, Vec<Vec<Span>>) {
    let mut regions = Vec::new();
    let mut blocks = Vec::new();
    for (i, &n) in SIZES.iter().enumerate() {
        let addr = gpu.alloc(n);
        gpu.write(addr, &block_bytes(seed + i as u64, n));
        regions.push(addr);
        blocks.push(match i % 2 {
            0 => {
                let k = n / 3;
                vec![Span::new(addr, k), Span::new(addr + k, n - k)]
            }
            _ => vec![Span::new(addr, n)],
        });
    }
    (regions, blocks)
}

/// Empty device regions shaped as `device_blocks`' (the halves split at
/// other points, for gets).
fn empty_device_blocks(gpu: &HostStandIn) -> (Vec<usize>, Vec<Vec<Span>>) {
    let mut regions = Vec::new();
    let mut blocks = Vec::new();
    for (i, &n) in SIZES.iter().enumerate() {
        let addr = gpu.alloc(n);
        regions.push(addr);
        blocks.push(match i % 2 {
            0 => vec![Span::new(addr, n)],
            _ => {
                let k = n / 2 + 1;
                vec![
                    Span::new(addr, k.min(n)),
                    Span::new(addr + k.min(n), n - k.min(n)),
                ]
            }
        });
    }
    (regions, blocks)
}

/// Blocks of `n` bytes side by side in one device region, block `i`
/// keyed `keys[i]` and holding `block_bytes(seed(i), n)`.
fn side_by_side(
    gpu: &HostStandIn,
    keys: &[BlockHash],
    n: usize,
    seed: impl Fn(usize) -> u64,
) -> Vec<(BlockHash, Vec<Span>)> {
    let src = gpu.alloc(n * keys.len());
    for i in 0..keys.len() {
        gpu.write(src + i * n, &block_bytes(seed(i), n));
    }
    keys.iter()
        .enumerate()
        .map(|(i, k)| (*k, vec![Span::new(src + i * n, n)]))
        .collect()
}

/// Puts `blocks` (no chain, default options).
///
/// # Safety
/// As `Client::put_spans`.
async unsafe fn put_all(client: &Client, blocks: &[(BlockHash, Vec<Span>)]) -> Vec<PutOutcome> {
    // SAFETY: the caller's promise.
    unsafe { client.put_spans(&ns(), blocks, None, &[], PutOptions::default()) }
        .await
        .unwrap()
}

async fn round_trip(client: &Client, gpu: &HostStandIn) {
    let (_, from) = device_blocks(gpu, 100);
    assert_eq!(client.memory_of(from[0][0].addr), Memory::Device(0));
    let blocks: Vec<(BlockHash, Vec<Span>)> = from
        .iter()
        .enumerate()
        .map(|(i, spans)| (hash(i as u64), spans.clone()))
        .collect();
    // SAFETY: the stand-in's regions live as long as `gpu`.
    let put = unsafe {
        client
            .put_spans(&ns(), &blocks, Some(None), &[], PutOptions::default())
            .await
    }
    .unwrap();
    assert!(put.iter().all(|o| *o == PutOutcome::Stored), "{put:?}");

    // What the store holds is what the device held.
    for (i, &n) in SIZES.iter().enumerate() {
        let key = mooncake_proto::BlockKey::new(ns(), hash(i as u64));
        let bytes = client.get(&key).await.unwrap().expect("stored");
        assert_eq!(bytes, block_bytes(100 + i as u64, n), "block {i} as stored");
    }

    let (to_regions, to) = empty_device_blocks(gpu);
    let hashes: Vec<BlockHash> = (0..SIZES.len() as u64).map(hash).collect();
    // SAFETY: as above; the regions are apart.
    let got = unsafe { client.get_into_spans(&ns(), &hashes, &to).await }.unwrap();
    for (i, &n) in SIZES.iter().enumerate() {
        assert_eq!(got[i], GetOutcome::Hit(n), "block {i}");
        assert_eq!(
            gpu.read(to_regions[i], n),
            block_bytes(100 + i as u64, n),
            "block {i} on the device"
        );
    }
    let (uploads, downloads) = gpu.copies();
    assert!(uploads >= SIZES.len() as u64 && downloads >= SIZES.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_go_from_device_memory_to_the_store_and_back_byte_for_byte() {
    let cluster = TestCluster::start(64 << 20).await;
    let gpu = HostStandIn::new();
    // Stages of 256 KiB: the batch of 600 KiB takes both stages, twice.
    let client = client_on(&cluster.meta_addr, &gpu, 256 << 10, None);
    round_trip(&client, &gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_go_between_device_memory_and_the_same_host_pool_byte_for_byte() {
    let (cluster, socket, dir) = with_shared_pool(64 << 20, "device").await;
    let gpu = HostStandIn::new();
    let client = client_on(&cluster.meta_addr, &gpu, 128 << 10, Some(&socket));
    round_trip(&client, &gpu).await;
    // Every block was put straight into the pool and read straight from
    // it, registered with the GPU once (the round trip also reads each
    // block to the host once).
    assert!(gpu.registered_bytes() >= 64 << 20, "the pool is registered");
    // One copy a piece of each block that is not empty: ten each way
    // (block 0's first piece is empty when put; gets split odd blocks).
    let pieces = SIZES.len() + SIZES.len() / 2;
    assert_eq!(gpu.downloads_to_registered(), pieces as u64);
    assert_eq!(gpu.uploads_from_registered(), pieces as u64);
    assert_eq!(client.shm_writes(), SIZES.len() as u64);
    drop(client);
    assert_eq!(gpu.registered_bytes(), 0, "and unregistered with its link");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_batch_hashed_on_four_threads_goes_straight_between_device_and_pool() {
    let (cluster, socket, dir) = with_shared_pool(256 << 20, "device-threads").await;
    let gpu = HostStandIn::new();
    let mut cfg =
        ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(30));
    cfg.device = DeviceChoice::Given(Arc::new(gpu.clone()));
    cfg.shm_socket = Some(socket.clone());
    // Groups of 16 MiB (a sixteenth of the pool), hashed in parts of
    // about 2 MiB on up to four blocking threads.
    cfg.copy_threads = 4;
    let client = Client::new(cfg);
    let (n, count) = (300_001usize, 96u64);
    let keys: Vec<BlockHash> = (0..count).map(|i| hash(900 + i)).collect();
    let from = side_by_side(&gpu, &keys, n, |i| 900 + i as u64);
    // SAFETY: live stand-in regions, apart.
    let put = unsafe { put_all(&client, &from) }.await;
    assert!(put.iter().all(|o| *o == PutOutcome::Stored), "{put:?}");
    assert_eq!(gpu.downloads_to_registered(), count);
    let dst = gpu.alloc(n * count as usize);
    let into: Vec<Vec<Span>> = (0..count as usize)
        .map(|i| vec![Span::new(dst + i * n, n)])
        .collect();
    // SAFETY: as above.
    let got = unsafe { client.get_into_spans(&ns(), &keys, &into).await }.unwrap();
    assert!(got.iter().all(|o| *o == GetOutcome::Hit(n)), "{got:?}");
    // Every block checked out where it lay: none was read again by staging.
    assert_eq!(gpu.uploads_from_registered(), count);
    for i in 0..count as usize {
        assert!(
            gpu.read(dst + i * n, n) == block_bytes(900 + i as u64, n),
            "block {i}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_from_the_device_that_fails_stores_none_of_its_chunk() {
    let cluster = TestCluster::start(64 << 20).await;
    let gpu = HostStandIn::new();
    // One block a chunk: each stage holds one 200 KB block.
    let client = client_on(&cluster.meta_addr, &gpu, 100_000, None);
    copy_down_fails_for_block_2(&client, &gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_from_the_device_into_the_pool_that_fails_stores_none_of_its_group() {
    let (cluster, socket, dir) = with_shared_pool(64 << 20, "device-fail").await;
    let gpu = HostStandIn::new();
    // One block a group: each group holds one 200 KB block.
    let client = client_on(&cluster.meta_addr, &gpu, 100_000, Some(&socket));
    copy_down_fails_for_block_2(&client, &gpu).await;
    // Blocks 0 and 1 went straight into the pool; block 2's copy there
    // failed (a failed copy is not counted), and blocks 3 to 5 then went
    // through staging on a new lane.
    assert_eq!(gpu.downloads_to_registered(), 2);
    assert_eq!(gpu.copies().1, 2 + 3);
    // Block 2's room was freed with its connection: it goes in now.
    let n = 200_000;
    let addr = gpu.alloc(n);
    gpu.write(addr, &block_bytes(2, n));
    let again = vec![(hash(52), vec![Span::new(addr, n)])];
    // SAFETY: the stand-in's region lives as long as `gpu`.
    let put = unsafe { put_all(&client, &again) }.await;
    assert_eq!(put, vec![PutOutcome::Stored]);
    let key = mooncake_proto::BlockKey::new(ns(), hash(52));
    assert_eq!(client.get(&key).await.unwrap().unwrap(), block_bytes(2, n));
    let _ = std::fs::remove_dir_all(dir);
}

/// Puts six blocks of 200 KB from device memory, the third copy down
/// (block 2's) failing: that block alone fails, is not stored, and the
/// others read back byte for byte.
async fn copy_down_fails_for_block_2(client: &Client, gpu: &HostStandIn) {
    let n = 200_000;
    let regions: Vec<usize> = (0..6)
        .map(|i| {
            let addr = gpu.alloc(n);
            gpu.write(addr, &block_bytes(i, n));
            addr
        })
        .collect();
    let blocks: Vec<(BlockHash, Vec<Span>)> = regions
        .iter()
        .enumerate()
        .map(|(i, &a)| (hash(50 + i as u64), vec![Span::new(a, n)]))
        .collect();
    gpu.fail_copy(3);
    // SAFETY: the stand-in's regions live as long as `gpu`.
    let put = unsafe { put_all(client, &blocks) }.await;
    for (i, outcome) in put.iter().enumerate() {
        match i {
            2 => assert_eq!(
                *outcome,
                PutOutcome::Failed(ErrorCode::Internal),
                "block {i}"
            ),
            _ => assert_eq!(*outcome, PutOutcome::Stored, "block {i}"),
        }
    }
    let stored = client
        .exists(&ns(), &blocks.iter().map(|b| b.0).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(stored, vec![true, true, false, true, true, true]);
    for i in [0u64, 1, 3, 4, 5] {
        let key = mooncake_proto::BlockKey::new(ns(), hash(50 + i));
        assert_eq!(
            client.get(&key).await.unwrap().unwrap(),
            block_bytes(i, n),
            "block {i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_to_the_device_that_fails_is_never_reported_read() {
    let cluster = TestCluster::start(64 << 20).await;
    let host = cluster.client();
    let n = 150_000;
    let values: Vec<Vec<u8>> = (0..6).map(|i| block_bytes(i, n)).collect();
    let blocks: Vec<(BlockHash, &[u8])> = values
        .iter()
        .enumerate()
        .map(|(i, v)| (hash(70 + i as u64), &v[..]))
        .collect();
    assert!(host
        .put(&ns(), &blocks)
        .await
        .unwrap()
        .iter()
        .all(|o| *o == PutOutcome::Stored));

    let gpu = HostStandIn::new();
    // Two blocks a chunk.
    let client = client_on(&cluster.meta_addr, &gpu, 2 * n, None);
    let regions: Vec<usize> = (0..6).map(|_| gpu.alloc(n)).collect();
    let to: Vec<Vec<Span>> = regions.iter().map(|&a| vec![Span::new(a, n)]).collect();
    let hashes: Vec<BlockHash> = blocks.iter().map(|b| b.0).collect();
    // The fourth copy up (block 3's, in the second chunk) fails: its
    // chunk's lane reports the error for both of its blocks.
    gpu.fail_copy(4);
    // SAFETY: as above; the regions are apart.
    let got = unsafe { client.get_into_spans(&ns(), &hashes, &to).await }.unwrap();
    for (i, outcome) in got.iter().enumerate() {
        match i {
            2 | 3 => assert_eq!(
                *outcome,
                GetOutcome::Failed(ErrorCode::Internal),
                "block {i}"
            ),
            _ => {
                assert_eq!(*outcome, GetOutcome::Hit(n), "block {i}");
                assert_eq!(gpu.read(regions[i], n), values[i], "block {i}");
            }
        }
    }
    // The same call again, with nothing failing, reads every block.
    let got = unsafe { client.get_into_spans(&ns(), &hashes, &to).await }.unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(n); 6]);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(&gpu.read(regions[i], n), v, "block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_and_device_blocks_share_a_batch_and_a_block_of_both_is_refused() {
    let cluster = TestCluster::start(64 << 20).await;
    let gpu = HostStandIn::new();
    let client = client_on(&cluster.meta_addr, &gpu, 1 << 20, None);
    let n = 10_000;
    let on_gpu = gpu.alloc(n);
    gpu.write(on_gpu, &block_bytes(1, n));
    let on_host = block_bytes(2, n);
    let half = gpu.alloc(n / 2);
    let blocks = vec![
        (hash(90), vec![Span::new(on_gpu, n)]),
        (hash(91), vec![Span::new(on_host.as_ptr() as usize, n)]),
        (
            hash(92),
            vec![
                Span::new(half, n / 2),
                Span::new(on_host.as_ptr() as usize, n / 2),
            ],
        ),
    ];
    assert_eq!(client.memory_of(on_host.as_ptr() as usize), Memory::Host);
    // SAFETY: live device regions and a live host vector.
    let put = unsafe { put_all(&client, &blocks) }.await;
    assert_eq!(
        put,
        vec![
            PutOutcome::Stored,
            PutOutcome::Stored,
            PutOutcome::Failed(ErrorCode::Malformed)
        ]
    );
    // Each read into the other kind of memory.
    let mut into_host = vec![0u8; n];
    let into_gpu = gpu.alloc(n);
    let to = vec![
        vec![Span::new(into_host.as_mut_ptr() as usize, n)],
        vec![Span::new(into_gpu, n)],
    ];
    // SAFETY: as above, apart.
    let got = unsafe {
        client
            .get_into_spans(&ns(), &[hash(90), hash(91)], &to)
            .await
    }
    .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(n), GetOutcome::Hit(n)]);
    assert_eq!(into_host, block_bytes(1, n));
    assert_eq!(gpu.read(into_gpu, n), block_bytes(2, n));
    assert!(!client.exists(&ns(), &[hash(92)]).await.unwrap()[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_larger_than_its_device_buffer_is_refused_and_nothing_is_copied() {
    let cluster = TestCluster::start(64 << 20).await;
    let host = cluster.client();
    let n = 50_000;
    let value = block_bytes(7, n);
    host.put(&ns(), &[(hash(95), &value[..])]).await.unwrap();
    let gpu = HostStandIn::new();
    let client = client_on(&cluster.meta_addr, &gpu, 1 << 20, None);
    let small = gpu.alloc(n - 1);
    // SAFETY: a live device region.
    let got = unsafe {
        client
            .get_into_spans(
                &ns(),
                &[hash(95), hash(96)],
                &[vec![Span::new(small, n - 1)], vec![Span::new(small, 0)]],
            )
            .await
    }
    .unwrap();
    assert_eq!(
        got,
        vec![GetOutcome::Failed(ErrorCode::TooLarge), GetOutcome::Miss]
    );
    assert_eq!(gpu.copies(), (0, 0));
    assert_eq!(gpu.read(small, n - 1), vec![0u8; n - 1]);
}

#[test]
fn without_gpu_support_every_address_is_host_memory() {
    let off = {
        let mut cfg = ClientConfig::new("127.0.0.1:1");
        cfg.device = DeviceChoice::Off;
        Client::new(cfg)
    };
    let bytes = [0u8; 64];
    assert!(off.device().is_none());
    assert_eq!(off.memory_of(bytes.as_ptr() as usize), Memory::Host);
    // The default loads CUDA's driver where there is one: a host address
    // is host memory either way, and without a driver there is no device.
    let default = Client::new(ClientConfig::new("127.0.0.1:1"));
    assert_eq!(default.memory_of(bytes.as_ptr() as usize), Memory::Host);
    let driver = mooncake_client::device::cuda::Cuda::load();
    assert_eq!(default.device().is_some(), driver.is_ok());
    if let Err(why) = driver {
        assert!(why.to_string().contains("CUDA"), "{why}");
    }
}

/// Slices of a block already read and checked (a read session's), copied
/// into device and host memory: byte for byte, several stages' worth, a
/// piece of two memories refused, and a failed copy up failing its
/// stage's pieces only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_of_checked_bytes_reach_device_and_host_memory_and_a_failed_copy_fails_its_stage() {
    let gpu = HostStandIn::new();
    // Stages of 3,000 bytes: pieces 0 to 2 fill one, 3 (larger) and 4
    // take one each.
    let client = client_on("127.0.0.1:1", &gpu, 3_000, None);
    let source = block_bytes(9, 20_000);
    let slices: [(usize, usize); 5] = [
        (0, 1),
        (17, 999),
        (1_000, 2_000),
        (9_001, 4_097),
        (19_969, 31),
    ];
    let regions: Vec<usize> = slices.iter().map(|&(_, n)| gpu.alloc(n)).collect();
    let to_device = |i: usize| -> Vec<Span> {
        let n = slices[i].1;
        match i % 2 {
            0 => vec![Span::new(regions[i], n)],
            _ => vec![
                Span::new(regions[i], n / 2),
                Span::new(regions[i] + n / 2, n - n / 2),
            ],
        }
    };
    let to_gpu: Vec<(&[u8], Vec<Span>)> = (0..slices.len())
        .map(|i| {
            (
                &source[slices[i].0..slices[i].0 + slices[i].1],
                to_device(i),
            )
        })
        .collect();
    // SAFETY: device regions allocated above and apart; the sources are
    // host memory apart from them.
    let done = unsafe { client.copy_into_spans(&to_gpu) };
    assert_eq!(done, vec![Ok(()); 5]);
    for (i, &(at, n)) in slices.iter().enumerate() {
        assert_eq!(gpu.read(regions[i], n), source[at..at + n], "slice {i}");
    }

    // Into host memory, and a piece with a host span and a device span.
    let mut host = vec![0u8; 3_000];
    let (first, rest) = host.split_at_mut(1_000);
    let mixed = vec![
        Span::new(rest.as_mut_ptr() as usize, 5),
        Span::new(regions[0], 1),
    ];
    let pieces: Vec<(&[u8], Vec<Span>)> = vec![
        (
            &source[100..1_100],
            vec![Span::new(first.as_mut_ptr() as usize, 1_000)],
        ),
        (&source[..6], mixed),
    ];
    // SAFETY: as above.
    let done = unsafe { client.copy_into_spans(&pieces) };
    assert_eq!(done, vec![Ok(()), Err(ErrorCode::Malformed)]);
    assert_eq!(host[..1_000], source[100..1_100]);
    assert_eq!(
        host[1_000..],
        vec![0u8; 2_000][..],
        "a refused piece writes nothing"
    );

    // The second copy up from now (piece 1's first half) fails: the three
    // pieces of its stage fail; the next stages copy.
    gpu.fail_copy(2);
    // SAFETY: as above.
    let done = unsafe { client.copy_into_spans(&to_gpu) };
    let failed = Err(ErrorCode::Internal);
    assert_eq!(done, vec![failed, failed, failed, Ok(()), Ok(())]);
    for i in 3..5 {
        let (at, n) = slices[i];
        assert_eq!(gpu.read(regions[i], n), source[at..at + n], "slice {i}");
    }
}

/// `n` bytes cut at random places into 1 to 4 pieces: their lengths
/// (empty pieces among them, at times: a cut at the start, the end, or
/// twice in one place).
fn cuts(rng: &mut impl rand::Rng, n: usize) -> Vec<usize> {
    let pieces = rng.gen_range(1..=4usize);
    let mut at: Vec<usize> = (1..pieces)
        .map(|_| match rng.gen_range(0..4) {
            0 => 0,
            1 => n,
            _ => rng.gen_range(0..=n),
        })
        .collect();
    at.push(0);
    at.push(n);
    at.sort_unstable();
    at.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sizes_splits_and_stages_come_back_byte_for_byte() {
    use rand::{Rng, SeedableRng};
    let (cluster, socket, dir) = with_shared_pool(128 << 20, "device-random").await;
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for round in 0..6u64 {
        let gpu = HostStandIn::new();
        let staging = rng.gen_range(1..=600_000);
        // Odd rounds through the shared pool (gets straight from it).
        let shm = (round % 2 == 1).then_some(socket.as_path());
        let client = client_on(&cluster.meta_addr, &gpu, staging, shm);
        let sizes: Vec<usize> = (0..rng.gen_range(1..=24))
            .map(|_| rng.gen_range(0..=400_000))
            .collect();
        let mut from = Vec::new();
        let mut into = Vec::new();
        let mut regions = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let (src, dst) = (gpu.alloc(n), gpu.alloc(n));
            gpu.write(src, &block_bytes(seed ^ (round << 32) ^ i as u64, n));
            let split = |addr: usize, lens: Vec<usize>| {
                let mut at = addr;
                lens.into_iter()
                    .map(|len| {
                        at += len;
                        Span::new(at - len, len)
                    })
                    .collect::<Vec<Span>>()
            };
            let key = BlockHash::from_opaque(format!("{seed}-{round}-{i}").as_bytes());
            from.push((key, split(src, cuts(&mut rng, n))));
            into.push(split(dst, cuts(&mut rng, n)));
            regions.push(dst);
        }
        // SAFETY: live stand-in regions, apart.
        let put = unsafe { put_all(&client, &from) }.await;
        let keys: Vec<BlockHash> = from.iter().map(|b| b.0).collect();
        let got = unsafe { client.get_into_spans(&ns(), &keys, &into).await }.unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            let why =
                format!("seed {seed} round {round} block {i} of {n} bytes, stages of {staging}");
            assert_eq!(put[i], PutOutcome::Stored, "{why}");
            assert_eq!(got[i], GetOutcome::Hit(n), "{why}");
            assert_eq!(
                gpu.read(regions[i], n),
                block_bytes(seed ^ (round << 32) ^ i as u64, n),
                "{why}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Thousands of blocks in one call, through the same-host pool both ways
/// and from host and device memory: more requests than the socket's
/// buffers hold at once, so the client must read the daemon's answers
/// while it still sends (a batch sent whole before reading would leave
/// both sides waiting on each other). A call of 4,096 blocks of 20 KB
/// (82 MB) is more than the room a pool of 128 MiB lets puts in progress
/// hold (a quarter): it is stored whole, each block committed once its
/// bytes are in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_blocks_in_one_call_go_through_the_same_host_pool() {
    let (cluster, socket, dir) = with_shared_pool(128 << 20, "device-many").await;
    let gpu = HostStandIn::new();
    let client = client_on(&cluster.meta_addr, &gpu, 32 << 20, Some(&socket));
    assert!(client.same_host_ready(Duration::from_secs(30)).await);
    // Small blocks go with their bytes in the frame; larger ones through
    // room reserved in the pool: both kinds, 4,096 blocks each.
    for (round, n) in [(0u64, 2_000usize), (1, 20_000)] {
        let count = 4_096;
        let keys: Vec<BlockHash> = (0..count as u64).map(|i| hash((round << 32) | i)).collect();
        let seed = |i: usize| (round << 32) | i as u64;
        let bytes: Vec<Vec<u8>> = (0..count).map(|i| block_bytes(seed(i), n)).collect();
        let from = side_by_side(&gpu, &keys, n, seed);
        // SAFETY: live stand-in regions, apart.
        let put = unsafe { put_all(&client, &from) }.await;
        let first = |bad: Option<usize>| bad.map(|i| format!("block {i} of {n} B"));
        let first_put = |put: &[PutOutcome]| {
            let bad = put.iter().position(|o| *o != PutOutcome::Stored);
            bad.map(|i| format!("block {i} of {n} B: {:?}", put[i]))
        };
        assert_eq!(first_put(&put), None);
        // Into device memory: every block leased from the pool.
        let dst = gpu.alloc(n * count);
        let into: Vec<Vec<Span>> = (0..count)
            .map(|i| vec![Span::new(dst + i * n, n)])
            .collect();
        // SAFETY: as above.
        let got = unsafe { client.get_into_spans(&ns(), &keys, &into).await }.unwrap();
        assert_eq!(
            first(got.iter().position(|o| *o != GetOutcome::Hit(n))),
            None
        );
        for (i, b) in bytes.iter().enumerate() {
            assert_eq!(
                &gpu.read(dst + i * n, n),
                b,
                "block {i} of {n} B on the device"
            );
        }
        // Into host memory, and from it.
        let mut host = vec![0u8; n * count];
        let spans: Vec<Vec<Span>> = host
            .chunks_mut(n)
            .map(|c| vec![Span::new(c.as_mut_ptr() as usize, n)])
            .collect();
        // SAFETY: `host` outlives the call; the spans are apart.
        let got = unsafe { client.get_into_spans(&ns(), &keys, &spans).await }.unwrap();
        assert_eq!(
            first(got.iter().position(|o| *o != GetOutcome::Hit(n))),
            None
        );
        assert!(host.chunks(n).zip(&bytes).all(|(a, b)| a == b.as_slice()));
        let again: Vec<(BlockHash, Vec<Span>)> = (0..count)
            .map(|i| (hash((round << 32) | (1 << 20) | i as u64), spans[i].clone()))
            .collect();
        // SAFETY: as above.
        let put = unsafe { put_all(&client, &again) }.await;
        assert_eq!(first_put(&put), None);
        let all: Vec<BlockHash> = keys
            .iter()
            .chain(again.iter().map(|b| &b.0))
            .copied()
            .collect();
        client.remove(&ns(), &all).await.unwrap();
    }
    let _ = std::fs::remove_dir_all(dir);
}
