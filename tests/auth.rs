//! Authentication of every connection with a cluster key (DESIGN.md invariant 9):
//! engines with the same key transfer; different keys, or one side without, fail the
//! rooms of both sides with a reason naming authentication and write nothing; a
//! stranger on a raw socket (frames without the handshake, a replayed handshake, a
//! truncated, oversized or silent one, a flood of them, a data connection it has no
//! session for) changes no room, receives nothing and is counted.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fake::{self, encode, frames, read_until_closed};
use common::{engine, source, unless_failed, wait_terminal, wait_until, KeyFile, Pair, POISON};
use kvxfer::log::Level;
use kvxfer::proto::{
    self, AuthMode, AuthRefusal, ConnKind, DataHeader, FrameHeader, Kind, Limits, Message, Role,
    Target, AUTH_KEY_ID_LEN, DATA_FRAME_PREFIX_LEN,
};
use kvxfer::{Cause, Config, Engine, RoomPeers, State};

const BUFS: usize = 2;
const PAGES: usize = 32;
const ITEM: usize = 512;
const KEY_A: &str = "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0";
const KEY_B: &str = "0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20";
/// Every engine of this file opens two data connections per peer.
const CONNS: (&str, &str) = ("connections_per_peer", "2");

/// A prefill engine with `p_extra` and a decode engine with `d_extra`, both logging
/// everything into `plog` and `dlog`.
fn pair(p_extra: &[(&str, &str)], d_extra: &[(&str, &str)]) -> Pair {
    Pair::builder()
        .config(&[CONNS])
        .prefill(p_extra)
        .decode(d_extra)
        .bufs(BUFS)
        .pages(PAGES)
        .item(ITEM)
        .log(Level::Debug)
        .build()
}

/// Whether no byte of the decode engine's buffers was written.
fn untouched(t: &Pair) -> bool {
    t.dmem.iter().all(|m| m.holds_only(POISON))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn engines_with_the_same_key_transfer_and_count_no_refusal() {
    // One side reads the key from a file, the other has it in hex: the same bytes.
    let file = KeyFile::new("same", &unhex(KEY_A));
    let t = pair(&[("auth_key_file", &file.path)], &[("auth_key", KEY_A)]);
    for room in 1..=3u64 {
        let from: Vec<u32> = (room as u32 * 3..room as u32 * 3 + 3).collect();
        let to: Vec<u32> = (room as u32 * 4..room as u32 * 4 + 3).collect();
        assert_eq!(
            t.transfer(room, &from, &to),
            (State::Success, State::Success)
        );
        assert!(t.delivered(&from, &to), "room {room}");
    }
    assert_eq!(t.p.metrics().auth_failures, 0);
    assert_eq!(t.d.metrics().auth_failures, 0);
    assert!(t
        .p
        .metrics()
        .prometheus("prefill")
        .contains("kvxfer_auth_failures_total{role=\"prefill\"} 0"));
}

/// Decode room 1 against a prefill room 1 with a chunk waiting: both must fail, the
/// decode side at once with MISMATCH, the prefill side at its bootstrap deadline; both
/// reasons name authentication and `parts`; no page is written.
fn assert_refused_both_sides(t: &Pair, parts: &[&str]) {
    t.p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    unless_failed(t.p.enqueue_chunk(1, &[1, 2], true, None));
    t.d.room_create(1, RoomPeers::Prefills(vec![t.p.address().into()]))
        .unwrap();
    unless_failed(t.d.room_set_destination(1, &[3, 4], None));
    assert_eq!(wait_terminal(&t.d, 1), State::Failed);
    let why = t.d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(why.message.contains("authentication"), "{why}");
    for part in parts {
        assert!(why.message.contains(part), "decode: {why}");
    }
    assert_eq!(wait_terminal(&t.p, 1), State::Failed);
    let why = t.p.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::BootstrapTimeout, "{why}");
    assert!(why.message.contains("authentication"), "{why}");
    for part in parts {
        assert!(why.message.contains(part), "prefill: {why}");
    }
    assert!(untouched(t));
    assert!(t.p.metrics().auth_failures >= 1);
    assert!(t.d.metrics().auth_failures >= 1);
}

