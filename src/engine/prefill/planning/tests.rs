//! The hand-off's orders, one by one, then every interleaving of callers, planners,
//! workers and senders that proptest draws.

use std::collections::VecDeque;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

/// The one-page chunk at position `start`, whole.
fn whole(start: usize) -> Chunk {
    Chunk {
        pages: vec![start as u32],
        is_last: false,
        aux: None,
        start,
        buffers: None,
        total: None,
    }
}

/// Layer `l` (of two kv buffers) of the one-page chunk at `start`.
fn layer(start: usize, l: usize) -> Chunk {
    let mask: Arc<[bool]> = (0..2).map(|b| b == l).collect();
    Chunk {
        buffers: Some(mask),
        ..whole(start)
    }
}

/// `c`, as the call that closes the room.
fn last(c: Chunk) -> Chunk {
    Chunk {
        is_last: true,
        total: Some(c.start + 1),
        ..c
    }
}

/// For a `plans` that must not be asked: the chunk waits whatever the answer.
fn never(_: &Chunk) -> bool {
    unreachable!("asked who plans a chunk that waits")
}

#[test]
fn a_chunk_handed_on_while_nothing_waits_is_the_callers_if_it_may_plan_it_else_the_workers() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| true), HandOn::Here(whole(0)));
    assert!(p.is_busy());
    assert_eq!(p.next(never), Next::Idle);
    assert!(!p.is_busy());
    assert_eq!(p.hand_on(whole(1), |_| false), HandOn::ToWorker);
    assert!(p.is_busy() && p.waits());
    assert_eq!(p.worker_starts(), Some(whole(1)));
    assert_eq!(p.next(never), Next::Idle);
    assert!(!p.is_busy() && !p.waits());
}

/// No live engine is held in this order any more (the `prefill.plan_here` pause point
/// and its test in tests/hooks_complete.rs went, issue 37): this test and the
/// simulator's `InOrder` (bug `HandOnPastWaiting`) pin it.
#[test]
fn a_chunk_enqueued_while_the_caller_plans_the_one_before_waits_for_it() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| true), HandOn::Here(whole(0)));
    assert_eq!(p.hand_on(last(whole(1)), never), HandOn::Joined);
    // The caller that planned the first goes on with it.
    assert_eq!(p.next(|_| true), Next::Plan(last(whole(1))));
    assert_eq!(p.next(never), Next::Idle);
    assert!(!p.is_busy() && !p.waits());
}

/// tests/hooks_complete.rs pins it on a live engine (a chunk of 2,000 runs, then one).
#[test]
fn a_small_chunk_after_one_left_to_the_worker_is_planned_after_it() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| false), HandOn::ToWorker);
    // Small enough for its caller, but the worker has the room.
    assert_eq!(p.hand_on(last(whole(1)), never), HandOn::Joined);
    assert_eq!(p.worker_starts(), Some(whole(0)));
    assert_eq!(p.next(|_| true), Next::Plan(last(whole(1))));
    assert_eq!(p.next(never), Next::Idle);
}

#[test]
fn a_chunk_its_planner_may_not_plan_goes_to_the_worker_with_what_waits_behind_it() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| true), HandOn::Here(whole(0)));
    assert_eq!(p.hand_on(whole(1), never), HandOn::Joined);
    assert_eq!(p.hand_on(whole(2), never), HandOn::Joined);
    assert_eq!(p.next(|c| c.start != 1), Next::Worker);
    // The room stays held until the worker starts: nothing goes past.
    assert!(p.is_busy());
    assert_eq!(p.hand_on(whole(3), never), HandOn::Joined);
    assert_eq!(p.worker_starts(), Some(whole(1)));
    for c in 2..4 {
        assert_eq!(p.next(|_| true), Next::Plan(whole(c)));
    }
    assert_eq!(p.next(never), Next::Idle);
}

#[test]
fn layer_calls_wait_while_more_than_the_reserve_is_queued_join_and_go_with_the_sender() {
    let mut p = Planning::default();
    p.planned(QUEUED_RESERVE + 2);
    assert_eq!(p.hand_on(layer(0, 0), never), HandOn::Joined);
    assert!(!p.is_busy(), "no one holds the room: the senders will");
    assert_eq!(p.hand_on(layer(0, 1), never), HandOn::Joined);
    // A whole chunk goes behind the layers that wait, whatever is queued.
    assert_eq!(p.hand_on(last(whole(1)), never), HandOn::Joined);
    assert_eq!(p.taken(never), Next::Idle);
    let both = Chunk {
        buffers: Some(Arc::from([true, true])),
        ..whole(0)
    };
    assert_eq!(p.taken(|_| true), Next::Plan(both));
    assert_eq!(p.queued(), QUEUED_RESERVE);
    // The sender queues the layers' batches; the whole chunk goes after them at once.
    p.planned(2);
    assert_eq!(p.next(|_| true), Next::Plan(last(whole(1))));
    assert_eq!(p.next(never), Next::Idle);
    assert!(!p.is_busy() && !p.waits());
}

