use super::*;
use crate::io::{engine, open_direct, EngineKind, IoResult};
use futures::future::BoxFuture;
use std::sync::atomic::AtomicI32;
use std::sync::Arc;

struct Scratch(PathBuf);
impl Scratch {
    fn new() -> Self {
        let p = std::env::temp_dir().join(format!(
            "mooncake-nvme-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey::new(
        Namespace::new("t/nvme").unwrap(),
        BlockHash::from_opaque(&i.to_le_bytes()),
    )
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 13 + j) as u8).collect()
}

fn open(dir: &Path, kind: EngineKind, capacity: u64) -> NvmeTier {
    let data = dir.join("tier.bin");
    let engine = engine(kind, open_direct(&data).unwrap(), 8).unwrap();
    NvmeTier::open(engine, capacity, &NvmeTier::index_dir_for(&data)).unwrap()
}

#[test]
fn extents_allocate_claim_and_coalesce() {
    let mut e = Extents::new(100);
    assert_eq!(e.allocate(30), Some(0));
    assert_eq!(e.allocate(30), Some(30));
    assert!(e.claim(80, 10));
    assert!(!e.claim(85, 10), "overlaps a used range");
    e.release(0, 30);
    e.release(30, 30);
    assert_eq!(e.free.get(&0), Some(&80), "coalesced with both neighbours");
    assert_eq!(e.free_bytes(), 90);
    assert_eq!(e.allocate(95), None);
}

#[tokio::test]
async fn a_blocks_parent_survives_a_reopen_and_old_records_still_open() {
    let dir = Scratch::new();
    let parent = BlockHash::from_opaque(b"the parent");
    {
        let tier = open(&dir.0, EngineKind::Psync, 16 << 20);
        let v = value(1, 5000);
        tier.put(&key(1), &v, checksum(&v), (Some(parent), None, true))
            .await
            .unwrap();
        let v = value(2, 5000);
        tier.put(&key(2), &v, checksum(&v), (None, None, true))
            .await
            .unwrap();
    }
    let tier = open(&dir.0, EngineKind::Psync, 16 << 20);
    assert_eq!(tier.parent_of(&key(1)), Some(parent));
    assert_eq!(tier.parent_of(&key(2)), None);
    // A record written before parents were kept: 20 bytes.
    let old = &Record {
        offset: 4096,
        len: 10,
        checksum: 7,
        parent: Some(parent),
        tagged: false,
    }
    .encode()[..Record::LEN];
    let decoded = Record::decode(old).unwrap();
    assert_eq!(
        (decoded.offset, decoded.len, decoded.checksum),
        (4096, 10, 7)
    );
    assert_eq!(decoded.parent, None);
    assert!(Record::decode(&[0u8; 21]).is_none());
}

