//! A block's copies after its put: made again (repair), wanted more or
//! fewer (hot blocks), and the tier each daemon holds its copy in.

use mooncake_proto::message::{Location, Tier};
use mooncake_proto::BlockKey;

use super::{Copies, Entry, Index, Named};

/// Which daemons are leaving (draining): their copies still serve, but do
/// not count toward the copies a block wants.
pub type Leaving<'a> = &'a dyn Fn(u32) -> bool;

/// No daemon leaving.
#[cfg(test)]
pub fn none_leaving(_: u32) -> bool {
    false
}

impl Entry {
    /// Its copies on daemons that are not leaving.
    fn staying(&self, leaving: Leaving<'_>) -> usize {
        self.copies.iter().filter(|d| !leaving(*d)).count()
    }

    /// Visible, and fewer of its copies stay than its writer asked for,
    /// with room for another.
    fn wants_copy(&self, leaving: Leaving<'_>) -> bool {
        !self.is_pending()
            && !self.copies.is_empty()
            && !self.copies.is_full()
            && self.staying(leaving) < usize::from(self.want())
    }
}

impl Index {
    /// A visible block with fewer copies than wanted, not counting those
    /// on `leaving` daemons: where it is, and how many copies it wants;
    /// `None` for any other.
    pub fn short_of_copies(
        &self,
        block: &BlockKey,
        leaving: Leaving<'_>,
    ) -> Option<(Location, u8)> {
        let names = self.names();
        let key = names.key_of(block)?;
        let shard = self.shard(&key).read();
        let e = shard.get(&key).filter(|e| e.wants_copy(leaving))?;
        Some((e.visible()?, e.want()))
    }

    /// After a new leader rebuilt the index from the daemons' inventories
    /// (which say where copies are, not how many their writers asked
    /// for): raises each visible block's wanted copies to what its
    /// namespace wants by default (`want_of`), and returns the blocks left
    /// short of them, for the repairs. A count asked for per put, above
    /// the namespace's, is not known again.
    pub fn restore_wants(
        &self,
        want_of: &dyn Fn(&mooncake_proto::Namespace) -> u8,
    ) -> Vec<BlockKey> {
        let mut short = Vec::new();
        for s in &self.shards {
            let names = self.names();
            let mut shard = s.write(self);
            let mut raised = Vec::new();
            for (k, e) in shard.iter() {
                let want = want_of(names.name(k.ns));
                if !e.is_pending() && e.want() < want {
                    raised.push((*k, want));
                }
            }
            for (k, want) in raised {
                let Some(mut e) = shard.get(&k).copied() else {
                    continue;
                };
                e.set_want(want);
                if e.is_short() {
                    short.push(BlockKey::new(names.name(k.ns).clone(), k.hash));
                }
                shard.insert(k, e);
            }
        }
        short
    }

    /// The visible blocks with a copy on `daemon` (a daemon being drained,
    /// whose blocks are copied elsewhere).
    pub fn keys_on(&self, daemon: u32) -> Vec<BlockKey> {
        let mut out = Vec::new();
        for s in &self.shards {
            let names = self.names();
            let shard = s.read();
            out.extend(
                shard
                    .iter()
                    .filter(|(_, e)| !e.is_pending() && e.copies.contains(daemon))
                    .map(|(k, _)| BlockKey::new(names.name(k.ns).clone(), k.hash)),
            );
        }
        out
    }

    /// Adds `daemon`'s copy (made again from another) to a visible block
    /// that still has these bytes (size and checksum) and wants another
    /// copy (not counting those on `leaving` daemons); `false` if not
    /// (removed, replaced or repaired meanwhile): the caller then drops the
    /// copy.
    pub fn add_copy(
        &self,
        block: &BlockKey,
        (daemon, size, checksum): (u32, u32, u64),
        leaving: Leaving<'_>,
    ) -> bool {
        let names = self.names();
        let Some(key) = names.key_of(block) else {
            return false;
        };
        let mut shard = self.shard(&key).write(self);
        let Some(mut e) = shard.get(&key).copied() else {
            return false;
        };
        let same = e
            .visible()
            .is_some_and(|l| l.size == size && l.checksum == checksum);
        if !same {
            return false;
        }
        if e.copies.contains(daemon) {
            return true;
        }
        if !e.wants_copy(leaving) || !e.copies.push(daemon) {
            return false;
        }
        shard.insert(key, e);
        let named = shard.named(&key);
        self.events
            .stored((daemon, Tier::Dram), &block.namespace, block.hash, &named);
        true
    }

    /// Raises a visible block's wanted copies to `want` (a hot block);
    /// returns what it wanted before, or `None` if it is not visible or
    /// wants as many already.
    pub fn raise_want(&self, block: &BlockKey, want: u8) -> Option<u8> {
        self.change_visible(block, |e, _| {
            let before = e.want();
            (before < want).then(|| {
                e.set_want(want);
                before
            })
        })
    }

    /// Lowers a visible block's wanted copies to `want` (a hot block
    /// cooled) and takes out its copies past that many, the last made
    /// first; returns them, for their daemons to drop.
    pub fn lower_want(&self, block: &BlockKey, want: u8) -> Copies {
        let mut extra = Copies::default();
        self.change_visible(block, |e, named| {
            e.set_want(want.min(e.want()));
            while e.copies.len() > usize::from(want.max(1)) {
                let last = e.copies.with_tiers().last().expect("more than one");
                e.copies.remove(last.0);
                extra.push(last.0);
                self.events
                    .removed(last, &block.namespace, block.hash, named);
            }
            Some(())
        });
        extra
    }

    /// Changes a visible entry in place with `f`, shown what the index
    /// keeps of it for events (the count of copies follows); `None` if it
    /// is not visible or `f` says so.
    fn change_visible<T>(
        &self,
        block: &BlockKey,
        f: impl FnOnce(&mut Entry, &Named) -> Option<T>,
    ) -> Option<T> {
        let names = self.names();
        let key = names.key_of(block)?;
        let mut shard = self.shard(&key).write(self);
        let mut e = shard.get(&key).copied().filter(|e| !e.is_pending())?;
        let named = shard.named(&key);
        let out = f(&mut e, &named)?;
        shard.insert(key, e);
        Some(out)
    }

    /// Records the tier `daemon` holds its copy of a visible block in now
    /// (demoted to NVMe, or promoted back); `false` if it holds none, or
    /// the tier did not change.
    pub fn set_tier(&self, block: &BlockKey, daemon: u32, tier: Tier) -> bool {
        let names = self.names();
        let Some(key) = names.key_of(block) else {
            return false;
        };
        let mut shard = self.shard(&key).write(self);
        let Some(mut e) = shard.get(&key).copied().filter(|e| !e.is_pending()) else {
            return false;
        };
        let Some(from) = e.copies.set_tier(daemon, tier) else {
            return false;
        };
        shard.insert(key, e);
        // Emitted under the entry's lock, as every change of it is.
        let named = shard.named(&key);
        self.events
            .moved(daemon, (from, tier), &block.namespace, block.hash, &named);
        true
    }
}
