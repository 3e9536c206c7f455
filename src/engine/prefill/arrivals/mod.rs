//! What decode engines send a prefill engine about its rooms, routed to its room:
//! destinations (attached to their room, or held until it is created) and aborts
//! (failing the room, or kept as tombstones), each told apart from late messages about
//! an earlier, cleared use of the same id; what a cleared room leaves behind, what a
//! lost engine leaves.
//!
//! Written once, over [`Shell`]: the live engine ([`live`]: its room table, locks and
//! sockets) and the simulator (`src/engine/sim/prefill/`) each give the routing their
//! rooms, holding area and hands, and run this same code. The decisions on one room are
//! the [`Ledger`]'s and on what has no room the [`Holding`] area's; this module looks
//! the room up, asks them, and applies their outcomes through the shell. It holds no
//! lock itself: [`Shell::ledger`] and [`Shell::holding`] are the shell's critical
//! sections, and everything else (sends, failures) happens outside them.

mod live;

pub(super) use live::Live;

use super::holding::{Full, Grave, Holding};
use super::ledger::{Dest, Ledger, OnAbort, OnDestination, Standing};
use crate::engine::peer_ref::PeerRef;
use crate::room::{Cause, FailureReason};

/// What the routing counts and logs (the live engine's metrics; the simulator keeps
/// none).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counted<'a> {
    /// A message about a room bound to other decode engines, refused (its reason).
    Refusal(&'a str),
    /// A message about no room of ours (a late one, or one for a room not created yet).
    UnknownRoom,
    /// A destination held for a room not created yet.
    Held,
    /// A destination that found the holding area full (and was refused).
    HeldFull,
    /// A held destination whose room never came (answered).
    HeldExpired,
    /// A tombstone (an abort or a loss before its room) the holding area had no place for.
    TombstoneFull,
    /// A cleared use's record the holding area had no place for.
    ClearedFull,
    /// A decode engine's abort that says the bytes it got were not the ones sent.
    Integrity,
}

/// A prefill engine, as the routing sees it: its rooms, its holding area, and the hands
/// that send, fail and count. `Room` is a handle on one use of a room (the live engine's
/// `Arc<PRoom>`; the simulator's id and use).
pub(crate) trait Shell {
    type Peer: PeerRef;
    type Room;

    /// The live room of id `id`, if any.
    fn room(&mut self, id: u64) -> Option<Self::Room>;
    /// The cleared uses of `id` whose writes are still in flight.
    fn draining(&mut self, id: u64) -> Vec<Self::Room>;
    fn id(&self, room: &Self::Room) -> u64;
    /// Calls `f` with `room`'s ledger and what the room is now, read together in one
    /// critical section: a failure makes the room terminal before it reads the ledger,
    /// so a destination either sees the failure or is seen by it.
    fn ledger<R>(
        &mut self,
        room: &Self::Room,
        f: impl FnOnce(&mut Ledger<Self::Peer>, Standing) -> R,
    ) -> R;
    /// As [`Shell::ledger`], for `peer`'s destination: when `decide` attaches it, the
    /// room depends on `peer` from then on (its loss fails the room), recorded in the
    /// same critical section. A clear forgets a room's dependencies after reading its
    /// ledger, so one recorded after the decision, outside it, could outlive the room.
    fn attach(
        &mut self,
        room: &Self::Room,
        peer: &Self::Peer,
        decide: impl FnOnce(&mut Ledger<Self::Peer>, Standing) -> OnDestination,
    ) -> OnDestination;
    fn holding<R>(&mut self, f: impl FnOnce(&mut Holding<Self::Peer>) -> R) -> R;
    /// When a record held now for a room not created yet expires (the bootstrap
    /// timeout), in the holding area's clock.
    fn held_until(&self) -> u64;
    /// When the record of a use cleared now expires (the bootstrap and waiting
    /// timeouts: the longest a late message about it can take).
    fn cleared_until(&self) -> u64;
    /// How logs and reasons name `peer`.
    fn name(&self, peer: &Self::Peer) -> String;
    /// The engine writes with one-sided RDMA: aborts are acknowledged.
    fn rdma(&self) -> bool;
    /// How long the shell holds a destination for a room not created yet, for the
    /// reason of its expiry.
    fn held_for(&self) -> String;