#[test]
fn different_keys_fail_the_rooms_of_both_sides_naming_authentication() {
    let t = pair(
        &[("auth_key", KEY_A), ("bootstrap_timeout_ms", "1500")],
        &[("auth_key", KEY_B)],
    );
    assert_refused_both_sides(&t, &["wrong key"]);
}

#[test]
fn one_engine_without_a_key_is_a_mismatch_naming_both_settings() {
    for (pk, dk) in [(Some(KEY_A), None), (None, Some(KEY_A))] {
        let with = |k: Option<&'static str>| k.map(|k| vec![("auth_key", k)]).unwrap_or_default();
        let mut pcfg = with(pk);
        pcfg.push(("bootstrap_timeout_ms", "1500"));
        let t = pair(&pcfg, &with(dk));
        assert_refused_both_sides(&t, &["auth=off", "auth=required"]);
        // The engine that holds the key names the other side as having none.
        let keyed = if pk.is_some() { &t.plog } else { &t.dlog };
        keyed.wait_for(&["authentication mismatch (no key)"]);
    }
}

/// A decode engine's Hello on connection `conn`, as engine `engine_id`.
fn hello(conn: ConnKind, engine_id: u64) -> Vec<u8> {
    encode(&fake::hello(Role::Decode, conn, engine_id, 0))
}

/// Waits until `e` counted `n` refusals in all.
fn wait_refusals(e: &Engine, n: u64) {
    wait_until(&format!("{n} refusals to be counted"), || {
        e.metrics().auth_failures >= n
    });
    assert_eq!(e.metrics().auth_failures, n);
}

#[test]
fn frames_without_the_handshake_change_no_room_and_each_refusal_is_counted_and_logged_once() {
    let t = pair(&[("auth_key", KEY_A)], &[("auth_key", KEY_A)]);
    t.ready(1, &[5, 6]);
    let generation = 1; // what a stranger would guess
    let destination = encode(&fake::destination(1, generation, vec![0, 1]));
    let abort = encode(&Message::abort(
        1,
        generation,
        "stranger",
        &Limits::default(),
    ));
    let mut data = [0u8; DATA_FRAME_PREFIX_LEN];
    DataHeader {
        room: 1,
        generation,
        target: Target::Kv,
        buffer: 0,
        first_page: 5,
        n_pages: 1,
        byte_len: ITEM as u32,
        page_off: 0,
        digest: 0,
    }
    .encode_frame(&mut data)
    .unwrap();
    let mut data = data.to_vec();
    data.extend(std::iter::repeat_n(0x66u8, ITEM));
    let attempts: Vec<Vec<u8>> = vec![
        destination.clone(),
        abort.clone(),
        data.clone(),
        [hello(ConnKind::Control, 9), destination].concat(),
        [hello(ConnKind::Control, 9), abort.clone()].concat(),
        [hello(ConnKind::Data, 9), data].concat(),
        // The handshake of an engine without a key, then an abort.
        [
            hello(ConnKind::Control, 9),
            encode(&fake::auth_off_hello()),
            abort,
        ]
        .concat(),
    ];
    for (i, bytes) in attempts.iter().enumerate() {
        let mut s = TcpStream::connect(t.p.address()).unwrap();
        let _ = s.write_all(bytes);
        let got = read_until_closed(&mut s);
        // At most a refusal comes back, never the prefill's Hello or Registration.
        assert!(
            frames(&got).iter().all(|m| m.kind() == Kind::AuthRefused),
            "attempt {i}: {:?}",
            frames(&got)
        );
        wait_refusals(&t.p, i as u64 + 1);
    }
    assert_eq!(t.p.room_poll(1).unwrap(), State::WaitingForInput);
    assert_eq!(t.d.room_poll(1).unwrap(), State::WaitingForInput);
    assert!(untouched(&t));
    // Logged at warn level once for the address, at debug level after that.
    let warned = t
        .plog
        .lines(Level::Warn, "refused connection from 127.0.0.1");
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("authentication"), "{warned:?}");
    assert!(t.plog.lines(Level::Debug, "refused").len() >= attempts.len() - 1);
    // The room completes as if nothing happened.
    t.p.enqueue_chunk(1, &[7, 8], true, None).unwrap();
    assert_eq!(wait_terminal(&t.p, 1), State::Success);
    assert_eq!(wait_terminal(&t.d, 1), State::Success);
    assert!(t.delivered(&[7, 8], &[5, 6]));
    assert_eq!(t.p.metrics().auth_failures, attempts.len() as u64);
}

