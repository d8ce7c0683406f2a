use super::*;
use mooncake_proto::{BlockHash, Namespace};

#[test]
fn a_blocks_tag_is_kept_while_a_tier_holds_it_and_reported_in_the_inventory() {
    use crate::pool::PoolConfig;
    let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
    let tiers = Tiers::dram_only(pool.clone());
    let key = |i: u8| BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]));
    let put = |i: u8| {
        let bytes = vec![i; 4096];
        let mut slot = pool
            .reserve(key(i), 4096, mooncake_proto::checksum::checksum(&bytes))
            .unwrap();
        slot.buf_mut().copy_from_slice(&bytes);
        slot.commit().unwrap();
    };
    let tag = |n: u64| {
        Some(Arc::new(
            EngineTag::new(
                Some(mooncake_proto::message::EngineHash::Int(n)),
                vec![1, 2],
            )
            .unwrap(),
        ))
    };
    for i in 1..=3 {
        put(i);
        tiers.set_tag(&key(i), tag(u64::from(i)));
    }
    let inventory = tiers.inventory();
    let of = |i: u8| {
        inventory
            .iter()
            .find(|b| b.key == key(i))
            .unwrap()
            .tag
            .clone()
    };
    assert_eq!((of(1), of(3)), (tag(1), tag(3)));
    // A removal takes it; a report of a block gone that is held again
    // (put anew since) does not; one of a block gone does.
    assert!(tiers.remove(&key(1)));
    tiers.forget_tags(&[key(2)]);
    assert_eq!(tiers.tags_kept(), 2);
    pool.remove(&key(2)).unwrap();
    tiers.forget_tags(&[key(2)]);
    assert_eq!(tiers.tags_kept(), 1);
    // Bytes put again without a tag lose the old one.
    tiers.set_tag(&key(3), None);
    assert_eq!(tiers.tags_kept(), 0);
}

/// A block reported gone and stored again before the report left (put
/// anew after a removal, say) is not reported: the meta service would
/// take the new copy out of its index while this daemon serves it.
#[test]
fn a_block_gone_is_not_reported_once_held_or_being_stored_again() {
    use crate::pool::PoolConfig;
    let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
    let tiers = Tiers::dram_only(pool.clone());
    let key = |i: u8| BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]));
    let bytes = vec![1u8; 4096];
    let sum = mooncake_proto::checksum::checksum(&bytes);
    let mut stored = pool.reserve(key(1), 4096, sum).unwrap();
    stored.buf_mut().copy_from_slice(&bytes);
    stored.commit().unwrap();
    let _being_written = pool.reserve(key(2), 4096, sum).unwrap();
    assert!(tiers.start_admitting(&key(4)));
    let reported = (1..=4).map(key).collect();
    assert_eq!(tiers.still_gone(reported), vec![key(3)]);
}

#[test]
fn tags_are_kept_as_far_as_the_leaders_events_use_them() {
    use crate::pool::PoolConfig;
    let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
    let tiers = Tiers::dram_only(pool);
    let key = |i: u8| BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]));
    let hashed = EngineTag::new(Some(mooncake_proto::message::EngineHash::Int(7)), vec![])
        .unwrap()
        .with_key("k-1")
        .unwrap();
    let key_only = EngineTag::default().with_key("k-2").unwrap();
    let kept = |i: u8| tiers.tags.lock().get(&key(i)).cloned();
    tiers.set_tag(&key(1), Some(Arc::new(hashed.clone())));
    tiers.set_tag(&key(2), Some(Arc::new(key_only.clone())));
    assert_eq!(tiers.tags_kept(), 2, "whole tags before any leader said");
    // vLLM's format: keys go, and a tag that was only a key with them.
    tiers.keep_tags(KeepTags::WithoutKeys);
    assert_eq!(tiers.tags_kept(), 1);
    assert_eq!(kept(1).unwrap().key, None);
    assert_eq!(kept(1).unwrap().hash, hashed.hash);
    tiers.set_tag(&key(2), Some(Arc::new(key_only.clone())));
    assert_eq!(tiers.tags_kept(), 1, "a key alone is not kept");
    // Mooncake's: whole tags again.
    tiers.keep_tags(KeepTags::WithKeys);
    tiers.set_tag(&key(2), Some(Arc::new(key_only)));
    assert_eq!(kept(2).unwrap().key.as_deref(), Some("k-2"));
    // Events off: nothing, now or later.
    tiers.keep_tags(KeepTags::No);
    assert_eq!(tiers.tags_kept(), 0);
    tiers.set_tag(&key(1), Some(Arc::new(hashed)));
    assert_eq!(tiers.tags_kept(), 0);
}

