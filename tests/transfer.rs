//! Two engines in one process over loopback TCP: real transfers through the public Rust
//! API, pages compared byte for byte, and the failure paths.

use std::ops::Range;
use std::time::{Duration, Instant};

use kvxfer::{Cause, Engine, RoomPeers, State};

mod common;

use common::{
    pattern, poisoned, source, unless_failed, wait_state, wait_terminal, wait_until,
    wait_until_within, Pair, Region, POISON,
};

const LAYERS: usize = 4;
const PAGES: usize = 64;
const ITEM: usize = 1024;
const AUX_SLOTS: usize = 8;
const AUX_ITEM: usize = 64;

/// A prefill and a decode engine, two workers each, with K and V buffers per layer plus
/// one aux buffer; the prefill with `p_extra`, the decode with `d_extra`.
fn pair_with(p_extra: &[(&str, &str)], d_extra: &[(&str, &str)]) -> Pair {
    Pair::builder()
        .config(&[("workers", "2")])
        .prefill(p_extra)
        .decode(d_extra)
        .bufs(2 * LAYERS)
        .pages(PAGES)
        .item(ITEM)
        .aux(AUX_SLOTS, AUX_ITEM)
        .build()
}

/// As [`pair_with`], both engines with `extra`.
fn pair(extra: &[(&str, &str)]) -> Pair {
    pair_with(extra, extra)
}

#[test]
fn single_chunk_transfer_delivers_every_byte() {
    let t = pair(&[]);
    t.create(1);
    let src: Vec<u32> = (0..8).collect();
    let dst: Vec<u32> = (20..28).collect();
    t.d.room_set_destination(1, &dst, None).unwrap();
    t.p.enqueue_chunk(1, &src, true, None).unwrap();
    assert_eq!(wait_terminal(&t.p, 1), State::Success);
    assert_eq!(wait_terminal(&t.d, 1), State::Success);
    t.assert_pages(&src, &dst);
    assert!(t.d.room_drained(1).unwrap());
    let m = t.d.metrics();
    assert_eq!(m.bytes_received, (8 * ITEM * 2 * LAYERS) as u64);
    assert_eq!(m.rooms_succeeded, 1);
}

/// A scheduler that sleeps in `Engine::wait` instead of polling on a timer is woken by
/// every change of its rooms' states, on both sides, through to SUCCESS and FAILED, and
/// by `Engine::wake`: each wait below returns a count past the one it was given, where a
/// missed change would leave it asleep until its timeout and fail the test.
#[test]
fn a_scheduler_waiting_on_its_engine_is_woken_by_every_change_of_state() {
    let t = pair(&[]);
    const LONG: Duration = Duration::from_secs(20);
    // Waits on `e` until room `id` is in `want`, asserting that no wait timed out.
    let until = |e: &Engine, id: u64, want: State| loop {
        let seen = e.changes();
        let now = e.room_poll(id).unwrap();
        if now == want {
            return;
        }
        assert!(!now.is_terminal(), "room {id} is {now:?}, not {want:?}");
        assert!(e.wait(seen, LONG) > seen, "a wait for room {id} timed out");
    };
    let (p, d) = (&t.p, &t.d);
    t.create(1);
    std::thread::scope(|s| {
        s.spawn(|| until(p, 1, State::Success));
        s.spawn(|| until(d, 1, State::Success));
        t.d.room_set_destination(1, &[5, 6, 7], None).unwrap();
        t.p.enqueue_chunk(1, &[0, 1, 2], true, None).unwrap();
    });
    t.assert_pages(&[0, 1, 2], &[5, 6, 7]);
    t.create(2);
    std::thread::scope(|s| {
        s.spawn(|| until(p, 2, State::Failed));
        s.spawn(|| until(d, 2, State::Failed));
        t.d.room_set_destination(2, &[8], None).unwrap();
        wait_state(&t.p, 2, State::WaitingForInput);
        t.d.room_abort(2, "client went away").unwrap();
    });
    // The host's own wakeup.
    let seen = t.d.changes();
    std::thread::scope(|s| {
        s.spawn(|| assert!(t.d.wait(seen, LONG) > seen, "wake did not wake the wait"));
        std::thread::sleep(Duration::from_millis(20));
        t.d.wake();
    });
    // Nothing changes: a wait times out with the count it was given.
    let seen = t.d.changes();
    assert_eq!(t.d.wait(seen, Duration::from_millis(20)), seen);
}

