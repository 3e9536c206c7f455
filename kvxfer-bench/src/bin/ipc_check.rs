//! `ipc_check`: libkvxfer's CUDA IPC layer (`kvxfer::cuda::ipc`, `kvxfer::transport::fdpass`)
//! between two processes on one GPU, for scripts/gpu-check.sh: byte-exact scattered
//! pages, and the figure, IPC copies against a plain device-to-device copy of
//! the same pages in one process (target: >= 0.8x).
//!
//!     ipc_check legacy|vmm [--item BYTES] [--pages N] [--reps N]
//!
//! The process runs itself again as the exporter (`--child`), which allocates the
//! source pages (`legacy`: one `cuMemAlloc`; `vmm`: `cuMemCreate` chunks of 2 MiB or the
//! driver's granularity, mapped one after the other into one reserved range, exportable
//! as POSIX file descriptors, as PyTorch's expandable segments allocate), fills them,
//! exports them and passes the descriptors. This process takes them, imports them and
//! copies the pages, in reversed order, into memory of its own. One JSON line at the end.
//!
//! This checks the layer, not the engine: the engine does not take the IPC path yet.
//! With KVXFER_CUDA_LIBRARY pointing at tests/fakecuda's library it runs without a GPU,
//! to check the program itself; its figures then mean nothing.

use std::ffi::{c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer::cuda::driver::{self, Context, CuDevicePtr, CuHandle, Driver, MemAccessDesc};
use kvxfer::cuda::ipc::{self, DtoD, Imports};
use kvxfer::transport::fdpass::{self, FdOffer};
use kvxfer::{BufferDesc, MemKind};

/// `CUmemAllocationProp`.
#[repr(C)]
struct AllocProp {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

type R = c_int;

/// The driver calls this program makes itself (allocations and plain copies).
struct Extra {
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> R,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> R,
    granularity: unsafe extern "C" fn(*mut usize, *const AllocProp, c_int) -> R,
    create: unsafe extern "C" fn(*mut u64, usize, *const AllocProp, u64) -> R,
    htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> R,
    dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> R,
    stream_sync: unsafe extern "C" fn(CuHandle) -> R,
    _lib: libloading::Library,
}

impl Extra {
    fn load() -> Extra {
        let path = driver::library_path();
        // SAFETY: the CUDA driver (or the file KVXFER_CUDA_LIBRARY names), already loaded
        // by the library; another reference to it.
        let lib = unsafe { libloading::Library::new(&path) }.expect("the CUDA driver loads");
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the driver's entry point of this name, with the C signature of
                // the field it is stored in (cuda.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .unwrap_or_else(|e| panic!("{}: {e}", $name))
            };
        }
        Extra {
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            granularity: sym!("cuMemGetAllocationGranularity"),
            create: sym!("cuMemCreate"),
            htod: sym!("cuMemcpyHtoD_v2"),
            dtoh: sym!("cuMemcpyDtoH_v2"),
            stream_sync: sym!("cuStreamSynchronize"),
            _lib: lib,
        }
    }
}

struct Gpu {
    d: &'static Driver,
    ctx: Context,
    x: Extra,
}

impl Gpu {
    fn new() -> Gpu {
        let d = driver::load().expect("the CUDA driver");
        let ctx = d.primary_context(0).expect("device 0");
        Gpu {
            d,
            ctx,
            x: Extra::load(),
        }
    }

    fn ok(&self, what: &str, f: impl FnOnce() -> R) {
        let r = self.d.with_context(self.ctx, f).expect("context");
        if let Err(e) = self.d.check(r) {
            panic!("{what}: {e}");
        }
    }

    /// `len` bytes of cudaMalloc-style memory.
    fn alloc(&self, len: usize) -> u64 {
        let mut p = 0;
        // SAFETY: writes one device pointer.
        self.ok("cuMemAlloc", || unsafe { (self.x.mem_alloc)(&mut p, len) });
        p
    }

