//! Hostile and broken peers on raw sockets: malformed, truncated and out-of-grant frames
//! close the connection and fail that peer's rooms with a reason; the process lives on
//! and no byte lands outside the grant.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvxfer::proto::{
    self, BufferInfo, ConnKind, DataHeader, Layout, Limits, Message, Registration, Role, Target,
    WireTransport, PROTO_VERSION,
};
use kvxfer::{Cause, Engine, RoomPeers, State};

use common::wait_state;

const ITEM: usize = 256;

fn engine(role: &str, mem: &mut [Vec<u8>], extra: &[(&str, &str)]) -> Engine {
    let mut with = vec![("connections_per_peer", "1")];
    with.extend_from_slice(extra);
    common::engine_paged(role, mem, ITEM, &with)
}

fn wait_terminal(e: &Engine, room: u64) -> State {
    common::wait_terminal(e, room, Duration::from_secs(20))
}

const PAGES: usize = 16;
const POISON: u8 = 0xEE;

fn registration(n: usize) -> Registration {
    Registration {
        kv: (0..n)
            .map(|_| BufferInfo {
                len: (PAGES * ITEM) as u64,
                item_len: ITEM as u64,
                layer_id: BufferInfo::NO_LAYER,
                addr: 0,
                rkey: 0,
            })
            .collect(),
        aux: vec![],
        layout: Layout::default(),
    }
}

fn send(s: &mut TcpStream, m: &Message) {
    let mut f = Vec::new();
    m.encode(&mut f).unwrap();
    s.write_all(&f).unwrap();
}

fn recv(s: &mut TcpStream) -> Message {
    let l = Limits::default();
    let h = proto::read_frame_header(s, &l).unwrap();
    proto::read_control(s, &h, &l).unwrap()
}

fn hello(role: Role, conn: ConnKind, id: u64) -> Message {
    Message::Hello {
        proto_version: PROTO_VERSION,
        role,
        engine_id: id,
        conn,
        conn_index: 0,
    }
}

/// A fake decode engine: control connection with handshake done.
fn fake_decode(addr: &str, id: u64) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    send(&mut s, &hello(Role::Decode, ConnKind::Control, id));
    assert!(matches!(
        recv(&mut s),
        Message::Hello {
            role: Role::Prefill,
            ..
        }
    ));
    assert!(matches!(recv(&mut s), Message::Registration(_)));
    send(&mut s, &Message::Registration(registration(2)));
    send(&mut s, &TCP_TRANSPORT);
    assert!(matches!(
        recv(&mut s),
        Message::Transport {
            transport: WireTransport::Tcp,
            ..
        }
    ));
    s
}

const TCP_TRANSPORT: Message = Message::Transport {
    transport: WireTransport::Tcp,
    qps: Vec::new(),
};

/// The engine closes the connection: reads end in EOF or a reset within the timeout.
fn assert_closed(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => continue, // heartbeats or aborts still queued
        }
    }
}

fn prefill() -> (Vec<Vec<u8>>, Engine) {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![7u8; PAGES * ITEM]).collect();
    let e = engine("prefill", &mut mem, &[]);
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
        assert_closed(&mut s);
    }
    // Still serving: a well-behaved peer handshakes fine.
    let _ok = fake_decode(p.address(), 1);
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    assert_eq!(p.room_poll(1).unwrap(), State::Bootstrapping);
}

