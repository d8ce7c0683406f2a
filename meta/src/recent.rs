//! A map of the last `cap` keys inserted: what the meta service remembers
//! of recent events (evictions, branch points, blocks just put) without
//! growing with the cluster. Inserting past `cap` forgets the oldest key;
//! inserting a key again makes it the newest.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

pub(crate) struct Recent<K, V> {
    cap: usize,
    /// Each key with its value and its insertion's number. Every put and
    /// every prefix match looks keys up here, so the hash is foldhash's
    /// (seeded per process: keys come from clients), not std's slower
    /// SipHash.
    map: HashMap<K, (V, u64), foldhash::quality::RandomState>,
    /// The insertions in order, oldest first (a key inserted again since
    /// appears twice; only its latest number counts).
    order: VecDeque<(K, u64)>,
    next: u64,
}

impl<K: Hash + Eq + Clone, V> Recent<K, V> {
    pub(crate) fn new(cap: usize) -> Self {
        Recent {
            cap: cap.max(1),
            map: HashMap::default(),
            order: VecDeque::new(),
            next: 0,
        }
    }

    /// `key` is the newest now, with `value`.
    pub(crate) fn insert(&mut self, key: K, value: V) {
        let n = self.next;
        self.next += 1;
        self.map.insert(key.clone(), (value, n));
        self.order.push_back((key, n));
        while self.order.len() > self.cap {
            let Some((old, at)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&old).is_some_and(|(_, n)| *n == at) {
                self.map.remove(&old);
            }
        }
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.map.get(key).map(|(v, _)| v)
    }

    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(key).map(|(v, _)| v)
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        self.map.remove(key).map(|(v, _)| v)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{BlockHash, BlockKey, Namespace};

    fn key(i: u64) -> BlockKey {
        BlockKey::new(
            Namespace::new("t").unwrap(),
            BlockHash::from_opaque(&i.to_le_bytes()),
        )
    }

    #[test]
    fn only_the_last_keys_inserted_are_kept() {
        let mut recent = Recent::new(3);
        for i in 0..5 {
            recent.insert(key(i), i);
        }
        assert_eq!(recent.len(), 3);
        assert_eq!(recent.get(&key(1)), None);
        assert_eq!(recent.get(&key(2)), Some(&2));
        // Inserted again: the newest, so the next to go is key 3.
        recent.insert(key(2), 20);
        recent.insert(key(5), 5);
        assert_eq!(recent.get(&key(2)), Some(&20));
        assert_eq!(recent.get(&key(3)), None);
        assert_eq!(recent.remove(&key(4)), Some(4));
        assert_eq!(recent.len(), 2);
    }
}
