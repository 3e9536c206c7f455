//! Shared by the multi-process integration tests: the prefill child process (the test
//! binary runs itself), its plan of rooms, and helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer::log::{Level, Logger};
use kvxfer::{BufferDesc, Config, Engine, RoomPeers, State};

pub const BUFS: usize = 8;
pub const PAGES: usize = 256;
pub const ITEM: usize = 4096;

pub fn pattern(b: usize, page: usize, i: usize) -> u8 {
    (b * 131 + page * 17 + i * 3) as u8
}

/// An engine of `role` with `extra` config keys, its KV buffers registered over `mem`
/// with pages of `ITEM` bytes.
pub fn engine(role: &str, mem: &mut [Vec<u8>], extra: &[(&str, &str)]) -> Engine {
    engine_paged(role, mem, ITEM, extra)
}

/// As `engine`, with pages of `item_len` bytes.
pub fn engine_paged(
    role: &str,
    mem: &mut [Vec<u8>],
    item_len: usize,
    extra: &[(&str, &str)],
) -> Engine {
    let mut c = Config::default();
    c.set("role", role).unwrap();
    c.set("transport", &test_transport()).unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    let e = Engine::new(c, Logger::new(Level::Error, None)).unwrap();
    e.register_kv(
        mem.iter_mut()
            .map(|b| BufferDesc {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
                item_len,
            })
            .collect(),
    )
    .unwrap();
    e
}

