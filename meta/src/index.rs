//! The global block index, sharded by key hash so that lookups from many
//! connections do not contend (and so that it can later be split across
//! leaders, one shard range each).
//!
//! An entry is `Pending` from a put's first phase until its commit, and
//! only `Visible` entries are ever returned: visible means complete.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

#[cfg(test)]
use mooncake_proto::message::MAX_COPIES;
use mooncake_proto::message::{
    CommitItem, Copies, EngineHash, EngineTag, ListEntry, Location, Tier,
};
use mooncake_proto::{BlockHash, BlockKey, ErrorCode, Namespace};
use parking_lot::RwLockReadGuard;

use crate::clients::{Client, PendingByClient};
use crate::events::{Events, Named};
use crate::table::TableKey;
use names::{NameTable, Names, NsId};
use shard::Shard;

const SHARDS: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
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
/// the reserving client only while it is being stored (an entry stays 48
/// bytes). `want`: the copies its writer asked for, which a lost copy is
/// made again up to.
#[derive(Clone, Copy)]
enum State {
    /// `evicted`: a daemon it was placed on evicted the block before the
    /// put committed (a pool of 2Q lets a long new chain pass through its
    /// probation while it is still being written); that daemon has left
    /// the entry's copies.
    Pending {
        since: Instant,
        client: Client,
        evicted: bool,
        want: u8,
    },
    Visible {
        checksum: u64,
        want: u8,
    },
}

/// A block: the daemons holding its copies (while pending: those it is
/// being written to), its size and phase.
#[derive(Clone, Copy)]
struct Entry {
    copies: Copies,
    size: u32,
    state: State,
}

impl Entry {
    fn visible(&self) -> Option<Location> {
        match self.state {
            State::Visible { checksum, .. } => Some(Location {
                daemons: self.copies,
                size: self.size,
                checksum,
            }),
            State::Pending { .. } => None,
        }
    }

    fn is_pending(&self) -> bool {
        matches!(self.state, State::Pending { .. })
    }

    fn want(&self) -> u8 {
        match self.state {
            State::Pending { want, .. } | State::Visible { want, .. } => want,
        }
    }

    fn set_want(&mut self, to: u8) {
        match &mut self.state {
            State::Pending { want, .. } | State::Visible { want, .. } => *want = to,
        }
    }

    /// Visible with fewer copies than its writer asked for.
    fn is_short(&self) -> bool {
        !self.is_pending()
            && !self.copies.is_empty()
            && self.copies.len() < usize::from(self.want())
    }

    /// Takes `daemon`'s copy out (it evicted the block, or died): a pending
    /// entry remembers that one of its copies went.
    fn lose(&mut self, daemon: u32) -> bool {
        if !self.copies.remove(daemon) {
            return false;
        }
        if let State::Pending { evicted, .. } = &mut self.state {
            *evicted = true;
        }
        true
    }
}

/// What a daemon's leaving cost the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gone {
    /// Copies it held (visible or being written).
    pub copies: usize,
    /// Blocks whose last copy it held: gone from the index.
    pub blocks: usize,
    /// Blocks left with fewer copies than their writers asked for.
    pub short: Vec<BlockKey>,
}

/// Keys of a prefix match whose slots are prefetched ahead of the probe.
const PREFETCH_AHEAD: usize = 8;

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
    pub copies: u64,
    pub bytes: u64,
    pub pending: u64,
}

