//! A simulated decode engine: the library's [`DecodeRoom`] (destination, grants taken
//! once, landed bytes, Done claims, quiet peers, the drain deadline) and the state rule,
//! under a single-threaded shell that applies their outcomes as
//! `src/engine/decode/mod.rs` and `receive.rs` do; and the host, which gives a room's
//! pages back once it is drained. The simulated memory knows which room each page was
//! granted to, and checks every write that lands.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;

use super::check::{self, Invariant};
use super::net::Msg;
use super::{Ev, Host, Reason, SimPeer, World, DRAIN_US, TICK_US, WAITING_US};
mod shell;

use crate::engine::decode::arrivals::{self, Shell};
use crate::engine::decode::room::{DecodeRoom, Facts, Settle};
use crate::proto::{DataHeader, Message, Target};
use crate::room::{Cause, Event, State};
use shell::Sim;

/// Bytes of one page in one buffer.
const PAGE: u64 = 4096;
/// Pages of each decode engine's KV memory.
const PAGES: u32 = 32;

pub(crate) struct DRoom {
    pub req: usize,
    pub dgen: u64,
    pub state: State,
    pub reason: Option<Reason>,
    /// Shared with the thread that sends the destination (`Rc`: the engine's connect
    /// thread holds the room until it did, even past a clear).
    pub core: Rc<DecodeRoom<SimPeer>>,
    pub pages: Vec<u32>,
    pub deadline: u64,
    pub failed_at: Option<u64>,
    /// The model's layers (kv buffers).
    pub layers: u32,
    /// What landed, as the memory saw it: (prefill engine's place in the room, kv
    /// buffer, page).
    landed: HashMap<(usize, u32, u32), u32>,
}

impl DRoom {
    /// How often page `k.2` of kv buffer `k.1` landed from the room's prefill engine
    /// `k.0`.
    pub fn landed_count(&self, k: &(usize, u32, u32)) -> u32 {
        self.landed.get(k).copied().unwrap_or(0)
    }
}

pub(crate) struct DEngine {
    rdma: bool,
    pub rooms: BTreeMap<u64, DRoom>,
    next_gen: u64,
    /// Its incarnation: how often it crashed and started again.
    pub epoch: u32,
    free: Vec<u32>,
    /// Which use of which room each page is granted to now: (request, id, generation).
    owner: Vec<Option<(usize, u64, u64)>>,
    /// Links whose loss this engine noticed: (prefill engine, link incarnation).
    lost: HashSet<(usize, u32)>,
    /// Acknowledgements heard, and Aborts sent or heard, per (room, generation, prefill
    /// engine and link).
    acked: HashMap<(u64, u64, SimPeer), u32>,
    aborts: HashMap<(u64, u64, SimPeer), u32>,
    /// Rooms whose destination is still to be sent, by (id, generation).
    sending: HashMap<(u64, u64), Rc<DecodeRoom<SimPeer>>>,
    retries: HashMap<usize, u32>,
}

impl DEngine {
    pub fn new(rdma: bool, epoch: u32) -> DEngine {
        DEngine {
            rdma,
            rooms: BTreeMap::new(),
            next_gen: 1,
            epoch,
            free: (0..PAGES).rev().collect(),
            owner: vec![None; PAGES as usize],
            lost: HashSet::new(),
            acked: HashMap::new(),
            aborts: HashMap::new(),
            sending: HashMap::new(),
            retries: HashMap::new(),
        }
    }

    /// Counts an Abort sent for `id` by no room of ours (a stranger's, generation 0).
    pub fn stranger_abort(&mut self, id: u64, peer: SimPeer) {
        *self.aborts.entry((id, 0, peer)).or_default() += 1;
    }

    /// No room, and every page back.
    pub fn idle(&self) -> bool {
        self.rooms.is_empty() && self.free.len() == PAGES as usize
    }

    /// Whether room `id` is drained: terminal, and over RDMA succeeded, never sent its
    /// destination, or heard from every peer that it can write no more.
    pub fn drained_now(&self, room: &DRoom) -> bool {
        room.state.is_terminal()
            && (!self.rdma || room.state == State::Success || room.core.quiet())
    }
}

/// The room `id` of this engine if it is use `dgen`.
fn this(w: &mut World, d: usize, id: u64, dgen: u64) -> Option<&mut DRoom> {
    w.decodes[d].rooms.get_mut(&id).filter(|r| r.dgen == dgen)
}

