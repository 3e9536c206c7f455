//! The live engine's [`Shell`]: its room table, the room's lock around the ledger, the
//! holding area's lock, the peers' sockets, the lifecycle's transitions, the metrics and
//! the log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Counted, Shell};
use crate::control::Peer;
use crate::engine::lifecycle;
use crate::engine::prefill::holding::Holding;
use crate::engine::prefill::ledger::{Ledger, OnDestination, Standing};
use crate::engine::prefill::sender::Handed;
use crate::engine::prefill::{ext, Job, PRoom, PrefillEngine};
use crate::proto::Message;
use crate::room::{Cause, FailureReason, State};

/// The engine, lent to one routing call.
pub(in crate::engine::prefill) struct Live<'a>(pub &'a PrefillEngine);

/// What `room` is now, for the ledger's decisions.
fn standing(room: &PRoom) -> Standing<'_> {
    match room.state() {
        State::Success => Standing::Succeeded,
        State::Failed => Standing::Failed(room.failure().map_or("", |f| f.message.as_str())),
        _ => Standing::Live,
    }
}

impl Live<'_> {
    /// Counts one record the holding area had no place for, and logs the first and then
    /// every power of two.
    fn overflowed(&self, counter: &AtomicU64, what: &str, limit: usize, consequence: &str) {
        let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            crate::log!(
                self.0.core.node.log,
                Warn,
                "holding area: {what} full ({limit}); {n} not kept so far: {consequence}"
            );
        }
    }

    /// Counts a refusal of a room's binding; warns the first time and every power of
    /// two, logs at debug otherwise.
    fn refusal(&self, why: &str) {
        let node = &self.0.core.node;
        let n = node
            .metrics
            .binding_refusals
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        if n.is_power_of_two() {
            crate::log!(
                node.log,
                Warn,
                "{why} ({n} refused so far: binding_refusals)"
            );
        } else {
            crate::log!(node.log, Debug, "{why}");
        }
    }
}

impl Shell for Live<'_> {
    type Peer = Arc<Peer>;
    type Room = Arc<PRoom>;

    fn room(&mut self, id: u64) -> Option<Arc<PRoom>> {
        self.0.core.rooms.get(id)
    }

    fn draining(&mut self, id: u64) -> Vec<Arc<PRoom>> {
        self.0.core.draining_of(id)
    }

    fn id(&self, room: &Arc<PRoom>) -> u64 {
        room.id()
    }

    fn ledger<R>(
        &mut self,
        room: &Arc<PRoom>,
        f: impl FnOnce(&mut Ledger<Arc<Peer>>, Standing) -> R,
    ) -> R {
        // The standing is read under the room's lock: a failure makes the room terminal
        // before it takes this lock to read the ledger.
        let mut p = ext(room).lock();
        f(&mut p.ledger, standing(room))
    }

    fn attach(
        &mut self,
        room: &Arc<PRoom>,
        peer: &Arc<Peer>,
        decide: impl FnOnce(&mut Ledger<Arc<Peer>>, Standing) -> OnDestination,
    ) -> OnDestination {
        let mut p = ext(room).lock();
        let outcome = decide(&mut p.ledger, standing(room));
        if matches!(outcome, OnDestination::Attached { .. }) {
            // The index `core::fail_rooms_of` reads when the peer is lost.
            peer.rooms.lock().insert((room.id(), room.generation()));
        }
        outcome
    }

    fn holding<R>(&mut self, f: impl FnOnce(&mut Holding<Arc<Peer>>) -> R) -> R {
        f(&mut self.0.holding.lock())
    }

    fn held_until(&self) -> u64 {
        let node = &self.0.core.node;
        node.now_ms() + node.config.bootstrap_timeout_ms
    }

    fn cleared_until(&self) -> u64 {
        let node = &self.0.core.node;
        node.now_ms() + node.config.bootstrap_timeout_ms + node.config.waiting_timeout_ms
    }

    fn name(&self, peer: &Arc<Peer>) -> String {
        peer.name.clone()
    }

    fn rdma(&self) -> bool {
        self.0.core.node.rdma.is_some()
    }

    fn held_for(&self) -> String {
        let ms = self.0.core.node.config.bootstrap_timeout_ms;
        format!("bootstrap_timeout_ms={ms}")
    }

    fn send_abort(&mut self, peer: &Arc<Peer>, id: u64, generation: u64, why: &str) {
        let limits = &self.0.core.node.limits;
        peer.send(&Message::abort(id, generation, why, limits));
    }

    fn send_ack(&mut self, peer: &Arc<Peer>, id: u64, generation: u64) {
        peer.send(&Message::AbortAck {
            room: id,
            generation,
        });
    }

    fn queue_ack(&mut self, room: &Arc<PRoom>, peer: &Arc<Peer>, generation: u64) {
        let e = self.0;
        e.acks.queue(&e.core, room, peer.clone(), generation);
    }

    fn fail_room(&mut self, room: &Arc<PRoom>, reason: FailureReason, origin: Option<&Arc<Peer>>) {
        lifecycle::fail(self.0, room, reason, origin);
    }

    fn loss(&self, peer: &Arc<Peer>) -> Option<(Cause, String)> {
        peer.is_lost().then(|| (peer.loss_cause(), peer.loss()))
    }

    /// The Ready transition, then the chunks held so far are handed on in order, under
    /// the room's lock (an enqueue meanwhile finds the room ready only once they are).
    fn ready(&mut self, room: &Arc<PRoom>) {
        let e = self.0;
        let mut p = ext(room).lock();
        if p.ready || !lifecycle::ready(e, room) {
            return;
        }
        p.ready = true;
        let (mut sent, mut here) = (true, None);
        while let Some(chunk) = p.held.pop_front() {
            let job = Job {
                room: room.clone(),
                chunk,
            };
            match e.hand_on(&mut p, job) {
                Handed::Queued(ok) => sent &= ok,
                Handed::Here(job) => here = Some(job),
            }
        }
        drop(p);
        if let Some(job) = here {
            e.plan_here(job);
        }
        if !sent {
            e.fail_undispatched(room);
        }
    }

    fn count(&mut self, what: Counted<'_>) {
        let e = self.0;
        let metrics = &e.core.node.metrics;
        let limits = || e.holding.lock().limits();
        match what {
            Counted::Refusal(why) => self.refusal(why),
            Counted::UnknownRoom => e.core.unknown_room(),
            Counted::Held => {
                metrics.held.fetch_add(1, Ordering::Relaxed);
            }
            Counted::HeldFull => {
                metrics.held_overflow.fetch_add(1, Ordering::Relaxed);
            }
            Counted::HeldExpired => {
                metrics.held_expired.fetch_add(1, Ordering::Relaxed);
            }
            Counted::Integrity => {
                metrics.integrity_failures.fetch_add(1, Ordering::Relaxed);
            }
            Counted::TombstoneFull => self.overflowed(
                &metrics.tombstone_overflow,
                "tombstones (aborts and losses before their room)",
                limits().tombstones,
                "those rooms fail at their bootstrap deadline instead of at once",
            ),
            Counted::ClearedFull => self.overflowed(
                &metrics.cleared_overflow,
                "cleared-room records",
                limits().cleared,
                "late messages about these rooms may be taken for a new use of their id",
            ),
        }
    }
}
