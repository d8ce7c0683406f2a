//! Branch points across the cluster: the meta service's half of 2Q's
//! branch rule (`store/src/pool/evict.rs`).
//!
//! A daemon's 2Q pool takes a new block straight into its main queue when
//! the block branches off a prefix a reader matched and at least half of
//! that prefix's earlier branches were read again (the first branch always
//! is), or continues such a branch: a conversation's next turn is kept,
//! while the one-off tails that many requests put after a shared system
//! prompt wait in probation. The daemon judges that from the block's
//! parent, which in a cluster is mostly on another daemon (blocks go to
//! whichever daemon is least loaded): there it knew nothing, and a
//! conversation's next turn waited in probation until evicted. On the
//! conversation trace a cluster of four kept 3 to 4.5 points less than one
//! daemon of the same memory.
//!
//! The meta service sees every prefix match and every put, so it keeps the
//! same counts for the whole cluster: a prefix a reader matched is a
//! branch point; a block put after it is a branch, counted there, and its
//! first match afterwards counts as the branch coming back. A block
//! stored again soon after a daemon evicted it (the meta service
//! remembers recent evictions, `crate::misses`) is no new branch, as the
//! daemon does not count one that its ghost list remembers: counted, the
//! turns of conversations evicted and stored again made their branch
//! points look like ones whose branches do not come back, and a cluster
//! of four kept up to 1.7 points less than LRU on conversations. It judges each
//! block of a put as the daemon would and says so in the block's slot
//! (`Slot::Place`'s `continues`); a daemon that does not hold the parent
//! follows that judgement.
//!
//! The serving engines' Mooncake backends (`mooncake.store`) find a
//! request's stored prefix by asking which of its keys exist (`Lookup`),
//! not by a prefix match, so a lookup's leading found keys count as a
//! prefix a reader matched too (the client names the parents of their
//! puts, `client/src/lineage.rs`).
//!
//! Bounded: the last `cap` branch points and the last `cap` blocks put
//! after one (or continuing one), each forgotten after `cap` newer ones.

use std::hash::BuildHasher;

use mooncake_proto::{BlockHash, Namespace};
use parking_lot::Mutex;

use crate::recent::Recent;

/// Branch points remembered, and blocks put after them.
pub const DEFAULT_CAP: usize = 65_536;

pub struct Branches {
    /// Seeds the blocks' fingerprints (keys come from clients).
    seed: foldhash::quality::RandomState,
    inner: Mutex<Inner>,
}

/// A block as the counts know it: a seeded 64-bit hash of its namespace
/// and hash. Every prefix match looks each of its blocks up here, so no
/// key is built or hashed whole per block; two blocks that share a
/// fingerprint (about one chance in 2^64 a pair) would only share counts.
type Fingerprint = u64;

struct Inner {
    /// The last blocks of prefixes readers matched.
    points: Recent<Fingerprint, Point>,
    /// Blocks put recently after a branch point, or continuing a branch
    /// that comes back.
    fresh: Recent<Fingerprint, Fresh>,
}

#[derive(Default)]
struct Point {
    /// Branches put after it since it became one.
    branches: u32,
    /// Those matched again since.
    hits: u32,
}

struct Fresh {
    /// The branch point it was put after, until a reader first matches
    /// it (that branch came back).
    branch_of: Option<Fingerprint>,
    /// Judged to continue a branch that comes back: a later put may go on
    /// from it.
    continues: bool,
}

/// One block of a put, as `Branches::judge` takes it.
#[derive(Debug, Clone, Copy)]
pub struct Put {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    /// Placed (reserved): only a block that will be stored counts as a
    /// branch.
    pub placed: bool,
    /// Stored again soon after a daemon evicted it (`Misses::returning`).
    pub returning: bool,
}

impl Branches {
    pub fn new(cap: usize) -> Self {
        Branches {
            seed: foldhash::quality::RandomState::default(),
            inner: Mutex::new(Inner {
                points: Recent::new(cap),
                fresh: Recent::new(cap),
            }),
        }
    }

