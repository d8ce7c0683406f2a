use super::*;
use std::collections::HashMap;
use std::time::Duration;

fn ns() -> Namespace {
    Namespace::new("t").unwrap()
}

fn me() -> Client {
    Client::of([10, 0, 0, 1].into())
}

fn h(i: u8) -> BlockHash {
    BlockHash([i; 32])
}

fn commit(idx: &Index, i: u8, daemon: u32) -> ErrorCode {
    idx.commit(
        &ns(),
        &CommitItem {
            hash: h(i),
            stored_on: Copies::one(daemon),
            size: 10,
            checksum: 99,
            parent: None,
            tag: None,
        },
    )
}

#[test]
fn pending_is_invisible_until_committed() {
    let idx = Index::new();
    let now = Instant::now();
    assert_eq!(
        idx.reserve(&ns(), h(1), (10, Copies::one(7), 1), me(), now),
        Reservation::Reserved
    );
    assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None]);
    assert_eq!(
        idx.reserve(&ns(), h(1), (10, Copies::one(7), 1), me(), now),
        Reservation::Exists
    );
    assert_eq!(commit(&idx, 1, 7), ErrorCode::Ok);
    let loc = idx.lookup(&ns(), &[h(1)])[0].unwrap();
    assert_eq!(
        (loc.daemons, loc.size, loc.checksum),
        (Copies::one(7), 10, 99)
    );
}

#[test]
fn commit_without_reservation_or_from_another_daemon_is_refused() {
    let idx = Index::new();
    idx.reserve(&ns(), h(2), (10, Copies::one(1), 1), me(), Instant::now());
    assert_eq!(commit(&idx, 1, 1), ErrorCode::NoReservation);
    assert_eq!(commit(&idx, 2, 9), ErrorCode::NoReservation);
    assert_eq!(
        idx.stats().pending,
        1,
        "another writer's reservation is kept"
    );
    let abort = || {
        idx.commit(
            &ns(),
            &CommitItem {
                hash: h(2),
                stored_on: Copies::default(),
                size: 10,
                checksum: 0,
                parent: None,
                tag: None,
            },
        )
    };
    assert_eq!(abort(), ErrorCode::Ok);
    assert_eq!(idx.stats().pending, 0);
    assert_eq!(abort(), ErrorCode::Ok, "nothing left to release");
}

#[test]
fn a_namespace_leaves_with_its_last_entry_and_its_id_never_mixes_on_reuse() {
    let idx = Index::new();
    let t = Instant::now();
    for i in 0..1000 {
        let ns = Namespace::new(format!("made-up/{i}")).unwrap();
        idx.reserve(&ns, h(1), (10, Copies::one(1), 1), me(), t);
    }
    idx.reserve(&ns(), h(1), (10, Copies::one(1), 1), me(), t);
    idx.commit(
        &ns(),
        &CommitItem {
            hash: h(1),
            stored_on: Copies::one(1),
            size: 10,
            checksum: 9,
            parent: None,
            tag: None,
        },
    );
    assert_eq!(idx.namespaces(), 1001);
    assert_eq!(idx.expire_pending(t + Duration::from_secs(1)).len(), 1000);
    assert_eq!(idx.sweep_namespaces(), 1000);
    assert_eq!(
        idx.namespaces(),
        1,
        "only the one with a stored block stays"
    );
    // Ids are reused by new names; what the old names held never shows.
    let gone = Namespace::new("made-up/7").unwrap();
    let other = Namespace::new("other").unwrap();
    idx.reserve(&other, h(1), (10, Copies::one(2), 1), me(), t);
    idx.commit(
        &other,
        &CommitItem {
            hash: h(1),
            stored_on: Copies::one(2),
            size: 10,
            checksum: 9,
            parent: None,
            tag: None,
        },
    );
    assert_eq!(idx.lookup(&gone, &[h(1)]), vec![None]);
    assert_eq!(
        idx.lookup(&other, &[h(1)])[0].unwrap().daemons,
        Copies::one(2)
    );
    assert_eq!(
        idx.lookup(&ns(), &[h(1)])[0].unwrap().daemons,
        Copies::one(1)
    );
    assert_eq!(idx.sweep_namespaces(), 0, "names in use are kept");
}

