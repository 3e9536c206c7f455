//! The invariants of DESIGN.md section 1 where a review found that they held only by
//! timing or not at all (the findings of shared/reviews/invariants-2026-12.md, numbered
//! F1..F8 there). Each test holds the interleaving the finding describes open with a
//! test-only pause point (src/testing.rs), or builds the input it describes, and fails
//! without its fix.
//!
//! `cargo test --features test-hooks --test hardening`.

#![cfg(feature = "test-hooks")]

mod common;

use std::time::{Duration, Instant};

use common::fake::{self, destination, FakePrefill};
use common::{engine, terminal_within, wait_state, wait_until, Pair, PairBuilder, Region, POISON};
use kvxfer::proto::Message;
use kvxfer::testing;
use kvxfer::{RoomPeers, State};

const BUFS: usize = 2;
const PAGES: usize = 256;
const ITEM: usize = 1024;
const PARK: Duration = Duration::from_secs(10);
/// The fake engines speak TCP.
const TCP: (&str, &str) = ("transport", "tcp");

/// A prefill and a decode engine over TCP, of this file's shape.
fn pair() -> PairBuilder {
    Pair::builder()
        .transport("tcp")
        .bufs(BUFS)
        .pages(PAGES)
        .item(ITEM)
}

/// This file's decode buffers, every byte POISON.
fn poisoned() -> Vec<Region> {
    common::poisoned(BUFS, PAGES, ITEM)
}

/// This file's prefill buffers, holding the source pattern.
fn source() -> Vec<Region> {
    common::source(BUFS, PAGES, ITEM)
}

/// F1 (invariant 6). A decode room whose destination is set becomes ready once its
/// prefill engine answered its last connection, and the connect thread then sends the
/// destination; here the room fails just before that answer. The destination must
/// never go out: a prefill that got it after the Abort would write into pages the host
/// was already told it may reuse (over RDMA `room_drained` counts an unsent destination
/// as quiet).
///
/// What this proves is only that: the room is still BOOTSTRAPPING when it fails, so the
/// connect thread's check of the state (the early return of the engine's
/// `send_destination`) stops it, and the room's own decision, on the state read under
/// its lock (`DecodeRoom::send_destination`), is not reached. The narrower window, the
/// room failing after that check and before the lock, is pinned by the room's unit
/// tests (`src/engine/decode/room/tests.rs`:
/// `no_destination_goes_out_when_the_room_is_not_live`, and that the message is handed
/// over under the lock) and by the simulator
/// (`engine::sim::scenarios`, `Seen::DestinationAfterFailure`, the bug switch
/// `DestinationAfterFailure` caught there); on real threads it is reached now and
/// then, not for certain, by tests/pin_regression.rs
/// `a_decode_room_s_destination_never_follows_its_abort_however_the_two_race`.
#[test]
fn a_destination_is_never_sent_for_a_room_that_failed_before_it_went_out() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let room = 11;
    let mut fp = FakePrefill::listen();
    d.room_create(room, RoomPeers::Prefills(vec![fp.addr.clone()]))
        .unwrap();
    d.room_set_destination(room, &[3, 4], None).unwrap();
    // The fake engine's fourth answer is the Hello of the last data connection.
    let answers = std::cell::Cell::new(0);
    fp.handshake_paced(BUFS, PAGES, ITEM, 1, &|| {
        answers.set(answers.get() + 1);
        if answers.get() == 4 {
            d.room_abort(room, "client cancelled").unwrap();
        }
        true
    });
    assert_eq!(answers.get(), 4);
    let msgs = fake::drain_msgs(fp.ctrl(), Duration::from_millis(500));
    let destination = msgs
        .iter()
        .position(|m| matches!(m, Message::Destination { room: r, .. } if *r == room));
    let abort = msgs
        .iter()
        .position(|m| matches!(m, Message::Abort { room: r, .. } if *r == room));
    assert!(abort.is_some(), "the prefill was not told: {msgs:?}");
    assert_eq!(
        destination, None,
        "the destination of failed room {room} went out (abort at {abort:?}): {msgs:?}"
    );
    assert_eq!(d.room_poll(room).unwrap(), State::Failed);
    assert!(d.room_drained(room).unwrap());
}

