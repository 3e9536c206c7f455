//! Hostile and broken peers on raw sockets: malformed, truncated and out-of-grant frames
//! close the connection and fail that peer's rooms with a reason; the process lives on
//! and no byte lands outside the grant.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::fake::{
    self, data_frame, destination, kv_header, read_until_closed, runs_frame, send_msg, FakePrefill,
};
use common::{all_filled, engine, poisoned, source, wait_state, wait_terminal, Region, POISON};
use kvxfer::proto::{DataHeader, Message};
use kvxfer::{Cause, Engine, RoomPeers, State};

const ITEM: usize = 256;
const PAGES: usize = 16;
/// Both sides register 2 KV buffers of PAGES pages of ITEM bytes.
const BUFS: usize = 2;
/// Every engine of this file has one data connection per peer.
const ONE_CONN: (&str, &str) = ("connections_per_peer", "1");
/// The pages of every decode room's destination.
const DEST: [u32; 2] = [2, 3];

/// A decode engine with `extra` (beyond one data connection per peer) over fresh
/// POISON buffers, and a fake prefill engine serving its room `room` over `conns` data
/// connections once the room's destination DEST reached it; with that destination's
/// generation.
fn served(
    room: u64,
    extra: &[(&str, &str)],
    conns: usize,
) -> (Vec<Region>, Engine, FakePrefill, u64) {
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine("decode", &mem, &[&[ONE_CONN], extra].concat());
    let (f, dest) = FakePrefill::serving(&d, room, &DEST, BUFS, PAGES, ITEM, conns);
    assert_eq!(dest.pages, DEST);
    (mem, d, f, dest.generation)
}

/// A data frame of `n` pages of KV buffer `buffer` from `first_page`, every byte `byte`.
fn frame(room: u64, generation: u64, buffer: u32, first_page: u32, n: u32, byte: u8) -> Vec<u8> {
    data_frame(
        &kv_header(room, generation, buffer, first_page, n, ITEM),
        byte,
    )
}

/// A prefill engine and its buffers, holding the source pattern.
fn prefill() -> (Vec<Region>, Engine) {
    let mem = source(BUFS, PAGES, ITEM);
    let e = engine("prefill", &mem, &[ONE_CONN]);
    (mem, e)
}

#[test]
fn garbage_before_the_handshake_closes_the_connection_and_the_engine_lives() {
    let (_mem, p) = prefill();
    for junk in [
        &b"GET / HTTP/1.1\r\n\r\n"[..],
        &[0u8; 64][..],
        &[0xFF; 3][..],
    ] {
        let mut s = TcpStream::connect(p.address()).unwrap();
        s.write_all(junk).unwrap();
        if junk.len() < 16 {
            s.shutdown(std::net::Shutdown::Write).unwrap();
        }
        read_until_closed(&mut s);
    }
    // Still serving: a well-behaved peer handshakes fine.
    let _ok = fake::decode_ctrl(p.address(), 1, BUFS, PAGES, ITEM);
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    assert_eq!(p.room_poll(1).unwrap(), State::Bootstrapping);
}

#[test]
fn a_malformed_frame_from_a_peer_fails_its_rooms_with_a_reason() {
    let (_mem, p) = prefill();
    let mut s = fake::decode_ctrl(p.address(), 2, BUFS, PAGES, ITEM);
    p.room_create(5, RoomPeers::Decoders(1)).unwrap();
    send_msg(&mut s, &destination(5, 77, vec![0, 1]));
    wait_state(&p, 5, State::WaitingForInput);
    // A frame header with a bad magic.
    s.write_all(&[0xAB; 16]).unwrap();
    read_until_closed(&mut s);
    assert_eq!(wait_terminal(&p, 5), State::Failed);
    let why = p.room_failure(5).unwrap();
    assert_eq!(why.cause, Cause::PeerLost);
    assert!(why.message.contains("malformed frame"), "{why}");
    assert!(p.metrics().protocol_errors >= 1);
}

