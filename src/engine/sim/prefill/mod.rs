//! A simulated prefill engine: the library's pure cores ([`Ledger`], [`Holding`],
//! [`AckTable`], [`Planning`], the state rule) and its routing of decode engines'
//! messages (`src/engine/prefill/arrivals/`, run on this engine through [`Sim`]), under
//! a single-threaded shell that applies their outcomes as `mod.rs` and `sender.rs` do,
//! with the sender's writes one page at a time. A chunk handed on is planned by its caller at
//! once, by the room's worker a random while later, or by the sender that takes the
//! room's batches down to the reserve; the draws of who may plan stand in for the
//! engine's rule (a chunk's size, the workers).

mod hand_off;
mod host;
mod shell;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::check;
use super::net::Msg;
use super::{engine_id, Ev, Host, Reason, SimPeer, World, BOOTSTRAP_US, TICK_US, WAITING_US};
use crate::engine::peer_ref::PeerRef;
use crate::engine::prefill::acks::AckTable;
use crate::engine::prefill::arrivals;
use crate::engine::prefill::completion::Completion;
use crate::engine::prefill::holding::{Holding, Limits};
use crate::engine::prefill::layers::{self, Chunks};
use crate::engine::prefill::ledger::{Ledger, Standing};
use crate::engine::prefill::planning::Next;
use crate::engine::prefill::Chunk;
use crate::room::{Cause, Event, State};

pub(crate) use hand_off::worker;
use hand_off::{hand_on, hand_on_held, plan_waiting, to_worker, HandOff, Planner};
pub(crate) use host::{host_abort, host_create, host_enqueue, host_poll};
use shell::Sim;

pub(crate) struct PRoom {
    pub req: usize,
    pub rgen: u64,
    pub state: State,
    pub reason: Option<Reason>,
    pub ledger: Ledger<SimPeer>,
    pub deadline: u64,
    /// The host's calls still to make: (chunk, layer; none for a whole chunk).
    calls: VecDeque<(u32, Option<u32>)>,
    /// The room's chunks as the library admits them (`layers::Chunks`).
    admitted: Chunks,
    /// Who plans the calls admitted, and when.
    hand_off: HandOff,
    /// Writes not made yet, each a batch: (destination, its generation, page, kv buffer).
    todo: VecDeque<(SimPeer, u64, u32, u32)>,
    /// A sender step is scheduled.
    stepping: bool,
    /// Writes made and not completed.
    pub io: u32,
    /// The library's rule for when the room is complete, with each destination's Done.
    completion: Completion<(SimPeer, u64, u32)>,
}

pub(crate) struct PEngine {
    rdma: bool,
    pub rooms: BTreeMap<u64, PRoom>,
    /// Cleared rooms with writes still in flight.
    draining: Vec<(u64, PRoom)>,
    holding: Holding<SimPeer>,
    acks: AckTable<SimPeer>,
    /// Its incarnation: how often it crashed and started again.
    pub epoch: u32,
    /// Links whose loss this engine noticed (`Peer::is_lost`): (decode engine, link
    /// incarnation).
    lost: HashSet<(usize, u32)>,
    /// The rooms (id and use) that depend on each link, as the live engine indexes them
    /// per peer (`Peer::rooms`): recorded when a destination is attached.
    deps: HashMap<(usize, u32), Vec<(u64, u64)>>,
    /// Cleared rooms (id and use) whose source pages the host took back: the drain rule
    /// (`room::drained`) said no write of theirs was in flight.
    pub released: HashSet<(u64, u64)>,
    /// The highest decode generation heard from each engine (by engine id) for each id.
    pub heard: HashMap<(u64, u64), u64>,
    /// Host retries of a create, per request.
    retries: HashMap<usize, u32>,
}

impl PEngine {
    pub fn new(rdma: bool, epoch: u32) -> PEngine {
        PEngine {
            rdma,
            rooms: BTreeMap::new(),
            draining: Vec::new(),
            // Small bounds, so that overflow is exercised.
            holding: Holding::new(Limits {
                dests: 8,
                pages: 24,
                tombstones: 8,
                cleared: 8,
            }),
            acks: AckTable::default(),
            epoch,
            lost: HashSet::new(),
            deps: HashMap::new(),
            released: HashSet::new(),
            heard: HashMap::new(),
            retries: HashMap::new(),
        }
    }

    /// No room, no drain, no acknowledgement waits, nothing held.
    pub fn idle(&self) -> bool {
        self.rooms.is_empty()
            && self.draining.is_empty()
            && self.acks.len() == 0
            && self.holding.is_empty()
    }

    /// What the engine's tables hold: held records and waiting acknowledgements.
    pub fn tables(&self) -> (usize, usize) {
        (self.holding.len(), self.acks.len())
    }
}

