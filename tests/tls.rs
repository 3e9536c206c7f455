//! TLS 1.3 on the control connection (`tls_cert_file`, `tls_key_file`, `tls_ca_file`)
//! and `encrypt_data`: engines with certificates of one CA transfer, and nothing of
//! their control connection travels in the clear; a certificate of another CA, or TLS on
//! one side only, fails the rooms of both sides naming TLS and writes nothing; a
//! stranger on a raw socket gets nothing; sealed data arrives byte-exact, nothing of it
//! in the clear, and a payload changed on the way fails the room and is never written.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};

use common::fake::{self, encode, frames, read_until_closed};
use common::pki::{refs, Pki};
use common::{unless_failed, wait_terminal, wait_until, Pair, POISON};
use kvxfer::log::Level;
use kvxfer::proto::{AuthRefusal, ConnKind, Kind, Message, Role, FRAME_MAGIC};
use kvxfer::{Cause, Config, Engine, ErrorKind, RoomPeers, State};

const BUFS: usize = 2;
const PAGES: usize = 32;
const ITEM: usize = 512;
const KEY: &str = "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0";

fn pair(p_extra: &[(&str, &str)], d_extra: &[(&str, &str)]) -> Pair {
    Pair::builder()
        .transport("tcp")
        .config(&[("connections_per_peer", "2")])
        .prefill(p_extra)
        .decode(d_extra)
        .bufs(BUFS)
        .pages(PAGES)
        .item(ITEM)
        .log(Level::Debug)
        .build()
}