#[test]
fn an_inventory_lists_each_block_after_the_parent_it_holds() {
    let ns = Namespace::new("t").unwrap();
    let h = |i: u8| BlockHash([i; 32]);
    let block = |i: u8, parent: Option<u8>| InventoryBlock {
        key: BlockKey::new(ns.clone(), h(i)),
        size: 1,
        checksum: 0,
        tier: Tier::Dram,
        parent: parent.map(h),
        tag: None,
    };
    // Chains 1 <- 2 <- 3 <- 4 and 1 <- 5; 7 names 6, which is not held.
    let shuffled = vec![
        block(4, Some(3)),
        block(7, Some(6)),
        block(2, Some(1)),
        block(5, Some(1)),
        block(3, Some(2)),
        block(1, None),
    ];
    let order: Vec<u8> = parents_first(shuffled)
        .iter()
        .map(|b| b.key.hash.0[0])
        .collect();
    assert_eq!(order.len(), 6, "{order:?}");
    let pos = |i: u8| order.iter().position(|&x| x == i).unwrap();
    for (child, parent) in [(2, 1), (3, 2), (4, 3), (5, 1)] {
        assert!(
            pos(parent) < pos(child),
            "{parent} before {child}: {order:?}"
        );
    }
}

/// A scratch folder for a drive, removed with it.
struct Scratch(std::path::PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// DRAM of 1 MiB over one drive of 4 MiB, promoting on the first hit;
/// the drive's writes end only as `gate` lets them.
fn over_a_gated_drive(
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> (Arc<Tiers>, Arc<tokio::sync::Semaphore>, Scratch) {
    over_a_gated_drive_promoting(tasks, stop, 1)
}

/// `over_a_gated_drive`, promoting after `promote_after` hits (0: never).
fn over_a_gated_drive_promoting(
    tasks: &TaskTracker,
    stop: &CancellationToken,
    promote_after: u32,
) -> (Arc<Tiers>, Arc<tokio::sync::Semaphore>, Scratch) {
    use crate::io::{engine, gated::Gated, open_direct, EngineKind};
    use crate::pool::PoolConfig;
    let dir = std::env::temp_dir().join(format!(
        "mooncake-tiers-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("drive.bin");
    let gated = Gated::over(engine(EngineKind::Psync, open_direct(&data).unwrap(), 4).unwrap());
    gated.reads.add_permits(1 << 20);
    let gate = gated.writes.clone();
    let drive = NvmeTier::open(Box::new(gated), 4 << 20, &NvmeTier::index_dir_for(&data)).unwrap();
    let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
    let drives = vec![Arc::new(drive)];
    let tiers = Tiers::with_nvme(pool, drives, promote_after, (tasks, stop.clone()));
    (tiers, gate, Scratch(dir))
}

/// Stops the tiers' background tasks and waits for them.
async fn stopped(tasks: TaskTracker, stop: CancellationToken) {
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

fn key(i: u8) -> BlockKey {
    BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]))
}

fn bytes(i: u8) -> Vec<u8> {
    (0..65536u32).map(|j| (j as u8).wrapping_mul(i)).collect()
}

/// Puts `v` under `k` in DRAM.
async fn put(tiers: &Tiers, k: BlockKey, v: &[u8]) {
    let sum = mooncake_proto::checksum::checksum(v);
    let mut slot = tiers
        .reserve_put(k, v.len() as u64, Some(sum), Duration::from_secs(1))
        .await
        .unwrap();
    slot.buf_mut().copy_from_slice(v);
    slot.commit().unwrap();
}

/// Waits (boundedly) until the demoter has taken every block evicted.
async fn demotions_settled(tiers: &Tiers) {
    for _ in 0..5000 {
        if tiers.dram.demotions_waiting() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("demotions never settled");
}

#[tokio::test]
async fn a_block_removed_while_read_from_a_drive_is_not_promoted_back() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let (tiers, gate, _dir) = over_a_gated_drive(&tasks, &stop);
    gate.add_permits(64);
    let drive = tiers.nvme[0].clone();
    let on_drive = |i: u8| {
        let v = bytes(i);
        let (drive, sum) = (drive.clone(), mooncake_proto::checksum::checksum(&v));
        async move {
            drive
                .put(&key(i), &v, sum, (None, None, false))
                .await
                .unwrap();
        }
    };
    // Read from the drive (a get's miss in DRAM, a lease's prefetch),
    // then removed before the bytes go into DRAM.
    on_drive(1).await;
    let (read, sum) = read_drive(&drive, &key(1)).await.unwrap();
    assert!(tiers.remove(&key(1)));
    assert!(!tiers.promote(&key(1), &read, sum));
    assert!(!tiers.contains(&key(1)), "the removed block came back");
    // Read, then put again with other bytes: the read's older bytes do
    // not replace them.
    on_drive(2).await;
    let (old, old_sum) = read_drive(&drive, &key(2)).await.unwrap();
    put(&tiers, key(2), &bytes(3)).await;
    assert!(!tiers.promote(&key(2), &old, old_sum));
    let sum3 = mooncake_proto::checksum::checksum(&bytes(3));
    assert_eq!(tiers.dram.get(&key(2)).map(|l| l.checksum()), Some(sum3));
    // Nothing in between: it goes back to DRAM.
    on_drive(4).await;
    let (read, sum) = read_drive(&drive, &key(4)).await.unwrap();
    assert!(tiers.promote(&key(4), &read, sum));
    assert!(tiers.dram.contains(&key(4)));
    stopped(tasks, stop).await;
}

#[tokio::test]
async fn a_block_removed_on_its_way_to_a_drive_is_neither_served_nor_written() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let (tiers, gate, _dir) = over_a_gated_drive(&tasks, &stop);
    for i in 1..=4 {
        put(&tiers, key(i), &bytes(i)).await;
    }
    // Four blocks evicted, oldest first: the demoter writes two (held at
    // the gate) and the other two wait in its queue.
    assert_eq!(tiers.dram.evict_bytes(4 * 65536).1, 4);
    for i in [1, 3] {
        assert!(tiers.get_nvme(&key(i)).await.is_some(), "served on its way");
        assert!(
            tiers.remove(&key(i)),
            "a block on its way is there to remove"
        );
        assert!(
            tiers.get_nvme(&key(i)).await.is_none(),
            "removed, still served"
        );
    }
    gate.add_permits(64);
    demotions_settled(&tiers).await;
    let drive = &tiers.nvme[0];
    for i in [1, 3] {
        assert!(!drive.contains(&key(i)), "block {i}: removed, then written");
    }
    for i in [2, 4] {
        assert!(
            drive.contains(&key(i)),
            "block {i}: not removed, not written"
        );
    }
    assert_eq!(drive.used(), 2 * 65536);
    stopped(tasks, stop).await;
}

#[tokio::test]
async fn a_lease_holds_a_block_on_a_drive_or_on_its_way_there_against_a_removal_not_forced() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    // Never promotes: a lease brings nothing back to DRAM.
    let (tiers, gate, _dir) = over_a_gated_drive_promoting(&tasks, &stop, 0);
    for i in 1..=3 {
        put(&tiers, key(i), &bytes(i)).await;
    }
    assert_eq!(tiers.dram.evict_bytes(3 * 65536).1, 3);
    // Leased on its way to the drive (its write held at the gate).
    let later = std::time::Instant::now() + Duration::from_secs(600);
    tiers.hold(&key(1), later).unwrap();
    gate.add_permits(64);
    demotions_settled(&tiers).await;
    assert!(tiers.nvme[0].leased(&key(1)), "the lease went with it");
    // Leased where only the drive holds it.
    tiers.hold(&key(2), later).unwrap();
    for i in [1, 2] {
        assert!(
            matches!(tiers.remove_unleased(&key(i)), Err(PoolError::Leased)),
            "block {i}"
        );
        assert!(tiers.contains(&key(i)) && !tiers.dram.contains(&key(i)));
    }
    assert_eq!(
        [1, 2, 3, 9].map(|i| tiers.lease_of(&key(i))),
        [Some(true), Some(true), Some(false), None]
    );
    // Unleased, and forced: both go.
    assert_eq!(tiers.remove_unleased(&key(3)), Ok(true));
    assert!(tiers.remove(&key(1)));
    assert!(!tiers.contains(&key(1)) && !tiers.contains(&key(3)));
    assert!(matches!(
        tiers.hold(&key(3), later),
        Err(PoolError::NotFound)
    ));
    stopped(tasks, stop).await;
}