#[test]
fn a_layer_call_goes_at_once_while_no_more_than_the_reserve_is_queued() {
    let mut p = Planning::default();
    p.planned(QUEUED_RESERVE);
    assert_eq!(p.hand_on(layer(0, 0), |_| true), HandOn::Here(layer(0, 0)));
}

#[test]
fn a_planner_leaves_a_layer_call_behind_queued_batches_to_the_sender_that_takes_them() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| true), HandOn::Here(whole(0)));
    assert_eq!(p.hand_on(layer(1, 0), never), HandOn::Joined);
    p.planned(3);
    // The layer waits behind the first chunk's batches: the caller lets the room go.
    assert_eq!(p.next(never), Next::Idle);
    assert!(!p.is_busy() && p.waits());
    assert_eq!(p.taken(never), Next::Idle);
    assert_eq!(p.taken(|_| true), Next::Plan(layer(1, 0)));
    // The next layer comes while the sender plans, and waits behind its batch.
    assert_eq!(p.hand_on(layer(1, 1), never), HandOn::Joined);
    p.planned(1);
    assert_eq!(p.next(never), Next::Idle);
    assert_eq!(p.taken(|_| true), Next::Plan(layer(1, 1)));
}

#[test]
fn a_sender_plans_nothing_while_another_thread_holds_the_room() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| true), HandOn::Here(whole(0)));
    p.planned(2);
    assert_eq!(p.hand_on(layer(1, 0), never), HandOn::Joined);
    // Down to the reserve, but the caller still holds the room: it goes on with it.
    assert_eq!(p.taken(never), Next::Idle);
    assert_eq!(p.next(|_| true), Next::Plan(layer(1, 0)));
}

#[test]
fn a_sender_leaves_to_the_worker_what_it_may_not_plan_and_later_layers_join_it() {
    let mut p = Planning::default();
    p.planned(QUEUED_RESERVE + 1);
    assert_eq!(p.hand_on(layer(0, 0), never), HandOn::Joined);
    assert_eq!(p.taken(|_| false), Next::Worker);
    assert!(p.is_busy());
    assert_eq!(p.hand_on(last(layer(0, 1)), never), HandOn::Joined);
    let both = Chunk {
        buffers: Some(Arc::from([true, true])),
        ..last(whole(0))
    };
    assert_eq!(p.worker_starts(), Some(both));
    assert_eq!(p.next(never), Next::Idle);
}

#[test]
fn a_worker_that_finds_nothing_lets_the_room_go() {
    let mut p = Planning::default();
    assert_eq!(p.hand_on(whole(0), |_| false), HandOn::ToWorker);
    assert_eq!(p.worker_starts(), Some(whole(0)));
    assert_eq!(p.next(never), Next::Idle);
    assert_eq!(p.worker_starts(), None);
    assert!(!p.is_busy());
    assert_eq!(p.hand_on(whole(1), |_| true), HandOn::Here(whole(1)));
}

#[test]
fn a_batch_dropped_from_its_outbox_leaves_the_queue() {
    let mut p = Planning::default();
    p.planned(QUEUED_RESERVE + 1);
    p.dropped();
    assert_eq!(p.hand_on(layer(0, 0), |_| true), HandOn::Here(layer(0, 0)));
}

#[test]
fn plans_next_takes_the_calls_a_chunk_plans_and_refuses_one_out_of_order() {
    let calls = [layer(0, 0), layer(0, 1), last(whole(1))];
    let mut handed: VecDeque<Chunk> = calls.iter().cloned().collect();
    let both = Chunk {
        buffers: Some(Arc::from([true, true])),
        ..whole(0)
    };
    assert!(plans_next(&mut handed, &both));
    assert!(plans_next(&mut handed, &last(whole(1))));
    assert!(handed.is_empty());
    let mut handed: VecDeque<Chunk> = calls.iter().cloned().collect();
    assert!(!plans_next(&mut handed, &last(whole(1))), "past the layers");
    let mut handed: VecDeque<Chunk> = calls.into_iter().collect();
    assert!(plans_next(&mut handed, &layer(0, 0)));
    assert!(!plans_next(&mut handed, &layer(0, 0)), "twice");
}