#[tokio::test]
async fn a_blocks_tag_survives_a_reopen_and_goes_with_its_block() {
    use mooncake_proto::message::EngineHash;
    let dir = Scratch::new();
    let tag = |i: u64| {
        Arc::new(
            EngineTag::new(Some(EngineHash::Int(1000 + i)), vec![i as u32; 4])
                .unwrap()
                .with_key(&format!("model@tp_rank:0@{i}"))
                .unwrap(),
        )
    };
    {
        // Four blocks of 256 KiB fill a drive of 1 MiB: 0, 1 and 3
        // tagged. A fifth evicts the coldest (0), tag and all; block 1 is
        // removed, tag and all.
        let tier = open(&dir.0, EngineKind::Psync, 1 << 20);
        for i in 0..4u64 {
            let v = value(i, 256 << 10);
            let t = (i != 2).then(|| tag(i));
            tier.put(&key(i), &v, checksum(&v), (None, t.as_ref(), true))
                .await
                .unwrap();
        }
        let v = value(4, 256 << 10);
        let evicted = tier
            .put(&key(4), &v, checksum(&v), (None, None, true))
            .await
            .unwrap();
        assert_eq!(evicted, [key(0)]);
        assert!(tier.remove(&key(1)).unwrap());
        assert!(tier.take_tags().is_empty(), "a new drive had none");
    }
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20);
    assert_eq!(tier.blocks(), 3);
    assert_eq!(tier.take_tags(), [(key(3), tag(3))]);
    assert!(tier.take_tags().is_empty(), "taken once");
    // The tag entries left are exactly the one of the block held.
    let entries: Vec<Box<[u8]>> = tier
        .db
        .iterator(rocksdb::IteratorMode::Start)
        .map(|e| e.unwrap().0)
        .filter(|k| k.first() == Some(&TAG_ENTRY))
        .collect();
    assert_eq!(entries, [tag_key(&key(3)).into_boxed_slice()]);
    // Read as a block's entry (as a daemon from before tags reads it), a
    // tag entry is unusable, and dropped on open.
    assert!(decode_entry(&entries[0], &EngineTag::to_wire(&Some(tag(3)))).is_none());
    // A tag entry whose block is gone, or whose bytes are not a tag, is
    // dropped on open; the block of an unreadable tag stays, untagged.
    tier.db
        .put(tag_key(&key(9)), EngineTag::to_wire(&Some(tag(9))))
        .unwrap();
    tier.db.put(tag_key(&key(4)), [7u8, 7]).unwrap();
    drop(tier);
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20);
    assert_eq!(tier.blocks(), 3);
    assert_eq!(tier.take_tags(), [(key(3), tag(3))]);
    let left = tier
        .db
        .iterator(rocksdb::IteratorMode::Start)
        .filter(|e| e.as_ref().unwrap().0.first() == Some(&TAG_ENTRY))
        .count();
    assert_eq!(left, 1);
    assert!(tier.get(&key(4)).await.unwrap().is_some());
}

#[tokio::test]
async fn blocks_round_trip_and_survive_a_reopen_on_both_engines() {
    for kind in [EngineKind::Uring, EngineKind::Psync] {
        let dir = Scratch::new();
        {
            let tier = open(&dir.0, kind, 64 << 20);
            for i in 0..50u64 {
                let v = value(i, 1000 + i as usize * 977);
                tier.put(&key(i), &v, checksum(&v), (None, None, true))
                    .await
                    .unwrap();
            }
            for i in 0..50u64 {
                let (got, _) = tier.get(&key(i)).await.unwrap().unwrap();
                assert_eq!(got, value(i, 1000 + i as usize * 977), "{kind:?} block {i}");
            }
            assert!(tier.remove(&key(7)).unwrap());
        }
        // A new process: the index finds every block, byte for byte.
        let tier = open(&dir.0, kind, 64 << 20);
        assert_eq!(tier.blocks(), 49);
        assert!(tier.get(&key(7)).await.unwrap().is_none());
        for i in (0..50u64).filter(|i| *i != 7) {
            let (got, _) = tier.get(&key(i)).await.unwrap().unwrap();
            assert_eq!(got, value(i, 1000 + i as usize * 977));
        }
        // Recovered extents are not handed out again.
        let v = value(99, 300_000);
        tier.put(&key(99), &v, checksum(&v), (None, None, true))
            .await
            .unwrap();
        for i in (0..50u64).filter(|i| *i != 7) {
            assert!(tier.get(&key(i)).await.unwrap().is_some());
        }
    }
}

#[tokio::test]
async fn a_full_tier_evicts_its_coldest_and_refuses_what_never_fits() {
    let dir = Scratch::new();
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20);
    for i in 0..8u64 {
        let v = value(i, 200 << 10);
        let evicted = tier
            .put(&key(i), &v, checksum(&v), (None, None, true))
            .await
            .unwrap();
        if i < 5 {
            assert!(evicted.is_empty());
        }
    }
    assert!(!tier.contains(&key(0)), "coldest evicted");
    assert!(tier.contains(&key(7)));
    assert!(tier.evictions() >= 3);
    assert!(tier.used() <= tier.capacity());
    let huge = vec![0u8; 2 << 20];
    assert!(matches!(
        tier.put(&key(100), &huge, 0, (None, None, true)).await,
        Err(TierError::TooLarge(_))
    ));
}