/// F7. The watchdog read a room's deadline before its state, while a transition arms
/// the new state's deadline before it changes the state: it could pair the old state's
/// expired deadline with the new state and fail a room that had just got a fresh
/// deadline, with the new state's cause. Here the watchdog is held between its two
/// reads of the room while the room moves from BOOTSTRAPPING (deadline passed) to
/// WAITING_FOR_INPUT (fresh deadline): it must not fail it.
#[test]
fn the_watchdog_never_fails_a_room_with_a_deadline_of_another_state() {
    const POINT: &str = "watchdog.scan";
    let t = pair().prefill(&[("bootstrap_timeout_ms", "200")]).build();
    let (p, d) = (&t.p, &t.d);
    let room = 12;
    p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    let created = Instant::now();
    testing::pause_at(POINT, room);
    assert!(
        testing::wait_paused(POINT, room, PARK),
        "the watchdog never scanned the room"
    );
    // The bootstrap deadline passes while the watchdog is held...
    std::thread::sleep(Duration::from_millis(300).saturating_sub(created.elapsed()));
    // ...and then the destination comes: WAITING_FOR_INPUT, with a fresh deadline.
    d.room_create(room, RoomPeers::Prefills(vec![p.address().to_string()]))
        .unwrap();
    d.room_set_destination(room, &[1, 2], None).unwrap();
    wait_state(p, room, State::WaitingForInput);
    testing::release(POINT, room);
    std::thread::sleep(Duration::from_millis(300));
    let state = p.room_poll(room).unwrap();
    let why = p
        .room_failure(room)
        .map(|f| f.to_string())
        .unwrap_or_default();
    assert_eq!(
        state,
        State::WaitingForInput,
        "a room fresh in waiting_for_input was failed: {why}"
    );
}

/// F5 (invariant 4). A destination held for a room not created yet, from a decode
/// engine that is then lost: the room can never get its destination (the decode room
/// failed with the loss). It must fail at once when created, as PEER_LOST naming the
/// engine, not wait out its bootstrap deadline as a BOOTSTRAP_TIMEOUT.
#[test]
fn a_room_whose_held_destination_came_from_a_lost_engine_fails_at_once() {
    let pmem = source();
    let p = engine("prefill", &pmem, &[TCP]);
    let room = 21;
    let (mut ctrl, data) = fake::decode(p.address(), 0xD21, BUFS, PAGES, ITEM);
    fake::send_msg(&mut ctrl, &destination(room, 1, vec![1, 2]));
    wait_until("the destination to be held", || p.metrics().held == 1);
    drop((ctrl, data));
    wait_until("the engine to be lost", || p.metrics().peers_lost == 1);
    p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    let state = terminal_within(&p, room, Duration::from_secs(2));
    assert_eq!(state, State::Failed, "the room waited for a lost engine");
    let why = p.room_failure(room).unwrap();
    assert_eq!(why.cause, kvxfer::Cause::PeerLost, "{why}");
    assert!(why.message.contains("decode engine"), "{why}");
}