/// Data frames of either kind belong on data connections: on the control connection
/// they lose the peer, saying which kind came.
#[test]
fn a_data_frame_on_the_control_connection_loses_the_peer_naming_its_kind() {
    let (_mem, p) = prefill();
    let h = kv_header(6, 77, 0, 0, 1, ITEM);
    for (room, frame, kind) in [
        (6, data_frame(&h, 0x41), "Data frame"),
        (8, runs_frame(&[(h, 0x41)]), "DataRuns frame"),
    ] {
        let mut s = fake::decode_ctrl(p.address(), room, BUFS, PAGES, ITEM);
        p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        send_msg(&mut s, &destination(room, 77, vec![0, 1]));
        wait_state(&p, room, State::WaitingForInput);
        s.write_all(&frame).unwrap();
        read_until_closed(&mut s);
        assert_failed(
            &p,
            room,
            Cause::PeerLost,
            &format!("{kind} on the control connection"),
        );
    }
}

#[test]
fn a_truncated_frame_then_close_fails_the_room() {
    let (_mem, p) = prefill();
    let mut s = fake::decode_ctrl(p.address(), 3, BUFS, PAGES, ITEM);
    p.room_create(6, RoomPeers::Decoders(1)).unwrap();
    send_msg(&mut s, &destination(6, 1, vec![3]));
    let mut f = Vec::new();
    destination(9, 1, vec![1, 2, 3]).encode(&mut f).unwrap();
    s.write_all(&f[..f.len() - 5]).unwrap();
    drop(s);
    assert_eq!(wait_terminal(&p, 6), State::Failed);
    assert!(p.room_failure(6).unwrap().message.contains("decode engine"));
}

#[test]
fn a_destination_for_a_room_never_created_is_answered_with_an_abort() {
    let mem = source(BUFS, PAGES, ITEM);
    let p = engine(
        "prefill",
        &mem,
        &[ONE_CONN, ("bootstrap_timeout_ms", "200")],
    );
    let mut s = fake::decode_ctrl(p.address(), 4, BUFS, PAGES, ITEM);
    send_msg(&mut s, &destination(404, 9, vec![1]));
    match fake::recv_past_heartbeats(&mut s) {
        Message::Abort {
            room,
            generation,
            reason,
        } => {
            assert_eq!((room, generation), (404, 9));
            assert!(reason.contains("created no room 404"), "{reason}");
        }
        m => panic!("unexpected {m:?}"),
    }
    // No room was created by the peer's message.
    assert!(p.room_poll(404).is_err());
    assert_eq!(p.metrics().held_expired, 1);
}

/// Waits for `room` to end and checks it FAILED with `cause` and a message saying `text`.
fn assert_failed(d: &Engine, room: u64, cause: Cause, text: &str) {
    assert_eq!(wait_terminal(d, room), State::Failed);
    let why = d.room_failure(room).unwrap();
    assert_eq!(why.cause, cause);
    assert!(why.message.contains(text), "{why}");
}

#[test]
fn a_data_frame_outside_the_grant_is_refused_and_nothing_is_written() {
    let (mem, d, mut f, generation) = served(11, &[], 1);
    // Page 5 was never granted to room 11.
    f.data[0]
        .write_all(&frame(11, generation, 0, 5, 1, 0x41))
        .unwrap();
    assert_eq!(wait_terminal(&d, 11), State::Failed);
    let why = d.room_failure(11).unwrap();
    assert_eq!(why.cause, Cause::Protocol);
    assert!(why.message.contains("page 5 was not granted"), "{why}");
    assert!(mem.iter().all(|b| b.holds_only(POISON)), "a byte landed");
    read_until_closed(&mut f.data[0]);
}

#[test]
fn frames_for_an_unknown_buffer_or_with_a_wrong_length_are_refused() {
    let (mem, d, mut f, generation) = served(12, &[], 1);
    f.data[0]
        .write_all(&frame(12, generation, 7, 2, 1, 0x41))
        .unwrap();
    assert_eq!(wait_terminal(&d, 12), State::Failed);
    assert!(d
        .room_failure(12)
        .unwrap()
        .message
        .contains("kv buffer 7 is not registered"));

    let (mut g, dest) = FakePrefill::serving(&d, 13, &DEST, BUFS, PAGES, ITEM, 1);
    let generation = dest.generation;
    let mut bytes = frame(13, generation, 0, 2, 2, 0x41);
    // Claim 2 pages but carry the bytes of 1 (fix up both length fields).
    let h = DataHeader {
        byte_len: ITEM as u32,
        ..kv_header(13, generation, 0, 2, 2, ITEM)
    };
    let prefix = fake::frame_prefix(&h);
    bytes.truncate(prefix.len() + ITEM);
    bytes[..prefix.len()].copy_from_slice(&prefix);
    g.data[0].write_all(&bytes).unwrap();
    assert_eq!(wait_terminal(&d, 13), State::Failed);
    assert_eq!(d.room_failure(13).unwrap().cause, Cause::Protocol);
    assert!(mem.iter().all(|b| b.holds_only(POISON)), "a byte landed");
}

