//! CUDA IPC between two processes, on the CUDA driver's test double
//! (tests/fakecuda/fakecuda.c): the exporting process (the test binary run again as its
//! `child_exporter` test) exports the device allocations of its buffers, legacy IPC
//! handles for cudaMalloc-style memory and POSIX file descriptors for VMM memory, and
//! passes the descriptors over a Unix socket; this process takes them (checking the
//! socket is the exporter's), imports them into an import table and copies runs device
//! to device into its own device memory.
//!
//! What this proves: the handle protocol, the descriptor passing and its checks, the
//! import table's translation and refusals, and the library's use of the driver's IPC
//! and VMM entry points. Not GPU behaviour: the fake's "device" memory is host memory
//! (memfds mapped into both processes). The GPU run is scripts/gpu-check.sh.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use common::fakecuda::{fakecuda, with_env, Fake};
use common::{wait_state, wait_terminal, wait_until};
use kvxfer::cuda::ipc::{self, CopyError, DtoD, Imports};
use kvxfer::transport::fdpass::{self, FdOffer};
use kvxfer::State;
use kvxfer::{BufferDesc, MemKind};

/// Bytes of a page in these tests.
const PAGE: u64 = 4096;

/// The byte at `offset` of the exporter's buffer `b`.
fn source(b: usize, offset: u64) -> u8 {
    (offset / PAGE * 31 + offset % 251 + b as u64 * 101) as u8
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The exporting process: allocates buffers of the kind KVXFER_IPC_CHILD names
/// (`legacy`: two cudaMalloc-style allocations of 16 pages; `vmm`: two buffers of four
/// VMM chunks of 4 pages each), fills them, exports them, prints
/// `OFFER <name> <nonce> <ranges> <base of each buffer>` and gives the descriptors to
/// process KVXFER_IPC_TAKER; then waits for `quit`. Prints `ERROR <why>` if the export
/// fails.
#[test]
fn child_exporter() {
    let Ok(kind) = std::env::var("KVXFER_IPC_CHILD") else {
        return;
    };
    let fake = Fake::open();
    let bases: Vec<usize> = match kind.as_str() {
        "legacy" => (0..2).map(|_| fake.alloc(0, 16 * PAGE as usize)).collect(),
        _ => (0..2)
            .map(|_| fake.alloc_vmm(0, 4 * PAGE as usize, 4))
            .collect(),
    };
    let bufs: Vec<BufferDesc> = bases
        .iter()
        .enumerate()
        .map(|(b, &base)| {
            // SAFETY: 16 pages of the fake's "device" memory (host memory) we allocated.
            let m = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, 16 * PAGE as usize) };
            for (o, x) in m.iter_mut().enumerate() {
                *x = source(b, o as u64);
            }
            BufferDesc {
                kind: MemKind::Cuda { device: 0 },
                ..BufferDesc::host(base, 16 * PAGE as usize, PAGE as usize)
            }
        })
        .collect();
    let exports = match ipc::export(&bufs) {
        Ok(e) => e,
        Err(e) => {
            println!("ERROR {e}");
            return;
        }
    };
    let offer = FdOffer::bind().unwrap();
    let bases: Vec<String> = bases.iter().map(|b| b.to_string()).collect();
    println!(
        "OFFER {} {} {} {}",
        hex(offer.name()),
        hex(&offer.nonce()),
        hex(&ipc::encode(&exports.ranges)),
        bases.join(",")
    );
    std::io::stdout().flush().unwrap();
    let taker: u32 = std::env::var("KVXFER_IPC_TAKER").unwrap().parse().unwrap();
    let fds: Vec<_> = exports.fds.iter().map(|f| f.as_fd()).collect();
    offer.give(taker, &fds, Duration::from_secs(20)).unwrap();
    for line in std::io::stdin().lock().lines() {
        if line.unwrap() == "quit" {
            break;
        }
    }
}