/// F5 (invariant 4, and invariant 3's cause). A destination attached while its engine
/// is being lost: between attach() releasing the room's lock and failing the room as
/// PEER_LOST, a chunk enqueued then was dispatched for a room still BOOTSTRAPPING (the
/// room counted as ready by its destinations alone), and the worker failed it as
/// INTERNAL "cannot start a chunk" first. Chunks now wait for the Ready transition.
#[test]
fn a_chunk_enqueued_while_the_destination_s_engine_is_lost_fails_the_room_as_peer_lost() {
    const ON_DEST: &str = "prefill.on_destination";
    const LOST: &str = "prefill.attach_lost";
    let pmem = source();
    let p = engine(
        "prefill",
        &pmem,
        &[
            TCP,
            ("workers", "1"),
            ("heartbeat_interval_ms", "50"),
            ("heartbeat_misses", "3"),
        ],
    );
    let room = 22;
    let ctrl = fake::decode_ctrl(p.address(), 0xD22, BUFS, PAGES, ITEM);
    let alive = fake::KeepAlive::on(&ctrl);
    let _data = fake::decode_data(p.address(), 0xD22, 0);
    p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    testing::pause_at(ON_DEST, room);
    alive.send(&destination(room, 1, vec![1, 2]));
    assert!(testing::wait_paused(ON_DEST, room, PARK));
    // The control reader is held: nothing more is heard from the fake engine, which is
    // lost at the heartbeat deadline.
    drop(alive);
    wait_until("the engine to be lost", || p.metrics().peers_lost == 1);
    testing::pause_at(LOST, room);
    testing::release(ON_DEST, room);
    assert!(testing::wait_paused(LOST, room, PARK));
    p.enqueue_chunk(room, &[5, 6], true, None).unwrap();
    // Give a dispatched chunk the time to reach the worker.
    let early = terminal_within(&p, room, Duration::from_millis(300));
    testing::release(LOST, room);
    let state = terminal_within(&p, room, Duration::from_secs(5));
    assert_eq!(state, State::Failed);
    let why = p.room_failure(room).unwrap();
    assert_eq!(
        why.cause,
        kvxfer::Cause::PeerLost,
        "failed while {early} as {:?}: {why}",
        why.cause
    );
}

/// F5. A Done (or Progress) naming a room of ours that does not pull from the engine
/// that sent it was dropped without a trace: it is counted now.
#[test]
fn a_done_for_a_room_that_does_not_pull_from_its_sender_is_counted() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let (_a, mut b, generation) = fake::two_prefills(&d, 31, 32, (BUFS, PAGES, ITEM));
    let before = d.metrics().unknown_room_frames;
    // Engine B claims it finished room 31, which pulls from A only.
    b.done(31, generation, 1);
    wait_until("the Done to be counted", || {
        d.metrics().unknown_room_frames == before + 1
    });
    assert_eq!(d.room_poll(31).unwrap(), State::WaitingForInput);
}

/// F3. Cleared-room records shared one bound with early destinations: a burst of
/// prefill rooms failed (before their destinations came) and cleared filled it, and
/// every legitimate early destination from every decode engine was then refused as
/// "holding area is full" for up to bootstrap + waiting timeouts.
#[test]
fn a_burst_of_cleared_rooms_does_not_make_early_destinations_be_refused() {
    const BURST: u64 = 70_000; // more than the holding area's bound (65,536)
    let pmem = source();
    let p = engine("prefill", &pmem, &[TCP]);
    for room in 1..=BURST {
        p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        p.room_clear(room).unwrap();
    }
    assert!(p.metrics().cleared_overflow > 0, "the records have a bound");
    let room = BURST + 1;
    let (mut ctrl, _data) = fake::decode(p.address(), 0xD33, BUFS, PAGES, ITEM);
    fake::send_msg(&mut ctrl, &destination(room, 1, vec![1, 2]));
    wait_until("the destination to be held or refused", || {
        let m = p.metrics();
        m.held + m.held_overflow > 0
    });
    assert_eq!(
        p.metrics().held_overflow,
        0,
        "the early destination was refused"
    );
    p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    wait_state(&p, room, State::WaitingForInput);
}

/// F3. A tombstone was adopted without a generation check: an engine's Abort of an
/// earlier use of an id failed the use whose destination the same engine sent after it.
#[test]
fn an_abort_of_an_earlier_use_does_not_fail_the_use_the_engine_sent_next() {
    let pmem = source();
    let p = engine("prefill", &pmem, &[TCP]);
    let room = 41;
    let (mut ctrl, _data) = fake::decode(p.address(), 0xD41, BUFS, PAGES, ITEM);
    let abort = Message::Abort {
        room,
        generation: 5,
        reason: "the earlier request was cancelled".into(),
    };
    fake::send_msg(&mut ctrl, &abort);
    fake::send_msg(&mut ctrl, &destination(room, 6, vec![1, 2]));
    wait_until("the destination to be held", || p.metrics().held == 1);
    p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let state = p.room_poll(room).unwrap();
    let why = p
        .room_failure(room)
        .map(|f| f.to_string())
        .unwrap_or_default();
    assert_eq!(state, State::WaitingForInput, "{why}");
}

