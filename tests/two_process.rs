//! Prefill and decode in two processes over loopback. The test binary runs itself as
//! the prefill process (the `child_prefill` test, which does nothing unless
//! KVXFER_CHILD is set), so no extra binary is needed.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kvxfer::{Cause, RoomPeers, State};

#[test]
fn child_prefill() {
    common::child_prefill_main();
}

#[test]
fn rooms_move_between_two_processes_byte_for_byte() {
    let mut child = ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0xEEu8; PAGES * ITEM]).collect();
    let d = engine("decode", &mut mem, &[]);
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
        assert_eq!(
            wait_terminal(&d, r, Duration::from_secs(20)),
            State::Success,
            "room {r}"
        );
        for (i, (&s, &t)) in src.iter().zip(&dst).enumerate() {
            for (b, buf) in mem.iter().enumerate() {
                let page = &buf[t as usize * ITEM..(t as usize + 1) * ITEM];
                assert!(
                    page.iter()
                        .enumerate()
                        .all(|(j, &x)| x == pattern(b, s as usize, j)),
                    "room {r} page {i} buffer {b} differs"
                );
            }
        }
        d.room_clear(r).unwrap();
    }
    child.send("quit");
}

#[test]
fn a_killed_prefill_process_fails_decode_rooms_within_the_heartbeat_deadline() {
    let child = ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0u8; PAGES * ITEM]).collect();
    let d = engine(
        "decode",
        &mut mem,
        &[("heartbeat_interval_ms", "100"), ("heartbeat_misses", "5")],
    );
    for r in 1..=8u64 {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        d.room_set_destination(r, &[r as u32], None).unwrap();
    }
    let t = Instant::now();
    while d.room_poll(8).unwrap() != State::WaitingForInput {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(child); // SIGKILL
    for r in 1..=8u64 {
        // Heartbeat deadline is 500 ms; a killed process closes its sockets at once.
        assert_eq!(wait_terminal(&d, r, Duration::from_secs(5)), State::Failed);
        let why = d.room_failure(r).unwrap();
        assert_eq!(why.cause, Cause::PeerLost, "{why}");
    }
}

#[test]
fn a_stopped_prefill_process_is_detected_by_missed_heartbeats() {
    let child = ChildPrefill::start();
    let mut mem: Vec<Vec<u8>> = (0..BUFS).map(|_| vec![0u8; PAGES * ITEM]).collect();
    let d = engine(
        "decode",
        &mut mem,
        &[("heartbeat_interval_ms", "100"), ("heartbeat_misses", "3")],
    );
    d.room_create(1, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(1, &[1], None).unwrap();
    let t = Instant::now();
    while d.room_poll(1).unwrap() != State::WaitingForInput {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    // SIGSTOP: the sockets stay open, the peer just goes silent (a hung process).
    let pid = child.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    assert_eq!(wait_terminal(&d, 1, Duration::from_secs(5)), State::Failed);
    let why = d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::PeerLost);
    assert!(why.message.contains("heartbeat"), "{why}");
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
}
