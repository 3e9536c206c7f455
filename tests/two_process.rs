//! Prefill and decode in two processes over loopback. The test binary runs itself as
//! the prefill process (the `child_prefill` test, which does nothing unless
//! KVXFER_CHILD is set), so no extra binary is needed.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer::log::{Level, Logger};
use kvxfer::{BufferDesc, Cause, Config, Engine, RoomPeers, State};

const BUFS: usize = 8;
const PAGES: usize = 256;
const ITEM: usize = 4096;

fn pattern(b: usize, page: usize, i: usize) -> u8 {
    (b * 131 + page * 17 + i * 3) as u8
}

fn engine(role: &str, mem: &mut [Vec<u8>], extra: &[(&str, &str)]) -> Engine {
    let mut c = Config::default();
    c.set("role", role).unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    let e = Engine::new(c, Logger::new(Level::Error, None)).unwrap();
    e.register_kv(
        mem.iter_mut()
            .map(|b| BufferDesc {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
                item_len: ITEM,
            })
            .collect(),
    )
    .unwrap();
    e
}

/// Source pages of room `r`: 4..20 pages spread over the buffer, in 1..4 chunks.
fn plan(r: u64) -> (Vec<u32>, usize) {
    let n = 4 + (r as usize * 7) % 17;
    let start = (r as usize * 13) % (PAGES - n);
    (
        (start..start + n).map(|p| p as u32).collect(),
        1 + r as usize % 4,
    )
}

/// The prefill process: reads commands from stdin, one per line:
/// `room R` creates room R and enqueues its chunks; `quit` exits.
#[test]
fn child_prefill() {
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
    let p = engine("prefill", &mut mem, &[("heartbeat_interval_ms", "100")]);
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
            (Some("quit"), _) => return,
            _ => panic!("bad command {line}"),
        }
    }
}

struct ChildPrefill {
    child: Child,
    addr: String,
}

impl ChildPrefill {
    fn start() -> ChildPrefill {
        let mut child = Command::new(std::env::current_exe().unwrap())
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

    fn send(&mut self, cmd: &str) {
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

fn wait_terminal(e: &Engine, room: u64, limit: Duration) -> State {
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

#[test]
fn rooms_move_between_two_processes_byte_for_byte() {
    let mut child = ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0xEEu8; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[]);
    let rooms: Vec<u64> = (1..=24).collect();
    for &r in &rooms {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        let (src, _) = plan(r);
        // Scattered destination: every other page, offset per room.
        let dst: Vec<u32> = (0..src.len())
            .map(|i| ((r as usize * 40 + i * 2) % PAGES) as u32)
            .collect();
        let mut uniq = dst.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), dst.len());
        d.room_set_destination(r, &dst, None).unwrap();
        child.send(&format!("room {r}"));
        assert_eq!(
            wait_terminal(&d, r, Duration::from_secs(20)),
            State::Success,
            "room {r}"
        );
        for (i, (&s, &t)) in src.iter().zip(&dst).enumerate() {
            for (b, buf) in mem.iter().enumerate() {
                let page = &buf[t as usize * ITEM..(t as usize + 1) * ITEM];
                assert!(
                    page.iter()
                        .enumerate()
                        .all(|(j, &x)| x == pattern(b, s as usize, j)),
                    "room {r} page {i} buffer {b} differs"
                );
            }
        }
        d.room_clear(r).unwrap();
    }
    child.send("quit");
}

#[test]
fn a_killed_prefill_process_fails_decode_rooms_within_the_heartbeat_deadline() {
    let child = ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0u8; PAGES * ITEM]).collect();
    let d = engine(
        "decode",
        &mut mem,
        &[("heartbeat_interval_ms", "100"), ("heartbeat_misses", "5")],
    );
    for r in 1..=8u64 {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        d.room_set_destination(r, &[r as u32], None).unwrap();
    }
    let t = Instant::now();
    while d.room_poll(8).unwrap() != State::WaitingForInput {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(child); // SIGKILL
    for r in 1..=8u64 {
        // Heartbeat deadline is 500 ms; a killed process closes its sockets at once.
        assert_eq!(wait_terminal(&d, r, Duration::from_secs(5)), State::Failed);
        let why = d.room_failure(r).unwrap();
        assert_eq!(why.cause, Cause::PeerLost, "{why}");
    }
}

#[test]
fn a_stopped_prefill_process_is_detected_by_missed_heartbeats() {
    let child = ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0u8; PAGES * ITEM]).collect();
    let d = engine(
        "decode",
        &mut mem,
        &[("heartbeat_interval_ms", "100"), ("heartbeat_misses", "3")],
    );
    d.room_create(1, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(1, &[1], None).unwrap();
    let t = Instant::now();
    while d.room_poll(1).unwrap() != State::WaitingForInput {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    // SIGSTOP: the sockets stay open, the peer just goes silent (a hung process).
    let pid = child.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    assert_eq!(wait_terminal(&d, 1, Duration::from_secs(5)), State::Failed);
    let why = d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::PeerLost);
    assert!(why.message.contains("heartbeat"), "{why}");
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
}
