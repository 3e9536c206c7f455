//! Completion and chunk order on the prefill side. The worker claims completion before
//! it sends Done, so a prefill-side abort that races the last chunk leaves both sides
//! agreeing (found by kvxfer-bench's checker; the abort landing just before the claim,
//! or just after it, is the simulator's: `src/engine/sim/scenarios/`); a room's chunks
//! are planned in order, whoever plans them (who does, chunk after chunk, is the
//! planning core's: `src/engine/prefill/planning/`).

mod common;

use std::time::Duration;

use common::{wait_terminal, Pair};
use kvxfer::State;

/// A prefill-side abort racing the completion claim of a room's last chunk: both sides
/// end FAILED, the decode side told why (the abort came before the claim: no Done went
/// out), or both SUCCESS (the claim came first), and an abort after SUCCESS changes
/// nothing on either side. Which of the two each room shows is left to the threads;
/// the simulator reaches both orders at the room (`Seen::AbortBeforeClaim`,
/// `Seen::AbortAfterClaim`) and catches the reference design's rule in each.
#[test]
fn a_prefill_abort_racing_the_completion_claim_ends_both_sides_alike() {
    let t = Pair::builder().build();
    let (p, d) = (&t.p, &t.d);
    let too_late = |room: u64| {
        p.room_abort(room, "too late").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(p.room_poll(room).unwrap(), State::Success);
        assert_eq!(d.room_poll(room).unwrap(), State::Success);
    };
    for room in 1..=12u64 {
        t.ready(room, &[room as u32]);
        p.enqueue_chunk(room, &[7], true, None).unwrap();
        p.room_abort(room, "cancelled at the last moment").unwrap();
        let (ps, ds) = (wait_terminal(p, room), wait_terminal(d, room));
        assert_eq!(ps, ds, "room {room}: prefill {ps}, decode {ds}");
        if ps == State::Failed {
            let why = d.room_failure(room).unwrap();
            assert!(why.from_peer, "{why}");
            assert!(why.message.contains("last moment"), "{why}");
        } else {
            too_late(room);
        }
    }
    // The claim first, for certain.
    let room = 13;
    t.ready(room, &[room as u32]);
    p.enqueue_chunk(room, &[7], true, None).unwrap();
    assert_eq!(wait_terminal(p, room), State::Success);
    assert_eq!(wait_terminal(d, room), State::Success);
    too_late(room);
}

/// A chunk too large to plan on the caller's thread goes to the room's worker; a small
/// last chunk enqueued right after it goes there too, behind it, not past it.
#[test]
fn a_small_chunk_after_one_left_to_the_worker_is_planned_after_it() {
    let t = Pair::builder().pages(2048).item(256).build();
    let src: Vec<u32> = (0..1001).collect();
    let dst: Vec<u32> = (1000..2001).collect();
    for room in 10..14u64 {
        t.repoison(&dst);
        t.ready(room, &dst);
        // 1,000 pages x 2 buffers: more than a caller plans itself.
        t.p.enqueue_chunk(room, &src[..1000], false, None).unwrap();
        t.p.enqueue_chunk(room, &src[1000..], true, None).unwrap();
        assert_eq!(wait_terminal(&t.p, room), State::Success, "room {room}");
        assert_eq!(wait_terminal(&t.d, room), State::Success, "room {room}");
        t.assert_pages(&src, &dst);
        for e in [&t.p, &t.d] {
            e.room_clear(room).unwrap();
        }
    }
}