/// Room `id` if it is use `dgen`, live, and pulls from `peer`; with `peer`'s place in it.
fn live_party(
    w: &mut World,
    d: usize,
    peer: SimPeer,
    id: u64,
    dgen: u64,
) -> Option<(&mut DRoom, usize)> {
    let room = this(w, d, id, dgen).filter(|r| !r.state.is_terminal())?;
    let idx = room.core.index_of(&peer)?;
    Some((room, idx))
}

pub(crate) fn on_message(w: &mut World, d: usize, p: usize, inc: u32, msg: Msg) {
    let peer = w.prefill_peer(p, inc);
    w.note(|| format!("d{d} <- p{p}: {msg:?}"));
    match msg {
        Msg::Write {
            id,
            dgen,
            page,
            buffer,
            req,
            rgen,
        } => {
            let run = Run {
                id,
                dgen,
                page,
                buffer,
                req,
            };
            write(w, d, peer, run);
            if w.net.rdma {
                // The prefill's completion: the bytes are in the page.
                let after = w.rng.range(1, 50);
                w.at(after, Ev::WriteDone { p, id, rgen });
            }
        }
        Msg::Done { id, dgen, pages } => {
            arrivals::on_done(&mut Sim { w, d }, &peer, id, dgen, pages, false);
        }
        Msg::Abort { id, dgen, reason } => {
            *w.decodes[d].aborts.entry((id, dgen, peer)).or_default() += 1;
            arrivals::on_abort(&mut Sim { w, d }, &peer, id, dgen, reason);
        }
        Msg::AbortAck { id, dgen } => {
            w.checking(Invariant::OneAck);
            let e = &mut w.decodes[d];
            let n = e.acked.entry((id, dgen, peer)).or_default();
            *n += 1;
            // One per Abort each way: ours, and the prefill's refusal (each comes with
            // its acknowledgement); they may cross.
            let aborts = e.aborts.get(&(id, dgen, peer)).copied().unwrap_or(0);
            if *n > aborts {
                let detail = format!(
                    "d{d} room {id} (use {dgen}) acknowledged {n} times by p{p} for {aborts} \
                     abort(s)"
                );
                w.broke(Invariant::OneAck, detail);
            }
            arrivals::on_abort_ack(&mut Sim { w, d }, &peer, id, dgen);
        }
        Msg::Dest { .. } => {}
    }
}

/// One write: page `page` of kv buffer `buffer` of room `id` (use `dgen`), for request
/// `req`.
#[derive(Clone, Copy)]
struct Run {
    id: u64,
    dgen: u64,
    page: u32,
    buffer: u32,
    req: usize,
}

/// A write landing: over RDMA whatever the room is; over TCP only once the receiver
/// checked it (the room live, the page granted, its bytes not taken before).
fn write(w: &mut World, d: usize, peer: SimPeer, run: Run) {
    if w.net.rdma {
        return land(w, d, peer, run);
    }
    let Some((room, idx)) = live_party(w, d, peer, run.id, run.dgen) else {
        return;
    };
    // With several prefill engines each sends its heads: its part of every page.
    let n = room.core.peers.len() as u32;
    let part = PAGE as u32 / n;
    let header = DataHeader {
        room: run.id,
        generation: run.dgen,
        target: Target::Kv,
        buffer: run.buffer,
        first_page: run.page,
        n_pages: 1,
        byte_len: part,
        page_off: idx as u32 * part,
        digest: 0,
    };
    let runs = std::iter::once((header, run.buffer, n > 1));
    if let Err(why) = room.core.take_grants(idx, runs) {
        return fail(w, d, run.id, (Cause::Protocol, why), None);
    }
    land(w, d, peer, run);
}

/// The bytes are in the page: the memory checks whose page it is; the room counts them.
fn land(w: &mut World, d: usize, peer: SimPeer, run: Run) {
    let Run {
        id,
        dgen,
        page,
        buffer,
        req,
    } = run;
    let owner = w.decodes[d].owner.get(page as usize).copied().flatten();
    check::landing(w, d, page, owner, (req, id, dgen));
    let Some(room) = this(w, d, id, dgen) else {
        return;
    };
    let Some(idx) = room.core.index_of(&peer) else {
        return;
    };
    *room.landed.entry((idx, buffer, page)).or_default() += 1;
    let part = PAGE / room.core.peers.len() as u64;
    let waiting = room.core.count(idx, &[(buffer, part)], 0);
    if room.state == State::WaitingForInput {
        transit(w, d, id, Event::Start);
    }
    let mut sim = Sim { w, d };
    if let Some(room) = sim.room(id, dgen).filter(|_| waiting) {
        arrivals::settle(&mut sim, &room, idx);
    }
}

