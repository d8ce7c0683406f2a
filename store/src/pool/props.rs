//! Properties of the pool under any sequence of operations: blocks never
//! overlap, no byte leaks, capacity is never exceeded, and what is pinned or
//! leased is never evicted.

use super::*;
use mooncake_proto::{BlockHash, Namespace};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Put {
        key: u8,
        len: u32,
    },
    /// A writer that reserves and vanishes before committing.
    Abandon {
        key: u8,
        len: u32,
    },
    Remove {
        key: u8,
    },
    Pin {
        key: u8,
    },
    Unpin {
        key: u8,
    },
    Lease {
        key: u8,
    },
    /// A lease for a time (`hold`): for an hour, or one that has already
    /// run out.
    Hold {
        key: u8,
        long: bool,
    },
    Release {
        nth: u8,
    },
    /// A read through the shared index, told to the pool.
    Touch {
        key: u8,
    },
    /// Room held for a block not yet named (a same-host writer's).
    Room {
        len: u32,
    },
    /// A block written into a room held, and named.
    Fill {
        nth: u8,
        key: u8,
    },
    /// A room let go unfilled.
    LetGo {
        nth: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u8..48;
    let len = prop_oneof![1u32..300, 1u32..20_000, 20_000u32..70_000];
    prop_oneof![
        4 => (key.clone(), len.clone()).prop_map(|(key, len)| Op::Put { key, len }),
        1 => (key.clone(), len).prop_map(|(key, len)| Op::Abandon { key, len }),
        2 => key.clone().prop_map(|key| Op::Remove { key }),
        1 => key.clone().prop_map(|key| Op::Pin { key }),
        1 => key.clone().prop_map(|key| Op::Unpin { key }),
        2 => key.clone().prop_map(|key| Op::Lease { key }),
        2 => (key.clone(), any::<bool>()).prop_map(|(key, long)| Op::Hold { key, long }),
        1 => key.clone().prop_map(|key| Op::Touch { key }),
        2 => any::<u8>().prop_map(|nth| Op::Release { nth }),
        1 => (1u32..70_000).prop_map(|len| Op::Room { len }),
        2 => (any::<u8>(), key).prop_map(|(nth, key)| Op::Fill { nth, key }),
        1 => any::<u8>().prop_map(|nth| Op::LetGo { nth }),
    ]
}

/// Even keys belong to tenant `quota` (30% of the pool), odd ones to a
/// namespace without a quota.
fn key(i: u8) -> BlockKey {
    let ns = if i % 2 == 0 { "quota/model" } else { "free" };
    BlockKey::new(Namespace::new(ns).unwrap(), BlockHash::from_opaque(&[i]))
}

