//! The CUDA driver's test double (tests/fakecuda/fakecuda.c), built with `cc` into the
//! test's target dir, and the process-wide settings that point the engine at it. It
//! proves the engine's use of the driver API and its pipelines, not GPU behaviour.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Mutex;

/// The driver library path and the fake's knobs are process-wide: one test at a time.
static ENV: Mutex<()> = Mutex::new(());

/// Builds tests/fakecuda/fakecuda.c into the test's target dir (once per run).
pub fn fakecuda() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fakecuda/fakecuda.c");
            let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("libfakecuda.so");
            // Built under a name of this process's, then renamed: another test binary
            // may be loading the library meanwhile.
            let tmp = out.with_extension(format!("so.{}", std::process::id()));
            let st = std::process::Command::new("cc")
                .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
                .arg(&tmp)
                .arg(&src)
                .status()
                .expect("a C compiler (cc) builds the fake CUDA driver");
            assert!(st.success(), "building {}", src.display());
            std::fs::rename(&tmp, &out).unwrap();
            out
        })
        .clone()
}

/// The fake's test API, from the same loaded library the engine uses.
pub struct Fake {
    lib: libloading::Library,
}

impl Fake {
    pub fn open() -> Fake {
        // SAFETY: the fake driver has no initializers beyond libc's.
        let lib = unsafe { libloading::Library::new(fakecuda()) }.unwrap();
        Fake { lib }
    }

    pub fn alloc(&self, device: i32, size: usize) -> usize {
        // SAFETY: the fake's own signature.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(i32, usize) -> *mut c_void>(b"fakecuda_alloc\0")
        }
        .unwrap();
        // SAFETY: allocates; NULL on failure.
        let p = unsafe { f(device, size) } as usize;
        assert_ne!(p, 0);
        p
    }

    pub fn alloc_vmm(&self, device: i32, chunk: usize, n: i32) -> usize {
        // SAFETY: the fake's own signature.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(i32, usize, i32) -> *mut c_void>(
                    b"fakecuda_alloc_vmm\0",
                )
        }
        .unwrap();
        // SAFETY: allocates; NULL on failure.
        let p = unsafe { f(device, chunk, n) } as usize;
        assert_ne!(p, 0);
        p
    }

    pub fn free(&self, p: usize) {
        // SAFETY: the fake's own signature.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(*mut c_void)>(b"fakecuda_free\0")
        }
        .unwrap();
        // SAFETY: p came from alloc or alloc_vmm.
        unsafe { f(p as *mut c_void) };
    }
}

/// Runs `f` with the driver library and the fake's knobs set as given, one at a time.
pub fn with_env(library: &str, knobs: &[(&str, &str)], f: impl FnOnce()) {
    let _one = ENV.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("KVXFER_CUDA_LIBRARY", library);
    for k in ["FAKECUDA_INIT_ERROR", "FAKECUDA_DEVICES"] {
        std::env::remove_var(k);
    }
    for (k, v) in knobs {
        std::env::set_var(k, v);
    }
    f();
}
