//! Verified bytes (DESIGN inv. 10): with `integrity=verify` a decode room reaches
//! SUCCESS only when every data run's digest matched the bytes where it landed; a run
//! changed on the way, sent to another place than it was made for, or carrying an
//! earlier use's bytes fails the room as INTEGRITY, naming where. Each test shows the
//! failure it would miss with the check off.
//!
//! `cargo test --features test-hooks --test integrity` (the faults are test hooks).

#![cfg(feature = "test-hooks")]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{engine, poisoned, source, wait_terminal, Pair};
use kvxfer::proto::{FrameHeader, Kind, Limits, DATA_HEADER_LEN, FRAME_HEADER_LEN};
use kvxfer::{testing, Cause, RoomPeers, State};

const TCP: (&str, &str) = ("transport", "tcp");
const OFF: (&str, &str) = ("integrity", "off");
const VERIFY: (&str, &str) = ("integrity", "verify");

/// A TCP relay in front of `upstream`: it passes every connection through, and on the
/// data connections (whose first frame, a Hello, says so) it flips one payload byte of
/// every data frame of an odd room id, as a broken switch or a hostile host on the path
/// would. Counts the frames it changed.
struct Relay {
    addr: String,
    changed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn new(upstream: String) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let changed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (changed.clone(), stop.clone());
        l.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((down, _)) => {
                        down.set_nonblocking(false).unwrap();
                        let up = TcpStream::connect(&upstream).unwrap();
                        let c = c.clone();
                        std::thread::spawn(move || relay(down, up, c));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Relay {
            addr,
            changed,
            stop,
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn read_frame(s: &mut TcpStream) -> Option<(FrameHeader, Vec<u8>, Vec<u8>)> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    s.read_exact(&mut h).ok()?;
    let hdr = FrameHeader::decode(&h, &Limits::default()).ok()?;
    let mut payload = vec![0u8; hdr.payload_len as usize];
    s.read_exact(&mut payload).ok()?;
    Some((hdr, h.to_vec(), payload))
}

/// One connection: the client's frames go up unchanged; the answers come down, data
/// frames of odd rooms changed.
fn relay(mut down: TcpStream, mut up: TcpStream, changed: Arc<AtomicU64>) {
    let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut d2, &mut u2);
        let _ = u2.shutdown(std::net::Shutdown::Write);
    });
    while let Some((hdr, head, mut payload)) = read_frame(&mut up) {
        // The run headers end where the bytes begin: Data has one, DataRuns a count and
        // as many as it says.
        let (room, bytes_at) = match hdr.kind {
            Kind::Data => (u64_at(&payload, 0), DATA_HEADER_LEN),
            Kind::DataRuns => {
                let n = u32::from_le_bytes(payload[0..4].try_into().unwrap()) as usize;
                (u64_at(&payload, 8), 8 + n * DATA_HEADER_LEN)
            }
            _ => (0, payload.len()),
        };
        if room % 2 == 1 && bytes_at < payload.len() {
            payload[bytes_at] ^= 0x40;
            changed.fetch_add(1, Ordering::Relaxed);
        }
        if down.write_all(&head).is_err() || down.write_all(&payload).is_err() {
            break;
        }
    }
    let _ = down.shutdown(std::net::Shutdown::Both);
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

const BUFS: usize = 2;
const PAGES: usize = 64;
const ITEM: usize = 4096;

/// Rooms 1..=6 through a relay that changes the data frames of odd rooms; how each room
/// ended on the decode side, and whether its pages hold the source's bytes.
fn through_a_tampering_relay(integrity: (&str, &str)) -> Vec<(u64, State, Option<Cause>, bool)> {
    let (pmem, dmem) = (source(BUFS, PAGES, ITEM), poisoned(BUFS, PAGES, ITEM));
    let keys = [TCP, integrity, ("connections_per_peer", "1")];
    let p = engine("prefill", &pmem, &keys);
    let d = engine("decode", &dmem, &keys);
    let relay = Relay::new(p.address().to_string());
    let mut out = Vec::new();
    for r in 1..=6u64 {
        let src: Vec<u32> = (0..4).map(|i| (r as u32 * 4 + i) % PAGES as u32).collect();
        let dst: Vec<u32> = (0..4).map(|i| (r as u32 * 8 + i) % PAGES as u32).collect();
        p.room_create(r, RoomPeers::Decoders(1)).unwrap();
        d.room_create(r, RoomPeers::Prefills(vec![relay.addr.clone()]))
            .unwrap();
        d.room_set_destination(r, &dst, None).unwrap();
        p.enqueue_chunk(r, &src, true, None).unwrap();
        let state = wait_terminal(&d, r);
        let cause = d.room_failure(r).ok().map(|f| f.cause);
        let intact = common::first_unlike_source(&dmem, &src, &dst).is_none();
        if state == State::Success {
            assert_eq!(d.room_verified(r).unwrap(), integrity == VERIFY);
        }
        out.push((r, state, cause, intact));
    }
    assert!(relay.changed.load(Ordering::Relaxed) >= 3);
    out
}

