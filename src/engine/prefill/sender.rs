//! The prefill's data path. One thread at a time plans a room's chunks, in order: the
//! thread that hands on a small chunk while nothing of its room waits (the scheduler's
//! enqueue, or the control reader when the destination makes the room ready), a sender
//! that took the room's queued batches down to the reserve (layer calls wait behind
//! them), or the worker the room is hashed to for the others. Who, and when, is the
//! room's [`Planning`](super::planning) to decide; this is its shell, which asks it
//! under the room's lock and acts once it holds none. Each chunk becomes its data frames
//! for each destination ([`plan`]), in batches queued in the destination engine's
//! outbox; a sender thread per link of that engine writes them (`send.rs`).

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use super::outbox::{Batch, Item, Outbox, Ticket};
use super::plan::{batches, plan, Grouped, Place};
use super::planning::{HandOn, Next};
use super::{ext, Chunk, Job, PRoom, PrefillEngine, PrefillRoom};
use crate::control::Peer;
use crate::engine::lifecycle;
use crate::proto::{Message, Target};
use crate::room::{Cause, FailureReason, Refusal};
use crate::slice;

/// The most runs (source pages x kv buffers sent x destinations) of a chunk that the
/// thread handing it on plans itself, rather than a worker: a plan this small takes
/// microseconds, less than waking a worker on the room's critical path (a wakeup is a
/// switch of core, and on a virtual machine a round trip through the host).
const PLAN_HERE_RUNS: usize = 1024;

/// What became of a chunk handed on ([`PrefillEngine::hand_on`]).
pub(super) enum Handed {
    /// Waiting behind the room's earlier chunks or queued batches, or handed to the
    /// room's worker (false: the engine is shutting down, the caller fails the room).
    Queued(bool),
    /// The caller plans it, once it holds no lock of the room ([`PrefillEngine::plan_here`]).
    Here(Job),
}

/// The thread that plans a room's chunks: the one that handed a chunk on (the
/// scheduler's enqueue, a control reader; small chunks only, [`PLAN_HERE_RUNS`]), a
/// sender that took one of the room's batches, or the room's worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planner {
    Caller,
    Sender,
    Worker,
}

impl PrefillEngine {
    /// Hands on the next chunk of a ready room, in order (under the room's lock `p`): it
    /// waits behind the room's earlier chunks (and a layer call behind its queued
    /// batches), or is the caller's to plan ([`Handed::Here`]) if small, or goes to the
    /// room's worker (`Planning::hand_on`).
    pub(super) fn hand_on(&self, p: &mut PrefillRoom, job: Job) -> Handed {
        let dests = p.ledger.dests().len();
        let here = |c: &Chunk| self.plans(Planner::Caller, dests, c);
        match p.planning.hand_on(job.chunk, here) {
            HandOn::Joined => Handed::Queued(true),
            HandOn::Here(chunk) => Handed::Here(Job {
                room: job.room,
                chunk,
            }),
            HandOn::ToWorker => Handed::Queued(self.dispatch(&job.room)),
        }
    }

    /// Whether `planner` plans `chunk` (with `dests` destinations) itself rather than
    /// the room's worker: a worker plans any chunk; a sender any that is not empty (a
    /// plan takes microseconds per thousand page runs, less than the worker's wakeup on
    /// the room's path, and the sender was about to write one of the room's batches
    /// anyway); a caller only a small one (it is the scheduler's thread). None but a
    /// worker plans while the workers stop.
    fn plans(&self, planner: Planner, dests: usize, chunk: &Chunk) -> bool {
        if planner == Planner::Worker {
            return true;
        }
        let buffers = match &chunk.buffers {
            Some(b) => b.iter().filter(|on| **on).count(),
            None => self
                .core
                .node
                .memory
                .kv
                .get()
                .map_or(0, |m| m.buffers().len()),
        };
        // An empty chunk stays with the worker: there is nothing to plan, and it only
        // completes the room.
        let runs = chunk.pages.len() * buffers * dests;
        let most = match planner {
            Planner::Caller => PLAN_HERE_RUNS,
            _ => usize::MAX,
        };
        (1..=most).contains(&runs) && !self.workers.read().is_empty()
    }