#[tokio::test]
async fn a_leased_block_is_passed_over_by_eviction_until_its_lease_ends() {
    let dir = Scratch::new();
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20);
    let put = |i: u64| put_hot(&tier, i, 250 << 10);
    for i in 0..4 {
        assert!(put(i).await.unwrap().is_empty());
    }
    let now = std::time::Instant::now();
    let later = now + std::time::Duration::from_secs(600);
    assert_eq!(tier.hold(&key(9), later), None, "not on the drive");
    assert_eq!(tier.hold(&key(0), later), Some(true));
    assert_eq!(tier.hold(&key(1), later), Some(true));
    assert!(tier.leased(&key(0)));
    // The two coldest are leased: the third goes.
    assert_eq!(put(4).await.unwrap(), vec![key(2)]);
    assert!(tier.contains(&key(0)) && tier.contains(&key(1)));
    // A lease that has ended holds nothing, and gives its share back.
    end_lease(&tier, &key(0), now);
    assert!(!tier.leased(&key(0)));
    assert_eq!(put(5).await.unwrap(), vec![key(3)]);
    assert_eq!(put(6).await.unwrap(), vec![key(0)]);
    assert_eq!(tier.hold(&key(5), later), Some(true));
    assert_eq!(tier.holds(), (2, 0));
    // A block that leaves takes its lease with it.
    assert!(tier.remove(&key(1)).unwrap());
    assert!(!tier.leased(&key(1)));
    assert!(!tier.state.lock().leases.by_key.contains_key(&key(1)));
    assert_eq!(tier.holds(), (1, 0));
}

/// Writes block `i` of `len` bytes to `tier`, as a block read before
/// (hot); the blocks its write evicted.
async fn put_hot(tier: &NvmeTier, i: u64, len: usize) -> Result<Vec<BlockKey>, TierError> {
    let v = value(i, len);
    tier.put(&key(i), &v, checksum(&v), (None, None, true))
        .await
}

/// Ends `key`'s lease on `tier` at `now`, as the clock would.
fn end_lease(tier: &NvmeTier, key: &BlockKey, now: std::time::Instant) {
    let mut state = tier.state.lock();
    state.leases.by_key.get_mut(key).unwrap().until = now;
    state.leases.due.push(std::cmp::Reverse((now, key.clone())));
}

#[tokio::test]
async fn leases_hold_at_most_half_a_drive_so_demotions_keep_room() {
    let dir = Scratch::new();
    // Four blocks of 256 KiB fill the drive; leases hold two at most.
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20);
    let put = |i: u64| put_hot(&tier, i, 256 << 10);
    for i in 0..4 {
        assert!(put(i).await.unwrap().is_empty());
    }
    let later = std::time::Instant::now() + std::time::Duration::from_secs(600);
    for i in 0..4 {
        assert_eq!(tier.hold(&key(i), later), Some(i < 2), "block {i}");
    }
    assert_eq!(tier.holds(), (2, 2), "two held, two past the share");
    // Taken again, a held lease stays held and an unheld one stays out.
    assert_eq!(tier.hold(&key(0), later), Some(true));
    assert_eq!(tier.hold(&key(3), later), Some(false));
    // Past the share a lease still refuses a removal that is not forced...
    assert!(tier.leased(&key(2)) && tier.leased(&key(3)));
    // ...but not the eviction: each write makes room from the unheld.
    assert_eq!(put(4).await.unwrap(), vec![key(2)]);
    assert_eq!(put(5).await.unwrap(), vec![key(3)]);
    assert!(tier.contains(&key(0)) && tier.contains(&key(1)));
    // The held ones' share is taken: a new lease is found but not held
    // (each refusal counted), until a held lease ends.
    assert_eq!(tier.hold(&key(4), later), Some(false));
    assert_eq!(tier.holds(), (2, 4));
    end_lease(&tier, &key(1), std::time::Instant::now());
    assert_eq!(tier.hold(&key(4), later), Some(true));
    assert_eq!(tier.holds(), (2, 4));
}

