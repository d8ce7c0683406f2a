//! Same-host reads and writes through the daemon's shared pool: right
//! bytes, straight from and into shared memory; blocks the pool does not
//! hold (on NVMe) and daemons without a socket go over TCP; a block
//! replaced while clients copy it never comes back with mixed bytes;
//! reads through the daemon's shared index need no lease and still count
//! as uses for its LRU.

use std::sync::Arc;
use std::time::Duration;

use mooncake_client::{Client, ClientConfig, GetOutcome, PutOutcome};
use mooncake_proto::{BlockHash, Namespace};
use mooncake_tests::{block_bytes, daemon_config, fast_meta, TestCluster};

fn ns() -> Namespace {
    Namespace::new("t/shm").unwrap()
}

fn hash(i: u64) -> BlockHash {
    BlockHash::from_opaque(&i.to_le_bytes())
}

fn scratch() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-shm-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn cluster_with_shm(dir: &std::path::Path, dram: u64, nvme: bool) -> TestCluster {
    let mut cfg = daemon_config(dram);
    cfg.shm_socket = Some(dir.join("daemon.sock"));
    if nvme {
        cfg.nvme = vec![format!("{}:64MiB", dir.join("drive.bin").display())];
    }
    TestCluster::start_with(fast_meta(), vec![cfg]).await
}

fn client(cluster: &TestCluster, socket: &std::path::Path) -> Client {
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(5));
    cfg.shm_socket = Some(socket.to_path_buf());
    Client::new(cfg)
}

/// Stores block `i` (`block_bytes(i, sizes[i])`) for each size, one put each.
async fn put_each(client: &Client, sizes: &[usize]) {
    put_each_from(client, 0, sizes).await
}

