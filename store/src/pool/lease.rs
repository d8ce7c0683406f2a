//! Access to a block's bytes: a [`WriteSlot`] to write a new block (it
//! becomes visible only once its checksum verifies) and a [`ReadLease`]
//! that keeps a block's bytes in place while they are read.

use super::*;

/// Exclusive room for one block's bytes. Dropped without `commit` (the
/// writer vanished mid-transfer), it frees its space at once.
pub struct WriteSlot {
    pub(super) pool: Arc<DramPool>,
    pub(super) key: BlockKey,
    /// The block this one extends, as its writer said (see `Lru`).
    pub(super) parent: Option<mooncake_proto::BlockHash>,
    pub(super) offset: u64,
    pub(super) len: usize,
    /// The writer's checksum, where it said it before writing.
    pub(super) checksum: Option<u64>,
    /// The meta service judged that it continues a branch readers come
    /// back to (`set_continues`).
    pub(super) continues: bool,
    pub(super) committed: bool,
}

impl WriteSlot {
    /// The slot of a block just reserved at `alloc`.
    pub(super) fn new(
        pool: &Arc<DramPool>,
        key: BlockKey,
        alloc: Allocation,
        len: u64,
        checksum: Option<u64>,
    ) -> WriteSlot {
        WriteSlot {
            pool: pool.clone(),
            parent: None,
            key,
            offset: alloc.offset as u64 * UNIT,
            len: len as usize,
            checksum,
            continues: false,
            committed: false,
        }
    }

    /// Where the block's bytes go in the pool's region.
    pub fn byte_offset(&self) -> u64 {
        self.offset
    }

    pub fn key(&self) -> &BlockKey {
        &self.key
    }

    /// The block's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Names the block whose prefix this one extends (same namespace).
    pub fn set_parent(&mut self, parent: Option<mooncake_proto::BlockHash>) {
        self.parent = parent;
    }

    /// The block it extends, if named.
    pub fn parent(&self) -> Option<mooncake_proto::BlockHash> {
        self.parent
    }

    /// The meta service judged that this block continues a branch readers
    /// come back to (`meta/src/branches.rs`): under 2Q it enters main if
    /// this pool does not hold its parent to judge by.
    pub fn set_continues(&mut self, continues: bool) {
        self.continues = continues;
    }

    pub fn buf_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocator gave this range to this slot alone; no
        // lease exists until the block is committed.
        unsafe { self.pool.region.slice_mut(self.offset as usize, self.len) }
    }

    /// Verifies the bytes against the writer's checksum and makes the block
    /// visible; on a mismatch the space is freed.
    pub fn commit(mut self) -> Result<(), PoolError> {
        let sum = checksum(self.buf_mut());
        self.commit_hashed(sum)
    }

    /// `commit`, for a writer that already hashed the bytes in this slot
    /// as they landed (`sum` must be the checksum of `buf_mut()`): this
    /// daemon as a value arrived, or a same-host client that wrote them
    /// into the shared pool itself. Checked against the checksum given at
    /// reservation, if one was; kept as the block's checksum.
    pub fn commit_hashed(mut self, sum: u64) -> Result<(), PoolError> {
        if self.checksum.is_some_and(|said| said != sum) {
            return Err(PoolError::ChecksumMismatch);
        }
        self.checksum = Some(sum);
        let mut inner = self.pool.inner.lock();
        let inner = &mut *inner;
        inner.clock += 1;
        let admission = self
            .pool
            .admit(inner, &self.key, self.parent, self.continues);
        let queue = admission.queue;
        let block = inner
            .blocks
            .get_mut(&self.key)
            .expect("a reserved block stays indexed until committed or dropped");
        block.ready = true;
        block.checksum = sum;
        block.stamp = inner.clock;
        block.parent = self.parent;
        block.queue = queue;
        block.continues = admission.continues;
        block.fingerprint = admission.fingerprint;
        let (tenant, alloc) = (block.tenant, block.alloc);
        if queue == Queue::Probation {
            inner.probation_units += inner.alloc.allocation_size(alloc) as u64;
        }
        DramPool::written(inner, alloc, tenant);
        if let Some(parent) = self.parent {
            DramPool::add_child(inner, &self.key, parent, admission.parent_stamp);
        }
        DramPool::lru_insert(inner, inner.clock, &self.key, tenant, queue);
        if let Some(index) = &self.pool.index {
            let entry = Entry {
                offset: self.offset,
                len: self.len as u64,
                checksum: sum,
            };
            index.publish(&self.key, entry);
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for WriteSlot {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut inner = self.pool.inner.lock();
        let block = inner.blocks.remove(&self.key).expect("reserved block");
        DramPool::written(&mut inner, block.alloc, block.tenant);
        DramPool::free(&mut inner, block.alloc, block.tenant);
    }
}

/// A reader's hold on a block's bytes.
pub struct ReadLease {
    pub(super) pool: Arc<DramPool>,
    pub(super) key: BlockKey,
    pub(super) offset: u32,
    pub(super) len: usize,
    pub(super) checksum: u64,
}

impl ReadLease {
    /// Where the bytes start in the pool's region.
    pub fn byte_offset(&self) -> u64 {
        self.offset as u64 * UNIT
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: a leased block is neither freed nor rewritten until every
        // lease on it is dropped.
        unsafe {
            self.pool
                .region
                .slice(self.offset as usize * UNIT as usize, self.len)
        }
    }

    pub fn checksum(&self) -> u64 {
        self.checksum
    }

    /// Whether the bytes still match the writer's checksum.
    pub fn verify(&self) -> bool {
        checksum(self.bytes()) == self.checksum
    }
}

impl Drop for ReadLease {
    fn drop(&mut self) {
        self.pool.release(&self.key, self.offset);
    }
}
