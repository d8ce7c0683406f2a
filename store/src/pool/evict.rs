//! What goes when room is needed: the eviction order (prefix-aware LRU)
//! and the eviction of blocks from the pool, to the next tier if there is
//! one.

use super::*;

/// Evictable blocks by last access (a stamp from the pool's clock), and
/// the same per tenant with a quota, so that an over-quota tenant finds its
/// coldest block at once.
///
/// Eviction is prefix-aware: a block's key extends its parent's prefix,
/// and a block whose children are stored is worth more than a chain's tail
/// (a prefix match stops at the first missing block, so a parent evicted
/// before its children strands them). The coldest *tail* (no stored child)
/// goes first; the coldest block of all only when no tail is evictable.
pub(super) struct Lru {
    pub(super) all: BTreeMap<u64, (BlockKey, Option<u16>)>,
    pub(super) by_tenant: Vec<std::collections::BTreeSet<u64>>,
    /// The stamps in `all` of blocks no stored block names as its parent.
    pub(super) tails: std::collections::BTreeSet<u64>,
}

impl Lru {
    pub(super) fn new(tenants: usize) -> Lru {
        Lru {
            all: BTreeMap::new(),
            by_tenant: vec![Default::default(); tenants],
            tails: Default::default(),
        }
    }

    pub(super) fn insert(&mut self, stamp: u64, key: BlockKey, tenant: Option<u16>, tail: bool) {
        if let Some(t) = tenant {
            self.by_tenant[t as usize].insert(stamp);
        }
        if tail {
            self.tails.insert(stamp);
        }
        self.all.insert(stamp, (key, tenant));
    }

    pub(super) fn remove(&mut self, stamp: u64) -> Option<BlockKey> {
        let (key, tenant) = self.all.remove(&stamp)?;
        if let Some(t) = tenant {
            self.by_tenant[t as usize].remove(&stamp);
        }
        self.tails.remove(&stamp);
        Some(key)
    }

    /// Marks an evictable block a tail or not (its first child came, or
    /// its last one went); blocks not in the LRU are left alone.
    pub(super) fn set_tail(&mut self, stamp: u64, tail: bool) {
        if !self.all.contains_key(&stamp) {
            return;
        }
        if tail {
            self.tails.insert(stamp);
        } else {
            self.tails.remove(&stamp);
        }
    }

    /// The next block to evict: the coldest tail, else the coldest block.
    pub(super) fn pop_first(&mut self) -> Option<(u64, BlockKey)> {
        let stamp = match self.tails.first() {
            Some(s) => *s,
            None => *self.all.keys().next()?,
        };
        self.remove(stamp).map(|k| (stamp, k))
    }

    pub(super) fn coldest_of(&self, tenant: u16) -> Option<u64> {
        self.by_tenant[tenant as usize].first().copied()
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (&u64, &BlockKey)> {
        self.all.iter().map(|(s, (k, _))| (s, k))
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.all.len()
    }
}

impl DramPool {
    pub(super) fn evict_one(&self, inner: &mut Inner) -> bool {
        let Some((_, key)) = inner.lru.pop_first() else {
            return false;
        };
        self.evict(inner, key);
        true
    }

    /// Evicts the coldest evictable block of tenant `t`; `false` if none
    /// is found among the coldest `MAX_QUOTA_SCAN`.
    pub(super) fn evict_tenant_one(&self, inner: &mut Inner, t: u16) -> bool {
        let Some(key) = inner.lru.coldest_of(t).and_then(|s| inner.lru.remove(s)) else {
            return false;
        };
        self.quota_evictions.fetch_add(1, Ordering::Relaxed);
        self.evict(inner, key);
        true
    }

    /// Puts an evictable block on the LRU, as a tail if no stored block
    /// names it as parent.
    pub(super) fn lru_insert(inner: &mut Inner, stamp: u64, key: &BlockKey, tenant: Option<u16>) {
        let tail = !inner.children.contains_key(key);
        inner.lru.insert(stamp, key.clone(), tenant, tail);
    }

    /// A stored block naming `parent` arrived: the parent is no tail now.
    pub(super) fn add_child(inner: &mut Inner, key: &BlockKey, parent: mooncake_proto::BlockHash) {
        let parent = BlockKey::new(key.namespace.clone(), parent);
        let count = inner.children.entry(parent.clone()).or_insert(0);
        *count += 1;
        if *count == 1 {
            if let Some(p) = inner.blocks.get(&parent) {
                inner.lru.set_tail(p.stamp, false);
            }
        }
    }

    /// A stored block naming `parent` left: the parent may be a tail again.
    pub(super) fn remove_child(
        inner: &mut Inner,
        key: &BlockKey,
        parent: mooncake_proto::BlockHash,
    ) {
        let parent = BlockKey::new(key.namespace.clone(), parent);
        let Some(count) = inner.children.get_mut(&parent) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            inner.children.remove(&parent);
            if let Some(p) = inner.blocks.get(&parent) {
                inner.lru.set_tail(p.stamp, true);
            }
        }
    }

    /// Evicts a block already taken off the LRU.
    pub(super) fn evict(&self, inner: &mut Inner, key: BlockKey) {
        let block = inner.blocks.remove(&key).expect("lru entries are indexed");
        debug_assert!(block.evictable());
        self.unpublish(&key);
        if let Some(parent) = block.parent {
            Self::remove_child(inner, &key, parent);
        }
        // Demotion: the bytes leave for the next tier before the space is
        // freed. A full demotion queue drops the block (a miss later).
        let mut kept = false;
        let budget_left =
            self.demote_queued.load(Ordering::Relaxed) + block.len as u64 <= DEMOTION_BYTES_MAX;
        if let Some(next) = self.demote.get().filter(|_| budget_left) {
            let offset = block.alloc.offset as usize * UNIT as usize;
            // SAFETY: an evictable block has no lease and no writer.
            let bytes = unsafe { self.region.slice(offset, block.len as usize) }.to_vec();
            let demoted = Demoted {
                key: key.clone(),
                bytes,
                checksum: block.checksum,
                parent: block.parent,
            };
            kept = next.try_send(demoted).is_ok();
            if kept {
                self.demotions.fetch_add(1, Ordering::Relaxed);
                self.demote_queued
                    .fetch_add(block.len as u64, Ordering::Relaxed);
            }
        }
        let overflowed = !kept && self.demote.get().is_some();
        Self::free(inner, block.alloc, block.tenant);
        self.evictions.fetch_add(1, Ordering::Relaxed);
        if overflowed {
            let mut overflow = self.overflow.lock();
            if overflow.len() < MAX_PENDING_REMOVALS {
                overflow.push(key);
            }
        } else if !kept {
            self.report_removed(key);
        }
    }

    /// Whether storing `extra` more bytes would start an eviction.
    pub fn would_evict(&self, extra: u64) -> bool {
        let inner = self.inner.lock();
        let capacity_units = self.region.len() as u64 / UNIT;
        let high = (capacity_units as f64 * self.cfg.high_watermark) as u64;
        inner.used_units + extra.div_ceil(UNIT) > high
    }

    /// Evicts the coldest evictable blocks until `bytes` are freed (or none
    /// is left); returns the bytes and blocks freed.
    pub fn evict_bytes(&self, bytes: u64) -> (u64, u64) {
        let mut inner = self.inner.lock();
        let start = inner.used_units;
        let mut blocks = 0;
        while (start - inner.used_units) * UNIT < bytes && self.evict_one(&mut inner) {
            blocks += 1;
        }
        ((start - inner.used_units) * UNIT, blocks)
    }
}