#[test]
fn many_scattered_chunks_with_aux_rows_arrive_in_order() {
    let t = pair(&[]);
    t.create(2);
    let src: Vec<u32> = vec![5, 6, 7, 40, 41, 2, 9, 10, 11, 12, 60];
    let dst: Vec<u32> = vec![1, 2, 3, 4, 30, 31, 50, 51, 52, 8, 9];
    // The chunks come before the destination: they are held, then sent.
    t.p.enqueue_chunk(2, &src[..3], false, None).unwrap();
    t.p.enqueue_chunk(2, &src[3..6], false, None).unwrap();
    t.d.room_set_destination(2, &dst, Some(5)).unwrap();
    t.p.enqueue_chunk(2, &src[6..], true, Some(3)).unwrap();
    assert_eq!(wait_terminal(&t.d, 2), State::Success);
    assert_eq!(wait_terminal(&t.p, 2), State::Success);
    t.assert_pages(&src, &dst);
    assert_eq!(t.daux[0].page(5), t.paux[0].page(3));
    assert!(t.daux[0].page(4).iter().all(|&x| x == POISON));
}

#[test]
fn an_empty_last_chunk_completes_the_room() {
    let t = pair(&[]);
    t.create(3);
    t.d.room_set_destination(3, &[7, 8], None).unwrap();
    t.p.enqueue_chunk(3, &[1, 2], false, None).unwrap();
    t.p.enqueue_chunk(3, &[], true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 3), State::Success);
    t.assert_pages(&[1, 2], &[7, 8]);
}

#[test]
fn a_destination_arriving_before_the_prefill_room_is_adopted() {
    let t = pair(&[]);
    t.d.room_create(4, RoomPeers::Prefills(vec![t.p.address().to_string()]))
        .unwrap();
    wait_state(&t.d, 4, State::WaitingForInput);
    t.d.room_set_destination(4, &[0, 1], None).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    t.p.room_create(4, RoomPeers::Decoders(1)).unwrap();
    t.p.enqueue_chunk(4, &[10, 11], true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 4), State::Success);
    t.assert_pages(&[10, 11], &[0, 1]);
}

#[test]
fn abort_on_decode_fails_both_sides_and_no_page_is_written() {
    let t = pair(&[]);
    t.create(5);
    t.d.room_set_destination(5, &[1, 2, 3], None).unwrap();
    wait_state(&t.p, 5, State::WaitingForInput);
    t.d.room_abort(5, "client went away").unwrap();
    assert_eq!(wait_terminal(&t.p, 5), State::Failed);
    let why = t.p.room_failure(5).unwrap();
    assert!(
        why.from_peer && why.message.contains("client went away"),
        "{why}"
    );
    assert_eq!(t.d.room_failure(5).unwrap().cause, Cause::Aborted);
    // Over TCP at once; over RDMA once the prefill's acknowledgement arrived.
    wait_until_within("the decode room to drain", Duration::from_secs(5), || {
        t.d.room_drained(5).unwrap()
    });
    // A chunk after the abort is refused and nothing lands.
    assert!(t.p.enqueue_chunk(5, &[0, 1, 2], true, None).is_err());
    std::thread::sleep(Duration::from_millis(50));
    t.assert_poisoned(&[1, 2, 3]);
}

#[test]
fn abort_on_prefill_between_chunks_fails_decode_with_the_peer_reason() {
    let t = pair(&[]);
    t.create(6);
    t.d.room_set_destination(6, &[1, 2, 3, 4], None).unwrap();
    t.p.enqueue_chunk(6, &[0, 1], false, None).unwrap();
    wait_state(&t.d, 6, State::Transferring);
    t.p.room_abort(6, "prefill preempted").unwrap();
    assert_eq!(wait_terminal(&t.d, 6), State::Failed);
    let why = t.d.room_failure(6).unwrap();
    assert!(
        why.from_peer && why.message.contains("prefill preempted"),
        "{why}"
    );
    assert!(t.p.enqueue_chunk(6, &[2, 3], true, None).is_err());
    t.assert_poisoned(&[3, 4]);
}