/// The port of `host:port` (how test faults name a peer).
fn port(addr: &str) -> u64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// Moves room `room` from `p` to `d` (pages 0..4 to 10..14) and returns how it ended on
/// the decode side, with its reason if it failed.
fn transfer(t: &Pair, room: u64) -> (State, String) {
    t.create(room);
    // Either may find the room already failed (a peer lost at once): the test is about
    // how the room ends.
    let _ = t.d.room_set_destination(room, &[10, 11, 12, 13], None);
    let _ = t.p.enqueue_chunk(room, &[0, 1, 2, 3], true, None);
    let state = terminal_within(&t.d, room, Duration::from_secs(5));
    let why =
        t.d.room_failure(room)
            .map(|f| f.to_string())
            .unwrap_or_default();
    (state, why)
}

/// F6 (invariant 7). A panic in a thread serving a peer (here the decode side's data
/// receiver, which had no catch) must fail that peer's rooms at once with the reason and
/// let the next room connect afresh; before, the thread died silently, the prefill's
/// writes on its connection stalled, and the room waited for its transfer deadline.
#[test]
fn a_panic_in_a_receiver_loses_its_peer_with_the_reason_and_the_next_room_reconnects() {
    let t = pair().build();
    testing::inject_fault("recv.panic", 61);
    let (state, why) = transfer(&t, 61);
    assert_eq!(state, State::Failed, "the room did not fail at once");
    assert!(why.contains("panicked"), "{why}");
    assert_eq!(t.d.room_failure(61).unwrap().cause, kvxfer::Cause::PeerLost);
    let (state, why) = transfer(&t, 62);
    assert_eq!(state, State::Success, "{why}");
}

/// F6. A panic in the decode side's connector thread left its peer neither ready nor
/// lost for good: every room to that prefill engine then waited for its bootstrap
/// deadline, forever. Now the peer is lost at once and the next room reconnects.
#[test]
fn a_panic_in_the_connector_loses_its_peer_and_the_next_room_reconnects() {
    let t = pair().build();
    testing::inject_fault("connect.panic", port(t.p.address()));
    let (state, why) = transfer(&t, 63);
    assert_eq!(state, State::Failed, "the room did not fail at once");
    assert!(why.contains("panicked"), "{why}");
    let (state, why) = transfer(&t, 64);
    assert_eq!(state, State::Success, "{why}");
}

/// A decode engine is ready, and sends its destinations, once the prefill engine has
/// answered its last data connection. The prefill engine used to register that
/// connection's link only after answering, so a chunk enqueued as soon as the room was
/// ready found no link and failed the room ("no data connection", seen in CI under
/// load). Held open: the accepting thread parked right after its answer.
#[test]
fn a_chunk_enqueued_as_soon_as_the_room_is_ready_finds_the_new_engine_s_data_link() {
    const POINT: &str = "accept.data_answered";
    let t = pair().config(&[("connections_per_peer", "1")]).build();
    let key = port(t.p.address());
    testing::pause_at(POINT, key);
    let room = 67;
    t.open(room, &[10, 11, 12, 13]);
    let parked = testing::wait_paused(POINT, key, PARK);
    let state = if parked {
        wait_state(&t.p, room, State::WaitingForInput);
        t.p.enqueue_chunk(room, &[0, 1, 2, 3], true, None).unwrap();
        terminal_within(&t.d, room, Duration::from_secs(5))
    } else {
        State::Failed
    };
    testing::release(POINT, key);
    assert!(
        parked,
        "the accepting thread never answered the data connection"
    );
    let why = t.p.room_failure(room).map(|f| f.to_string());
    assert_eq!(state, State::Success, "{why:?}");
    t.assert_pages(&[0, 1, 2, 3], &[10, 11, 12, 13]);
}

