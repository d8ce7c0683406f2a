//! Memory the client reads blocks into or writes them from: Python objects
//! with the buffer protocol (held for the call), or address ranges of
//! buffers registered once (`register_buffer`), as GPU workers use them.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;

/// One contiguous range of memory that stays valid for the call.
pub struct Region {
    pub ptr: usize,
    pub len: usize,
    /// The Python buffer the range belongs to, released after the call.
    _held: Option<PyUntypedBuffer>,
}

impl Region {
    /// A buffer-protocol object's bytes; `writable` for destinations.
    pub fn of_object(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Region> {
        let buf = PyUntypedBuffer::get(obj)?;
        if writable && buf.readonly() {
            return Err(PyBufferError::new_err(
                "the destination buffer is read-only",
            ));
        }
        if !buf.is_c_contiguous() {
            return Err(PyBufferError::new_err("the buffer is not contiguous"));
        }
        Ok(Region {
            ptr: buf.buf_ptr() as usize,
            len: buf.len_bytes(),
            _held: Some(buf),
        })
    }

    /// An address range inside a registered buffer.
    pub fn registered(ptr: usize, len: usize) -> Region {
        Region {
            ptr,
            len,
            _held: None,
        }
    }

    /// # Safety
    /// The range must be valid for reads for the life of the slice.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// # Safety
    /// The range must be valid for writes for the life of the slice and
    /// not overlap any other slice in use.
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

/// For each range, whether it overlaps another one.
pub fn overlapping(regions: &[Region]) -> Vec<bool> {
    let spans: Vec<(usize, usize)> = regions.iter().map(|r| (r.ptr, r.len)).collect();
    mooncake_client::bindings::overlapping(&spans)
}

/// Whether `[ptr, ptr + len)` is mapped readable and writable in this
/// process, from `/proc/self/maps`: a GPU's device pointer is not (its
/// address range is reserved, not accessible), nor is a freed or made-up
/// one, so such a range is refused rather than read as host memory.
fn host_memory(ptr: usize, len: usize) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let mut covered = ptr;
    let end = ptr + len;
    // Mappings are listed in address order.
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((start, stop)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(stop)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(stop, 16),
        ) else {
            continue;
        };
        if stop <= covered {
            continue;
        }
        if start > covered || !perms.starts_with("rw") {
            return false;
        }
        covered = stop;
        if covered >= end {
            return true;
        }
    }
    false
}

/// Buffers registered by address: (start -> length).
#[derive(Default)]
pub struct Registered {
    ranges: Mutex<BTreeMap<usize, usize>>,
}

impl Registered {
    pub fn register(&self, ptr: usize, len: usize) -> PyResult<()> {
        if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
            return Err(PyValueError::new_err(format!(
                "cannot register {len} bytes at {ptr:#x}"
            )));
        }
        if !host_memory(ptr, len) {
            return Err(PyValueError::new_err(format!(
                "{len} bytes at {ptr:#x} are not readable and writable host memory of this process (a GPU pointer? GPU memory cannot be registered yet)"
            )));
        }
        let mut ranges = self.ranges.lock();
        let before = ranges.range(..ptr + len).next_back();
        if before.is_some_and(|(&start, &l)| start + l > ptr) {
            return Err(PyValueError::new_err(format!(
                "{len} bytes at {ptr:#x} overlap a registered buffer"
            )));
        }
        ranges.insert(ptr, len);
        Ok(())
    }

    pub fn unregister(&self, ptr: usize) -> bool {
        self.ranges.lock().remove(&ptr).is_some()
    }

    /// Whether `[ptr, ptr + len)` lies inside one registered buffer.
    pub fn covers(&self, ptr: usize, len: usize) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        self.ranges
            .lock()
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&start, &l)| end <= start + l)
    }
}