    /// Plans a chunk [`PrefillEngine::hand_on`] gave the caller, then the chunks that
    /// came meanwhile ([`PrefillEngine::plan_waiting`]).
    pub(super) fn plan_here(&self, job: Job) {
        self.plan_waiting(Planner::Caller, &job.room, job.chunk);
    }

    /// A worker thread: plans the waiting chunks of the rooms handed to it, until the
    /// engine stops.
    pub(super) fn worker(&self, _index: usize, rooms: mpsc::Receiver<Arc<PRoom>>) {
        for room in rooms {
            let first = ext(&room).lock().planning.worker_starts();
            if let Some(chunk) = first {
                self.plan_waiting(Planner::Worker, &room, chunk);
            }
        }
    }

    /// Plans `chunk` of `room` (`planner` is the room's planner), then each chunk that
    /// may go after it (`Planning::next`); what it may not plan goes to the room's
    /// worker.
    fn plan_waiting(&self, planner: Planner, room: &Arc<PRoom>, mut chunk: Chunk) {
        loop {
            self.plan_job(room, &chunk);
            let next = {
                let mut p = ext(room).lock();
                let dests = p.ledger.dests().len();
                p.planning.next(|c| self.plans(planner, dests, c))
            };
            match next {
                Next::Plan(next) => chunk = next,
                Next::Worker => return self.to_worker(room),
                Next::Idle => return,
            }
        }
    }

    /// A sender took one of `room`'s batches: once they are down to the reserve, the
    /// layers that waited are planned, on this thread (before it writes the batch it
    /// took, so that the room's next batches are queued while it does; `Planning::taken`).
    pub(super) fn taken(&self, room: &Arc<PRoom>) {
        let next = {
            let mut p = ext(room).lock();
            let dests = p.ledger.dests().len();
            p.planning.taken(|c| self.plans(Planner::Sender, dests, c))
        };
        match next {
            Next::Plan(chunk) => self.plan_waiting(Planner::Sender, room, chunk),
            Next::Worker => self.to_worker(room),
            Next::Idle => {}
        }
    }

    /// Hands `room` to its worker, or fails it if the engine is shutting down.
    fn to_worker(&self, room: &Arc<PRoom>) {
        if !self.dispatch(room) {
            self.fail_undispatched(room);
        }
    }

