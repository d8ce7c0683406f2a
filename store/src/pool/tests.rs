use super::*;
use mooncake_proto::{BlockHash, Namespace};

fn key(i: u32) -> BlockKey {
    in_ns("test", i)
}

fn in_ns(ns: &str, i: u32) -> BlockKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    BlockKey::new(Namespace::new(ns).unwrap(), BlockHash(h))
}

fn pool(capacity: u64) -> Arc<DramPool> {
    Arc::new(DramPool::new(PoolConfig::with_capacity(capacity)).unwrap())
}

fn put(pool: &Arc<DramPool>, k: BlockKey, fill: u8, len: usize) -> Result<(), PoolError> {
    let value = vec![fill; len];
    let mut slot = pool.reserve(k, len as u64, checksum(&value))?;
    slot.buf_mut().copy_from_slice(&value);
    slot.commit()
}

#[test]
fn a_tenant_over_its_share_evicts_its_own_blocks_first() {
    let cfg = PoolConfig {
        quotas: Quotas::new([("acme".into(), 0.25)]),
        ..PoolConfig::with_capacity(1 << 20)
    };
    let p = Arc::new(DramPool::new(cfg).unwrap());
    // Another tenant's blocks, colder than all of acme's.
    for i in 0..4 {
        put(&p, in_ns("globex", i), 1, 64 << 10).unwrap();
    }
    // Acme writes twice its share (256 KiB) of 32 KiB blocks.
    for i in 0..16 {
        put(&p, in_ns("acme/llama", i), 2, 32 << 10).unwrap();
        let (_, used, limit) = p.tenant_usage()[0].clone();
        assert!(used <= limit, "acme at {used} of {limit}");
    }
    for i in 0..4 {
        assert!(
            p.contains(&in_ns("globex", i)),
            "globex's block {i} was evicted for acme"
        );
    }
    assert!(
        !p.contains(&in_ns("acme/llama", 0)),
        "acme's coldest went first"
    );
    assert!(p.contains(&in_ns("acme/llama", 15)));
    assert_eq!(p.quota_evictions(), 8);
    // A block larger than the whole share is refused.
    assert_eq!(
        put(&p, in_ns("acme", 99), 3, 300 << 10),
        Err(PoolError::NoSpace)
    );
}

#[test]
fn one_tenants_puts_in_progress_leave_room_for_anothers() {
    let cfg = PoolConfig {
        quotas: Quotas::new([("acme".into(), 1.0), ("globex".into(), 1.0)]),
        ..PoolConfig::with_capacity(1 << 20)
    };
    let p = Arc::new(DramPool::new(cfg).unwrap());
    // Headers without values, 16 KiB each: acme may hold half of the
    // quarter of the pool that puts in progress may hold (128 KiB).
    let mut held = Vec::new();
    let refused = loop {
        match p.reserve(in_ns("acme", held.len() as u32), 16 << 10, 0) {
            Ok(slot) => held.push(slot),
            Err(err) => break err,
        }
    };
    assert_eq!(refused, PoolError::Busy);
    assert_eq!(held.len(), 8, "acme's puts in progress: 128 KiB");
    // Globex's puts still find room, up to the rest of the quarter.
    let globex: Vec<_> = (0..8)
        .map(|i| p.reserve(in_ns("globex", i), 16 << 10, 0))
        .collect::<Result<_, _>>()
        .expect("the rest of the room is globex's to take");
    assert_eq!(
        p.reserve(in_ns("globex", 99), 16 << 10, 0).err(),
        Some(PoolError::Busy),
        "and no more than the whole quarter"
    );
    drop(held);
    put(&p, in_ns("acme", 100), 1, 16 << 10).expect("room again once acme's heads go");
    drop(globex);
    assert_eq!(p.inner.lock().tenant_pending, vec![0, 0]);
}

#[test]
fn put_then_get_returns_the_same_bytes() {
    let p = pool(1 << 20);
    put(&p, key(1), 7, 5000).unwrap();
    let lease = p.get(&key(1)).unwrap();
    assert_eq!(lease.bytes(), &vec![7u8; 5000][..]);
    assert!(lease.verify());
    assert_eq!(put(&p, key(1), 7, 5000), Err(PoolError::AlreadyExists));
}