#[test]
fn a_page_count_mismatch_fails_both_sides_with_a_clear_reason() {
    let t = pair(&[]);
    t.create(7);
    t.d.room_set_destination(7, &[1, 2], None).unwrap();
    t.p.enqueue_chunk(7, &[0, 1, 2], true, None).unwrap();
    assert_eq!(wait_terminal(&t.p, 7), State::Failed);
    assert_eq!(wait_terminal(&t.d, 7), State::Failed);
    let why = t.p.room_failure(7).unwrap();
    assert_eq!(why.cause, Cause::Mismatch);
    assert!(why.message.contains("overflows"), "{why}");
    assert!(t.d.room_failure(7).unwrap().message.contains("overflows"));

    t.create(8);
    t.d.room_set_destination(8, &[1, 2, 3], None).unwrap();
    t.p.enqueue_chunk(8, &[0], true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 8), State::Failed);
    assert!(t.d.room_failure(8).unwrap().message.contains("unfilled"));
}

#[test]
fn a_registration_mismatch_fails_the_room_naming_the_buffer() {
    let t = pair(&[]);
    // A decode engine whose buffer 3 has pages of half the size.
    let bufs: Vec<Region> = (0..2 * LAYERS)
        .map(|i| match i {
            3 => Region::new(2 * PAGES, ITEM / 2, |_| 0),
            _ => Region::new(PAGES, ITEM, |_| 0),
        })
        .collect();
    let d = common::start("decode", &[], common::quiet());
    d.register_kv(common::descs(&bufs)).unwrap();
    d.room_create(9, RoomPeers::Prefills(vec![t.p.address().to_string()]))
        .unwrap();
    assert_eq!(wait_terminal(&d, 9), State::Failed);
    let why = d.room_failure(9).unwrap();
    assert!(why.message.contains("kv buffer 3"), "{why}");
    assert_eq!(why.cause, Cause::Mismatch);
}

#[test]
fn an_unreachable_prefill_fails_the_room_with_the_address() {
    let t = pair_with(&[], &[("bootstrap_timeout_ms", "500")]);
    let d = &t.d;
    // A port nobody listens on: bind one, then close it.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    d.room_create(10, RoomPeers::Prefills(vec![addr.clone()]))
        .unwrap();
    assert_eq!(wait_terminal(d, 10), State::Failed);
    let why = d.room_failure(10).unwrap();
    assert!(why.message.contains(&addr), "{why}");
}

#[test]
fn a_prefill_engine_going_away_fails_decode_rooms() {
    // Both sides beat every 50 ms: a decode that expects beats every 50 ms from a
    // prefill beating every second would lose it after 200 ms even while it lives.
    let t = pair(&[("heartbeat_interval_ms", "50"), ("heartbeat_misses", "4")]);
    // The memory stays in `t`, dropped after both engines.
    let Pair { p, d, .. } = t;
    for room in 20..25 {
        p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        d.room_create(room, RoomPeers::Prefills(vec![p.address().to_string()]))
            .unwrap();
        d.room_set_destination(room, &[room as u32], None).unwrap();
    }
    wait_state(&p, 24, State::WaitingForInput);
    drop(p);
    for room in 20..25 {
        assert_eq!(wait_terminal(&d, room), State::Failed);
        let why = d.room_failure(room).unwrap();
        assert!(
            matches!(
                why.cause,
                Cause::PeerLost | Cause::Shutdown | Cause::Aborted
            ),
            "{why}"
        );
    }
}

#[test]
fn several_decode_engines_receive_the_same_pages() {
    // Three pairs: the prefill engine of the first serves the decode engines of all.
    let ts: Vec<Pair> = (0..3).map(|_| pair(&[])).collect();
    let p = &ts[0].p;
    p.room_create(30, RoomPeers::Decoders(3)).unwrap();
    for (i, t) in ts.iter().enumerate() {
        t.d.room_create(30, RoomPeers::Prefills(vec![p.address().to_string()]))
            .unwrap();
        t.d.room_set_destination(30, &[i as u32, 10 + i as u32], Some(i as u32))
            .unwrap();
    }
    p.enqueue_chunk(30, &[3, 4], true, Some(1)).unwrap();
    assert_eq!(wait_terminal(p, 30), State::Success);
    for (i, t) in ts.iter().enumerate() {
        assert_eq!(wait_terminal(&t.d, 30), State::Success);
        for b in 0..2 * LAYERS {
            assert_eq!(t.dmem[b].page(i as u32), ts[0].pmem[b].page(3));
            assert_eq!(t.dmem[b].page(10 + i as u32), ts[0].pmem[b].page(4));
        }
        assert_eq!(t.daux[0].page(i as u32), ts[0].paux[0].page(1));
    }
}