/// A running exporter and what it offered.
struct Exporter {
    child: Child,
    stdin: ChildStdin,
    pid: u32,
    name: Vec<u8>,
    nonce: [u8; fdpass::NONCE_LEN],
    ranges: Vec<ipc::Exported>,
    bases: Vec<u64>,
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

/// Starts the exporter of `kind` with `env`; its first line, or the error it printed.
fn exporter(kind: &str, env: &[(&str, &str)]) -> Result<Exporter, String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_exporter",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVXFER_IPC_CHILD", kind)
        .env("KVXFER_IPC_TAKER", std::process::id().to_string())
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let line = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the exporter said nothing"
        );
        // The test harness prints "test child_exporter ... " before it.
        if let Some(at) = line.find("OFFER ").or_else(|| line.find("ERROR ")) {
            break line[at..].trim().to_string();
        }
    };
    let stdin = child.stdin.take().unwrap();
    if let Some(why) = line.strip_prefix("ERROR ") {
        let _ = child.wait();
        return Err(why.to_string());
    }
    let w: Vec<&str> = line.split(' ').collect();
    Ok(Exporter {
        pid: child.id(),
        child,
        stdin,
        name: unhex(w[1]),
        nonce: unhex(w[2]).try_into().unwrap(),
        ranges: ipc::decode(&unhex(w[3])).unwrap(),
        bases: w[4].split(',').map(|b| b.parse().unwrap()).collect(),
    })
}

/// Takes the exporter's descriptors and imports its ranges into device 0.
fn import(x: &Exporter) -> Imports {
    let n = x
        .ranges
        .iter()
        .filter(|r| matches!(r.handle, ipc::ExportHandle::Fd(_)))
        .count();
    let fds = fdpass::take(&x.name, &x.nonce, x.pid, n, Duration::from_secs(10)).unwrap();
    Imports::open(0, &x.ranges, fds).unwrap()
}

/// This process's device memory: `pages` pages, poisoned.
fn destination(fake: &Fake, pages: u64) -> (usize, &'static mut [u8]) {
    let base = fake.alloc(0, (pages * PAGE) as usize);
    // SAFETY: the fake's "device" memory (host memory) we allocated, never freed here.
    let m = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, (pages * PAGE) as usize) };
    m.fill(0xEE);
    (base, m)
}

/// Copies scattered single pages and a run of several pages from both of the exporter's
/// buffers into scattered destination pages, and checks every byte.
fn scattered_pages_arrive_byte_exact(kind: &str) {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let x = exporter(kind, &[]).unwrap();
        let table = import(&x);
        let fake = Fake::open();
        let (dst, mem) = destination(&fake, 32);
        // (buffer, first source page, pages, first destination page)
        let runs = [
            (0, 5u64, 1u64, 30u64),
            (1, 0, 1, 2),
            (0, 13, 1, 7),
            (1, 3, 6, 11),
            (0, 0, 1, 0),
        ];
        let copies: Vec<(u64, u64, u64)> = runs
            .iter()
            .map(|&(b, s, n, d)| (dst as u64 + d * PAGE, x.bases[b] + s * PAGE, n * PAGE))
            .collect();
        DtoD::new(0).unwrap().copy(&table, &copies).unwrap();
        let mut filled = [false; 32];
        for &(b, s, n, d) in &runs {
            for p in 0..n {
                let got = &mem[((d + p) * PAGE) as usize..((d + p + 1) * PAGE) as usize];
                for (o, &byte) in got.iter().enumerate() {
                    let want = source(b, (s + p) * PAGE + o as u64);
                    assert_eq!(byte, want, "{kind}: destination page {} byte {o}", d + p);
                }
                filled[(d + p) as usize] = true;
            }
        }
        for (p, f) in filled.iter().enumerate() {
            if !f {
                let page = &mem[p * PAGE as usize..(p + 1) * PAGE as usize];
                assert!(
                    page.iter().all(|&b| b == 0xEE),
                    "{kind}: page {p} was written"
                );
            }
        }
        drop(table);
        drop(x);
    });
}

#[test]
fn scattered_pages_of_cuda_malloc_memory_copy_byte_exact_through_legacy_ipc_handles() {
    scattered_pages_arrive_byte_exact("legacy");
}