/// What a room in `state` is, for the ledger; `failure`: its reason, if it failed.
fn standing(state: State, failure: Option<&str>) -> Standing<'_> {
    match state {
        State::Success => Standing::Succeeded,
        State::Failed => Standing::Failed(failure.unwrap_or("")),
        _ => Standing::Live,
    }
}

/// A message from decode engine `d` over link incarnation `inc`.
pub(crate) fn on_message(w: &mut World, p: usize, d: usize, inc: u32, msg: Msg) {
    let peer = w.decode_peer(d, inc);
    w.note(|| format!("p{p} <- d{d}: {msg:?}"));
    match msg {
        Msg::Dest { id, dgen, pages } => {
            heard(w, p, peer, id, dgen);
            arrivals::on_destination(&mut Sim { w, p }, &peer, id, dgen, pages, None);
        }
        Msg::Abort { id, dgen, reason } => {
            arrivals::on_abort(&mut Sim { w, p }, &peer, id, dgen, reason);
            heard(w, p, peer, id, dgen);
            if w.prefills[p].rdma {
                arrivals::ack_abort(&mut Sim { w, p }, &peer, id, dgen);
            }
        }
        _ => {}
    }
}

fn heard(w: &mut World, p: usize, peer: SimPeer, id: u64, dgen: u64) {
    let key = (peer.engine().expect("sim peers know their engine"), id);
    let h = w.prefills[p].heard.entry(key).or_default();
    *h = (*h).max(dgen);
}

/// Every destination arrived: the room is ready, and sends the chunks enqueued.
fn ready(w: &mut World, p: usize, id: u64) {
    if !transit(w, p, id, Event::Ready) {
        return;
    }
    let room = w.prefills[p].rooms.get_mut(&id).expect("ready room");
    room.deadline = w.now + WAITING_US;
    hand_on_held(w, p, id);
}

/// Applies `event` to room `id` through the state rule; whether it applied.
fn transit(w: &mut World, p: usize, id: u64, event: Event) -> bool {
    let name = |req| format!("p{p} room {id} (req {req})");
    check::apply(w, event, name, |w| {
        let room = w.prefills[p].rooms.get_mut(&id)?;
        Some((&mut room.state, room.req))
    })
}

/// The sender's next write of room `id`: it takes the room's next batch, as a sender
/// takes one from its outbox (`send.rs`), and writes it if the room is still this use
/// and live. A room that failed keeps its batches queued, as the engine's outboxes do,
/// and each is skipped as it is taken (`write_batch`: ended unwritten, and no Done,
/// `try_complete` finding the room terminal); its failure told the decode side.
pub(crate) fn send_step(w: &mut World, p: usize, id: u64, rgen: u64) {
    let this = w.prefills[p].rooms.get(&id).is_some_and(|r| r.rgen == rgen);
    if !this {
        return;
    }
    // The state rule refuses a terminal room's "transferring" (the reference design's
    // rule takes it: the room is resurrected, and its batch written).
    let live = transit(w, p, id, Event::Start);
    let rng = &mut w.rng;
    let room = w.prefills[p].rooms.get_mut(&id).expect("this use");
    let Some((peer, dgen, page, buffer)) = room.todo.pop_front() else {
        room.stepping = false;
        return;
    };
    // As a sender does with the batch it took: once the room's batches are down to the
    // reserve, the layers that waited behind them are planned first.
    match room.hand_off.planning.taken(|_| Planner::Sender.plans(rng)) {
        Next::Plan(chunk) => plan_waiting(w, p, id, Planner::Sender, chunk),
        Next::Worker => to_worker(w, p, id),
        Next::Idle => {}
    }
    // A room that failed (before this step, or meanwhile) has its batch skipped.
    let room = w.prefills[p].rooms.get_mut(&id).expect("this use");
    if !live || room.state.is_terminal() {
        room.completion.ended();
        room.stepping = !room.todo.is_empty();
        if room.stepping {
            w.at(1, Ev::SendStep { p, id, rgen });
        }
        return;
    }
    let (req, rgen) = (room.req, room.rgen);
    if !w.net.alive(p, peer.node, peer.inc) {
        let why = format!("the link to d{} broke", peer.node);
        return fail(w, p, id, (Cause::Transfer, why), None);
    }
    room.io += 1;
    let more = !room.todo.is_empty();
    room.stepping = more;
    w.note(|| format!("p{p} writes page {page} of room {id} to d{}", peer.node));
    let write = Msg::Write {
        id,
        dgen,
        page,
        buffer,
        req,
        rgen,
    };
    w.send_to_decode(p, peer.node, peer.inc, write);
    if !w.net.rdma {
        // Over TCP a write is done once the bytes are in the socket.
        w.at(1, Ev::WriteDone { p, id, rgen });
    }
    if more {
        let after = w.rng.range(20, 300);
        w.at(after, Ev::SendStep { p, id, rgen });
    }
}