#[test]
fn the_waiting_deadline_fails_a_room_that_never_gets_data() {
    // Only the decode side has the short deadline, so its own watchdog fires first.
    let t = pair_with(&[], &[("waiting_timeout_ms", "200")]);
    t.create(40);
    unless_failed(t.d.room_set_destination(40, &[1], None));
    assert_eq!(wait_terminal(&t.d, 40), State::Failed);
    let why = t.d.room_failure(40).unwrap();
    assert_eq!(why.cause, Cause::WaitingTimeout);
    assert!(why.message.contains("waiting_timeout_ms"));
    // The prefill room hears of it from the decode side.
    assert_eq!(wait_terminal(&t.p, 40), State::Failed);
    let why = t.p.room_failure(40).unwrap();
    assert!(
        why.from_peer && why.message.contains("waiting_timeout_ms"),
        "{why}"
    );
}

#[test]
fn many_rooms_at_once_all_succeed_and_clear_leaves_nothing() {
    // 64 rooms in 64 pages: live rooms share destination pages, which a host never does
    // and integrity=verify would rightly catch (another room's bytes where a run landed).
    let t = pair(&[("integrity", "off")]);
    for room in 100..164u64 {
        t.create(room);
        let dst: Vec<u32> = (0..4).map(|i| (room as u32 % 16) * 4 + i).collect();
        t.d.room_set_destination(room, &dst, None).unwrap();
        t.p.enqueue_chunk(room, &[room as u32 % 60, room as u32 % 60 + 1], false, None)
            .unwrap();
        t.p.enqueue_chunk(
            room,
            &[room as u32 % 60 + 2, room as u32 % 60 + 3],
            true,
            None,
        )
        .unwrap();
    }
    for room in 100..164u64 {
        assert_eq!(wait_terminal(&t.d, room), State::Success, "room {room}");
        assert_eq!(wait_terminal(&t.p, room), State::Success, "room {room}");
        t.d.room_clear(room).unwrap();
        t.p.room_clear(room).unwrap();
    }
    assert_eq!(t.d.room_count(), 0);
    assert_eq!(t.p.room_count(), 0);
    let m = t.d.metrics();
    assert_eq!(m.inflight, 0);
    assert_eq!(m.rooms_succeeded, 64);
}

/// Waits until room is drained, re-poisons its pages, lets any straggler arrive, and
/// checks no byte landed after the drain.
fn assert_no_write_after_drain(t: &Pair, room: u64, dst: &[u32]) {
    wait_until_within(
        &format!("room {room} to drain"),
        Duration::from_secs(10),
        || t.d.room_drained(room).unwrap(),
    );
    t.repoison(dst);
    std::thread::sleep(Duration::from_millis(100));
    t.assert_poisoned(dst);
}