/// What one relayed connection carried from the decode engine.
type Recording = Arc<Mutex<Vec<u8>>>;

/// A relay between decode engines and `to` that records, per connection, what the
/// decode engine sent.
struct Tap {
    addr: String,
    streams: Arc<Mutex<Vec<Recording>>>,
}

fn tap(to: String) -> Tap {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let streams: Arc<Mutex<Vec<Recording>>> = Default::default();
    let rec = streams.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let Ok(up) = TcpStream::connect(&to) else {
                return;
            };
            let log = Arc::new(Mutex::new(Vec::new()));
            rec.lock().unwrap().push(log.clone());
            let (mut c_r, mut c_w) = (c.try_clone().unwrap(), c);
            let (mut up_r, mut up_w) = (up.try_clone().unwrap(), up);
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n @ 1..) = c_r.read(&mut buf) {
                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                    if up_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = up_w.shutdown(Shutdown::Both);
            });
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n @ 1..) = up_r.read(&mut buf) {
                    if c_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c_w.shutdown(Shutdown::Both);
            });
        }
    });
    Tap { addr, streams }
}

#[test]
fn a_replayed_handshake_is_refused_as_a_replay_and_changes_no_room() {
    let t = pair(&[("auth_key", KEY_A)], &[("auth_key", KEY_A)]);
    let tapped = tap(t.p.address().to_string());
    t.p.room_create(7, RoomPeers::Decoders(1)).unwrap();
    t.d.room_create(7, RoomPeers::Prefills(vec![tapped.addr.clone()]))
        .unwrap();
    t.d.room_set_destination(7, &[1, 2], None).unwrap();
    t.p.enqueue_chunk(7, &[3, 4], true, None).unwrap();
    assert_eq!(wait_terminal(&t.p, 7), State::Success);
    assert_eq!(wait_terminal(&t.d, 7), State::Success);
    // The recorded streams: one control connection (handshake, registration, transport,
    // the room's destination) and the data connections (handshakes).
    let recorded: Vec<Vec<u8>> = tapped
        .streams
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.lock().unwrap().clone())
        .collect();
    assert_eq!(recorded.len(), 3, "one control and two data connections");
    // A new use of room 7 that the replayed Destination would claim if it were accepted.
    t.p.room_clear(7).unwrap();
    t.p.room_create(7, RoomPeers::Decoders(1)).unwrap();
    for (i, bytes) in recorded.iter().enumerate() {
        let mut s = TcpStream::connect(t.p.address()).unwrap();
        let _ = s.write_all(bytes);
        let got = read_until_closed(&mut s);
        assert_eq!(
            frames(&got),
            vec![Message::AuthRefused {
                reason: AuthRefusal::Replay,
                auth: AuthMode::Required
            }],
            "replay of connection {i}"
        );
        wait_refusals(&t.p, i as u64 + 1);
    }
    assert_eq!(
        t.plog.lines(Level::Debug, "(replay)").len() + t.plog.lines(Level::Warn, "(replay)").len(),
        3
    );
    // Another prefill engine of the cluster has never seen the nonce: the proof, bound
    // to the first engine's id and nonce, does not verify there.
    let p2mem = source(BUFS, PAGES, ITEM);
    let p2 = engine("prefill", &p2mem, &[CONNS, ("auth_key", KEY_A)]);
    p2.room_create(7, RoomPeers::Decoders(1)).unwrap();
    let mut s = TcpStream::connect(p2.address()).unwrap();
    let _ = s.write_all(&recorded[0]);
    let got = read_until_closed(&mut s);
    let refusal = |reason| Message::AuthRefused {
        reason,
        auth: AuthMode::Required,
    };
    assert_eq!(frames(&got)[1..], [refusal(AuthRefusal::BadProof)]);
    assert!(matches!(frames(&got)[0], Message::AuthChallenge { .. }));
    wait_refusals(&p2, 1);
    assert_eq!(p2.room_poll(7).unwrap(), State::Bootstrapping);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(t.p.room_poll(7).unwrap(), State::Bootstrapping);
    // The real decode engine's session is unharmed.
    let (from, to) = ([9, 10], [11, 12]);
    t.d.room_clear(7).unwrap();
    t.p.room_clear(7).unwrap();
    t.p.room_create(8, RoomPeers::Decoders(1)).unwrap();
    t.d.room_create(8, RoomPeers::Prefills(vec![tapped.addr.clone()]))
        .unwrap();
    t.d.room_set_destination(8, &to, None).unwrap();
    t.p.enqueue_chunk(8, &from, true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 8), State::Success);
    assert!(t.delivered(&from, &to));
}