/// F6. A thread that cannot be started (here the decode side's control reader) loses
/// its peer with the reason, instead of leaving it connected with nobody reading its
/// control messages; the next room connects afresh. (A fake prefill engine: the fault
/// is process-wide, and a real one would start threads of the same name.)
#[test]
fn a_peer_thread_that_cannot_start_loses_its_peer_with_the_reason() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let mut fp = FakePrefill::listen();
    testing::inject_fault("spawn:kvxfer-ctrl-rx", port(&fp.addr));
    d.room_create(65, RoomPeers::Prefills(vec![fp.addr.clone()]))
        .unwrap();
    fp.handshake(BUFS, PAGES, ITEM, 1);
    assert_eq!(
        terminal_within(&d, 65, Duration::from_secs(5)),
        State::Failed
    );
    let why = d.room_failure(65).unwrap();
    assert!(
        why.message.contains("cannot start thread kvxfer-ctrl-rx"),
        "{why}"
    );
    d.room_create(66, RoomPeers::Prefills(vec![fp.addr.clone()]))
        .unwrap();
    fp.handshake(BUFS, PAGES, ITEM, 1);
    wait_state(&d, 66, State::WaitingForInput);
}

/// F6 (liveness). Each step of a peer's setup has its own timeout, but the whole setup
/// had none: a prefill engine answering each step just within it kept the peer in
/// setup, and every room to it waiting. The setup as a whole must finish within
/// bootstrap_timeout_ms, or the peer is lost.
#[test]
fn a_peer_whose_setup_takes_longer_than_the_bootstrap_deadline_is_lost() {
    let dmem = poisoned();
    let d = engine(
        "decode",
        &dmem,
        &[
            TCP,
            ("bootstrap_timeout_ms", "400"),
            ("connections_per_peer", "1"),
        ],
    );
    let mut fp = FakePrefill::listen();
    d.room_create(71, RoomPeers::Prefills(vec![fp.addr.clone()]))
        .unwrap();
    // A prefill engine that answers every step of the handshake after 250 ms: each
    // within the 400 ms per-step timeout, all of it well beyond. It stops once the
    // decode engine gave up on it.
    let step = || {
        std::thread::sleep(Duration::from_millis(250));
        d.metrics().peers_lost == 0
    };
    let completed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        fp.handshake_paced(BUFS, PAGES, ITEM, 1, &step)
    }))
    .unwrap_or(false);
    assert!(
        !completed,
        "the setup ran to its end: the peer was not cut at its deadline"
    );
    wait_until("the loss to be counted", || d.metrics().peers_lost == 1);
    assert_eq!(
        terminal_within(&d, 71, Duration::from_secs(5)),
        State::Failed
    );
}

/// Liveness. Control writes had no stall limit: a peer that keeps sending (its
/// heartbeats keep it "alive") but stops reading its control connection was never
/// lost, the messages to it (destinations, aborts) queued without bound, and its rooms
/// waited for their deadlines. Now a control write that makes no progress for the
/// peer deadline (heartbeat_interval_ms x heartbeat_misses) loses the peer.
#[test]
fn a_peer_that_stops_reading_its_control_connection_is_lost() {
    const BIG: usize = 65_536;
    let dmem = vec![Region::new(BIG, 16, |_| POISON)];
    let d = engine(
        "decode",
        &dmem,
        &[
            TCP,
            ("connections_per_peer", "1"),
            // A stall limit of 1 s: long enough that the fake engine's heartbeats (every
            // 20 ms) keep it alive on a loaded host, so only the stalled write can lose it.
            ("heartbeat_interval_ms", "250"),
            ("heartbeat_misses", "4"),
        ],
    );
    let mut fp = FakePrefill::listen();
    let rooms: Vec<u64> = (100..140).collect();
    for &r in &rooms {
        d.room_create(r, RoomPeers::Prefills(vec![fp.addr.clone()]))
            .unwrap();
    }
    fp.handshake(1, BIG, 16, 1);
    // The fake engine sends heartbeats and never reads its control connection again.
    let alive = fake::KeepAlive::on(fp.ctrl());
    // 40 destinations of 65,536 pages (256 KiB each): more than the sockets buffer.
    let all: Vec<u32> = (0..BIG as u32).collect();
    wait_state(&d, rooms[0], State::WaitingForInput);
    for &r in &rooms {
        // The peer may be lost (and the room failed) before the last ones are set.
        let _ = d.room_set_destination(r, &all, None);
    }
    for &r in &rooms {
        assert_fails_with(&d, r, kvxfer::Cause::PeerLost, "control write");
    }
    drop(alive);
}