#[test]
fn abort_at_every_stage_from_either_side_ends_both_rooms() {
    // (stage, abort from decode?)
    for from_decode in [true, false] {
        let t = pair(&[]);
        let dst: Vec<u32> = (0..32).collect();
        let src: Vec<u32> = (32..64).collect();

        // 1. Before the destination is known.
        t.create(1);
        t.side(from_decode).room_abort(1, "stage 1").unwrap();
        assert_eq!(wait_terminal(&t.p, 1), State::Failed, "prefill, stage 1");
        if !from_decode {
            // The decode room learns it when it sends its destination.
            t.d.room_set_destination(1, &dst[..1], None).unwrap();
        }
        assert_eq!(wait_terminal(&t.d, 1), State::Failed, "decode, stage 1");

        // 2. Between chunks.
        t.create(2);
        t.d.room_set_destination(2, &dst, None).unwrap();
        t.p.enqueue_chunk(2, &src[..8], false, None).unwrap();
        wait_state(&t.d, 2, State::Transferring);
        t.side(from_decode).room_abort(2, "stage 2").unwrap();
        assert_eq!(wait_terminal(&t.p, 2), State::Failed);
        assert_eq!(wait_terminal(&t.d, 2), State::Failed);
        assert!(t.p.enqueue_chunk(2, &src[8..], true, None).is_err());
        assert_no_write_after_drain(&t, 2, &dst);

        // 3. While a chunk is on the wire: abort as soon as bytes arrive.
        t.create(3);
        t.d.room_set_destination(3, &dst, None).unwrap();
        t.p.enqueue_chunk(3, &src, true, None).unwrap();
        let s0 = Instant::now();
        while t.d.metrics().bytes_received == 0 && s0.elapsed() < Duration::from_secs(10) {
            std::hint::spin_loop();
        }
        t.side(from_decode).room_abort(3, "stage 3").unwrap();
        let (ps, ds) = (wait_terminal(&t.p, 3), wait_terminal(&t.d, 3));
        // The whole chunk may have landed before the abort: then both may be SUCCESS;
        // either way the two sides agree unless the abort came after completion.
        assert!(
            ds == State::Failed || ps == State::Success,
            "prefill {ps}, decode {ds}"
        );
        if ds == State::Failed {
            assert_no_write_after_drain(&t, 3, &dst);
        }

        // 4. After the last chunk completed: SUCCESS stays.
        t.create(4);
        t.d.room_set_destination(4, &dst[..2], None).unwrap();
        t.p.enqueue_chunk(4, &src[..2], true, None).unwrap();
        assert_eq!(wait_terminal(&t.p, 4), State::Success);
        assert_eq!(wait_terminal(&t.d, 4), State::Success);
        t.side(from_decode).room_abort(4, "stage 4").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(t.p.room_poll(4).unwrap(), State::Success);
        assert_eq!(t.d.room_poll(4).unwrap(), State::Success);

        for room in 1..=3 {
            for e in [&t.p, &t.d] {
                if let Ok(why) = e.room_failure(room) {
                    assert!(!why.message.is_empty());
                    assert!(
                        why.message.contains(&format!("stage {room}"))
                            || why.cause != Cause::Aborted,
                        "{why}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_transfer_deadline_fails_a_room_whose_last_chunk_never_comes() {
    let t = pair_with(&[], &[("transfer_timeout_ms", "200")]);
    t.create(50);
    t.d.room_set_destination(50, &[1, 2], None).unwrap();
    t.p.enqueue_chunk(50, &[1], false, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 50), State::Failed);
    assert_eq!(wait_terminal(&t.p, 50), State::Failed);
    let why = t.d.room_failure(50).unwrap();
    assert_eq!(why.cause, Cause::TransferTimeout);
    assert!(why.message.contains("transfer_timeout_ms"), "{why}");
}

#[test]
fn the_bootstrap_deadline_fails_a_prefill_room_that_gets_no_destination() {
    let t = pair(&[("bootstrap_timeout_ms", "150")]);
    t.p.room_create(60, RoomPeers::Decoders(1)).unwrap();
    unless_failed(t.p.enqueue_chunk(60, &[1], true, None));
    assert_eq!(wait_terminal(&t.p, 60), State::Failed);
    let why = t.p.room_failure(60).unwrap();
    assert_eq!(why.cause, Cause::BootstrapTimeout);
    assert!(why.message.contains("bootstrap_timeout_ms"), "{why}");
}

#[test]
fn clearing_a_live_room_aborts_it_on_the_peer_too() {
    let t = pair(&[]);
    t.create(70);
    t.d.room_set_destination(70, &[1], None).unwrap();
    wait_state(&t.p, 70, State::WaitingForInput);
    t.d.room_clear(70).unwrap();
    assert!(t.d.room_poll(70).is_err());
    assert_eq!(wait_terminal(&t.p, 70), State::Failed);
    assert!(t
        .p
        .room_failure(70)
        .unwrap()
        .message
        .contains("cleared while live"));
    // The id is free again on decode, and a new use of it works end to end.
    t.p.room_clear(70).unwrap();
    t.create(70);
    t.d.room_set_destination(70, &[3], None).unwrap();
    t.p.enqueue_chunk(70, &[9], true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 70), State::Success);
    t.assert_pages(&[9], &[3]);
}

#[test]
fn dropping_an_engine_fails_its_live_rooms_as_shut_down() {
    let t = pair(&[]);
    t.create(80);
    // The memory stays in `t`, dropped after both engines.
    let Pair { p, d, .. } = t;
    drop(p);
    assert_eq!(wait_terminal(&d, 80), State::Failed);
    drop(d);
}

#[test]
fn an_abort_that_arrives_before_the_prefill_room_exists_fails_it_on_creation() {
    let t = pair(&[]);
    t.d.room_create(90, RoomPeers::Prefills(vec![t.p.address().to_string()]))
        .unwrap();
    t.d.room_abort(90, "cancelled early").unwrap();
    // Give the abort time to reach the prefill engine before its room exists.
    wait_until("the abort to reach the prefill engine", || {
        t.p.metrics().unknown_room_frames > 0
    });
    t.p.room_create(90, RoomPeers::Decoders(1)).unwrap();
    assert_eq!(t.p.room_poll(90).unwrap(), State::Failed);
    let why = t.p.room_failure(90).unwrap();
    assert!(
        why.from_peer && why.message.contains("cancelled early"),
        "{why}"
    );
}

/// An engine of `role` holding the K and V buffers of `layers` (two per layer, out of
/// `kv`) and the aux buffer `aux`.
fn layered_engine(role: &str, kv: &[Region], aux: &Region, layers: Range<usize>) -> Engine {
    let e = common::start(role, &[], common::quiet());
    let ids = layers.clone().flat_map(|l| [l as u32; 2]).collect();
    let bufs = common::descs(&kv[2 * layers.start..2 * layers.end]);
    e.register_kv_layers(bufs, ids).unwrap();
    e.register_aux(vec![aux.desc()]).unwrap();
    e
}

/// An aux buffer of `AUX_SLOTS` slots, every byte `byte`.
fn aux(byte: u8) -> Region {
    Region::new(AUX_SLOTS, AUX_ITEM, move |_| byte)
}

#[test]
fn a_decode_room_pulls_each_layer_from_the_pipeline_stage_that_has_it() {
    let s0 = source(2 * LAYERS, PAGES, ITEM);
    let s1: Vec<Region> = (0..2 * LAYERS)
        .map(|b| Region::new(PAGES, ITEM, move |i| pattern(b, i / ITEM, i % ITEM) ^ 0x5A))
        .collect();
    let dmem = poisoned(2 * LAYERS, PAGES, ITEM);
    let (a0, a1, da) = (aux(1), aux(3), aux(POISON));
    let stage0 = layered_engine("prefill", &s0, &a0, 0..LAYERS / 2);
    let stage1 = layered_engine("prefill", &s1, &a1, LAYERS / 2..LAYERS);
    let d = layered_engine("decode", &dmem, &da, 0..LAYERS);
    let addrs = vec![stage0.address().to_string(), stage1.address().to_string()];
    d.room_create(1, RoomPeers::Prefills(addrs)).unwrap();
    d.room_set_destination(1, &[4, 5, 6], None).unwrap();
    for stage in [&stage0, &stage1] {
        stage.room_create(1, RoomPeers::Decoders(1)).unwrap();
        stage.enqueue_chunk(1, &[10, 11], false, None).unwrap();
        stage.enqueue_chunk(1, &[12], true, None).unwrap();
    }
    assert_eq!(wait_terminal(&d, 1), State::Success);
    for (s, t) in [(10, 4), (11, 5), (12, 6)] {
        for b in 0..2 * LAYERS {
            let from = if b < LAYERS { &s0 } else { &s1 };
            assert_eq!(dmem[b].page(t), from[b].page(s), "buffer {b}");
        }
    }
}

#[test]
fn a_decode_room_whose_stages_miss_a_layer_fails_naming_the_buffer() {
    let s0 = source(2 * LAYERS, PAGES, ITEM);
    let dmem = poisoned(2 * LAYERS, PAGES, ITEM);
    let (a0, da) = (aux(1), aux(POISON));
    let stage0 = layered_engine("prefill", &s0, &a0, 0..LAYERS / 2);
    let d = layered_engine("decode", &dmem, &da, 0..LAYERS);
    d.room_create(2, RoomPeers::Prefills(vec![stage0.address().to_string()]))
        .unwrap();
    assert_eq!(wait_terminal(&d, 2), State::Failed);
    let why = d.room_failure(2).unwrap();
    assert_eq!(why.cause, Cause::Mismatch);
    assert!(
        why.message
            .contains(&format!("decode kv buffer {} is delivered by none", LAYERS)),
        "{why}"
    );
}

#[test]
fn a_destination_for_a_room_failed_and_cleared_before_it_arrived_is_answered_at_once() {
    // Default deadlines (30 s): the answer must not wait for any of them.
    let t = pair(&[]);
    t.p.room_create(91, RoomPeers::Decoders(1)).unwrap();
    t.p.room_abort(91, "preempted before the decode side showed up")
        .unwrap();
    t.p.room_clear(91).unwrap();
    t.d.room_create(91, RoomPeers::Prefills(vec![t.p.address().to_string()]))
        .unwrap();
    t.d.room_set_destination(91, &[1], None).unwrap();
    let start = Instant::now();
    assert_eq!(wait_terminal(&t.d, 91), State::Failed);
    assert!(start.elapsed() < Duration::from_secs(5));
    let why = t.d.room_failure(91).unwrap();
    assert!(
        why.from_peer && why.message.contains("preempted before"),
        "{why}"
    );
    // A new use of the id on the prefill side is not touched by the old tombstone.
    t.d.room_clear(91).unwrap();
    t.create(91);
    t.d.room_set_destination(91, &[2], None).unwrap();
    t.p.enqueue_chunk(91, &[3], true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 91), State::Success);
}

#[test]
fn a_wildcard_listen_address_is_advertised_with_a_reachable_host() {
    // Beyond loopback, an engine needs a key (or auth=off): as a deployment would.
    let key = ("auth_key", "5a".repeat(32));
    let key = (key.0, key.1.as_str());
    let t = pair_with(&[("listen", "0.0.0.0:0"), key], &[key]);
    let (p, d) = (&t.p, &t.d);
    let addr = p.address().to_string();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let resolves = std::net::ToSocketAddrs::to_socket_addrs(&(host.trim(), 1))
        .is_ok_and(|mut a| a.next().is_some());
    if !resolves {
        // (The soft-RoCE guest's host name resolves nowhere: the bound address stays.)
        assert!(addr.starts_with("0.0.0.0:"), "{addr}");
        return;
    }
    assert!(!addr.starts_with("0.0.0.0:"), "{addr}");
    // And a decode engine can use it.
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    d.room_create(1, RoomPeers::Prefills(vec![addr])).unwrap();
    d.room_set_destination(1, &[2], None).unwrap();
    p.enqueue_chunk(1, &[3], true, None).unwrap();
    assert_eq!(wait_terminal(d, 1), State::Success);
}

/// With a cluster key on both sides the pages arrive as without one (over RDMA too: the
/// queue pairs are exchanged on the authenticated control connection); with different
/// keys no room succeeds on either side and no page is written.
#[test]
fn a_shared_cluster_key_transfers_and_different_keys_write_nothing() {
    let key = "5ca1ab1e".repeat(8);
    let t = pair(&[("auth_key", &key)]);
    t.create(41);
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..6).collect(), (30..36).collect());
    t.d.room_set_destination(41, &dst, Some(2)).unwrap();
    t.p.enqueue_chunk(41, &src[..3], false, None).unwrap();
    t.p.enqueue_chunk(41, &src[3..], true, Some(1)).unwrap();
    assert_eq!(wait_terminal(&t.d, 41), State::Success);
    assert_eq!(wait_terminal(&t.p, 41), State::Success);
    t.assert_pages(&src, &dst);
    assert_eq!(t.daux[0].page(2), t.paux[0].page(1));
    assert_eq!(t.p.metrics().auth_failures + t.d.metrics().auth_failures, 0);

    let other = "0ddba11".repeat(10);
    let t = pair_with(
        &[("auth_key", &key), ("bootstrap_timeout_ms", "1000")],
        &[("auth_key", &other[..64])],
    );
    t.create(42);
    unless_failed(t.d.room_set_destination(42, &dst, None));
    unless_failed(t.p.enqueue_chunk(42, &src, true, None));
    assert_eq!(wait_terminal(&t.d, 42), State::Failed);
    let why = t.d.room_failure(42).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(
        why.message.contains("authentication failed (wrong key)"),
        "{why}"
    );
    assert_eq!(wait_terminal(&t.p, 42), State::Failed);
    assert!(t.p.room_failure(42).unwrap().message.contains("wrong key"));
    t.assert_poisoned(&dst);
    assert!(t.d.metrics().bytes_received == 0 && t.p.metrics().bytes_sent == 0);
}