#[test]
fn a_removal_that_comes_while_a_block_is_admitted_keeps_it_out_of_the_pool() {
    use crate::pool::PoolConfig;
    let pool = Arc::new(DramPool::new(PoolConfig::with_capacity(1 << 20)).unwrap());
    let tiers = Tiers::dram_only(pool.clone());
    let key = |i: u8| BlockKey::new(Namespace::new("t").unwrap(), BlockHash([i; 32]));
    let bytes = vec![9u8; 4096];
    let sum = mooncake_proto::checksum::checksum(&bytes);
    // Named in its room, out of the pool, while the meta service admits it.
    let named = |i: u8| {
        assert!(tiers.start_admitting(&key(i)));
        let room = tiers.reserve_room(4096).unwrap();
        let Ok(mut slot) = pool.fill_room(room, key(i), 4096, Some(sum)) else {
            panic!("room for block {i}");
        };
        slot.buf_mut().copy_from_slice(&bytes);
        slot
    };
    let slot = named(1);
    assert!(
        !tiers.start_admitting(&key(1)),
        "one writer of a key at a time"
    );
    // Admitted; a removal reaches the daemon before the block is stored.
    assert!(!tiers.remove(&key(1)), "nothing in the pool to take yet");
    assert!(tiers
        .admitted(&key(1), || slot.commit_hashed(sum))
        .is_none());
    assert!(!tiers.contains(&key(1)), "a removed block never comes back");
    assert_eq!(pool.stats().used, 0, "its room is freed");
    // Without a removal it is stored; and one held already is not admitted.
    let slot = named(2);
    assert!(matches!(
        tiers.admitted(&key(2), || slot.commit_hashed(sum)),
        Some(Ok(()))
    ));
    assert!(tiers.contains(&key(2)));
    assert!(!tiers.start_admitting(&key(2)), "held here already");
    // Refused: the mark goes, and the key may be admitted again.
    let slot = named(3);
    tiers.not_admitted(&key(3));
    drop(slot);
    assert!(tiers.start_admitting(&key(3)));
}
