//! Two engines in one process over loopback TCP: real transfers through the public Rust
//! API, pages compared byte for byte, and the failure paths.

use std::time::{Duration, Instant};

use kvxfer::log::{Level, Logger};
use kvxfer::{BufferDesc, Cause, Config, Engine, RoomPeers, State};

mod common;

use common::wait_state;

fn wait_terminal(e: &Engine, room: u64) -> State {
    common::wait_terminal(e, room, Duration::from_secs(20))
}

const LAYERS: usize = 4;
const PAGES: usize = 64;
const ITEM: usize = 1024;
const AUX_SLOTS: usize = 8;
const AUX_ITEM: usize = 64;

/// One side's registered memory: K and V per layer plus one aux buffer.
struct Mem {
    kv: Vec<Vec<u8>>,
    aux: Vec<u8>,
}

impl Mem {
    fn new(fill: impl Fn(usize, usize) -> u8) -> Mem {
        Mem {
            kv: (0..2 * LAYERS)
                .map(|b| (0..PAGES * ITEM).map(|i| fill(b, i)).collect())
                .collect(),
            aux: (0..AUX_SLOTS * AUX_ITEM).map(|i| fill(99, i)).collect(),
        }
    }
    fn page(&self, b: usize, p: u32) -> &[u8] {
        &self.kv[b][p as usize * ITEM..(p as usize + 1) * ITEM]
    }
    fn slot(&self, s: u32) -> &[u8] {
        &self.aux[s as usize * AUX_ITEM..(s as usize + 1) * AUX_ITEM]
    }
}

fn engine(role: &str, mem: &mut Mem, extra: &[(&str, &str)]) -> Engine {
    let mut c = Config::default();
    c.set("role", role).unwrap();
    c.set("transport", &common::test_transport()).unwrap();
    c.set("workers", "2").unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    let e = Engine::new(c, Logger::new(Level::Error, None)).unwrap();
    e.register_kv(
        mem.kv
            .iter_mut()
            .map(|b| BufferDesc {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
                item_len: ITEM,
            })
            .collect(),
    )
    .unwrap();
    e.register_aux(vec![BufferDesc {
        base: mem.aux.as_mut_ptr() as usize,
        len: mem.aux.len(),
        item_len: AUX_ITEM,
    }])
    .unwrap();
    e
}

fn src_pattern(b: usize, i: usize) -> u8 {
    (b * 31 + i * 7 + i / ITEM) as u8
}
const POISON: u8 = 0xEE;

struct Pair {
    pmem: Box<Mem>,
    dmem: Box<Mem>,
    p: Engine,
    d: Engine,
}

fn pair(extra: &[(&str, &str)]) -> Pair {
    pair_with(extra, extra)
}

fn pair_with(p_extra: &[(&str, &str)], d_extra: &[(&str, &str)]) -> Pair {
    let mut pmem = Box::new(Mem::new(src_pattern));
    let mut dmem = Box::new(Mem::new(|_, _| POISON));
    let p = engine("prefill", &mut pmem, p_extra);
    let d = engine("decode", &mut dmem, d_extra);
    Pair { pmem, dmem, p, d }
}

impl Pair {
    fn create(&self, room: u64) {
        self.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        self.d
            .room_create(
                room,
                RoomPeers::Prefills(vec![self.p.address().to_string()]),
            )
            .unwrap();
    }
    fn assert_pages(&self, src: &[u32], dst: &[u32]) {
        for (&s, &d) in src.iter().zip(dst) {
            for b in 0..2 * LAYERS {
                assert_eq!(
                    self.dmem.page(b, d),
                    self.pmem.page(b, s),
                    "buffer {b} src {s} dst {d}"
                );
            }
        }
    }
    fn assert_poisoned(&self, dst: &[u32]) {
        for &d in dst {
            for b in 0..2 * LAYERS {
                assert!(
                    self.dmem.page(b, d).iter().all(|&x| x == POISON),
                    "page {d} of buffer {b} was written"
                );
            }
        }
    }
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
    assert_eq!(t.dmem.slot(5), t.pmem.slot(3));
    assert!(t.dmem.slot(4).iter().all(|&x| x == POISON));
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
    let t0 = Instant::now();
    while !t.d.room_drained(5).unwrap() {
        assert!(t0.elapsed() < Duration::from_secs(5), "never drained");
        std::thread::sleep(Duration::from_millis(1));
    }
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
    let mut pmem = Box::new(Mem::new(src_pattern));
    let p = engine("prefill", &mut pmem, &[]);
    let mut c = Config::default();
    c.set("role", "decode").unwrap();
    let d = Engine::new(c, Logger::new(Level::Error, None)).unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..2 * LAYERS).map(|_| vec![0u8; PAGES * ITEM]).collect();
    d.register_kv(
        bufs.iter_mut()
            .enumerate()
            .map(|(i, b)| BufferDesc {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
                item_len: if i == 3 { ITEM / 2 } else { ITEM },
            })
            .collect(),
    )
    .unwrap();
    d.room_create(9, RoomPeers::Prefills(vec![p.address().to_string()]))
        .unwrap();
    assert_eq!(wait_terminal(&d, 9), State::Failed);
    let why = d.room_failure(9).unwrap();
    assert!(why.message.contains("kv buffer 3"), "{why}");
    assert_eq!(why.cause, Cause::Mismatch);
}