#[test]
fn scattered_pages_of_vmm_memory_copy_byte_exact_through_file_descriptors_across_chunks() {
    // The run of 6 pages from page 3 crosses two of the exporter's VMM chunks (4 pages
    // each), which the import table maps apart.
    scattered_pages_arrive_byte_exact("vmm");
}

#[test]
fn the_exports_are_legacy_handles_for_cuda_malloc_memory_and_descriptors_for_vmm_chunks() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let legacy = exporter("legacy", &[]).unwrap();
        assert_eq!(legacy.ranges.len(), 2);
        assert!(legacy
            .ranges
            .iter()
            .all(|r| matches!(r.handle, ipc::ExportHandle::Legacy(_)) && r.len == 16 * PAGE));
        drop(import(&legacy));
        let vmm = exporter("vmm", &[]).unwrap();
        assert_eq!(vmm.ranges.len(), 8, "two buffers of four chunks");
        let mut idx: Vec<u32> = vmm
            .ranges
            .iter()
            .map(|r| match r.handle {
                ipc::ExportHandle::Fd(i) => i,
                h => panic!("{h:?}"),
            })
            .collect();
        idx.sort();
        assert_eq!(idx, (0..8).collect::<Vec<_>>());
        drop(import(&vmm));
    });
}

#[test]
fn a_source_outside_the_exported_ranges_is_refused_and_nothing_is_copied() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let x = exporter("vmm", &[]).unwrap();
        let table = import(&x);
        let fake = Fake::open();
        let (dst, mem) = destination(&fake, 4);
        let copier = DtoD::new(0).unwrap();
        // Below every exported range, straddling the end of the last one, and this
        // process's own memory.
        let low = x.ranges.iter().map(|r| r.base).min().unwrap();
        let high = x.ranges.iter().map(|r| r.base + r.len).max().unwrap();
        // A good run first: it must not be copied either, since the batch is refused whole.
        for bad in [low - PAGE, high - PAGE / 2, dst as u64] {
            let runs = [
                (dst as u64, x.bases[1], PAGE),
                (dst as u64 + PAGE, bad, PAGE),
            ];
            match copier.copy(&table, &runs) {
                Err(CopyError::Outside(why)) => assert!(why.contains("outside"), "{why}"),
                other => panic!("a source at {bad:#x}: {other:?}"),
            }
            assert!(
                mem.iter().all(|&b| b == 0xEE),
                "bytes landed from a refused batch"
            );
        }
    });
}

#[test]
fn a_range_longer_than_what_its_legacy_handle_opens_is_refused_at_import() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let x = exporter("legacy", &[]).unwrap();
        // Legacy handles need no descriptors: the offer gives none.
        let fds = fdpass::take(&x.name, &x.nonce, x.pid, 0, Duration::from_secs(10)).unwrap();
        assert!(fds.is_empty());
        let mut ranges = x.ranges.clone();
        // The peer's word says 16 pages and one more: the driver's mapping has 16.
        ranges[0].len += PAGE;
        let e = Imports::open(0, &ranges, Vec::new())
            .err()
            .expect("refused");
        assert!(e.message().contains("claims"), "{e}");
        // As exported, the same ranges import.
        assert_eq!(Imports::open(0, &x.ranges, Vec::new()).unwrap().len(), 2);
    });
}

#[test]
fn an_export_the_driver_refuses_names_the_allocation_and_the_driver_error() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let why = exporter("legacy", &[("FAKECUDA_EXPORT_ERROR", "2")])
            .err()
            .expect("the export fails");
        assert!(
            why.contains("cuIpcGetMemHandle") && why.contains("out of memory"),
            "{why}"
        );
        let why = exporter("vmm", &[("FAKECUDA_EXPORT_ERROR", "2")])
            .err()
            .expect("the export fails");
        assert!(
            why.contains("cuMemExportToShareableHandle")
                && why.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"),
            "{why}"
        );
    });
}