#[test]
fn truncated_oversized_silent_and_trickling_handshakes_are_refused_and_counted() {
    // bootstrap_timeout_ms of 60 s: the handshake deadline is its 5 s cap.
    let t = pair(
        &[("auth_key", KEY_A), ("bootstrap_timeout_ms", "60000")],
        &[],
    );
    t.p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    let auth_hello = encode(&Message::AuthHello {
        auth: AuthMode::Required,
        key_id: [1; AUTH_KEY_ID_LEN],
        nonce: [2; 32],
    });
    // Truncated: a Hello and part of an AuthHello, then the end of the stream.
    let mut s = TcpStream::connect(t.p.address()).unwrap();
    s.write_all(&[hello(ConnKind::Control, 3), auth_hello[..30].to_vec()].concat())
        .unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    read_until_closed(&mut s);
    wait_refusals(&t.p, 1);
    t.plog.wait_for(&["refused", "truncated"]);
    // Oversized: an AuthHello header claiming 1 MiB, and nothing more. Refused from the
    // header, not at the deadline.
    let mut s = TcpStream::connect(t.p.address()).unwrap();
    s.write_all(
        &[
            hello(ConnKind::Control, 3),
            FrameHeader::new(Kind::AuthHello, 1 << 20).encode().to_vec(),
        ]
        .concat(),
    )
    .unwrap();
    read_until_closed(&mut s);
    wait_refusals(&t.p, 2);
    t.plog.wait_for(&["refused", "oversized AuthHello frame"]);
    // Oversized Hello too: the accepting side reads no large frame before the proof.
    let mut s = TcpStream::connect(t.p.address()).unwrap();
    s.write_all(&FrameHeader::new(Kind::Hello, 4 << 20).encode())
        .unwrap();
    read_until_closed(&mut s);
    wait_refusals(&t.p, 3);
    t.plog.wait_for(&["refused", "oversized Hello frame"]);
    // Silent, and trickling one byte every 100 ms (90 bytes would take 9 s): both are
    // closed at the one handshake deadline.
    let trickle = std::thread::spawn({
        let addr = t.p.address().to_string();
        let bytes = [hello(ConnKind::Control, 4), auth_hello.clone()].concat();
        move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut sent = 0;
            for b in &bytes {
                if s.write_all(&[*b]).is_err() {
                    break;
                }
                sent += 1;
                std::thread::sleep(Duration::from_millis(100));
                // A closed connection reads as EOF (or a reset); an open one would block.
                s.set_nonblocking(true).unwrap();
                let mut probe = [0u8; 64];
                let open = matches!(s.read(&mut probe), Ok(1..))
                    || matches!(s.read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
                s.set_nonblocking(false).unwrap();
                if !open {
                    break;
                }
            }
            (sent, bytes.len())
        }
    });
    let mut silent = TcpStream::connect(t.p.address()).unwrap();
    read_until_closed(&mut silent);
    let (sent, total) = trickle.join().unwrap();
    assert!(
        sent < total,
        "the trickle was read to its end ({sent} of {total})"
    );
    wait_refusals(&t.p, 5);
    assert!(t.plog.lines(Level::Debug, "deadline").len() >= 2);
    assert_eq!(t.p.room_poll(1).unwrap(), State::Bootstrapping);
    assert_eq!(t.p.metrics().protocol_errors, 0);
}

