//! The CUDA driver API, loaded at run time: a table of the driver symbols the library
//! uses, resolved with `dlopen` (through `libloading`) from `libcuda.so.1`, or from the
//! file named by `KVXFER_CUDA_LIBRARY`. Nothing of CUDA is needed at build time, and on
//! a host without the driver only the calls that need it fail, with a message that
//! names what is missing.
//!
//! A loaded driver is never unloaded (its function pointers live as long as the
//! process); each library path is loaded once.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use parking_lot::Mutex;

use crate::err;
use crate::error::Result;

/// The environment variable that names the driver library to load instead of
/// [`DEFAULT_LIBRARY`].
pub const LIBRARY_ENV: &str = "KVXFER_CUDA_LIBRARY";
/// The driver library loaded by default.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// `CUresult`: 0 is success.
pub type CuResult = c_int;
/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUdeviceptr`.
pub type CuDevicePtr = u64;
/// `CUcontext`, `CUstream`, `CUevent`: opaque handles.
pub type CuHandle = *mut c_void;

/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_NOT_READY`: `cuEventQuery` of work still running.
pub const CUDA_ERROR_NOT_READY: CuResult = 600;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (a `CUmemorytype`, 32 bits).
pub const ATTR_MEMORY_TYPE: c_uint = 2;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (an int).
pub const ATTR_DEVICE_ORDINAL: c_uint = 9;
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` (a `CUdeviceptr`).
pub const ATTR_RANGE_START_ADDR: c_uint = 11;
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE` (a `size_t`).
pub const ATTR_RANGE_SIZE: c_uint = 12;
/// `CU_MEMORYTYPE_DEVICE`.
pub const MEMORYTYPE_DEVICE: c_uint = 2;
/// `CU_EVENT_DISABLE_TIMING`.
pub const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_STREAM_NON_BLOCKING`.
pub const STREAM_NON_BLOCKING: c_uint = 1;

macro_rules! driver_table {
    ($(#[$doc:meta])* $table:ident { $($name:ident: fn($($arg:ty),*);)* }) => {
        $(#[$doc])*
        #[allow(non_snake_case)]
        pub struct $table {
            /// Where it was loaded from.
            pub path: String,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> CuResult,)*
            _lib: libloading::Library,
        }

        impl $table {
            fn resolve(path: &str, lib: libloading::Library) -> Result<$table> {
                Ok($table {
                    path: path.to_string(),
                    $($name: {
                        // SAFETY: the symbol is the CUDA driver's entry point of this
                        // name, whose C signature the field's type spells out (from
                        // cuda.h); the library stays loaded as long as `self`, and
                        // drivers are never dropped (see `load`).
                        let sym = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        }
                        .map_err(|e| {
                            err!(
                                TransportUnavailable,
                                "the CUDA driver {path} lacks {}: {e}",
                                stringify!($name)
                            )
                        })?;
                        *sym
                    },)*
                    _lib: lib,
                })
            }
        }
    };
}

driver_table! {
    /// The driver entry points the library uses (each returns a `CUresult`).
    Driver {
    cuInit: fn(c_uint);
    cuDeviceGetCount: fn(*mut c_int);
    cuDeviceGet: fn(*mut CuDevice, c_int);
    cuDevicePrimaryCtxRetain: fn(*mut CuHandle, CuDevice);
    cuCtxPushCurrent_v2: fn(CuHandle);
    cuCtxPopCurrent_v2: fn(*mut CuHandle);
    cuPointerGetAttribute: fn(*mut c_void, c_uint, CuDevicePtr);
    cuGetErrorString: fn(CuResult, *mut *const c_char);
    cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint);
    cuMemFreeHost: fn(*mut c_void);
    cuStreamCreate: fn(*mut CuHandle, c_uint);
    cuStreamDestroy_v2: fn(CuHandle);
    cuStreamSynchronize: fn(CuHandle);
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, CuDevicePtr, usize, CuHandle);
    cuMemcpyHtoDAsync_v2: fn(CuDevicePtr, *const c_void, usize, CuHandle);
    cuEventCreate: fn(*mut CuHandle, c_uint);
    cuEventDestroy_v2: fn(CuHandle);
    cuEventRecord: fn(CuHandle, CuHandle);
    cuEventQuery: fn(CuHandle);
    cuEventSynchronize: fn(CuHandle);
    }
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcMemHandle(pub [u8; 64]);

driver_table! {
    /// The entry points of CUDA IPC ([`super::ipc`]), resolved apart from [`Driver`] and
    /// only when the IPC path is set up: a driver without them still moves device pages
    /// over TCP staging.
    IpcApi {
    cuIpcGetMemHandle: fn(*mut IpcMemHandle, CuDevicePtr);
    cuIpcOpenMemHandle_v2: fn(*mut CuDevicePtr, IpcMemHandle, c_uint);
    cuIpcCloseMemHandle: fn(CuDevicePtr);
    cuMemRetainAllocationHandle: fn(*mut u64, *mut c_void);
    cuMemRelease: fn(u64);
    cuMemExportToShareableHandle: fn(*mut c_void, u64, c_int, u64);
    cuMemImportFromShareableHandle: fn(*mut u64, *mut c_void, c_int);
    cuMemAddressReserve: fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, u64);
    cuMemAddressFree: fn(CuDevicePtr, usize);
    cuMemMap: fn(CuDevicePtr, usize, usize, u64, u64);
    cuMemSetAccess: fn(CuDevicePtr, usize, *const MemAccessDesc, usize);
    cuMemUnmap: fn(CuDevicePtr, usize);
    cuMemcpyDtoDAsync_v2: fn(CuDevicePtr, CuDevicePtr, usize, CuHandle);
    cuDeviceGetUuid: fn(*mut [u8; 16], CuDevice);
    cuDeviceCanAccessPeer: fn(*mut c_int, CuDevice, CuDevice);
    }
}

/// `CUmemAccessDesc`: a location (`CUmemLocation`: type, id) and the access flags.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemAccessDesc {
    pub location_type: c_int,
    pub location_id: c_int,
    pub flags: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub const MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

// SAFETY: as for Driver: function pointers of the thread-safe driver API, and the
// library handle, which only keeps the library loaded.
unsafe impl Send for IpcApi {}
// SAFETY: as for Send: nothing in the table is mutated after `resolve`.
unsafe impl Sync for IpcApi {}

/// IPC tables resolved so far, by driver path: never freed.
static IPC: Mutex<Option<HashMap<String, &'static IpcApi>>> = Mutex::new(None);

// SAFETY: the table holds function pointers of a thread-safe C library (the CUDA driver
// API may be called from any thread) and the library handle, which is never used after
// loading except to keep it loaded.
unsafe impl Send for Driver {}
// SAFETY: as for Send: nothing in the table is mutated after `resolve`.
unsafe impl Sync for Driver {}

/// A device's primary context, retained (never released): made only by
/// [`Driver::primary_context`].
#[derive(Debug, Clone, Copy)]
pub struct Context(CuHandle);

// SAFETY: a CUDA context handle may be used from any thread (made current on each).
unsafe impl Send for Context {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Context {}

/// Drivers loaded so far, by path: never freed, so their function pointers stay valid.
static LOADED: Mutex<Option<HashMap<String, &'static Driver>>> = Mutex::new(None);

/// The driver library to load: `KVXFER_CUDA_LIBRARY` if set and not empty, else
/// [`DEFAULT_LIBRARY`].
pub fn library_path() -> String {
    std::env::var(LIBRARY_ENV)
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| DEFAULT_LIBRARY.to_string())
}

/// The CUDA driver, loaded (once per library path) and initialized (`cuInit`, every
/// call: it is cheap once done, and a failure is reported, never cached). Errors are
/// `TransportUnavailable`, naming the library and what is missing.
pub fn load() -> Result<&'static Driver> {
    let path = library_path();
    let driver = {
        let mut loaded = LOADED.lock();
        let map = loaded.get_or_insert_with(HashMap::new);
        match map.get(&path) {
            Some(d) => *d,
            None => {
                // SAFETY: loading runs the library's initializers: the CUDA driver's (or
                // the file the operator named in KVXFER_CUDA_LIBRARY, which is trusted
                // like the library path itself).
                let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| {
                    err!(
                        TransportUnavailable,
                        "CUDA device memory needs the CUDA driver, and {path} cannot be \
                         loaded ({e}); install the NVIDIA driver or set {LIBRARY_ENV}"
                    )
                })?;
                let d: &'static Driver = Box::leak(Box::new(Driver::resolve(&path, lib)?));
                map.insert(path.clone(), d);
                d
            }
        }
    };
    // SAFETY: cuInit takes flags (0) and may be called any number of times.
    driver
        .check(unsafe { (driver.cuInit)(0) })
        .map_err(|e| err!(TransportUnavailable, "cuInit of {path} failed: {e}"))?;
    Ok(driver)
}

impl Driver {
    /// The CUDA IPC entry points of this driver, resolved on first use; an error names
    /// the symbol the driver lacks.
    pub fn ipc(&self) -> Result<&'static IpcApi> {
        let mut loaded = IPC.lock();
        let map = loaded.get_or_insert_with(HashMap::new);
        if let Some(t) = map.get(&self.path) {
            return Ok(*t);
        }
        // SAFETY: the library is already loaded (this driver holds it): dlopen of the
        // same path only takes another reference and runs no initializer again.
        let lib = unsafe { libloading::Library::new(&self.path) }.map_err(|e| {
            err!(
                TransportUnavailable,
                "reopening the CUDA driver {}: {e}",
                self.path
            )
        })?;
        let t: &'static IpcApi = Box::leak(Box::new(IpcApi::resolve(&self.path, lib)?));
        map.insert(self.path.clone(), t);
        Ok(t)
    }

    /// `Ok` for `CUDA_SUCCESS`, else the driver's description of `r`.
    pub fn check(&self, r: CuResult) -> std::result::Result<(), String> {
        if r == 0 {
            Ok(())
        } else {
            Err(self.describe(r))
        }
    }

    /// The driver's text for `r`, with the code.
    pub fn describe(&self, r: CuResult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static NUL-terminated string
        // (or fails and writes nothing).
        let ok = unsafe { (self.cuGetErrorString)(r, &mut s) } == 0;
        if ok && !s.is_null() {
            // SAFETY: a static C string of the driver.
            let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
            format!("{text} (CUresult {r})")
        } else {
            format!("CUresult {r}")
        }
    }

    /// How many CUDA devices the driver sees.
    pub fn device_count(&self) -> Result<u32> {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        self.check(unsafe { (self.cuDeviceGetCount)(&mut n) })
            .map_err(|e| err!(TransportUnavailable, "cuDeviceGetCount failed: {e}"))?;
        Ok(n.max(0) as u32)
    }

    /// Device `ordinal`'s primary context, retained (it stays alive for the process;
    /// the library never releases it, as the CUDA runtime does not either).
    pub fn primary_context(&self, ordinal: u32) -> Result<Context> {
        let n = self.device_count()?;
        if n == 0 {
            return Err(err!(
                TransportUnavailable,
                "the CUDA driver ({}) sees no CUDA device",
                self.path
            ));
        }
        let dev = self.device_among(ordinal, n)?;
        let mut ctx: CuHandle = std::ptr::null_mut();
        // SAFETY: writes one context handle for a valid device.
        self.check(unsafe { (self.cuDevicePrimaryCtxRetain)(&mut ctx, dev) })
            .map_err(|e| {
                err!(
                    TransportUnavailable,
                    "cuDevicePrimaryCtxRetain({ordinal}) failed: {e}"
                )
            })?;
        Ok(Context(ctx))
    }

    /// The `CUdevice` of ordinal `ordinal` (checked against the device count).
    pub fn device(&self, ordinal: u32) -> Result<CuDevice> {
        self.device_among(ordinal, self.device_count()?)
    }

    /// The `CUdevice` of ordinal `ordinal`, one of the `n` devices the driver sees.
    fn device_among(&self, ordinal: u32, n: u32) -> Result<CuDevice> {
        if ordinal >= n {
            return Err(err!(
                InvalidArgument,
                "CUDA device {ordinal} does not exist (the driver sees {n})"
            ));
        }
        let mut dev: CuDevice = 0;
        // SAFETY: writes one CUdevice; ordinal checked against the count.
        self.check(unsafe { (self.cuDeviceGet)(&mut dev, ordinal as c_int) })
            .map_err(|e| err!(TransportUnavailable, "cuDeviceGet({ordinal}) failed: {e}"))?;
        Ok(dev)
    }

    /// Runs `f` with `ctx` current on this thread, restoring the thread's context after:
    /// the library leaves the host's threads as it found them.
    pub fn with_context<T>(&self, ctx: Context, f: impl FnOnce() -> T) -> Result<T> {
        // SAFETY: a Context is a retained primary context (made only by
        // `primary_context`, never released).
        self.check(unsafe { (self.cuCtxPushCurrent_v2)(ctx.0) })
            .map_err(|e| err!(TransportUnavailable, "cuCtxPushCurrent failed: {e}"))?;
        let out = f();
        let mut popped: CuHandle = std::ptr::null_mut();
        // SAFETY: pops what was pushed above.
        let _ = unsafe { (self.cuCtxPopCurrent_v2)(&mut popped) };
        Ok(out)
    }

    /// Reads a pointer attribute of at most 8 bytes (`T` must be the attribute's type).
    pub fn pointer_attribute<T: Copy + Default>(
        &self,
        attr: c_uint,
        ptr: u64,
    ) -> std::result::Result<T, CuResult> {
        let mut v = T::default();
        // SAFETY: the driver writes the attribute's value, of type T by the caller's
        // choice of attribute, into `v`.
        let r = unsafe { (self.cuPointerGetAttribute)((&mut v as *mut T).cast(), attr, ptr) };
        if r == 0 {
            Ok(v)
        } else {
            Err(r)
        }
    }
}
