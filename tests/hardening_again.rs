//! The findings of the second invariants review (shared/reviews/invariants-2026-12-05.md)
//! whose tests live here: F2, F3 and F7/F8 (F1 is the Python SGLang backend's, tested in
//! python/tests; F4's is in tests/hetero.rs, F5's in tests/auth.rs and the sealed
//! receiver's unit tests, F6's in tests/tls.rs). Each test
//! builds the input the finding describes, or holds its interleaving open with a
//! test-only pause point (src/testing.rs), and fails without its fix.
//!
//! `cargo test --features test-hooks --test hardening_again`.

#![cfg(feature = "test-hooks")]

mod common;

use std::io::Write;
use std::sync::mpsc;
use std::time::Duration;

use common::fake::{self, FakePrefill};
use common::{engine, wait_terminal, wait_until, Region, POISON};
use kvxfer::proto::Message;
use kvxfer::testing;
use kvxfer::{Cause, RoomPeers, State};

const BUFS: usize = 2;
const PAGES: usize = 64;
const ITEM: usize = 1024;
/// The fake engines speak TCP.
const TCP: (&str, &str) = ("transport", "tcp");

/// This file's decode buffers, every byte POISON.
fn poisoned() -> Vec<Region> {
    common::poisoned(BUFS, PAGES, ITEM)
}

/// F3. An Abort from a connected prefill engine failed any decode room it named, also
/// one that does not pull from it: a member could cancel other engines' rooms. Only the
/// room's own prefill engines may abort it now; any other Abort is counted.
#[test]
fn an_abort_from_an_engine_the_room_does_not_pull_from_is_counted_and_ignored() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let (mut a, mut b, generation) = fake::two_prefills(&d, 31, 32, (BUFS, PAGES, ITEM));
    let before = d.metrics().unknown_room_frames;
    // Engine B aborts room 31, which pulls from A only.
    fake::send_msg(
        b.ctrl(),
        &Message::Abort {
            room: 31,
            generation,
            reason: "not yours".into(),
        },
    );
    wait_until("the Abort to be counted", || {
        d.metrics().unknown_room_frames == before + 1
    });
    assert_eq!(d.room_poll(31).unwrap(), State::WaitingForInput);
    assert_eq!(d.room_poll(32).unwrap(), State::WaitingForInput);
    // The room's own engine still can.
    fake::send_msg(
        a.ctrl(),
        &Message::Abort {
            room: 31,
            generation,
            reason: "cancelled by its prefill".into(),
        },
    );
    assert_eq!(wait_terminal(&d, 31), State::Failed);
    let why = d.room_failure(31).unwrap();
    assert!(
        why.from_peer && why.message.contains("cancelled by its prefill"),
        "{why}"
    );
}

/// F3, by the data path: a data frame naming a room that does not pull from its sender
/// failed that room as a protocol error, so a member could fail other engines' rooms
/// with it too. It closes the sender's connection now, is counted, and leaves the room
/// (and its pages) alone.
#[test]
fn a_data_frame_from_an_engine_the_room_does_not_pull_from_leaves_the_room_alone() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let (_a, mut b, generation) = fake::two_prefills(&d, 33, 34, (BUFS, PAGES, ITEM));
    let before = d.metrics().unknown_room_frames;
    let f = fake::data_frame(&fake::kv_header(33, generation, 0, 1, 1, ITEM), 0x55);
    b.data[0].write_all(&f).unwrap();
    wait_until("the frame to be counted", || {
        d.metrics().unknown_room_frames == before + 1
    });
    assert_eq!(d.room_poll(33).unwrap(), State::WaitingForInput);
    assert!(dmem[0].page(1).iter().all(|&x| x == POISON));
}

