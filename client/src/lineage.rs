//! The chains that writers leave unnamed. The serving engines' Mooncake
//! backends (`mooncake.store`: vLLM's connector, SGLang HiCache) put blocks
//! by opaque keys with no parent, after asking which of a request's keys
//! exist. Without a parent, a daemon can neither evict a chain from its
//! tail nor apply 2Q's branch rule, and every block such a writer put
//! waited in probation: on the conversation trace 2Q then kept 2.7 to 4.3
//! points less than LRU (`docs/benchmarks.md`, "Blocks the engines put").
//!
//! So a lookup's keys not found are remembered with the key before each in
//! that lookup (the engines ask in chain order), and a put that names no
//! parent for such a key names that one. Block keys chain every block
//! before them, so a key's parent never changes: a remembered one is never
//! wrong for keys that are block hashes, only missing once forgotten.
//! Bounded like the location cache: emptied when full.
//!
//! LMCache's `mooncakestore` connector asks one key at a time, up to the
//! first missing one, so its lookups imply no parent; it then puts the
//! rest of the request's chunks in one call, in order. A put that says its
//! blocks are in order (`PutOptions::in_order`, which `mooncake.store`'s
//! puts say) gives each block that names no parent, and that no lookup
//! placed, the block before it in the call; the call's first such block
//! stays without one.

use std::collections::HashMap;

use mooncake_proto::message::Location;
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use parking_lot::Mutex;

/// Keys remembered at most (about 6 MiB at most).
const CAPACITY: usize = 65_536;

#[derive(Default)]
pub struct Lineage {
    parents: Mutex<HashMap<BlockKey, BlockHash, rustc_hash::FxBuildHasher>>,
}

impl Lineage {
    /// A lookup of `hashes` found `items`: each key not found, after the
    /// first, is awaited after the key before it.
    pub fn looked_up(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        items: &[Option<Location>],
    ) {
        let mut parents = self.parents.lock();
        for (pair, item) in hashes.windows(2).zip(items.iter().skip(1)) {
            if item.is_some() {
                continue;
            }
            if parents.len() >= CAPACITY {
                parents.clear();
            }
            parents.insert(BlockKey::new(namespace.clone(), pair[1]), pair[0]);
        }
    }

    /// `named`, with the parent a lookup implied for each block that
    /// names none, or with `in_order` (the blocks are consecutive blocks
    /// of one chain), the block before it in the call where no lookup
    /// implied one; `None` when nothing was filled.
    pub fn fill(
        &self,
        namespace: &Namespace,
        hashes: impl Iterator<Item = BlockHash>,
        named: &[Option<BlockHash>],
        in_order: bool,
    ) -> Option<Vec<Option<BlockHash>>> {
        if named.iter().all(Option::is_some) {
            return None;
        }
        let parents = self.parents.lock();
        if parents.is_empty() && !in_order {
            return None;
        }
        let mut out = named.to_vec();
        let mut filled = false;
        let mut before = None;
        for (hash, parent) in hashes.zip(out.iter_mut()) {
            if parent.is_none() {
                *parent = parents
                    .get(&BlockKey::new(namespace.clone(), hash))
                    .copied()
                    .or(before.filter(|_| in_order));
                filled |= parent.is_some();
            }
            before = Some(hash);
        }
        filled.then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    #[test]
    fn a_put_that_names_no_parent_takes_the_one_a_lookup_implied() {
        let ns = Namespace::new("t").unwrap();
        let lineage = Lineage::default();
        let found = Some(Location::on(1, 2, 3));
        // As vLLM's connector saves a request: which of its keys exist,
        // then the missing ones put.
        lineage.looked_up(&ns, &[h(1), h(2), h(3), h(4)], &[found, found, None, None]);
        let filled = lineage.fill(&ns, [h(3), h(4)].into_iter(), &[None, None], false);
        assert_eq!(filled, Some(vec![Some(h(2)), Some(h(3))]));
        // A parent named wins; a key never looked up, or only first in a
        // lookup, or in another namespace, gets none.
        lineage.looked_up(&ns, &[h(7)], &[None]);
        let other = Namespace::new("u").unwrap();
        assert_eq!(
            lineage.fill(&ns, [h(3)].into_iter(), &[Some(h(9))], false),
            None
        );
        assert_eq!(
            lineage.fill(&ns, [h(5), h(7)].into_iter(), &[None, None], false),
            None
        );
        assert_eq!(
            lineage.fill(&other, [h(3)].into_iter(), &[None], false),
            None
        );
        assert_eq!(
            lineage.fill(&ns, [h(5), h(4)].into_iter(), &[None, None], false),
            Some(vec![None, Some(h(3))])
        );
    }

    #[test]
    fn blocks_put_in_order_extend_the_one_before_them_where_no_lookup_said() {
        let ns = Namespace::new("t").unwrap();
        let lineage = Lineage::default();
        // As LMCache saves a request: its chunks past the stored prefix,
        // in one call, none looked up in a lookup of several keys.
        assert_eq!(
            lineage.fill(&ns, [h(3), h(4), h(5)].into_iter(), &[None; 3], true),
            Some(vec![None, Some(h(3)), Some(h(4))])
        );
        // Not in order: nothing to go on.
        assert_eq!(
            lineage.fill(&ns, [h(3), h(4), h(5)].into_iter(), &[None; 3], false),
            None
        );
        // What a lookup implied wins over the order, and a parent named
        // over both.
        let found = Some(Location::on(1, 2, 3));
        lineage.looked_up(&ns, &[h(8), h(5)], &[found, None]);
        assert_eq!(
            lineage.fill(
                &ns,
                [h(3), h(4), h(5)].into_iter(),
                &[None, Some(h(9)), None],
                true
            ),
            Some(vec![None, Some(h(9)), Some(h(8))])
        );
    }

    #[test]
    fn stays_within_its_capacity() {
        let ns = Namespace::new("t").unwrap();
        let lineage = Lineage::default();
        let hashes: Vec<BlockHash> = (0..CAPACITY as u32 + 10)
            .map(|i| BlockHash::from_opaque(&i.to_le_bytes()))
            .collect();
        let missing = vec![None; hashes.len()];
        lineage.looked_up(&ns, &hashes, &missing);
        assert!(lineage.parents.lock().len() <= CAPACITY);
    }
}
