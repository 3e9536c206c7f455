//! The prefill worker claims completion before it sends Done, so a prefill-side abort
//! that races the last chunk leaves both sides agreeing (found by kvxfer-bench's
//! checker). Deterministic through the `worker.before_complete` pause point; needs
//! `--features test-hooks`.
#![cfg(feature = "test-hooks")]

mod common;

use std::time::Duration;

use common::{engine, wait_state, wait_terminal, ITEM, PAGES};
use kvxfer::testing;
use kvxfer::{RoomPeers, State};

#[test]
fn an_abort_just_before_the_completion_claim_fails_both_sides() {
    let mut pmem: Vec<Vec<u8>> = (0..2).map(|_| vec![1u8; PAGES * ITEM]).collect();
    let mut dmem: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; PAGES * ITEM]).collect();
    let p = engine("prefill", &mut pmem, &[]);
    let d = engine("decode", &mut dmem, &[]);
    let limit = Duration::from_secs(20);

    for (room, abort) in [(1u64, true), (2, false)] {
        p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        d.room_create(room, RoomPeers::Prefills(vec![p.address().to_string()]))
            .unwrap();
        d.room_set_destination(room, &[room as u32], None).unwrap();
        wait_state(&p, room, State::WaitingForInput);
        testing::pause_at("worker.before_complete", room);
        p.enqueue_chunk(room, &[7], true, None).unwrap();
        assert!(testing::wait_paused("worker.before_complete", room, limit));
        if abort {
            p.room_abort(room, "cancelled at the last moment").unwrap();
        }
        testing::release("worker.before_complete", room);
        let (ps, ds) = (
            wait_terminal(&p, room, limit),
            wait_terminal(&d, room, limit),
        );
        if abort {
            assert_eq!((ps, ds), (State::Failed, State::Failed));
            assert!(d
                .room_failure(room)
                .unwrap()
                .message
                .contains("last moment"));
        } else {
            assert_eq!((ps, ds), (State::Success, State::Success));
            // An abort after the claim changes nothing on either side.
            p.room_abort(room, "too late").unwrap();
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(p.room_poll(room).unwrap(), State::Success);
            assert_eq!(d.room_poll(room).unwrap(), State::Success);
        }
    }
}
