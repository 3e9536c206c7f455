//! A prefill engine in a second process: the test binary runs itself, with one of its
//! tests as the child's main (which does nothing unless the child's variable is set),
//! driven by one command a line on its stdin.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use kvxfer::RoomPeers;

use super::engine::engine;
use super::memory::source;

/// The shape of the child prefill's KV buffers (and of its decode peers').
pub const BUFS: usize = 8;
pub const PAGES: usize = 256;
pub const ITEM: usize = 4096;

/// Source pages of room `r`: 4..20 pages spread over the buffer, in 1..4 chunks.
pub fn plan(r: u64) -> (Vec<u32>, usize) {
    let n = 4 + (r as usize * 7) % 17;
    let start = (r as usize * 13) % (PAGES - n);
    (
        (start..start + n).map(|p| p as u32).collect(),
        1 + r as usize % 4,
    )
}

/// The prefill process, if KVXFER_CHILD is set: reads commands from stdin, one per
/// line: `room R` creates room R and enqueues its chunks ([`plan`]); `big R` creates
/// room R with every page, one page per chunk; `quit` exits. Its buffers hold the source
/// pattern. Listens on KVXFER_LISTEN if set, authenticates with the key in
/// KVXFER_TEST_AUTH_KEY_FILE if set, sets `auth` to KVXFER_TEST_AUTH if set, and makes
/// itself not dumpable (no other process without CAP_SYS_PTRACE may read its memory) if
/// KVXFER_TEST_UNDUMPABLE is set. Each test binary calls this from its `child_prefill`
/// test.
pub fn child_prefill_main() {
    if std::env::var_os("KVXFER_CHILD").is_none() {
        return;
    }
    if std::env::var_os("KVXFER_TEST_UNDUMPABLE").is_some() {
        // Only a process with CAP_SYS_PTRACE may read this one's memory now.
        // SAFETY: prctl(PR_SET_DUMPABLE) takes plain integers and touches no memory.
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }, 0);
    }
    let mem = source(BUFS, PAGES, ITEM);
    let listen = std::env::var("KVXFER_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    let key_file = std::env::var("KVXFER_TEST_AUTH_KEY_FILE").ok();
    let auth = std::env::var("KVXFER_TEST_AUTH").ok();
    let mut extra = vec![("heartbeat_interval_ms", "100"), ("listen", &listen)];
    if let Some(f) = &key_file {
        extra.push(("auth_key_file", f));
    }
    if let Some(a) = &auth {
        extra.push(("auth", a));
    }
    let p = engine("prefill", &mem, &extra);
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
                    // A test may cut the room short (it fails here, and refuses more).
                    if p.enqueue_chunk(r, &[page], page + 1 == PAGES as u32, None)
                        .is_err()
                    {
                        break;
                    }
                }
            }
            (Some("quit"), _) => return,
            _ => panic!("bad command {line}"),
        }
    }
}

/// A child process running a prefill engine, killed on drop.
pub struct ChildPrefill {
    pub child: Child,
    out: BufReader<ChildStdout>,
    /// The address the child's engine listens on.
    pub addr: String,
}

impl ChildPrefill {
    /// Starts this test binary's `child_prefill` test as the prefill process.
    pub fn start() -> ChildPrefill {
        Self::start_in(&[], None, &[])
    }

    /// As `start`, run through `wrapper` (such as `ip netns exec NS`), listening on
    /// `listen`, with `env` added to the child's environment.
    pub fn start_in(wrapper: &[&str], listen: Option<&str>, env: &[(&str, &str)]) -> ChildPrefill {
        let mut env = env.to_vec();
        env.push(("KVXFER_CHILD", "1"));
        if let Some(l) = listen {
            env.push(("KVXFER_LISTEN", l));
        }
        Self::spawn("child_prefill", wrapper, &env)
    }

    /// Runs this test binary's test `test` as a child process, through `wrapper`, with
    /// `env` added to its environment, and waits until it says where its engine listens
    /// (a line `ADDR host:port`).
    pub fn spawn(test: &str, wrapper: &[&str], env: &[(&str, &str)]) -> ChildPrefill {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let mut child = cmd
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .envs(env.iter().copied())
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
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut c = ChildPrefill {
            child,
            out,
            addr: String::new(),
        };
        c.addr = c.line_after("ADDR ").trim().to_string();
        let _ = started_tx.send(());
        c
    }

    /// Sends the child one command line.
    pub fn send(&mut self, cmd: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
    }

    /// What follows `tag` on the next line of the child's stdout that holds it (libtest
    /// may print "test NAME ... " on the same line first).
    pub fn line_after(&mut self, tag: &str) -> String {
        loop {
            let mut line = String::new();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "child exited early"
            );
            if let Some(i) = line.find(tag) {
                return line[i + tag.len()..].to_string();
            }
        }
    }
}

impl Drop for ChildPrefill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