#[test]
fn descriptors_offered_to_another_process_are_not_given_and_a_wrong_exporter_pid_is_refused() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let x = exporter("vmm", &[]).unwrap();
        // Told another exporter pid: refused before the nonce goes out.
        let e = fdpass::take(&x.name, &x.nonce, x.pid + 1, 8, Duration::from_secs(5)).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("belongs to process {}", x.pid)),
            "{e}"
        );
        // The right one, after: the offer is still open, and gives them.
        drop(import(&x));
    });
}

// ---- The engine over the CUDA IPC path: a prefill engine in a second process ----

/// KV pages of the engine tests' buffers.
const EPAGES: usize = 32;
/// Bytes of an aux slot (host memory on both sides: it crosses by process_vm_readv).
const AUX: usize = 64;

/// The byte at `offset` of prefill rank `rank`'s kv buffer `b`.
fn esource(rank: usize, b: usize, offset: usize) -> u8 {
    (offset as u8).wrapping_mul(13)
        ^ ((b + 4 * rank) as u8).wrapping_mul(101)
        ^ ((offset / 4096) as u8)
}

/// A layout of `kv_heads` 2 for head slices (HND pages of 16 tokens, 64 x 2 bytes a
/// head): `tp` ranks.
fn layout(rank: u32, tp: u32) -> kvxfer::KvLayout {
    kvxfer::KvLayout {
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
        tp_rank: rank,
        tp_size: tp,
        page_tokens: 16,
        order: kvxfer::PageOrder::Hnd,
        kind: kvxfer::KvKind::Heads,
    }
}

fn ipc_engine(role: &str, extra: &[(&str, &str)]) -> kvxfer::Engine {
    let mut keys = vec![
        ("transport", "tcp"),
        ("same_host", "require"),
        ("integrity", "off"),
        ("heartbeat_interval_ms", "100"),
    ];
    keys.extend_from_slice(extra);
    common::start(role, &keys, common::quiet())
}

/// Device memory of `bufs` kv buffers of EPAGES pages of `item` bytes (`vmm`: each
/// buffer four VMM chunks), with `fill(b, offset)`.
fn device_buffers(
    fake: &Fake,
    vmm: bool,
    bufs: usize,
    item: usize,
    fill: impl Fn(usize, usize) -> u8,
) -> Vec<BufferDesc> {
    (0..bufs)
        .map(|b| {
            let len = EPAGES * item;
            let base = if vmm {
                fake.alloc_vmm(0, len / 4, 4)
            } else {
                fake.alloc(0, len)
            };
            // SAFETY: fake "device" memory (host memory) of len bytes we allocated.
            let m = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len) };
            for (o, x) in m.iter_mut().enumerate() {
                *x = fill(b, o);
            }
            BufferDesc {
                kind: MemKind::Cuda { device: 0 },
                ..BufferDesc::host(base, len, item)
            }
        })
        .collect()
}

