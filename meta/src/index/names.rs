//! Namespaces interned to small ids for the index's entries.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_proto::{BlockKey, Namespace};
use parking_lot::{Mutex, RwLock};

use super::IdxKey;

/// A namespace interned to a small number, so that entries stay small and
/// lookups hash no strings.
pub(super) type NsId = u32;

/// The namespaces in use, interned to small ids. Each entry of the tables
/// holds one reference to its namespace's id; an id whose last entry went
/// is freed by `sweep_namespaces` (and may then be reused), so that names
/// a client made up leave with their entries. Whoever reads an id from
/// `ids` holds the read lock until done with it: a sweep (write lock) can
/// then never free it under them.
#[derive(Default)]
pub(super) struct Names {
    pub(super) table: RwLock<NameTable>,
    /// Ids whose references reached zero since the last sweep.
    zeroed: Mutex<Vec<NsId>>,
}

#[derive(Default)]
pub(super) struct NameTable {
    pub(super) ids: HashMap<Namespace, NsId>,
    /// By id; `None`: free.
    names: Vec<Option<Namespace>>,
    refs: Vec<AtomicU64>,
    free: Vec<NsId>,
}

impl NameTable {
    /// The index key of a block, if its namespace is in use.
    pub(super) fn key_of(&self, block: &BlockKey) -> Option<IdxKey> {
        Some(IdxKey {
            ns: *self.ids.get(&block.namespace)?,
            hash: block.hash,
        })
    }

    pub(super) fn name(&self, id: NsId) -> &Namespace {
        self.names[id as usize]
            .as_ref()
            .expect("an id in use has its name")
    }
}

impl Names {
    /// The id of `ns` with one more reference, which the caller hands to
    /// the entry it adds, or gives back with `release`.
    pub(super) fn acquire(&self, ns: &Namespace) -> NsId {
        {
            let table = self.table.read();
            if let Some(&id) = table.ids.get(ns) {
                table.refs[id as usize].fetch_add(1, Ordering::Relaxed);
                return id;
            }
        }
        let mut table = self.table.write();
        if let Some(&id) = table.ids.get(ns) {
            table.refs[id as usize].fetch_add(1, Ordering::Relaxed);
            return id;
        }
        let id = match table.free.pop() {
            Some(id) => id,
            None => {
                table.names.push(None);
                table.refs.push(AtomicU64::new(0));
                (table.names.len() - 1) as NsId
            }
        };
        table.names[id as usize] = Some(ns.clone());
        table.refs[id as usize].store(1, Ordering::Relaxed);
        table.ids.insert(ns.clone(), id);
        id
    }

    /// Gives back one reference (an entry of the namespace went).
    pub(super) fn release(&self, id: NsId) {
        let before = self.table.read_recursive().refs[id as usize].fetch_sub(1, Ordering::Relaxed);
        if before == 1 {
            self.zeroed.lock().push(id);
        }
    }

    /// Frees the ids no entry refers to any more; returns how many.
    pub(super) fn sweep(&self) -> usize {
        let zeroed = std::mem::take(&mut *self.zeroed.lock());
        if zeroed.is_empty() {
            return 0;
        }
        let mut table = self.table.write();
        let mut freed = 0;
        for id in zeroed {
            let unused = table.refs[id as usize].load(Ordering::Relaxed) == 0;
            if let Some(name) = table.names[id as usize].take_if(|_| unused) {
                table.ids.remove(&name);
                table.free.push(id);
                freed += 1;
            }
        }
        if table.ids.capacity() > 64 && table.ids.len() * 4 < table.ids.capacity() {
            table.ids.shrink_to_fit();
        }
        freed
    }
}
