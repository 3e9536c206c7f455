//! The RDMA transport. On a machine without RDMA devices (the host): `transport=rdma`
//! fails engine creation with a clear error and `transport=auto` falls back to TCP.
//! Inside the soft-RoCE guest (`make test-rdma`, KVXFER_TEST_TRANSPORT=rdma): transfers
//! over real verbs, many rooms at once, an abort while writes are outstanding (the drain
//! is acknowledged only after their completions), and a completion error forced with a
//! wrong remote key that fails exactly its room.
//!
//! Needs `--features test-hooks` for the forced completion error.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Region;
use kvxfer::log::{Level, Logger};
use kvxfer::{Cause, Config, Engine, ErrorKind, RoomPeers, State};

const BUFS: usize = 4;
const PAGES: usize = 256;
const ITEM: usize = 16 * 1024;
const POISON: u8 = 0xEE;
const LIMIT: Duration = Duration::from_secs(60);

/// Whether this run has an RDMA device (the guest of `make test-rdma`).
fn rdma() -> bool {
    common::test_transport() == "rdma"
}

fn src_byte(b: usize, i: usize) -> u8 {
    (b * 37 + i * 11 + i / ITEM * 5) as u8 | 1
}

fn config(role: &str, transport: &str, extra: &[(&str, &str)]) -> Config {
    let mut c = Config::default();
    c.set("role", role).unwrap();
    c.set("transport", transport).unwrap();
    c.set("workers", "2").unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    c
}

/// A log sink that keeps every line.
fn capture() -> (Logger, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    let sink: kvxfer::log::Sink = Arc::new(move |_, msg: &str| l.lock().unwrap().push(msg.into()));
    (Logger::new(Level::Info, Some(sink)), lines)
}

struct Pair {
    p: Engine,
    d: Engine,
    pmem: Vec<Region>,
    dmem: Vec<Region>,
}

impl Pair {
    fn new(transport: &str, p_extra: &[(&str, &str)], d_extra: &[(&str, &str)]) -> Pair {
        let pmem: Vec<Region> = (0..BUFS)
            .map(|b| Region::new(PAGES, ITEM, move |i| src_byte(b, i)))
            .collect();
        let dmem: Vec<Region> = (0..BUFS)
            .map(|_| Region::new(PAGES, ITEM, |_| POISON))
            .collect();
        let quiet = Logger::new(Level::Error, None);
        let p = Engine::new(config("prefill", transport, p_extra), quiet.clone()).unwrap();
        p.register_kv(pmem.iter().map(Region::desc).collect())
            .unwrap();
        let d = Engine::new(config("decode", transport, d_extra), quiet).unwrap();
        d.register_kv(dmem.iter().map(Region::desc).collect())
            .unwrap();
        Pair { p, d, pmem, dmem }
    }

    fn create(&self, room: u64, dst: &[u32]) {
        self.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        self.d
            .room_create(room, RoomPeers::Prefills(vec![self.p.address().into()]))
            .unwrap();
        self.d.room_set_destination(room, dst, None).unwrap();
    }

    fn send(&self, room: u64, src: &[u32], chunk: usize) {
        let parts: Vec<&[u32]> = src.chunks(chunk.max(1)).collect();
        for (i, part) in parts.iter().enumerate() {
            self.p
                .enqueue_chunk(room, part, i + 1 == parts.len(), None)
                .unwrap();
        }
    }

    fn assert_pages(&self, src: &[u32], dst: &[u32]) {
        if let Some((b, s, d)) = common::first_difference(&self.pmem, src, &self.dmem, dst) {
            panic!("buffer {b}: page {d} differs from source page {s}");
        }
    }

    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    fn poisoned(&self, dst: &[u32]) -> bool {
        common::all_filled(&self.dmem, dst, POISON)
    }

    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    fn repoison(&self, dst: &[u32]) {
        common::fill_pages(&self.dmem, dst, POISON)
    }
}

