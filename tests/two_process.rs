//! Prefill and decode in two processes over loopback. The test binary runs itself as
//! the prefill process (the `child_prefill` test, which does nothing unless
//! KVXFER_CHILD is set), so no extra binary is needed.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use kvxfer::{Cause, RoomPeers, State};

#[test]
fn child_prefill() {
    common::child_prefill_main();
}

#[test]
fn rooms_move_between_two_processes_byte_for_byte() {
    let mut child = ChildPrefill::start();
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine("decode", &mem, &[]);
    let rooms: Vec<u64> = (1..=24).collect();
    for &r in &rooms {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        let (src, _) = plan(r);
        // Scattered destination: every other page, offset per room.
        let dst: Vec<u32> = (0..src.len())
            .map(|i| ((r as usize * 40 + i * 2) % PAGES) as u32)
            .collect();
        let mut uniq = dst.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), dst.len());
        d.room_set_destination(r, &dst, None).unwrap();
        child.send(&format!("room {r}"));
        let s = wait_terminal(&d, r);
        assert_eq!(s, State::Success, "room {r}: {:?}", d.room_failure(r).ok());
        if let Some((b, s, t)) = first_unlike_source(&mem, &src, &dst) {
            panic!("room {r}: page {t} of buffer {b} differs from source page {s}");
        }
        d.room_clear(r).unwrap();
    }
    child.send("quit");
}

#[test]
fn a_killed_prefill_process_fails_decode_rooms_within_the_heartbeat_deadline() {
    let child = ChildPrefill::start();
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine(
        "decode",
        &mem,
        &[("heartbeat_interval_ms", "100"), ("heartbeat_misses", "5")],
    );
    for r in 1..=8u64 {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        d.room_set_destination(r, &[r as u32], None).unwrap();
    }
    wait_state(&d, 8, State::WaitingForInput);
    drop(child); // SIGKILL
    for r in 1..=8u64 {
        // Heartbeat deadline is 500 ms; a killed process closes its sockets at once.
        assert_eq!(
            terminal_within(&d, r, Duration::from_secs(5)),
            State::Failed
        );
        let why = d.room_failure(r).unwrap();
        assert_eq!(why.cause, Cause::PeerLost, "{why}");
    }
}

#[test]
fn a_stopped_prefill_process_is_detected_by_missed_heartbeats() {
    let child = ChildPrefill::start();
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine(
        "decode",
        &mem,
        // 600 ms of silence: a child starved of CPU for a moment is not lost before
        // the stop; the stop is still seen well within the 5 s below.
        &[("heartbeat_interval_ms", "100"), ("heartbeat_misses", "6")],
    );
    d.room_create(1, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(1, &[1], None).unwrap();
    wait_state(&d, 1, State::WaitingForInput);
    // SIGSTOP: the sockets stay open, the peer just goes silent (a hung process).
    let pid = child.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    assert_eq!(
        terminal_within(&d, 1, Duration::from_secs(5)),
        State::Failed
    );
    let why = d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::PeerLost);
    assert!(why.message.contains("heartbeat"), "{why}");
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
}