#[test]
fn match_prefix_stops_at_the_first_gap() {
    let idx = Index::new();
    for i in [1, 2, 4] {
        idx.reserve(&ns(), h(i), (10, Copies::one(1), 1), me(), Instant::now());
        commit(&idx, i, 1);
    }
    assert_eq!(idx.match_prefix(&ns(), &[h(1), h(2), h(3), h(4)]).len(), 2);
    assert_eq!(idx.match_prefix(&ns(), &[h(3), h(1)]).len(), 0);
    let other = Namespace::new("other").unwrap();
    assert_eq!(
        idx.match_prefix(&other, &[h(1)]).len(),
        0,
        "namespaces never mix"
    );
}

#[test]
fn expired_reservations_free_the_key() {
    let idx = Index::new();
    let t0 = Instant::now();
    idx.reserve(&ns(), h(1), (10, Copies::one(3), 1), me(), t0);
    let expired = idx.expire_pending(t0 + Duration::from_secs(1));
    assert_eq!(expired, vec![(BlockKey::new(ns(), h(1)), Copies::one(3))]);
    assert_eq!(
        idx.reserve(&ns(), h(1), (10, Copies::one(3), 1), me(), t0),
        Reservation::Reserved
    );
    assert_eq!(idx.stats().pending, 1);
}

#[test]
fn a_block_evicted_before_its_commit_commits_as_stored_but_stays_invisible() {
    let idx = Index::new();
    idx.reserve(&ns(), h(1), (10, Copies::one(4), 1), me(), Instant::now());
    // The daemon's eviction report comes before the writer's commit.
    assert!(idx.remove_at(&BlockKey::new(ns(), h(1)), 4));
    assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None]);
    assert_eq!(commit(&idx, 1, 4), ErrorCode::Ok);
    assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None]);
    assert_eq!(idx.stats(), PrefixStats::default(), "nothing left");
    // A new put of the key is a put like any other.
    assert_eq!(
        idx.reserve(&ns(), h(1), (10, Copies::one(4), 1), me(), Instant::now()),
        Reservation::Reserved
    );
    assert_eq!(commit(&idx, 1, 4), ErrorCode::Ok);
    assert!(idx.lookup(&ns(), &[h(1)])[0].is_some());
}

#[test]
fn dead_daemon_and_evictions_remove_only_their_blocks() {
    let idx = Index::new();
    for (i, d) in [(1, 1), (2, 1), (3, 2)] {
        idx.reserve(&ns(), h(i), (10, Copies::one(d), 1), me(), Instant::now());
        commit(&idx, i, d);
    }
    assert!(
        !idx.remove_at(&BlockKey::new(ns(), h(3)), 1),
        "wrong daemon"
    );
    assert!(idx.remove_at(&BlockKey::new(ns(), h(3)), 2));
    assert_eq!(
        idx.remove_daemon(1),
        Gone {
            copies: 2,
            blocks: 2,
            short: vec![]
        }
    );
    assert_eq!(idx.stats(), PrefixStats::default());
}

fn copies(ids: &[u32]) -> Copies {
    ids.iter().copied().collect()
}

fn commit_on(idx: &Index, i: u8, stored_on: Copies) -> ErrorCode {
    let item = CommitItem {
        hash: h(i),
        stored_on,
        size: 10,
        checksum: 99,
        parent: None,
        tag: None,
    };
    idx.commit(&ns(), &item)
}

#[test]
fn a_block_with_copies_outlives_all_but_its_last() {
    let idx = Index::new();
    idx.reserve(
        &ns(),
        h(1),
        (10, copies(&[1, 2, 3]), 3),
        me(),
        Instant::now(),
    );
    // Daemon 3's write failed: visible on the two that stored it.
    assert_eq!(commit_on(&idx, 1, copies(&[1, 2])), ErrorCode::Ok);
    let loc = idx.lookup(&ns(), &[h(1)])[0].unwrap();
    assert_eq!(loc.daemons, copies(&[1, 2]));
    assert_eq!(idx.stats().visible, 1, "one block, whatever its copies");
    let gone = idx.remove_daemon(1);
    assert_eq!((gone.copies, gone.blocks), (1, 0));
    let key = BlockKey::new(ns(), h(1));
    assert_eq!(gone.short, vec![key.clone()], "short of the three it wants");
    let (loc, want) = idx.short_of_copies(&key, &none_leaving).unwrap();
    assert_eq!((loc.daemons, want), (copies(&[2]), 3));
    // A copy made again joins; one of other bytes does not.
    assert!(!idx.add_copy(&key, (5, 10, 1234), &none_leaving));
    assert!(idx.add_copy(&key, (5, 10, 99), &none_leaving));
    assert!(idx.add_copy(&key, (6, 10, 99), &none_leaving));
    assert_eq!(
        idx.short_of_copies(&key, &none_leaving),
        None,
        "three copies again"
    );
    assert_eq!(idx.stats().copies, 3);
    assert!(idx.remove_at(&key, 5) && idx.remove_at(&key, 6));
    assert_eq!(idx.lookup(&ns(), &[h(1)])[0].unwrap().daemons, copies(&[2]));
    assert_eq!(
        idx.list(
            None,
            None,
            ListFilter {
                daemon: Some(2),
                ..Default::default()
            },
            10
        )
        .0
        .len(),
        1
    );
    assert!(idx.remove_at(&BlockKey::new(ns(), h(1)), 2));
    assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None], "the last copy went");
    assert_eq!(idx.stats(), PrefixStats::default());
}