pub struct Index {
    shards: Vec<Shard>,
    namespaces: Names,
    pending_by_client: PendingByClient,
    /// Told of every block that becomes visible or leaves, under the lock
    /// of its entry (so that one key's changes queue in order).
    events: Events,
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
            events: Events::default(),
        }
    }
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index that tells `events` of its changes.
    pub fn with_events(events: Events) -> Self {
        Index {
            events,
            ..Self::default()
        }
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

    /// Phase one: reserves a key on daemons (one per copy; `want` were
    /// asked for) for `client` unless it is already stored or being stored.
    pub fn reserve(
        &self,
        ns: &Namespace,
        hash: BlockHash,
        (size, copies, want): (u32, Copies, u8),
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
                copies,
                size,
                state: State::Pending {
                    since: now,
                    client,
                    evicted: false,
                    want,
                },
            },
        );
        shard.reservations.lock().push_back((key, now));
        Reservation::Reserved
    }

    /// Adds a block a daemon reports holding (index rebuild): one more
    /// copy of a visible entry with the same bytes (size and checksum).
    /// Otherwise the report wins over the existing entry: the reporting
    /// daemon holds complete, verified bytes now, while the entry may point
    /// at a daemon that is gone (a restart at a new address) and about to
    /// be dropped.
    pub fn insert_visible(
        &self,
        block: &BlockKey,
        at: (u32, Tier),
        bytes: (u32, u64),
        parent: Option<BlockHash>,
    ) {
        self.insert_reported(block, at, bytes, (parent, None));
    }

    /// `insert_visible`, with the engine's tag the daemon kept with the
    /// block (a copy reported without one keeps the tag known for the same
    /// bytes).
    pub fn insert_reported(
        &self,
        block: &BlockKey,
        (daemon, tier): (u32, Tier),
        (size, checksum): (u32, u64),
        (parent, tag): (Option<BlockHash>, Option<Arc<EngineTag>>),
    ) {
        let tag = self.events.kept(tag);
        let key = IdxKey {
            ns: self.namespaces.acquire(&block.namespace),
            hash: block.hash,
        };
        let mut shard = self.shard(&key).write(self);
        let old = shard.get(&key).and_then(Entry::visible);
        let same = old.filter(|o| o.size == size && o.checksum == checksum);
        let want = shard
            .get(&key)
            .filter(|_| same.is_some())
            .map_or(1, Entry::want);
        let (ns, hash) = (&block.namespace, block.hash);
        // The same bytes keep the parent and tag known for them (a
        // daemon's inventory carries no tag, and its parent may be none).
        let named = match same {
            Some(_) => {
                let known = shard.named(&key);
                let parent = parent.or(known.parent);
                Named {
                    parent_hash: self.engine_hash(key.ns, parent),
                    parent,
                    tag: tag.or(known.tag),
                }
            }
            None => Named {
                parent,
                parent_hash: self.engine_hash(key.ns, parent),
                tag,
            },
        };
        let copies = match same {
            Some(o) if o.daemons.is_full() && !o.daemons.contains(daemon) => o.daemons,
            Some(o) => {
                let mut copies = o.daemons;
                if copies.push(daemon) {
                    self.events.stored((daemon, Tier::Dram), ns, hash, &named);
                }
                if let Some(was) = copies.set_tier(daemon, tier) {
                    self.events.moved(daemon, (was, tier), ns, hash, &named);
                }
                copies
            }
            None => {
                let before = shard.named(&key);
                for d in old.iter().flat_map(|o| o.daemons.with_tiers()) {
                    self.events.removed(d, ns, hash, &before);
                }
                self.events.stored((daemon, tier), ns, hash, &named);
                let mut copies = Copies::one(daemon);
                copies.set_tier(daemon, tier);
                copies
            }
        };
        let replaced = shard.insert(
            key,
            Entry {
                copies,
                size,
                // Copies reported after a failover are kept as wanted.
                state: State::Visible {
                    checksum,
                    want: want.max(copies.len() as u8),
                },
            },
        );
        shard.set_named(key, &named);
        drop(shard);
        if replaced.is_some() {
            // The entry it replaced already held the namespace's reference.
            self.namespaces.release(key.ns);
        }
    }

    /// Gives up a reservation just made: its put does not go ahead.
    pub fn release(&self, namespace: &Namespace, hash: BlockHash) {
        let nothing = CommitItem {
            hash,
            stored_on: Copies::default(),
            size: 0,
            checksum: 0,
            parent: None,
            tag: None,
        };
        self.commit(namespace, &nothing);
    }

    /// Phase two: makes a stored block visible on the daemons that stored
    /// it, or drops the reservation of one that was not stored. A commit
    /// naming none of the daemons the block was placed on is another
    /// writer's (unless its copies were evicted meanwhile).
    pub fn commit(&self, namespace: &Namespace, item: &CommitItem) -> ErrorCode {
        let names = self.names();
        let Some(&ns) = names.ids.get(namespace) else {
            // Nothing was ever reserved in this namespace: dropping a
            // reservation is done, making one visible is not possible.
            return if item.stored() {
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
        let Some(e) = shard.get(&key).copied().filter(Entry::is_pending) else {
            // Nothing of this writer's is left to release.
            return if item.stored() {
                ErrorCode::NoReservation
            } else {
                ErrorCode::Ok
            };
        };
        let evicted = matches!(e.state, State::Pending { evicted: true, .. });
        let copies: Copies = item
            .stored_on
            .iter()
            .filter(|d| e.copies.contains(*d))
            .collect();
        if item.stored() && copies.is_empty() && !evicted {
            // Another writer's reservation: neither released nor "done".
            return ErrorCode::NoReservation;
        }
        if copies.is_empty() {
            // Not stored, or stored and evicted everywhere since (as any
            // block may be): done, and not visible.
            shard.remove(&key);
        } else {
            let visible = Entry {
                copies,
                size: item.size,
                state: State::Visible {
                    checksum: item.checksum,
                    want: e.want(),
                },
            };
            shard.insert(key, visible);
            if self.events.is_on() {
                let named = Named {
                    parent: item.parent,
                    tag: self.events.kept(item.tag.clone()),
                    parent_hash: self.engine_hash(ns, item.parent),
                };
                shard.set_named(key, &named);
                for d in copies.with_tiers() {
                    self.events.stored(d, namespace, item.hash, &named);
                }
            }
        }
        ErrorCode::Ok
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
    pub fn remove(&self, namespace: &Namespace, hashes: &[BlockHash]) -> Vec<Option<Copies>> {
        let names = self.names();
        let Some(&ns) = names.ids.get(namespace) else {
            return vec![None; hashes.len()];
        };
        hashes
            .iter()
            .map(|hash| {
                let key = IdxKey { ns, hash: *hash };
                let mut shard = self.shard(&key).write(self);
                match shard.get(&key) {
                    Some(e) if !e.is_pending() => {
                        let copies = e.copies;
                        let named = shard.named(&key);
                        shard.remove(&key);
                        for d in copies.with_tiers() {
                            self.events.removed(d, namespace, *hash, &named);
                        }
                        Some(copies)
                    }
                    _ => None,
                }
            })
            .collect()
    }

    /// Drops `daemon`'s copy of a key: a daemon's report that it evicted a
    /// block must not remove a copy elsewhere. The key goes with its last
    /// copy. A put of it not committed yet stays reserved, marked evicted:
    /// its commit then succeeds (the block was stored, and evicted as any
    /// block may be) without making that copy visible.
    pub fn remove_at(&self, block: &BlockKey, daemon: u32) -> bool {
        let names = self.names();
        let Some(key) = names.key_of(block) else {
            return false;
        };
        let mut shard = self.shard(&key).write(self);
        let Some(mut e) = shard.get(&key).copied() else {
            return false;
        };
        let tier = e.copies.tier_of(daemon);
        if !e.lose(daemon) {
            return false;
        }
        if let (false, Some(tier)) = (e.is_pending(), tier) {
            let named = shard.named(&key);
            self.events
                .removed((daemon, tier), &block.namespace, block.hash, &named);
        }
        if e.copies.is_empty() && !e.is_pending() {
            shard.remove(&key);
        } else {
            shard.insert(key, e);
        }
        true
    }

    /// Drops a dead daemon's copies; entries left with none go (a put
    /// being written only there too). The blocks left short of the copies
    /// they want are in `gone.short`.
    pub fn remove_daemon(&self, daemon: u32) -> Gone {
        let mut gone = Gone::default();
        for s in &self.shards {
            // The names per shard: a writer of a new namespace waits for
            // one shard, not the whole scan.
            let names = self.names();
            let mut shard = s.write(self);
            let before = shard.len();
            shard.retain(|k, e, named| {
                let tier = e.copies.tier_of(daemon).unwrap_or_default();
                if !e.lose(daemon) {
                    return true;
                }
                gone.copies += 1;
                if !e.is_pending() {
                    s.copies.fetch_sub(1, Ordering::Relaxed);
                    self.events
                        .removed((daemon, tier), names.name(k.ns), k.hash, named);
                }
                if e.is_short() {
                    gone.short
                        .push(BlockKey::new(names.name(k.ns).clone(), k.hash));
                }
                !e.copies.is_empty()
            });
            gone.blocks += before - shard.len();
        }
        gone
    }

    /// The visible blocks of shard `i` (daemon, namespace, hash), for a
    /// resync of the events; `None` past the last shard.
    pub fn visible_in_shard(&self, i: usize) -> Option<Vec<crate::events::Held>> {
        let shard = self.shards.get(i)?;
        let names = self.names();
        let table = shard.read();
        let kept = shard.named.lock();
        Some(
            table
                .iter()
                .filter(|(_, e)| !e.is_pending())
                .flat_map(|(k, e)| {
                    let name = names.name(k.ns);
                    let named = kept.get(k).cloned().unwrap_or_default();
                    e.copies
                        .with_tiers()
                        .map(move |d| (d, name.clone(), k.hash, named.clone()))
                })
                .collect(),
        )
    }

    /// What the engine calls the block `hash` of namespace `ns`, if it is
    /// visible with a tag that names it (events on): events name a
    /// block's parent as they named the parent.
    fn engine_hash(&self, ns: NsId, hash: Option<BlockHash>) -> Option<EngineHash> {
        let key = IdxKey { ns, hash: hash? };
        if !self.events.is_on() {
            return None;
        }
        let kept = self.shard(&key).named.lock();
        kept.get(&key)?.tag.as_ref()?.hash.clone()
    }

    /// How many parents and tags are kept (for tests of their bound).
    #[cfg(test)]
    pub(crate) fn parents_kept(&self) -> usize {
        self.shards.iter().map(|s| s.named.lock().len()).sum()
    }

    /// Drops reservations older than `deadline`; returns them, so that their
    /// daemons can free whatever bytes arrived. Visits only the reservations
    /// made before `deadline` (an entry reserved again since, or committed,
    /// is left alone).
    pub fn expire_pending(&self, deadline: Instant) -> Vec<(BlockKey, Copies)> {
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
                    expired.push((key, entry.copies));
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
                    || filter.daemon.is_some_and(|d| !e.copies.contains(d))
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
            st.copies += s.copies.load(Ordering::Relaxed);
            st.bytes += s.bytes.load(Ordering::Relaxed);
            st.pending += s.pending.load(Ordering::Relaxed);
        }
        st
    }
}

mod copies;
mod names;
mod shard;
#[cfg(test)]
pub(crate) use copies::none_leaving;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;