#[test]
fn bytes_changed_on_the_way_fail_their_rooms_as_integrity_and_the_others_succeed() {
    for (r, state, cause, intact) in through_a_tampering_relay(VERIFY) {
        if r % 2 == 1 {
            assert_eq!(
                (state, cause),
                (State::Failed, Some(Cause::Integrity)),
                "room {r}"
            );
        } else {
            assert_eq!(state, State::Success, "room {r}: {cause:?}");
            assert!(intact, "room {r}");
        }
    }
}

/// The same relay with the check off: the changed rooms succeed with wrong bytes, which
/// is what the check is for.
#[test]
fn without_the_check_the_changed_rooms_succeed_with_wrong_bytes() {
    let rooms = through_a_tampering_relay(OFF);
    assert!(rooms
        .iter()
        .all(|(_, state, _, _)| *state == State::Success));
    assert!(rooms.iter().any(|(r, _, _, intact)| r % 2 == 1 && !intact));
}

/// A pair over TCP with `integrity`, rooms of four one-page chunks.
fn pair(integrity: (&str, &str)) -> Pair {
    Pair::builder()
        .config(&[TCP, integrity, ("connections_per_peer", "1")])
        .build()
}

/// Room `room` with test fault `fault` armed: how the decode side ended, and its reason.
fn with_fault(t: &Pair, room: u64, fault: &str) -> (State, kvxfer::FailureReason) {
    testing::inject_fault(fault, room);
    t.open(room, &[10, 11, 12, 13]);
    t.send(room, &[1, 2, 3, 4], 1);
    let state = wait_terminal(&t.d, room);
    let why =
        t.d.room_failure(room)
            .unwrap_or(kvxfer::FailureReason::local(Cause::Internal, "no failure"));
    (state, why)
}

#[test]
fn a_run_sent_to_the_wrong_page_fails_as_integrity_naming_the_page() {
    let (state, why) = with_fault(&pair(VERIFY), 21, "integrity.wrong_page");
    assert_eq!(
        (state, why.cause),
        (State::Failed, Cause::Integrity),
        "{why}"
    );
    assert!(why.message.contains("page 11 of kv buffer"), "{why}");
    assert!(why.message.contains("do not match their digest"), "{why}");
}

#[test]
fn a_run_with_an_earlier_use_s_digest_fails_as_integrity() {
    let (state, why) = with_fault(&pair(VERIFY), 22, "integrity.earlier_use");
    assert_eq!(
        (state, why.cause),
        (State::Failed, Cause::Integrity),
        "{why}"
    );
    // Without the check the run is taken as it is: the room succeeds.
    let (state, _) = with_fault(&pair(OFF), 23, "integrity.earlier_use");
    assert_eq!(state, State::Success);
}

#[test]
fn engines_that_differ_in_integrity_fail_their_rooms_naming_both_settings() {
    let t = Pair::builder()
        .config(&[TCP])
        .decode(&[VERIFY])
        .prefill(&[OFF])
        .build();
    t.open(1, &[1]);
    assert_eq!(wait_terminal(&t.d, 1), State::Failed);
    let why = t.d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(
        why.message
            .contains("integrity=verify on the decode engine")
            && why.message.contains("integrity=off on the prefill engine"),
        "{why}"
    );
}

/// The decode engine tells the prefill engine, which counts it, and fails its room as
/// INTEGRITY if the room had not already handed over every byte (SUCCESS is sticky).
#[test]
fn the_prefill_engine_counts_the_integrity_failure_it_is_told_of() {
    let t = pair(VERIFY);
    let (state, _) = with_fault(&t, 24, "integrity.wrong_page");
    assert_eq!(state, State::Failed);
    assert_eq!(t.d.metrics().integrity_failures, 1);
    common::wait_until("the prefill engine to count it", || {
        t.p.metrics().integrity_failures == 1
    });
    if wait_terminal(&t.p, 24) == State::Failed {
        let why = t.p.room_failure(24).unwrap();
        assert_eq!(why.cause, Cause::Integrity, "{why}");
        assert!(why.from_peer);
    }
}