fn with(kv: &[(String, String)], more: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = kv.to_vec();
    v.extend(more.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    v
}

/// Whether no byte of the decode engine's buffers was written.
fn untouched(t: &Pair) -> bool {
    t.dmem.iter().all(|m| m.holds_only(POISON))
}

/// What a relayed connection carried from the prefill engine to the decode engine
/// (`down`) and back (`up`).
#[derive(Default)]
struct Recording {
    up: Vec<u8>,
    down: Vec<u8>,
}

/// A relay between decode engines and `to`, recording each connection; `change` may
/// alter each chunk going down (to the decode engine), given its offset in the stream.
struct Tap {
    addr: String,
    streams: Arc<Mutex<Vec<Arc<Mutex<Recording>>>>>,
}

/// A change to a chunk going down connection `conn` (0: the first one, the control
/// connection) at offset `at` of its stream.
type Change = Arc<dyn Fn(usize, usize, &mut [u8]) + Send + Sync>;

fn tap(to: String, change: Change) -> Tap {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let streams: Arc<Mutex<Vec<Arc<Mutex<Recording>>>>> = Default::default();
    let rec = streams.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let Ok(up) = TcpStream::connect(&to) else {
                return;
            };
            let log = Arc::new(Mutex::new(Recording::default()));
            let conn = {
                let mut streams = rec.lock().unwrap();
                streams.push(log.clone());
                streams.len() - 1
            };
            let (mut c_r, mut c_w) = (c.try_clone().unwrap(), c);
            let (mut up_r, mut up_w) = (up.try_clone().unwrap(), up);
            let up_log = log.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n @ 1..) = c_r.read(&mut buf) {
                    up_log.lock().unwrap().up.extend_from_slice(&buf[..n]);
                    if up_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = up_w.shutdown(Shutdown::Both);
            });
            let change = change.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                let mut at = 0;
                while let Ok(n @ 1..) = up_r.read(&mut buf) {
                    change(conn, at, &mut buf[..n]);
                    at += n;
                    log.lock().unwrap().down.extend_from_slice(&buf[..n]);
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

fn no_change() -> Change {
    Arc::new(|_, _, _| {})
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Runs `room` through `via` (a tap's address): source pages `from` into `to`.
fn transfer_via(t: &Pair, via: &str, room: u64, from: &[u32], to: &[u32]) -> (State, State) {
    t.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    t.d.room_create(room, RoomPeers::Prefills(vec![via.to_string()]))
        .unwrap();
    t.d.room_set_destination(room, to, None).unwrap();
    t.p.enqueue_chunk(room, from, true, None).unwrap();
    (wait_terminal(&t.p, room), wait_terminal(&t.d, room))
}

#[test]
fn engines_with_certificates_of_one_ca_transfer_and_their_control_connection_is_encrypted() {
    let pki = Pki::new("one-ca");
    // Without a cluster key, then with one (its handshake runs inside TLS).
    for key in [None, Some(KEY)] {
        let extra: Vec<(&str, &str)> = key.map(|k| vec![("auth_key", k)]).unwrap_or_default();
        let (pk, dk) = (
            with(&pki.keys("prefill"), &extra),
            with(&pki.keys("decode"), &extra),
        );
        let t = pair(&refs(&pk), &refs(&dk));
        let tapped = tap(t.p.address().to_string(), no_change());
        for room in 1..=3u64 {
            let from: Vec<u32> = (room as u32 * 3..room as u32 * 3 + 3).collect();
            let to: Vec<u32> = (room as u32 * 4..room as u32 * 4 + 3).collect();
            assert_eq!(
                transfer_via(&t, &tapped.addr, room, &from, &to),
                (State::Success, State::Success)
            );
            assert!(t.delivered(&from, &to), "room {room}");
        }
        assert_eq!(t.p.metrics().auth_failures, 0);
        assert_eq!(t.d.metrics().auth_failures, 0);
        // The control connection is the first: a TLS handshake record from its first
        // byte, and no kvxfer frame (Hello, Registration, Destination) in the clear.
        let streams = tapped.streams.lock().unwrap();
        assert_eq!(streams.len(), 3, "one control and two data connections");
        let ctrl = streams[0].lock().unwrap();
        assert_eq!(ctrl.up[..2], [0x16, 0x03], "a TLS ClientHello");
        for dir in [&ctrl.up, &ctrl.down] {
            assert!(
                !contains(dir, &FRAME_MAGIC.to_le_bytes()),
                "a frame in the clear"
            );
        }
        // Data connections stay plain TCP, with the pages in the clear.
        let data = streams[1].lock().unwrap();
        assert_eq!(data.up[..4], FRAME_MAGIC.to_le_bytes());
        t.plog.wait_for(&["accepted decode engine"]);
    }
}

#[test]
fn control_frames_larger_than_a_tls_record_cross_whole() {
    // A destination of 40,000 pages is a 160 KB frame: ten TLS records, read by the
    // control reader a socket read at a time.
    let pki = Pki::new("large");
    let (pk, dk) = (pki.keys("prefill"), pki.keys("decode"));
    let t = Pair::builder()
        .transport("tcp")
        .prefill(&refs(&pk))
        .decode(&refs(&dk))
        .bufs(1)
        .pages(40_000)
        .item(64)
        .build();
    let all: Vec<u32> = (0..40_000).collect();
    let to: Vec<u32> = all.iter().rev().copied().collect();
    for room in 1..=2 {
        assert_eq!(
            t.transfer(room, &all, &to),
            (State::Success, State::Success)
        );
        t.assert_pages(&all, &to);
        t.repoison(&to);
    }
}

/// Decode room 1 against a prefill room 1 with a chunk waiting: both must fail, the
/// decode side at once with MISMATCH, the prefill side at its bootstrap deadline; both
/// reasons name TLS; no page is written; both engines count the refusal.
fn assert_refused_both_sides(t: &Pair, parts: &[&str]) {
    t.p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    unless_failed(t.p.enqueue_chunk(1, &[1, 2], true, None));
    t.d.room_create(1, RoomPeers::Prefills(vec![t.p.address().into()]))
        .unwrap();
    unless_failed(t.d.room_set_destination(1, &[3, 4], None));
    assert_eq!(wait_terminal(&t.d, 1), State::Failed);
    let why = t.d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(why.message.contains("TLS"), "decode: {why}");
    for part in parts {
        assert!(why.message.contains(part), "decode: {why}");
    }
    assert_eq!(wait_terminal(&t.p, 1), State::Failed);
    let why = t.p.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::BootstrapTimeout, "{why}");
    assert!(why.message.contains("TLS"), "prefill: {why}");
    assert!(untouched(t));
    assert!(t.p.metrics().auth_failures >= 1);
    assert!(t.d.metrics().auth_failures >= 1);
}

#[test]
fn a_certificate_of_another_ca_is_refused_and_fails_both_sides_naming_tls() {
    let (ours, theirs) = (Pki::new("ours"), Pki::new("theirs"));
    let timeout = [("bootstrap_timeout_ms", "1500")];
    // A decode engine of another cluster (its certificate and CA). (An engine whose own
    // certificate is not of its CA does not start: see the configuration test.)
    let stranger = theirs.keys("decode");
    let p = with(&ours.keys("prefill"), &timeout);
    let t = pair(&refs(&p), &refs(&stranger));
    assert_refused_both_sides(&t, &["TLS authentication failed"]);
    // The decode engine checks the prefill's certificate first, and says so; the
    // prefill engine hears its alert (or the connection closing).
    t.dlog
        .wait_for(&["TLS authentication failed", "invalid peer certificate"]);
    t.plog.wait_for(&["refused", "TLS authentication failed"]);
}

#[test]
fn tls_on_one_side_only_fails_both_sides_naming_tls() {
    let pki = Pki::new("one-side");
    let timeout = ("bootstrap_timeout_ms", "1500");
    // TLS on the prefill engine only, then on the decode engine only; with and without
    // a cluster key on both.
    for key in [None, Some(KEY)] {
        let k: Vec<(&str, &str)> = key.map(|k| vec![("auth_key", k)]).unwrap_or_default();
        let p = with(&pki.keys("prefill"), &[timeout]);
        let p = with(&p, &k);
        let t = pair(&refs(&p), &k);
        assert_refused_both_sides(&t, &["TLS mismatch", "this decode engine has no TLS"]);
        t.plog.wait_for(&["refused", "without TLS"]);
        let d = with(&pki.keys("decode"), &k);
        let mut p = k.clone();
        p.push(timeout);
        let t = pair(&p, &refs(&d));
        assert_refused_both_sides(&t, &["TLS mismatch", "this decode engine requires TLS"]);
        t.plog
            .wait_for(&["refused", "the peer speaks TLS", "this engine has no TLS"]);
    }
}

#[test]
fn a_plaintext_stranger_gets_nothing_from_an_engine_with_tls() {
    let pki = Pki::new("stranger");
    let (pk, dk) = (pki.keys("prefill"), pki.keys("decode"));
    let t = pair(&refs(&pk), &refs(&dk));
    t.ready(1, &[5, 6]);
    let destination = encode(&fake::destination(1, 1, vec![0, 1]));
    let hello = |conn, id| encode(&fake::hello(Role::Decode, conn, id, 0));
    let attempts: Vec<Vec<u8>> = vec![
        destination.clone(),
        [hello(ConnKind::Control, 9), destination.clone()].concat(),
        [
            hello(ConnKind::Control, 9),
            encode(&fake::auth_off_hello()),
            destination,
        ]
        .concat(),
        // A data connection: with TLS it must prove the control session, which a
        // stranger has not (even with no cluster key set).
        [hello(ConnKind::Data, 9), encode(&fake::auth_off_hello())].concat(),
        // A TLS record that is not a handshake the CA would pass.
        vec![0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5],
    ];
    for (i, bytes) in attempts.iter().enumerate() {
        let mut s = TcpStream::connect(t.p.address()).unwrap();
        let _ = s.write_all(bytes);
        let got = read_until_closed(&mut s);
        // At most a refusal or a TLS alert comes back, never the prefill's Hello.
        if got.first() != Some(&0x15) {
            assert!(
                frames(&got).iter().all(|m| m.kind() == Kind::AuthRefused),
                "attempt {i}: {:?}",
                frames(&got)
            );
        }
        let n = i as u64 + 1;
        wait_until(&format!("{n} refusals"), || {
            t.p.metrics().auth_failures >= n
        });
    }
    // The data connection of engine 9 was refused for want of a session.
    let s = {
        let mut s = TcpStream::connect(t.p.address()).unwrap();
        s.write_all(
            &[
                hello(ConnKind::Data, 9),
                encode(&Message::AuthHello {
                    auth: kvxfer::proto::AuthMode::Required,
                    key_id: [1; 8],
                    nonce: [2; 32],
                }),
            ]
            .concat(),
        )
        .unwrap();
        read_until_closed(&mut s)
    };
    assert_eq!(
        frames(&s),
        vec![Message::AuthRefused {
            reason: AuthRefusal::NoSession,
            auth: kvxfer::proto::AuthMode::Required
        }]
    );
    assert_eq!(t.p.room_poll(1).unwrap(), State::WaitingForInput);
    assert!(untouched(&t));
    // The room completes as if nothing happened.
    t.p.enqueue_chunk(1, &[7, 8], true, None).unwrap();
    assert_eq!(wait_terminal(&t.p, 1), State::Success);
    assert_eq!(wait_terminal(&t.d, 1), State::Success);
    assert!(t.delivered(&[7, 8], &[5, 6]));
}

#[test]
fn sealed_data_arrives_byte_exact_and_nothing_of_it_travels_in_the_clear() {
    let pki = Pki::new("sealed");
    let seal = [("encrypt_data", "true")];
    let (pk, dk) = (
        with(&pki.keys("prefill"), &seal),
        with(&pki.keys("decode"), &seal),
    );
    let t = pair(&refs(&pk), &refs(&dk));
    let tapped = tap(t.p.address().to_string(), no_change());
    let mut sent = Vec::new();
    for room in 1..=4u64 {
        // Runs of one page and of several, so frames of several sizes.
        let from: Vec<u32> = (0..room as u32 * 2).map(|i| i * 3 % PAGES as u32).collect();
        let to: Vec<u32> = (0..room as u32 * 2)
            .map(|i| (i + room as u32) % 32)
            .collect();
        assert_eq!(
            transfer_via(&t, &tapped.addr, room, &from, &to),
            (State::Success, State::Success)
        );
        t.assert_pages(&from, &to);
        sent.extend(from);
    }
    // No 32-byte piece of any page sent is on the wire.
    let streams = tapped.streams.lock().unwrap();
    for (i, s) in streams.iter().enumerate().skip(1) {
        let down = &s.lock().unwrap().down;
        assert!(down.len() > 1000, "data connection {i} carried data");
        for &p in &sent {
            for b in 0..BUFS {
                let page = t.pmem[b].page(p);
                for piece in page.chunks(32) {
                    assert!(
                        !contains(down, piece),
                        "page {p} of buffer {b} in the clear"
                    );
                }
            }
        }
    }
}

#[test]
fn a_sealed_payload_changed_on_the_way_fails_the_room_and_is_never_written() {
    let pki = Pki::new("tamper");
    let seal = [("encrypt_data", "true")];
    let (pk, dk) = (
        with(&pki.keys("prefill"), &seal),
        with(&pki.keys("decode"), &seal),
    );
    let t = pair(&refs(&pk), &refs(&dk));
    // One bit of each data connection's stream, inside the first payload: past the
    // handshake (under 400 bytes), within a frame of 8 pages of 512 bytes.
    let flip: Change = Arc::new(|conn, at, chunk: &mut [u8]| {
        const AT: usize = 1000;
        if conn > 0 && (at..at + chunk.len()).contains(&AT) {
            chunk[AT - at] ^= 0x20;
        }
    });
    let tapped = tap(t.p.address().to_string(), flip);
    let (from, to): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (8..16).collect());
    let (_, d) = transfer_via(&t, &tapped.addr, 1, &from, &to);
    assert_eq!(d, State::Failed);
    let why = t.d.room_failure(1).unwrap();
    assert!(why.message.contains("encrypt_data"), "{why}");
    assert!(why.message.contains("integrity"), "{why}");
    // The prefill room may have finished sending before the decode side failed.
    t.assert_poisoned(&to);
    assert!(untouched(&t));
    assert!(t.d.metrics().protocol_errors >= 1);
}

#[test]
fn engines_that_differ_in_encrypt_data_fail_naming_it_and_write_nothing() {
    let pki = Pki::new("differ");
    let timeout = ("bootstrap_timeout_ms", "1500");
    for (p_seal, d_seal) in [("true", "false"), ("false", "true")] {
        let p = with(&pki.keys("prefill"), &[("encrypt_data", p_seal), timeout]);
        let d = with(&pki.keys("decode"), &[("encrypt_data", d_seal)]);
        let t = pair(&refs(&p), &refs(&d));
        t.p.room_create(1, RoomPeers::Decoders(1)).unwrap();
        unless_failed(t.p.enqueue_chunk(1, &[1, 2], true, None));
        t.d.room_create(1, RoomPeers::Prefills(vec![t.p.address().into()]))
            .unwrap();
        unless_failed(t.d.room_set_destination(1, &[3, 4], None));
        assert_eq!(wait_terminal(&t.d, 1), State::Failed);
        let why = t.d.room_failure(1).unwrap();
        assert_eq!(why.cause, Cause::Mismatch, "{why}");
        assert!(why.message.contains("encrypt_data"), "{why}");
        assert_eq!(wait_terminal(&t.p, 1), State::Failed);
        assert!(t
            .p
            .room_failure(1)
            .unwrap()
            .message
            .contains("encrypt_data"));
        assert!(untouched(&t));
    }
}

fn engine_error(extra: &[(&str, &str)]) -> kvxfer::Error {
    let mut c = Config::default();
    c.set("role", "prefill").unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    Engine::new(c, common::quiet())
        .err()
        .expect("the engine starts")
}

#[test]
fn a_partial_or_unreadable_tls_configuration_is_refused_when_the_engine_starts() {
    let pki = Pki::new("config");
    let keys = pki.keys("prefill");
    let kv = refs(&keys);
    // Only some of the three: the message names what is missing.
    let e = engine_error(&kv[..2]);
    assert_eq!(e.kind(), ErrorKind::BadValue);
    assert!(e.message().contains("'tls_ca_file' missing"), "{e}");
    let e = engine_error(&kv[1..2]);
    assert!(
        e.message()
            .contains("'tls_cert_file' and 'tls_ca_file' missing"),
        "{e}"
    );
    // A missing file, a file without PEM, a key that is not the certificate's, a
    // certificate of another CA: each names its key and path.
    let garbage = pki.path("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    // Private, so that as tls_key_file it fails for holding no key, not for its mode.
    std::fs::set_permissions(&garbage, std::fs::Permissions::from_mode(0o600)).unwrap();
    let missing = pki.path("missing.pem");
    let (_, other_key) = pki.issue("other");
    let foreign = Pki::new("config-foreign");
    let (foreign_cert, foreign_key) = foreign.issue("prefill");
    for (i, value, part) in [
        (0, missing.as_str(), "tls_cert_file"),
        (0, garbage.as_str(), "no PEM certificate"),
        (2, garbage.as_str(), "tls_ca_file"),
        (1, garbage.as_str(), "tls_key_file"),
        (1, other_key.as_str(), "does not fit"),
    ] {
        let mut kv = kv.clone();
        kv[i].1 = value;
        let e = engine_error(&kv);
        assert_eq!(e.kind(), ErrorKind::BadValue, "{e}");
        assert!(e.message().contains(part), "{part}: {e}");
        assert!(e.message().contains(value), "{value}: {e}");
    }
    let mut kv2 = kv.clone();
    kv2[0].1 = &foreign_cert;
    kv2[1].1 = &foreign_key;
    let e = engine_error(&kv2);
    assert!(e.message().contains("not valid under the CA"), "{e}");
    // encrypt_data needs TLS.
    let e = engine_error(&[("encrypt_data", "true")]);
    assert!(e.message().contains("encrypt_data"), "{e}");
    assert!(e.message().contains("tls_cert_file"), "{e}");
    // All three and encrypt_data start.
    let mut c = Config::default();
    c.set("role", "prefill").unwrap();
    for (k, v) in kv.iter().chain(&[("encrypt_data", "true")]) {
        c.set(k, v).unwrap();
    }
    assert!(Engine::new(c, common::quiet()).is_ok());
}

#[test]
fn a_tls_key_file_that_group_or_others_may_read_is_refused_naming_its_mode() {
    let pki = Pki::new("key-mode");
    let keys = pki.keys("prefill");
    let key_file = keys[1].1.clone();
    for (mode, refused) in [(0o644, true), (0o640, true), (0o604, true), (0o400, false)] {
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(mode)).unwrap();
        let mut c = Config::default();
        c.set("role", "prefill").unwrap();
        for (k, v) in refs(&keys) {
            c.set(k, v).unwrap();
        }
        let r = Engine::new(c, common::quiet());
        if !refused {
            assert!(r.is_ok(), "mode {mode:04o}: {:?}", r.err());
            continue;
        }
        let e = r
            .err()
            .expect("the engine started with a key file others may read");
        assert_eq!(e.kind(), ErrorKind::BadValue, "{e}");
        for part in [
            "tls_key_file",
            key_file.as_str(),
            &format!("mode {mode:04o}"),
            "chmod 600",
        ] {
            assert!(e.message().contains(part), "{part}: {e}");
        }
    }
    // Nor is a key that is not a regular file (a directory here).
    let mut c = Config::default();
    c.set("role", "prefill").unwrap();
    for (k, v) in refs(&keys) {
        c.set(k, if k == "tls_key_file" { "/tmp" } else { v })
            .unwrap();
    }
    let e = Engine::new(c, common::quiet()).err().unwrap();
    assert!(e.message().contains("not a regular file"), "{e}");
}