    /// The fingerprints of a namespace's blocks.
    fn fingerprints(&self, ns: &Namespace) -> impl Fn(&BlockHash) -> Fingerprint + '_ {
        let ns = self.seed.hash_one(ns.as_str());
        move |hash| self.seed.hash_one((ns, &hash.0))
    }

    /// A reader matched the first `matched` blocks of the chain `hashes`:
    /// the branches among them are matched for the first time, and the
    /// last one is a branch point.
    pub fn matched(&self, ns: &Namespace, hashes: &[BlockHash], matched: usize) {
        let fp = self.fingerprints(ns);
        // Hashed before the lock: every prefix match comes here.
        let prefix: Vec<Fingerprint> = hashes.iter().take(matched).map(&fp).collect();
        let Some(last) = prefix.last() else {
            return;
        };
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        if !inner.fresh.is_empty() {
            for me in &prefix {
                let Some(point) = inner.fresh.get_mut(me).and_then(|f| f.branch_of.take()) else {
                    continue;
                };
                if let Some(p) = inner.points.get_mut(&point) {
                    p.hits = p.hits.saturating_add(1);
                }
            }
        }
        if inner.points.get(last).is_none() {
            inner.points.insert(*last, Point::default());
        }
    }

    /// Whether each block of a put continues a branch that comes back:
    /// one put after a branch point while at least half of that point's
    /// branches came back; one whose parent is the block before it in the
    /// put, as that block; one whose parent was judged to continue in an
    /// earlier put, too. Only a placed block that is not `returning`
    /// counts as a new branch.
    pub fn judge(&self, ns: &Namespace, blocks: &[Put]) -> Vec<bool> {
        let fp = self.fingerprints(ns);
        let fps: Vec<Fingerprint> = blocks.iter().map(|b| fp(&b.hash)).collect();
        let parents: Vec<Option<Fingerprint>> =
            blocks.iter().map(|b| b.parent.as_ref().map(&fp)).collect();
        let mut out: Vec<bool> = Vec::with_capacity(blocks.len());
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        for (i, (block, parent)) in blocks.iter().zip(&parents).enumerate() {
            let Some(parent) = *parent else {
                out.push(false);
                continue;
            };
            if let Some(before) = i.checked_sub(1).filter(|&j| fps[j] == parent) {
                out.push(out[before]);
                continue;
            }
            let verdict = match inner.points.get_mut(&parent) {
                Some(point) => {
                    let back = 2 * u64::from(point.hits) >= u64::from(point.branches);
                    // A block stored again after its eviction is not a
                    // new branch: as a daemon's ghost hit is not either.
                    if block.placed && !block.returning {
                        point.branches = point.branches.saturating_add(1);
                        let fresh = Fresh {
                            branch_of: Some(parent),
                            continues: back,
                        };
                        inner.fresh.insert(fps[i], fresh);
                    }
                    back
                }
                None => inner.fresh.get(&parent).is_some_and(|f| f.continues),
            };
            out.push(verdict);
        }
        // The last block of each run that continues: a later put may go on
        // from it.
        for (i, block) in blocks.iter().enumerate() {
            let run_ends = parents.get(i + 1).is_none_or(|p| *p != Some(fps[i]));
            if out[i] && block.placed && run_ends && inner.fresh.get(&fps[i]).is_none() {
                let fresh = Fresh {
                    branch_of: None,
                    continues: true,
                };
                inner.fresh.insert(fps[i], fresh);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("t").unwrap()
    }

    fn h(i: u64) -> BlockHash {
        BlockHash::from_opaque(&i.to_le_bytes())
    }

    /// A chain of `blocks` put after `parent`, each block placed.
    fn chain(parent: Option<u64>, blocks: &[u64]) -> Vec<Put> {
        let mut parent = parent.map(h);
        blocks
            .iter()
            .map(|&b| {
                let put = Put {
                    hash: h(b),
                    parent,
                    placed: true,
                    returning: false,
                };
                parent = Some(h(b));
                put
            })
            .collect()
    }

    #[test]
    fn a_branch_off_a_matched_prefix_continues_while_half_of_its_branches_come_back() {
        let b = Branches::new(100);
        assert_eq!(b.judge(&ns(), &chain(None, &[1, 2])), [false, false]);
        assert_eq!(
            b.judge(&ns(), &chain(Some(2), &[3])),
            [false],
            "block 2 was never matched: no branch point"
        );
        b.matched(&ns(), &[h(1), h(2), h(9)], 2);
        // The first branch always continues, and the rest of its run.
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[10, 11])), [true, true]);
        // One branch of one came back: so does the next.
        b.matched(&ns(), &[h(1), h(2), h(10)], 3);
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[20])), [true]);
        // Two branches of three never came back: no more.
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[30])), [true]);
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[40])), [false]);
        // A branch matched twice comes back once.
        b.matched(&ns(), &[h(1), h(2), h(10)], 3);
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[50])), [false]);
        b.matched(&ns(), &[h(1), h(2), h(20)], 3);
        b.matched(&ns(), &[h(1), h(2), h(30)], 3);
        assert_eq!(
            b.judge(&ns(), &chain(Some(2), &[60])),
            [true],
            "3 of 5 branches came back"
        );
    }

    #[test]
    fn a_branch_stored_again_after_its_eviction_is_no_new_branch() {
        let b = Branches::new(100);
        b.matched(&ns(), &[h(1), h(2)], 2);
        // Branch 10 is put, comes back, then is evicted and stored again
        // twice: still one branch of one that came back.
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[10])), [true]);
        b.matched(&ns(), &[h(1), h(2), h(10)], 3);
        for _ in 0..2 {
            let mut again = chain(Some(2), &[10]);
            again[0].returning = true;
            assert_eq!(b.judge(&ns(), &again), [true]);
        }
        assert_eq!(b.judge(&ns(), &chain(Some(2), &[20])), [true]);
        // Counted as new branches, they would have made 20 one of four
        // whose one came back: not continued.
        let counted = Branches::new(100);
        counted.matched(&ns(), &[h(1), h(2)], 2);
        counted.judge(&ns(), &chain(Some(2), &[10]));
        counted.matched(&ns(), &[h(1), h(2), h(10)], 3);
        for _ in 0..2 {
            counted.judge(&ns(), &chain(Some(2), &[10]));
        }
        assert_eq!(counted.judge(&ns(), &chain(Some(2), &[20])), [false]);
    }

    #[test]
    fn a_later_put_goes_on_from_a_run_that_continues() {
        let b = Branches::new(100);
        b.matched(&ns(), &[h(1)], 1);
        assert_eq!(b.judge(&ns(), &chain(Some(1), &[2, 3])), [true, true]);
        assert_eq!(b.judge(&ns(), &chain(Some(3), &[4])), [true]);
        assert_eq!(b.judge(&ns(), &chain(Some(4), &[5])), [true]);
        // Another namespace's block of the same hash is another block.
        let other = Namespace::new("u").unwrap();
        assert_eq!(b.judge(&other, &chain(Some(4), &[5])), [false]);
    }

    #[test]
    fn a_block_not_placed_is_judged_but_not_counted() {
        let b = Branches::new(100);
        b.matched(&ns(), &[h(1)], 1);
        let mut taken = chain(Some(1), &[2]);
        taken[0].placed = false;
        for _ in 0..3 {
            assert_eq!(b.judge(&ns(), &taken), [true], "stored already: no branch");
        }
        // Counted, the first branch of none back would have been the last.
        assert_eq!(b.judge(&ns(), &chain(Some(1), &[3])), [true]);
        assert_eq!(b.judge(&ns(), &chain(Some(1), &[4])), [false]);
    }

    #[test]
    fn branch_points_are_bounded() {
        let b = Branches::new(4);
        for i in 0..10 {
            b.matched(&ns(), &[h(i)], 1);
        }
        assert_eq!(
            b.judge(&ns(), &chain(Some(0), &[100])),
            [false],
            "forgotten"
        );
        assert_eq!(b.judge(&ns(), &chain(Some(9), &[101])), [true]);
        let inner = b.inner.lock();
        assert!(inner.points.len() <= 4 && inner.fresh.len() <= 4);
    }
}
