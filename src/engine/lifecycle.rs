//! When a room changes state: the only place in the engine that calls
//! [`Room::advance`], [`Room::fail`] or [`Room::fail_in`]. The rule and the
//! compare-and-swap are `room/state.rs`; this file decides when each event fires, and
//! does what goes with it: each transition arms the deadline of the state it enters
//! (before the compare-and-swap, so that the watchdog, which reads the state first and
//! the deadline second, never pairs the new state with the old deadline), counts, logs,
//! a failure tells the room's peers, and every change wakes the scheduler's wait.
//!
//! `tests/layers.rs` fails if a room's state is changed anywhere else in the engine.

use std::sync::Arc;

use super::core::Side;
use crate::control::Peer;
use crate::node::Node;
use crate::room::{Event, FailureReason, Refusal, Room, State};

/// Arms (or re-arms) the deadline of `state` on `room`: the one it is about to enter,
/// or stays in after progress.
fn arm<T>(node: &Node, room: &Room<T>, state: State) {
    let c = &node.config;
    let ms = match state {
        State::Bootstrapping => c.bootstrap_timeout_ms,
        State::WaitingForInput => c.waiting_timeout_ms,
        State::Transferring => c.transfer_timeout_ms,
        State::Success | State::Failed => return,
    };
    room.set_deadline_ms(node.now_ms() + ms);
}

/// A room was created (in BOOTSTRAPPING, with its bootstrap deadline): counted and
/// logged.
pub(crate) fn created<S: Side>(side: &S, room: &Room<S::Ext>, what: std::fmt::Arguments<'_>) {
    let node = &side.core().node;
    node.metrics.created();
    crate::log!(
        node.log,
        Debug,
        "room {} created (gen {}, {what})",
        room.id(),
        room.generation()
    );
}

/// The bootstrap deadline a new room starts with.
pub(crate) fn bootstrap_deadline(node: &Node) -> u64 {
    node.now_ms() + node.config.bootstrap_timeout_ms
}

/// BOOTSTRAPPING -> WAITING_FOR_INPUT (prefill: every destination arrived; decode: every
/// peer is connected). Whether this call made the transition.
pub(crate) fn ready<S: Side>(side: &S, room: &Room<S::Ext>) -> bool {
    arm(&side.core().node, room, State::WaitingForInput);
    let won = room.advance(Event::Ready).is_ok();
    if won {
        side.core().changes.bump();
    }
    won
}

/// Decode: the scheduler gave the destination of a room already waiting; waiting now
/// means waiting for the prefill's data, with a fresh deadline.
pub(crate) fn waiting_again<S: Side>(side: &S, room: &Room<S::Ext>) {
    if room.state() == State::WaitingForInput {
        arm(&side.core().node, room, State::WaitingForInput);
    }
}

/// -> TRANSFERRING (data starts or goes on moving), with a fresh no-progress deadline.
/// A terminal room refuses it; a room not yet ready refuses it too (never expected: the
/// callers make sure, and fail the room if it happens).
pub(crate) fn start<S: Side>(side: &S, room: &Room<S::Ext>) -> Result<(), Refusal> {
    arm(&side.core().node, room, State::Transferring);
    let (from, _) = room.advance(Event::Start)?;
    if from != State::Transferring {
        side.core().changes.bump();
    }
    Ok(())
}

/// Data moved: the no-progress deadline is armed again.
pub(crate) fn progressed<S: Side>(side: &S, room: &Room<S::Ext>) {
    arm(&side.core().node, room, State::Transferring);
}

/// -> SUCCESS (prefill: every byte is with the transport, claimed before Done goes
/// out; decode: every prefill engine's Done and every byte it counts arrived). Whether
/// this call made it; counted and logged when it did.
pub(crate) fn complete<S: Side>(side: &S, room: &Room<S::Ext>) -> bool {
    if room.advance(Event::Complete).is_err() {
        return false;
    }
    side.core().changes.bump();
    let node = &side.core().node;
    node.metrics.succeeded();
    let done = match node.role {
        crate::Role::Prefill => "sent",
        crate::Role::Decode => "received",
    };
    crate::log!(node.log, Debug, "room {} {done}", room.id());
    true
}

/// Fails `room` with `reason` unless it is terminal; when this call made it FAILED,
/// counts and logs it and tells the room's peers (but `origin`). Returns whether this
/// call failed it.
pub(crate) fn fail<S: Side>(
    side: &S,
    room: &Room<S::Ext>,
    reason: FailureReason,
    origin: Option<&Arc<Peer>>,
) -> bool {
    fail_if(side, room, None, reason, origin)
}

/// As [`fail`], but only while the room is still in `state` (a deadline read for that
/// state must not fail the room once it has moved on).
pub(crate) fn fail_in<S: Side>(
    side: &S,
    room: &Room<S::Ext>,
    state: State,
    reason: FailureReason,
) -> bool {
    fail_if(side, room, Some(state), reason, None)
}

fn fail_if<S: Side>(
    side: &S,
    room: &Room<S::Ext>,
    state: Option<State>,
    reason: FailureReason,
    origin: Option<&Arc<Peer>>,
) -> bool {
    // The peers are told the reason's own text: whether it came from a peer is ours to
    // know, and they mark it as coming from one.
    let (msg, told) = (reason.to_string(), reason.message.clone());
    let cause = reason.cause;
    let won = match state {
        Some(s) => room.fail_in(s, reason),
        None => room.fail(reason),
    };
    let Some(from) = won else {
        return false;
    };
    side.core().changes.bump();
    let node = &side.core().node;
    node.metrics.failed(cause);
    // The peers first: the log sink below is the host's code and may take its time, and
    // a decode room's pages are reusable only once its peers have the Abort.
    side.tell_failed(room, &told, origin);
    crate::log!(
        node.log,
        Warn,
        "room {} ({}, gen {}) failed while {}: {}",
        room.id(),
        node.role,
        room.generation(),
        from,
        msg
    );
    true
}
