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
        Self::map_private(len, hugepages, prefault)
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
                if let Ok(region) = Self::map_shared(huge_len, fd, true, true, prefault) {
                    return Ok(region);
                }
            }
        }
        Self::map_shared(len, memfd(0, len)?, false, hugepages, prefault)
    }

    /// Maps a memfd, of reserved huge pages if `reserved`. Otherwise, if
    /// huge pages are `wanted`, advised before any page exists: with
    /// `shmem_enabled` at `advise` (or `within_size`, `always`) the kernel
    /// then backs it with 2 MiB pages; elsewhere the advice does nothing.
    fn map_shared(
        len: usize,
        fd: OwnedFd,
        reserved: bool,
        wanted: bool,
        prefault: bool,
    ) -> io::Result<Region> {
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let ptr = map(len, libc::MAP_SHARED, raw).ok_or_else(io::Error::last_os_error)?;
        let region = Region {
            ptr,
            len,
            hugepages: reserved,
            fd: Some(fd),
        };
        if wanted && !reserved {
            // SAFETY: advising a mapping we own; failure is harmless.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        if prefault {
            populate(ptr, len);
        }
        Ok(region)
    }

    /// The memfd of a shared region.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// An anonymous mapping: reserved huge pages if wanted and there, else
    /// normal pages with the transparent-huge-page hint.
    fn map_private(len: usize, hugepages: bool, prefault: bool) -> io::Result<Region> {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        if hugepages {
            // Without MAP_NORESERVE the kernel refuses the mapping unless the
            // huge pages are reserved, instead of a SIGBUS on first touch.
            let huge_len = len.next_multiple_of(2 << 20);
            if let Some(ptr) = map(huge_len, flags | libc::MAP_HUGETLB, -1) {
                if prefault {
                    populate(ptr, huge_len);
                }
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
            // Before any page exists, so that prefaulting makes huge ones.
            // SAFETY: advising a mapping we own; failure is harmless.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        if prefault {
            populate(ptr, len);
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

    /// What pages back the region, for the daemon's start-up line: the
    /// reserved huge pages it got, or normal pages and the kernel's
    /// transparent-huge-page mode that decides whether they grow to 2 MiB
    /// (`shmem_enabled` for a shared region, `enabled` for a private one).
    pub fn pages(&self) -> String {
        if self.hugepages {
            return "2MiB (reserved huge pages)".into();
        }
        let knob = if self.fd.is_some() {
            "shmem_enabled"
        } else {
            "enabled"
        };
        let path = format!("/sys/kernel/mm/transparent_hugepage/{knob}");
        match std::fs::read_to_string(&path)
            .ok()
            .as_deref()
            .and_then(chosen)
        {
            Some(mode) => format!("4KiB (transparent huge pages: {knob}={mode})"),
            None => "4KiB".into(),
        }
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

/// Gives every page of a new mapping its memory now, so that no request
/// pays a fault; as `MAP_POPULATE` did, a failure (no memory left) is left
/// to the first touch of each page. A few MiB per call: the kernel holds
/// the process's memory-map lock for reading while it fills (and may
/// compact memory for huge pages), and one call over gigabytes would stall
/// every other thread that maps memory (an allocation, a new thread) for
/// the whole fill.
fn populate(ptr: NonNull<u8>, len: usize) {
    const STEP: usize = 16 << 20;
    for start in (0..len).step_by(STEP) {
        let n = STEP.min(len - start);
        // SAFETY: in bounds; filling our own mapping's pages changes no byte.
        let at = unsafe { ptr.as_ptr().add(start) };
        // SAFETY: as above.
        let rc = unsafe { libc::madvise(at.cast(), n, libc::MADV_POPULATE_WRITE) };
        if rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // Kernels before 5.14 lack the advice: touch each page instead.
            for offset in (0..len).step_by(4096) {
                // SAFETY: in bounds; the pool is new, nobody reads it yet.
                unsafe { ptr.as_ptr().add(offset).write_volatile(0) };
            }
            return;
        }
    }
}

/// The bracketed choice of a kernel setting such as "always [madvise] never".
fn chosen(setting: &str) -> Option<&str> {
    let start = setting.find('[')? + 1;
    let end = start + setting[start..].find(']')?;
    Some(&setting[start..end])
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_choice_is_the_bracketed_word() {
        assert_eq!(chosen("always [madvise] never\n"), Some("madvise"));
        assert_eq!(
            chosen("always within_size advise [never] deny force"),
            Some("never")
        );
        assert_eq!(chosen("no choice here"), None);
    }

    #[test]
    fn a_shared_region_says_what_pages_back_it() {
        let region = Region::shared(4 << 20, false, true).unwrap();
        assert!(region.pages().starts_with("4KiB"), "{}", region.pages());
        // Prefaulted pages read as zero.
        assert!(unsafe { region.slice(0, 4 << 20) }.iter().all(|b| *b == 0));
    }

    /// Pages of `region` the kernel holds in memory, by `mincore`.
    fn resident(region: &Region) -> usize {
        let mut flags = vec![0u8; region.len().div_ceil(4096)];
        // SAFETY: a mapping we own, and a vector of one byte per page.
        let rc = unsafe {
            libc::mincore(
                region.ptr().as_ptr().cast(),
                region.len(),
                flags.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        flags.iter().filter(|f| *f & 1 == 1).count()
    }

    #[test]
    fn prefaulting_fills_every_page_of_a_pool_larger_than_one_step() {
        // Two and a half steps of 16 MiB, so the last call is a short one.
        let len = 40 << 20;
        for shared in [false, true] {
            let filled = if shared {
                Region::shared(len, false, true)
            } else {
                Region::new(len, false, true)
            }
            .unwrap();
            assert_eq!(resident(&filled), len / 4096, "shared: {shared}");
            let lazy = if shared {
                Region::shared(len, false, false)
            } else {
                Region::new(len, false, false)
            }
            .unwrap();
            assert_eq!(resident(&lazy), 0, "shared: {shared}");
        }
    }
}