    /// `len` bytes (rounded up to chunks) of VMM memory in chunks of 2 MiB (or the
    /// granularity), each its own allocation exportable as a POSIX descriptor.
    fn alloc_vmm(&self, len: usize) -> u64 {
        let api = self.d.ipc().expect("the IPC entry points");
        let prop = AllocProp {
            kind: 1,
            handle_types: driver::MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            location_type: driver::MEM_LOCATION_TYPE_DEVICE,
            location_id: 0,
            win32: std::ptr::null_mut(),
            flags: [0; 8],
        };
        let mut g = 0usize;
        // SAFETY: writes one size_t.
        self.ok("cuMemGetAllocationGranularity", || unsafe {
            (self.x.granularity)(&mut g, &prop, 0)
        });
        let chunk = (2usize << 20).div_ceil(g) * g;
        let n = len.div_ceil(chunk).max(2);
        let mut base = 0;
        // SAFETY: writes one address of a fresh reservation.
        self.ok("cuMemAddressReserve", || unsafe {
            (api.cuMemAddressReserve)(&mut base, n * chunk, 0, 0, 0)
        });
        let access = MemAccessDesc {
            location_type: driver::MEM_LOCATION_TYPE_DEVICE,
            location_id: 0,
            flags: driver::MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for i in 0..n {
            let at = base + (i * chunk) as u64;
            let mut h = 0u64;
            // SAFETY: creates one allocation, maps it at its place in the reservation,
            // grants access, and drops our handle reference (the mapping keeps it).
            self.ok("cuMemCreate", || unsafe {
                (self.x.create)(&mut h, chunk, &prop, 0)
            });
            // SAFETY: as above.
            self.ok("cuMemMap", || unsafe { (api.cuMemMap)(at, chunk, 0, h, 0) });
            // SAFETY: as above.
            self.ok("cuMemSetAccess", || unsafe {
                (api.cuMemSetAccess)(at, chunk, &access, 1)
            });
            // SAFETY: as above.
            self.ok("cuMemRelease", || unsafe { (api.cuMemRelease)(h) });
        }
        base
    }

    fn upload(&self, dst: u64, src: &[u8]) {
        // SAFETY: copies src.len() bytes into device memory we allocated.
        self.ok("cuMemcpyHtoD", || unsafe {
            (self.x.htod)(dst, src.as_ptr().cast(), src.len())
        });
    }

    fn download(&self, src: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: copies len bytes of device memory we own into v.
        self.ok("cuMemcpyDtoH", || unsafe {
            (self.x.dtoh)(v.as_mut_ptr().cast(), src, len)
        });
        v
    }
}

fn pattern(page: usize, item: usize) -> Vec<u8> {
    (0..item)
        .map(|o| (page * 131 + o % 253 + o / 4096) as u8)
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

fn child(alloc: &str, item: usize, pages: usize) {
    let gpu = Gpu::new();
    let len = item * pages;
    let base = if alloc == "vmm" {
        gpu.alloc_vmm(len)
    } else {
        gpu.alloc(len)
    };
    for p in 0..pages {
        gpu.upload(base + (p * item) as u64, &pattern(p, item));
    }
    let buf = BufferDesc {
        kind: MemKind::Cuda { device: 0 },
        ..BufferDesc::host(base as usize, len, item)
    };
    let exports = match ipc::export(&[buf]) {
        Ok(e) => e,
        Err(e) => {
            println!("ERROR {e}");
            return;
        }
    };
    let offer = FdOffer::bind().expect("a Unix socket");
    println!(
        "OFFER {} {} {} {base} {}",
        hex(offer.name()),
        hex(&offer.nonce()),
        hex(&ipc::encode(&exports.ranges)),
        exports.fds.len()
    );
    std::io::stdout().flush().unwrap();
    let taker: u32 = std::env::var("KVXFER_IPC_TAKER").unwrap().parse().unwrap();
    let fds: Vec<_> = exports.fds.iter().map(|f| f.as_fd()).collect();
    offer
        .give(taker, &fds, Duration::from_secs(30))
        .expect("the descriptors are taken");
    for line in std::io::stdin().lock().lines() {
        if line.unwrap() == "quit" {
            break;
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let alloc = args.get(1).cloned().unwrap_or_default();
    if alloc != "legacy" && alloc != "vmm" {
        eprintln!("usage: ipc_check legacy|vmm [--item BYTES] [--pages N] [--reps N]");
        std::process::exit(2);
    }
    let item = arg(&args, "--item", 1 << 20);
    let pages = arg(&args, "--pages", 64);
    let reps = arg(&args, "--reps", 20);
    if args.iter().any(|a| a == "--child") {
        return child(&alloc, item, pages);
    }
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            &alloc,
            "--child",
            "--item",
            &item.to_string(),
            "--pages",
            &pages.to_string(),
        ])
        .env("KVXFER_IPC_TAKER", std::process::id().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the exporter starts");
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let mut stdin = c.stdin.take().unwrap();
    let result = parent(&alloc, item, pages, reps, line.trim(), c.id());
    let _ = writeln!(stdin, "quit");
    let _ = c.wait();
    println!("{result}");
    if !result.contains("\"ok\": true") {
        std::process::exit(1);
    }
}

fn parent(alloc: &str, item: usize, pages: usize, reps: usize, line: &str, pid: u32) -> String {
    let fail = |why: String| {
        format!(
            "{{\"case\": \"ipc\", \"alloc\": \"{alloc}\", \"ok\": false, \"why\": {:?}}}",
            why
        )
    };
    if let Some(why) = line.strip_prefix("ERROR ") {
        return fail(format!("the exporter: {why}"));
    }
    let w: Vec<&str> = line.split(' ').collect();
    if w.len() != 6 || w[0] != "OFFER" {
        return fail(format!("the exporter said {line:?}"));
    }
    let (name, nonce) = (unhex(w[1]), unhex(w[2]));
    let ranges = ipc::decode(&unhex(w[3])).expect("ranges");
    let src: u64 = w[4].parse().unwrap();
    let n_fds: usize = w[5].parse().unwrap();
    let t0 = Instant::now();
    let fds = match fdpass::take(
        &name,
        &nonce.try_into().unwrap(),
        pid,
        n_fds,
        Duration::from_secs(30),
    ) {
        Ok(f) => f,
        Err(e) => return fail(format!("taking the descriptors: {e}")),
    };
    let table = match Imports::open(0, &ranges, fds) {
        Ok(t) => t,
        Err(e) => return fail(format!("importing: {e}")),
    };
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    let gpu = Gpu::new();
    let dst = gpu.alloc(item * pages);
    // Page p of the source goes to page pages-1-p here: scattered single-page runs.
    let runs: Vec<(u64, u64, u64)> = (0..pages)
        .map(|p| {
            (
                dst + ((pages - 1 - p) * item) as u64,
                src + (p * item) as u64,
                item as u64,
            )
        })
        .collect();
    let copier = DtoD::new(0).expect("a copier");
    if let Err(e) = copier.copy(&table, &runs) {
        return fail(format!("copying: {e}"));
    }
    for p in 0..pages {
        let got = gpu.download(dst + ((pages - 1 - p) * item) as u64, item);
        if got != pattern(p, item) {
            return fail(format!("source page {p} arrived different"));
        }
    }
    // Refused: a source just past the exported memory.
    let end = ranges.iter().map(|r| r.base + r.len).max().unwrap();
    if copier.copy(&table, &[(dst, end - 1, 2)]).is_ok() {
        return fail("a source outside the exported ranges was copied".into());
    }
    // The figure: the same runs through IPC, and between two allocations of this
    // process with the same copies on a stream of its own.
    let t = Instant::now();
    for _ in 0..reps {
        copier.copy(&table, &runs).expect("copy");
    }
    let ipc_s = t.elapsed().as_secs_f64();
    let local = gpu.alloc(item * pages);
    let plain: Vec<(u64, u64, u64)> = runs
        .iter()
        .map(|&(d, s, n)| (d, local + (s - src), n))
        .collect();
    let api = gpu.d.ipc().expect("IPC entry points");
    let mut stream: CuHandle = std::ptr::null_mut();
    // SAFETY: writes one stream handle.
    gpu.ok("cuStreamCreate", || unsafe {
        (gpu.d.cuStreamCreate)(&mut stream, driver::STREAM_NON_BLOCKING)
    });
    let t = Instant::now();
    for _ in 0..reps {
        for &(d, s, n) in &plain {
            // SAFETY: both ranges are our own allocations; waited for below.
            gpu.ok("cuMemcpyDtoDAsync", || unsafe {
                (api.cuMemcpyDtoDAsync_v2)(d, s, n as usize, stream)
            });
        }
        // SAFETY: our stream.
        gpu.ok("cuStreamSynchronize", || unsafe {
            (gpu.x.stream_sync)(stream)
        });
    }
    let plain_s = t.elapsed().as_secs_f64();
    let bytes = (reps * pages * item) as f64;
    let (ipc_gbps, plain_gbps) = (bytes / ipc_s / 1e9, bytes / plain_s / 1e9);
    drop(table);
    // SAFETY: our allocations, no copy pending.
    gpu.ok("cuMemFree", || unsafe { (gpu.x.mem_free)(dst) });
    // SAFETY: as above.
    gpu.ok("cuMemFree", || unsafe { (gpu.x.mem_free)(local) });
    format!(
        "{{\"case\": \"ipc\", \"alloc\": \"{alloc}\", \"ok\": true, \"item\": {item}, \
         \"pages\": {pages}, \"reps\": {reps}, \"ranges\": {}, \"setup_ms\": {setup_ms:.2}, \
         \"ipc_gbps\": {ipc_gbps:.3}, \"plain_gbps\": {plain_gbps:.3}, \"ratio\": {:.3}}}",
        ranges.len(),
        ipc_gbps / plain_gbps
    )
}
