//! The RDMA transport. On a machine without RDMA devices (the host): `transport=rdma`
//! fails engine creation with a clear error and `transport=auto` falls back to TCP.
//! Inside the soft-RoCE guest (`make test-rdma`, KVXFER_TEST_TRANSPORT=rdma): transfers
//! over real verbs, many rooms at once, an abort while writes are outstanding (the drain
//! is acknowledged only after their completions), and a completion error forced with a
//! wrong remote key that fails exactly its room; verified bytes (integrity=verify): rooms
//! verified where they landed, and a run written to the wrong page or a destination
//! byte changed before its verification caught as INTEGRITY.
//!
//! Needs `--features test-hooks` for the forced completion error and the integrity
//! faults.

mod common;

use std::time::{Duration, Instant};

use common::{terminal_within, wait_until_within, Log, Pair, POISON};
use kvxfer::log::Level;
use kvxfer::{Cause, Engine, ErrorKind, RoomPeers, State};

const BUFS: usize = 4;
const PAGES: usize = 256;
const ITEM: usize = 16 * 1024;
/// How long a wait may take: soft-RoCE in an emulated guest is slow.
const LIMIT: Duration = Duration::from_secs(60);
/// Every engine of this file has two workers.
const WORKERS: (&str, &str) = ("workers", "2");

/// Whether this run has an RDMA device (the guest of `make test-rdma`).
fn rdma() -> bool {
    common::test_transport() == "rdma"
}

/// A prefill and a decode engine over `transport`, the prefill with `p_extra`.
fn pair(transport: &str, p_extra: &[(&str, &str)]) -> Pair {
    Pair::builder()
        .transport(transport)
        .config(&[WORKERS])
        .prefill(p_extra)
        .bufs(BUFS)
        .pages(PAGES)
        .item(ITEM)
        .build()
}

/// An engine of `role` over `transport`, logging only errors, with no buffers.
fn start(role: &str, transport: &str, extra: &[(&str, &str)]) -> Result<Engine, kvxfer::Error> {
    let mut keys = vec![("transport", transport), WORKERS];
    keys.extend_from_slice(extra);
    Engine::new(common::config(role, &keys), common::quiet())
}

#[test]
fn transport_rdma_without_a_device_fails_engine_creation_clearly() {
    let r = start("prefill", "rdma", &[]);
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
    let e = start("decode", "rdma", &[("rdma_devices", "nosuch0")])
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
    let log = Log::default();
    let e = Engine::new(
        common::config("prefill", &[("transport", "auto"), WORKERS]),
        log.logger(Level::Info),
    )
    .unwrap();
    drop(e);
    // The engine logs its transport.
    let said = log.wait_for(&["listening on"]);
    if rdma() {
        assert!(said.contains("transport rdma"), "{said}");
    } else {
        assert!(
            said.contains("transport tcp (auto: no usable RDMA device"),
            "{said}"
        );
    }
    // And auto moves bytes either way.
    let t = pair("auto", &[]);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..16).collect(), (100..116).collect());
    t.open(1, &dst);
    t.send(1, &src, 5);
    assert_eq!(terminal_within(&t.d, 1, LIMIT), State::Success);
    assert_eq!(terminal_within(&t.p, 1, LIMIT), State::Success);
    t.assert_pages(&src, &dst);
}