#[test]
fn a_commit_names_only_daemons_the_block_was_placed_on() {
    let idx = Index::new();
    idx.reserve(&ns(), h(1), (10, copies(&[1, 2]), 2), me(), Instant::now());
    assert_eq!(
        commit_on(&idx, 1, copies(&[7])),
        ErrorCode::NoReservation,
        "none of its daemons: another writer's"
    );
    // One copy evicted before the commit: the other alone becomes visible.
    assert!(idx.remove_at(&BlockKey::new(ns(), h(1)), 2));
    assert_eq!(commit_on(&idx, 1, copies(&[1, 2, 7])), ErrorCode::Ok);
    assert_eq!(idx.lookup(&ns(), &[h(1)])[0].unwrap().daemons, copies(&[1]));
    assert_eq!(idx.remove(&ns(), &[h(1)]), vec![Some(copies(&[1]))]);
}

#[test]
fn inventory_rebuilds_visible_entries_and_the_latest_report_wins() {
    let idx = Index::new();
    let key = BlockKey::new(ns(), h(5));
    idx.insert_visible(&key, (2, Tier::Dram), (100, 7), None);
    idx.insert_visible(&key, (3, Tier::Nvme), (100, 7), None);
    let loc = idx.lookup(&ns(), &[h(5)])[0].unwrap();
    assert_eq!(
        loc.daemons.with_tiers().collect::<Vec<_>>(),
        [(2, Tier::Dram), (3, Tier::Nvme)],
        "the same bytes: two copies, each in the tier its daemon reported"
    );
    idx.insert_visible(&key, (4, Tier::Dram), (100, 8), None);
    let loc = idx.lookup(&ns(), &[h(5)])[0].unwrap();
    assert_eq!(
        loc.daemons,
        copies(&[4]),
        "other bytes: the latest report wins"
    );
    // A dead daemon's removal no longer takes the block with it.
    assert_eq!(idx.remove_daemon(2), Gone::default());
    assert_eq!(idx.match_prefix(&ns(), &[h(5)]).len(), 1);
}

#[test]
fn list_pages_in_key_order() {
    let idx = Index::new();
    for i in 0..10 {
        idx.reserve(&ns(), h(i), (10, Copies::one(1), 1), me(), Instant::now());
        commit(&idx, i, 1);
    }
    let (page, more) = idx.list(None, None, ListFilter::default(), 4);
    assert!(more);
    assert_eq!(page.len(), 4);
    let (rest, more) = idx.list(Some(&ns()), Some(&page[3].key), ListFilter::default(), 100);
    assert!(!more);
    assert_eq!(rest.len(), 6);
    assert!(rest[0].key > page[3].key);
    let three = ListFilter {
        prefix: &[3, 3],
        daemon: Some(1),
    };
    let (only, _) = idx.list(None, None, three, 100);
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].key.hash, h(3));
    let elsewhere = ListFilter {
        daemon: Some(2),
        ..ListFilter::default()
    };
    assert!(idx.list(None, None, elsewhere, 100).0.is_empty());
}