#[tokio::test]
async fn a_tenant_over_its_share_of_a_drive_evicts_its_own_blocks() {
    let dir = Scratch::new();
    let quotas = || Quotas::new([("acme".into(), 0.25)]);
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20).with_quotas(quotas());
    let in_ns = |ns: &str, i: u64| {
        BlockKey::new(
            Namespace::new(ns).unwrap(),
            BlockHash::from_opaque(&i.to_le_bytes()),
        )
    };
    for i in 0..4 {
        let v = value(i, 64 << 10);
        tier.put(&in_ns("globex", i), &v, checksum(&v), (None, None, true))
            .await
            .unwrap();
    }
    for i in 0..8 {
        let v = value(i, 64 << 10);
        tier.put(
            &in_ns("acme/llama", i),
            &v,
            checksum(&v),
            (None, None, true),
        )
        .await
        .unwrap();
        let (_, used, limit) = tier.tenant_usage()[0].clone();
        assert!(used <= limit, "acme holds {used} of {limit}");
    }
    for i in 0..4 {
        assert!(
            tier.contains(&in_ns("globex", i)),
            "globex's block {i} went for acme"
        );
    }
    assert!(!tier.contains(&in_ns("acme/llama", 0)) && tier.contains(&in_ns("acme/llama", 7)));
    drop(tier);
    // After a restart, the blocks found again count against the share.
    let tier = open(&dir.0, EngineKind::Psync, 1 << 20).with_quotas(quotas());
    assert_eq!(tier.tenant_usage()[0].1, 4 * (64 << 10));
}

#[tokio::test]
async fn corrupt_bytes_on_the_device_are_a_miss_and_dropped() {
    let dir = Scratch::new();
    let tier = open(&dir.0, EngineKind::Psync, 4 << 20);
    let v = value(1, 10_000);
    tier.put(&key(1), &v, checksum(&v) ^ 1, (None, None, true))
        .await
        .unwrap();
    assert!(tier.get(&key(1)).await.unwrap().is_none());
    assert_eq!(tier.corrupt_blocks(), 1);
    assert!(!tier.contains(&key(1)));
}

/// An engine that fails writes on demand with an errno (0: no
/// failure), to inject I/O errors and a full device.
struct Failing {
    inner: Box<dyn IoEngine>,
    errno: Arc<AtomicI32>,
}

impl IoEngine for Failing {
    fn submit(&self, kind: IoKind, batch: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>> {
        let errno = self.errno.load(Ordering::Relaxed);
        if kind == IoKind::Write && errno != 0 {
            let out = batch
                .into_iter()
                .map(|r| (r.buf, Err(io::Error::from_raw_os_error(errno))))
                .collect();
            return Box::pin(async move { out });
        }
        self.inner.submit(kind, batch)
    }
    fn name(&self) -> &'static str {
        "failing"
    }
}

#[tokio::test]
async fn an_io_error_or_a_full_device_leaves_no_entry_and_frees_the_space() {
    let dir = Scratch::new();
    let data = dir.0.join("tier.bin");
    let errno = Arc::new(AtomicI32::new(libc::EIO));
    let engine = Box::new(Failing {
        inner: engine(EngineKind::Psync, open_direct(&data).unwrap(), 4).unwrap(),
        errno: errno.clone(),
    });
    let index = NvmeTier::index_dir_for(&data);
    {
        let tier = NvmeTier::open(engine, 4 << 20, &index).unwrap();
        let v = value(3, 8192);
        assert!(matches!(
            tier.put(&key(3), &v, checksum(&v), (None, None, true))
                .await,
            Err(TierError::Io(_))
        ));
        errno.store(libc::ENOSPC, Ordering::Relaxed);
        assert!(matches!(
            tier.put(&key(3), &v, checksum(&v), (None, None, true))
                .await,
            Err(TierError::NoSpace)
        ));
        assert_eq!(tier.io_errors(), 2, "both failures counted");
        assert!(!tier.contains(&key(3)));
        assert_eq!(tier.used(), 0);
        errno.store(0, Ordering::Relaxed);
        tier.put(&key(3), &v, checksum(&v), (None, None, true))
            .await
            .unwrap();
        assert_eq!(tier.get(&key(3)).await.unwrap().unwrap().0, v);
    }
    let reopened = open(&dir.0, EngineKind::Psync, 4 << 20);
    assert_eq!(reopened.blocks(), 1);
}