    fn send_abort(&mut self, peer: &Self::Peer, id: u64, generation: u64, why: &str);
    fn send_ack(&mut self, peer: &Self::Peer, id: u64, generation: u64);
    /// Acknowledges `peer`'s abort of its destination `generation` of `room` once no
    /// write of the room is in flight (at once if none is).
    fn queue_ack(&mut self, room: &Self::Room, peer: &Self::Peer, generation: u64);
    /// Fails `room` with `reason` unless it is terminal, through the lifecycle (the one
    /// place that changes a room's state); the failure tells the room's
    /// parties but `origin` ([`Ledger::told`]).
    fn fail_room(&mut self, room: &Self::Room, reason: FailureReason, origin: Option<&Self::Peer>);
    /// Why `peer` is lost, if it is.
    fn loss(&self, peer: &Self::Peer) -> Option<(Cause, String)>;
    /// Every destination `room` waits for arrived: it becomes ready and plans the
    /// chunks enqueued so far.
    fn ready(&mut self, room: &Self::Room);
    fn count(&mut self, what: Counted<'_>);
    /// `peer`'s abort (of its destination `generation`) fails `room`. An observation
    /// point: the simulator checks here that the abort is the room's own and the
    /// newest it heard; the live engine does nothing more.
    fn abort_applies(&mut self, _room: &Self::Room, _peer: &Self::Peer, _generation: u64) {}
}

/// The answer to a late destination for a cleared use of room `id`.
fn cleared_why(id: u64, reason: Option<String>) -> String {
    match reason {
        Some(r) => format!("prefill room {id} already failed and was cleared: {r}"),
        None => format!("prefill room {id} already finished and was cleared"),
    }
}

/// A decode engine's destination for room `id`.
pub(crate) fn on_destination<S: Shell>(
    s: &mut S,
    peer: &S::Peer,
    id: u64,
    generation: u64,
    pages: Vec<u32>,
    aux: Option<u32>,
) {
    #[cfg(feature = "test-hooks")]
    crate::testing::pause_point("prefill.on_destination", id);
    if let Some(old) = s.holding(|h| h.earlier_use(peer, id, generation)) {
        return refuse(s, peer, id, generation, &cleared_why(id, old));
    }
    match s.room(id) {
        Some(room) => attach(s, &room, peer, generation, pages, aux),
        None => hold(s, peer, id, generation, pages, aux),
    }
}

/// Attaches `peer`'s destination to `room`, as the ledger decides.
fn attach<S: Shell>(
    s: &mut S,
    room: &S::Room,
    peer: &S::Peer,
    generation: u64,
    pages: Vec<u32>,
    aux: Option<u32>,
) {
    let id = s.id(room);
    let dest = Dest {
        peer: peer.clone(),
        generation,
        pages: pages.into(),
        aux,
    };
    let name = s.name(peer);
    let outcome = s.attach(room, peer, |l, standing| {
        l.destination(peer.engine(), standing, dest, &name, id)
    });
    let complete = match outcome {
        OnDestination::Attached { complete } => complete,
        OnDestination::NotBound => {
            // An engine the room is not bound to learns nothing of it (not even whether
            // it ended) and changes nothing; its own room fails.
            let why = refused(s, id, &name, "destination");
            return refuse(s, peer, id, generation, &why);
        }
        OnDestination::Ended(why) => return refuse(s, peer, id, generation, &why),
        OnDestination::Second { why, known } => {
            // The destination held is a party: the failure tells it, and over RDMA
            // acknowledges it once its writes are done. Another one was never written
            // to: refused at once.
            if !known {
                refuse(s, peer, id, generation, &why);
            }
            return s.fail_room(room, FailureReason::local(Cause::Protocol, why), None);
        }
    };
    // The room depends on its peer from the attachment on, before the loss is read
    // here: a loss either sees the dependency (and fails the room) or is seen here.
    if let Some((cause, why)) = s.loss(peer) {
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("prefill.attach_lost", id);
        return s.fail_room(room, FailureReason::local(cause, why), None);
    }
    if complete {
        s.ready(room);
    }
}

/// Holds a destination for a room not created yet.
fn hold<S: Shell>(
    s: &mut S,
    peer: &S::Peer,
    id: u64,
    generation: u64,
    pages: Vec<u32>,
    aux: Option<u32>,
) {
    let expires = s.held_until();
    let kept = s.holding(|h| {
        h.hold(peer, id, generation, pages, aux, expires)
            .map_err(|Full| h.limits())
    });
    if let Err(limits) = kept {
        s.count(Counted::HeldFull);
        let why = format!(
            "prefill has no room {id} and its holding area is full ({} destinations, \
             {} pages)",
            limits.dests, limits.pages
        );
        return refuse(s, peer, id, generation, &why);
    }
    s.count(Counted::Held);
    // A use of the id may have been created, failed and cleared between our lookup and
    // the insert: then this destination is its late one and is answered now.
    answer_held_for_cleared(s, id);
    // The room may have been created between our lookup and the insert.
    if let Some(room) = s.room(id) {
        adopt_held(s, &room);
    }
}

/// Answers, and stops holding, the held destinations for `id` that belong to a cleared
/// use of it. Called after a clear records the use and after a destination is held, so
/// that whichever of the two comes second sees the other.
fn answer_held_for_cleared<S: Shell>(s: &mut S, id: u64) {
    for (d, reason) in s.holding(|h| h.take_cleared_dests(id)) {
        refuse(s, &d.peer, id, d.generation, &cleared_why(id, reason));
    }
}

/// A new room takes the destinations (and aborts) that were waiting for it.
pub(crate) fn adopt_held<S: Shell>(s: &mut S, room: &S::Room) {
    let id = s.id(room);
    let (tombs, held) = s.holding(|h| h.adopt(id));
    for t in tombs {
        // An early abort, or the loss of an engine that sent an early destination: from
        // an engine the room is not bound to, it touches nothing.
        let what = match t.grave {
            Grave::Aborted(_) => "abort (before the room was created)",
            Grave::Lost(_) => "destination (before the room was created)",
        };
        if !s.ledger(room, |l, _| l.admits(t.peer.engine())) {
            let name = s.name(&t.peer);
            refused(s, id, &name, what);
            continue;
        }
        let reason = match t.grave {
            Grave::Aborted(why) => {
                s.ledger(room, |l, _| l.remember(&t.peer, t.generation));
                s.abort_applies(room, &t.peer, t.generation);
                FailureReason::peer(Cause::Aborted, why)
            }
            Grave::Lost(why) => FailureReason::local(
                Cause::PeerLost,
                format!(
                    "lost {}, which had sent the destination of room {id} before the room \
                     was created: {why}",
                    s.name(&t.peer)
                ),
            ),
        };
        s.fail_room(room, reason, Some(&t.peer));
    }
    for d in held {
        // attach() refuses engines the room is not bound to, and fails the room if the
        // peer was lost meanwhile.
        attach(s, room, &d.peer, d.generation, d.pages, d.aux);
    }
}

/// The reason a `what` (a destination or an abort) from the engine `name` is refused
/// by room `id`, which is not bound to it; counted. The caller answers it, if at all,
/// and leaves the room as it is.
fn refused<S: Shell>(s: &mut S, id: u64, name: &str, what: &str) -> String {
    let why =
        format!("prefill room {id} is bound to other decode engines: {what} from {name} refused");
    s.count(Counted::Refusal(&why));
    why
}

/// Answers a destination that will never be written to with an Abort, and over RDMA
/// with its AbortAck too: nothing of it can be outstanding, so the decode side may reuse
/// the pages at once.
fn refuse<S: Shell>(s: &mut S, peer: &S::Peer, id: u64, generation: u64, why: &str) {
    s.send_abort(peer, id, generation, why);
    if s.rdma() {
        s.send_ack(peer, id, generation);
    }
}

/// A decode engine's Abort for room `id`.
///
/// An abort from an engine the room is not bound to is refused and counted, and changes
/// nothing. Otherwise it fails the prefill room when the room has that decode room's
/// destination, or has none from that engine yet while still waiting for destinations
/// (the decode side gave up before its destination went out). An Abort for a room not
/// created yet is held like an early destination and fails the room when it is created
/// (unless the room is bound to other engines). Anything else (another generation of a
/// destination we hold) is a late message for an earlier use of the id and is dropped.
pub(crate) fn on_abort<S: Shell>(
    s: &mut S,
    peer: &S::Peer,
    id: u64,
    generation: u64,
    reason: String,
) {
    if s.holding(|h| h.earlier_use(peer, id, generation)).is_some() {
        // A late abort for an earlier use of the id: it must not touch this one.
        return s.count(Counted::UnknownRoom);
    }
    if let Some(room) = s.room(id) {
        match s.ledger(&room, |l, standing| {
            l.abort(peer.engine(), standing, peer, generation)
        }) {
            OnAbort::NotBound => {
                let name = s.name(peer);
                refused(s, id, &name, "abort");
            }
            OnAbort::Stale => s.count(Counted::UnknownRoom),
            OnAbort::Fails => {
                let cause = crate::integrity::peer_cause(&reason);
                if cause == Cause::Integrity {
                    s.count(Counted::Integrity);
                }
                s.abort_applies(&room, peer, generation);
                s.fail_room(&room, FailureReason::peer(cause, reason), Some(peer));
            }
        }
        return;
    }
    let expires = s.held_until();
    if s.holding(|h| h.abort_early(peer, id, generation, reason, expires))
        .is_err()
    {
        s.count(Counted::TombstoneFull);
    }
    // Counted once held: whoever sees the count (a test, an operator) and then creates
    // the room finds the abort waiting for it.
    s.count(Counted::UnknownRoom);
    // The room may have been created between our lookup and the insert.
    if let Some(room) = s.room(id) {
        adopt_held(s, &room);
    }
}

/// Over RDMA: a decode engine aborted its room `id` (its generation `generation`);
/// acknowledge once no write into that destination can be outstanding. The destination
/// is held by the room of that id or by a cleared use of it still draining; if neither
/// holds it, nothing was ever written there.
pub(crate) fn ack_abort<S: Shell>(s: &mut S, peer: &S::Peer, id: u64, generation: u64) {
    let holds = |s: &mut S, r: &S::Room| s.ledger(r, |l, _| l.holds(peer, generation));
    let live = s.room(id).filter(|r| holds(s, r));
    let holder = live.or_else(|| s.draining(id).into_iter().find(|r| holds(s, r)));
    match holder {
        Some(room) => s.queue_ack(&room, peer, generation),
        None => s.send_ack(peer, id, generation),
    }
}

/// Room `id` was cleared: remembers, for a while, which decode generations it knew and
/// why it failed (`reason`), so that late messages about it neither touch a new use of
/// the id nor wait for a deadline to be answered; answers those held already.
pub(crate) fn cleared<S: Shell>(
    s: &mut S,
    id: u64,
    reason: Option<String>,
    gens: Vec<(S::Peer, u64)>,
    complete: bool,
) {
    let expires = s.cleared_until();
    if s.holding(|h| h.clear_use(id, reason, gens, complete, expires))
        .is_err()
    {
        s.count(Counted::ClearedFull);
    }
    answer_held_for_cleared(s, id);
}

/// The holding area's records that expired by `now` go; the held destinations among
/// them (their room never came) are answered.
pub(crate) fn expire<S: Shell>(s: &mut S, now: u64) {
    for (id, d) in s.holding(|h| h.expire(now)) {
        s.count(Counted::HeldExpired);
        let why = format!("prefill created no room {id} within {}", s.held_for());
        refuse(s, &d.peer, id, d.generation, &why);
    }
}

/// `peer` was lost: the destinations it left in the holding area become tombstones (the
/// rooms they wait for fail at once when created). Its rooms are the shell's to fail
/// (they depend on it since [`Shell::attach`]).
pub(crate) fn lost<S: Shell>(s: &mut S, peer: &S::Peer, why: &str) {
    let expires = s.held_until();
    for _ in 0..s.holding(|h| h.peer_lost(peer, why, expires)) {
        s.count(Counted::TombstoneFull);
    }
}
