//! Keys whose forced removal is being told to the daemons that held them.
//! Such a key is out of the index already, so a put of it would be placed
//! again, maybe on a daemon whose removal is still on its way; that daemon
//! may still hold the same bytes, answer the put "already stored", and
//! then drop them when the removal arrives, leaving the index naming a
//! copy that is gone (every get a miss, every put "already exists").
//! So a put of a key being removed is refused (`Busy`: the caller may try
//! again) until each of its daemons has answered.
//!
//! Marked before the key leaves the index, so that a put that no longer
//! finds it there sees the mark; each mark ends once the key's daemons
//! answered, or with its guard, however the removal ends (a caller gone
//! mid-way included).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use mooncake_proto::{BlockHash, BlockKey, Namespace};
use parking_lot::Mutex;

#[derive(Default)]
pub struct Removing {
    keys: Mutex<HashMap<BlockKey, u32>>,
    /// Keys marked, readable without the lock (puts ask on every block).
    count: AtomicUsize,
}

/// Marks keys as being removed: each until `done`, the rest until dropped.
pub struct Marked<'a> {
    removing: &'a Removing,
    keys: Vec<Option<BlockKey>>,
}

impl Removing {
    /// Marks `hashes` of `namespace`: each until `Marked::done`, the rest
    /// until the guard is dropped.
    pub fn mark<'a>(&'a self, namespace: &Namespace, hashes: &[BlockHash]) -> Marked<'a> {
        let keys: Vec<Option<BlockKey>> = hashes
            .iter()
            .map(|h| Some(BlockKey::new(namespace.clone(), *h)))
            .collect();
        let mut marked = self.keys.lock();
        for key in keys.iter().flatten() {
            *marked.entry(key.clone()).or_default() += 1;
        }
        self.count.store(marked.len(), Ordering::Relaxed);
        drop(marked);
        Marked {
            removing: self,
            keys,
        }
    }

    /// Whether `hash` of `namespace` is being removed.
    pub fn contains(&self, namespace: &Namespace, hash: BlockHash) -> bool {
        self.count.load(Ordering::Relaxed) > 0
            && self
                .keys
                .lock()
                .contains_key(&BlockKey::new(namespace.clone(), hash))
    }

    /// Ends one mark of each of `keys`.
    fn unmark<'k>(&self, keys: impl Iterator<Item = &'k BlockKey>) {
        let mut marked = self.keys.lock();
        for key in keys {
            if let Some(n) = marked.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    marked.remove(key);
                }
            }
        }
        self.count.store(marked.len(), Ordering::Relaxed);
    }
}

impl Marked<'_> {
    /// The removal of the `i`-th key marked is done (its daemons answered).
    pub fn done(&mut self, i: usize) {
        let key = self.keys.get_mut(i).and_then(Option::take);
        self.removing.unmark(key.iter());
    }
}

impl Drop for Marked<'_> {
    fn drop(&mut self) {
        self.removing.unmark(self.keys.iter().flatten());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_marked_while_any_removal_of_it_runs() {
        let removing = Removing::default();
        let ns = Namespace::new("t").unwrap();
        let h = |i: u8| BlockHash([i; 32]);
        assert!(!removing.contains(&ns, h(1)));
        let mut first = removing.mark(&ns, &[h(1), h(2), h(3)]);
        let second = removing.mark(&ns, &[h(1)]);
        assert!(removing.contains(&ns, h(1)) && removing.contains(&ns, h(2)));
        assert!(!removing.contains(&Namespace::new("u").unwrap(), h(1)));
        first.done(2);
        first.done(2);
        assert!(!removing.contains(&ns, h(3)), "its daemons answered");
        assert!(removing.contains(&ns, h(2)));
        drop(first);
        assert!(
            removing.contains(&ns, h(1)),
            "the second removal still runs"
        );
        assert!(!removing.contains(&ns, h(2)));
        drop(second);
        assert!(!removing.contains(&ns, h(1)));
    }
}
