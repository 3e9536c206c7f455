//! The planning hand-off of a simulated prefill room: the library's [`Planning`] under
//! the shell of `src/engine/prefill/sender.rs`, with a chunk planned by its caller at
//! once, by the room's worker a random while later (an event), or by the sender that
//! takes the room's batches down to the reserve; and each chunk's plan, its writes queued
//! for the sender, as `plan_chunk` does.

use std::collections::VecDeque;

use super::{check, fail, transit, PRoom};
use crate::engine::prefill::planning::{self, HandOn, Next, Planning, QUEUED_RESERVE};
use crate::engine::prefill::Chunk;
use crate::engine::sim::{Ev, Rng, World, TRANSFER_US};
use crate::room::{Cause, Event};

/// A room's planning hand-off as the simulator runs it: the library's core, and what the
/// shell and the checks keep around it.
#[derive(Default)]
pub(crate) struct HandOff {
    /// Calls admitted before the room was ready (layers of one chunk joined), handed on
    /// once it is (the engine's `held`).
    pub(super) held: VecDeque<Chunk>,
    /// The library's core: who plans, what waits, the batches queued.
    pub(super) planning: Planning,
    /// The room was handed to its worker, which has not started yet.
    pub(super) worker_due: bool,
    /// Calls handed on and not planned yet, as the host made them (what
    /// `check::in_order` compares each chunk planned with).
    handed: VecDeque<Chunk>,
}

impl PRoom {
    /// Whether `chunk`, planned now, is the calls handed on first, joined as they waited,
    /// each planned once (taking them off the record).
    pub fn plans_in_order(&mut self, chunk: &Chunk) -> bool {
        planning::plans_next(&mut self.hand_off.handed, chunk)
    }

    /// The room was handed to its worker, which has not started: no other thread may
    /// plan it (in the engine the worker may start at any moment).
    pub fn worker_due(&self) -> bool {
        self.hand_off.worker_due
    }

    /// Calls wait to be planned with no one to plan them: no worker is due, and no sender
    /// has the room's batches to take down to the reserve (a caller or a sender plans
    /// only within a step).
    pub fn stranded(&self) -> bool {
        let p = &self.hand_off.planning;
        let senders = !p.is_busy() && p.queued() > QUEUED_RESERVE && self.stepping;
        p.waits() && !self.hand_off.worker_due && !senders
    }
}

/// Who plans in the simulator. Its draws stand in for the engine's rule
/// (`PrefillEngine::plans`: a chunk's size, the workers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Planner {
    Caller,
    Sender,
    Worker,
}

impl Planner {
    /// Whether it plans a chunk itself rather than the room's worker: a worker always, a
    /// caller three times in four (else the chunk is too large for it), a sender nine
    /// in ten (else the workers stop, say).
    pub(super) fn plans(self, rng: &mut Rng) -> bool {
        match self {
            Planner::Worker => true,
            Planner::Caller => !rng.chance(25),
            Planner::Sender => !rng.chance(10),
        }
    }
}

/// The room became ready: the calls held for it are handed on in order, and the one its
/// caller is to plan is planned once all are (as `attach` does, once it holds no lock).
pub(super) fn hand_on_held(w: &mut World, p: usize, id: u64) {
    let mut here = Vec::new();
    while let Some(chunk) = w.prefills[p]
        .rooms
        .get_mut(&id)
        .and_then(|r| r.hand_off.held.pop_front())
    {
        here.extend(hand_on(w, p, id, chunk));
    }
    for chunk in here {
        plan_waiting(w, p, id, Planner::Caller, chunk);
    }
}

/// Hands a call of a ready room on, as `PrefillEngine::hand_on` does: the chunk its
/// caller is to plan, if it is the caller's.
pub(super) fn hand_on(w: &mut World, p: usize, id: u64, chunk: Chunk) -> Option<Chunk> {
    let rng = &mut w.rng;
    let room = w.prefills[p].rooms.get_mut(&id).expect("a ready room");
    room.hand_off.handed.push_back(chunk.clone());
    let at = chunk.start;
    match room
        .hand_off
        .planning
        .hand_on(chunk, |_| Planner::Caller.plans(rng))
    {
        HandOn::Here(chunk) => Some(chunk),
        HandOn::ToWorker => {
            to_worker(w, p, id);
            None
        }
        HandOn::Joined => {
            w.note(|| format!("p{p} room {id}: the call at {at} waits"));
            None
        }
    }
}

