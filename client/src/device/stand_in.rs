//! A GPU played in host memory, for tests on hosts without one: its
//! "device memory" is host memory only it hands out, its copies run when
//! the lane is waited on (so a pipeline that reuses staging before waiting
//! delivers wrong bytes, as it would on a GPU), it refuses copies to or
//! from memory it did not hand out, and it can fail the n-th copy.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Device, DeviceError, Lane, Memory, Pinned, Registration};

/// See the module's comment. Cheap to clone: clones share one "GPU".
#[derive(Clone, Default)]
pub struct HostStandIn {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// "Device memory": start address -> length, allocated with
    /// `layout(length)` and freed by `free` or with the stand-in.
    device: BTreeMap<usize, usize>,
    /// Pinned memory handed out and not yet freed: start -> length.
    pinned: BTreeMap<usize, usize>,
    /// Copies done so far, and the one (counted from 1) that fails.
    copies: u64,
    fail_at: Option<u64>,
    uploads: u64,
    downloads: u64,
    /// Host memory registered (`register_host`): start -> length.
    registered: BTreeMap<usize, usize>,
    /// Uploads whose source was registered host memory (not staging).
    uploads_from_registered: u64,
    /// Downloads whose destination was registered host memory.
    downloads_to_registered: u64,
}

/// Whether `[addr, addr + len)` lies inside one of `ranges`.
fn inside(
    ranges: impl DoubleEndedIterator<Item = (usize, usize)>,
    addr: usize,
    len: usize,
) -> bool {
    ranges
        .rev()
        .find(|&(start, _)| start <= addr)
        .is_some_and(|(start, n)| addr + len <= start + n)
}

impl State {
    fn on_device(&self, addr: usize, len: usize) -> bool {
        inside(self.device.range(..=addr).map(|(&a, &n)| (a, n)), addr, len)
    }

    fn is_pinned(&self, addr: usize, len: usize) -> bool {
        inside(self.pinned.range(..=addr).map(|(&a, &n)| (a, n)), addr, len)
            || inside(
                self.registered.range(..=addr).map(|(&a, &n)| (a, n)),
                addr,
                len,
            )
    }
}

fn layout(len: usize) -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(len.max(1), 4096).expect("a sane length")
}

impl Drop for State {
    fn drop(&mut self) {
        for (&addr, &len) in &self.device {
            // SAFETY: allocated by `alloc` with this layout, not yet freed.
            unsafe { std::alloc::dealloc(addr as *mut u8, layout(len)) };
        }
    }
}

impl HostStandIn {
    pub fn new() -> HostStandIn {
        HostStandIn::default()
    }

    /// `len` bytes of "device memory", zeroed; its address.
    pub fn alloc(&self, len: usize) -> usize {
        // SAFETY: the layout is not zero-sized.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout(len)) };
        assert!(!ptr.is_null(), "out of memory");
        self.state.lock().device.insert(ptr as usize, len);
        ptr as usize
    }

    /// Frees what `alloc` gave.
    pub fn free(&self, addr: usize) {
        if let Some(len) = self.state.lock().device.remove(&addr) {
            // SAFETY: allocated by `alloc` with this layout.
            unsafe { std::alloc::dealloc(addr as *mut u8, layout(len)) };
        }
    }

    /// Writes `bytes` at device address `addr` (as a `cudaMemcpy` would).
    pub fn write(&self, addr: usize, bytes: &[u8]) {
        let state = self.state.lock();
        assert!(state.on_device(addr, bytes.len()), "outside device memory");
        // SAFETY: inside a live allocation (checked, under the lock).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
    }

    /// Reads `len` bytes at device address `addr`.
    pub fn read(&self, addr: usize, len: usize) -> Vec<u8> {
        let state = self.state.lock();
        assert!(state.on_device(addr, len), "outside device memory");
        // SAFETY: as in `write`.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
    }

    /// Makes the `n`-th copy from now (1: the next) fail.
    pub fn fail_copy(&self, n: u64) {
        let mut state = self.state.lock();
        state.fail_at = Some(state.copies + n);
    }

    /// Copies done so far: (uploads, downloads).
    pub fn copies(&self) -> (u64, u64) {
        let state = self.state.lock();
        (state.uploads, state.downloads)
    }

    /// Pinned bytes handed out and not yet freed.
    pub fn pinned_bytes(&self) -> usize {
        self.state.lock().pinned.values().sum()
    }

    /// Uploads so far whose source was registered host memory.
    pub fn uploads_from_registered(&self) -> u64 {
        self.state.lock().uploads_from_registered
    }