fn transit(w: &mut World, d: usize, id: u64, event: Event) -> bool {
    let name = |req| format!("d{d} room {id} (req {req})");
    check::apply(w, event, name, |w| {
        let room = w.decodes[d].rooms.get_mut(&id)?;
        Some((&mut room.state, room.req))
    })
}

/// Fails room `id` unless terminal; the winner tells the peers its destination went to
/// (but `origin`), as `tell_failed` does under the room's lock.
pub(crate) fn fail(w: &mut World, d: usize, id: u64, reason: Reason, origin: Option<SimPeer>) {
    if !transit(w, d, id, Event::Fail) {
        return;
    }
    check::reason(w, &reason);
    let now = w.now;
    let room = w.decodes[d].rooms.get_mut(&id).expect("failed room");
    room.failed_at = Some(now);
    room.reason = Some(reason.clone());
    let (req, dgen) = (room.req, room.dgen);
    let core = room.core.clone();
    w.note(|| format!("d{d} room {id} (req {req}) failed: {reason:?}"));
    arrivals::tell_failed(
        &mut Sim { w, d },
        &core,
        (id, dgen),
        &reason.1,
        origin.as_ref(),
    );
}

/// The host creates the request's room once every prefill engine's link is up, an
/// earlier use of the id is cleared and pages are free; it then polls it.
pub(crate) fn host_create(w: &mut World, req: usize, d: usize) {
    let r = w.requests[req].clone();
    let e = &w.decodes[d];
    let peers: Option<Vec<SimPeer>> = r
        .prefills
        .iter()
        .map(|&p| {
            let inc = w.net.up(p, d)?;
            let peer = w.prefill_peer(p, inc);
            (!e.lost.contains(&(p, inc))).then_some(peer)
        })
        .collect();
    let ready = peers.filter(|_| !e.rooms.contains_key(&r.id) && e.free.len() >= r.pages);
    let Some(peers) = ready else {
        let n = w.decodes[d].retries.entry(req).or_default();
        *n += 1;
        if *n < 100 {
            w.at(TICK_US, Ev::Host(Host::DecodeCreate { req, d }));
        } else {
            w.room_done(req);
        }
        return;
    };
    let e = &mut w.decodes[d];
    let dgen = e.next_gen;
    e.next_gen += 1;
    let pages: Vec<u32> = (0..r.pages).map(|_| e.free.pop().expect("free")).collect();
    for &pg in &pages {
        e.owner[pg as usize] = Some((req, r.id, dgen));
    }
    let core = Rc::new(DecodeRoom::new(peers));
    core.set_destination(&pages, None);
    e.sending.insert((r.id, dgen), core.clone());
    e.rooms.insert(
        r.id,
        DRoom {
            req,
            dgen,
            // Its peers are connected: ready at once.
            state: State::WaitingForInput,
            reason: None,
            core,
            pages: pages.clone(),
            deadline: w.now + WAITING_US,
            failed_at: None,
            layers: r.layers,
            landed: HashMap::new(),
        },
    );
    w.note(|| {
        format!(
            "d{d} creates room {} (req {req}, use {dgen}) pages {pages:?}",
            r.id
        )
    });
    // The destination goes out once the peers are ready (a connect thread's work).
    let after = w.rng.range(0, 2_000);
    w.at(after, Ev::DestOut { d, id: r.id, dgen });
    let poll = w.rng.range(50, 1_000);
    w.at(poll, Ev::Host(Host::DecodePoll { req, d }));
}

