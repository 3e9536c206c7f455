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
use kvxfer::cuda::ipc::{self, CopyError, DtoD, Imports};
use kvxfer::transport::fdpass::{self, FdOffer};
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