    /// Downloads so far whose destination was registered host memory.
    pub fn downloads_to_registered(&self) -> u64 {
        self.state.lock().downloads_to_registered
    }

    /// Bytes of host memory registered and not yet unregistered.
    pub fn registered_bytes(&self) -> usize {
        self.state.lock().registered.values().sum()
    }
}

impl Device for HostStandIn {
    fn name(&self) -> String {
        "host stand-in".to_string()
    }

    fn classify(&self, addr: usize) -> Memory {
        match self.state.lock().on_device(addr, 1) {
            true => Memory::Device(0),
            false => Memory::Host,
        }
    }

    fn lane(&self, ordinal: i32) -> Result<Box<dyn Lane>, DeviceError> {
        if ordinal != 0 {
            return Err(DeviceError(format!("no device {ordinal}")));
        }
        Ok(Box::new(StandInLane {
            state: self.state.clone(),
            queued: Vec::new(),
        }))
    }

    fn pinned(&self, len: usize) -> Result<Pinned, DeviceError> {
        let layout = layout(len);
        // SAFETY: the layout is not zero-sized.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) })
            .ok_or_else(|| DeviceError(format!("out of memory for {len} pinned bytes")))?;
        self.state.lock().pinned.insert(ptr.as_ptr() as usize, len);
        let state = self.state.clone();
        let free = Box::new(move |ptr: NonNull<u8>, _| {
            state.lock().pinned.remove(&(ptr.as_ptr() as usize));
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        });
        // SAFETY: freshly allocated, `len` bytes, ours alone.
        Ok(unsafe { Pinned::from_raw(ptr, len, free) })
    }

    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<Registration, DeviceError> {
        let addr = ptr as usize;
        let mut state = self.state.lock();
        if state.is_pinned(addr, 1) {
            return Err(DeviceError(format!(
                "stand-in: {addr:#x} is registered already"
            )));
        }
        state.registered.insert(addr, len);
        let state = self.state.clone();
        Ok(Registration::new(Box::new(move || {
            state.lock().registered.remove(&addr);
        })))
    }
}

#[derive(Clone, Copy)]
enum Copy {
    Up { dst: usize, src: usize, len: usize },
    Down { dst: usize, src: usize, len: usize },
}

struct StandInLane {
    state: Arc<Mutex<State>>,
    queued: Vec<Copy>,
}

impl Lane for StandInLane {
    unsafe fn upload(&mut self, dst: usize, src: *const u8, len: usize) -> Result<(), DeviceError> {
        let src = src as usize;
        self.queued.push(Copy::Up { dst, src, len });
        Ok(())
    }

    unsafe fn download(&mut self, dst: *mut u8, src: usize, len: usize) -> Result<(), DeviceError> {
        let dst = dst as usize;
        self.queued.push(Copy::Down { dst, src, len });
        Ok(())
    }

    fn wait(&mut self) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        for copy in self.queued.drain(..) {
            state.copies += 1;
            if state.fail_at == Some(state.copies) {
                return Err(DeviceError("stand-in: this copy was told to fail".into()));
            }
            let (dev, host, len) = match copy {
                Copy::Up { dst, src, len } => (dst, src, len),
                Copy::Down { dst, src, len } => (src, dst, len),
            };
            if !state.on_device(dev, len) {
                return Err(DeviceError(format!(
                    "stand-in: {len} bytes at {dev:#x} are not device memory"
                )));
            }
            if !state.is_pinned(host, len) {
                return Err(DeviceError(format!(
                    "stand-in: {len} bytes at {host:#x} are not pinned host memory"
                )));
            }
            // SAFETY: both ranges were checked to lie in live allocations
            // (the device map is locked; pinned memory outlives the wait,
            // the lane's promise); they are distinct allocations.
            unsafe {
                match copy {
                    Copy::Up { .. } => {
                        state.uploads += 1;
                        if inside(
                            state.registered.range(..=host).map(|(&a, &n)| (a, n)),
                            host,
                            len,
                        ) {
                            state.uploads_from_registered += 1;
                        }
                        std::ptr::copy_nonoverlapping(host as *const u8, dev as *mut u8, len)
                    }
                    Copy::Down { .. } => {
                        state.downloads += 1;
                        if inside(
                            state.registered.range(..=host).map(|(&a, &n)| (a, n)),
                            host,
                            len,
                        ) {
                            state.downloads_to_registered += 1;
                        }
                        std::ptr::copy_nonoverlapping(dev as *const u8, host as *mut u8, len)
                    }
                }
            }
        }
        Ok(())
    }
}
