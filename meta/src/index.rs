//! The global block index, sharded by key hash so that lookups from many
//! connections do not contend (and so that it can later be split across
//! leaders, one shard range each).
//!
//! An entry is `Pending` from a put's first phase until its commit, and
//! only `Visible` entries are ever returned: visible means complete.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use mooncake_proto::message::{CommitItem, ListEntry, Location};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace};
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::clients::{Client, PendingByClient};
use crate::table::{prefetch, Table, TableKey};

const SHARDS: usize = 64;

/// A namespace interned to a small number, so that entries stay small and
/// lookups hash no strings.
type NsId = u32;

#[derive(Clone, Copy, PartialEq, Eq)]
struct IdxKey {
    ns: NsId,
    hash: BlockHash,
}

impl TableKey for IdxKey {
    fn hash64(&self) -> u64 {
        // The block hash is already uniform: its first bytes are the hash.
        self.hash.prefix_u64() ^ u64::from(self.ns).rotate_left(32)
    }
}

/// An entry's phase; the checksum is known once the block is stored, and
/// the reserving client only while it is being stored (an entry stays 32
/// bytes).
#[derive(Clone, Copy)]
enum State {
    /// `evicted`: the daemon evicted the block before the put committed
    /// (a pool of 2Q lets a long new chain pass through its probation
    /// while it is still being written).
    Pending {
        since: Instant,
        client: Client,
        evicted: bool,
    },
    Visible {
        checksum: u64,
    },
}

#[derive(Clone, Copy)]
struct Entry {
    daemon: u32,
    size: u32,
    state: State,
}

impl Entry {
    fn visible(&self) -> Option<Location> {
        match self.state {
            State::Visible { checksum } => Some(Location {
                daemon: self.daemon,
                size: self.size,
                checksum,
            }),
            State::Pending { .. } => None,
        }
    }
}

/// Keys of a prefix match whose slots are prefetched ahead of the probe.
const PREFETCH_AHEAD: usize = 8;

/// One shard: its table, and where the table's slots lie (published on
/// every write, read without the lock) so that a reader can prefetch a
/// key's slot before taking the lock. A stale layout (the table grew
/// since) only makes a prefetch useless.
#[derive(Default)]
struct Shard {
    table: RwLock<Table<IdxKey, Entry>>,
    base: AtomicUsize,
    mask: AtomicUsize,
    /// Reservations in the order they were made, so that expiring them
    /// visits only those old enough, not the whole table: a scan of every
    /// entry under the write lock, five times a second, costs as much as
    /// the index is large and stalls every lookup of the shard meanwhile.
    /// Holds the reservations of the last put timeout, committed or not
    /// (a committed one is skipped when its turn comes). Two threads may
    /// push their times slightly out of order: an entry then waits for the
    /// one before it, microseconds later. Locked after the table, never
    /// before.
    reservations: Mutex<VecDeque<(IdxKey, Instant)>>,
    /// What the table holds, kept as entries come and go (under the write
    /// lock) so that `stats` (every metrics scrape) reads three numbers
    /// instead of every entry.
    visible: AtomicU64,
    bytes: AtomicU64,
    pending: AtomicU64,
}