#[test]
fn a_transport_mismatch_fails_the_room_naming_both_transports() {
    if !rdma() {
        return; // needs an RDMA engine beside a TCP one
    }
    let t = pair("rdma", &[]);
    let mem = common::poisoned(BUFS, PAGES, ITEM);
    let tcp_decode = start("decode", "tcp", &[]).unwrap();
    tcp_decode.register_kv(common::descs(&mem)).unwrap();
    tcp_decode
        .room_create(9, RoomPeers::Prefills(vec![t.p.address().into()]))
        .unwrap();
    assert_eq!(terminal_within(&tcp_decode, 9, LIMIT), State::Failed);
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
    let t = pair(
        &common::test_transport(),
        &[("rdma_slice_bytes", "8192"), ("rdma_queue_depth", "8")],
    );
    let rooms = 24u64;
    let mut plans = Vec::new();
    for r in 0..rooms {
        let n = 2 + (r as usize * 5) % 9;
        let src: Vec<u32> = (0..n)
            .map(|i| ((r as usize * 7 + i * 3) % PAGES) as u32)
            .collect();
        let dst: Vec<u32> = (0..n).map(|i| (r as usize * 10 + i) as u32).collect();
        t.open(r, &dst);
        plans.push((src, dst));
    }
    for (r, (src, _)) in plans.iter().enumerate() {
        t.send(r as u64, src, 1 + r % 3);
    }
    for (r, (src, dst)) in plans.iter().enumerate() {
        assert_eq!(
            terminal_within(&t.d, r as u64, LIMIT),
            State::Success,
            "room {r}"
        );
        assert_eq!(
            terminal_within(&t.p, r as u64, LIMIT),
            State::Success,
            "room {r}"
        );
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
    let t = pair("rdma", &[("workers", "1")]);
    let src: Vec<u32> = (0..PAGES as u32).collect();
    let dst: Vec<u32> = (0..PAGES as u32).collect();
    kvxfer::testing::pause_at("rdma.batch_done", 5);
    t.open(5, &dst);
    t.send(5, &src, PAGES);
    assert!(
        kvxfer::testing::wait_paused("rdma.batch_done", 5, LIMIT),
        "the worker never finished a batch"
    );
    t.d.room_abort(5, "client cancelled mid-write").unwrap();
    assert_eq!(terminal_within(&t.d, 5, LIMIT), State::Failed, "decode");
    assert_eq!(terminal_within(&t.p, 5, LIMIT), State::Failed, "prefill");
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
    wait_until_within("the decode room to drain", LIMIT, || {
        t.d.room_drained(5).unwrap()
    });
    assert!(t.p.room_drained(5).unwrap());
    let why = t.p.room_failure(5).unwrap();
    assert!(why.message.contains("client cancelled mid-write"), "{why}");
    // Nothing lands after the drain: no later batch of the room was posted.
    t.repoison(&dst);
    std::thread::sleep(Duration::from_millis(500));
    assert!(t.poisoned(&dst), "a write landed after the room drained");
    // The link goes on: the next room arrives whole.
    let (src2, dst2): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (40..48).collect());
    t.open(6, &dst2);
    t.send(6, &src2, 3);
    assert_eq!(terminal_within(&t.d, 6, LIMIT), State::Success);
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
    let mem = common::poisoned(common::BUFS, common::PAGES, common::ITEM);
    let d = common::engine("decode", &mem, &[("heartbeat_interval_ms", "100")]);
    let dst: Vec<u32> = (0..common::PAGES as u32).collect();
    d.room_create(3, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(3, &dst, None).unwrap();
    child.send("big 3");
    wait_until_within("the transfer to start", LIMIT, || {
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
    assert_eq!(terminal_within(&d, 3, LIMIT), State::Failed);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let why = d.room_failure(3).unwrap();
    assert_eq!(why.cause, Cause::PeerLost, "{why}");
    // Lost peer: its queue pairs are shut, so the room is drained at once.
    assert!(d.room_drained(3).unwrap());
    common::fill_pages(&mem, &dst, POISON);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        common::all_filled(&mem, &dst, POISON),
        "a write landed after the room drained"
    );
}

#[cfg(feature = "test-hooks")]
#[test]
fn a_completion_error_fails_exactly_its_room_with_the_verbs_status() {
    if !rdma() {
        return;
    }
    let t = pair("rdma", &[("workers", "1")]);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (0..8).collect());
    kvxfer::testing::inject_fault("rdma.bad_rkey", 11);
    t.open(11, &dst);
    t.send(11, &src, 8);
    assert_eq!(terminal_within(&t.p, 11, LIMIT), State::Failed);
    assert_eq!(terminal_within(&t.d, 11, LIMIT), State::Failed);
    let why = t.p.room_failure(11).unwrap();
    assert_eq!(why.cause, Cause::Transfer, "{why}");
    assert!(
        why.message.to_lowercase().contains("remote access"),
        "{why}"
    );
    wait_until_within("the failed room to drain", LIMIT, || {
        t.d.room_drained(11).unwrap()
    });
    // The broken queue pair is replaced on next use: rooms before and after are intact.
    for r in 12..16u64 {
        let (src, dst): (Vec<u32>, Vec<u32>) = (
            (r as u32..r as u32 + 6).collect(),
            (r as u32 * 8..r as u32 * 8 + 6).collect(),
        );
        t.open(r, &dst);
        t.send(r, &src, 2);
        assert_eq!(terminal_within(&t.d, r, LIMIT), State::Success, "room {r}");
        t.assert_pages(&src, &dst);
    }
    assert_eq!(t.d.metrics().rooms_failed.iter().sum::<u64>(), 1);
}

/// A pair over the test transport with integrity=verify, one aux buffer of 8 slots of
/// 256 bytes and `extra` on both sides. The tests that inject faults (or pause points),
/// which are keyed by room id across the process, use rooms above 200, which no other
/// test here uses: on the host the tests run at once.
fn verifying_pair(extra: &[(&str, &str)]) -> Pair {
    Pair::builder()
        .transport(&common::test_transport())
        .config(&[WORKERS, ("integrity", "verify")])
        .config(extra)
        .bufs(BUFS)
        .pages(PAGES)
        .item(ITEM)
        .aux(8, 256)
        .build()
}

/// Inv. 10 over RDMA: each batch's progress carries its runs' digests, which the decode
/// engine checks where the writes landed before it counts them. Rooms of several
/// chunks (runs split into many writes) and an aux row arrive byte for byte, say they
/// were verified, and every byte is counted verified. On the host the same rooms go
/// over TCP.
#[test]
fn verified_rooms_arrive_byte_for_byte_and_say_so() {
    let t = verifying_pair(&[("rdma_slice_bytes", "8192")]);
    let rooms = 6u64;
    let mut plans = Vec::new();
    for r in 0..rooms {
        let n = 3 + 2 * r as usize;
        let src: Vec<u32> = (0..n)
            .map(|i| ((r as usize * 11 + i * 5) % PAGES) as u32)
            .collect();
        let dst: Vec<u32> = (0..n).map(|i| (r as usize * 20 + i) as u32).collect();
        t.create(r);
        t.d.room_set_destination(r, &dst, Some(r as u32)).unwrap();
        let parts: Vec<&[u32]> = src.chunks(2).collect();
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            let aux = last.then_some(7 - r as u32);
            t.p.enqueue_chunk(r, part, last, aux).unwrap();
        }
        plans.push((src, dst));
    }
    let mut bytes = 0u64;
    for (r, (src, dst)) in plans.iter().enumerate() {
        let r = r as u64;
        assert_eq!(terminal_within(&t.d, r, LIMIT), State::Success, "room {r}");
        assert_eq!(terminal_within(&t.p, r, LIMIT), State::Success, "room {r}");
        assert!(t.d.room_verified(r).unwrap(), "room {r} was not verified");
        t.assert_pages(src, dst);
        assert_eq!(t.daux[0].page(r as u32), t.paux[0].page(7 - r as u32));
        bytes += (src.len() * BUFS * ITEM + 256) as u64;
    }
    let m = t.d.metrics();
    assert_eq!(m.bytes_verified, bytes);
    assert_eq!(m.integrity_failures, 0);
    assert_eq!(m.rooms_succeeded, rooms);
}

