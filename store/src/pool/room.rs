//! Room reserved before the block that fills it is named. A same-host
//! writer holds a few rooms of its blocks' size and writes each block
//! straight into one, then names it (`fill_room`): one message to the
//! daemon per put (`ShmStore`) instead of a reservation and a commit.
//!
//! Rooms count as puts in progress (used, and not evictable), under a cap
//! of their own: together they hold at most `ROOM_SHARE` of the room puts
//! in progress may hold, and never keep a put from starting.

use super::*;

/// The share of the pool's room for puts in progress (`PENDING_SHARE`)
/// that rooms held ahead may take, beyond it.
pub const ROOM_SHARE: f64 = 0.5;

/// Room for one block of up to `len` bytes, not yet named. Dropped
/// unfilled, its space is freed.
pub struct Room {
    pool: Arc<DramPool>,
    pub(super) alloc: Allocation,
    len: u64,
    filled: bool,
}

impl Room {
    /// Where the block's bytes go in the pool's region.
    pub fn byte_offset(&self) -> u64 {
        self.alloc.offset as u64 * UNIT
    }

    /// The most bytes the block may have.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The room's bytes, as a writer on this host fills them.
    #[cfg(test)]
    pub fn buf_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocator gave this range to this room alone.
        unsafe {
            self.pool
                .region
                .slice_mut(self.byte_offset() as usize, self.len as usize)
        }
    }
}

impl DramPool {
    /// Reserves room for a block of up to `len` bytes to be named later
    /// (`fill_room`), evicting as a put would. `Busy` past the rooms' cap.
    pub fn reserve_room(self: &Arc<Self>, len: u64) -> Result<Room, PoolError> {
        if len > self.cfg.max_block {
            return Err(PoolError::TooLarge(len));
        }
        let units = len.div_ceil(UNIT).max(1) as u32;
        let mut inner = self.inner.lock();
        let cap = (self.pending_cap() as f64 * ROOM_SHARE) as u64;
        if inner.room_units + u64::from(units) > cap {
            return Err(PoolError::Busy);
        }
        self.below_high_watermark(&mut inner, units);
        let alloc = self.allocate(&mut inner, units)?;
        inner.room_units += inner.alloc.allocation_size(alloc) as u64;
        Ok(Room {
            pool: self.clone(),
            alloc,
            len,
            filled: false,
        })
    }

    /// Names the block of `len` bytes written into `room` (`checksum`: its
    /// writer's, as in `reserve_for`), which is then committed as a slot
    /// `reserve_for` gave would be. Refused as `reserve_for` refuses (the
    /// bytes already held, the key being written, its tenant out of room),
    /// and then the room comes back unfilled.
    pub fn fill_room(
        self: &Arc<Self>,
        mut room: Room,
        key: BlockKey,
        len: u64,
        checksum: Option<u64>,
    ) -> Result<WriteSlot, (PoolError, Room)> {
        if len > room.len {
            return Err((PoolError::TooLarge(len), room));
        }
        let mut inner = self.inner.lock();
        if let Err(err) = self.replace_held(&mut inner, &key, len, checksum) {
            return Err((err, room));
        }
        let size = inner.alloc.allocation_size(room.alloc) as u64;
        let tenant = self.cfg.quotas.tenant_of(&key.namespace);
        if let Some(t) = tenant {
            if let Err(err) = self.tenant_room(&mut inner, t, size) {
                return Err((err, room));
            }
            inner.tenant_used[t as usize] += size;
            inner.tenant_pending[t as usize] += size;
        }
        inner.room_units -= size;
        inner.blocks.insert(
            key.clone(),
            Block::reserved(room.alloc, tenant, len, checksum),
        );
        room.filled = true;
        Ok(WriteSlot::new(self, key, room.alloc, len, checksum))
    }

    /// Bytes held in rooms not yet filled.
    pub fn room_bytes(&self) -> u64 {
        self.inner.lock().room_units * UNIT
    }

    /// Whether sessions serve rooms' requests (`ShmRoom`, `ShmStore`):
    /// always, unless a test has this daemon act as one older than rooms.
    pub fn serves_rooms(&self) -> bool {
        !self.rooms_refused.load(Ordering::Relaxed)
    }

    /// Has this daemon's sessions answer rooms' requests as a daemon
    /// older than rooms does (`UnknownOpcode`, and the session ends), to
    /// test what its clients then do. Only for fault-injection tests.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn refuse_rooms_for_test(&self) {
        self.rooms_refused.store(true, Ordering::Relaxed);
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if self.filled {
            return;
        }
        let mut inner = self.pool.inner.lock();
        inner.room_units -= inner.alloc.allocation_size(self.alloc) as u64;
        DramPool::written(&mut inner, self.alloc, None);
        DramPool::free(&mut inner, self.alloc, None);
    }
}
