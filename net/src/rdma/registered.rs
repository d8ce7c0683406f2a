//! Caller memory registered with the NIC once (`Client::register_memory`),
//! so that blocks read into it, or written from it, move by RDMA straight
//! between the daemon's pool and that memory: no staging, no copy on the
//! client (a get only hashes the bytes where they landed).

use std::sync::Arc;

use super::nic::{MemoryRegion, Nic};

struct Entry {
    start: usize,
    len: usize,
    mr: Arc<MemoryRegion>,
}

/// The registered ranges of this client.
#[derive(Default)]
pub struct Registered {
    entries: parking_lot::RwLock<Vec<Entry>>,
}

impl Registered {
    /// Registers `len` bytes at `ptr` (replacing a registration at the
    /// same address).
    ///
    /// # Safety
    ///
    /// The bytes must stay allocated until `remove(ptr)`, and until every
    /// call using them has returned.
    pub unsafe fn add(&self, nic: &Nic, ptr: *mut u8, len: usize) -> Result<(), String> {
        // SAFETY: the caller's promise above.
        let mr = unsafe { nic.register(ptr, len, false) }?;
        let mut entries = self.entries.write();
        entries.retain(|e| e.start != ptr as usize);
        entries.push(Entry {
            start: ptr as usize,
            len,
            mr,
        });
        Ok(())
    }

    /// Ends the registration at `ptr`; false if there was none. Calls in
    /// flight keep the region until they finish.
    pub fn remove(&self, ptr: *const u8) -> bool {
        let mut entries = self.entries.write();
        let before = entries.len();
        entries.retain(|e| e.start != ptr as usize);
        entries.len() != before
    }

    /// The region holding all of `bytes`, if one does.
    pub fn find(&self, bytes: &[u8]) -> Option<Arc<MemoryRegion>> {
        let (start, end) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        self.entries
            .read()
            .iter()
            .find(|e| e.start <= start && end <= e.start + e.len)
            .map(|e| e.mr.clone())
    }
}