#[test]
fn a_pin_count_never_wraps() {
    let p = pool(1 << 20);
    put(&p, key(1), 7, 100).unwrap();
    p.pin(&key(1)).unwrap();
    p.inner.lock().blocks.get_mut(&key(1)).unwrap().pins = u32::MAX;
    assert_eq!(p.pin(&key(1)), Err(PoolError::TooManyPins));
    assert_eq!(
        p.inner.lock().blocks[&key(1)].pins,
        u32::MAX,
        "not wrapped to 0"
    );
    assert_eq!(p.evict_bytes(1 << 20).1, 0, "still pinned: nothing evicted");
    assert!(p.contains(&key(1)));
}

#[test]
fn a_put_of_other_bytes_replaces_what_the_key_held() {
    let p = pool(1 << 20);
    put(&p, key(1), 7, 5000).unwrap();
    let old_reader = p.get(&key(1)).unwrap();
    put(&p, key(1), 8, 10).unwrap();
    let lease = p.get(&key(1)).unwrap();
    assert_eq!(lease.bytes(), &[8u8; 10][..], "the new bytes, not the old");
    assert!(lease.verify());
    assert_eq!(
        old_reader.bytes(),
        &vec![7u8; 5000][..],
        "a reader of the old block keeps its bytes until it lets go"
    );
    assert!(
        p.take_removed().is_empty(),
        "not a removal for the meta service: the key lives on, with new bytes"
    );
    let writing = p.reserve(key(2), 100, 0).unwrap();
    assert_eq!(
        p.reserve(key(2), 100, 0).err(),
        Some(PoolError::Busy),
        "a put in progress is neither replaced nor reported stored"
    );
    drop(writing);
}

#[test]
fn uncommitted_slot_is_invisible_and_its_space_comes_back() {
    let p = pool(1 << 20);
    let slot = p.reserve(key(1), 4096, 0).unwrap();
    assert!(p.get(&key(1)).is_none());
    assert!(p.stats().used >= 4096);
    drop(slot);
    assert_eq!(p.stats().used, 0);
    assert!(p.get(&key(1)).is_none());
}

#[test]
fn wrong_checksum_is_refused_and_frees_space() {
    let p = pool(1 << 20);
    let mut slot = p.reserve(key(1), 100, 12345).unwrap();
    slot.buf_mut().fill(1);
    assert_eq!(slot.commit(), Err(PoolError::ChecksumMismatch));
    assert!(!p.contains(&key(1)));
    assert_eq!(p.stats().used, 0);
}

#[test]
fn full_pool_evicts_least_recently_used_first() {
    let p = pool(64 << 10);
    // 56 KiB: under the high watermark (95% of 64 KiB).
    for i in 0..7 {
        put(&p, key(i), i as u8, 8 << 10).unwrap();
    }
    // Touch block 0 so that block 1 is now the coldest.
    drop(p.get(&key(0)).unwrap());
    put(&p, key(100), 1, 8 << 10).unwrap();
    assert!(p.contains(&key(0)), "recently read block survived");
    assert!(!p.contains(&key(1)), "coldest block was evicted");
    assert!(p.stats().evictions >= 1);
    assert!(p.take_removed().contains(&key(1)));
    assert!(p.stats().used <= p.stats().capacity);
}

#[test]
fn chain_tails_are_evicted_before_the_blocks_they_extend() {
    // Room for 4 blocks of 64 KiB (and the watermarks leave 3).
    let p = pool(4 * (64 << 10));
    let put_child = |k: u32, parent: Option<u32>| {
        let value = vec![k as u8; 64 << 10];
        let mut slot = p
            .reserve(key(k), value.len() as u64, checksum(&value))
            .unwrap();
        slot.buf_mut().copy_from_slice(&value);
        slot.set_parent(parent.map(|q| key(q).hash));
        slot.commit().unwrap();
    };
    // A chain 1 <- 2 <- 3, oldest first: plain LRU would evict 1, the
    // head every prefix match needs, and strand 2 and 3.
    put_child(1, None);
    put_child(2, Some(1));
    put_child(3, Some(2));
    put_child(4, None);
    assert!(
        p.contains(&key(1)) && p.contains(&key(2)),
        "the chain's head and middle stay"
    );
    assert!(!p.contains(&key(3)), "the chain's tail went first");
    // With 3 gone, 2 is the chain's tail, and colder than 4.
    put_child(5, None);
    assert!(!p.contains(&key(2)));
    assert!(
        p.contains(&key(1)) && p.contains(&key(4)),
        "the head outlives its tail"
    );
}