impl Shard {
    fn read(&self) -> RwLockReadGuard<'_, Table<IdxKey, Entry>> {
        self.table.read()
    }

    fn write<'a>(&'a self, index: &'a Index) -> ShardWrite<'a> {
        ShardWrite {
            table: self.table.write(),
            shard: self,
            names: &index.namespaces,
            clients: &index.pending_by_client,
        }
    }

    fn prefetch(&self, key: &IdxKey) {
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
struct ShardWrite<'a> {
    table: RwLockWriteGuard<'a, Table<IdxKey, Entry>>,
    shard: &'a Shard,
    /// Each entry removed gives back its namespace's reference.
    names: &'a Names,
    /// Reservations are counted against their clients.
    clients: &'a PendingByClient,
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
    fn insert(&mut self, key: IdxKey, entry: Entry) -> Option<Entry> {
        self.count(&entry, true);
        let old = self.table.insert(key, entry);
        if let Some(old) = &old {
            self.count(old, false);
        }
        old
    }

    fn remove(&mut self, key: &IdxKey) -> Option<Entry> {
        let old = self.table.remove(key);
        if let Some(old) = &old {
            self.count(old, false);
            self.names.release(key.ns);
        }
        old
    }

    fn retain(&mut self, mut keep: impl FnMut(&IdxKey, &Entry) -> bool) {
        let (shard, names, clients) = (self.shard, self.names, self.clients);
        self.table.retain(|k, e| {
            let kept = keep(k, e);
            if !kept {
                count((shard, clients), e, false);
                names.release(k.ns);
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

/// Which visible blocks `list` returns beyond the namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct ListFilter<'a> {
    /// Hashes starting with these bytes.
    pub prefix: &'a [u8],
    /// On this daemon only (None: any).
    pub daemon: Option<u32>,
}

/// Counts for `stat`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub visible: u64,
    pub bytes: u64,
    pub pending: u64,
}

pub struct Index {
    shards: Vec<Shard>,
    namespaces: Names,
    pending_by_client: PendingByClient,
}

/// The namespaces in use, interned to small ids. Each entry of the tables
/// holds one reference to its namespace's id; an id whose last entry went
/// is freed by `sweep_namespaces` (and may then be reused), so that names
/// a client made up leave with their entries. Whoever reads an id from
/// `ids` holds the read lock until done with it: a sweep (write lock) can
/// then never free it under them.
#[derive(Default)]
struct Names {
    table: RwLock<NameTable>,
    /// Ids whose references reached zero since the last sweep.
    zeroed: Mutex<Vec<NsId>>,
}

#[derive(Default)]
struct NameTable {
    ids: HashMap<Namespace, NsId>,
    /// By id; `None`: free.
    names: Vec<Option<Namespace>>,
    refs: Vec<AtomicU64>,
    free: Vec<NsId>,
}

impl NameTable {
    fn name(&self, id: NsId) -> &Namespace {
        self.names[id as usize]
            .as_ref()
            .expect("an id in use has its name")
    }
}

impl Names {
    /// The id of `ns` with one more reference, which the caller hands to
    /// the entry it adds, or gives back with `release`.
    fn acquire(&self, ns: &Namespace) -> NsId {
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
    fn release(&self, id: NsId) {
        let before = self.table.read_recursive().refs[id as usize].fetch_sub(1, Ordering::Relaxed);
        if before == 1 {
            self.zeroed.lock().push(id);
        }
    }

    /// Frees the ids no entry refers to any more; returns how many.
    fn sweep(&self) -> usize {
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

/// What phase one decided for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    Reserved,
    Exists,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            namespaces: Names::default(),
            pending_by_client: PendingByClient::default(),
        }
    }
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    fn shard(&self, key: &IdxKey) -> &Shard {
        // High bits pick the shard; the map inside uses the low bits.
        &self.shards[(key.hash.prefix_u64() >> 58) as usize % SHARDS]
    }

    /// The name table, read-locked: ids read from it stay valid while the
    /// guard lives.
    fn names(&self) -> RwLockReadGuard<'_, NameTable> {
        self.namespaces.table.read()
    }

    /// Frees namespaces that no entry uses any more (the reaper calls it);
    /// returns how many.
    pub fn sweep_namespaces(&self) -> usize {
        self.namespaces.sweep()
    }

    /// Namespaces interned now.
    pub fn namespaces(&self) -> usize {
        self.names().ids.len()
    }

    /// Reservations of `client` not committed yet.
    pub fn pending_of(&self, client: Client) -> u32 {
        self.pending_by_client.of(client)
    }

    /// Phase one: reserves a key on a daemon for `client` unless it is
    /// already stored or being stored.
    pub fn reserve(
        &self,
        ns: &Namespace,
        hash: BlockHash,
        (size, daemon): (u32, u32),
        client: Client,
        now: Instant,
    ) -> Reservation {
        let key = IdxKey {
            ns: self.namespaces.acquire(ns),
            hash,
        };
        let shard = self.shard(&key);
        let mut table = shard.write(self);
        if table.contains_key(&key) {
            drop(table);
            self.namespaces.release(key.ns);
            return Reservation::Exists;
        }
        table.insert(
            key,
            Entry {
                daemon,
                size,
                state: State::Pending {
                    since: now,
                    client,
                    evicted: false,
                },
            },
        );
        shard.reservations.lock().push_back((key, now));
        Reservation::Reserved
    }

    /// Adds a block a daemon reports holding (index rebuild). The report
    /// wins over an existing entry: the reporting daemon holds complete,
    /// verified bytes now, while the entry may point at a daemon that is
    /// gone (a restart at a new address) and about to be dropped.
    pub fn insert_visible(&self, key: &BlockKey, daemon: u32, size: u32, checksum: u64) {
        let key = IdxKey {
            ns: self.namespaces.acquire(&key.namespace),
            hash: key.hash,
        };
        let replaced = self.shard(&key).write(self).insert(
            key,
            Entry {
                daemon,
                size,
                state: State::Visible { checksum },
            },
        );
        if replaced.is_some() {
            // The entry it replaced already held the namespace's reference.
            self.namespaces.release(key.ns);
        }
    }

    /// Phase two: makes a stored block visible, or drops the reservation
    /// of one that was not stored.
    pub fn commit(&self, ns: &Namespace, item: &CommitItem) -> ErrorCode {
        let names = self.names();
        let Some(&ns) = names.ids.get(ns) else {
            // Nothing was ever reserved in this namespace: dropping a
            // reservation is done, making one visible is not possible.
            return if item.stored {
                ErrorCode::NoReservation
            } else {
                ErrorCode::Ok
            };
        };
        let key = IdxKey {
            ns,
            hash: item.hash,
        };
        let mut shard = self.shard(&key).write(self);
        match shard.get(&key).copied() {
            Some(e) if matches!(e.state, State::Pending { .. }) && e.daemon == item.daemon => {
                let evicted = matches!(e.state, State::Pending { evicted: true, .. });
                if item.stored && !evicted {
                    let visible = Entry {
                        state: State::Visible {
                            checksum: item.checksum,
                        },
                        size: item.size,
                        ..e
                    };
                    shard.insert(key, visible);
                } else {
                    shard.remove(&key);
                }
                ErrorCode::Ok
            }
            // Another writer's reservation: neither released nor "done".
            Some(e) if matches!(e.state, State::Pending { .. }) => ErrorCode::NoReservation,
            // Nothing of this writer's is left to release.
            _ if !item.stored => ErrorCode::Ok,
            _ => ErrorCode::NoReservation,
        }
    }

    fn visible(&self, ns: NsId, hash: BlockHash) -> Option<Location> {
        let key = IdxKey { ns, hash };
        let shard = self.shard(&key).read();
        shard.get(&key).and_then(Entry::visible)
    }

    /// Locations of visible keys, `None` for the rest.
    pub fn lookup(&self, ns: &Namespace, hashes: &[BlockHash]) -> Vec<Option<Location>> {
        let names = self.names();
        let Some(&ns) = names.ids.get(ns) else {
            return vec![None; hashes.len()];
        };
        hashes.iter().map(|h| self.visible(ns, *h)).collect()
    }

    /// Locations of the longest visible prefix of a chain.
    pub fn match_prefix(&self, ns: &Namespace, hashes: &[BlockHash]) -> Vec<Location> {
        let names = self.names();
        let Some(&ns) = names.ids.get(ns) else {
            return Vec::new();
        };
        let ahead = |i: usize| {
            if let Some(hash) = hashes.get(i + PREFETCH_AHEAD) {
                let key = IdxKey { ns, hash: *hash };
                self.shard(&key).prefetch(&key);
            }
        };
        for hash in hashes.iter().take(PREFETCH_AHEAD) {
            let key = IdxKey { ns, hash: *hash };
            self.shard(&key).prefetch(&key);
        }
        let mut out = Vec::with_capacity(hashes.len());
        for (i, hash) in hashes.iter().enumerate() {
            ahead(i);
            match self.visible(ns, *hash) {
                Some(location) => out.push(location),
                None => break,
            }
        }
        out
    }

    /// Removes visible keys; returns where each was (`None`: not stored).
    pub fn remove(&self, ns: &Namespace, hashes: &[BlockHash]) -> Vec<Option<u32>> {
        let names = self.names();
        let Some(&ns) = names.ids.get(ns) else {
            return vec![None; hashes.len()];
        };
        hashes
            .iter()
            .map(|hash| {
                let key = IdxKey { ns, hash: *hash };
                let mut shard = self.shard(&key).write(self);
                match shard.get(&key) {
                    Some(e) if matches!(e.state, State::Visible { .. }) => {
                        let daemon = e.daemon;
                        shard.remove(&key);
                        Some(daemon)
                    }
                    _ => None,
                }
            })
            .collect()
    }

    /// Drops a key if (and only if) it lives on `daemon`: a daemon's report
    /// that it evicted a block must not remove a newer copy elsewhere. A
    /// put of it not committed yet stays reserved, marked evicted: its
    /// commit then succeeds (the block was stored, and evicted as any
    /// block may be) without making it visible.
    pub fn remove_at(&self, key: &BlockKey, daemon: u32) -> bool {
        let names = self.names();
        let Some(&ns) = names.ids.get(&key.namespace) else {
            return false;
        };
        let key = IdxKey { ns, hash: key.hash };
        let mut shard = self.shard(&key).write(self);
        let Some(e) = shard.get(&key).copied().filter(|e| e.daemon == daemon) else {
            return false;
        };
        if let State::Pending { since, client, .. } = e.state {
            let state = State::Pending {
                since,
                client,
                evicted: true,
            };
            shard.insert(key, Entry { state, ..e });
        } else {
            shard.remove(&key);
        }
        true
    }

    /// Drops every entry of a dead daemon; returns how many.
    pub fn remove_daemon(&self, daemon: u32) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let mut shard = s.write(self);
                let before = shard.len();
                shard.retain(|_, e| e.daemon != daemon);
                before - shard.len()
            })
            .sum()
    }

    /// Drops reservations older than `deadline`; returns them, so that their
    /// daemons can free whatever bytes arrived. Visits only the reservations
    /// made before `deadline` (an entry reserved again since, or committed,
    /// is left alone).
    pub fn expire_pending(&self, deadline: Instant) -> Vec<(BlockKey, u32)> {
        let due = |s: &Shard| {
            s.reservations
                .lock()
                .front()
                .is_some_and(|(_, since)| *since < deadline)
        };
        let mut expired = Vec::new();
        for s in self.shards.iter().filter(|s| due(s)) {
            let mut table = s.write(self);
            let mut queue = s.reservations.lock();
            while let Some(&(key, made)) = queue.front() {
                if made >= deadline {
                    break;
                }
                queue.pop_front();
                let still_pending = table.get(&key).is_some_and(
                    |e| matches!(e.state, State::Pending { since, .. } if since == made),
                );
                if still_pending {
                    let entry = table.remove(&key).expect("just found");
                    expired.push((key, entry.daemon));
                }
            }
        }
        // Not swept yet (only `sweep_namespaces` frees, after this): the
        // names of the entries just removed are still there.
        let names = self.names();
        expired
            .into_iter()
            .map(|(k, d)| (BlockKey::new(names.name(k.ns).clone(), k.hash), d))
            .collect()
    }

    /// A page of visible entries after `after`, ordered by (namespace, hash).
    pub fn list(
        &self,
        ns: Option<&Namespace>,
        after: Option<&BlockKey>,
        filter: ListFilter<'_>,
        limit: usize,
    ) -> (Vec<ListEntry>, bool) {
        let names = self.names();
        let wanted = match ns {
            Some(ns) => match names.ids.get(ns) {
                Some(id) => Some(*id),
                None => return (Vec::new(), false),
            },
            None => None,
        };
        let mut all: Vec<ListEntry> = Vec::new();
        for s in &self.shards {
            let shard = s.read();
            for (k, e) in shard.iter() {
                let Some(location) = e.visible() else {
                    continue;
                };
                if wanted.is_some_and(|w| w != k.ns)
                    || !k.hash.0.starts_with(filter.prefix)
                    || filter.daemon.is_some_and(|d| d != e.daemon)
                {
                    continue;
                }
                let key = BlockKey::new(names.name(k.ns).clone(), k.hash);
                if after.is_some_and(|a| &key <= a) {
                    continue;
                }
                all.push(ListEntry { key, location });
            }
        }
        all.sort_by(|a, b| a.key.cmp(&b.key));
        let more = all.len() > limit;
        all.truncate(limit);
        (all, more)
    }

    pub fn stats(&self) -> PrefixStats {
        let mut st = PrefixStats::default();
        for s in &self.shards {
            st.visible += s.visible.load(Ordering::Relaxed);
            st.bytes += s.bytes.load(Ordering::Relaxed);
            st.pending += s.pending.load(Ordering::Relaxed);
        }
        st
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ns() -> Namespace {
        Namespace::new("t").unwrap()
    }

    fn me() -> Client {
        Client::of([10, 0, 0, 1].into())
    }

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn commit(idx: &Index, i: u8, daemon: u32) -> ErrorCode {
        idx.commit(
            &ns(),
            &CommitItem {
                hash: h(i),
                daemon,
                size: 10,
                checksum: 99,
                stored: true,
            },
        )
    }

    #[test]
    fn pending_is_invisible_until_committed() {
        let idx = Index::new();
        let now = Instant::now();
        assert_eq!(
            idx.reserve(&ns(), h(1), (10, 7), me(), now),
            Reservation::Reserved
        );
        assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None]);
        assert_eq!(
            idx.reserve(&ns(), h(1), (10, 7), me(), now),
            Reservation::Exists
        );
        assert_eq!(commit(&idx, 1, 7), ErrorCode::Ok);
        let loc = idx.lookup(&ns(), &[h(1)])[0].unwrap();
        assert_eq!((loc.daemon, loc.size, loc.checksum), (7, 10, 99));
    }

    #[test]
    fn commit_without_reservation_or_from_another_daemon_is_refused() {
        let idx = Index::new();
        idx.reserve(&ns(), h(2), (10, 1), me(), Instant::now());
        assert_eq!(commit(&idx, 1, 1), ErrorCode::NoReservation);
        assert_eq!(commit(&idx, 2, 9), ErrorCode::NoReservation);
        let abort = |daemon| {
            idx.commit(
                &ns(),
                &CommitItem {
                    hash: h(2),
                    daemon,
                    size: 10,
                    checksum: 0,
                    stored: false,
                },
            )
        };
        assert_eq!(
            abort(9),
            ErrorCode::NoReservation,
            "another writer's reservation"
        );
        assert_eq!(idx.stats().pending, 1, "and it is kept");
        assert_eq!(abort(1), ErrorCode::Ok);
        assert_eq!(idx.stats().pending, 0);
        assert_eq!(abort(1), ErrorCode::Ok, "nothing left to release");
    }

    #[test]
    fn a_namespace_leaves_with_its_last_entry_and_its_id_never_mixes_on_reuse() {
        let idx = Index::new();
        let t = Instant::now();
        for i in 0..1000 {
            let ns = Namespace::new(format!("made-up/{i}")).unwrap();
            idx.reserve(&ns, h(1), (10, 1), me(), t);
        }
        idx.reserve(&ns(), h(1), (10, 1), me(), t);
        idx.commit(
            &ns(),
            &CommitItem {
                hash: h(1),
                daemon: 1,
                size: 10,
                checksum: 9,
                stored: true,
            },
        );
        assert_eq!(idx.namespaces(), 1001);
        assert_eq!(idx.expire_pending(t + Duration::from_secs(1)).len(), 1000);
        assert_eq!(idx.sweep_namespaces(), 1000);
        assert_eq!(
            idx.namespaces(),
            1,
            "only the one with a stored block stays"
        );
        // Ids are reused by new names; what the old names held never shows.
        let gone = Namespace::new("made-up/7").unwrap();
        let other = Namespace::new("other").unwrap();
        idx.reserve(&other, h(1), (10, 2), me(), t);
        idx.commit(
            &other,
            &CommitItem {
                hash: h(1),
                daemon: 2,
                size: 10,
                checksum: 9,
                stored: true,
            },
        );
        assert_eq!(idx.lookup(&gone, &[h(1)]), vec![None]);
        assert_eq!(idx.lookup(&other, &[h(1)])[0].unwrap().daemon, 2);
        assert_eq!(idx.lookup(&ns(), &[h(1)])[0].unwrap().daemon, 1);
        assert_eq!(idx.sweep_namespaces(), 0, "names in use are kept");
    }

    #[test]
    fn match_prefix_stops_at_the_first_gap() {
        let idx = Index::new();
        for i in [1, 2, 4] {
            idx.reserve(&ns(), h(i), (10, 1), me(), Instant::now());
            commit(&idx, i, 1);
        }
        assert_eq!(idx.match_prefix(&ns(), &[h(1), h(2), h(3), h(4)]).len(), 2);
        assert_eq!(idx.match_prefix(&ns(), &[h(3), h(1)]).len(), 0);
        let other = Namespace::new("other").unwrap();
        assert_eq!(
            idx.match_prefix(&other, &[h(1)]).len(),
            0,
            "namespaces never mix"
        );
    }

    #[test]
    fn expired_reservations_free_the_key() {
        let idx = Index::new();
        let t0 = Instant::now();
        idx.reserve(&ns(), h(1), (10, 3), me(), t0);
        let expired = idx.expire_pending(t0 + Duration::from_secs(1));
        assert_eq!(expired, vec![(BlockKey::new(ns(), h(1)), 3)]);
        assert_eq!(
            idx.reserve(&ns(), h(1), (10, 3), me(), t0),
            Reservation::Reserved
        );
        assert_eq!(idx.stats().pending, 1);
    }

    #[test]
    fn a_block_evicted_before_its_commit_commits_as_stored_but_stays_invisible() {
        let idx = Index::new();
        idx.reserve(&ns(), h(1), (10, 4), me(), Instant::now());
        // The daemon's eviction report comes before the writer's commit.
        assert!(idx.remove_at(&BlockKey::new(ns(), h(1)), 4));
        assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None]);
        assert_eq!(commit(&idx, 1, 4), ErrorCode::Ok);
        assert_eq!(idx.lookup(&ns(), &[h(1)]), vec![None]);
        assert_eq!(idx.stats(), PrefixStats::default(), "nothing left");
        // A new put of the key is a put like any other.
        assert_eq!(
            idx.reserve(&ns(), h(1), (10, 4), me(), Instant::now()),
            Reservation::Reserved
        );
        assert_eq!(commit(&idx, 1, 4), ErrorCode::Ok);
        assert!(idx.lookup(&ns(), &[h(1)])[0].is_some());
    }

    #[test]
    fn dead_daemon_and_evictions_remove_only_their_blocks() {
        let idx = Index::new();
        for (i, d) in [(1, 1), (2, 1), (3, 2)] {
            idx.reserve(&ns(), h(i), (10, d), me(), Instant::now());
            commit(&idx, i, d);
        }
        assert!(
            !idx.remove_at(&BlockKey::new(ns(), h(3)), 1),
            "wrong daemon"
        );
        assert!(idx.remove_at(&BlockKey::new(ns(), h(3)), 2));
        assert_eq!(idx.remove_daemon(1), 2);
        assert_eq!(idx.stats(), PrefixStats::default());
    }

    #[test]
    fn inventory_rebuilds_visible_entries_and_the_latest_report_wins() {
        let idx = Index::new();
        let key = BlockKey::new(ns(), h(5));
        idx.insert_visible(&key, 2, 100, 7);
        idx.insert_visible(&key, 3, 100, 7);
        let loc = idx.lookup(&ns(), &[h(5)])[0].unwrap();
        assert_eq!(loc.daemon, 3, "the latest report wins");
        // A dead daemon's removal no longer takes the block with it.
        assert_eq!(idx.remove_daemon(2), 0);
        assert_eq!(idx.match_prefix(&ns(), &[h(5)]).len(), 1);
    }

    #[test]
    fn list_pages_in_key_order() {
        let idx = Index::new();
        for i in 0..10 {
            idx.reserve(&ns(), h(i), (10, 1), me(), Instant::now());
            commit(&idx, i, 1);
        }
        let (page, more) = idx.list(None, None, ListFilter::default(), 4);
        assert!(more);
        assert_eq!(page.len(), 4);
        let (rest, more) = idx.list(Some(&ns()), Some(&page[3].key), ListFilter::default(), 100);
        assert!(!more);
        assert_eq!(rest.len(), 6);
        assert!(rest[0].key > page[3].key);
        let three = ListFilter {
            prefix: &[3, 3],
            daemon: Some(1),
        };
        let (only, _) = idx.list(None, None, three, 100);
        assert_eq!(only.len(), 1);
        assert_eq!(only[0].key.hash, h(3));
        let elsewhere = ListFilter {
            daemon: Some(2),
            ..ListFilter::default()
        };
        assert!(idx.list(None, None, elsewhere, 100).0.is_empty());
    }
}