/// The prefill process of the engine tests (KVXFER_IPC_PREFILL = `legacy` or `vmm`):
/// two device kv buffers (or, with KVXFER_IPC_LAYERS, four of layers 0, 0, 1, 1), of
/// EPAGES pages of 4 KiB (with KVXFER_IPC_TP=`rank/size`, 2 KiB pages of that head
/// slice), and one host aux buffer. Commands: `create R`, `chunk R LAST PAGES..`,
/// `layer R LAYER LAST PAGES..`, `abort R`, `quit`; after each, `OK` or `ERR why`.
#[test]
fn child_ipc_prefill() {
    let Ok(kind) = std::env::var("KVXFER_IPC_PREFILL") else {
        return;
    };
    let fake = Fake::open();
    let tp: Option<(u32, u32)> = std::env::var("KVXFER_IPC_TP").ok().map(|t| {
        let (r, s) = t.split_once('/').unwrap();
        (r.parse().unwrap(), s.parse().unwrap())
    });
    let rank = tp.map_or(0, |t| t.0 as usize);
    let layers = std::env::var_os("KVXFER_IPC_LAYERS").is_some();
    let (bufs, item) = match (tp, layers) {
        (Some(_), _) => (2, 2048),
        (None, true) => (4, 4096),
        (None, false) => (2, 4096),
    };
    let descs = device_buffers(&fake, kind == "vmm", bufs, item, |b, o| esource(rank, b, o));
    let aux = common::Region::new(4, AUX, |i| (i as u8).wrapping_mul(7) ^ 0x5c);
    let p = ipc_engine("prefill", &[("same_host", "auto")]);
    match (tp, layers) {
        (Some((r, s)), _) => p.register_kv_layout(descs, None, layout(r, s)).unwrap(),
        (None, true) => p.register_kv_layers(descs, vec![0, 0, 1, 1]).unwrap(),
        (None, false) => p.register_kv(descs).unwrap(),
    }
    p.register_aux(vec![aux.desc()]).unwrap();
    println!("ADDR {}", p.address());
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| w[i].parse::<u64>().unwrap();
        let pages =
            |from: usize| -> Vec<u32> { w[from..].iter().map(|x| x.parse().unwrap()).collect() };
        let r = match w[0] {
            "create" => p.room_create(n(1), kvxfer::RoomPeers::Decoders(1)),
            "chunk" => {
                let last = n(2) == 1;
                p.enqueue_chunk(n(1), &pages(3), last, last.then_some(2))
            }
            "layer" => {
                let last = n(3) == 1;
                p.enqueue_layers(n(1), &pages(4), n(2) as u32, 1, last, last.then_some(2))
            }
            "abort" => p.room_abort(n(1), "the prefill's client went away"),
            #[cfg(feature = "test-hooks")]
            "outside" => {
                kvxfer::testing::inject_fault("ipc.outside", n(1));
                Ok(())
            }
            "path" => {
                println!("PATH {:?}", p.room_path(n(1)).unwrap());
                Ok(())
            }
            _ => break,
        };
        match r {
            Ok(()) => println!("OK"),
            Err(e) => println!("ERR {e}"),
        }
        std::io::stdout().flush().unwrap();
    }
}

/// A prefill process of the engine tests.
struct Prefill(common::ChildPrefill);

impl Prefill {
    fn start(kind: &str, env: &[(&str, &str)]) -> Prefill {
        let mut env = env.to_vec();
        env.push(("KVXFER_IPC_PREFILL", kind));
        Prefill(common::ChildPrefill::spawn("child_ipc_prefill", &[], &env))
    }

    fn run(&mut self, cmd: &str) -> String {
        self.0.send(cmd);
        let line = self.0.line_after("");
        line.trim().to_string()
    }

    fn ok(&mut self, cmd: &str) {
        assert_eq!(self.run(cmd), "OK", "{cmd}");
    }
}

const EPOISON: u8 = 0xA5;

/// The decode side: device kv buffers (poisoned) and a host aux buffer.
struct Decode {
    _fake: Fake,
    e: kvxfer::Engine,
    kv: Vec<BufferDesc>,
    aux: common::Region,
}

impl Decode {
    fn new(
        vmm: bool,
        bufs: usize,
        item: usize,
        register: impl FnOnce(&kvxfer::Engine, Vec<BufferDesc>),
    ) -> Decode {
        let fake = Fake::open();
        let kv = device_buffers(&fake, vmm, bufs, item, |_, _| EPOISON);
        let aux = common::Region::new(4, AUX, |_| EPOISON);
        let e = ipc_engine("decode", &[]);
        register(&e, kv.clone());
        e.register_aux(vec![aux.desc()]).unwrap();
        Decode {
            _fake: fake,
            e,
            kv,
            aux,
        }
    }

    fn page(&self, b: usize, p: u32) -> &[u8] {
        let d = &self.kv[b];
        // SAFETY: fake device memory of the decode's buffer, read once no copy lands
        // (after SUCCESS or room_drained).
        unsafe {
            std::slice::from_raw_parts((d.base + p as usize * d.item_len) as *const u8, d.item_len)
        }
    }
}

fn expected(rank: usize, b: usize, item: usize, p: u32) -> Vec<u8> {
    (0..item)
        .map(|o| esource(rank, b, p as usize * item + o))
        .collect()
}

