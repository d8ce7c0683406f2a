//! The index's hash table: open addressing with linear probing, entries
//! stored inline, so that finding a key costs one or two adjacent cache
//! lines and the slot a key will use can be computed (and prefetched)
//! before it is probed. A prefix match walks 128 keys whose slots are
//! scattered over a table larger than the CPU's caches: prefetching a few
//! keys ahead overlaps those misses instead of paying them one by one.
//!
//! Deletion shifts later entries back (no tombstones), so probe sequences
//! stay as short as the load allows.

/// A key whose own bits are a uniform hash.
pub trait TableKey: Copy + Eq {
    fn hash64(&self) -> u64;
}

/// Longest fill before the table doubles: 5/8.
const LOAD_NUM: usize = 5;
const LOAD_DEN: usize = 8;
const MIN_SLOTS: usize = 16;

pub struct Table<K, V> {
    slots: Box<[Option<(K, V)>]>,
    len: usize,
}

impl<K: TableKey, V> Default for Table<K, V> {
    fn default() -> Self {
        Self::with_slots(MIN_SLOTS)
    }
}

impl<K: TableKey, V> Table<K, V> {
    fn with_slots(n: usize) -> Self {
        Table {
            slots: (0..n).map(|_| None).collect(),
            len: 0,
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, key: &K) -> usize {
        key.hash64() as usize & self.mask()
    }

    /// The slots' base address and index mask, published so that readers
    /// can compute a key's home slot without the lock (`prefetch`).
    pub fn layout(&self) -> (usize, usize) {
        (self.slots.as_ptr() as usize, self.mask())
    }

    fn find(&self, key: &K) -> Option<usize> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match &self.slots[i] {
                None => return None,
                Some((k, _)) if k == key => return Some(i),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        let i = self.find(key)?;
        self.slots[i].as_ref().map(|(_, v)| v)
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.find(key).is_some()
    }

    /// Inserts or replaces; the value replaced, if any.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        if (self.len + 1) * LOAD_DEN > self.slots.len() * LOAD_NUM {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(&key);
        loop {
            match &mut self.slots[i] {
                slot @ None => {
                    *slot = Some((key, value));
                    self.len += 1;
                    return None;
                }
                Some((k, v)) if *k == key => return Some(std::mem::replace(v, value)),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    fn grow(&mut self) {
        let bigger = Self::with_slots(self.slots.len() * 2).slots;
        let old = std::mem::replace(&mut self.slots, bigger);
        self.len = 0;
        for (k, v) in old.into_vec().into_iter().flatten() {
            self.insert(k, v);
        }
    }

    /// Removes a key; its value, if it was there.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let mut hole = self.find(key)?;
        let (_, value) = self.slots[hole].take()?;
        self.len -= 1;
        // Shift back every later entry of the run that may move into the
        // hole (whose home is not strictly between the hole and itself).
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let home = match &self.slots[j] {
                None => break,
                Some((k, _)) => self.home(k),
            };
            // Distance from home to j, and from the hole to j, cyclically.
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j].take();
                hole = j;
            }
        }
        Some(value)
    }

    /// Keeps only the entries `keep` says to.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        let gone: Vec<K> = self
            .slots
            .iter_mut()
            .flatten()
            .filter_map(|(k, v)| (!keep(k, v)).then_some(*k))
            .collect();
        for k in gone {
            self.remove(&k);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots.iter().flatten().map(|(k, v)| (k, v))
    }
}

/// Asks the CPU to load the cache lines at `addr` (a slot of `size` bytes)
/// ahead of use. A hint only: any address is fine, none is dereferenced.
#[inline]
pub fn prefetch(addr: usize, size: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut line = addr & !63;
        while line < addr + size {
            // SAFETY: prefetching never faults nor reads into the program.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, size);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// Keys whose hash is chosen, to force collisions and wrap-around.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    struct K(u64, u8);

    impl TableKey for K {
        fn hash64(&self) -> u64 {
            self.0
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(K, u32),
        Remove(K),
        Retain(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct hashes (many collisions), some near the table's end.
        let key = (
            prop_oneof![0u64..8, Just(15), Just(31), Just(u64::MAX)],
            0u8..4,
        )
            .prop_map(|(h, n)| K(h, n));
        prop_oneof![
            4 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => key.prop_map(Op::Remove),
            1 => (0u8..4).prop_map(Op::Retain),
        ]
    }

    proptest! {
        /// After any sequence of inserts, removes and retains, the table
        /// holds exactly what a HashMap holds.
        #[test]
        fn behaves_as_a_map(ops in proptest::collection::vec(op(), 0..300)) {
            let mut table: Table<K, u32> = Table::default();
            let mut model: HashMap<K, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => prop_assert_eq!(table.insert(k, v), model.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(table.remove(&k), model.remove(&k)),
                    Op::Retain(n) => {
                        table.retain(|k, _| k.1 != n);
                        model.retain(|k, _| k.1 != n);
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                for (k, v) in &model {
                    prop_assert_eq!(table.get(k), Some(v));
                }
                prop_assert_eq!(table.iter().count(), model.len());
            }
        }
    }

    #[test]
    fn grows_and_finds_every_key() {
        let mut table: Table<K, u64> = Table::default();
        for i in 0..10_000u64 {
            table.insert(K(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), 0), i);
        }
        assert_eq!(table.len(), 10_000);
        for i in 0..10_000u64 {
            assert_eq!(
                table.get(&K(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), 0)),
                Some(&i)
            );
        }
        assert!(table.get(&K(1, 1)).is_none());
    }
}