/// The index against a plain map of what it should hold, under any sequence
/// of reservations, commits, removals and daemon deaths.
#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Reserve {
            ns: u8,
            h: u8,
            daemon: u32,
            size: u32,
        },
        Commit {
            ns: u8,
            h: u8,
            daemon: u32,
            stored: bool,
            size: u32,
        },
        Report {
            ns: u8,
            h: u8,
            daemon: u32,
            size: u32,
        },
        Remove {
            ns: u8,
            h: u8,
        },
        RemoveAt {
            ns: u8,
            h: u8,
            daemon: u32,
        },
        DaemonDied {
            daemon: u32,
        },
        /// Expires reservations made more than `age` steps ago.
        Expire {
            age: u64,
        },
        /// Frees namespaces no entry uses.
        Sweep,
    }

    fn op() -> impl Strategy<Value = Op> {
        let (ns, h, d, size) = (0u8..3, 0u8..12, 1u32..4, 1u32..1000);
        prop_oneof![
            (ns.clone(), h.clone(), d.clone(), size.clone()).prop_map(|(ns, h, daemon, size)| {
                Op::Reserve {
                    ns,
                    h,
                    daemon,
                    size,
                }
            }),
            (
                ns.clone(),
                h.clone(),
                d.clone(),
                any::<bool>(),
                size.clone()
            )
                .prop_map(|(ns, h, daemon, stored, size)| Op::Commit {
                    ns,
                    h,
                    daemon,
                    stored,
                    size
                }),
            (ns.clone(), h.clone(), d.clone(), size).prop_map(|(ns, h, daemon, size)| Op::Report {
                ns,
                h,
                daemon,
                size
            }),
            (ns.clone(), h.clone()).prop_map(|(ns, h)| Op::Remove { ns, h }),
            (ns, h, d.clone()).prop_map(|(ns, h, daemon)| Op::RemoveAt { ns, h, daemon }),
            d.prop_map(|daemon| Op::DaemonDied { daemon }),
            (0u64..40).prop_map(|age| Op::Expire { age }),
            Just(Op::Sweep),
        ]
    }

    #[derive(Debug, Clone, Copy)]
    struct Model {
        daemon: u32,
        size: u32,
        visible: bool,
        /// The step of the reservation, while pending.
        since: u64,
        /// Who reserved it, while pending.
        client: u8,
        /// Evicted by its daemon while pending.
        evicted: bool,
    }

    fn client_of(i: u8) -> Client {
        Client::of([10, 0, 0, i].into())
    }

    fn name(i: u8) -> Namespace {
        Namespace::new(format!("ns{i}")).unwrap()
    }

    fn hash(i: u8) -> BlockHash {
        BlockHash::from_opaque(&[i])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn the_index_holds_what_a_plain_map_holds(ops in proptest::collection::vec(op(), 1..150)) {
            let index = Index::new();
            let mut model: HashMap<(u8, u8), Model> = HashMap::new();
            let t0 = Instant::now();
            let at = |step: u64| t0 + std::time::Duration::from_millis(step);
            for (step, op) in ops.into_iter().enumerate() {
                let step = step as u64;
                match op {
                    Op::Reserve { ns, h, daemon, size } => {
                        // Clients take turns, apart from daemons.
                        let client = (step % 3) as u8;
                        let r = index.reserve(&name(ns), hash(h), (size, daemon), client_of(client), at(step));
                        let exists = model.contains_key(&(ns, h));
                        prop_assert_eq!(r == Reservation::Exists, exists);
                        if !exists {
                            model.insert((ns, h), Model { daemon, size, visible: false, since: step, client, evicted: false });
                        }
                    }
                    Op::Commit { ns, h, daemon, stored, size } => {
                        let item = CommitItem { hash: hash(h), daemon, size, checksum: 7, stored };
                        let code = index.commit(&name(ns), &item);
                        match model.get(&(ns, h)).copied() {
                            Some(m) if !m.visible && m.daemon == daemon => {
                                prop_assert_eq!(code, ErrorCode::Ok);
                                if stored && !m.evicted {
                                    model.insert((ns, h), Model { daemon, size, visible: true, since: 0, client: 0, evicted: false });
                                } else {
                                    model.remove(&(ns, h));
                                }
                            }
                            // Another writer's reservation stays, and says so.
                            Some(m) if !m.visible => prop_assert_eq!(code, ErrorCode::NoReservation),
                            _ if !stored => prop_assert_eq!(code, ErrorCode::Ok),
                            _ => prop_assert_eq!(code, ErrorCode::NoReservation),
                        }
                    }
                    Op::Report { ns, h, daemon, size } => {
                        index.insert_visible(&BlockKey::new(name(ns), hash(h)), daemon, size, 7);
                        model.insert((ns, h), Model { daemon, size, visible: true, since: 0, client: 0, evicted: false });
                    }
                    Op::Remove { ns, h } => {
                        let got = index.remove(&name(ns), &[hash(h)]);
                        let want = model.get(&(ns, h)).filter(|m| m.visible).map(|m| m.daemon);
                        prop_assert_eq!(got, vec![want]);
                        if want.is_some() {
                            model.remove(&(ns, h));
                        }
                    }
                    Op::RemoveAt { ns, h, daemon } => {
                        let removed = index.remove_at(&BlockKey::new(name(ns), hash(h)), daemon);
                        let want = model.get(&(ns, h)).is_some_and(|m| m.daemon == daemon);
                        prop_assert_eq!(removed, want);
                        match model.get_mut(&(ns, h)) {
                            Some(m) if want && !m.visible => m.evicted = true,
                            _ if want => {
                                model.remove(&(ns, h));
                            }
                            _ => {}
                        }
                    }
                    Op::DaemonDied { daemon } => {
                        let gone = index.remove_daemon(daemon);
                        let before = model.len();
                        model.retain(|_, m| m.daemon != daemon);
                        prop_assert_eq!(gone, before - model.len());
                    }
                    Op::Expire { age } => {
                        let deadline = step.saturating_sub(age);
                        let mut got: Vec<(BlockKey, u32)> = index.expire_pending(at(deadline));
                        let mut want: Vec<(BlockKey, u32)> = model
                            .iter()
                            .filter(|(_, m)| !m.visible && m.since < deadline)
                            .map(|((ns, h), m)| (BlockKey::new(name(*ns), hash(*h)), m.daemon))
                            .collect();
                        got.sort_by_key(|(k, d)| (k.to_string(), *d));
                        want.sort_by_key(|(k, d)| (k.to_string(), *d));
                        prop_assert_eq!(got, want);
                        model.retain(|_, m| m.visible || m.since >= deadline);
                    }
                    Op::Sweep => {
                        index.sweep_namespaces();
                        let used: std::collections::HashSet<u8> = model.keys().map(|(ns, _)| *ns).collect();
                        prop_assert_eq!(index.namespaces(), used.len(), "exactly the namespaces in use stay");
                    }
                }
                // Every key, and a chain per namespace, read as the model says.
                for ns in 0..3u8 {
                    let hashes: Vec<BlockHash> = (0..12).map(hash).collect();
                    let want: Vec<Option<(u32, u32)>> = (0..12u8)
                        .map(|h| model.get(&(ns, h)).filter(|m| m.visible).map(|m| (m.daemon, m.size)))
                        .collect();
                    let got: Vec<Option<(u32, u32)>> = index
                        .lookup(&name(ns), &hashes)
                        .into_iter()
                        .map(|l| l.map(|l| (l.daemon, l.size)))
                        .collect();
                    prop_assert_eq!(&got, &want);
                    let prefix = want.iter().take_while(|w| w.is_some()).count();
                    prop_assert_eq!(index.match_prefix(&name(ns), &hashes).len(), prefix);
                }
                let st = index.stats();
                prop_assert_eq!(st.visible as usize, model.values().filter(|m| m.visible).count());
                prop_assert_eq!(st.pending as usize, model.values().filter(|m| !m.visible).count());
                for c in 0..3u8 {
                    let want = model.values().filter(|m| !m.visible && m.client == c).count();
                    prop_assert_eq!(index.pending_of(client_of(c)) as usize, want, "client {}'s reservations", c);
                }
                prop_assert_eq!(
                    st.bytes,
                    model.values().filter(|m| m.visible).map(|m| m.size as u64).sum::<u64>()
                );
            }
        }
    }
}
