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
