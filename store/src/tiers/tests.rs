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