/// The destination goes out, if the room is still live (decided under the room's lock
/// by [`DecodeRoom::send_destination`]).
pub(crate) fn dest_out(w: &mut World, d: usize, id: u64, dgen: u64) {
    let Some(core) = w.decodes[d].sending.remove(&(id, dgen)) else {
        return;
    };
    // A room cleared meanwhile is terminal (the thread holds the room, not the table).
    let state = this(w, d, id, dgen).map_or(State::Failed, |r| r.state);
    let mut to = Vec::new();
    let msg = |pages: &[u32], aux| Message::Destination {
        room: id,
        generation: dgen,
        pages: pages.to_vec(),
        aux_slot: aux,
    };
    core.send_destination(
        || state == State::WaitingForInput,
        msg,
        |peer, m| to.push((*peer, m.clone())),
    );
    for (peer, m) in to {
        if let Message::Destination { pages, .. } = m {
            w.note(|| format!("d{d} sends room {id}'s destination to p{}", peer.node));
            w.send_to_prefill(d, peer.node, peer.inc, Msg::Dest { id, dgen, pages });
        }
    }
}

/// The request's room of this engine, if it is the current use of its id.
fn room_of(w: &World, req: usize, d: usize) -> Option<u64> {
    let id = w.requests[req].id;
    w.decodes[d]
        .rooms
        .get(&id)
        .filter(|r| r.req == req)
        .map(|_| id)
}

pub(crate) fn host_abort(w: &mut World, req: usize, d: usize) {
    if let Some(id) = room_of(w, req, d) {
        let why = format!("decode host d{d} cancelled [req {req}]");
        fail(w, d, id, (Cause::Aborted, why), None);
    }
}

/// The host polls its room; once it is terminal and drained, it gives the pages back
/// (to the next request) and clears the room.
pub(crate) fn host_poll(w: &mut World, req: usize, d: usize) {
    let Some(id) = room_of(w, req, d) else {
        return;
    };
    let e = &w.decodes[d];
    if !e.drained_now(&e.rooms[&id]) {
        let poll = w.rng.range(50, 1_000);
        return w.at(poll, Ev::Host(Host::DecodePoll { req, d }));
    }
    let e = &mut w.decodes[d];
    let room = e.rooms.remove(&id).expect("room");
    for &pg in &room.pages {
        e.owner[pg as usize] = None;
        e.free.push(pg);
    }
    w.note(|| {
        format!(
            "d{d} gives back room {id}'s pages {:?} (req {req})",
            room.pages
        )
    });
    w.room_done(req);
}

/// The watchdog: deadlines of live rooms; over RDMA, a failed room's peers that did not
/// acknowledge within the drain deadline are cut off.
pub(crate) fn tick(w: &mut World, d: usize) {
    let now = w.now;
    let late: Vec<(u64, Reason)> = w.decodes[d]
        .rooms
        .iter()
        .filter_map(|(&id, r)| super::overdue(r.state, r.deadline, now).map(|why| (id, why)))
        .collect();
    for (id, why) in late {
        fail(w, d, id, why, None);
    }
    if !w.decodes[d].rdma {
        return;
    }
    let mut silent = Vec::new();
    for room in w.decodes[d].rooms.values() {
        if room.state == State::Failed {
            silent.extend(room.core.silent_past_drain(now, DRAIN_US));
        }
    }
    silent.sort_by_key(|p| (p.node, p.inc));
    silent.dedup();
    for peer in silent {
        if w.net.alive(peer.node, d, peer.inc) {
            w.note(|| {
                format!(
                    "d{d} cuts p{} off: silent past the drain deadline",
                    peer.node
                )
            });
            w.cut(peer.node, d);
        }
        lost(w, d, peer.node, peer.inc);
    }
}

/// The engine lost its link (incarnation `inc`) to prefill `p`: its rooms fail, and no
/// write of that link can land any more.
pub(crate) fn lost(w: &mut World, d: usize, p: usize, inc: u32) {
    let peer = w.prefill_peer(p, inc);
    if !w.decodes[d].lost.insert((p, inc)) {
        return;
    }
    w.note(|| format!("d{d} notices the loss of p{p} (inc {inc})"));
    let rooms: Vec<u64> = w.decodes[d]
        .rooms
        .iter()
        .filter(|(_, r)| r.core.index_of(&peer).is_some())
        .map(|(&id, _)| id)
        .collect();
    for id in rooms {
        let why = format!("lost p{p} (inc {inc})");
        fail(w, d, id, (Cause::PeerLost, why), Some(peer));
        if let Some(room) = w.decodes[d].rooms.get(&id) {
            room.core.peer_quiet(&peer);
        }
    }
}