#[test]
fn an_unreachable_prefill_fails_the_room_with_the_address() {
    let mut dmem = Box::new(Mem::new(|_, _| 0));
    let d = engine("decode", &mut dmem, &[("bootstrap_timeout_ms", "500")]);
    // A port nobody listens on: bind one, then close it.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    d.room_create(10, RoomPeers::Prefills(vec![addr.clone()]))
        .unwrap();
    assert_eq!(wait_terminal(&d, 10), State::Failed);
    let why = d.room_failure(10).unwrap();
    assert!(why.message.contains(&addr), "{why}");
}

#[test]
fn a_prefill_engine_going_away_fails_decode_rooms() {
    let mut pmem = Box::new(Mem::new(src_pattern));
    let mut dmem = Box::new(Mem::new(|_, _| POISON));
    let p = engine("prefill", &mut pmem, &[]);
    let d = engine(
        "decode",
        &mut dmem,
        &[("heartbeat_interval_ms", "50"), ("heartbeat_misses", "4")],
    );
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
    let mut pmem = Box::new(Mem::new(src_pattern));
    let p = engine("prefill", &mut pmem, &[]);
    let mut dmems: Vec<Box<Mem>> = (0..3).map(|_| Box::new(Mem::new(|_, _| POISON))).collect();
    let ds: Vec<Engine> = dmems.iter_mut().map(|m| engine("decode", m, &[])).collect();
    p.room_create(30, RoomPeers::Decoders(3)).unwrap();
    for (i, d) in ds.iter().enumerate() {
        d.room_create(30, RoomPeers::Prefills(vec![p.address().to_string()]))
            .unwrap();
        d.room_set_destination(30, &[i as u32, 10 + i as u32], Some(i as u32))
            .unwrap();
    }
    p.enqueue_chunk(30, &[3, 4], true, Some(1)).unwrap();
    assert_eq!(wait_terminal(&p, 30), State::Success);
    for (i, d) in ds.iter().enumerate() {
        assert_eq!(wait_terminal(d, 30), State::Success);
        for b in 0..2 * LAYERS {
            assert_eq!(dmems[i].page(b, i as u32), pmem.page(b, 3));
            assert_eq!(dmems[i].page(b, 10 + i as u32), pmem.page(b, 4));
        }
        assert_eq!(dmems[i].slot(i as u32), pmem.slot(1));
    }
}

