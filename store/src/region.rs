//! The DRAM pool's memory: one mapping made at start, backed by huge pages
//! when the host has them reserved, else by transparent huge pages where
//! the kernel allows. A shared region lives in a memfd, so that processes
//! on the same host can map it (read-only) and copy blocks straight out.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    hugepages: bool,
    /// The memfd behind a shared region.
    fd: Option<OwnedFd>,
}

// SAFETY: the region is plain memory; who may touch which bytes when is
// decided by the pool's allocator and leases, not by the region.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Maps `len` bytes. Tries explicit huge pages first when asked, then
    /// falls back to normal pages with a transparent-huge-page hint.
    pub fn new(len: usize, hugepages: bool, prefault: bool) -> io::Result<Region> {
        Self::map_with(len, hugepages, prefault, None)
    }

    /// As `new`, in a memfd that other processes can map (`fd`).
    pub fn shared(len: usize, hugepages: bool, prefault: bool) -> io::Result<Region> {
        let memfd = |flags: libc::c_uint, len: usize| -> io::Result<OwnedFd> {
            // SAFETY: a NUL-terminated name and plain flags.
            let fd =
                unsafe { libc::memfd_create(c"mooncake-pool".as_ptr(), libc::MFD_CLOEXEC | flags) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a descriptor we just created and own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sizing our own memfd.
            if unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as libc::off_t) }
                != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(fd)
        };
        if hugepages {
            let huge_len = len.next_multiple_of(2 << 20);
            if let Ok(fd) = memfd(libc::MFD_HUGETLB, huge_len) {
                if let Ok(region) = Self::map_with(huge_len, true, prefault, Some(fd)) {
                    return Ok(region);
                }
            }
        }
        Self::map_with(len, false, prefault, Some(memfd(0, len)?))
    }

    /// The memfd of a shared region.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    fn map_with(
        len: usize,
        hugepages: bool,
        prefault: bool,
        fd: Option<OwnedFd>,
    ) -> io::Result<Region> {
        if let Some(fd) = fd {
            let populate = if prefault { libc::MAP_POPULATE } else { 0 };
            let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
            let ptr =
                map(len, libc::MAP_SHARED | populate, raw).ok_or_else(io::Error::last_os_error)?;
            return Ok(Region {
                ptr,
                len,
                hugepages,
                fd: Some(fd),
            });
        }
        let populate = if prefault { libc::MAP_POPULATE } else { 0 };
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | populate;
        if hugepages {
            // Without MAP_NORESERVE the kernel refuses the mapping unless the
            // huge pages are reserved, instead of a SIGBUS on first touch.
            let huge_len = len.next_multiple_of(2 << 20);
            if let Some(ptr) = map(huge_len, flags | libc::MAP_HUGETLB, -1) {
                return Ok(Region {
                    ptr,
                    len: huge_len,
                    hugepages: true,
                    fd: None,
                });
            }
        }
        let ptr = map(len, flags | libc::MAP_NORESERVE, -1).ok_or_else(io::Error::last_os_error)?;
        if hugepages {
            // SAFETY: advising a mapping we own; failure is harmless.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        Ok(Region {
            ptr,
            len,
            hugepages: false,
            fd: None,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The start of the mapping (page-aligned).
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
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

fn map(len: usize, flags: libc::c_int, fd: libc::c_int) -> Option<NonNull<u8>> {
    // SAFETY: a fresh mapping (anonymous, or of our own memfd), aliasing
    // nothing in this process.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
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