#[test]
fn a_malformed_frame_from_a_peer_fails_its_rooms_with_a_reason() {
    let (_mem, p) = prefill();
    let mut s = fake_decode(p.address(), 2);
    p.room_create(5, RoomPeers::Decoders(1)).unwrap();
    send(
        &mut s,
        &Message::Destination {
            room: 5,
            generation: 77,
            pages: vec![0, 1],
            aux_slot: None,
        },
    );
    let t = Instant::now();
    while p.room_poll(5).unwrap() != State::WaitingForInput {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    // A frame header with a bad magic.
    s.write_all(&[0xAB; 16]).unwrap();
    assert_closed(&mut s);
    assert_eq!(wait_terminal(&p, 5), State::Failed);
    let why = p.room_failure(5).unwrap();
    assert_eq!(why.cause, Cause::PeerLost);
    assert!(why.message.contains("malformed frame"), "{why}");
    assert!(p.metrics().protocol_errors >= 1);
}

#[test]
fn a_truncated_frame_then_close_fails_the_room() {
    let (_mem, p) = prefill();
    let mut s = fake_decode(p.address(), 3);
    p.room_create(6, RoomPeers::Decoders(1)).unwrap();
    send(
        &mut s,
        &Message::Destination {
            room: 6,
            generation: 1,
            pages: vec![3],
            aux_slot: None,
        },
    );
    let mut f = Vec::new();
    Message::Destination {
        room: 9,
        generation: 1,
        pages: vec![1, 2, 3],
        aux_slot: None,
    }
    .encode(&mut f)
    .unwrap();
    s.write_all(&f[..f.len() - 5]).unwrap();
    drop(s);
    assert_eq!(wait_terminal(&p, 6), State::Failed);
    assert!(p.room_failure(6).unwrap().message.contains("decode engine"));
}

#[test]
fn a_destination_for_a_room_never_created_is_answered_with_an_abort() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![7u8; PAGES * ITEM]).collect();
    let p = engine("prefill", &mut mem, &[("bootstrap_timeout_ms", "200")]);
    let mut s = fake_decode(p.address(), 4);
    send(
        &mut s,
        &Message::Destination {
            room: 404,
            generation: 9,
            pages: vec![1],
            aux_slot: None,
        },
    );
    let t = Instant::now();
    loop {
        match recv(&mut s) {
            Message::Abort {
                room,
                generation,
                reason,
            } => {
                assert_eq!((room, generation), (404, 9));
                assert!(reason.contains("created no room 404"), "{reason}");
                break;
            }
            Message::Heartbeat { .. } => {}
            m => panic!("unexpected {m:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10));
    }
    // No room was created by the peer's message.
    assert!(p.room_poll(404).is_err());
    assert_eq!(p.metrics().held_expired, 1);
}

/// A fake prefill engine for one decode room: handshakes on the control connection and
/// one data connection, reads the destination, then lets the test write raw frames.
struct FakePrefill {
    ctrl: TcpStream,
    data: TcpStream,
    /// Data connections beyond the first (an engine with `connections_per_peer` > 1).
    more_data: Vec<TcpStream>,
    dest: Vec<u32>,
    generation: u64,
}

fn fake_prefill(d: &Engine, room: u64) -> FakePrefill {
    fake_prefill_with(d, room, 1)
}

/// A fake prefill engine serving decode room `room` of `d` (whose
/// `connections_per_peer` is `conns`), once the room's destination reached it.
fn fake_prefill_with(d: &Engine, room: u64, conns: usize) -> FakePrefill {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    d.room_create(room, RoomPeers::Prefills(vec![addr]))
        .unwrap();
    let (mut ctrl, _) = l.accept().unwrap();
    ctrl.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(matches!(
        recv(&mut ctrl),
        Message::Hello {
            role: Role::Decode,
            ..
        }
    ));
    send(&mut ctrl, &hello(Role::Prefill, ConnKind::Control, 99));
    assert!(matches!(recv(&mut ctrl), Message::Registration(_)));
    send(&mut ctrl, &Message::Registration(registration(2)));
    assert!(matches!(
        recv(&mut ctrl),
        Message::Transport {
            transport: WireTransport::Tcp,
            ..
        }
    ));
    send(&mut ctrl, &TCP_TRANSPORT);
    let mut datas: Vec<TcpStream> = (0..conns)
        .map(|_| {
            let (mut data, _) = l.accept().unwrap();
            assert!(matches!(
                recv(&mut data),
                Message::Hello {
                    conn: ConnKind::Data,
                    ..
                }
            ));
            send(&mut data, &hello(Role::Prefill, ConnKind::Data, 99));
            data
        })
        .collect();
    let data = datas.remove(0);
    d.room_set_destination(room, &[2, 3], None).unwrap();
    loop {
        match recv(&mut ctrl) {
            Message::Destination {
                room: r,
                generation,
                pages,
                ..
            } => {
                assert_eq!(r, room);
                return FakePrefill {
                    ctrl,
                    data,
                    more_data: datas,
                    dest: pages,
                    generation,
                };
            }
            Message::Heartbeat { .. } => {}
            m => panic!("unexpected {m:?}"),
        }
    }
}

impl FakePrefill {
    /// Sends Done for `room` on the data connection, claiming `pages_sent` pages.
    fn done(&mut self, room: u64, pages_sent: u32) {
        send(
            &mut self.data,
            &Message::Done {
                room,
                generation: self.generation,
                pages_sent,
                aux_sent: false,
            },
        );
    }
}

/// Waits for `room` to end and checks it FAILED with `cause` and a message saying `text`.
fn assert_failed(d: &Engine, room: u64, cause: Cause, text: &str) {
    assert_eq!(wait_terminal(d, room), State::Failed);
    let why = d.room_failure(room).unwrap();
    assert_eq!(why.cause, cause);
    assert!(why.message.contains(text), "{why}");
}

fn data_frame(
    room: u64,
    generation: u64,
    buffer: u32,
    first_page: u32,
    n: u32,
    byte: u8,
) -> Vec<u8> {
    let h = DataHeader {
        room,
        generation,
        target: Target::Kv,
        buffer,
        first_page,
        n_pages: n,
        byte_len: n * ITEM as u32,
    };
    let mut prefix = [0u8; proto::DATA_FRAME_PREFIX_LEN];
    h.encode_frame(&mut prefix).unwrap();
    let mut f = prefix.to_vec();
    f.extend(std::iter::repeat_n(byte, n as usize * ITEM));
    f
}

#[test]
fn a_data_frame_outside_the_grant_is_refused_and_nothing_is_written() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![POISON; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[]);
    let mut f = fake_prefill(&d, 11);
    assert_eq!(f.dest, vec![2, 3]);
    // Page 5 was never granted to room 11.
    f.data
        .write_all(&data_frame(11, f.generation, 0, 5, 1, 0x41))
        .unwrap();
    assert_eq!(wait_terminal(&d, 11), State::Failed);
    let why = d.room_failure(11).unwrap();
    assert_eq!(why.cause, Cause::Protocol);
    assert!(why.message.contains("page 5 was not granted"), "{why}");
    assert!(
        mem.iter().all(|b| b.iter().all(|&x| x == POISON)),
        "a byte landed"
    );
    assert_closed(&mut f.data);
    let _ = &mut f.ctrl;
}