#[test]
fn pinned_and_leased_blocks_are_never_evicted() {
    let p = pool(64 << 10);
    put(&p, key(0), 0, 16 << 10).unwrap();
    put(&p, key(1), 1, 16 << 10).unwrap();
    p.pin(&key(0)).unwrap();
    let lease = p.get(&key(1)).unwrap();
    for i in 10..30 {
        let _ = put(&p, key(i), 2, 8 << 10);
    }
    assert!(p.contains(&key(0)));
    assert!(p.contains(&key(1)));
    assert_eq!(lease.bytes(), &vec![1u8; 16 << 10][..]);
    // With everything else pinned or leased, a block that needs their
    // space gets a clean NoSpace.
    assert_eq!(put(&p, key(99), 3, 60 << 10), Err(PoolError::NoSpace));
    drop(lease);
    p.unpin(&key(0)).unwrap();
    put(&p, key(99), 3, 40 << 10).unwrap();
    assert!(!p.contains(&key(0)) || !p.contains(&key(1)));
}

#[test]
fn a_held_block_outlives_eviction_until_its_lease_ends() {
    let p = pool(64 << 10);
    let hour = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    put(&p, key(0), 0, 16 << 10).unwrap();
    put(&p, key(1), 1, 16 << 10).unwrap();
    p.hold(&key(0), hour).unwrap();
    // Held by a lease that has already run out: evictable again.
    p.hold(&key(1), std::time::Instant::now()).unwrap();
    assert_eq!(p.hold(&key(7), hour), Err(PoolError::NotFound));
    for i in 10..30 {
        let _ = put(&p, key(i), 2, 8 << 10);
    }
    assert!(p.contains(&key(0)), "a held block was evicted");
    assert!(!p.contains(&key(1)), "a lease that ran out still holds");
    assert_eq!(p.held(), 1);
    // The space of everything else, and the held block's: NoSpace.
    assert_eq!(put(&p, key(99), 3, 60 << 10), Err(PoolError::NoSpace));
    // A shorter lease taken again does not shorten it.
    p.hold(&key(0), std::time::Instant::now()).unwrap();
    assert_eq!(put(&p, key(99), 3, 60 << 10), Err(PoolError::NoSpace));
    // Removing a held block ends its lease with it.
    p.remove(&key(0)).unwrap();
    assert_eq!(p.held(), 0);
    put(&p, key(99), 3, 60 << 10).unwrap();
}

/// A pool of 64 KiB with three blocks of 16 KiB, each leased for an hour:
/// the first two held, the third past the leases' half of the pool.
fn three_leased_two_held() -> (Arc<DramPool>, std::time::Instant) {
    let p = pool(64 << 10);
    let hour = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    for i in 0..3 {
        put(&p, key(i), i as u8, 16 << 10).unwrap();
    }
    let held: Vec<_> = (0..3).map(|i| p.hold(&key(i), hour)).collect();
    assert_eq!(held, [Ok(()), Ok(()), Err(PoolError::Busy)]);
    (p, hour)
}

#[test]
fn leases_hold_at_most_half_the_pool_so_puts_keep_room() {
    let (p, hour) = three_leased_two_held();
    assert_eq!((p.held(), p.holds_refused()), (2, 1));
    // Taken again, a lease held is extended, not refused.
    assert_eq!(p.hold(&key(0), hour), Ok(()));
    // A put finds room: the block not held goes, the held ones stay.
    put(&p, key(9), 9, 24 << 10).unwrap();
    assert!(p.contains(&key(0)) && p.contains(&key(1)));
    assert!(!p.contains(&key(2)));
}

#[test]
fn a_lease_refuses_a_removal_that_is_not_forced_even_past_the_leases_share() {
    let (p, _) = three_leased_two_held();
    for i in 0..3 {
        assert_eq!(
            p.remove_unheld(&key(i)),
            Err(PoolError::Leased),
            "block {i}"
        );
        assert!(p.contains(&key(i)));
    }
    assert_eq!(p.remove(&key(2)), Ok(()), "forced");
    assert_eq!(p.held(), 2);
    put(&p, key(3), 3, 16 << 10).unwrap();
    assert_eq!(p.remove_unheld(&key(3)), Ok(()), "no lease on it");
    assert_eq!(p.remove_unheld(&key(3)), Err(PoolError::NotFound));
}

#[test]
fn a_lease_ends_by_itself_and_the_block_goes_back_where_it_was() {
    let p = pool(64 << 10);
    let soon = std::time::Instant::now() + std::time::Duration::from_millis(20);
    for i in 0..3 {
        put(&p, key(i), i as u8, 16 << 10).unwrap();
    }
    p.hold(&key(0), soon).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(30));
    // Past its end: key 0, the coldest, goes first again.
    assert_eq!(p.evict_bytes(1).1, 1);
    assert!(!p.contains(&key(0)));
    assert!(p.contains(&key(1)) && p.contains(&key(2)));
    assert_eq!(p.held(), 0);
}

