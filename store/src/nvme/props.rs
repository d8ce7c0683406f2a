//! The extent allocator under any sequence of allocations and releases:
//! no range is handed out twice, free space is coalesced, nothing leaks.

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
}
