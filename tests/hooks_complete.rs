//! The prefill worker claims completion before it sends Done, so a prefill-side abort
//! that races the last chunk leaves both sides agreeing (found by kvxfer-bench's
//! checker). Deterministic through the `worker.before_complete` pause point; needs
//! `--features test-hooks`.
#![cfg(feature = "test-hooks")]

mod common;

use std::time::Duration;

use common::{wait_terminal, Pair, LIMIT};
use kvxfer::testing;
use kvxfer::State;

#[test]
fn an_abort_just_before_the_completion_claim_fails_both_sides() {
    let t = Pair::builder().build();
    let (p, d) = (&t.p, &t.d);

    for (room, abort) in [(1u64, true), (2, false)] {
        t.ready(room, &[room as u32]);
        testing::pause_at("worker.before_complete", room);
        p.enqueue_chunk(room, &[7], true, None).unwrap();
        assert!(testing::wait_paused("worker.before_complete", room, LIMIT));
        if abort {
            p.room_abort(room, "cancelled at the last moment").unwrap();
        }
        testing::release("worker.before_complete", room);
        let (ps, ds) = (wait_terminal(p, room), wait_terminal(d, room));
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