#[test]
fn frames_for_an_unknown_buffer_or_with_a_wrong_length_are_refused() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![POISON; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[]);
    let mut f = fake_prefill(&d, 12);
    f.data
        .write_all(&data_frame(12, f.generation, 7, 2, 1, 0x41))
        .unwrap();
    assert_eq!(wait_terminal(&d, 12), State::Failed);
    assert!(d
        .room_failure(12)
        .unwrap()
        .message
        .contains("kv buffer 7 is not registered"));

    let mut g = fake_prefill(&d, 13);
    let mut frame = data_frame(13, g.generation, 0, 2, 2, 0x41);
    // Claim 2 pages but carry the bytes of 1 (fix up both length fields).
    let h = DataHeader {
        room: 13,
        generation: g.generation,
        target: Target::Kv,
        buffer: 0,
        first_page: 2,
        n_pages: 2,
        byte_len: ITEM as u32,
    };
    let mut prefix = [0u8; proto::DATA_FRAME_PREFIX_LEN];
    h.encode_frame(&mut prefix).unwrap();
    frame.truncate(prefix.len() + ITEM);
    frame[..prefix.len()].copy_from_slice(&prefix);
    g.data.write_all(&frame).unwrap();
    assert_eq!(wait_terminal(&d, 13), State::Failed);
    assert_eq!(d.room_failure(13).unwrap().cause, Cause::Protocol);
    assert!(
        mem.iter().all(|b| b.iter().all(|&x| x == POISON)),
        "a byte landed"
    );
}

#[test]
fn data_for_a_stale_generation_is_discarded_not_written() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![POISON; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[]);
    let mut f = fake_prefill(&d, 14);
    f.data
        .write_all(&data_frame(14, f.generation + 1000, 0, 2, 1, 0x41))
        .unwrap();
    // Then a good frame and Done: the room completes with exactly the good bytes.
    for b in 0..2 {
        f.data
            .write_all(&data_frame(14, f.generation, b, 2, 2, 0x42))
            .unwrap();
    }
    send(
        &mut f.data,
        &Message::Done {
            room: 14,
            generation: f.generation,
            pages_sent: 2,
            aux_sent: false,
        },
    );
    assert_eq!(wait_terminal(&d, 14), State::Success);
    assert!(mem[0][2 * ITEM..4 * ITEM].iter().all(|&x| x == 0x42));
    assert!(mem[0][..2 * ITEM].iter().all(|&x| x == POISON));
    assert_eq!(d.metrics().dropped_frames, 1);
}