#[test]
fn a_copy_moved_between_tiers_is_one_removal_and_one_store_in_its_new_medium() {
    use crate::events::{Feed, Kind};
    let (events, mut feed) = Feed::for_tests(64);
    let idx = Index::with_events(events);
    let key = BlockKey::new(ns(), h(3));
    idx.reserve(&ns(), h(3), (100, copies(&[1, 2]), 2), me(), Instant::now());
    assert_eq!(commit_on(&idx, 3, copies(&[1, 2])), ErrorCode::Ok);
    assert_eq!(
        feed.drain(),
        [(Kind::Stored, 1, Tier::Dram), (Kind::Stored, 2, Tier::Dram)]
    );
    assert!(idx.set_tier(&key, 1, Tier::Nvme), "demoted");
    assert!(!idx.set_tier(&key, 1, Tier::Nvme), "already there");
    assert!(!idx.set_tier(&key, 9, Tier::Nvme), "holds no copy");
    assert_eq!(
        feed.drain(),
        [
            (Kind::Removed, 1, Tier::Dram),
            (Kind::Stored, 1, Tier::Nvme)
        ]
    );
    let loc = idx.lookup(&ns(), &[h(3)])[0].unwrap();
    assert_eq!(loc.daemons.tier_of(1), Some(Tier::Nvme));
    assert_eq!(loc.daemons.tier_of(2), Some(Tier::Dram));
    // Its removal names the medium it is in.
    assert!(idx.remove_at(&key, 1));
    assert_eq!(feed.drain(), [(Kind::Removed, 1, Tier::Nvme)]);
    assert!(idx.set_tier(&key, 2, Tier::Nvme));
    feed.drain();
    assert_eq!(idx.remove_daemon(2).blocks, 1);
    assert_eq!(feed.drain(), [(Kind::Removed, 2, Tier::Nvme)]);
}

#[test]
fn a_blocks_parent_is_kept_with_it_while_events_are_on_and_goes_with_it() {
    use crate::events::Feed;
    let item = |i: u8, parent: Option<u8>, daemon: u32| CommitItem {
        hash: h(i),
        stored_on: Copies::one(daemon),
        size: 10,
        checksum: 99,
        parent: parent.map(h),
        tag: None,
    };
    let put = |idx: &Index, (i, parent, d): (u8, Option<u8>, u32)| {
        idx.reserve(&ns(), h(i), (10, Copies::one(d), 1), me(), Instant::now());
        assert_eq!(idx.commit(&ns(), &item(i, parent, d)), ErrorCode::Ok);
    };
    let (events, _feed) = Feed::for_tests(1024);
    let idx = Index::with_events(events);
    for block in [
        (1, None, 1),
        (2, Some(1), 1),
        (3, Some(2), 2),
        (4, Some(3), 2),
    ] {
        put(&idx, block);
    }
    let held = |idx: &Index| -> HashMap<BlockHash, Option<BlockHash>> {
        (0..SHARDS)
            .flat_map(|s| idx.visible_in_shard(s).unwrap())
            .map(|(_, _, hash, named)| (hash, named.parent))
            .collect()
    };
    assert_eq!(held(&idx)[&h(1)], None);
    assert_eq!(held(&idx)[&h(3)], Some(h(2)), "a resync republishes it");
    assert_eq!(idx.parents_kept(), 3);
    assert!(idx.set_tier(&BlockKey::new(ns(), h(4)), 2, Tier::Nvme));
    assert_eq!(held(&idx)[&h(4)], Some(h(3)), "a move keeps it");
    // A removal and a daemon's leaving take it with the block.
    idx.remove(&ns(), &[h(2)]);
    assert_eq!(idx.parents_kept(), 2);
    assert_eq!(idx.remove_daemon(2).blocks, 2);
    assert_eq!(idx.parents_kept(), 0);
    // An inventory brings it back; another daemon's report of the same
    // bytes without one keeps it.
    let key = BlockKey::new(ns(), h(5));
    idx.insert_visible(&key, (3, Tier::Dram), (10, 99), Some(h(4)));
    idx.insert_visible(&key, (4, Tier::Dram), (10, 99), None);
    assert_eq!(held(&idx)[&h(5)], Some(h(4)));
    assert!(idx.remove_at(&key, 3));
    assert!(idx.remove_at(&key, 4));
    assert_eq!(idx.parents_kept(), 0, "gone with its last copy");
    // Without events nothing is kept.
    let plain = Index::new();
    put(&plain, (2, Some(1), 1));
    assert_eq!(plain.parents_kept(), 0);
}