#[test]
fn a_flood_of_unauthenticated_connections_is_refused_as_busy_and_then_served() {
    let t = pair(
        &[("auth_key", KEY_A), ("bootstrap_timeout_ms", "60000")],
        &[("auth_key", KEY_A)],
    );
    // More silent connections from one address than it may have authenticating at once
    // (32): the ones past the bound are refused at once with Busy, the others are held.
    let flood: Vec<TcpStream> = (0..48)
        .map(|_| TcpStream::connect(t.p.address()).unwrap())
        .collect();
    wait_refusals(&t.p, 16);
    let (mut busy, mut open) = (0, 0);
    for mut s in flood {
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => {
                assert_eq!(
                    frames(&buf[..n]),
                    vec![Message::AuthRefused {
                        reason: AuthRefusal::Busy,
                        auth: AuthMode::Required
                    }]
                );
                busy += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => open += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((busy, open), (16, 32));
    t.plog.wait_for(&["refused", "(busy)"]);
    // Their slots come back when they go: a real engine then connects and transfers.
    let start = Instant::now();
    let mut room = 1;
    loop {
        // A slot may still be held for a moment by a closing connection: the decode's
        // connection is then refused as busy and its room fails, possibly before its
        // destination is set. Its prefill room would wait for that destination until
        // its deadline (a minute), so it is aborted and the next room tries again.
        t.create(room);
        unless_failed(t.d.room_set_destination(room, &[2], None));
        t.p.enqueue_chunk(room, &[1], true, None).unwrap();
        if wait_terminal(&t.d, room) == State::Success {
            assert_eq!(wait_terminal(&t.p, room), State::Success);
            break;
        }
        let why = t.d.room_failure(room).unwrap();
        assert_eq!(why.cause, Cause::PeerLost, "{why}");
        t.p.room_abort(room, "test: the decode was refused as busy; trying again")
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(20));
        room += 1;
    }
    assert!(t.delivered(&[1], &[2]));
}

/// The decode engine's id, as the prefill logged it when it accepted it.
fn accepted_decode_engine(t: &Pair) -> u64 {
    let line = t.plog.wait_for(&["accepted decode engine"]);
    let id = line.split("decode engine ").nth(1).unwrap();
    u64::from_str_radix(id.split(' ').next().unwrap(), 16).unwrap()
}

#[test]
fn a_stranger_cannot_open_a_data_connection_of_an_authenticated_session() {
    let t = pair(&[("auth_key", KEY_A)], &[("auth_key", KEY_A)]);
    assert_eq!(t.transfer(1, &[1], &[1]), (State::Success, State::Success));
    let id = accepted_decode_engine(&t);
    let mut strangers = Vec::new();
    for (i, auth) in [
        Message::AuthHello {
            auth: AuthMode::Required,
            key_id: [0x42; AUTH_KEY_ID_LEN],
            nonce: [0x43; 32],
        },
        fake::auth_off_hello(),
    ]
    .iter()
    .enumerate()
    {
        let mut s = TcpStream::connect(t.p.address()).unwrap();
        s.write_all(&[hello(ConnKind::Data, id), encode(auth)].concat())
            .unwrap();
        // The refusal comes at once; keep reading while a room transfers, to see that
        // no page comes this way.
        let mut hdr = [0u8; 16];
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.read_exact(&mut hdr).unwrap();
        let mut r = &hdr[..];
        let h = proto::read_frame_header(&mut r, &Limits::default()).unwrap();
        let m = proto::read_control(&mut s, &h, &Limits::default()).unwrap();
        let want = if i == 0 {
            AuthRefusal::NoSession
        } else {
            AuthRefusal::Mismatch
        };
        assert_eq!(
            m,
            Message::AuthRefused {
                reason: want,
                auth: AuthMode::Required
            }
        );
        strangers.push(s);
    }
    wait_refusals(&t.p, 2);
    for room in 2..6u64 {
        let (from, to) = (
            [room as u32, room as u32 + 10],
            [room as u32 + 2, room as u32 + 20],
        );
        assert_eq!(
            t.transfer(room, &from, &to),
            (State::Success, State::Success)
        );
        assert!(t.delivered(&from, &to));
    }
    for mut s in strangers {
        assert!(
            read_until_closed(&mut s).is_empty(),
            "a stranger received bytes"
        );
    }
    assert_eq!(t.p.metrics().peers_lost, 0);
}

#[test]
fn auth_required_without_a_key_is_refused_when_the_engine_starts() {
    let mut c = Config::default();
    c.set("role", "prefill").unwrap();
    c.set("auth", "required").unwrap();
    let e = Engine::new(c, common::quiet()).err().unwrap();
    assert_eq!(e.kind(), kvxfer::ErrorKind::BadValue);
    assert!(e.message().contains("auth_key_file"), "{e}");
}

#[test]
fn an_engine_of_the_cluster_cannot_take_over_another_engines_data_connection() {
    use kvxfer::auth::{self, Key, Local};
    let t = pair(&[("auth_key", KEY_A)], &[("auth_key", KEY_A)]);
    assert_eq!(t.transfer(1, &[1], &[1]), (State::Success, State::Success));
    let victim = accepted_decode_engine(&t);
    // A member of the cluster: it holds the key and authenticates its own control
    // connection, as engine 0x0BAD.
    let key = Key::from_hex(KEY_A).unwrap();
    let me = |engine_id| Local {
        mode: AuthMode::Required,
        key: Some(&key),
        role: Role::Decode,
        engine_id,
    };
    let soon = || Instant::now() + Duration::from_secs(10);
    let mut ctrl = TcpStream::connect(t.p.address()).unwrap();
    ctrl.write_all(&hello(ConnKind::Control, 0x0BAD)).unwrap();
    let session = auth::initiate(&mut ctrl, &me(0x0BAD), ConnKind::Control, 0, None, soon())
        .unwrap()
        .unwrap();
    // Its own session opens its own data connection...
    let mut own = TcpStream::connect(t.p.address()).unwrap();
    own.write_all(&hello(ConnKind::Data, 0x0BAD)).unwrap();
    assert!(auth::initiate(
        &mut own,
        &me(0x0BAD),
        ConnKind::Data,
        0,
        Some(&session),
        soon()
    )
    .is_ok());
    // ...but not one of the victim's: that needs the victim's session secret.
    let mut s = TcpStream::connect(t.p.address()).unwrap();
    s.write_all(&hello(ConnKind::Data, victim)).unwrap();
    let f = auth::initiate(
        &mut s,
        &me(victim),
        ConnKind::Data,
        0,
        Some(&session),
        soon(),
    )
    .unwrap_err();
    assert_eq!(f.reason, auth::Reason::NoSession, "{f}");
    // Nor does the cluster key itself open one: a data connection proves a session.
    let mut s2 = TcpStream::connect(t.p.address()).unwrap();
    s2.write_all(&hello(ConnKind::Data, victim)).unwrap();
    let nonce_i = [0x61; 32];
    s2.write_all(&encode(&Message::AuthHello {
        auth: AuthMode::Required,
        key_id: key.id(),
        nonce: nonce_i,
    }))
    .unwrap();
    let mut r = TcpStream::try_clone(&s2).unwrap();
    r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut next = || {
        let h = proto::read_frame_header(&mut r, &Limits::default()).unwrap();
        proto::read_control(&mut r, &h, &Limits::default()).unwrap()
    };
    match next() {
        Message::AuthChallenge {
            engine_id, nonce, ..
        } => {
            // Had it been challenged: the proof of the cluster key for this connection.
            let t = auth::Transcript {
                conn: ConnKind::Data,
                conn_index: 0,
                initiator: (Role::Decode, victim),
                responder: (Role::Prefill, engine_id),
                nonce_i,
                nonce_r: nonce,
            };
            s2.write_all(&encode(&Message::AuthProof {
                mac: t.initiator_proof(&unhex(KEY_A)),
            }))
            .unwrap();
            panic!("challenged, then answered {:?}", next());
        }
        m => assert_eq!(
            m,
            Message::AuthRefused {
                reason: AuthRefusal::NoSession,
                auth: AuthMode::Required
            }
        ),
    }
    wait_refusals(&t.p, 2);
    for room in 2..5u64 {
        let (from, to) = ([room as u32], [room as u32 + 7]);
        assert_eq!(
            t.transfer(room, &from, &to),
            (State::Success, State::Success)
        );
        assert!(t.delivered(&from, &to));
    }
    assert!(read_until_closed(&mut s).is_empty());
    assert!(read_until_closed(&mut s2).is_empty());
}

/// A member of the cluster (it holds the key) on raw sockets, as decode engine `id`:
/// its authenticated control connection, once the prefill answered it (so the prefill
/// knows the engine), and its session.
struct Member {
    id: u64,
    key: kvxfer::auth::Key,
    ctrl: TcpStream,
    session: Option<kvxfer::auth::SessionSecret>,
}

impl Member {
    /// Connects to `addr` as decode engine `id`; `None` if the prefill closed the control
    /// connection after authenticating it instead of answering.
    fn join(addr: &str, id: u64) -> Option<Member> {
        use kvxfer::auth::{self, Key};
        let key = Key::from_hex(KEY_A).unwrap();
        let mut ctrl = TcpStream::connect(addr).unwrap();
        ctrl.write_all(&hello(ConnKind::Control, id)).unwrap();
        let me = member(&key, id);
        let session = auth::initiate(&mut ctrl, &me, ConnKind::Control, 0, None, soon()).unwrap();
        answered(&mut ctrl).then_some(Member {
            id,
            key,
            ctrl,
            session,
        })
    }

    /// Opens data connection `index` of its session: `Some` if the prefill answered it
    /// (it is a link), `None` if it closed it once authenticated.
    fn data(&self, addr: &str, index: u16) -> Option<TcpStream> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&encode(&fake::hello(
            Role::Decode,
            ConnKind::Data,
            self.id,
            index,
        )))
        .unwrap();
        let me = member(&self.key, self.id);
        kvxfer::auth::initiate(
            &mut s,
            &me,
            ConnKind::Data,
            index,
            self.session.as_ref(),
            soon(),
        )
        .unwrap();
        answered(&mut s).then_some(s)
    }
}

