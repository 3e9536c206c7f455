//! What both roles share: the room table (and cleared rooms still draining), the node
//! and the control layer; the [`Side`] each role implements; and the scheduler's calls
//! that are the same for both roles (poll, abort, failure, drained, clear, metrics).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::changes::Changes;
use super::lifecycle;
use crate::control::{Control, Events, Peer};
use crate::err;
use crate::error::Result;
use crate::metrics::MetricsSnapshot;
use crate::node::Node;
use crate::room::{Cause, FailureReason, Room, RoomTable, State};

/// Cleared rooms still draining, by (id, generation): the room and when it was cleared.
type Draining<T> = HashMap<(u64, u64), (Arc<Room<T>>, u64)>;

pub(crate) struct Core<T> {
    pub node: Arc<Node>,
    pub control: Arc<Control>,
    pub rooms: RoomTable<T>,
    /// Rooms cleared while a transport operation could still touch their memory, with
    /// the engine-clock ms of their clear: out of the table (their id may be used again
    /// at once) and released by the watchdog once drained.
    draining: Mutex<Draining<T>>,
    /// Counts every change of a room's state (`lifecycle` bumps it), for the scheduler's
    /// wait.
    pub changes: Changes,
}

impl<T> Core<T> {
    pub fn new(node: Arc<Node>, control: Arc<Control>) -> Self {
        Core {
            node,
            control,
            rooms: RoomTable::new(),
            draining: Mutex::new(HashMap::new()),
            changes: Changes::default(),
        }
    }

    pub fn room(&self, id: u64) -> Result<Arc<Room<T>>> {
        self.rooms
            .get(id)
            .ok_or_else(|| err!(NotFound, "room {id} not found"))
    }

    /// The room `id` with generation `generation`: in the table, or cleared and still
    /// draining (what a message about a room's memory must find).
    pub fn find_room(&self, id: u64, generation: u64) -> Option<Arc<Room<T>>> {
        self.rooms.get_generation(id, generation).or_else(|| {
            self.draining
                .lock()
                .get(&(id, generation))
                .map(|(r, _)| r.clone())
        })
    }