#[test]
fn removed_block_stays_readable_while_leased() {
    let p = pool(1 << 20);
    put(&p, key(1), 9, 4096).unwrap();
    let lease = p.get(&key(1)).unwrap();
    p.remove(&key(1)).unwrap();
    assert!(p.get(&key(1)).is_none());
    // Its space is still held: a new block cannot overwrite the bytes.
    put(&p, key(2), 1, 4096).unwrap();
    assert_eq!(lease.bytes(), &vec![9u8; 4096][..]);
    drop(lease);
    p.remove(&key(2)).unwrap();
    assert_eq!(p.stats().used, 0);
}

#[test]
fn flipped_byte_fails_verification_and_is_dropped() {
    let p = pool(1 << 20);
    put(&p, key(1), 5, 2048).unwrap();
    assert!(p.flip_byte_for_test(&key(1), 100));
    let lease = p.get(&key(1)).unwrap();
    assert!(!lease.verify());
    p.drop_corrupt(&lease);
    drop(lease);
    assert!(!p.contains(&key(1)));
    assert_eq!(p.corrupt_blocks(), 1);
    assert_eq!(p.stats().used, 0);
}

#[test]
fn inventory_lists_only_committed_blocks() {
    let p = pool(1 << 20);
    put(&p, key(1), 1, 100).unwrap();
    let _writing = p.reserve(key(2), 100, 0).unwrap();
    let inv = p.inventory();
    assert_eq!(inv.len(), 1);
    assert_eq!((inv[0].0.clone(), inv[0].1, inv[0].3), (key(1), 100, None));
}

#[test]
fn evict_bytes_frees_the_coldest_first_and_reports_them() {
    let p = pool(1 << 20);
    for i in 0..4 {
        put(&p, key(i), 0, 10 << 10).unwrap();
    }
    let (freed, blocks) = p.evict_bytes(15 << 10);
    assert_eq!(blocks, 2);
    assert!(freed >= 15 << 10);
    assert!(!p.contains(&key(0)) && !p.contains(&key(1)) && p.contains(&key(2)));
    assert_eq!(p.take_removed(), vec![key(0), key(1)]);
}

#[test]
fn oversized_block_is_refused_without_allocating() {
    let p = pool(1 << 20);
    assert_eq!(
        put(&p, key(1), 0, 2 << 20),
        Err(PoolError::TooLarge(2 << 20))
    );
    assert_eq!(p.stats().used, 0);
}

#[test]
fn random_workload_never_overlaps_or_leaks() {
    use rand::{Rng, SeedableRng};
    let p = pool(1 << 20);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for i in 0..3000u32 {
        let len = rng.gen_range(1..64 << 10);
        let fill = (i % 251) as u8;
        let _ = put(&p, key(i), fill, len);
        if rng.gen_bool(0.1) {
            let _ = p.remove(&key(rng.gen_range(0..=i)));
        }
        let probe = key(rng.gen_range(0..=i));
        if let Some(lease) = p.get(&probe) {
            let expect = (u32::from_le_bytes(probe.hash.0[..4].try_into().unwrap()) % 251) as u8;
            assert!(
                lease.bytes().iter().all(|b| *b == expect),
                "overlap detected"
            );
        }
        assert!(p.stats().used <= p.stats().capacity);
    }
    for i in 0..3000 {
        let _ = p.remove(&key(i));
    }
    assert_eq!(p.stats().used, 0, "space leaked");
    assert_eq!(p.stats().blocks, 0);
}

#[test]
fn under_two_q_new_blocks_fill_a_pool_that_holds_nothing_reused() {
    // Probation holds more than its share while main has nothing to give:
    // a pool of sixteen 64 KiB blocks keeps the last sixteen put.
    let cfg = PoolConfig {
        eviction: Eviction::TwoQ,
        high_watermark: 1.0,
        ..PoolConfig::with_capacity(1 << 20)
    };
    let p = Arc::new(DramPool::new(cfg).unwrap());
    for i in 0..40 {
        put(&p, key(i), i as u8, 64 << 10).unwrap();
    }
    let kept: Vec<u32> = (0..40).filter(|i| p.contains(&key(*i))).collect();
    assert_eq!(kept, (24..40).collect::<Vec<_>>());
}