/// A prefill spreads a room's frames over its data connections, so its Done (sent on
/// one of them) may overtake a frame still on another: the room completes once it lands.
#[test]
fn done_on_one_connection_ahead_of_a_frame_on_another_completes_when_it_lands() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![POISON; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[("connections_per_peer", "2")]);
    let mut f = fake_prefill_with(&d, 15, 2);
    let frame = data_frame(15, f.generation, 1, 2, 2, 0x43);
    // Half of buffer 1's frame on the second connection, then everything else on the
    // first, Done last.
    f.more_data[0].write_all(&frame[..frame.len() / 2]).unwrap();
    f.data
        .write_all(&data_frame(15, f.generation, 0, 2, 2, 0x42))
        .unwrap();
    f.done(15, 2);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(d.room_poll(15).unwrap(), State::Transferring);
    f.more_data[0].write_all(&frame[frame.len() / 2..]).unwrap();
    assert_eq!(wait_terminal(&d, 15), State::Success);
    d.room_clear(15).unwrap();
    drop(d);
    assert!(mem[0][2 * ITEM..4 * ITEM].iter().all(|&x| x == 0x42));
    assert!(mem[1][2 * ITEM..4 * ITEM].iter().all(|&x| x == 0x43));
}

#[test]
fn a_done_whose_frames_never_arrive_fails_at_the_transfer_deadline_saying_so() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![POISON; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[("transfer_timeout_ms", "300")]);
    let mut f = fake_prefill(&d, 15);
    f.data
        .write_all(&data_frame(15, f.generation, 0, 2, 2, 0x42))
        .unwrap();
    f.done(15, 2);
    assert_failed(
        &d,
        15,
        Cause::TransferTimeout,
        "reported done but only 2 page writes",
    );
}

#[test]
fn a_done_claiming_fewer_pages_than_the_destination_fails_at_once() {
    let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![POISON; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[]);
    let mut f = fake_prefill(&d, 15);
    f.done(15, 1);
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
    let mut s = fake_decode(p.address(), 5);
    // Data connection, so the prefill can send the first use's pages.
    let mut data = TcpStream::connect(p.address()).unwrap();
    data.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    send(&mut data, &hello(Role::Decode, ConnKind::Data, 5));
    assert!(matches!(recv(&mut data), Message::Hello { .. }));
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while matches!(data.read(&mut buf), Ok(n) if n > 0) {}
    });

    // First use: generation 5, completed and cleared on the prefill side.
    p.room_create(7, RoomPeers::Decoders(1)).unwrap();
    send(
        &mut s,
        &Message::Destination {
            room: 7,
            generation: 5,
            pages: vec![0],
            aux_slot: None,
        },
    );
    p.enqueue_chunk(7, &[1], true, None).unwrap();
    assert_eq!(wait_terminal(&p, 7), State::Success);
    p.room_clear(7).unwrap();

    // Second use of id 7 on the prefill side; then the decode side's late abort of
    // generation 5 arrives. It must not touch the new room.
    p.room_create(7, RoomPeers::Decoders(1)).unwrap();
    send(
        &mut s,
        &Message::Abort {
            room: 7,
            generation: 5,
            reason: "old".into(),
        },
    );
    // A heartbeat round trip later the abort has certainly been processed.
    send(
        &mut s,
        &Message::Destination {
            room: 7,
            generation: 6,
            pages: vec![2],
            aux_slot: None,
        },
    );
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
    let mut s = fake_decode(p.address(), 6);
    let pages: Vec<u32> = (0..1_000_000).collect();
    // 17 early destinations of a million pages each pass the 16 Mi-page bound.
    for room in 0..17u64 {
        let m = Message::Destination {
            room: 500 + room,
            generation: 1,
            pages: pages.clone(),
            aux_slot: None,
        };
        send(&mut s, &m);
    }
    loop {
        match recv(&mut s) {
            Message::Abort { room, reason, .. } => {
                assert_eq!(room, 516);
                assert!(reason.contains("holding area is full"), "{reason}");
                break;
            }
            Message::Heartbeat { .. } => {}
            m => panic!("unexpected {m:?}"),
        }
    }
    assert_eq!(p.metrics().held_overflow, 1);
    assert_eq!(p.metrics().held, 16);
}
