//! The extent allocator under any sequence of allocations and releases:
//! no range is handed out twice, free space is coalesced, nothing leaks.
//! The leases under any sequence of leases, departures and time: they
//! never hold more than their share of the drive, and give back what
//! they hold when they end.

use super::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn extents_never_overlap_and_never_leak(
        ops in proptest::collection::vec((any::<bool>(), 1u64..64, any::<u16>()), 1..300)
    ) {
        const CAPACITY: u64 = 1000;
        let mut e = Extents::new(CAPACITY);
        let mut used: Vec<(u64, u64)> = Vec::new();
        for (alloc, len, pick) in ops {
            if alloc || used.is_empty() {
                if let Some(at) = e.allocate(len) {
                    prop_assert!(at + len <= CAPACITY);
                    for (u, l) in &used {
                        prop_assert!(at + len <= *u || u + l <= at, "handed out twice");
                    }
                    used.push((at, len));
                } else {
                    prop_assert!(e.free.values().all(|s| *s < len), "refused while a range fits");
                }
            } else {
                let (at, len) = used.swap_remove(pick as usize % used.len());
                e.release(at, len);
            }
            let used_bytes: u64 = used.iter().map(|(_, l)| l).sum();
            prop_assert_eq!(e.free_bytes() + used_bytes, CAPACITY, "bytes leaked");
            let free: Vec<(u64, u64)> = e.free.iter().map(|(a, l)| (*a, *l)).collect();
            for w in free.windows(2) {
                prop_assert!(w[0].0 + w[0].1 < w[1].0, "free ranges not coalesced: {:?}", w);
            }
        }
    }

    #[test]
    fn leases_hold_at_most_their_share_and_give_it_back_when_they_end(
        ops in proptest::collection::vec((0u8..3, 0u64..12, 0u64..20, 1u64..5), 1..300)
    ) {
        const CAPACITY: u64 = 16;
        let start = Instant::now();
        let at = |t: u64| start + std::time::Duration::from_millis(t);
        let (mut leases, mut t) = (leases::Leases::default(), 0);
        for (op, k, dt, bytes) in ops {
            match op {
                0 => {
                    let held = leases.take(&key(k), (at(t + dt), at(t)), bytes, CAPACITY);
                    if dt > 0 {
                        prop_assert_eq!(held, leases.holds(&key(k), at(t)));
                        prop_assert!(leases.runs(&key(k), at(t)));
                    }
                }
                1 => leases.end(&key(k)),
                _ => {
                    t += dt;
                    leases.expire(at(t));
                    for (k, l) in &leases.by_key {
                        prop_assert!(l.held == 0 || l.until > at(t), "{k} held past its end");
                    }
                }
            }
            let held: Vec<u64> = leases.by_key.values().map(|l| l.held).filter(|h| *h > 0).collect();
            prop_assert_eq!(leases.held, held.len() as u64);
            prop_assert_eq!(leases.held_bytes, held.iter().sum::<u64>());
            prop_assert!(leases.held_bytes <= CAPACITY / 2, "past the share");
        }
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey::new(
        Namespace::new("t/leases").unwrap(),
        BlockHash::from_opaque(&i.to_le_bytes()),
    )
}