fn device_pages_arrive_byte_exact_through_cuda_ipc(kind: &str) {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let mut p = Prefill::start(kind, &[]);
        let d = Decode::new(kind == "vmm", 2, 4096, |e, kv| e.register_kv(kv).unwrap());
        let src = [5u32, 0, 13, 14, 15, 16, 17, 31, 2];
        let dst = [30u32, 1, 7, 8, 9, 10, 11, 3, 20];
        p.ok("create 1");
        d.e.room_create(1, kvxfer::RoomPeers::Prefills(vec![p.0.addr.clone()]))
            .unwrap();
        d.e.room_set_destination(1, &dst, Some(1)).unwrap();
        p.ok("chunk 1 0 5 0 13 14");
        p.ok("chunk 1 1 15 16 17 31 2");
        let s = wait_terminal(&d.e, 1);
        assert_eq!(s, State::Success, "{:?}", d.e.room_failure(1));
        assert_eq!(d.e.room_path(1).unwrap(), kvxfer::DataPath::CudaIpc);
        assert_eq!(p.run("path 1"), "PATH CudaIpc");
        let m = d.e.metrics();
        assert_eq!((m.pairings_cuda_ipc, m.same_host_fallbacks), (1, 0));
        assert!(
            !d.e.room_verified(1).unwrap(),
            "integrity is off: nothing verified"
        );
        for b in 0..2 {
            for (&s, &t) in src.iter().zip(&dst) {
                assert!(
                    d.page(b, t) == expected(0, b, 4096, s),
                    "{kind}: buffer {b} page {t}"
                );
            }
            for t in 0..EPAGES as u32 {
                if !dst.contains(&t) {
                    assert!(
                        d.page(b, t).iter().all(|&x| x == EPOISON),
                        "{kind}: page {t} written"
                    );
                }
            }
        }
        // The aux row (host memory) of slot 2 went to slot 1, copied host to host.
        let want: Vec<u8> = (2 * AUX..3 * AUX)
            .map(|i| (i as u8).wrapping_mul(7) ^ 0x5c)
            .collect();
        assert_eq!(d.aux.page(1), want);
        assert!(d.aux.page(0).iter().all(|&x| x == EPOISON));
    });
}

#[test]
fn scattered_cuda_malloc_pages_and_an_aux_row_move_through_cuda_ipc_byte_exact_and_the_path_says_so(
) {
    device_pages_arrive_byte_exact_through_cuda_ipc("legacy");
}

#[test]
fn scattered_vmm_pages_and_an_aux_row_move_through_cuda_ipc_byte_exact_and_the_path_says_so() {
    device_pages_arrive_byte_exact_through_cuda_ipc("vmm");
}

#[test]
fn head_slices_from_two_prefill_processes_fill_each_device_page_through_cuda_ipc() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let mut ps: Vec<Prefill> = (0..2)
            .map(|r| {
                Prefill::start(
                    if r == 0 { "legacy" } else { "vmm" },
                    &[("KVXFER_IPC_TP", &format!("{r}/2"))],
                )
            })
            .collect();
        let d = Decode::new(false, 2, 4096, |e, kv| {
            e.register_kv_layout(kv, None, layout(0, 1)).unwrap()
        });
        let (src, dst) = ([3u32, 4, 10], [0u32, 5, 6]);
        for p in &mut ps {
            p.ok("create 2");
        }
        let addrs = ps.iter().map(|p| p.0.addr.clone()).collect();
        d.e.room_create(2, kvxfer::RoomPeers::Prefills(addrs))
            .unwrap();
        d.e.room_set_destination(2, &dst, None).unwrap();
        for p in &mut ps {
            p.ok("chunk 2 1 3 4 10");
        }
        assert_eq!(
            wait_terminal(&d.e, 2),
            State::Success,
            "{:?}",
            d.e.room_failure(2)
        );
        assert_eq!(d.e.room_path(2).unwrap(), kvxfer::DataPath::CudaIpc);
        for b in 0..2 {
            for (&s, &t) in src.iter().zip(&dst) {
                for r in 0..2 {
                    // HND: head r is the r-th half of the decode page.
                    assert!(
                        d.page(b, t)[r * 2048..(r + 1) * 2048] == expected(r, b, 2048, s),
                        "buffer {b} page {t}: head {r}"
                    );
                }
            }
        }
    });
}