/// Review (registration order): buffers registered after peers connected were unknown
/// to them (an RDMA link built earlier had no aux regions, so aux writes failed as
/// INTERNAL or TRANSFER). Registration is now closed by the first room or peer.
#[test]
fn buffers_cannot_be_registered_once_a_room_exists_or_a_peer_connected() {
    let pmem = source();
    let aux = Region::new(4, 64, |_| 0);
    let p = engine("prefill", &pmem, &[TCP]);
    let _ctrl = fake::decode_ctrl(p.address(), 0xD91, BUFS, PAGES, ITEM);
    let e = p.register_aux(vec![aux.desc()]).unwrap_err();
    assert_eq!(e.kind(), kvxfer::ErrorKind::WrongState, "{e}");
    assert!(e.message().contains("before the first room"), "{e}");
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP]);
    d.room_create(92, RoomPeers::Prefills(vec![p.address().to_string()]))
        .unwrap();
    let e = d.register_aux(vec![aux.desc()]).unwrap_err();
    assert_eq!(e.kind(), kvxfer::ErrorKind::WrongState, "{e}");
}

/// A decode room created while the setup of its prefill engine is being refused
/// (different cluster keys) attaches to the engine after the loss, and failed as
/// PEER_LOST where every room the loss itself failed says MISMATCH: the cause depended on
/// which came first (CI saw it once in `auth.rs`, whose test expects MISMATCH). A room
/// that attaches after the loss now fails with the loss's own cause.
#[test]
fn a_room_that_attaches_after_a_refused_setup_fails_with_the_refusal_s_cause() {
    const ATTACH: &str = "decode.attach";
    const KEY_A: &str = "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0";
    const KEY_B: &str = "0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20";
    let (pmem, dmem) = (source(), poisoned());
    let p = engine("prefill", &pmem, &[TCP, ("auth_key", KEY_A)]);
    let d = engine("decode", &dmem, &[TCP, ("auth_key", KEY_B)]);
    let room = 41;
    let addr = p.address().to_string();
    testing::pause_at(ATTACH, room);
    std::thread::scope(|s| {
        let creating = s.spawn(|| d.room_create(room, RoomPeers::Prefills(vec![addr.clone()])));
        assert!(testing::wait_paused(ATTACH, room, PARK));
        // The connection the room asked for is refused meanwhile, and the engine lost.
        wait_until("the refused engine to be lost", || {
            d.metrics().peers_lost == 1
        });
        testing::release(ATTACH, room);
        creating.join().unwrap().unwrap();
    });
    assert_fails_with(&d, room, kvxfer::Cause::Mismatch, "authentication");
}

/// Room `room` of `e` ends FAILED within 5 s, with `cause` and a reason naming `text`.
fn assert_fails_with(e: &kvxfer::Engine, room: u64, cause: kvxfer::Cause, text: &str) {
    assert_eq!(
        terminal_within(e, room, Duration::from_secs(5)),
        State::Failed
    );
    let why = e.room_failure(room).unwrap();
    assert_eq!(why.cause, cause, "{why}");
    assert!(why.message.contains(text), "{why}");
}