fn member(key: &kvxfer::auth::Key, engine_id: u64) -> kvxfer::auth::Local<'_> {
    kvxfer::auth::Local {
        mode: AuthMode::Required,
        key: Some(key),
        role: Role::Decode,
        engine_id,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// After authentication: true if the prefill answers with its Hello, false if it
/// closes the connection instead.
fn answered(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hdr = [0u8; 16];
    match s.read_exact(&mut hdr) {
        Ok(()) => {
            let h = proto::read_frame_header(&mut &hdr[..], &Limits::default()).unwrap();
            assert_eq!(h.kind, Kind::Hello);
            true
        }
        Err(e) => {
            assert_ne!(
                e.kind(),
                std::io::ErrorKind::WouldBlock,
                "neither answered nor closed"
            );
            false
        }
    }
}

#[test]
fn a_member_gets_at_most_64_data_connections_and_never_two_with_one_index() {
    let t = pair(
        &[("auth_key", KEY_A), ("bootstrap_timeout_ms", "60000")],
        &[("auth_key", KEY_A)],
    );
    let addr = t.p.address().to_string();
    let m = Member::join(&addr, 0x0BAD).expect("the member's control connection");
    // 200 data connections, indices 0 to 199: the prefill makes a link (and a sender
    // thread) of the first 64 only, the most a decode engine opens; the others are
    // closed once authenticated, counted and logged.
    let mut links = Vec::new();
    let mut refused = Vec::new();
    for index in 0..200u16 {
        match m.data(&addr, index) {
            Some(s) => links.push((index, s)),
            None => refused.push(index),
        }
    }
    let accepted: Vec<u16> = links.iter().map(|(i, _)| *i).collect();
    assert_eq!(accepted, (0..64).collect::<Vec<u16>>());
    assert_eq!(refused, (64..200).collect::<Vec<u16>>());
    assert_eq!(t.p.metrics().peer_limit_refusals, 136);
    t.plog
        .wait_for(&["refused data connection 64 from decode engine", "up to 63"]);
    // An index already live is refused too, whichever it is.
    for index in [0, 5, 63] {
        assert!(
            m.data(&addr, index).is_none(),
            "a second data connection {index}"
        );
    }
    assert_eq!(t.p.metrics().peer_limit_refusals, 139);
    t.plog.wait_for(&["data connection 5 is already up"]);
    // Refusals are authenticated: none counts as an authentication failure, and the
    // real decode engine is served as before.
    assert_eq!(t.p.metrics().auth_failures, 0);
    assert_eq!(
        t.transfer(1, &[1, 2], &[3, 4]),
        (State::Success, State::Success)
    );
    assert!(t.delivered(&[1, 2], &[3, 4]));
    drop((links, m));
}

#[test]
fn a_prefill_engine_serves_at_most_1024_decode_engines_and_refuses_one_more() {
    let mem = common::source(BUFS, PAGES, ITEM);
    let log = common::Log::default();
    let p = common::start(
        "prefill",
        &[("auth_key", KEY_A), ("bootstrap_timeout_ms", "60000")],
        log.logger(Level::Debug),
    );
    p.register_kv(common::descs(&mem)).unwrap();
    let addr = p.address().to_string();
    // 1024 members, each with its own engine id: each one is a peer of the prefill
    // (its control connection waits for our Registration).
    let mut members: Vec<Member> = (1..=1024u64)
        .map(|id| Member::join(&addr, id).unwrap_or_else(|| panic!("member {id} refused")))
        .collect();
    // One more is refused once authenticated, counted and logged.
    assert!(Member::join(&addr, 1025).is_none());
    assert_eq!(p.metrics().peer_limit_refusals, 1);
    assert_eq!(p.metrics().auth_failures, 0);
    log.wait_for(&[
        "refused decode engine",
        "already serves 1024 decode engines",
    ]);
    // An engine already served may connect again (its new session replaces the old).
    let again = Member::join(&addr, 7).expect("a served engine reconnecting");
    // Once one goes (its setup fails, and the prefill forgets it), there is room again.
    let gone = members.remove(9);
    let _ = gone.ctrl.shutdown(Shutdown::Both);
    drop(gone);
    let start = Instant::now();
    let late = loop {
        if let Some(m) = Member::join(&addr, 1026) {
            break m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no room came back"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(late.id, 1026);
    drop((members, again, late));
}

#[test]
fn without_a_key_an_engine_listens_beyond_this_host_only_with_auth_off() {
    let start = |extra: &[(&str, &str)]| {
        let mut c = Config::default();
        c.set("role", "prefill").unwrap();
        for (k, v) in extra {
            c.set(k, v).unwrap();
        }
        Engine::new(c, common::quiet())
    };
    // A wildcard (or any address not loopback) without a key is refused, naming the
    // settings and the ways out.
    for extra in [
        &[("listen", "0.0.0.0:0")][..],
        &[("listen", "0.0.0.0:0"), ("auth", "auto")][..],
    ] {
        let e = start(extra)
            .err()
            .expect("a keyless engine listening everywhere");
        assert_eq!(e.kind(), kvxfer::ErrorKind::BadValue, "{e}");
        for part in ["'listen'", "0.0.0.0:0", "'auth'", "auth_key_file", "'off'"] {
            assert!(e.message().contains(part), "{part}: {e}");
        }
    }
    // auth=off says so explicitly; a key protects the address.
    let off = start(&[("listen", "0.0.0.0:0"), ("auth", "off")]).unwrap();
    let keyed = start(&[("listen", "0.0.0.0:0"), ("auth_key", KEY_A)]).unwrap();
    // Any loopback address is this host.
    let local = start(&[("listen", "127.0.0.2:0")]).unwrap();
    assert!(
        local.address().starts_with("127.0.0.2:"),
        "{}",
        local.address()
    );
    drop((off, keyed, local));
}