#[test]
fn a_layer_wise_room_moves_device_layers_through_cuda_ipc_as_they_are_enqueued() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let mut p = Prefill::start("vmm", &[("KVXFER_IPC_LAYERS", "1")]);
        let d = Decode::new(true, 4, 4096, |e, kv| {
            e.register_kv_layers(kv, vec![0, 0, 1, 1]).unwrap()
        });
        let (src, dst) = ([1u32, 2, 3], [10u32, 11, 12]);
        p.ok("create 3");
        d.e.room_create(3, kvxfer::RoomPeers::Prefills(vec![p.0.addr.clone()]))
            .unwrap();
        d.e.room_set_destination(3, &dst, None).unwrap();
        p.ok("layer 3 0 0 1 2 3");
        wait_until("layer 0 to land", || {
            d.e.room_layers_landed(3).unwrap() >= 1
        });
        for b in 2..4 {
            for &t in &dst {
                assert!(
                    d.page(b, t).iter().all(|&x| x == EPOISON),
                    "layer 1 landed early"
                );
            }
        }
        p.ok("layer 3 1 1 1 2 3");
        assert_eq!(
            wait_terminal(&d.e, 3),
            State::Success,
            "{:?}",
            d.e.room_failure(3)
        );
        for b in 0..4 {
            for (&s, &t) in src.iter().zip(&dst) {
                assert!(
                    d.page(b, t) == expected(0, b, 4096, s),
                    "buffer {b} page {t}"
                );
            }
        }
    });
}

#[test]
fn an_abort_from_either_side_lands_nothing_more_through_cuda_ipc_once_the_room_drained() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        for (room, from_decode) in [(7u64, true), (8, false)] {
            let mut p = Prefill::start("legacy", &[]);
            let d = Decode::new(false, 2, 4096, |e, kv| e.register_kv(kv).unwrap());
            let dst: Vec<u32> = (0..16).collect();
            let src: Vec<u32> = (8..24).collect();
            p.ok(&format!("create {room}"));
            d.e.room_create(room, kvxfer::RoomPeers::Prefills(vec![p.0.addr.clone()]))
                .unwrap();
            d.e.room_set_destination(room, &dst, None).unwrap();
            wait_state(&d.e, room, State::WaitingForInput);
            let first: Vec<String> = src[..8].iter().map(|s| s.to_string()).collect();
            p.ok(&format!("chunk {room} 0 {}", first.join(" ")));
            wait_until("the first chunk to land", || {
                d.page(1, 7).iter().any(|&x| x != EPOISON)
                    && d.e.metrics().bytes_received >= (8 * 2 * 4096) as u64
            });
            if from_decode {
                d.e.room_abort(room, "the decode's client went away")
                    .unwrap();
            } else {
                p.ok(&format!("abort {room}"));
            }
            assert_eq!(wait_terminal(&d.e, room), State::Failed);
            let rest: Vec<String> = src[8..].iter().map(|s| s.to_string()).collect();
            // Refused or dropped by the prefill: its room is failed.
            let _ = p.run(&format!("chunk {room} 1 {}", rest.join(" ")));
            wait_until("the decode room to drain", || {
                d.e.room_drained(room).unwrap()
            });
            let why = d.e.room_failure(room).unwrap();
            assert!(why.message.contains("client went away"), "{why:?}");
            assert_eq!(why.from_peer, !from_decode, "{why:?}");
            for b in 0..2 {
                for (&s, &t) in src[..8].iter().zip(&dst[..8]) {
                    assert!(
                        d.page(b, t) == expected(0, b, 4096, s),
                        "buffer {b} page {t}"
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(100));
            for b in 0..2 {
                for &t in &dst[8..] {
                    assert!(
                        d.page(b, t).iter().all(|&x| x == EPOISON),
                        "page {t} of buffer {b} written after the abort"
                    );
                }
            }
        }
    });
}