/// The prefill writes one run into the next page (test-only fault): over RDMA the
/// bytes land there, and the digest its progress carries, made for the page it was
/// meant for, does not match where they landed. The room fails as INTEGRITY naming the
/// page, drains, and the next room is verified. One worker, so that the batches (and
/// their progress) come in order.
#[cfg(feature = "test-hooks")]
#[test]
fn a_run_written_to_the_wrong_page_fails_as_integrity_naming_the_page() {
    let t = verifying_pair(&[("workers", "1"), ("connections_per_peer", "1")]);
    kvxfer::testing::inject_fault("integrity.wrong_page", 221);
    t.open(221, &[10, 11, 12, 13]);
    t.send(221, &[1, 2, 3, 4], 1);
    assert_eq!(terminal_within(&t.d, 221, LIMIT), State::Failed);
    let why = t.d.room_failure(221).unwrap();
    assert_eq!(why.cause, Cause::Integrity, "{why}");
    assert!(!why.from_peer, "{why}");
    assert!(why.message.contains("page 11 of kv buffer"), "{why}");
    assert!(why.message.contains("do not match their digest"), "{why}");
    assert!(!t.d.room_verified(221).unwrap());
    assert_eq!(t.d.metrics().integrity_failures, 1);
    wait_until_within("the failed room to drain", LIMIT, || {
        t.d.room_drained(221).unwrap()
    });
    let (src, dst): (Vec<u32>, Vec<u32>) = ((30..36).collect(), (60..66).collect());
    t.open(222, &dst);
    t.send(222, &src, 2);
    assert_eq!(terminal_within(&t.d, 222, LIMIT), State::Success);
    assert!(t.d.room_verified(222).unwrap());
    t.assert_pages(&src, &dst);
}

