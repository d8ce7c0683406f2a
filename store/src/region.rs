//! The DRAM pool's memory: one anonymous mapping made at start, backed by
//! huge pages when the host has them reserved, else by transparent huge
//! pages where the kernel allows.

use std::io;
use std::ptr::NonNull;

pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    hugepages: bool,
}

// SAFETY: the region is plain memory; who may touch which bytes when is
// decided by the pool's allocator and leases, not by the region.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Maps `len` bytes. Tries explicit huge pages first when asked, then
    /// falls back to normal pages with a transparent-huge-page hint.
    pub fn new(len: usize, hugepages: bool, prefault: bool) -> io::Result<Region> {
        let populate = if prefault { libc::MAP_POPULATE } else { 0 };
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | populate;
        if hugepages {
            // Without MAP_NORESERVE the kernel refuses the mapping unless the
            // huge pages are reserved, instead of a SIGBUS on first touch.
            let huge_len = len.next_multiple_of(2 << 20);
            if let Some(ptr) = map(huge_len, flags | libc::MAP_HUGETLB) {
                return Ok(Region {
                    ptr,
                    len: huge_len,
                    hugepages: true,
                });
            }
        }
        let ptr = map(len, flags | libc::MAP_NORESERVE).ok_or_else(io::Error::last_os_error)?;
        if hugepages {
            // SAFETY: advising a mapping we own; failure is harmless.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        Ok(Region {
            ptr,
            len,
            hugepages: false,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn uses_hugepages(&self) -> bool {
        self.hugepages
    }

    /// # Safety
    /// `offset + len` must lie within the region, and nobody may write
    /// those bytes while the returned slice lives.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(offset + len <= self.len);
        // SAFETY: in bounds and not concurrently written, by the contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// # Safety
    /// `offset + len` must lie within the region, and nobody else may read
    /// or write those bytes while the returned slice lives.
    #[expect(clippy::mut_from_ref, reason = "exclusivity is the caller's contract")]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset + len <= self.len);
        // SAFETY: in bounds and exclusively owned, by the contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

fn map(len: usize, flags: libc::c_int) -> Option<NonNull<u8>> {
    // SAFETY: a fresh anonymous mapping, aliasing nothing.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        None
    } else {
        NonNull::new(ptr.cast())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping what `new` mapped; no slice outlives the pool.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