/// One step of an interleaving (each skipped when it cannot happen).
#[derive(Debug, Clone)]
enum Step {
    /// The scheduler (or a control reader) hands the next call on; whether the caller
    /// may plan it.
    HandOn(bool),
    /// The thread that plans a chunk queues its batches.
    Queue(usize),
    /// That thread asks what next; whether it may plan the next chunk.
    Ask(bool),
    /// A worker the room was handed to starts.
    Worker,
    /// A sender takes one of the room's batches; whether it may plan.
    Take(bool),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<bool>().prop_map(Step::HandOn),
        (0..4usize).prop_map(Step::Queue),
        any::<bool>().prop_map(Step::Ask),
        Just(Step::Worker),
        any::<bool>().prop_map(Step::Take),
    ]
}

/// The threads around one room's hand-off, as the engine runs them.
#[derive(Default)]
struct Threads {
    p: Planning,
    /// The calls still to hand on.
    calls: VecDeque<Chunk>,
    /// The calls handed on and not planned.
    handed: VecDeque<Chunk>,
    /// The thread that plans: whether it is a worker, and the chunk it plans (none once
    /// its batches are queued and it is about to ask what next).
    planner: Option<(bool, Option<Chunk>)>,
    /// Workers the room was handed to that have not started.
    workers: usize,
    /// Batches in the outboxes.
    queued: usize,
}

impl Threads {
    /// Runs `s`; whether it could happen.
    fn run(&mut self, s: &Step) -> bool {
        match *s {
            Step::HandOn(may) => {
                let Some(c) = self.calls.pop_front() else {
                    return false;
                };
                self.handed.push_back(c.clone());
                match self.p.hand_on(c, |_| may) {
                    HandOn::Here(c) => self.plans(false, c),
                    HandOn::ToWorker => self.workers += 1,
                    HandOn::Joined => {}
                }
            }
            Step::Queue(n) => {
                let Some((_, chunk @ Some(_))) = &mut self.planner else {
                    return false;
                };
                *chunk = None;
                self.p.planned(n);
                self.queued += n;
            }
            Step::Ask(may) => {
                let Some((worker, None)) = self.planner else {
                    return false;
                };
                self.planner = None;
                let next = self.p.next(|_| worker || may);
                self.then(worker, next);
            }
            Step::Worker => {
                if self.workers == 0 {
                    return false;
                }
                self.workers -= 1;
                if let Some(c) = self.p.worker_starts() {
                    self.plans(true, c);
                }
            }
            Step::Take(may) => {
                if self.queued == 0 {
                    return false;
                }
                self.queued -= 1;
                let next = self.p.taken(|_| may);
                self.then(false, next);
            }
        }
        self.check();
        true
    }

    fn then(&mut self, worker: bool, next: Next) {
        match next {
            Next::Plan(c) => self.plans(worker, c),
            Next::Worker => self.workers += 1,
            Next::Idle => {}
        }
    }

    /// A thread (a worker or not) is told to plan `c`.
    fn plans(&mut self, worker: bool, c: Chunk) {
        assert!(self.planner.is_none(), "two threads plan the room");
        assert!(
            c.buffers.is_none() || self.p.queued() <= QUEUED_RESERVE,
            "a layer call planned with {} batches queued",
            self.p.queued()
        );
        assert!(plans_next(&mut self.handed, &c), "{c:?} out of order");
        self.planner = Some((worker, Some(c)));
    }

    /// The room is held exactly while a thread plans or a worker is due, and what waits
    /// has someone to plan it.
    fn check(&self) {
        let held = self.planner.is_some() || self.workers > 0;
        assert_eq!(self.p.is_busy(), held);
        let senders = !held && self.queued > QUEUED_RESERVE;
        assert!(!self.p.waits() || held || senders, "a chunk is stranded");
        assert_eq!(self.p.queued(), self.queued);
    }
}

proptest! {
    /// Whatever the interleaving, each call is planned once, in order, by one thread at
    /// a time (a layer call only while no more than the reserve is queued), and nothing
    /// waits with no one to plan it; once every thread is done, nothing waits.
    #[test]
    fn every_interleaving_plans_each_call_once_in_order_and_strands_nothing(
        layered in prop::collection::vec(any::<bool>(), 1..5),
        steps in prop::collection::vec(step(), 0..80),
    ) {
        let mut t = Threads::default();
        for (k, &l) in layered.iter().enumerate() {
            match l {
                true => t.calls.extend([layer(k, 0), layer(k, 1)]),
                false => t.calls.push_back(whole(k)),
            }
        }
        let c = t.calls.pop_back().expect("a call");
        t.calls.push_back(Chunk { is_last: true, total: Some(layered.len()), ..c });
        for s in &steps {
            t.run(s);
        }
        // Then every thread goes on until none can.
        let rest = [Step::HandOn(true), Step::Queue(1), Step::Ask(true), Step::Worker, Step::Take(true)];
        while rest.iter().any(|s| t.run(s)) {}
        prop_assert!(t.handed.is_empty() && t.calls.is_empty(), "calls left: {:?}", t.handed);
        prop_assert!(!t.p.is_busy() && !t.p.waits());
    }
}