#[test]
fn a_drive_in_use_by_another_tier_is_refused_by_name() {
    let dir = Scratch::new();
    let _first = open(&dir.0, EngineKind::Psync, 4 << 20);
    let data = dir.0.join("tier.bin");
    let engine = engine(EngineKind::Psync, open_direct(&data).unwrap(), 8).unwrap();
    let index = NvmeTier::index_dir_for(&data);
    match NvmeTier::open(engine, 4 << 20, &index) {
        Err(err @ TierError::InUse(_)) => {
            let text = err.to_string();
            assert!(text.contains(&index.display().to_string()), "{text}");
            assert!(text.contains("another daemon"), "{text}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a second tier opened a drive in use"),
    }
}

#[tokio::test]
async fn under_2q_a_drive_keeps_blocks_that_left_drams_main_queue_through_a_flood_of_cold_ones() {
    // A drive of 16 blocks of 64 KiB, its probation a quarter: two hot
    // blocks (they left DRAM's main queue), then 40 cold ones (they left
    // DRAM's probation unread). In 2Q the cold ones evict each other and
    // the hot ones stay; as an LRU the drive lets them push the hot out.
    const BLOCK: usize = 64 << 10;
    for (order, hot_kept) in [(Eviction::TwoQ, true), (Eviction::Lru, false)] {
        let dir = Scratch::new();
        let tier = open(&dir.0, EngineKind::Psync, 16 * BLOCK as u64).with_order(order, 0.25);
        let put = |i: u64, hot: bool| {
            let v = value(i, BLOCK);
            let sum = checksum(&v);
            let tier = &tier;
            async move { tier.put(&key(i), &v, sum, (None, None, hot)).await.unwrap() }
        };
        put(1, true).await;
        put(2, true).await;
        let mut evicted = Vec::new();
        for i in 100..140 {
            evicted.extend(put(i, false).await);
        }
        assert_eq!(
            tier.blocks(),
            16,
            "{order}: the drive is full, no room unused"
        );
        assert_eq!(
            tier.contains(&key(1)) && tier.contains(&key(2)),
            hot_kept,
            "{order}"
        );
        assert_eq!(evicted.contains(&key(1)), !hot_kept, "{order}");
        if hot_kept {
            let (got, _) = tier.get(&key(1)).await.unwrap().unwrap();
            assert_eq!(got, value(1, BLOCK));
            // A cold block read on the drive joins main, and a cold block
            // the drive dropped that comes back does too: neither is
            // evicted by the next flood.
            assert!(tier.get(&key(139)).await.unwrap().is_some());
            let dropped = evicted.first().cloned().unwrap();
            assert!(!tier.contains(&dropped));
            let back = (100..140).find(|i| key(*i) == dropped).unwrap();
            put(back, false).await;
            for i in 200..240 {
                put(i, false).await;
            }
            for k in [key(1), key(2), key(139), dropped] {
                assert!(tier.contains(&k), "{k} kept in main");
            }
        }
        drop(tier);
        // Reopened, every block is kept as reused (which part it was in is
        // not stored): the next flood goes through probation.
        let tier = open(&dir.0, EngineKind::Psync, 16 * BLOCK as u64).with_order(order, 0.25);
        let held: Vec<BlockKey> = tier.inventory().into_iter().map(|(k, ..)| k).collect();
        assert_eq!(held.len(), 16);
        for i in 300..340 {
            let v = value(i, BLOCK);
            tier.put(&key(i), &v, checksum(&v), (None, None, false))
                .await
                .unwrap();
        }
        let kept = held.iter().filter(|k| tier.contains(k)).count();
        match order {
            // Probation takes its share (4 blocks) and the one past it.
            Eviction::TwoQ => assert_eq!(kept, 11),
            Eviction::Lru => assert_eq!(kept, 0),
        }
    }
}

/// A drive whose writes end, and whose reads go, as the test lets them:
/// its writes' gate, then its reads'.
fn gated(
    dir: &Path,
) -> (
    Arc<NvmeTier>,
    Arc<tokio::sync::Semaphore>,
    Arc<tokio::sync::Semaphore>,
) {
    let data = dir.join("tier.bin");
    let engine = crate::io::gated::Gated::over(
        engine(EngineKind::Psync, open_direct(&data).unwrap(), 4).unwrap(),
    );
    let (writes, reads) = (engine.writes.clone(), engine.reads.clone());
    let tier = NvmeTier::open(Box::new(engine), 4 << 20, &NvmeTier::index_dir_for(&data)).unwrap();
    (Arc::new(tier), writes, reads)
}

/// Starts a put of `v` under `k` and returns once its write is in flight
/// (its room taken on the drive).
async fn writing(
    tier: &Arc<NvmeTier>,
    k: BlockKey,
    v: Vec<u8>,
) -> tokio::task::JoinHandle<Result<Vec<BlockKey>, TierError>> {
    let used = tier.used();
    let t = tier.clone();
    let put = tokio::spawn(async move { t.put(&k, &v, checksum(&v), (None, None, true)).await });
    for _ in 0..1000 {
        if tier.used() > used {
            return put;
        }
        tokio::task::yield_now().await;
    }
    panic!("the put never began its write");
}

#[tokio::test]
async fn a_block_removed_while_it_is_written_leaves_no_record_and_frees_its_room() {
    let dir = Scratch::new();
    let (tier, gate, _) = gated(&dir.0);
    let v = value(1, 8192);
    let put = writing(&tier, key(1), v).await;
    assert!(
        tier.remove(&key(1)).unwrap(),
        "a block being written is there to remove"
    );
    gate.add_permits(1);
    assert!(matches!(put.await.unwrap(), Err(TierError::Cancelled)));
    assert!(!tier.contains(&key(1)));
    assert!(tier.get(&key(1)).await.unwrap().is_none());
    assert_eq!(tier.used(), 0, "its room is free again");
    // Nor does its index entry bring it back on the next open.
    drop(tier);
    let tier = open(&dir.0, EngineKind::Psync, 4 << 20);
    assert!(!tier.contains(&key(1)));
}

#[tokio::test]
async fn a_block_written_again_while_its_write_is_in_flight_keeps_the_newer_bytes() {
    let dir = Scratch::new();
    let (tier, gate, reads) = gated(&dir.0);
    reads.add_permits(64);
    let (old, new) = (value(1, 8192), value(2, 8192));
    let first = writing(&tier, key(1), old).await;
    let second = writing(&tier, key(1), new.clone()).await;
    gate.add_permits(2);
    assert!(matches!(first.await.unwrap(), Err(TierError::Cancelled)));
    second.await.unwrap().unwrap();
    let (bytes, _) = tier.get(&key(1)).await.unwrap().expect("the newer write");
    assert_eq!(bytes, new);
    assert_eq!(tier.used(), 8192, "the older write's room is free again");
}

#[tokio::test]
async fn a_block_whose_room_is_written_again_while_it_is_read_is_a_miss_not_corruption() {
    let dir = Scratch::new();
    let (tier, writes, reads) = gated(&dir.0);
    writes.add_permits(64);
    let (old, new) = (value(1, 8192), value(2, 8192));
    tier.put(&key(1), &old, checksum(&old), (None, None, true))
        .await
        .unwrap();
    // The read has its block's place and waits to be sent; meanwhile the
    // block goes and another takes its room.
    let t = tier.clone();
    let read = tokio::spawn(async move { t.get(&key(1)).await });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(tier.remove(&key(1)).unwrap());
    tier.put(&key(2), &new, checksum(&new), (None, None, true))
        .await
        .unwrap();
    reads.add_permits(64);
    assert!(read.await.unwrap().unwrap().is_none(), "a miss");
    assert_eq!(tier.corrupt_blocks(), 0, "counted as corruption");
    let (bytes, _) = tier.get(&key(2)).await.unwrap().expect("the other block");
    assert_eq!(bytes, new);
}