/// The transport the integration tests run over: `tcp`, unless KVXFER_TEST_TRANSPORT
/// says otherwise (`make test-rdma` runs the suites with `rdma` inside a soft-RoCE guest).
pub fn test_transport() -> String {
    std::env::var("KVXFER_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

/// Source pages of room `r`: 4..20 pages spread over the buffer, in 1..4 chunks.
pub fn plan(r: u64) -> (Vec<u32>, usize) {
    let n = 4 + (r as usize * 7) % 17;
    let start = (r as usize * 13) % (PAGES - n);
    (
        (start..start + n).map(|p| p as u32).collect(),
        1 + r as usize % 4,
    )
}

/// The prefill process: reads commands from stdin, one per line:
/// `room R` creates room R and enqueues its chunks; `big R` creates room R with every
/// page, one page per chunk; `quit` exits. Listens on
/// KVXFER_LISTEN if set. Each test binary calls this from its `child_prefill` test.
pub fn child_prefill_main() {
    if std::env::var_os("KVXFER_CHILD").is_none() {
        return;
    }
    let mut mem: Vec<Vec<u8>> = (0..BUFS)
        .map(|b| {
            (0..PAGES * ITEM)
                .map(|i| pattern(b, i / ITEM, i % ITEM))
                .collect()
        })
        .collect();
    let listen = std::env::var("KVXFER_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    let p = engine(
        "prefill",
        &mut mem,
        &[("heartbeat_interval_ms", "100"), ("listen", &listen)],
    );
    println!("ADDR {}", p.address());
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let mut w = line.split_whitespace();
        match (w.next(), w.next().and_then(|x| x.parse::<u64>().ok())) {
            (Some("room"), Some(r)) => {
                p.room_create(r, RoomPeers::Decoders(1)).unwrap();
                let (src, chunks) = plan(r);
                let per = src.len().div_ceil(chunks);
                let parts: Vec<&[u32]> = src.chunks(per).collect();
                for (i, part) in parts.iter().enumerate() {
                    p.enqueue_chunk(r, part, i + 1 == parts.len(), None)
                        .unwrap();
                }
            }
            (Some("big"), Some(r)) => {
                // Every page, one page per chunk: a transfer long enough to interrupt.
                p.room_create(r, RoomPeers::Decoders(1)).unwrap();
                for page in 0..PAGES as u32 {
                    p.enqueue_chunk(r, &[page], page + 1 == PAGES as u32, None)
                        .unwrap();
                }
            }
            (Some("quit"), _) => return,
            _ => panic!("bad command {line}"),
        }
    }
}

pub struct ChildPrefill {
    pub child: Child,
    pub addr: String,
}

impl ChildPrefill {
    /// Starts this test binary's `child_prefill` test as the prefill process.
    pub fn start() -> ChildPrefill {
        Self::start_with(&[], None)
    }

    /// As `start`, run through `wrapper` (such as `ip netns exec NS`), listening on
    /// `listen`.
    pub fn start_with(wrapper: &[&str], listen: Option<&str>) -> ChildPrefill {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        if let Some(l) = listen {
            cmd.env("KVXFER_LISTEN", l);
        }
        let mut child = cmd
            .args([
                "--exact",
                "child_prefill",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KVXFER_CHILD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // If the child never says where it listens, kill it so the test fails instead of
        // hanging.
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let pid = child.id().to_string();
        std::thread::spawn(move || {
            if started_rx.recv_timeout(Duration::from_secs(60)).is_err() {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        });
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let addr = loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
            // libtest may print "test child_prefill ... " on the same line first.
            if let Some(i) = line.find("ADDR ") {
                break line[i + 5..].trim().to_string();
            }
        };
        let _ = started_tx.send(());
        ChildPrefill { child, addr }
    }

    pub fn send(&mut self, cmd: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for ChildPrefill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn wait_terminal(e: &Engine, room: u64, limit: Duration) -> State {
    let t = Instant::now();
    loop {
        let s = e.room_poll(room).unwrap();
        if s.is_terminal() {
            return s;
        }
        assert!(t.elapsed() < limit, "room {room} stuck in {s}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits (up to 10 s) until room `room` is in state `want`.
pub fn wait_state(e: &Engine, room: u64, want: State) {
    let t = Instant::now();
    while e.room_poll(room).unwrap() != want {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "room {room} never reached {want}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Registered memory that a test reads and writes only through raw pointers, so that the
/// engine writing into it from its own threads never aliases a Rust reference.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    item: usize,
}

// SAFETY: the region is plain bytes; the engine and the test touch it only through raw
// pointers, and the tests check it when no write may be landing (the claim under test).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// `pages` pages of `item` bytes, byte `i` set to `fill(i)`.
    pub fn new(pages: usize, item: usize, fill: impl Fn(usize) -> u8) -> Region {
        let bytes: Box<[u8]> = (0..pages * item).map(fill).collect();
        let len = bytes.len();
        Region {
            ptr: Box::into_raw(bytes).cast::<u8>(),
            len,
            item,
        }
    }

    /// The region as one KV buffer of its pages.
    pub fn desc(&self) -> BufferDesc {
        BufferDesc {
            base: self.ptr as usize,
            len: self.len,
            item_len: self.item,
        }
    }

    /// A copy of page `p`.
    pub fn page(&self, p: u32) -> Vec<u8> {
        let mut out = vec![0u8; self.item];
        assert!((p as usize + 1) * self.item <= self.len);
        // SAFETY: checked above: the page lies inside the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(p as usize * self.item),
                out.as_mut_ptr(),
                self.item,
            )
        };
        out
    }

    /// Fills page `p` with `byte`.
    pub fn poison(&self, p: u32, byte: u8) {
        assert!((p as usize + 1) * self.item <= self.len);
        // SAFETY: as in `page`.
        unsafe { std::ptr::write_bytes(self.ptr.add(p as usize * self.item), byte, self.item) };
    }
}

/// Whether page `p` of every buffer in `mem`, for every `p` in `pages`, holds only `byte`.
#[allow(dead_code)]
pub fn all_filled(mem: &[Region], pages: &[u32], byte: u8) -> bool {
    pages
        .iter()
        .all(|&p| mem.iter().all(|m| m.page(p).iter().all(|&x| x == byte)))
}

/// Fills page `p` of every buffer in `mem` with `byte`, for every `p` in `pages`.
#[allow(dead_code)]
pub fn fill_pages(mem: &[Region], pages: &[u32], byte: u8) {
    for &p in pages {
        for m in mem {
            m.poison(p, byte);
        }
    }
}

/// The first (buffer, source page, destination page) whose destination page in `dst`
/// differs from its source page in `src`, pairing `from` with `to` page by page.
#[allow(dead_code)]
pub fn first_difference(
    src: &[Region],
    from: &[u32],
    dst: &[Region],
    to: &[u32],
) -> Option<(usize, u32, u32)> {
    from.iter().zip(to).find_map(|(&s, &d)| {
        (0..src.len().min(dst.len()))
            .find(|&b| src[b].page(s) != dst[b].page(d))
            .map(|b| (b, s, d))
    })
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}