#[test]
fn auto_falls_back_to_tcp_staging_with_a_warning_count_and_require_fails_when_the_export_fails() {
    fallback_or_failure(
        "vmm",
        ("FAKECUDA_EXPORT_ERROR", "2"),
        "cuMemExportToShareableHandle",
    );
}

#[test]
fn a_prefill_whose_gpu_this_process_does_not_see_falls_back_or_fails_naming_it() {
    // Another GPU namespace: the prefill's devices have UUIDs no device here has.
    fallback_or_failure(
        "legacy",
        ("FAKECUDA_UUID_SEED", "9"),
        "which this process does not see",
    );
}

/// With the prefill started with `knob`, a pairing cannot set CUDA IPC up: with
/// `same_host=auto` it takes TCP staging (counted as a fallback, byte-exact); with
/// `require` the room fails as MISMATCH with a reason that contains `why`.
fn fallback_or_failure(kind: &str, knob: (&str, &str), why_has: &str) {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        for require in [false, true] {
            let mut p = Prefill::start(kind, &[knob]);
            let setting = if require { "require" } else { "auto" };
            let fake = Fake::open();
            let kv = device_buffers(&fake, false, 2, 4096, |_, _| EPOISON);
            let e = ipc_engine("decode", &[("same_host", setting)]);
            e.register_kv(kv.clone()).unwrap();
            let aux = common::Region::new(4, AUX, |_| EPOISON);
            e.register_aux(vec![aux.desc()]).unwrap();
            p.ok("create 4");
            e.room_create(4, kvxfer::RoomPeers::Prefills(vec![p.0.addr.clone()]))
                .unwrap();
            e.room_set_destination(4, &[6], None).unwrap();
            if require {
                assert_eq!(wait_terminal(&e, 4), State::Failed);
                let why = e.room_failure(4).unwrap();
                assert!(
                    why.message.contains("same_host=require") && why.message.contains(why_has),
                    "{why:?}"
                );
                assert_eq!(why.cause, kvxfer::Cause::Mismatch);
            } else {
                p.ok("chunk 4 1 9");
                assert_eq!(
                    wait_terminal(&e, 4),
                    State::Success,
                    "{:?}",
                    e.room_failure(4)
                );
                assert_eq!(e.room_path(4).unwrap(), kvxfer::DataPath::Tcp);
                let m = e.metrics();
                assert_eq!((m.same_host_fallbacks, m.pairings_cuda_ipc), (1, 0));
                // SAFETY: the decode's fake device page 6, after SUCCESS.
                let page = unsafe {
                    std::slice::from_raw_parts((kv[0].base + 6 * 4096) as *const u8, 4096)
                };
                assert!(page == expected(0, 0, 4096, 9), "page 6 over TCP staging");
            }
        }
    });
}

/// A prefill that names a source outside what it exported (a test-only fault in its
/// sender) makes the decode engine refuse the copy whole: the connection ends, the room
/// fails naming it, and none of the room's pages is written.
#[cfg(feature = "test-hooks")]
#[test]
fn a_source_address_outside_the_prefills_export_is_refused_and_nothing_lands() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let mut p = Prefill::start("legacy", &[]);
        let d = Decode::new(false, 2, 4096, |e, kv| e.register_kv(kv).unwrap());
        p.ok("create 5");
        d.e.room_create(5, kvxfer::RoomPeers::Prefills(vec![p.0.addr.clone()]))
            .unwrap();
        d.e.room_set_destination(5, &[1, 2, 3], None).unwrap();
        wait_state(&d.e, 5, State::WaitingForInput);
        p.ok("outside 5");
        p.ok("chunk 5 1 7 8 9");
        assert_eq!(wait_terminal(&d.e, 5), State::Failed);
        let why = d.e.room_failure(5).unwrap();
        assert!(
            why.message
                .contains("outside the device memory the peer exported"),
            "{why:?}"
        );
        wait_until("the decode room to drain", || d.e.room_drained(5).unwrap());
        for b in 0..2 {
            for t in 0..EPAGES as u32 {
                assert!(
                    d.page(b, t).iter().all(|&x| x == EPOISON),
                    "page {t} of buffer {b} written"
                );
            }
        }
    });
}
