//! Memory the client reads blocks into or writes them from: Python objects
//! with the buffer protocol (held for the call), CUDA tensors, or address
//! ranges of buffers registered once (`register_buffer`), host or GPU
//! memory, as GPU workers use them.

use std::collections::BTreeMap;

use mooncake_client::device::{Memory, Span};

use parking_lot::Mutex;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;

/// One contiguous range of memory that stays valid for the call.
pub struct Region {
    pub ptr: usize,
    pub len: usize,
    /// The Python object the range belongs to (its buffer, or a tensor),
    /// released after the call.
    _held: Option<Held>,
}

enum Held {
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
    Tensor(#[allow(dead_code)] Py<PyAny>),
}

impl Region {
    /// A buffer-protocol object's bytes, or a contiguous CUDA tensor's
    /// (on a host whose GPU `client` can reach); `writable` for
    /// destinations.
    pub fn of_object(
        obj: &Bound<'_, PyAny>,
        writable: bool,
        client: &mooncake_client::Client,
    ) -> PyResult<Region> {
        if obj
            .getattr("is_cuda")
            .is_ok_and(|c| c.is_truthy().unwrap_or(false))
        {
            return Region::of_cuda_tensor(obj, client);
        }
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
            _held: Some(Held::Buffer(buf)),
        })
    }

    /// A CUDA tensor's bytes: refused unless contiguous and in memory of
    /// a GPU that this client's CUDA driver knows (never read as host
    /// memory).
    fn of_cuda_tensor(
        obj: &Bound<'_, PyAny>,
        client: &mooncake_client::Client,
    ) -> PyResult<Region> {
        if !obj.call_method0("is_contiguous")?.is_truthy()? {
            return Err(PyBufferError::new_err("the CUDA tensor is not contiguous"));
        }
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let numel: usize = obj.call_method0("numel")?.extract()?;
        let size: usize = obj.call_method0("element_size")?.extract()?;
        let len = numel * size;
        gpu_memory(client, ptr, len)?;
        Ok(Region {
            ptr,
            len,
            _held: Some(Held::Tensor(obj.clone().unbind())),
        })
    }

    /// The range as a span (for the client's calls by address).
    pub fn span(&self) -> Span {
        Span::new(self.ptr, self.len)
    }

    /// An address range inside a registered buffer.
    pub fn registered(ptr: usize, len: usize) -> Region {
        Region {
            ptr,
            len,
            _held: None,
        }
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

/// Checks that `[ptr, ptr + len)` lies in one GPU's memory, as the
/// client's CUDA driver says; the error says why not, in one line.
pub fn gpu_memory(client: &mooncake_client::Client, ptr: usize, len: usize) -> PyResult<i32> {
    let Some(device) = client.device() else {
        return Err(PyValueError::new_err(format!(
            "{len} bytes at {ptr:#x} are GPU memory, but this client has no GPU support (no CUDA driver on this host: libcuda.so.1 not found)"
        )));
    };
    let last = ptr + len.max(1) - 1;
    match (device.classify(ptr), device.classify(last)) {
        (Memory::Device(a), Memory::Device(b)) if a == b => Ok(a),
        _ => Err(PyValueError::new_err(format!(
            "{len} bytes at {ptr:#x} are not memory of one GPU, as {} tells",
            device.name()
        ))),
    }
}

/// Buffers registered by address: (start -> length).
#[derive(Default)]
pub struct Registered {
    ranges: Mutex<BTreeMap<usize, usize>>,
}

impl Registered {
    /// Registers host memory, or a GPU's memory (as `client`'s CUDA
    /// driver tells); anything else is refused, never read.
    pub fn register(
        &self,
        ptr: usize,
        len: usize,
        client: &mooncake_client::Client,
    ) -> PyResult<()> {
        if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
            return Err(PyValueError::new_err(format!(
                "cannot register {len} bytes at {ptr:#x}"
            )));
        }
        match client.memory_of(ptr) {
            Memory::Device(_) => {
                gpu_memory(client, ptr, len)?;
            }
            Memory::Host if host_memory(ptr, len) => {}
            Memory::Host => {
                let why = match client.device() {
                    Some(device) => format!("nor GPU memory, as {} tells", device.name()),
                    None => "and this client has no GPU support (no CUDA driver on this host: libcuda.so.1 not found)".to_string(),
                };
                return Err(PyValueError::new_err(format!(
                    "{len} bytes at {ptr:#x} are not readable and writable host memory of this process, {why}"
                )));
            }
        };
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