#[test]
fn an_engines_tag_names_its_block_and_its_childs_parent_until_the_block_goes() {
    use crate::events::{Feed, Kind};
    use mooncake_proto::message::{EngineHash, EngineTag};
    use std::sync::Arc;
    let tag = |n: u64| {
        Some(Arc::new(
            EngineTag::new(Some(EngineHash::Int(n)), vec![n as u32; 4]).unwrap(),
        ))
    };
    let item = |i: u8, parent: Option<u8>, tag| CommitItem {
        hash: h(i),
        stored_on: Copies::one(1),
        size: 10,
        checksum: 99,
        parent: parent.map(h),
        tag,
    };
    let (events, mut feed) = Feed::for_tests(1024);
    let idx = Index::with_events(events);
    for (i, parent, t) in [
        (1, None, tag(100)),
        (2, Some(1), tag(200)),
        (3, Some(2), None),
    ] {
        idx.reserve(&ns(), h(i), (10, Copies::one(1), 1), me(), Instant::now());
        assert_eq!(idx.commit(&ns(), &item(i, parent, t)), ErrorCode::Ok);
    }
    let stored = feed.drain_named();
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[0].2.tag, tag(100));
    assert_eq!(stored[0].2.parent_hash, None);
    assert_eq!(
        stored[1].2.parent_hash,
        Some(EngineHash::Int(100)),
        "its parent as events named it"
    );
    assert_eq!(stored[2].2.tag, None);
    assert_eq!(
        stored[2].2.parent_hash,
        Some(EngineHash::Int(200)),
        "an untagged child of a tagged block"
    );
    // A resync republishes the tags; a move keeps them.
    let held: HashMap<BlockHash, crate::events::Named> = (0..SHARDS)
        .flat_map(|s| idx.visible_in_shard(s).unwrap())
        .map(|(_, _, hash, named)| (hash, named))
        .collect();
    assert_eq!(held[&h(2)].tag, tag(200));
    assert!(idx.set_tier(&BlockKey::new(ns(), h(2)), 1, Tier::Nvme));
    let moved = feed.drain_named();
    assert_eq!(moved.len(), 2);
    assert!(moved
        .iter()
        .all(|(_, hash, named)| *hash == h(2) && named.tag == tag(200)));
    // Removed, each block is named by its tag, and the tag goes with it.
    idx.remove(&ns(), &[h(1)]);
    assert!(idx.remove_at(&BlockKey::new(ns(), h(2)), 1));
    let removed = feed.drain_named();
    assert_eq!(
        removed.iter().map(|(k, ..)| *k).collect::<Vec<_>>(),
        [Kind::Removed; 2]
    );
    assert_eq!(removed[0].2.tag, tag(100));
    assert_eq!(removed[1].2.tag, tag(200));
    assert_eq!(
        idx.parents_kept(),
        1,
        "only the untagged child's parent is left"
    );
    // Without events no tag is kept.
    let plain = Index::new();
    plain.reserve(&ns(), h(1), (10, Copies::one(1), 1), me(), Instant::now());
    assert_eq!(plain.commit(&ns(), &item(1, None, tag(1))), ErrorCode::Ok);
    assert_eq!(plain.parents_kept(), 0);
}

#[test]
fn a_rebuilt_index_gets_its_namespaces_wanted_copies_back() {
    let idx = Index::new();
    // As inventories rebuild it: one block on two daemons, one on one.
    for (i, daemons) in [(1u8, &[1u32, 2][..]), (2, &[3][..])] {
        for d in daemons {
            idx.insert_visible(&BlockKey::new(ns(), h(i)), (*d, Tier::Dram), (10, 5), None);
        }
    }
    let other = Namespace::new("other").unwrap();
    idx.insert_visible(
        &BlockKey::new(other.clone(), h(3)),
        (4, Tier::Dram),
        (10, 5),
        None,
    );
    // A put still being written is left alone.
    idx.reserve(&ns(), h(4), (10, copies(&[5]), 1), me(), Instant::now());
    let mut short = idx.restore_wants(&|n| if *n == ns() { 2 } else { 1 });
    short.sort();
    assert_eq!(short, [BlockKey::new(ns(), h(2))], "one copy of two");
    let (loc, want) = idx
        .short_of_copies(&BlockKey::new(ns(), h(2)), &none_leaving)
        .unwrap();
    assert_eq!((loc.daemons, want), (copies(&[3]), 2));
    assert_eq!(
        idx.short_of_copies(&BlockKey::new(ns(), h(1)), &none_leaving),
        None
    );
    assert_eq!(
        idx.short_of_copies(&BlockKey::new(other, h(3)), &none_leaving),
        None
    );
    assert!(idx.lookup(&ns(), &[h(4)])[0].is_none(), "still pending");
}
