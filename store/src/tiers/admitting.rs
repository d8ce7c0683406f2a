//! Blocks being admitted: written into room by a same-host client and
//! made visible at the meta service by this daemon (`crate::admit`) before
//! they go into the pool. A removal that comes in between finds nothing
//! in the pool to take: it is noted here instead, and the block is dropped
//! rather than stored, so a removed block never comes back.

use mooncake_proto::BlockKey;

use super::Tiers;

impl Tiers {
    /// Notes that `key` is being admitted; `false` where a tier holds it
    /// already, or it is being admitted by another writer (then it is not
    /// admitted by this one).
    pub fn start_admitting(&self, key: &BlockKey) -> bool {
        if self.contains(key) || self.dram.is_demoting(key) {
            return false;
        }
        let mut admitting = self.admitting.lock();
        if admitting.contains_key(key) {
            return false;
        }
        admitting.insert(key.clone(), false);
        true
    }

    /// `key` was admitted: `store` puts it in the pool, unless a removal
    /// came for it meanwhile (`None`: then it must not be stored). Under
    /// the lock removals take, so none comes between the check and the
    /// store.
    pub fn admitted<R>(&self, key: &BlockKey, store: impl FnOnce() -> R) -> Option<R> {
        let _below = self.below.read();
        let removed = self.admitting.lock().remove(key).unwrap_or(false);
        (!removed).then(store)
    }

    /// `key` was not admitted: its mark goes.
    pub fn not_admitted(&self, key: &BlockKey) {
        self.admitting.lock().remove(key);
    }

    /// Whether `key` is being admitted.
    pub(super) fn is_admitting(&self, key: &BlockKey) -> bool {
        self.admitting.lock().contains_key(key)
    }

    /// A removal of `key`: noted if it is being admitted.
    pub(super) fn removed_while_admitted(&self, key: &BlockKey) {
        if let Some(removed) = self.admitting.lock().get_mut(key) {
            *removed = true;
        }
    }
}
