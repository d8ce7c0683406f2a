//! Same-host readers: the pool's block index published in its own memfd
//! (`mooncake_proto::shm_index`), which clients map read-only to find a
//! block and copy it straight out of the shared pool.

use super::*;

/// The pool's block index, in its own memfd, mapped read-only by same-host
/// clients (see `mooncake_proto::shm_index`). Written under the pool's
/// lock, so there is one writer at a time.
pub(super) struct SharedIndex {
    pub(super) region: Region,
    pub(super) table: IndexTable,
    /// Ready blocks left out because their bucket was full (readers lease
    /// those).
    pub(super) unindexed: AtomicU64,
}

impl SharedIndex {
    pub(super) fn new(pool_bytes: u64) -> std::io::Result<SharedIndex> {
        let buckets = shm_index::buckets_for(pool_bytes);
        let region = Region::shared(shm_index::bytes_for(buckets), false, true)?;
        // SAFETY: a fresh page-aligned mapping of the right size that lives
        // as long as the table (both are fields of this struct, and the
        // table is only used through it).
        let table = unsafe { IndexTable::init(region.ptr(), buckets) };
        Ok(SharedIndex {
            region,
            table,
            unindexed: AtomicU64::new(0),
        })
    }

    pub(super) fn publish(&self, key: &BlockKey, entry: Entry) {
        if !self.table.publish(Digest::of(key), entry) {
            self.unindexed.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn withdraw(&self, key: &BlockKey) {
        self.table.withdraw(Digest::of(key));
    }
}

impl DramPool {
    /// The memfd and size of a shared pool (`PoolConfig::shared`).
    pub fn shared_region(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        self.region.fd().map(|fd| (fd, self.region.len() as u64))
    }

    /// The memfd and size of a shared pool's block index.
    pub fn shared_index(&self) -> Option<(std::os::fd::BorrowedFd<'_>, u64)> {
        let index = self.index.as_ref()?;
        let fd = index.region.fd()?;
        Some((fd, index.region.len() as u64))
    }

    /// Ready blocks the shared index had no room for since start.
    pub fn unindexed_blocks(&self) -> u64 {
        self.index
            .as_ref()
            .map_or(0, |i| i.unindexed.load(Ordering::Relaxed))
    }

    pub(super) fn unpublish(&self, key: &BlockKey) {
        if let Some(index) = &self.index {
            index.withdraw(key);
        }
    }
}