    /// Cleared rooms of id `id` still draining.
    pub fn draining_of(&self, id: u64) -> Vec<Arc<Room<T>>> {
        self.draining
            .lock()
            .values()
            .filter(|(r, _)| r.id() == id)
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// Counts a peer message about a room this engine does not have (or that does not
    /// involve that peer).
    pub fn unknown_room(&self) {
        self.node
            .metrics
            .unknown_room_frames
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One role of engine: the room data it keeps and what it does that the other does not.
/// The calls that are the same for both roles are the functions of this module, over
/// any `Side`.
pub(crate) trait Side: Events + Sized + Send + Sync + 'static {
    /// The role's data per room.
    type Ext: Send + Sync + 'static;

    fn core(&self) -> &Core<Self::Ext>;

    /// The peers a room talks to, with the generation messages about it carry (always
    /// the decode side's generation).
    fn parties(&self, room: &Room<Self::Ext>) -> Vec<(Arc<Peer>, u64)>;

    /// Tells the peers of `room`, which just failed, with an Abort (but `origin`, where
    /// the failure came from).
    fn tell_failed(&self, room: &Room<Self::Ext>, msg: &str, origin: Option<&Arc<Peer>>);

    /// Whether no peer can still write into the room's memory by a means the room's io
    /// count does not cover (RDMA writes into a decode room). True by default.
    fn quiet(&self, _room: &Room<Self::Ext>) -> bool {
        true
    }

    /// A room's deadline passed: what to append to its reason (what it was waiting for),
    /// starting with its separator.
    fn deadline_note(&self, _room: &Room<Self::Ext>) -> Option<String> {
        None
    }

    /// Watchdog duty for one room (live, terminal or cleared and draining), each scan.
    fn watch(&self, _room: &Room<Self::Ext>, _now: u64) {}

    /// Watchdog duty once per scan, after the rooms.
    fn tick(&self, _now: u64) {}

    /// The room is being cleared (it is terminal): what the role keeps of it.
    fn on_clear(&self, _room: &Room<Self::Ext>) {}
}

/// The state of room `id`: one shard read and one atomic load.
pub(crate) fn poll<S: Side>(side: &S, id: u64) -> Result<State> {
    side.core()
        .rooms
        .state(id)
        .ok_or_else(|| err!(NotFound, "room {id} not found"))
}

/// Fails room `id` with `reason` unless it is terminal, and tells its peers.
pub(crate) fn abort<S: Side>(side: &S, id: u64, reason: &str) -> Result<()> {
    let room = side.core().room(id)?;
    let message = if reason.is_empty() {
        format!("room {id} aborted by the local scheduler")
    } else {
        format!("room {id} aborted: {reason}")
    };
    lifecycle::fail(
        side,
        &room,
        FailureReason::local(Cause::Aborted, message),
        None,
    );
    Ok(())
}

/// The failure reason of room `id`, which must be `Failed`.
pub(crate) fn failure<S: Side>(side: &S, id: u64) -> Result<FailureReason> {
    let room = side.core().room(id)?;
    room.failure().cloned().ok_or_else(|| {
        err!(
            WrongState,
            "room {id} is {}, not failed: it has no failure reason",
            room.state()
        )
    })
}

/// Whether no transport operation can still touch the room's memory.
pub(crate) fn fully_drained<S: Side>(side: &S, room: &Room<S::Ext>) -> bool {
    room.drained() && side.quiet(room)
}

/// Whether room `id`'s memory may be reused (see `Engine::room_drained`).
pub(crate) fn drained<S: Side>(side: &S, id: u64) -> Result<bool> {
    let room = side.core().room(id)?;
    Ok(fully_drained(side, &room))
}

/// The path room `id`'s data takes with its peers (see `Engine::room_path`).
pub(crate) fn path<S: Side>(side: &S, id: u64) -> Result<crate::DataPath> {
    let room = side.core().room(id)?;
    Ok(crate::DataPath::of(
        side.parties(&room)
            .iter()
            .map(|(peer, _)| peer.path.get().map(|p| p.data_path())),
    ))
}

/// Releases room `id` (aborting it first if live); never waits (see
/// `Engine::room_clear`).
pub(crate) fn clear<S: Side>(side: &S, id: u64) -> Result<()> {
    let core = side.core();
    let room = core.room(id)?;
    lifecycle::fail(
        side,
        &room,
        FailureReason::local(Cause::Aborted, format!("room {id} cleared while live")),
        None,
    );
    side.on_clear(&room);
    if core
        .rooms
        .remove_generation(id, room.generation())
        .is_none()
    {
        return Ok(()); // a concurrent clear of the same room took it
    }
    if fully_drained(side, &room) {
        forget(side, &room);
    } else {
        let key = (id, room.generation());
        core.draining.lock().insert(key, (room, core.node.now_ms()));
    }
    Ok(())
}

/// Drops a cleared room from its peers' room sets.
fn forget<S: Side>(side: &S, room: &Room<S::Ext>) {
    for (peer, _) in side.parties(room) {
        peer.rooms.lock().remove(&(room.id(), room.generation()));
    }
}

/// Watchdog duty: releases cleared rooms that have drained. One still held by a peer
/// past `drain_timeout_ms` after its clear has that peer cut off (a TCP peer stalled in
/// the middle of a frame; over RDMA the decode side's drain deadline does it).
pub(crate) fn release_drained<S: Side>(side: &S, now: u64) {
    let core = side.core();
    let rooms: Vec<(Arc<Room<S::Ext>>, u64)> = core.draining.lock().values().cloned().collect();
    let drain_ms = core.node.config.drain_timeout_ms;
    for (room, since) in rooms {
        side.watch(&room, now);
        if fully_drained(side, &room) {
            forget(side, &room);
            core.draining.lock().remove(&(room.id(), room.generation()));
            continue;
        }
        let held = now.saturating_sub(since);
        if held > drain_ms && room.io_in_flight() > 0 {
            for (peer, _) in side.parties(&room) {
                if !peer.is_lost() {
                    core.control.lose(
                        &peer,
                        format!(
                            "still in the middle of a transfer of room {}, cleared {held} ms \
                             ago (drain_timeout_ms={drain_ms})",
                            room.id()
                        ),
                    );
                }
            }
        }
    }
}

/// Fails every live room of the engine: it is stopping.
pub(crate) fn fail_all<S: Side>(side: &S) {
    for room in side.core().rooms.snapshot() {
        lifecycle::fail(
            side,
            &room,
            FailureReason::local(Cause::Shutdown, "engine shut down"),
            None,
        );
    }
}

/// A peer was lost: every room of ours that depended on it fails with `cause` and the
/// peer's loss as the reason (the peer itself is not told: it is gone). Rooms cleared
/// and still draining are among them; they drain with the loss.
pub(crate) fn fail_rooms_of<S: Side>(
    side: &S,
    peer: &Arc<Peer>,
    cause: Cause,
) -> Vec<Arc<Room<S::Ext>>> {
    let core = side.core();
    let rooms: Vec<(u64, u64)> = peer.rooms.lock().drain().collect();
    let mut out = Vec::with_capacity(rooms.len());
    for (id, generation) in rooms {
        if let Some(room) = core.find_room(id, generation) {
            lifecycle::fail(
                side,
                &room,
                FailureReason::local(cause, peer.loss()),
                Some(peer),
            );
            out.push(room);
        }
    }
    out
}

/// Counters and gauges.
pub(crate) fn metrics<S: Side>(side: &S) -> MetricsSnapshot {
    let core = side.core();
    let mut s = core.node.metrics.snapshot();
    for room in core.rooms.snapshot() {
        let st = room.state();
        s.rooms_by_state[st as usize] += 1;
        if !st.is_terminal() {
            s.inflight += 1;
        }
    }
    s.rooms_draining = core.draining.lock().len() as u64;
    s
}