/// A write of room `id` (use `rgen`) completed.
pub(crate) fn write_done(w: &mut World, p: usize, id: u64, rgen: u64) {
    // The transport read the room's source pages until now.
    check::source_held(w, p, id, rgen);
    let e = &mut w.prefills[p];
    if let Some(i) = e
        .draining
        .iter()
        .position(|(i, r)| *i == id && r.rgen == rgen)
    {
        e.draining[i].1.io -= 1;
        let r = &e.draining[i].1;
        if crate::room::drained(r.state, r.io) {
            e.draining.remove(i);
            e.released.insert((id, rgen));
        }
        return send_due(w, p);
    }
    let Some(room) = e.rooms.get_mut(&id).filter(|r| r.rgen == rgen) else {
        return;
    };
    room.io -= 1;
    room.completion.ended();
    // As the sender does: the Dones are taken by whoever ends the last batch, and go
    // only if the room can still claim SUCCESS.
    let due = room.completion.due();
    if let Some(dests) = due.filter(|_| transit(w, p, id, Event::Complete)) {
        w.note(|| format!("p{p} room {id} sent"));
        for (peer, dgen, pages) in dests {
            w.send_to_decode(p, peer.node, peer.inc, Msg::Done { id, dgen, pages });
        }
    }
    send_due(w, p);
}

/// Fails room `id` unless it is terminal; the winner tells the parties the ledger names
/// (and over RDMA queues their acknowledgements), as `lifecycle::fail` and
/// `tell_failed` do.
pub(crate) fn fail(w: &mut World, p: usize, id: u64, reason: Reason, origin: Option<SimPeer>) {
    if !transit(w, p, id, Event::Fail) {
        return;
    }
    check::reason(w, &reason);
    let rdma = w.prefills[p].rdma;
    let room = w.prefills[p].rooms.get_mut(&id).expect("failed room");
    // Its batches stay queued: the sender skips each as it takes it (`send_step`).
    let (req, rgen) = (room.req, room.rgen);
    let told = room.ledger.told(origin.as_ref());
    room.reason = Some(reason.clone());
    w.note(|| format!("p{p} room {id} (req {req}) failed: {reason:?}"));
    for (peer, dgen) in told.aborts {
        let msg = Msg::Abort {
            id,
            dgen,
            reason: reason.1.clone(),
        };
        w.send_to_decode(p, peer.node, peer.inc, msg);
    }
    if rdma {
        for (peer, dgen) in told.acks {
            w.prefills[p].acks.queue(id, rgen, peer, dgen);
        }
    }
    send_due(w, p);
}

/// Sends the acknowledgements whose rooms have no write in flight.
fn send_due(w: &mut World, p: usize) {
    let e = &mut w.prefills[p];
    let (rooms, draining) = (&e.rooms, &e.draining);
    let busy = |id: u64, rgen: u64| {
        rooms.get(&id).is_some_and(|r| r.rgen == rgen && r.io > 0)
            || draining
                .iter()
                .any(|(i, r)| *i == id && r.rgen == rgen && r.io > 0)
    };
    let mut due = e.acks.due(busy);
    // The table's order is a hash map's: sorted, so that a seed replays.
    due.sort_by_key(|&(peer, id, dgen)| (id, dgen, peer.node, peer.inc));
    for (peer, id, dgen) in due {
        w.note(|| format!("p{p} acknowledges d{}'s abort of room {id}", peer.node));
        w.send_to_decode(p, peer.node, peer.inc, Msg::AbortAck { id, dgen });
    }
}

/// The watchdog: deadlines, expired held destinations, acknowledgements due.
pub(crate) fn tick(w: &mut World, p: usize) {
    let now = w.now;
    let late: Vec<(u64, Reason)> = w.prefills[p]
        .rooms
        .iter()
        .filter_map(|(&id, r)| super::overdue(r.state, r.deadline, now).map(|why| (id, why)))
        .collect();
    for (id, why) in late {
        fail(w, p, id, why, None);
    }
    arrivals::expire(&mut Sim { w, p }, now);
    send_due(w, p);
}

/// The engine noticed that its link (incarnation `inc`) to decode `d` broke.
pub(crate) fn lost(w: &mut World, p: usize, d: usize, inc: u32) {
    let peer = w.decode_peer(d, inc);
    let why = format!("lost d{d} (inc {inc})");
    w.note(|| format!("p{p} notices {why}"));
    w.prefills[p].lost.insert((d, inc));
    arrivals::lost(&mut Sim { w, p }, &peer, &why);
    // As `core::fail_rooms_of`: the rooms the index names, if still that use.
    let deps = w.prefills[p].deps.remove(&(d, inc)).unwrap_or_default();
    for (id, rgen) in deps {
        if w.prefills[p].rooms.get(&id).is_some_and(|r| r.rgen == rgen) {
            fail(w, p, id, (Cause::PeerLost, why.clone()), Some(peer));
        }
    }
    check::loss_fails(w, p, peer);
}