/// `put_each`, the blocks numbered from `first`.
async fn put_each_from(client: &Client, first: u64, sizes: &[usize]) {
    for (i, n) in (first..).zip(sizes) {
        let out = client
            .put(&ns(), &[(hash(i), &block_bytes(i, *n))])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_daemon_already_serves_its_same_host_socket() {
    // The socket is bound before the daemon registers: a client that can
    // see the daemon can connect, and its first put goes through the pool.
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 16 << 20, false).await;
    assert!(std::os::unix::net::UnixStream::connect(dir.join("daemon.sock")).is_ok());
    let client = client(&cluster, &dir.join("daemon.sock"));
    put_each(&client, &[100_000]).await;
    assert_eq!(client.shm_writes(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_puts_and_gets_go_through_shared_memory_byte_for_byte() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    let sizes: Vec<usize> = (0..50).map(|i| 1 + i * 20_011 % (512 << 10)).collect();
    put_each(&client, &sizes).await;
    let hashes: Vec<BlockHash> = (0..50).map(hash).collect();
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0u8; *n]).collect();
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.get_into(&ns(), &hashes, &mut views).await.unwrap();
    for (i, (g, n)) in got.iter().zip(&sizes).enumerate() {
        assert_eq!(*g, GetOutcome::Hit(*n), "block {i}");
        assert!(bufs[i] == block_bytes(i as u64, *n), "block {i} bytes");
    }
    assert_eq!(
        client.shm_writes(),
        50,
        "every block went in through shared memory"
    );
    assert_eq!(
        client.shm_reads(),
        50,
        "every block came out through shared memory"
    );
    assert_eq!(
        client.shm_index_reads(),
        50,
        "every block was found through the daemon's index, without a lease"
    );
    // A client over TCP reads what was written through shared memory.
    let tcp = cluster.client();
    let mut buf = vec![0u8; sizes[7]];
    let got = tcp
        .get_into(&ns(), &[hash(7)], &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(sizes[7])]);
    assert!(buf == block_bytes(7, sizes[7]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_into_buffers_at_any_alignment_are_right_byte_for_byte() {
    // The copy out of the pool is hand-written (one pass that also hashes):
    // every length rule of the hash and every offset of the caller's
    // buffer against the block's, through the real path.
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    let sizes = [
        1usize,
        240,
        241,
        1023,
        1024,
        1025,
        4096 + 63,
        (256 << 10) + 13,
    ];
    put_each(&client, &sizes).await;
    let mut arena = vec![0u8; (256 << 10) + 13 + 64];
    for (i, n) in sizes.iter().enumerate() {
        for offset in [0, 1, 7, 8, 16, 31, 32, 48, 63] {
            arena.fill(0xEE);
            let got = client
                .get_into(
                    &ns(),
                    &[hash(i as u64)],
                    &mut [&mut arena[offset..offset + n]],
                )
                .await
                .unwrap();
            assert_eq!(
                got,
                vec![GetOutcome::Hit(*n)],
                "size {n} at offset {offset}"
            );
            assert!(
                arena[offset..offset + n] == block_bytes(i as u64, *n),
                "size {n} at offset {offset}: bytes"
            );
            assert!(
                arena[..offset]
                    .iter()
                    .chain(&arena[offset + n..])
                    .all(|b| *b == 0xEE),
                "size {n} at offset {offset}: nothing written outside the buffer"
            );
        }
    }
    assert_eq!(client.shm_index_reads(), 9 * sizes.len() as u64);
    let pages = client.same_host_pages().expect("a same-host link");
    assert!(
        pages.starts_with("4KiB") || pages.starts_with("2MiB"),
        "pages in words: {pages}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_on_nvme_and_daemons_without_a_socket_are_read_over_tcp() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 8 << 20, true).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    let block = 1 << 20;
    for i in 0..24u64 {
        client
            .put(&ns(), &[(hash(i), &block_bytes(i, block))])
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut buf = vec![0u8; block];
    for i in 0..24u64 {
        let got = client
            .get_into(&ns(), &[hash(i)], &mut [&mut buf[..]])
            .await
            .unwrap();
        assert_eq!(got, vec![GetOutcome::Hit(block)], "block {i}");
        assert!(buf == block_bytes(i, block), "block {i} bytes");
    }
    let shm = client.shm_reads();
    assert!(
        shm > 0 && shm < 24,
        "DRAM blocks through shared memory, NVMe ones over TCP: {shm}"
    );

    // A socket that is not there: everything over TCP, nothing lost.
    let tcp_only = self::client(&cluster, &dir.join("no-such.sock"));
    let got = tcp_only
        .get_into(&ns(), &[hash(23)], &mut [&mut buf[..]])
        .await
        .unwrap();
    assert_eq!(got, vec![GetOutcome::Hit(block)]);
    assert_eq!(tcp_only.shm_reads(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_replaced_while_clients_copy_it_never_comes_back_mixed() {
    let dir = scratch();
    let cluster = Arc::new(cluster_with_shm(&dir, 16 << 20, false).await);
    let socket = dir.join("daemon.sock");
    let len = 256 << 10;
    let versions = [block_bytes(1, len), block_bytes(2, len)];
    // The writer replaces the block until the reader has read it 50 times
    // (or 10 s passed: a loaded machine may give the reader fewer hits).
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let client = client(&cluster, &socket);
        let versions = versions.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let mut round = 0usize;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = client.remove(&ns(), &[hash(7)]).await;
                let _ = client.put(&ns(), &[(hash(7), &versions[round % 2])]).await;
                round += 1;
            }
            round
        })
    };
    let reader = client(&cluster, &socket);
    let mut buf = vec![0u8; len];
    let mut hits = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while hits < 50 && std::time::Instant::now() < deadline {
        if let Ok(got) = reader
            .get_into(&ns(), &[hash(7)], &mut [&mut buf[..]])
            .await
        {
            if got == vec![GetOutcome::Hit(len)] {
                assert!(
                    buf == versions[0] || buf == versions[1],
                    "mixed bytes returned"
                );
                hits += 1;
            }
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = writer.await.unwrap();
    assert!(rounds > 1, "the block was replaced while it was read");
    assert!(
        hits > 0 && reader.shm_reads() > 0,
        "the reader read through shared memory"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_batch_with_four_copy_threads_is_right_byte_for_byte() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    let mut cfg = ClientConfig::new(cluster.meta_addr.clone()).with_timeout(Duration::from_secs(5));
    cfg.shm_socket = Some(dir.join("daemon.sock"));
    cfg.copy_threads = 4;
    let client = Client::new(cfg);
    // 48 blocks of 256 KiB: 12 MiB in one call, over the 8 MiB from which
    // a batch is split between threads.
    let len = 256 << 10;
    let hashes: Vec<BlockHash> = (0..48).map(hash).collect();
    let values: Vec<Vec<u8>> = (0..48).map(|i| block_bytes(i, len)).collect();
    let blocks: Vec<(BlockHash, &[u8])> = hashes
        .iter()
        .zip(&values)
        .map(|(h, v)| (*h, &v[..]))
        .collect();
    assert!(client
        .put(&ns(), &blocks)
        .await
        .unwrap()
        .iter()
        .all(|o| *o == PutOutcome::Stored));
    let mut bufs = vec![vec![0u8; len]; 48];
    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = client.get_into(&ns(), &hashes, &mut views).await.unwrap();
    assert!(got.iter().all(|g| *g == GetOutcome::Hit(len)), "{got:?}");
    for (i, (buf, value)) in bufs.iter().zip(&values).enumerate() {
        assert!(buf == value, "block {i} bytes");
    }
    assert_eq!(client.shm_index_reads(), 48);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_through_the_index_keep_a_block_hot_and_count_as_hits() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 16 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    let pool = cluster.daemons[0].handle.pool.clone();
    let len = 256 << 10;
    let put = |from: u64, to: u64| {
        let client = &client;
        async move {
            for i in from..to {
                let out = client
                    .put(&ns(), &[(hash(i), &block_bytes(i, len))])
                    .await
                    .unwrap();
                assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
            }
        }
    };
    // 10 MiB of a 16 MiB pool; block 0 is the oldest.
    put(0, 40).await;
    let hits_before = pool.stats().hits;
    let mut buf = vec![0u8; len];
    for _ in 0..128 {
        let got = client
            .get_into(&ns(), &[hash(0)], &mut [&mut buf[..]])
            .await
            .unwrap();
        assert_eq!(got, vec![GetOutcome::Hit(len)]);
    }
    assert!(buf == block_bytes(0, len));
    assert_eq!(client.shm_index_reads(), 128, "read without leases");
    // The reads were told to the daemon in batches (of 64, or fewer after
    // 20 ms); the next call on the link waits for its answers to them.
    put(40, 80).await;
    assert!(
        pool.stats().hits >= hits_before + 64,
        "the daemon counted the reads: {} -> {}",
        hits_before,
        pool.stats().hits
    );
    // Another 10 MiB evicted the coldest blocks: the oldest ones, but not
    // block 0, which the reads made the most recently used of the first 40.
    assert!(pool.stats().evictions > 0);
    let mut got = Vec::new();
    for i in [0u64, 1] {
        got.push(
            client
                .get_into(&ns(), &[hash(i)], &mut [&mut buf[..]])
                .await
                .unwrap()[0],
        );
    }
    assert_eq!(got, vec![GetOutcome::Hit(len), GetOutcome::Miss]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_shared_pool_cannot_be_combined_with_authentication() {
    let mut cfg = daemon_config(8 << 20);
    cfg.shm_socket = Some("/tmp/x.sock".into());
    cfg.auth = Some("/tmp/tokens.toml".into());
    assert!(cfg.validate().unwrap_err().contains("auth"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_put_carries_the_meta_services_judgement_of_its_branch() {
    // A reader matched block P, which then left the daemon; a branch put
    // after it is judged by the meta service, not by the pool, which no
    // longer holds P. Small blocks go with their bytes over the socket,
    // larger ones into the shared pool: both carry the judgement.
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 16 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    let pool = &cluster.daemons[0].handle.pool;
    for (round, size) in [(0u64, 4 << 10), (1, 64 << 10)] {
        let (parent, branch) = (hash(100 + round), hash(200 + round));
        let value = block_bytes(round, size);
        let out = client.put(&ns(), &[(parent, &value)]).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored]);
        let matched = client.match_prefix(&ns(), &[parent, branch]).await.unwrap();
        assert_eq!(matched.matched, 1);
        client.remove(&ns(), &[parent]).await.unwrap();
        let before = pool.eviction_events().branch_admitted;
        let out = client
            .put_chain(&ns(), Some(parent), &[(branch, &value)])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored]);
        assert_eq!(
            pool.eviction_events().branch_admitted,
            before + 1,
            "{size} bytes"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_of_one_size_after_the_first_go_into_room_held_ahead_byte_for_byte() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    // One block a call: the first reserves its room and asks for room
    // ahead; each later one goes into the room the one before handed over,
    // and the daemon makes it visible itself (one round trip).
    put_each(&client, &[100_000; 12]).await;
    assert_eq!(client.shm_writes(), 12);
    assert_eq!(client.shm_room_writes(), 11);
    assert_eq!(client.shm_admitted(), 11);
    // Batches: the first is admitted up to its one room held and asks for
    // room for the rest (the room its admission handed back takes one
    // more); the second finds room for all of them but one, admitted, and
    // the last goes into the room their admission handed back.
    for round in 0..2u64 {
        let values: Vec<Vec<u8>> = (0..10)
            .map(|i| block_bytes(100 + round * 10 + i, 100_000))
            .collect();
        let blocks: Vec<(BlockHash, &[u8])> = (0..10)
            .map(|i| (hash(100 + round * 10 + i), &values[i as usize][..]))
            .collect();
        let out = client.put(&ns(), &blocks).await.unwrap();
        assert_eq!(out, vec![PutOutcome::Stored; 10]);
    }
    assert_eq!(client.shm_writes(), 32);
    assert_eq!(client.shm_room_writes(), 11 + 2 + 10);
    assert_eq!(client.shm_admitted(), 11 + 1 + 9);
    // Another size: the rooms held are let go; rooms of the new size
    // serve its blocks after the first.
    put_each_from(&client, 32, &[30_000; 4]).await;
    assert_eq!(client.shm_room_writes(), 23 + 3);
    assert_eq!(client.shm_admitted(), 21 + 3);
    // Every block reads back right, through shared memory and over TCP.
    let keys: Vec<(u64, usize)> = (0..12)
        .map(|i| (i, 100_000))
        .chain((100..120).map(|i| (i, 100_000)))
        .chain((32..36).map(|i| (i, 30_000)))
        .collect();
    let tcp = cluster.client();
    for reader in [&client, &tcp] {
        for (i, n) in &keys {
            let mut buf = vec![0u8; *n];
            let got = reader
                .get_into(&ns(), &[hash(*i)], &mut [&mut buf[..]])
                .await
                .unwrap();
            assert_eq!(got, vec![GetOutcome::Hit(*n)], "block {i}");
            assert!(buf == block_bytes(*i, *n), "block {i} bytes");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_blocks_go_in_their_frame_until_room_of_their_size_is_held_and_leave_other_rooms_for_a_while(
) {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    // One 8 KiB block a call: the first goes in its frame and asks for
    // room; each later one goes into the room the one before handed over.
    put_each(&client, &[8192; 6]).await;
    assert_eq!((client.shm_writes(), client.shm_room_writes()), (6, 5));
    // A connection holding rooms of 100 KB: a 4 KiB block goes in its
    // frame and leaves them, so the next 100 KB block finds its room.
    let sizes = [100_000, 100_000, 4096, 100_000];
    put_each_from(&client, 10, &sizes).await;
    assert_eq!(client.shm_room_writes(), 5 + 2);
    // Blocks of 4 KiB from now on: the eighth in a row asks for room of
    // their size, and the ones after it go there.
    let small = [4096; 10];
    put_each_from(&client, 20, &small).await;
    assert_eq!(client.shm_room_writes(), 7 + 2);
    let keys = (0..6u64)
        .map(|i| (i, 8192))
        .chain((10..14u64).zip(sizes))
        .chain((20..30u64).zip(small));
    let tcp = cluster.client();
    for (i, n) in keys {
        let mut buf = vec![0u8; n];
        let got = tcp
            .get_into(&ns(), &[hash(i)], &mut [&mut buf[..]])
            .await
            .unwrap();
        assert_eq!(got, vec![GetOutcome::Hit(n)], "block {i}");
        assert!(buf == block_bytes(i, n), "block {i} bytes");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_older_than_rooms_is_put_through_room_reserved_per_block() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    // It answers `ShmRoom` as a daemon older than rooms does: not known,
    // and the session ends with nothing of the call kept.
    cluster.daemons[0].handle.pool.refuse_rooms_for_test();
    let client = client(&cluster, &dir.join("daemon.sock"));
    let sizes = [100_000; 5];
    put_each(&client, &sizes).await;
    assert_eq!(client.shm_writes(), 5);
    assert_eq!(client.shm_room_writes(), 0);
    assert_eq!(cluster.daemons[0].handle.pool.room_bytes(), 0);
    for (i, n) in sizes.iter().enumerate() {
        let mut buf = vec![0u8; *n];
        let got = client
            .get_into(&ns(), &[hash(i as u64)], &mut [&mut buf[..]])
            .await
            .unwrap();
        assert_eq!(got, vec![GetOutcome::Hit(*n)], "block {i}");
        assert!(buf == block_bytes(i as u64, *n), "block {i} bytes");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_changes_size_never_leaves_the_client_a_room_the_daemon_let_go() {
    let dir = scratch();
    let cluster = cluster_with_shm(&dir, 64 << 20, false).await;
    let client = client(&cluster, &dir.join("daemon.sock"));
    // The connection holds a room of 100,000 bytes.
    put_each(&client, &[100_000; 2]).await;
    // Its first block goes into that room, whose store hands over the next
    // one; the second, of another size, asks for rooms of its size, and
    // the daemon lets go of those of the first size.
    let (first, second) = (block_bytes(2, 100_000), block_bytes(3, 50_000));
    let out = client
        .put(&ns(), &[(hash(2), &first[..]), (hash(3), &second[..])])
        .await
        .unwrap();
    assert_eq!(out, vec![PutOutcome::Stored; 2]);
    // Blocks of the first size again: none is written into room the
    // daemon no longer holds for this client.
    for i in 4..8u64 {
        let out = client
            .put(&ns(), &[(hash(i), &block_bytes(i, 100_000))])
            .await
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored], "block {i}");
    }
    let sizes = [
        100_000, 100_000, 100_000, 50_000, 100_000, 100_000, 100_000, 100_000,
    ];
    for (i, n) in sizes.iter().enumerate() {
        let mut buf = vec![0u8; *n];
        let got = client
            .get_into(&ns(), &[hash(i as u64)], &mut [&mut buf[..]])
            .await
            .unwrap();
        assert_eq!(got, vec![GetOutcome::Hit(*n)], "block {i}");
        assert!(buf == block_bytes(i as u64, *n), "block {i} bytes");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