fn wait_terminal(e: &Engine, room: u64) -> State {
    common::wait_terminal(e, room, LIMIT)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < LIMIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn transport_rdma_without_a_device_fails_engine_creation_clearly() {
    let r = Engine::new(
        config("prefill", "rdma", &[]),
        Logger::new(Level::Error, None),
    );
    if rdma() {
        r.expect("transport=rdma starts where a device is up");
        return;
    }
    let e = r
        .err()
        .expect("an rdma engine started on a machine without RDMA devices");
    assert_eq!(e.kind(), ErrorKind::TransportUnavailable);
    assert!(
        e.message().contains("no usable RDMA device"),
        "{}",
        e.message()
    );
    // Naming devices that do not exist is no better.
    let e = Engine::new(
        config("decode", "rdma", &[("rdma_devices", "nosuch0")]),
        Logger::new(Level::Error, None),
    )
    .err()
    .expect("an rdma engine started with a device that does not exist");
    assert_eq!(e.kind(), ErrorKind::TransportUnavailable);
    assert!(
        e.message().contains("rdma_devices=nosuch0"),
        "{}",
        e.message()
    );
}

#[test]
fn transport_auto_uses_rdma_where_it_can_and_tcp_otherwise_and_says_which() {
    let (log, lines) = capture();
    let e = Engine::new(config("prefill", "auto", &[]), log).unwrap();
    drop(e);
    let lines = lines.lock().unwrap();
    let said = lines
        .iter()
        .find(|l| l.contains("listening on"))
        .expect("the engine logs its transport");
    if rdma() {
        assert!(said.contains("transport rdma"), "{said}");
    } else {
        assert!(
            said.contains("transport tcp (auto: no usable RDMA device"),
            "{said}"
        );
    }
    // And auto moves bytes either way.
    let t = Pair::new("auto", &[], &[]);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..16).collect(), (100..116).collect());
    t.create(1, &dst);
    t.send(1, &src, 5);
    assert_eq!(wait_terminal(&t.d, 1), State::Success);
    assert_eq!(wait_terminal(&t.p, 1), State::Success);
    t.assert_pages(&src, &dst);
}

#[test]
fn a_transport_mismatch_fails_the_room_naming_both_transports() {
    if !rdma() {
        return; // needs an RDMA engine beside a TCP one
    }
    let t = Pair::new("rdma", &[], &[]);
    let tcp_decode = Engine::new(
        config("decode", "tcp", &[]),
        Logger::new(Level::Error, None),
    )
    .unwrap();
    let mem: Vec<Region> = (0..BUFS).map(|_| Region::new(PAGES, ITEM, |_| 0)).collect();
    tcp_decode
        .register_kv(mem.iter().map(Region::desc).collect())
        .unwrap();
    tcp_decode
        .room_create(9, RoomPeers::Prefills(vec![t.p.address().into()]))
        .unwrap();
    assert_eq!(wait_terminal(&tcp_decode, 9), State::Failed);
    let why = tcp_decode.room_failure(9).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(
        why.message.contains("RDMA") && why.message.contains("TCP"),
        "{why}"
    );
}

#[test]
fn many_rooms_at_once_arrive_byte_for_byte() {
    // Over RDMA (the guest): a small slice and queue depth, so runs split into many
    // writes, chains of WRs, and the bound on outstanding writes is reached. On the host
    // the same rooms go over TCP.
    let t = Pair::new(
        &common::test_transport(),
        &[("rdma_slice_bytes", "8192"), ("rdma_queue_depth", "8")],
        &[],
    );
    let rooms = 24u64;
    let mut plans = Vec::new();
    for r in 0..rooms {
        let n = 2 + (r as usize * 5) % 9;
        let src: Vec<u32> = (0..n)
            .map(|i| ((r as usize * 7 + i * 3) % PAGES) as u32)
            .collect();
        let dst: Vec<u32> = (0..n).map(|i| (r as usize * 10 + i) as u32).collect();
        t.create(r, &dst);
        plans.push((src, dst));
    }
    for (r, (src, _)) in plans.iter().enumerate() {
        t.send(r as u64, src, 1 + r % 3);
    }
    for (r, (src, dst)) in plans.iter().enumerate() {
        assert_eq!(wait_terminal(&t.d, r as u64), State::Success, "room {r}");
        assert_eq!(wait_terminal(&t.p, r as u64), State::Success, "room {r}");
        assert!(t.d.room_drained(r as u64).unwrap());
        t.assert_pages(src, dst);
    }
    let m = t.d.metrics();
    assert_eq!(m.rooms_succeeded, rooms);
}

