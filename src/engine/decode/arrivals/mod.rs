//! What prefill engines tell a decode engine about its rooms, routed to its room: an
//! Abort (from the room's own engines only), the acknowledgement of ours, a Done claim
//! and what it comes to ([`DecodeRoom::settle`]); and whom a failure tells.
//!
//! Written once, over [`Shell`], as the prefill side's `arrivals` is: the live engine
//! ([`live`]) and the simulator (`src/engine/sim/decode/shell.rs`) run this same code. The
//! decisions are the [`DecodeRoom`]'s; this module finds the room, asks it, and applies
//! the outcome through the shell.

mod live;

pub(super) use live::Live;

use super::room::{DecodeRoom, Settle};
use crate::engine::peer_ref::PeerRef;
use crate::room::{Cause, FailureReason};

/// A decode engine, as the routing sees it: its rooms and the hands that send, fail,
/// complete and count. `Room` is a handle on one use of a room (the live engine's
/// `Arc<DRoom>`; the simulator's).
pub(crate) trait Shell {
    type Peer: PeerRef;
    type Room;

    /// The live room of id `id` in its use `generation`, if any.
    fn room(&mut self, id: u64, generation: u64) -> Option<Self::Room>;
    /// That room, live or cleared and still draining.
    fn find(&mut self, id: u64, generation: u64) -> Option<Self::Room>;
    fn id(&self, room: &Self::Room) -> u64;
    /// The room's decisions.
    fn core<'r>(&self, room: &'r Self::Room) -> &'r DecodeRoom<Self::Peer>;
    /// What peer `idx`'s Done claim comes to ([`DecodeRoom::settle`], with what the
    /// shell knows of the peers: their names, aux buffers and the bytes they owe).
    fn settle(&mut self, room: &Self::Room, idx: usize) -> Settle;
    /// Fails `room` with `reason` unless it is terminal, through the lifecycle; the
    /// failure tells the room's peers but `origin` ([`tell_failed`]).
    fn fail_room(&mut self, room: &Self::Room, reason: FailureReason, origin: Option<&Self::Peer>);
    /// Every peer of `room` is done: it completes, unless it is terminal.
    fn complete(&mut self, room: &Self::Room);
    fn send_abort(&mut self, peer: &Self::Peer, id: u64, generation: u64, why: &str);
    /// A message naming no room of ours (or one that does not pull from its sender):
    /// counted, not silent.
    fn unknown_room(&mut self);
    /// `peer`'s Abort fails `room`. An observation point: the simulator checks here that
    /// the engine is one the room pulls from; the live engine does nothing more.
    fn abort_applies(&mut self, _room: &Self::Room, _peer: &Self::Peer) {}
}

/// The live room a prefill engine's message names, and that engine's place in it; an
/// unknown room (or use), or one that does not pull from that engine, is counted.
pub(crate) fn room_of<S: Shell>(
    s: &mut S,
    peer: &S::Peer,
    id: u64,
    generation: u64,
) -> Option<(S::Room, usize)> {
    let Some(room) = s.room(id, generation) else {
        s.unknown_room();
        return None;
    };
    let idx = s.core(&room).index_of(peer);
    if idx.is_none() {
        s.unknown_room();
    }
    Some((room, idx?))
}

/// A prefill engine's Abort of room `id` (our use `generation`). Only an engine the room
/// pulls from may abort it; any other Abort naming the room is counted and changes
/// nothing (a member must not cancel other engines' rooms).
pub(crate) fn on_abort<S: Shell>(
    s: &mut S,
    peer: &S::Peer,
    id: u64,
    generation: u64,
    reason: String,
) {
    let Some(room) = s.room(id, generation) else {
        return s.unknown_room();
    };
    if !s.core(&room).abort_from(peer) {
        return s.unknown_room();
    }
    s.abort_applies(&room, peer);
    s.fail_room(
        &room,
        FailureReason::peer(Cause::Aborted, reason),
        Some(peer),
    );
}

/// Over RDMA: the prefill engine's writes into the room (live or draining) have all
/// completed.
pub(crate) fn on_abort_ack<S: Shell>(s: &mut S, peer: &S::Peer, id: u64, generation: u64) {
    if let Some(room) = s.find(id, generation) {
        s.core(&room).peer_quiet(peer);
    }
}

/// A prefill engine's Done: its claim is checked against what arrived (see
/// [`DecodeRoom::settle`]), and the room completes when every prefill engine is done.
pub(crate) fn on_done<S: Shell>(
    s: &mut S,
    peer: &S::Peer,
    id: u64,
    generation: u64,
    pages_sent: u32,
    aux_sent: bool,
) {
    let Some((room, idx)) = room_of(s, peer, id, generation) else {
        return;
    };
    s.core(&room).claim(idx, pages_sent, aux_sent);
    settle(s, &room, idx);
}

/// Completes the room (or fails it) once peer `idx`'s Done claim and every byte it counts
/// have arrived.
pub(crate) fn settle<S: Shell>(s: &mut S, room: &S::Room, idx: usize) {
    match s.settle(room, idx) {
        Settle::Fail(why) => {
            let why = format!("room {}: {why}", s.id(room));
            s.fail_room(room, FailureReason::local(Cause::Mismatch, why), None);
        }
        Settle::Done { all: true } => s.complete(room),
        Settle::Done { all: false } | Settle::Wait | Settle::Nothing => {}
    }
}

/// A decode room (its decisions `core`, id `id`, use `generation`) failed with `msg`:
/// every peer but `origin` gets an Abort, under the room's lock, which its destination
/// is sent under too: a destination that went out before the failure is ahead of the
/// Abort on the peer's control connection, and none goes out after
/// ([`DecodeRoom::send_destination`]).
pub(crate) fn tell_failed<S: Shell>(
    s: &mut S,
    core: &DecodeRoom<S::Peer>,
    (id, generation): (u64, u64),
    msg: &str,
    origin: Option<&S::Peer>,
) {
    core.with_lock(|| {
        for peer in &core.peers {
            if !origin.is_some_and(|o| o.same(peer)) {
                s.send_abort(peer, id, generation, msg);
            }
        }
    })
}