    /// Plans `chunk` of `room`; a failure, or a panic, fails the room with the reason.
    fn plan_job(&self, room: &Arc<PRoom>, chunk: &Chunk) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.plan_chunk(room, chunk)
        }));
        let failure = match r {
            Ok(Ok(())) => None,
            Ok(Err(reason)) => Some(reason),
            Err(_) => Some(FailureReason::local(
                Cause::Internal,
                format!(
                    "internal error (panic) while planning a chunk of room {}",
                    room.id()
                ),
            )),
        };
        if let Some(reason) = failure {
            lifecycle::fail(self, room, reason, None);
        }
    }

    /// Plans one chunk for every destination and queues its batches in the destinations'
    /// outboxes; for the last chunk, the Done frames too. Returns the reason to fail the
    /// room with, if any.
    fn plan_chunk(&self, room: &Arc<PRoom>, chunk: &Chunk) -> Result<(), FailureReason> {
        if room.state().is_terminal() {
            // Skipped: the room is already terminal (aborted, failed or done).
            return Ok(());
        }
        let dests = ext(room).lock().ledger.dests().to_vec();
        let (start, n) = (chunk.start, chunk.pages.len());
        // With `is_last`, the room's source pages in all (the last call may add layers
        // to an earlier chunk than the last).
        let total = chunk.total.unwrap_or(start + n);
        match lifecycle::start(self, room) {
            Ok(()) => {}
            // Skipped: the room is already terminal.
            Err(Refusal::Terminal(_)) => return Ok(()),
            // Never expected (chunks are dispatched only once the room is ready), but a
            // chunk is never dropped for a live room: fail it with the reason.
            Err(r) => {
                return Err(FailureReason::local(
                    Cause::Internal,
                    format!("room {}: cannot start a chunk: {r}", room.id()),
                ))
            }
        }
        let memory = &self.core.node.memory;
        let kv = memory
            .kv
            .get()
            .expect("rooms exist only after KV registration");
        let aux = memory.aux.get();
        let mut queued: Vec<(Arc<Outbox>, Arc<Peer>, Vec<Grouped>)> = Vec::new();
        let mut finishes = Vec::new();
        for dest in &dests {
            let pages = &dest.pages;
            let peer = &dest.peer;
            let place = match peer.slicing.get() {
                None => Place::Pages { start },
                Some(slicing) => {
                    let fits = |before: usize, n: usize, last: bool| {
                        slice::chunk_tokens(
                            slicing.prefill.page_tokens,
                            slicing.decode.page_tokens,
                            before as u64,
                            n as u64,
                            pages.len() as u64,
                            last,
                        )
                    };
                    let tokens = fits(start, n, false)
                        .and_then(|t| {
                            if chunk.is_last {
                                fits(0, total, true).map(|_| t)
                            } else {
                                Ok(t)
                            }
                        })
                        .map_err(|why| {
                            FailureReason::local(
                                Cause::Mismatch,
                                format!(
                                    "room {}: chunk of {n} pages does not fit the destination \
                                 from {}: {why}",
                                    room.id(),
                                    peer.name
                                ),
                            )
                        })?;
                    Place::Sliced { slicing, tokens }
                }
            };
            let sliced = matches!(place, Place::Sliced { .. });
            if !sliced && start + n > pages.len() {
                return Err(FailureReason::local(
                    Cause::Mismatch,
                    format!(
                        "room {}: chunk of {n} pages overflows the destination of {} pages \
                         from {} ({start} already filled)",
                        room.id(),
                        pages.len(),
                        peer.name
                    ),
                ));
            }
            if !sliced && chunk.is_last && total != pages.len() {
                return Err(FailureReason::local(
                    Cause::Mismatch,
                    format!(
                        "room {}: the last chunk leaves {} of {} destination pages from {} unfilled",
                        room.id(),
                        pages.len().saturating_sub(total),
                        pages.len(),
                        peer.name
                    ),
                ));
            }
            let Some(outbox) = self.outbox(peer) else {
                return Err(FailureReason::local(
                    Cause::PeerLost,
                    format!("no data connection to {}", peer.name),
                ));
            };
            let frames = plan(room.id(), chunk, dest, place, kv, aux);
            let aux_sent = frames.iter().any(|f| f.hdr.target == Target::Aux);
            if chunk.is_last {
                let mut frame = Vec::with_capacity(64);
                Message::Done {
                    room: room.id(),
                    generation: dest.generation,
                    // The source pages of the room: the destination's for a byte copy.
                    pages_sent: total as u32,
                    aux_sent,
                }
                .encode(&mut frame)
                .map_err(|e| FailureReason::local(Cause::Internal, e.to_string()))?;
                finishes.push((peer.clone(), frame));
            }
            queued.push((outbox, peer.clone(), batches(frames)));
        }
        let batches_planned: usize = queued.iter().map(|(_, _, b)| b.len()).sum();
        let ticket = Ticket::new(batches_planned);
        {
            let mut p = ext(room).lock();
            let last = chunk.is_last.then_some(finishes);
            p.completion.planned(batches_planned, last);
            p.planning.planned(batches_planned);
        }
        if batches_planned == 0 {
            self.chunk_sent();
        }
        for (outbox, peer, batches) in queued {
            let n = batches.len();
            let batches = batches
                .into_iter()
                .enumerate()
                .map(|(i, (frames, bytes))| {
                    Item::Batch(Batch {
                        room: room.clone(),
                        peer: peer.clone(),
                        frames,
                        bytes,
                        chunk: ticket.clone(),
                        last: chunk.is_last && i + 1 == n,
                    })
                })
                .collect();
            for item in outbox.push_all(room.generation(), batches) {
                // The engine was lost meanwhile (its loss fails the room).
                if let Item::Batch(batch) = item {
                    self.batch_ended(&batch, false, None);
                }
            }
        }
        if chunk.is_last {
            // An empty last chunk (or one whose batches all ended already) completes here.
            self.try_complete(room, None);
        }
        Ok(())
    }

    pub(super) fn chunk_sent(&self) {
        self.core
            .node
            .metrics
            .chunks
            .fetch_add(1, Ordering::Relaxed);
    }
}