#[test]
fn under_two_q_probation_within_its_share_gives_way_by_age_as_main_does() {
    // A pool of sixteen 64 KiB blocks, probation a quarter of it: block 0
    // is put and never read, blocks 1..16 are read (main). Probation holds
    // one block, within its share: the coldest block of either queue goes,
    // and that is block 0, not main's coldest.
    let cfg = PoolConfig {
        eviction: Eviction::TwoQ,
        probation_share: 0.25,
        high_watermark: 1.0,
        ..PoolConfig::with_capacity(1 << 20)
    };
    let p = Arc::new(DramPool::new(cfg).unwrap());
    put(&p, key(0), 0, 64 << 10).unwrap();
    for i in 1..16 {
        put(&p, key(i), i as u8, 64 << 10).unwrap();
        drop(p.get(&key(i)));
    }
    assert!((0..16).all(|i| p.contains(&key(i))));
    put(&p, key(100), 1, 64 << 10).unwrap();
    assert!(!p.contains(&key(0)), "the coldest block, in probation");
    assert!((1..16).all(|i| p.contains(&key(i))), "main's blocks stay");
    // Twenty new blocks, never read: probation grows past its share (four
    // blocks) at main's coldest, then its own blocks go first, however
    // cold main's are.
    for i in 200..220 {
        put(&p, key(i), 2, 64 << 10).unwrap();
    }
    let main: Vec<u32> = (1..16).filter(|i| p.contains(&key(*i))).collect();
    assert_eq!(main, (5..16).collect::<Vec<_>>());
    let probation: Vec<u32> = (200..220).filter(|i| p.contains(&key(*i))).collect();
    assert_eq!(probation, (215..220).collect::<Vec<_>>());
}

/// A 1 MiB pool under 2Q whose main queue holds twelve 64 KiB blocks read
/// once (keys 0..12); probation (5%) holds less than one block.
fn two_q_with_main_full() -> Arc<DramPool> {
    let cfg = PoolConfig {
        eviction: Eviction::TwoQ,
        high_watermark: 1.0,
        ..PoolConfig::with_capacity(1 << 20)
    };
    let p = Arc::new(DramPool::new(cfg).unwrap());
    for i in 0..12 {
        put(&p, key(i), 1, 64 << 10).unwrap();
        drop(p.get(&key(i)));
    }
    p
}

#[test]
fn a_readers_miss_grows_probation_once_whether_the_daemon_saw_the_get_or_was_told() {
    // Main full of blocks read once, then eight new blocks of
    // which probation lets most go. Each missed block is both got here and
    // reported by the meta service (`missed`), twice: it counts once.
    let p = two_q_with_main_full();
    let keys: Vec<BlockKey> = (100..108).map(key).collect();
    for k in &keys {
        put(&p, k.clone(), 2, 64 << 10).unwrap();
    }
    let gone: Vec<&BlockKey> = keys.iter().filter(|k| !p.contains(k)).collect();
    assert!(!gone.is_empty());
    let (_, before) = p.probation();
    for k in &gone {
        assert!(p.get(k).is_none());
        p.missed(k);
        p.missed(k);
    }
    let (_, after) = p.probation();
    assert_eq!(after - before, gone.len() as u64 * (64 << 10));
    assert_eq!(p.eviction_events().early_eviction_reads, gone.len() as u64);
    // Still remembered as let go by probation: put again, it enters main.
    let ghost_hits = p.eviction_events().ghost_hits;
    put(&p, gone[0].clone(), 3, 64 << 10).unwrap();
    assert_eq!(p.eviction_events().ghost_hits, ghost_hits + 1);
}

#[test]
fn under_two_q_readers_that_come_back_soon_grow_probation_until_their_blocks_stay() {
    // Main holds twelve blocks read once; then rounds of eight new blocks,
    // each read right after the round is put (a decode node reading what a
    // prefill node put). Probation (5%: not one block) lets them go at
    // first; each read of one it let go grows it, until a round stays.
    let p = two_q_with_main_full();
    let (_, limit) = p.probation();
    assert!(limit < 64 << 10, "probation starts below one block");
    let mut hits_per_round = Vec::new();
    for round in 0..6u32 {
        let keys: Vec<BlockKey> = (0..8).map(|i| key(100 + round * 8 + i)).collect();
        for k in &keys {
            put(&p, k.clone(), 2, 64 << 10).unwrap();
        }
        hits_per_round.push(keys.iter().filter(|k| p.get(k).is_some()).count());
    }
    assert!(hits_per_round[0] < 8, "{hits_per_round:?}");
    assert_eq!(*hits_per_round.last().unwrap(), 8, "{hits_per_round:?}");
    assert!(p.eviction_events().early_eviction_reads > 0);
    let (_, limit) = p.probation();
    assert!(
        limit > 4 * (64 << 10),
        "probation grew toward a round: {limit}"
    );
}