#[test]
fn data_for_a_stale_generation_is_discarded_not_written() {
    let (mem, d, mut f, generation) = served(14, &[], 1);
    f.data[0]
        .write_all(&frame(14, generation + 1000, 0, 2, 1, 0x41))
        .unwrap();
    // Then a good frame and Done: the room completes with exactly the good bytes.
    for b in 0..2 {
        f.data[0]
            .write_all(&frame(14, generation, b, 2, 2, 0x42))
            .unwrap();
    }
    f.done(14, generation, 2);
    assert_eq!(wait_terminal(&d, 14), State::Success);
    assert!(all_filled(&mem[..1], &[2, 3], 0x42));
    assert!(all_filled(&mem[..1], &[0, 1], POISON));
    assert_eq!(d.metrics().dropped_frames, 1);
}

/// A `DataRuns` frame (a batch of small pages in one frame): each run lands at its own
/// pages, in any order of pages and buffers, and nothing else is touched.
#[test]
fn a_data_runs_frame_lands_each_run_at_its_pages() {
    let (mem, d, mut f, generation) = served(16, &[], 1);
    let h = |buffer, first, n| kv_header(16, generation, buffer, first, n, ITEM);
    f.data[0]
        .write_all(&runs_frame(&[
            (h(0, 3, 1), 0x51),
            (h(1, 2, 2), 0x53),
            (h(0, 2, 1), 0x52),
        ]))
        .unwrap();
    f.done(16, generation, 2);
    assert_eq!(wait_terminal(&d, 16), State::Success);
    d.room_clear(16).unwrap();
    drop(d);
    assert!(all_filled(&mem[..1], &[2], 0x52));
    assert!(all_filled(&mem[..1], &[3], 0x51));
    assert!(all_filled(&mem[1..], &[2, 3], 0x53));
    let others: Vec<u32> = (0..PAGES as u32).filter(|p| !DEST.contains(p)).collect();
    assert!(all_filled(&mem, &others, POISON));
}

/// Every run of a `DataRuns` frame is checked before any of its bytes is read: one run
/// outside the grant fails the room and not even the granted runs before it land.
#[test]
fn a_data_runs_frame_with_one_run_outside_the_grant_writes_nothing() {
    let (mem, d, mut f, generation) = served(17, &[], 1);
    let h = |first| kv_header(17, generation, 0, first, 1, ITEM);
    f.data[0]
        .write_all(&runs_frame(&[(h(2), 0x41), (h(3), 0x41), (h(5), 0x41)]))
        .unwrap();
    assert_failed(&d, 17, Cause::Protocol, "page 5 was not granted");
    assert!(mem.iter().all(|b| b.holds_only(POISON)), "a byte landed");
    read_until_closed(&mut f.data[0]);
}

/// Runs of two rooms, or two runs over one page, in one `DataRuns` frame are a
/// malformed frame: the connection closes, its peer is lost and the room fails saying
/// why, and nothing lands.
#[test]
fn data_runs_of_two_rooms_or_over_one_page_are_refused() {
    for (room, second_room, second_page) in [(18, 99, 3), (19, 19, 2)] {
        let (mem, d, mut f, generation) = served(room, &[], 1);
        let first = kv_header(room, generation, 0, 2, 2, ITEM);
        let second = kv_header(second_room, generation, 0, second_page, 1, ITEM);
        f.data[0]
            .write_all(&runs_frame(&[(first, 0x41), (second, 0x41)]))
            .unwrap();
        assert_failed(&d, room, Cause::PeerLost, "DataRuns frame");
        assert!(mem.iter().all(|b| b.holds_only(POISON)), "a byte landed");
        read_until_closed(&mut f.data[0]);
    }
}

