//! Who plans a prefill room's chunks, and when (issue 37): the hand-off between the
//! thread that enqueues a chunk, the room's worker and the senders. Pure (no lock, no
//! clock read, no I/O): the engine asks it under the room's lock and acts once it holds
//! none (`sender.rs`), and the simulator drives it too (`src/engine/sim/`).
//!
//! What it keeps:
//! - a room's chunks are planned in the order they were handed on, each once, by one
//!   planner at a time: the thread that hands a chunk on while nothing of the room waits
//!   (if it may plan that chunk, [`HandOn::Here`]), else the room's worker; a planner
//!   goes on with what came meanwhile ([`Planning::next`]);
//! - a layer call also waits while more than [`QUEUED_RESERVE`] of the room's batches
//!   are queued for a sender, and the layers that come meanwhile join it
//!   ([`layers::join`]): the sender that takes the room's batches down to the reserve
//!   plans them ([`Planning::taken`]), so a link that falls behind the compute gets whole
//!   batches, not one small job per layer;
//! - nothing waits with no one to plan it: a planner, the worker it was handed to, or a
//!   sender with the room's batches to take.
//!
//! Who may plan what depends on the engine (the chunk's size, its workers): each call
//! takes that answer as `plans`, asked only when it matters.

#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use super::{layers, Chunk};
use crate::engine::bugs::{self, Bug};

/// How many of a room's batches may stay queued while its waiting layers are planned: a
/// layer call waits while more are queued, and the sender that takes the batch that
/// leaves this many plans the layers that waited. One batch stays queued, for another
/// link to take while that sender plans.
pub(crate) const QUEUED_RESERVE: usize = 1;

/// A prefill room's planning hand-off.
#[derive(Debug, Default)]
pub(crate) struct Planning {
    /// A planner holds the room: a thread told to plan ([`HandOn::Here`], [`Next::Plan`])
    /// until it is told [`Next::Idle`], or the worker the room was handed to
    /// ([`HandOn::ToWorker`], [`Next::Worker`]). Chunks that come meanwhile wait.
    busy: bool,
    /// Chunks handed on and not planned yet, in order; the layers of one chunk join
    /// while they wait ([`layers::join`]).
    waiting: VecDeque<Chunk>,
    /// Batches planned and not yet taken by a sender (nor dropped), every destination.
    queued: usize,
}

/// What becomes of a chunk handed on ([`Planning::hand_on`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HandOn {
    /// It waits (joined to the layer call of its chunk that waits last, if any): behind
    /// the room's earlier chunks, or, a layer call, behind the room's queued batches.
    Joined,
    /// The caller plans it, then asks [`Planning::next`].
    Here(Chunk),
    /// The room's worker plans it: hand the room to the worker.
    ToWorker,
}

/// What a planner does next ([`Planning::next`], [`Planning::taken`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Plan this chunk, then ask [`Planning::next`].
    Plan(Chunk),
    /// Hand the room to its worker, which plans what waits; this thread is done.
    Worker,
    /// Nothing to plan now; this thread is done.
    Idle,
}

impl Planning {
    /// A chunk of a ready room is handed on. It waits while the room's earlier chunks
    /// are planned or wait, and a layer call also while more than [`QUEUED_RESERVE`]
    /// batches are queued. Otherwise its caller plans it if `plans` says it may (asked
    /// only then), else the worker does.
    pub fn hand_on(&mut self, chunk: Chunk, plans: impl FnOnce(&Chunk) -> bool) -> HandOn {
        let behind_chunks = self.busy || !self.waiting.is_empty();
        // Put back: only queued batches hold a call back.
        let behind_chunks = behind_chunks && !bugs::on(Bug::HandOnPastWaiting);
        if behind_chunks || self.behind_batches(&chunk) {
            layers::join(&mut self.waiting, chunk);
            return HandOn::Joined;
        }
        self.busy = true;
        if plans(&chunk) {
            return HandOn::Here(chunk);
        }
        self.waiting.push_back(chunk);
        HandOn::ToWorker
    }

    /// The planner queued `batches` more of the room's batches for its senders.
    pub fn planned(&mut self, batches: usize) {
        self.queued += batches;
    }

    /// One of the room's queued batches was dropped, never taken (its engine was lost).
    pub fn dropped(&mut self) {
        self.queued -= 1;
    }

    /// The planner planned its chunk: the next chunk that waits, if it may go now (a
    /// whole chunk at once, a layer call once the room's queued batches are down to the
    /// reserve, else the sender that takes them there plans it), is this planner's if
    /// `plans` says so (asked only then; a worker plans every chunk), else the worker's.
    pub fn next(&mut self, plans: impl FnOnce(&Chunk) -> bool) -> Next {
        let next = match self.waiting.front() {
            Some(c) if !self.behind_batches(c) => self.waiting.pop_front(),
            _ => None,
        };
        let Some(chunk) = next else {
            self.busy = false;
            return Next::Idle;
        };
        if plans(&chunk) {
            return Next::Plan(chunk);
        }
        self.waiting.push_front(chunk);
        Next::Worker
    }

    /// The worker the room was handed to starts: the chunk to plan first (then it asks
    /// [`Planning::next`]), or none, and the room is let go.
    pub fn worker_starts(&mut self) -> Option<Chunk> {
        let first = self.waiting.pop_front();
        if first.is_none() {
            self.busy = false;
        }
        first
    }

    /// A sender took one of the room's queued batches. Once they are down to the reserve
    /// and no one plans, the chunk that waits (layers that waited behind the batches) is
    /// this sender's to plan if `plans` says so (asked only then), else the worker's;
    /// the sender plans it before it writes the batch it took, so that the room's next
    /// batches are queued while it writes.
    pub fn taken(&mut self, plans: impl FnOnce(&Chunk) -> bool) -> Next {
        self.queued -= 1;
        if self.queued > QUEUED_RESERVE || self.busy {
            return Next::Idle;
        }
        let Some(chunk) = self.waiting.pop_front() else {
            return Next::Idle;
        };
        self.busy = true;
        if plans(&chunk) {
            return Next::Plan(chunk);
        }
        self.waiting.push_front(chunk);
        Next::Worker
    }

    /// A layer call waits behind the room's queued batches.
    fn behind_batches(&self, chunk: &Chunk) -> bool {
        chunk.buffers.is_some() && self.queued > QUEUED_RESERVE
    }

    /// A planner holds the room (the simulator's checks).
    #[cfg(test)]
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// Chunks wait to be planned (the simulator's checks).
    #[cfg(test)]
    pub fn waits(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Batches planned and not taken (the simulator's checks).
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        self.queued
    }
}

/// Takes off the front of `handed` (calls handed on and not planned, in order) the calls
/// that `chunk` plans: whether `chunk` is the calls at the front, joined as they waited
/// ([`layers::join`]). False when it is not: planned out of order, or twice (the order
/// checks of the tests and of the simulator).
#[cfg(test)]
pub(crate) fn plans_next(handed: &mut VecDeque<Chunk>, chunk: &Chunk) -> bool {
    let mut joined = VecDeque::new();
    while let Some(call) = handed.pop_front() {
        layers::join(&mut joined, call);
        if joined.len() > 1 {
            return false;
        }
        if joined[0] == *chunk {
            return true;
        }
    }
    false
}