/// Puts a 64 KiB block after `parent`, with the meta service's judgement
/// `continues`.
fn put_judged(p: &Arc<DramPool>, k: u32, parent: u32, continues: bool) {
    let value = vec![k as u8; 64 << 10];
    let mut slot = p
        .reserve(key(k), value.len() as u64, checksum(&value))
        .unwrap();
    slot.buf_mut().copy_from_slice(&value);
    slot.set_parent(Some(key(parent).hash));
    slot.set_continues(continues);
    slot.commit().unwrap();
}

#[test]
fn under_two_q_a_block_whose_parent_is_elsewhere_follows_the_meta_services_judgement() {
    // Main full of blocks read once; probation holds less than a block.
    // Block 100's parent (50) and block 101's (51) are on other daemons:
    // the meta service judged that 100 continues a branch that comes back.
    let p = two_q_with_main_full();
    let admitted = p.eviction_events().branch_admitted;
    put_judged(&p, 100, 50, true);
    put_judged(&p, 101, 51, false);
    assert_eq!(p.eviction_events().branch_admitted, admitted + 1);
    for i in 102..106 {
        put(&p, key(i), 2, 64 << 10).unwrap();
    }
    assert!(p.contains(&key(100)), "in main, past the new blocks");
    assert!(!p.contains(&key(101)), "in probation, let go");
}

#[test]
fn under_two_q_a_block_whose_parent_is_here_follows_the_pools_own_judgement() {
    // Block 11 is in main, read once: a branch point whose first branch
    // enters main whatever the meta service said. Block 100 is in
    // probation and never read: 101 continues its chain there, though the
    // meta service said otherwise.
    let p = two_q_with_main_full();
    put_judged(&p, 20, 11, false);
    put(&p, key(100), 2, 64 << 10).unwrap();
    put_judged(&p, 101, 100, true);
    for i in 102..106 {
        put(&p, key(i), 2, 64 << 10).unwrap();
    }
    assert!(p.contains(&key(20)), "a branch off a read prefix, in main");
    assert!(!p.contains(&key(101)), "continued its parent's probation");
}

#[test]
fn an_evicted_block_on_its_way_to_the_next_tier_is_still_served() {
    let p = pool(256 << 10);
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    p.demote_to(tx);
    for i in 0..4 {
        put(&p, key(i), i as u8, 64 << 10).unwrap();
    }
    // A fifth block evicts the first, which waits in the queue.
    put(&p, key(4), 4, 64 << 10).unwrap();
    assert!(!p.contains(&key(0)));
    let first = rx.try_recv().unwrap();
    assert_eq!(first.key, key(0));
    assert!(!p.read_on_its_way(&first), "not read yet");
    let (bytes, sum) = p.get_demoting(&key(0)).expect("served from the queue");
    assert_eq!(&bytes[..], &vec![0u8; 64 << 10][..]);
    assert_eq!(sum, checksum(&bytes));
    assert!(
        p.read_on_its_way(&first),
        "read on its way: the drive keeps it as read"
    );
    // Put again and evicted again before the first demotion is done: the
    // older one's completion leaves the newer one served.
    put(&p, key(0), 9, 64 << 10).unwrap();
    for i in 5..9 {
        put(&p, key(i), 5, 64 << 10).unwrap();
    }
    assert!(!p.contains(&key(0)));
    p.demotion_done(&first);
    let newer = std::iter::from_fn(|| rx.try_recv().ok())
        .find(|d| d.key == key(0))
        .expect("demoted again");
    assert!(
        !p.read_on_its_way(&newer) && !p.read_on_its_way(&first),
        "the newer demotion was not read; the older one is done"
    );
    let (bytes, _) = p.get_demoting(&key(0)).expect("the newer demotion");
    assert!(p.read_on_its_way(&newer));
    assert_eq!(bytes[0], 9, "the newer bytes");
    p.demotion_done(&newer);
    while let Ok(d) = rx.try_recv() {
        p.demotion_done(&d);
    }
    assert!(
        p.get_demoting(&key(0)).is_none(),
        "written: no longer served from the queue"
    );
}