/// A prefill spreads a room's frames over its data connections, so its Done (sent on
/// one of them) may overtake a frame still on another: the room completes once it lands.
#[test]
fn done_on_one_connection_ahead_of_a_frame_on_another_completes_when_it_lands() {
    let (mem, d, mut f, generation) = served(15, &[("connections_per_peer", "2")], 2);
    let late = frame(15, generation, 1, 2, 2, 0x43);
    // Half of buffer 1's frame on the second connection, then everything else on the
    // first, Done last.
    f.data[1].write_all(&late[..late.len() / 2]).unwrap();
    f.data[0]
        .write_all(&frame(15, generation, 0, 2, 2, 0x42))
        .unwrap();
    f.done(15, generation, 2);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(d.room_poll(15).unwrap(), State::Transferring);
    f.data[1].write_all(&late[late.len() / 2..]).unwrap();
    assert_eq!(wait_terminal(&d, 15), State::Success);
    d.room_clear(15).unwrap();
    drop(d);
    assert!(all_filled(&mem[..1], &[2, 3], 0x42));
    assert!(all_filled(&mem[1..], &[2, 3], 0x43));
}

#[test]
fn a_done_whose_frames_never_arrive_fails_at_the_transfer_deadline_saying_so() {
    let (_mem, d, mut f, generation) = served(15, &[("transfer_timeout_ms", "300")], 1);
    f.data[0]
        .write_all(&frame(15, generation, 0, 2, 2, 0x42))
        .unwrap();
    f.done(15, generation, 2);
    assert_failed(
        &d,
        15,
        Cause::TransferTimeout,
        "reported done but only 512 KV bytes",
    );
}

#[test]
fn a_done_claiming_fewer_pages_than_the_destination_fails_at_once() {
    let (_mem, d, mut f, generation) = served(15, &[], 1);
    f.done(15, generation, 1);
    assert_failed(
        &d,
        15,
        Cause::Mismatch,
        "sent 1 pages for a destination of 2",
    );
}

#[test]
fn a_late_abort_for_an_earlier_use_of_an_id_does_not_touch_the_next_use() {
    let (_mem, p) = prefill();
    let mut s = fake::decode_ctrl(p.address(), 5, BUFS, PAGES, ITEM);
    // Data connection, so the prefill can send the first use's pages.
    let mut data = fake::decode_data(p.address(), 5, 0);
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while matches!(data.read(&mut buf), Ok(n) if n > 0) {}
    });

    // First use: generation 5, completed and cleared on the prefill side.
    p.room_create(7, RoomPeers::Decoders(1)).unwrap();
    send_msg(&mut s, &destination(7, 5, vec![0]));
    p.enqueue_chunk(7, &[1], true, None).unwrap();
    assert_eq!(wait_terminal(&p, 7), State::Success);
    p.room_clear(7).unwrap();

    // Second use of id 7 on the prefill side; then the decode side's late abort of
    // generation 5 arrives. It must not touch the new room.
    p.room_create(7, RoomPeers::Decoders(1)).unwrap();
    send_msg(
        &mut s,
        &Message::Abort {
            room: 7,
            generation: 5,
            reason: "old".into(),
        },
    );
    // A heartbeat round trip later the abort has certainly been processed.
    send_msg(&mut s, &destination(7, 6, vec![2]));
    wait_state(&p, 7, State::WaitingForInput);
    assert_eq!(p.metrics().unknown_room_frames, 1);
    // A stale destination of generation 5 is answered, not attached.
    p.enqueue_chunk(7, &[3], true, None).unwrap();
    assert_eq!(wait_terminal(&p, 7), State::Success);
    drop(s);
    drop(p);
    let _ = drain.join();
}

#[test]
fn early_destinations_cannot_make_the_holding_area_grow_past_its_page_bound() {
    let (_mem, p) = prefill();
    let mut s = fake::decode_ctrl(p.address(), 6, BUFS, PAGES, ITEM);
    let pages: Vec<u32> = (0..1_000_000).collect();
    // 17 early destinations of a million pages each pass the 16 Mi-page bound.
    for room in 0..17u64 {
        let m = destination(500 + room, 1, pages.clone());
        send_msg(&mut s, &m);
    }
    match fake::recv_past_heartbeats(&mut s) {
        Message::Abort { room, reason, .. } => {
            assert_eq!(room, 516);
            assert!(reason.contains("holding area is full"), "{reason}");
        }
        m => panic!("unexpected {m:?}"),
    }
    assert_eq!(p.metrics().held_overflow, 1);
    assert_eq!(p.metrics().held, 16);
}