#[test]
fn the_waiting_deadline_fails_a_room_that_never_gets_data() {
    // Only the decode side has the short deadline, so its own watchdog fires first.
    let t = pair_with(&[], &[("waiting_timeout_ms", "200")]);
    t.create(40);
    t.d.room_set_destination(40, &[1], None).unwrap();
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
    let t = pair(&[]);
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
fn assert_no_write_after_drain(t: &mut Pair, room: u64, dst: &[u32]) {
    let start = Instant::now();
    while !t.d.room_drained(room).unwrap() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "room {room} never drained"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    for &d in dst {
        for b in 0..2 * LAYERS {
            t.dmem.kv[b][d as usize * ITEM..(d as usize + 1) * ITEM].fill(POISON);
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    t.assert_poisoned(dst);
}

#[test]
fn abort_at_every_stage_from_either_side_ends_both_rooms() {
    // (stage, abort from decode?)
    for from_decode in [true, false] {
        let mut t = pair(&[]);
        fn side(t: &Pair, from_decode: bool) -> &Engine {
            if from_decode {
                &t.d
            } else {
                &t.p
            }
        }
        let dst: Vec<u32> = (0..32).collect();
        let src: Vec<u32> = (32..64).collect();

        // 1. Before the destination is known.
        t.create(1);
        side(&t, from_decode).room_abort(1, "stage 1").unwrap();
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
        side(&t, from_decode).room_abort(2, "stage 2").unwrap();
        assert_eq!(wait_terminal(&t.p, 2), State::Failed);
        assert_eq!(wait_terminal(&t.d, 2), State::Failed);
        assert!(t.p.enqueue_chunk(2, &src[8..], true, None).is_err());
        assert_no_write_after_drain(&mut t, 2, &dst);

        // 3. While a chunk is on the wire: abort as soon as bytes arrive.
        t.create(3);
        t.d.room_set_destination(3, &dst, None).unwrap();
        t.p.enqueue_chunk(3, &src, true, None).unwrap();
        let s0 = Instant::now();
        while t.d.metrics().bytes_received == 0 && s0.elapsed() < Duration::from_secs(10) {
            std::hint::spin_loop();
        }
        side(&t, from_decode).room_abort(3, "stage 3").unwrap();
        let (ps, ds) = (wait_terminal(&t.p, 3), wait_terminal(&t.d, 3));
        // The whole chunk may have landed before the abort: then both may be SUCCESS;
        // either way the two sides agree unless the abort came after completion.
        assert!(
            ds == State::Failed || ps == State::Success,
            "prefill {ps}, decode {ds}"
        );
        if ds == State::Failed {
            assert_no_write_after_drain(&mut t, 3, &dst);
        }

        // 4. After the last chunk completed: SUCCESS stays.
        t.create(4);
        t.d.room_set_destination(4, &dst[..2], None).unwrap();
        t.p.enqueue_chunk(4, &src[..2], true, None).unwrap();
        assert_eq!(wait_terminal(&t.p, 4), State::Success);
        assert_eq!(wait_terminal(&t.d, 4), State::Success);
        side(&t, from_decode).room_abort(4, "stage 4").unwrap();
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
    t.p.enqueue_chunk(60, &[1], true, None).unwrap();
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
    let Pair { p, d, pmem, dmem } = t;
    drop(p);
    assert_eq!(wait_terminal(&d, 80), State::Failed);
    drop(d);
    drop((pmem, dmem));
}

#[test]
fn an_abort_that_arrives_before_the_prefill_room_exists_fails_it_on_creation() {
    let t = pair(&[]);
    t.d.room_create(90, RoomPeers::Prefills(vec![t.p.address().to_string()]))
        .unwrap();
    t.d.room_abort(90, "cancelled early").unwrap();
    // Give the abort time to reach the prefill engine before its room exists.
    let start = Instant::now();
    while t.p.metrics().unknown_room_frames == 0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    t.p.room_create(90, RoomPeers::Decoders(1)).unwrap();
    assert_eq!(t.p.room_poll(90).unwrap(), State::Failed);
    let why = t.p.room_failure(90).unwrap();
    assert!(
        why.from_peer && why.message.contains("cancelled early"),
        "{why}"
    );
}

fn layered_engine(role: &str, mem: &mut Mem, layers: std::ops::Range<usize>) -> Engine {
    let mut c = Config::default();
    c.set("role", role).unwrap();
    let e = Engine::new(c, Logger::new(Level::Error, None)).unwrap();
    let mut bufs = Vec::new();
    let mut ids = Vec::new();
    for l in layers {
        for kv in 0..2 {
            let b = &mut mem.kv[2 * l + kv];
            bufs.push(BufferDesc {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
                item_len: ITEM,
            });
            ids.push(l as u32);
        }
    }
    e.register_kv_layers(bufs, ids).unwrap();
    e.register_aux(vec![BufferDesc {
        base: mem.aux.as_mut_ptr() as usize,
        len: mem.aux.len(),
        item_len: AUX_ITEM,
    }])
    .unwrap();
    e
}

#[test]
fn a_decode_room_pulls_each_layer_from_the_pipeline_stage_that_has_it() {
    let mut s0 = Box::new(Mem::new(src_pattern));
    let mut s1 = Box::new(Mem::new(|b, i| src_pattern(b, i) ^ 0x5A));
    let mut dmem = Box::new(Mem::new(|_, _| POISON));
    let stage0 = layered_engine("prefill", &mut s0, 0..LAYERS / 2);
    let stage1 = layered_engine("prefill", &mut s1, LAYERS / 2..LAYERS);
    let d = layered_engine("decode", &mut dmem, 0..LAYERS);
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
            assert_eq!(dmem.page(b, t), from.page(b, s), "buffer {b}");
        }
    }
}

#[test]
fn a_decode_room_whose_stages_miss_a_layer_fails_naming_the_buffer() {
    let mut s0 = Box::new(Mem::new(src_pattern));
    let mut dmem = Box::new(Mem::new(|_, _| POISON));
    let stage0 = layered_engine("prefill", &mut s0, 0..LAYERS / 2);
    let d = layered_engine("decode", &mut dmem, 0..LAYERS);
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
    let mut mem = Box::new(Mem::new(src_pattern));
    let p = engine("prefill", &mut mem, &[("listen", "0.0.0.0:0")]);
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
    let mut dmem = Box::new(Mem::new(|_, _| POISON));
    let d = engine("decode", &mut dmem, &[]);
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    d.room_create(1, RoomPeers::Prefills(vec![addr])).unwrap();
    d.room_set_destination(1, &[2], None).unwrap();
    p.enqueue_chunk(1, &[3], true, None).unwrap();
    assert_eq!(wait_terminal(&d, 1), State::Success);
}
