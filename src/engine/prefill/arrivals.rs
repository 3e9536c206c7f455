//! What decode engines send a prefill engine about its rooms: destinations (attached to
//! their room, or held until it is created) and aborts (failing the room, or kept as
//! tombstones), each told apart from late messages about an earlier, cleared use of the
//! same id; and what a cleared room leaves behind.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::holding::{Full, Grave};
use super::ledger::{OnAbort, OnDestination, Standing};
use super::{ext, Dest, Handed, Job, PRoom, PrefillEngine};
use crate::control::Peer;
use crate::engine::lifecycle;
use crate::proto::Message;
use crate::room::{Cause, FailureReason, State};

/// The answer to a late destination for a cleared use of room `id`.
fn cleared_why(id: u64, reason: Option<String>) -> String {
    match reason {
        Some(r) => format!("prefill room {id} already failed and was cleared: {r}"),
        None => format!("prefill room {id} already finished and was cleared"),
    }
}

/// What `room` is now, for the ledger's decisions.
fn standing(room: &PRoom) -> Standing<'_> {
    match room.state() {
        State::Success => Standing::Succeeded,
        State::Failed => Standing::Failed(room.failure().map_or("", |f| f.message.as_str())),
        _ => Standing::Live,
    }
}

impl PrefillEngine {
    /// A decode engine's destination for room `id`.
    pub(super) fn on_destination(
        &self,
        peer: &Arc<Peer>,
        id: u64,
        generation: u64,
        pages: Vec<u32>,
        aux: Option<u32>,
    ) {
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("prefill.on_destination", id);
        if let Some(old) = self.earlier_use(peer, id, generation) {
            self.refuse(peer, id, generation, &cleared_why(id, old));
            return;
        }
        let Some(room) = self.core.rooms.get(id) else {
            return self.hold(peer, id, generation, pages, aux);
        };
        self.attach(&room, peer, generation, pages, aux);
    }

    /// Whether a message from `peer` about `id` with decode generation `generation`
    /// belongs to an earlier, cleared use of the id; if so, with the old use's failure
    /// reason.
    fn earlier_use(&self, peer: &Arc<Peer>, id: u64, generation: u64) -> Option<Option<String>> {
        self.holding.lock().earlier_use(peer, id, generation)
    }

    /// Answers, and stops holding, the held destinations for `id` that belong to a
    /// cleared use of it. Called after a clear records the use and after a destination is
    /// held, so that whichever of the two comes second sees the other.
    pub(super) fn answer_held_for_cleared(&self, id: u64) {
        let answered = self.holding.lock().take_cleared_dests(id);
        for (d, reason) in answered {
            self.refuse(&d.peer, id, d.generation, &cleared_why(id, reason));
        }
    }

