//! NVIDIA GPUs through the CUDA driver API (`libcuda.so.1`), loaded at run
//! time: the build needs no CUDA toolkit, and a host without the driver,
//! or without a GPU, simply has no device. Only the driver's stable,
//! versioned entry points are used (those of `cuda.h` since CUDA 10).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use super::{Device, DeviceError, Lane, Memory, Pinned, Registration};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuDevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`, `..._DEVICE_ORDINAL`.
const ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
/// `CU_MEMORYTYPE_DEVICE`: device memory (managed memory reports it too).
const MEMORYTYPE_DEVICE: c_uint = 2;
/// `CU_STREAM_NON_BLOCKING`: no implicit ordering with the legacy
/// default stream the engine's kernels may run on.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context.
const MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTREGISTER_PORTABLE`: registered for every context.
const MEMHOSTREGISTER_PORTABLE: c_uint = 1;

/// The driver's entry points this client calls.
struct Api {
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    pointer_get_attributes:
        unsafe extern "C" fn(c_uint, *mut c_int, *mut *mut c_void, CuDevicePtr) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    memcpy_htod_async:
        unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    /// Keeps the functions above loaded.
    _lib: libloading::Library,
}

/// NVIDIA's GPUs, through the driver; cheap to clone (lanes, pinned
/// buffers and device buffers hold it, so it is unloaded after them).
#[derive(Clone)]
pub struct Cuda(Arc<Driver>);

/// The driver, initialized, and the primary context of each GPU (the one
/// PyTorch and most engines use), made current around each call.
struct Driver {
    api: Api,
    version: c_int,
    contexts: Vec<CuContext>,
}

// SAFETY: the driver API is thread-safe; contexts are handles that any
// thread may make current.
unsafe impl Send for Driver {}
// SAFETY: as above.
unsafe impl Sync for Driver {}

impl Cuda {
    /// Loads and initializes the driver; why not, in one line, on a host
    /// without it or without a GPU.
    pub fn load() -> Result<Cuda, DeviceError> {
        let lib = ["libcuda.so.1", "libcuda.so"]
            .iter()
            // SAFETY: loading NVIDIA's driver library runs its
            // initializers, which are sound to run in any process.
            .find_map(|name| unsafe { libloading::Library::new(name) }.ok())
            .ok_or_else(|| {
                DeviceError("no CUDA driver on this host (libcuda.so.1 not found)".into())
            })?;
        // SAFETY: each symbol is declared with its C signature from cuda.h.
        let api = unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .map_err(|e| DeviceError(format!("the CUDA driver lacks {}: {e}", $name)))?
                };
            }
            let init: unsafe extern "C" fn(c_uint) -> CuResult = sym!("cuInit");
            let api = Api {
                get_error_string: sym!("cuGetErrorString"),
                driver_get_version: sym!("cuDriverGetVersion"),
                device_get_count: sym!("cuDeviceGetCount"),
                device_get: sym!("cuDeviceGet"),
                device_get_name: sym!("cuDeviceGetName"),
                primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
                ctx_set_current: sym!("cuCtxSetCurrent"),
                pointer_get_attributes: sym!("cuPointerGetAttributes"),
                stream_create: sym!("cuStreamCreate"),
                stream_destroy: sym!("cuStreamDestroy_v2"),
                stream_synchronize: sym!("cuStreamSynchronize"),
                memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
                memcpy_dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
                mem_host_alloc: sym!("cuMemHostAlloc"),
                mem_host_register: sym!("cuMemHostRegister_v2"),
                mem_host_unregister: sym!("cuMemHostUnregister"),
                mem_free_host: sym!("cuMemFreeHost"),
                mem_alloc: sym!("cuMemAlloc_v2"),
                mem_free: sym!("cuMemFree_v2"),
                _lib: lib,
            };
            let code = init(0);
            if code != CUDA_SUCCESS {
                return Err(DeviceError(format!(
                    "the CUDA driver did not start: {}",
                    describe(&api, code)
                )));
            }
            api
        };
        let mut d = Driver {
            api,
            version: 0,
            contexts: Vec::new(),
        };
        // SAFETY: out-pointers to locals.
        unsafe {
            let mut version = 0;
            d.check(
                "cuDriverGetVersion",
                (d.api.driver_get_version)(&mut version),
            )?;
            d.version = version;
            let mut count = 0;
            d.check("cuDeviceGetCount", (d.api.device_get_count)(&mut count))?;
            for ordinal in 0..count {
                let mut dev = 0;
                d.check("cuDeviceGet", (d.api.device_get)(&mut dev, ordinal))?;
                let mut ctx = std::ptr::null_mut();
                d.check(
                    "cuDevicePrimaryCtxRetain",
                    (d.api.primary_ctx_retain)(&mut ctx, dev),
                )?;
                d.contexts.push(ctx);
            }
        }
        if d.contexts.is_empty() {
            return Err(DeviceError("the CUDA driver sees no GPU".into()));
        }
        Ok(Cuda(Arc::new(d)))
    }

    /// GPUs the driver sees.
    pub fn devices(&self) -> usize {
        self.0.contexts.len()
    }

    /// GPU `ordinal`'s name, as the driver says it.
    pub fn device_name(&self, ordinal: i32) -> Result<String, DeviceError> {
        let d = &self.0;
        let mut name = [0 as c_char; 256];
        // SAFETY: a buffer of the length given.
        unsafe {
            let mut dev = 0;
            d.check("cuDeviceGet", (d.api.device_get)(&mut dev, ordinal))?;
            d.check(
                "cuDeviceGetName",
                (d.api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev),
            )?;
            Ok(CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned())
        }
    }

    /// `len` bytes of GPU `ordinal`'s memory (for checks and benchmarks:
    /// engines bring their own).
    pub fn alloc_device(&self, ordinal: i32, len: usize) -> Result<DeviceBuf, DeviceError> {
        let d = &self.0;
        d.enter(ordinal)?;
        let mut ptr = 0;
        // SAFETY: an out-pointer to a local.
        d.check("cuMemAlloc", unsafe { (d.api.mem_alloc)(&mut ptr, len) })?;
        Ok(DeviceBuf {
            cuda: d.clone(),
            ordinal,
            ptr,
            len,
        })
    }
}

impl Driver {
    fn check(&self, call: &str, code: CuResult) -> Result<(), DeviceError> {
        match code {
            CUDA_SUCCESS => Ok(()),
            _ => Err(DeviceError(format!(
                "{call}: {}",
                describe(&self.api, code)
            ))),
        }
    }

    /// Makes GPU `ordinal`'s primary context current on this thread.
    fn enter(&self, ordinal: i32) -> Result<(), DeviceError> {
        let ctx = *usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.contexts.get(i))
            .ok_or_else(|| DeviceError(format!("no GPU {ordinal}")))?;
        // SAFETY: a context retained in `load`, never released.
        self.check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(ctx)
        })
    }
}

/// "CUDA_ERROR_INVALID_VALUE (invalid argument)", from the driver.
fn describe(api: &Api, code: CuResult) -> String {
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: an out-pointer to a local; the driver's strings are static.
    let said = unsafe { (api.get_error_string)(code, &mut text) };
    if said != CUDA_SUCCESS || text.is_null() {
        return format!("CUDA error {code}");
    }
    // SAFETY: a NUL-terminated static string.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    format!("CUDA error {code} ({text})")
}

impl Device for Cuda {
    fn name(&self) -> String {
        let d = &self.0;
        format!(
            "CUDA driver {}.{}, {} GPU(s)",
            d.version / 1000,
            d.version % 1000 / 10,
            d.contexts.len()
        )
    }

    fn classify(&self, addr: usize) -> Memory {
        let mut kind: c_uint = 0;
        let mut ordinal: c_int = -1;
        let mut attributes = [ATTRIBUTE_MEMORY_TYPE, ATTRIBUTE_DEVICE_ORDINAL];
        let mut data = [
            (&mut kind as *mut c_uint).cast::<c_void>(),
            (&mut ordinal as *mut c_int).cast::<c_void>(),
        ];
        // SAFETY: two attributes, each with a slot of its documented type.
        // Unlike cuPointerGetAttribute, this call succeeds for addresses
        // CUDA does not know, leaving them zero: host memory.
        let code = unsafe {
            (self.0.api.pointer_get_attributes)(
                attributes.len() as c_uint,
                attributes.as_mut_ptr(),
                data.as_mut_ptr(),
                addr as CuDevicePtr,
            )
        };
        match (code, kind) {
            (CUDA_SUCCESS, MEMORYTYPE_DEVICE) => Memory::Device(ordinal.max(0)),
            _ => Memory::Host,
        }
    }

    fn lane(&self, ordinal: i32) -> Result<Box<dyn Lane>, DeviceError> {
        let d = &self.0;
        d.enter(ordinal)?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local, in the context made current.
        d.check("cuStreamCreate", unsafe {
            (d.api.stream_create)(&mut stream, STREAM_NON_BLOCKING)
        })?;
        Ok(Box::new(CudaLane {
            cuda: d.clone(),
            ordinal,
            stream,
        }))
    }

    fn pinned(&self, len: usize) -> Result<Pinned, DeviceError> {
        let d = &self.0;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local.
        d.check("cuMemHostAlloc", unsafe {
            (d.api.mem_host_alloc)(&mut ptr, len.max(1), MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| DeviceError("cuMemHostAlloc gave a null pointer".into()))?;
        let driver = d.clone();
        let free = Box::new(move |ptr: NonNull<u8>, _| {
            // SAFETY: allocated by cuMemHostAlloc above, freed once; the
            // driver stays loaded while this closure holds it.
            unsafe { (driver.api.mem_free_host)(ptr.as_ptr().cast()) };
        });
        // SAFETY: `len` bytes, ours alone until freed.
        Ok(unsafe { Pinned::from_raw(ptr, len, free) })
    }

    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<Registration, DeviceError> {
        let d = &self.0;
        // SAFETY: memory the caller keeps mapped until the registration
        // ends (this method's contract).
        d.check("cuMemHostRegister", unsafe {
            (d.api.mem_host_register)(ptr.cast(), len, MEMHOSTREGISTER_PORTABLE)
        })?;
        let driver = d.clone();
        let addr = ptr as usize;
        Ok(Registration::new(Box::new(move || {
            // SAFETY: registered above, unregistered once.
            unsafe { (driver.api.mem_host_unregister)(addr as *mut c_void) };
        })))
    }
}

/// A CUDA stream in GPU `ordinal`'s primary context.
struct CudaLane {
    cuda: Arc<Driver>,
    ordinal: i32,
    stream: CuStream,
}

// SAFETY: a stream handle may be used from any thread.
unsafe impl Send for CudaLane {}

impl Lane for CudaLane {
    unsafe fn upload(&mut self, dst: usize, src: *const u8, len: usize) -> Result<(), DeviceError> {
        let cuda = &self.cuda;
        cuda.enter(self.ordinal)?;
        // SAFETY: the caller's promise (`Lane::upload`).
        cuda.check("cuMemcpyHtoDAsync", unsafe {
            (cuda.api.memcpy_htod_async)(dst as CuDevicePtr, src.cast(), len, self.stream)
        })
    }

    unsafe fn download(&mut self, dst: *mut u8, src: usize, len: usize) -> Result<(), DeviceError> {
        let cuda = &self.cuda;
        cuda.enter(self.ordinal)?;
        // SAFETY: the caller's promise (`Lane::download`).
        cuda.check("cuMemcpyDtoHAsync", unsafe {
            (cuda.api.memcpy_dtoh_async)(dst.cast(), src as CuDevicePtr, len, self.stream)
        })
    }

    fn wait(&mut self) -> Result<(), DeviceError> {
        let cuda = &self.cuda;
        cuda.enter(self.ordinal)?;
        // SAFETY: a live stream of this lane.
        cuda.check("cuStreamSynchronize", unsafe {
            (cuda.api.stream_synchronize)(self.stream)
        })
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        let cuda = &self.cuda;
        if cuda.enter(self.ordinal).is_ok() {
            // SAFETY: a live stream of this lane, destroyed once.
            unsafe {
                (cuda.api.stream_synchronize)(self.stream);
                (cuda.api.stream_destroy)(self.stream);
            }
        }
    }
}

/// Device memory allocated by [`Cuda::alloc_device`], freed on drop.
pub struct DeviceBuf {
    cuda: Arc<Driver>,
    ordinal: i32,
    ptr: CuDevicePtr,
    len: usize,
}

impl DeviceBuf {
    /// Its device address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies pinned `src` to `at` bytes into this buffer and waits: what
    /// `cudaMemcpy` from pinned memory does (the benchmarks' reference).
    pub fn write(&self, lane: &mut dyn Lane, at: usize, src: &Pinned) -> Result<(), DeviceError> {
        assert!(at + src.len() <= self.len, "inside the buffer");
        // SAFETY: inside this buffer and `src`, both live until the wait.
        unsafe { lane.upload(self.addr() + at, src.as_ptr(), src.len())? };
        lane.wait()
    }

    /// Copies `dst.len()` bytes from `at` into pinned `dst` and waits.
    pub fn read(
        &self,
        lane: &mut dyn Lane,
        at: usize,
        dst: &mut Pinned,
    ) -> Result<(), DeviceError> {
        assert!(at + dst.len() <= self.len, "inside the buffer");
        // SAFETY: as in `write`.
        unsafe { lane.download(dst.as_ptr(), self.addr() + at, dst.len())? };
        lane.wait()
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.cuda.enter(self.ordinal).is_ok() {
            // SAFETY: allocated by cuMemAlloc, freed once.
            unsafe { (self.cuda.api.mem_free)(self.ptr) };
        }
    }
}