#[cfg(feature = "test-hooks")]
#[test]
fn an_abort_during_outstanding_writes_drains_only_after_their_completions() {
    if !rdma() {
        return;
    }
    // One worker, one big chunk: 4 buffers x 256 pages x 16 KiB = 16 MiB of writes. The
    // worker is held (test-only pause point) right after its first batch's writes
    // completed, while it still counts them on the room: the abort lands then.
    let t = Pair::new("rdma", &[("workers", "1")], &[]);
    let src: Vec<u32> = (0..PAGES as u32).collect();
    let dst: Vec<u32> = (0..PAGES as u32).collect();
    kvxfer::testing::pause_at("rdma.batch_done", 5);
    t.create(5, &dst);
    t.send(5, &src, PAGES);
    assert!(
        kvxfer::testing::wait_paused("rdma.batch_done", 5, LIMIT),
        "the worker never finished a batch"
    );
    t.d.room_abort(5, "client cancelled mid-write").unwrap();
    assert_eq!(wait_terminal(&t.d, 5), State::Failed, "decode");
    assert_eq!(wait_terminal(&t.p, 5), State::Failed, "prefill");
    // The prefill still counts the batch: no acknowledgement, so the decode room must
    // not be drained, however long we wait.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        assert!(!t.p.room_drained(5).unwrap());
        assert!(
            !t.d.room_drained(5).unwrap(),
            "decode drained while the prefill still held a batch of writes"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    kvxfer::testing::release("rdma.batch_done", 5);
    wait_until("the decode room to drain", || t.d.room_drained(5).unwrap());
    assert!(t.p.room_drained(5).unwrap());
    let why = t.p.room_failure(5).unwrap();
    assert!(why.message.contains("client cancelled mid-write"), "{why}");
    // Nothing lands after the drain: no later batch of the room was posted.
    t.repoison(&dst);
    std::thread::sleep(Duration::from_millis(500));
    assert!(t.poisoned(&dst), "a write landed after the room drained");
    // The link goes on: the next room arrives whole.
    let (src2, dst2): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (40..48).collect());
    t.create(6, &dst2);
    t.send(6, &src2, 3);
    assert_eq!(wait_terminal(&t.d, 6), State::Success);
    t.assert_pages(&src2, &dst2);
}

#[test]
fn child_prefill() {
    common::child_prefill_main();
}

#[test]
fn a_prefill_process_killed_mid_transfer_fails_the_room_and_nothing_lands_after() {
    if !rdma() {
        return; // over TCP the same is covered by tests/two_process.rs
    }
    let mut child = common::ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..common::BUFS)
        .map(|_| vec![POISON; common::PAGES * common::ITEM])
        .collect();
    let d = common::engine("decode", &mut mem, &[("heartbeat_interval_ms", "100")]);
    let dst: Vec<u32> = (0..common::PAGES as u32).collect();
    d.room_create(3, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(3, &dst, None).unwrap();
    child.send("big 3");
    wait_until("the transfer to start", || {
        d.room_poll(3).unwrap() != State::Bootstrapping
            && d.room_poll(3).unwrap() != State::WaitingForInput
    });
    assert_eq!(
        d.room_poll(3).unwrap(),
        State::Transferring,
        "the transfer ended before the kill"
    );
    drop(child); // SIGKILL mid-transfer
    let t = Instant::now();
    assert_eq!(wait_terminal(&d, 3), State::Failed);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let why = d.room_failure(3).unwrap();
    assert_eq!(why.cause, Cause::PeerLost, "{why}");
    // Lost peer: its queue pairs are shut, so the room is drained at once.
    assert!(d.room_drained(3).unwrap());
    for b in &mut mem {
        b.fill(POISON);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        mem.iter().all(|b| b.iter().all(|&x| x == POISON)),
        "a write landed after the room drained"
    );
}

#[cfg(feature = "test-hooks")]
#[test]
fn a_completion_error_fails_exactly_its_room_with_the_verbs_status() {
    if !rdma() {
        return;
    }
    let t = Pair::new("rdma", &[("workers", "1")], &[]);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (0..8).collect());
    kvxfer::testing::inject_fault("rdma.bad_rkey", 11);
    t.create(11, &dst);
    t.send(11, &src, 8);
    assert_eq!(wait_terminal(&t.p, 11), State::Failed);
    assert_eq!(wait_terminal(&t.d, 11), State::Failed);
    let why = t.p.room_failure(11).unwrap();
    assert_eq!(why.cause, Cause::Transfer, "{why}");
    assert!(
        why.message.to_lowercase().contains("remote access"),
        "{why}"
    );
    wait_until("the failed room to drain", || t.d.room_drained(11).unwrap());
    // The broken queue pair is replaced on next use: rooms before and after are intact.
    for r in 12..16u64 {
        let (src, dst): (Vec<u32>, Vec<u32>) = (
            (r as u32..r as u32 + 6).collect(),
            (r as u32 * 8..r as u32 * 8 + 6).collect(),
        );
        t.create(r, &dst);
        t.send(r, &src, 2);
        assert_eq!(wait_terminal(&t.d, r), State::Success, "room {r}");
        t.assert_pages(&src, &dst);
    }
    assert_eq!(t.d.metrics().rooms_failed.iter().sum::<u64>(), 1);
}