    /// Counts one record the holding area had no place for, and logs the first and then
    /// every power of two.
    pub(super) fn overflowed(
        &self,
        counter: &std::sync::atomic::AtomicU64,
        what: &str,
        limit: usize,
        consequence: &str,
    ) {
        let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            crate::log!(
                self.core.node.log,
                Warn,
                "holding area: {what} full ({limit}); {n} not kept so far: {consequence}"
            );
        }
    }

    pub(super) fn tombstones_overflowed(&self) {
        let metrics = &self.core.node.metrics;
        self.overflowed(
            &metrics.tombstone_overflow,
            "tombstones (aborts and losses before their room)",
            self.holding.lock().limits().tombstones,
            "those rooms fail at their bootstrap deadline instead of at once",
        );
    }

    /// Counts and logs the refusal of a `what` (a destination or an abort) from `peer`,
    /// which `room` is not bound to (warn the first time and every power of two, debug
    /// otherwise), and returns its reason; the caller answers it, if at all, and leaves
    /// the room as it is.
    fn refused(&self, room: &PRoom, peer: &Peer, what: &str) -> String {
        let node = &self.core.node;
        let n = node
            .metrics
            .binding_refusals
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        let why = format!(
            "prefill room {} is bound to other decode engines: {what} from {} refused",
            room.id(),
            peer.name
        );
        if n.is_power_of_two() {
            crate::log!(
                node.log,
                Warn,
                "{why} ({n} refused so far: binding_refusals)"
            );
        } else {
            crate::log!(node.log, Debug, "{why}");
        }
        why
    }

    fn attach(
        &self,
        room: &Arc<PRoom>,
        peer: &Arc<Peer>,
        generation: u64,
        pages: Vec<u32>,
        aux: Option<u32>,
    ) {
        let id = room.id();
        let dest = Dest {
            peer: peer.clone(),
            generation,
            pages: pages.into(),
            aux,
        };
        let mut p = ext(room).lock();
        // The standing is read under the room's lock: a failure makes the room terminal
        // before it takes this lock to read the destinations, so either it is seen here
        // or the failure finds this destination and tells it.
        let outcome = p
            .ledger
            .destination(peer.engine_id, standing(room), dest, &peer.name, id);
        let complete = match outcome {
            OnDestination::Attached { complete } => complete,
            OnDestination::NotBound => {
                // An engine the room is not bound to learns nothing of it (not even
                // whether it ended) and changes nothing; its own room fails.
                drop(p);
                let why = self.refused(room, peer, "destination");
                return self.refuse(peer, id, generation, &why);
            }
            OnDestination::Ended(why) => {
                drop(p);
                return self.refuse(peer, id, generation, &why);
            }
            OnDestination::Second { why, known } => {
                drop(p);
                // The destination held is a party: the failure tells it, and over RDMA
                // acknowledges it once its writes are done. Another one was never
                // written to: refused at once.
                if !known {
                    self.refuse(peer, id, generation, &why);
                }
                let reason = FailureReason::local(Cause::Protocol, why);
                lifecycle::fail(self, room, reason, None);
                return;
            }
        };
        peer.rooms.lock().insert((id, room.generation()));
        if peer.is_lost() {
            drop(p);
            #[cfg(feature = "test-hooks")]
            crate::testing::pause_point("prefill.attach_lost", id);
            lifecycle::fail(
                self,
                room,
                FailureReason::local(peer.loss_cause(), peer.loss()),
                None,
            );
            return;
        }
        if complete && lifecycle::ready(self, room) {
            p.ready = true;
            let (mut sent, mut here) = (true, None);
            while let Some(chunk) = p.held.pop_front() {
                let job = Job {
                    room: room.clone(),
                    chunk,
                };
                match self.hand_on(&mut p, job) {
                    Handed::Queued(ok) => sent &= ok,
                    Handed::Here(job) => here = Some(job),
                }
            }
            drop(p);
            if let Some(job) = here {
                self.plan_here(job);
            }
            if !sent {
                self.fail_undispatched(room);
            }
        }
    }

    fn hold(&self, peer: &Arc<Peer>, id: u64, generation: u64, pages: Vec<u32>, aux: Option<u32>) {
        let node = &self.core.node;
        let expires_ms = node.now_ms() + node.config.bootstrap_timeout_ms;
        let mut h = self.holding.lock();
        if h.hold(peer, id, generation, pages, aux, expires_ms) == Err(Full) {
            let limits = h.limits();
            drop(h);
            node.metrics.held_overflow.fetch_add(1, Ordering::Relaxed);
            let why = format!(
                "prefill has no room {id} and its holding area is full ({} destinations, \
                 {} pages)",
                limits.dests, limits.pages
            );
            self.refuse(peer, id, generation, &why);
            return;
        }
        node.metrics.held.fetch_add(1, Ordering::Relaxed);
        drop(h);
        // A use of the id may have been created, failed and cleared between our lookup
        // and the insert: then this destination is its late one and is answered now.
        self.answer_held_for_cleared(id);
        // The room may have been created between our lookup and the insert.
        if let Some(room) = self.core.rooms.get(id) {
            self.adopt_held(&room);
        }
    }

    /// A new room takes the destinations (and aborts) that were waiting for it.
    pub(super) fn adopt_held(&self, room: &Arc<PRoom>) {
        let (tombs, held) = self.holding.lock().adopt(room.id());
        for t in tombs {
            // An early abort, or the loss of an engine that sent an early destination:
            // from an engine the room is not bound to, it touches nothing.
            let what = match t.grave {
                Grave::Aborted(_) => "abort (before the room was created)",
                Grave::Lost(_) => "destination (before the room was created)",
            };
            if !ext(room).lock().ledger.admits(t.peer.engine_id) {
                self.refused(room, &t.peer, what);
                continue;
            }
            let reason = match t.grave {
                Grave::Aborted(why) => {
                    ext(room).lock().ledger.remember(&t.peer, t.generation);
                    FailureReason::peer(Cause::Aborted, why)
                }
                Grave::Lost(why) => FailureReason::local(
                    Cause::PeerLost,
                    format!(
                        "lost {}, which had sent the destination of room {} before the room \
                         was created: {why}",
                        t.peer.name,
                        room.id()
                    ),
                ),
            };
            lifecycle::fail(self, room, reason, Some(&t.peer));
        }
        for d in held {
            // attach() refuses engines the room is not bound to, and fails the room if
            // the peer was lost meanwhile.
            self.attach(room, &d.peer, d.generation, d.pages, d.aux);
        }
    }

    /// Answers a destination that will never be written to with an Abort, and over
    /// RDMA with its AbortAck too: nothing of it can be outstanding, so the decode side
    /// may reuse the pages at once.
    pub(super) fn refuse(&self, peer: &Arc<Peer>, id: u64, generation: u64, why: &str) {
        let node = &self.core.node;
        peer.send(&Message::abort(id, generation, why, &node.limits));
        if node.rdma.is_some() {
            peer.send(&Message::AbortAck {
                room: id,
                generation,
            });
        }
    }

    /// A decode engine's Abort for room `id`.
    ///
    /// An abort from an engine the room is not bound to is refused and counted, and
    /// changes nothing. Otherwise it fails the prefill room when the room has that decode
    /// room's destination, or has none from that engine yet while still waiting for
    /// destinations (the decode side gave up before its destination went out). An Abort
    /// for a room not created yet is held like an early destination and fails the room
    /// when it is created (unless the room is bound to other engines). Anything else
    /// (another generation of a destination we hold) is a late message for an earlier
    /// use of the id and is dropped.
    pub(super) fn on_abort(&self, peer: &Arc<Peer>, id: u64, generation: u64, reason: String) {
        if self.earlier_use(peer, id, generation).is_some() {
            // A late abort for an earlier use of the id: it must not touch this one.
            return self.core.unknown_room();
        }
        if let Some(room) = self.core.rooms.get(id) {
            let outcome = {
                let mut p = ext(&room).lock();
                p.ledger
                    .abort(peer.engine_id, standing(&room), peer, generation)
            };
            match outcome {
                OnAbort::NotBound => {
                    self.refused(&room, peer, "abort");
                }
                OnAbort::Stale => self.core.unknown_room(),
                OnAbort::Fails => {
                    let cause = crate::integrity::peer_cause(&reason);
                    if cause == Cause::Integrity {
                        self.core
                            .node
                            .metrics
                            .integrity_failures
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    let reason = FailureReason::peer(cause, reason);
                    lifecycle::fail(self, &room, reason, Some(peer));
                }
            }
            return;
        }
        let node = &self.core.node;
        let expires_ms = node.now_ms() + node.config.bootstrap_timeout_ms;
        let kept = self
            .holding
            .lock()
            .abort_early(peer, id, generation, reason, expires_ms);
        if kept.is_err() {
            self.tombstones_overflowed();
        }
        // Counted once held: whoever sees the count (a test, an operator) and then creates
        // the room finds the abort waiting for it.
        self.core.unknown_room();
        // The room may have been created between our lookup and the insert.
        if let Some(room) = self.core.rooms.get(id) {
            self.adopt_held(&room);
        }
    }

    /// Over RDMA: a decode engine aborted its room `id` (its generation `generation`);
    /// acknowledge once no write into that destination can be outstanding. The
    /// destination is held by the room of that id or by a cleared use of it still
    /// draining; if neither holds it, nothing was ever written there.
    pub(super) fn ack_abort(&self, peer: &Arc<Peer>, id: u64, generation: u64) {
        let holds = |room: &PRoom| ext(room).lock().ledger.holds(peer, generation);
        let room = self
            .core
            .rooms
            .get(id)
            .filter(|r| holds(r))
            .or_else(|| self.core.draining_of(id).into_iter().find(|r| holds(r)));
        match room {
            Some(room) => self.acks.queue(&self.core, &room, peer.clone(), generation),
            None => peer.send(&Message::AbortAck {
                room: id,
                generation,
            }),
        }
    }
}