/// Over RDMA the decode engine verifies the bytes in its own pages, after the writes
/// landed: a destination byte that changes in between (test-only fault on the decode
/// side, just before the check) fails the room as INTEGRITY.
#[cfg(feature = "test-hooks")]
#[test]
fn a_destination_byte_changed_between_landing_and_verification_fails_as_integrity() {
    if !rdma() {
        return; // TCP verifies as it reads: tests/integrity.rs's tampering relay
    }
    let t = verifying_pair(&[]);
    kvxfer::testing::inject_fault("rdma.changed_after_landing", 231);
    t.open(231, &[0, 1, 2, 3, 4, 5]);
    t.send(231, &[6, 7, 8, 9, 10, 11], 3);
    assert_eq!(terminal_within(&t.d, 231, LIMIT), State::Failed);
    let why = t.d.room_failure(231).unwrap();
    assert_eq!(why.cause, Cause::Integrity, "{why}");
    assert!(why.message.contains("do not match their digest"), "{why}");
    assert!(why.message.contains("of kv buffer"), "{why}");
    assert_eq!(t.d.metrics().integrity_failures, 1);
    // The prefill engine is told, and counts it.
    common::wait_until("the prefill engine to count it", || {
        t.p.metrics().integrity_failures == 1
    });
}

/// A room that ends while its progress waits for the verifier (held at a test-only
/// pause point, after it counted itself in the room's io) is not drained until the
/// verifier let go, and its pages are then neither read nor counted: nothing verified.
#[cfg(feature = "test-hooks")]
#[test]
fn a_room_aborted_before_its_verification_is_not_read_and_drains_after_the_verifier() {
    if !rdma() {
        return; // only RDMA progress goes through the verifier
    }
    let t = verifying_pair(&[("workers", "1")]);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..4).collect(), (100..104).collect());
    kvxfer::testing::pause_at("decode.verify", 241);
    t.open(241, &dst);
    t.send(241, &src, 4);
    assert!(
        kvxfer::testing::wait_paused("decode.verify", 241, LIMIT),
        "no progress of the room reached the verifier"
    );
    t.d.room_abort(241, "client cancelled before verification")
        .unwrap();
    assert_eq!(terminal_within(&t.d, 241, LIMIT), State::Failed);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        assert!(
            !t.d.room_drained(241).unwrap(),
            "drained while the verifier held the room"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    kvxfer::testing::release("decode.verify", 241);
    wait_until_within("the aborted room to drain", LIMIT, || {
        t.d.room_drained(241).unwrap()
    });
    let m = t.d.metrics();
    assert_eq!((m.bytes_verified, m.integrity_failures), (0, 0));
    assert!(!t.d.room_verified(241).unwrap());
}
