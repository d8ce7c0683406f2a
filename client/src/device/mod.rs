//! Device (GPU) memory as a place blocks come from and go to. The client
//! never reads device memory with the CPU: a block bound for the GPU lands
//! in pinned host staging memory, is checked against its checksum there,
//! and is then copied up by the GPU's copy engines; a block put from the
//! GPU is copied down into staging first and put from there
//! (`client/src/client/device.rs` runs that pipeline).
//!
//! [`Device`] is what the pipeline needs of a GPU: which memory an address
//! is, pinned host memory, and [`Lane`]s (queues of copies, CUDA streams).
//! [`cuda::Cuda`] is NVIDIA's, through the CUDA driver loaded at run time
//! (no CUDA toolkit at build time; on a host without one, no device);
//! [`HostStandIn`] plays a GPU in host memory, for tests on hosts without
//! one.

pub mod cuda;
mod staging;
mod stand_in;

use std::ptr::NonNull;

pub(crate) use staging::{down, up};
pub(crate) use staging::{Stage, Stages};
pub use stand_in::HostStandIn;

/// Per-block outcome of a device copy that failed.
pub(crate) const COPY_FAILED: mooncake_proto::ErrorCode = mooncake_proto::ErrorCode::Internal;

/// What memory an address lies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Memory this process's CPU can read and write (pageable or pinned).
    Host,
    /// Memory of the GPU with this ordinal: copied, never read by the CPU.
    Device(i32),
}

/// A failed device call, in one line: which call and the driver's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DeviceError(pub String);

/// A GPU, or what stands in for one: see the module's comment.
pub trait Device: Send + Sync {
    /// What it is, for logs: "CUDA driver 12.4", "host stand-in".
    fn name(&self) -> String;

    /// Which memory `addr` lies in; addresses the device does not know
    /// are host memory (the caller vouches for those).
    fn classify(&self, addr: usize) -> Memory;

    /// A new queue of copies between pinned host memory and the memory of
    /// GPU `ordinal`.
    fn lane(&self, ordinal: i32) -> Result<Box<dyn Lane>, DeviceError>;

    /// `len` bytes of host memory that the GPU's copy engines reach
    /// directly (page-locked).
    fn pinned(&self, len: usize) -> Result<Pinned, DeviceError>;

    /// Page-locks `len` bytes of host memory at `ptr` (a mapping of the
    /// same-host daemon's pool) so that the GPU's copy engines reach them
    /// directly, until the registration is dropped.
    ///
    /// # Safety
    /// The memory must stay mapped until the registration is dropped.
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<Registration, DeviceError>;
}

/// Host memory registered with a device (`Device::register_host`); dropping
/// it ends the registration.
pub struct Registration(Option<Box<dyn FnOnce() + Send + Sync>>);

impl Registration {
    /// A registration that `end` ends.
    pub fn new(end: Box<dyn FnOnce() + Send + Sync>) -> Registration {
        Registration(Some(end))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(end) = self.0.take() {
            end();
        }
    }
}

/// A queue of copies that run in order, asynchronously to the caller,
/// until [`Lane::wait`].
pub trait Lane: Send {
    /// Queues a copy of `len` bytes from pinned host memory at `src` to
    /// device memory at `dst`.
    ///
    /// # Safety
    /// Both ranges must stay valid, and `src` unchanged, until `wait`
    /// returns.
    unsafe fn upload(&mut self, dst: usize, src: *const u8, len: usize) -> Result<(), DeviceError>;

    /// Queues a copy of `len` bytes from device memory at `src` to pinned
    /// host memory at `dst`.
    ///
    /// # Safety
    /// Both ranges must stay valid, and `dst` otherwise untouched, until
    /// `wait` returns.
    unsafe fn download(&mut self, dst: *mut u8, src: usize, len: usize) -> Result<(), DeviceError>;

    /// Blocks until every copy queued so far is done; the first error of
    /// any of them (each copy since the last `wait` is then suspect).
    fn wait(&mut self) -> Result<(), DeviceError>;
}

/// What frees a [`Pinned`] buffer: given its address and length.
pub type FreePinned = Box<dyn FnOnce(NonNull<u8>, usize) + Send + Sync>;

/// Page-locked host memory, freed by whoever allocated it.
pub struct Pinned {
    ptr: NonNull<u8>,
    len: usize,
    free: Option<FreePinned>,
}

// SAFETY: `Pinned` owns its bytes alone, as a `Vec<u8>` does.
unsafe impl Send for Pinned {}
// SAFETY: shared access is read-only (`as_ptr`).
unsafe impl Sync for Pinned {}

impl Pinned {
    /// Takes ownership of `len` bytes at `ptr`, which `free` releases.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until
    /// `free` is called, and used by nothing else.
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize, free: FreePinned) -> Pinned {
        Pinned {
            ptr,
            len,
            free: Some(free),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: owned, valid for `len` bytes (`from_raw`'s promise).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(free) = self.free.take() {
            free(self.ptr, self.len);
        }
    }
}

/// Which GPU support a client uses.
#[derive(Clone, Default)]
pub enum DeviceChoice {
    /// NVIDIA's CUDA driver, if this host has one (loaded on first use).
    #[default]
    Cuda,
    /// None: every address is host memory.
    Off,
    /// This one (a test's stand-in, or another vendor's).
    Given(std::sync::Arc<dyn Device>),
}

impl std::fmt::Debug for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Cuda => f.write_str("Cuda"),
            DeviceChoice::Off => f.write_str("Off"),
            DeviceChoice::Given(d) => write!(f, "Given({})", d.name()),
        }
    }
}

/// A block's bytes by address, in pieces (a page's K and V apart, or one
/// piece per layer), in host or device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub addr: usize,
    pub len: usize,
}

impl Span {
    pub fn new(addr: usize, len: usize) -> Span {
        Span { addr, len }
    }
}