/// The pool's own accounting agrees with its blocks and the `rooms` held,
/// and its shared index shows exactly its ready blocks, where they are.
fn check(pool: &DramPool, rooms: &[Room]) {
    let inner = pool.inner.lock();
    if let Some(index) = &pool.index {
        assert_eq!(index.unindexed.load(Ordering::Relaxed), 0);
        for k in 0..=u8::MAX {
            let key = key(k);
            let want = inner.blocks.get(&key).filter(|b| b.ready).map(|b| Entry {
                offset: b.alloc.offset as u64 * UNIT,
                len: b.len as u64,
                checksum: b.checksum,
            });
            assert_eq!(
                index.table.lookup(Digest::of(&key)),
                want,
                "the index disagrees about block {k}"
            );
        }
    }
    let mut spans: Vec<(u64, u64)> = inner
        .blocks
        .values()
        .map(|b| b.alloc)
        .chain(inner.doomed.values().map(|d| d.alloc))
        .chain(rooms.iter().map(|r| r.alloc))
        .map(|a| (a.offset as u64, inner.alloc.allocation_size(a) as u64))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:?}");
    }
    let allocated: u64 = spans.iter().map(|(_, n)| n).sum();
    assert_eq!(
        allocated, inner.used_units,
        "allocated units leak or double count"
    );
    let pending: u64 = inner
        .blocks
        .values()
        .filter(|b| !b.ready)
        .map(|b| inner.alloc.allocation_size(b.alloc) as u64)
        .sum();
    let held: u64 = rooms
        .iter()
        .map(|r| inner.alloc.allocation_size(r.alloc) as u64)
        .sum();
    assert_eq!(held, inner.room_units, "rooms held");
    assert_eq!(
        pending + held,
        inner.pending_units,
        "room of puts in progress"
    );
    for (t, held) in inner.tenant_pending.iter().enumerate() {
        let want: u64 = inner
            .blocks
            .values()
            .filter(|b| !b.ready && b.tenant == Some(t as u16))
            .map(|b| inner.alloc.allocation_size(b.alloc) as u64)
            .sum();
        assert_eq!(*held, want, "tenant {t}'s room of puts in progress");
    }
    assert!(
        inner.used_units * UNIT <= pool.region.len() as u64,
        "over capacity"
    );
    for (t, stamps) in inner.lru.by_tenant.iter().enumerate() {
        let want: std::collections::BTreeSet<u64> = inner
            .lru
            .all
            .iter()
            .filter(|(_, (_, tenant, _))| *tenant == Some(t as u16))
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(stamps, &want, "tenant {t}'s LRU differs from the pool's");
    }
    for (k, tenant, queue) in inner.lru.all.values() {
        assert_eq!(
            inner.blocks[k].tenant, *tenant,
            "LRU entry of the wrong tenant"
        );
        assert_eq!(
            inner.blocks[k].queue, *queue,
            "LRU entry of the wrong queue"
        );
    }
    for (stamp, k) in inner.lru.iter() {
        let b = &inner.blocks[k];
        assert!(
            b.evictable() && b.stamp == *stamp,
            "an unevictable block in the LRU"
        );
    }
    let evictable = inner.blocks.values().filter(|b| b.evictable()).count();
    assert_eq!(
        evictable,
        inner.lru.len(),
        "an evictable block missing from the LRU"
    );
    let pinned = inner.blocks.values().filter(|b| b.pins > 0).count() as u64;
    assert_eq!(pinned, inner.pinned);
    let held = inner.blocks.values().filter(|b| b.held_until != 0).count() as u64;
    assert_eq!(held, inner.holds.held);
    let held_units: u64 = inner
        .blocks
        .values()
        .filter(|b| b.held_until != 0)
        .map(|b| inner.alloc.allocation_size(b.alloc) as u64)
        .sum();
    assert_eq!(held_units, inner.holds.held_units);
    assert!(
        held_units <= pool.region.len() as u64 / UNIT / 2,
        "leases hold more than half the pool"
    );
    let mut children: KeyMap<BlockKey, u32> = KeyMap::default();
    for (k, b) in inner.blocks.iter().filter(|(_, b)| b.ready) {
        if let Some(p) = b.parent {
            *children
                .entry(BlockKey::new(k.namespace.clone(), p))
                .or_insert(0) += 1;
        }
    }
    assert_eq!(
        children, inner.children,
        "children counts differ from the blocks"
    );
    // 2Q: each evictable block in its queue's set, and probation's room
    // is what its blocks hold.
    for (stamp, k) in inner.lru.iter() {
        let in_probation = inner.lru.probation.all.contains(stamp);
        assert_eq!(
            in_probation,
            inner.blocks[k].queue == super::Queue::Probation,
            "an evictable block in the wrong queue"
        );
        assert_ne!(in_probation, inner.lru.main.all.contains(stamp));
    }
    assert_eq!(
        inner.lru.probation.all.len() + inner.lru.main.all.len(),
        inner.lru.len()
    );
    let probation: u64 = inner
        .blocks
        .values()
        .filter(|b| b.queue == super::Queue::Probation)
        .map(|b| inner.alloc.allocation_size(b.alloc) as u64)
        .sum();
    assert_eq!(probation, inner.probation_units, "probation's room");
    assert!(
        (pool.probation_floor()..=pool.region.len() as u64 / UNIT)
            .contains(&inner.probation_target),
        "probation's limit between its share and the pool"
    );
    let tails: std::collections::BTreeSet<u64> = inner
        .lru
        .all
        .iter()
        .filter(|(_, (k, _, _))| !children.contains_key(k))
        .map(|(s, _)| *s)
        .collect();
    let held: std::collections::BTreeSet<u64> = inner
        .lru
        .probation
        .tails
        .union(&inner.lru.main.tails)
        .copied()
        .collect();
    assert_eq!(
        tails, held,
        "tails are the evictable blocks without children"
    );
    for q in [&inner.lru.probation, &inner.lru.main] {
        assert!(q.tails.is_subset(&q.all), "a queue's tails are its blocks");
    }
    let capacity_units = pool.region.len() as u64 / UNIT;
    for t in 0..pool.cfg.quotas.len() {
        let held: u64 = inner
            .blocks
            .values()
            .filter(|b| b.tenant == Some(t as u16))
            .map(|b| b.alloc)
            .chain(
                inner
                    .doomed
                    .values()
                    .filter(|d| d.tenant == Some(t as u16))
                    .map(|d| d.alloc),
            )
            .map(|a| inner.alloc.allocation_size(a) as u64)
            .sum();
        assert_eq!(held, inner.tenant_used[t], "tenant accounting");
        assert!(
            held <= pool.cfg.quotas.limit(t as u16, capacity_units),
            "tenant over its share"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_sequence_keeps_the_pool_consistent(
        ops in proptest::collection::vec(op(), 1..200),
        two_q in any::<bool>(),
    ) {
        let cfg = PoolConfig {
            quotas: Quotas::new([("quota".into(), 0.3)]),
            shared: true,
            eviction: if two_q { Eviction::TwoQ } else { Eviction::Lru },
            ..PoolConfig::with_capacity(1 << 20)
        };
        let pool = Arc::new(DramPool::new(cfg).unwrap());
        let mut leases: Vec<ReadLease> = Vec::new();
        let mut pinned: std::collections::HashSet<u8> = Default::default();
        // Keys held for an hour: never evicted while they hold the same
        // block (as pinned ones).
        let mut held: std::collections::HashSet<u8> = Default::default();
        let mut rooms: Vec<Room> = Vec::new();
        for op in ops {
            match op {
                Op::Put { key: k, len } => {
                    let value = vec![k; len as usize];
                    if let Ok(mut slot) = pool.reserve(key(k), len as u64, checksum(&value)) {
                        // Whatever the key held before (pinned or not)
                        // was replaced.
                        pinned.remove(&k);
                        held.remove(&k);
                        slot.buf_mut().copy_from_slice(&value);
                        // Chains 0, 2, 4, ... and 1, 3, 5, ... (one
                        // namespace each).
                        slot.set_parent(k.checked_sub(2).map(|p| key(p).hash));
                        slot.commit().unwrap();
                    }
                }
                Op::Abandon { key: k, len } => {
                    if pool.reserve(key(k), len as u64, 0).is_ok() {
                        pinned.remove(&k);
                        held.remove(&k);
                    }
                }
                Op::Remove { key: k } => {
                    if pool.remove(&key(k)).is_ok() {
                        pinned.remove(&k);
                        held.remove(&k);
                    }
                }
                Op::Pin { key: k } => {
                    if !pinned.contains(&k) && pool.pin(&key(k)).is_ok() {
                        pinned.insert(k);
                    }
                }
                Op::Unpin { key: k } => {
                    if pinned.remove(&k) {
                        pool.unpin(&key(k)).unwrap();
                    }
                }
                Op::Lease { key: k } => leases.extend(pool.get(&key(k))),
                Op::Hold { key: k, long } => {
                    let now = std::time::Instant::now();
                    let until = if long { now + std::time::Duration::from_secs(3600) } else { now };
                    let stored = pool.contains(&key(k));
                    match pool.hold(&key(k), until) {
                        Ok(()) => {
                            prop_assert!(stored);
                            if long {
                                held.insert(k);
                            }
                        }
                        // Leases hold their share of the pool already.
                        Err(PoolError::Busy) => prop_assert!(stored),
                        Err(e) => prop_assert!(!stored, "{e:?}"),
                    }
                }
                Op::Touch { key: k } => {
                    let ready = pool.contains(&key(k));
                    prop_assert_eq!(pool.touch(&key(k)), ready);
                }
                Op::Release { nth } => {
                    if !leases.is_empty() {
                        let i = nth as usize % leases.len();
                        leases.swap_remove(i);
                    }
                }
                Op::Room { len } => rooms.extend(pool.reserve_room(len as u64).ok()),
                Op::Fill { nth, key: k } => {
                    if !rooms.is_empty() {
                        let mut room = rooms.swap_remove(nth as usize % rooms.len());
                        let value = vec![k ^ 0x5a; room.len() as usize];
                        room.buf_mut().copy_from_slice(&value);
                        let sum = checksum(&value);
                        match pool.fill_room(room, key(k), value.len() as u64, Some(sum)) {
                            Ok(slot) => {
                                pinned.remove(&k);
                        held.remove(&k);
                                slot.commit_hashed(sum).unwrap();
                            }
                            Err((_, room)) => rooms.push(room),
                        }
                    }
                }
                Op::LetGo { nth } => {
                    if !rooms.is_empty() {
                        rooms.swap_remove(nth as usize % rooms.len());
                    }
                }
            }
            check(&pool, &rooms);
            for k in &pinned {
                prop_assert!(pool.contains(&key(*k)), "pinned block {k} was evicted");
            }
            for k in &held {
                prop_assert!(pool.contains(&key(*k)), "held block {k} was evicted");
            }
            for lease in &leases {
                // A leased block's bytes stay in place, removed or not.
                prop_assert!(lease.verify(), "leased bytes changed under a reader");
            }
        }
        drop(leases);
        rooms.clear();
        for k in 0..48 {
            let _ = pool.unpin(&key(k));
            let _ = pool.remove(&key(k));
        }
        check(&pool, &rooms);
        prop_assert_eq!(pool.stats().used, 0, "bytes leaked after everything was removed");
    }
}