/// Hands room `id` to its worker, which starts a while later.
pub(super) fn to_worker(w: &mut World, p: usize, id: u64) {
    let room = w.prefills[p].rooms.get_mut(&id).expect("a room to hand on");
    room.hand_off.worker_due = true;
    let rgen = room.rgen;
    let after = w.rng.range(20, 500);
    w.note(|| format!("p{p} hands room {id} to its worker"));
    w.at(after, Ev::Worker { p, id, rgen });
}

/// Prefill `p`'s worker starts on room `id` (use `rgen`), handed to it.
pub(crate) fn worker(w: &mut World, p: usize, id: u64, rgen: u64) {
    let Some(room) = w.prefills[p].rooms.get_mut(&id).filter(|r| r.rgen == rgen) else {
        return;
    };
    room.hand_off.worker_due = false;
    if let Some(chunk) = room.hand_off.planning.worker_starts() {
        plan_waiting(w, p, id, Planner::Worker, chunk);
    }
}

/// Plans `chunk`, then each chunk that may go after it, as `PrefillEngine::plan_waiting`
/// does; what `planner` may not plan goes to the room's worker.
pub(super) fn plan_waiting(w: &mut World, p: usize, id: u64, planner: Planner, mut chunk: Chunk) {
    loop {
        check::in_order(w, p, id, &chunk, planner == Planner::Worker);
        plan(w, p, id, &chunk);
        let rng = &mut w.rng;
        let room = w.prefills[p].rooms.get_mut(&id).expect("a planned room");
        match room.hand_off.planning.next(|_| planner.plans(rng)) {
            Next::Plan(next) => chunk = next,
            Next::Worker => return to_worker(w, p, id),
            Next::Idle => return,
        }
    }
}

/// Plans one chunk, as `plan_chunk` does: it must fit every destination (and the last
/// one fill it); each write of its positions of every destination's pages, in its kv
/// buffers, is a batch queued for the sender.
fn plan(w: &mut World, p: usize, id: u64, chunk: &Chunk) {
    if !transit(w, p, id, Event::Start) {
        return;
    }
    let rdma = w.net.rdma;
    let room = w.prefills[p].rooms.get_mut(&id).expect("started room");
    let layers = w.requests[room.req].layers;
    room.deadline = w.now + TRANSFER_US;
    let (start, n) = (chunk.start, chunk.pages.len());
    let total = chunk.total.unwrap_or(start + n);
    let bad = room.ledger.dests().iter().find(|d| {
        let len = d.pages.len();
        start + n > len || (chunk.is_last && total != len)
    });
    if let Some(dest) = bad {
        let why = format!(
            "room {id}: the chunks do not fit the destination of {} pages from d{}",
            dest.pages.len(),
            dest.peer.node
        );
        return fail(w, p, id, (Cause::Mismatch, why), None);
    }
    let sent = |b: u32| chunk.buffers.as_ref().is_none_or(|m| m[b as usize]);
    let buffers: Vec<u32> = (0..layers).filter(|&b| sent(b)).collect();
    let before = room.todo.len();
    for dest in room.ledger.dests() {
        for &page in &dest.pages[start..start + n] {
            for &b in &buffers {
                room.todo.push_back((dest.peer, dest.generation, page, b));
            }
        }
    }
    // Each write a batch; with the last call, the Dones.
    let last = chunk.is_last.then(|| {
        let dests = room.ledger.dests().iter();
        dests
            .map(|d| (d.peer, d.generation, d.pages.len() as u32))
            .collect()
    });
    let batches = room.todo.len() - before;
    room.completion.planned(batches, last);
    room.hand_off.planning.planned(batches);
    // Now and then over TCP (whose receiver checks each run; over RDMA without
    // integrity a wrong write is the sender's to prevent), a faulty sender: a page is
    // written in place of the last one of the last chunk.
    let n = room.todo.len();
    if !rdma && chunk.is_last && n >= 2 && w.rng.chance(3) {
        let first = room.todo[0];
        room.todo[n - 1] = first;
    }
    if !room.stepping && !room.todo.is_empty() {
        room.stepping = true;
        let rgen = room.rgen;
        let after = w.rng.range(20, 300);
        w.at(after, Ev::SendStep { p, id, rgen });
    }
}