/// F8. Completion counted bytes per peer: a peer that wrote one granted page twice and
/// skipped another reached SUCCESS, leaving stale bytes in the skipped page. A run that
/// repeats bytes the room already took is a protocol error now.
#[test]
fn a_page_written_twice_fails_the_room_even_when_the_byte_count_adds_up() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let (mut fp, dest) = FakePrefill::serving(&d, 41, &[3, 4], BUFS, PAGES, ITEM, 1);
    let g = dest.generation;
    // Page 3 of both buffers twice (once in a frame of its own, once with page 4 of the
    // other buffer), page 4 of buffer 0 never: as many bytes as two pages of two buffers.
    let twice = [
        fake::data_frame(&fake::kv_header(41, g, 0, 3, 1, ITEM), 0x11),
        fake::data_frame(&fake::kv_header(41, g, 1, 3, 2, ITEM), 0x22),
        fake::data_frame(&fake::kv_header(41, g, 0, 3, 1, ITEM), 0x33),
    ];
    for f in &twice {
        fp.data[0].write_all(f).unwrap();
    }
    fp.done(41, g, 2);
    assert_eq!(wait_terminal(&d, 41), State::Failed);
    let why = d.room_failure(41).unwrap();
    assert_eq!(why.cause, Cause::Protocol, "{why}");
    assert!(why.message.contains("already"), "{why}");
    // The repeated bytes never landed: page 3 of buffer 0 holds the first write.
    assert!(dmem[0].page(3).iter().all(|&b| b == 0x11));
    assert!(dmem[0].page(4).iter().all(|&b| b == POISON));
}

/// F8, the conforming case: every page once, over several frames, succeeds.
#[test]
fn every_page_written_once_still_succeeds() {
    let dmem = poisoned();
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let (mut fp, dest) = FakePrefill::serving(&d, 42, &[7, 8, 9], BUFS, PAGES, ITEM, 1);
    let g = dest.generation;
    for (b, first, n) in [(0, 7, 1), (0, 8, 2), (1, 7, 3)] {
        let f = fake::data_frame(&fake::kv_header(42, g, b, first, n, ITEM), 0x44);
        fp.data[0].write_all(&f).unwrap();
    }
    fp.done(42, g, 3);
    assert_eq!(wait_terminal(&d, 42), State::Success);
}

/// F2. A data connection accepted while its decode engine was being lost got a sender
/// thread on an outbox made after the loss had closed the old one: nothing ever closed
/// it, its sender slept forever, and freeing the prefill engine hung joining it. Held
/// open: the accepting thread parks after its check that the peer is not lost, the
/// engine is freed meanwhile (losing the peer), and the thread goes on 200 ms later.
#[test]
fn freeing_the_engine_returns_when_a_data_link_comes_up_while_its_peer_is_lost() {
    const POINT: &str = "accept.link_up";
    let (pmem, dmem) = (common::source(BUFS, PAGES, ITEM), poisoned());
    let p = engine("prefill", &pmem, &[TCP]);
    let d = engine("decode", &dmem, &[TCP, ("connections_per_peer", "1")]);
    let key: u64 = p.address().rsplit(':').next().unwrap().parse().unwrap();
    testing::pause_at(POINT, key);
    d.room_create(51, RoomPeers::Prefills(vec![p.address().to_string()]))
        .unwrap();
    let parked = testing::wait_paused(POINT, key, Duration::from_secs(10));
    let (tx, rx) = mpsc::channel();
    let freeing = std::thread::spawn(move || {
        drop(p);
        tx.send(()).unwrap();
    });
    std::thread::sleep(Duration::from_millis(200));
    testing::release(POINT, key);
    assert!(parked, "the data connection was never accepted");
    let freed = rx.recv_timeout(Duration::from_secs(10)).is_ok();
    if !freed {
        // The engine still runs: its memory must outlive the process's test run.
        std::mem::forget(pmem);
        panic!("freeing the prefill engine hung");
    }
    freeing.join().unwrap();
    assert_eq!(wait_terminal(&d, 51), State::Failed);
}
