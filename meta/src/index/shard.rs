//! One shard of the index: its table, the counts and side tables kept
//! beside it, and the write guard through which every change goes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::names::Names;
use super::{Entry, IdxKey, Index, State};
use crate::clients::PendingByClient;
use crate::events::Named;
use crate::table::{prefetch, Table, TableKey};

/// One shard: its table, and where the table's slots lie (published on
/// every write, read without the lock) so that a reader can prefetch a
/// key's slot before taking the lock. A stale layout (the table grew
/// since) only makes a prefetch useless.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) table: RwLock<Table<IdxKey, Entry>>,
    pub(super) base: AtomicUsize,
    pub(super) mask: AtomicUsize,
    /// Reservations in the order they were made, so that expiring them
    /// visits only those old enough, not the whole table: a scan of every
    /// entry under the write lock, five times a second, costs as much as
    /// the index is large and stalls every lookup of the shard meanwhile.
    /// Holds the reservations of the last put timeout, committed or not
    /// (a committed one is skipped when its turn comes). Two threads may
    /// push their times slightly out of order: an entry then waits for the
    /// one before it, microseconds later. Locked after the table, never
    /// before.
    pub(super) reservations: Mutex<VecDeque<(IdxKey, Instant)>>,
    /// What the table holds, kept as entries come and go (under the write
    /// lock) so that `stats` (every metrics scrape) reads three numbers
    /// instead of every entry.
    pub(super) visible: AtomicU64,
    /// The visible entries' copies.
    pub(super) copies: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) pending: AtomicU64,
    /// The parent each visible block's writer named and the engine's tag
    /// it attached, kept only while store events are published (they carry
    /// them as `parent_block_hash`, the engine's hash and `token_ids`), and
    /// only for blocks that have either, so that an index without
    /// subscribers stays 48 bytes an entry. Locked after the table, never
    /// before, and no other lock taken while it is held; an entry's goes
    /// with it.
    pub(super) named: Mutex<HashMap<IdxKey, Named>>,
}

impl Shard {
    pub(super) fn read(&self) -> RwLockReadGuard<'_, Table<IdxKey, Entry>> {
        self.table.read()
    }

    pub(super) fn write<'a>(&'a self, index: &'a Index) -> ShardWrite<'a> {
        ShardWrite {
            table: self.table.write(),
            shard: self,
            names: &index.namespaces,
            clients: &index.pending_by_client,
            named: index.events.is_on(),
        }
    }

    pub(super) fn prefetch(&self, key: &IdxKey) {
        let (base, mask) = (
            self.base.load(Ordering::Relaxed),
            self.mask.load(Ordering::Relaxed),
        );
        if base != 0 {
            let size = std::mem::size_of::<Option<(IdxKey, Entry)>>();
            prefetch(base + (key.hash64() as usize & mask) * size, size);
        }
    }
}

/// A shard's table, locked for writing; publishes its layout when done.
pub(super) struct ShardWrite<'a> {
    pub(super) table: RwLockWriteGuard<'a, Table<IdxKey, Entry>>,
    pub(super) shard: &'a Shard,
    /// Each entry removed gives back its namespace's reference.
    pub(super) names: &'a Names,
    /// Reservations are counted against their clients.
    pub(super) clients: &'a PendingByClient,
    /// Whether parents and tags are kept (store events are on).
    pub(super) named: bool,
}

impl std::ops::Deref for ShardWrite<'_> {
    type Target = Table<IdxKey, Entry>;
    fn deref(&self) -> &Self::Target {
        &self.table
    }
}

/// Every change to a shard's entries goes through these, which keep the
/// shard's counts. An entry added must bring its namespace's reference
/// (`Names::acquire`); replacing an entry keeps the one it had.
impl ShardWrite<'_> {
    pub(super) fn insert(&mut self, key: IdxKey, entry: Entry) -> Option<Entry> {
        self.count(&entry, true);
        let old = self.table.insert(key, entry);
        if let Some(old) = &old {
            self.count(old, false);
        }
        old
    }

    pub(super) fn remove(&mut self, key: &IdxKey) -> Option<Entry> {
        let old = self.table.remove(key);
        if let Some(old) = &old {
            self.count(old, false);
            self.names.release(key.ns);
            if self.named {
                self.shard.named.lock().remove(key);
            }
        }
        old
    }

    /// The parent and tag a visible block's writer named (kept while
    /// events are on).
    pub(super) fn named(&self, key: &IdxKey) -> Named {
        if !self.named {
            return Named::default();
        }
        self.shard
            .named
            .lock()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// Records the parent and tag of the visible block at `key` (events
    /// on).
    pub(super) fn set_named(&mut self, key: IdxKey, named: &Named) {
        if !self.named {
            return;
        }
        let mut kept = self.shard.named.lock();
        if named.is_empty() {
            kept.remove(&key);
        } else {
            kept.insert(key, named.clone());
        }
    }

    /// Keeps the entries `keep` says to, which it may change in place
    /// (their phase and size must stay, and a visible entry's copies
    /// taken out must be counted out by `keep`: the counts do not see it).
    /// `keep` is shown what the index keeps of each entry for events.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&IdxKey, &mut Entry, &Named) -> bool) {
        let (shard, names, clients) = (self.shard, self.names, self.clients);
        let mut named = self.named.then(|| shard.named.lock());
        let none = Named::default();
        self.table.retain(|k, e| {
            let of = named.as_ref().and_then(|n| n.get(k)).unwrap_or(&none);
            let kept = keep(k, e, of);
            if !kept {
                count((shard, clients), e, false);
                names.release(k.ns);
                if let Some(named) = &mut named {
                    named.remove(k);
                }
            }
            kept
        });
    }

    fn count(&self, e: &Entry, added: bool) {
        count((self.shard, self.clients), e, added);
    }
}

fn count((shard, clients): (&Shard, &PendingByClient), e: &Entry, added: bool) {
    let change = |n: &AtomicU64, by: u64| {
        if added {
            n.fetch_add(by, Ordering::Relaxed);
        } else {
            n.fetch_sub(by, Ordering::Relaxed);
        }
    };
    match e.state {
        State::Visible { .. } => {
            change(&shard.visible, 1);
            change(&shard.copies, e.copies.len() as u64);
            change(&shard.bytes, u64::from(e.size));
        }
        State::Pending { client, .. } => {
            change(&shard.pending, 1);
            if added {
                clients.add(client);
            } else {
                clients.sub(client);
            }
        }
    }
}

impl Drop for ShardWrite<'_> {
    fn drop(&mut self) {
        let (base, mask) = self.table.layout();
        self.shard.base.store(base, Ordering::Relaxed);
        self.shard.mask.store(mask, Ordering::Relaxed);
    }
}
