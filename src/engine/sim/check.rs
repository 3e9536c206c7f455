//! The invariants (DESIGN §1), checked against what the simulator knows for certain:
//! the requests of the workload, the owner of every decode page, and every message.

use super::{SimPeer, World, DRAIN_US, TICK_US};
use crate::engine::peer_ref::PeerRef;
use crate::engine::prefill::Chunk;
use crate::room::state::transition;
use crate::room::{Event, State};

/// What must always hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Invariant {
    /// §1.1: every room reaches SUCCESS or FAILED by its deadline (and the watchdog's
    /// period); nothing is left at the end.
    Terminal,
    /// §1.2: a terminal state is never left.
    Sticky,
    /// §1.3: a failure says why.
    Reason,
    /// §1.6: no byte lands in a decode page once its room gave it back (nor in a page
    /// granted to another room since).
    GivenBack,
    /// §1.5, §1.8: bytes land only in pages granted to their own request.
    ForeignBytes,
    /// §1.10: SUCCESS means every page of the destination arrived, from each prefill
    /// engine of the room, exactly once.
    TrueSuccess,
    /// §1.5: a late message about an earlier use of an id does not touch a later one.
    LateMessage,
    /// §1.9: a room is aborted only by its own engines.
    Stranger,
    /// RDMA: a destination's abort is acknowledged once.
    OneAck,
    /// §1.1, §1.6: a failed decode room drains (its pages can be given back) within its
    /// drain deadline.
    Drains,
    /// §1.5: the holding areas and acknowledgement tables stay bounded, and are empty at
    /// the end.
    Bounded,
    /// Issue 37's planning hand-off: a prefill room's calls are planned in the order they
    /// were handed on, each once (the layers of one chunk joined as they waited), by one
    /// thread at a time (none but its worker once the room is handed to it).
    InOrder,
    /// Issue 37's planning hand-off: what waits to be planned in a live prefill room has
    /// someone to plan it (the worker the room was handed to, or a sender with the
    /// room's batches to take down to the reserve).
    Attended,
    /// §1.1, §1.3: a prefill room whose decode engine is lost fails when the loss is
    /// noticed, naming it, not later at a deadline (the engine finds the rooms by its
    /// index of them per peer; checked against the rooms' ledgers).
    LossFails,
    /// §1.6, the prefill side: no write reads a source page once its room drained (the
    /// host may reuse the page then).
    SourceGivenBack,
}

/// An invariant broken: which, how, and when (virtual µs).
#[derive(Debug, Clone)]
pub(crate) struct Violation {
    pub invariant: Invariant,
    pub detail: String,
    pub at: u64,
}

/// The state rule applied to `from`: the new state if it applied, and what is wrong if
/// it left a terminal state.
pub(crate) fn transit(from: State, event: Event) -> (Option<State>, Option<String>) {
    match transition(from, event) {
        Ok(to) if from.is_terminal() && to != from => (
            Some(to),
            Some(format!("{event:?} moved it from {from} to {to}")),
        ),
        Ok(to) => (Some(to), None),
        Err(_) => (None, None),
    }
}

/// Applies `event` through the state rule to the room `room` finds in the world (its
/// state and request; named by `name(request)` in a report); whether it applied. Leaving
/// a terminal state breaks `Sticky`.
pub(crate) fn apply(
    w: &mut World,
    event: Event,
    name: impl FnOnce(usize) -> String,
    room: impl for<'a> Fn(&'a mut World) -> Option<(&'a mut State, usize)>,
) -> bool {
    let Some((&mut from, req)) = room(w) else {
        return false;
    };
    let (to, broken) = transit(from, event);
    w.checking(Invariant::Sticky);
    if let Some(b) = broken {
        w.broke(Invariant::Sticky, format!("{}: {b}", name(req)));
    }
    let Some(to) = to else {
        return false;
    };
    *room(w).expect("the room").0 = to;
    true
}

pub(crate) fn reason(w: &mut World, reason: &super::Reason) {
    w.checking(Invariant::Reason);
    if reason.1.trim().is_empty() {
        w.broke(
            Invariant::Reason,
            format!("a {:?} failure with no reason", reason.0),
        );
    }
}

/// An abort from prefill `p` failed decode room `id` (use `dgen`): `p` must be one of
/// the request's prefill engines.
pub(crate) fn party(w: &mut World, d: usize, id: u64, dgen: u64, p: usize) {
    w.checking(Invariant::Stranger);
    let req = w.decodes[d].rooms[&id].req;
    if !w.requests[req].prefills.contains(&p) {
        w.broke(
            Invariant::Stranger,
            format!("p{p}, no engine of request {req}, aborted d{d}'s room {id} (use {dgen})"),
        );
    }
}

/// A write of request `write.0` for room `write.1` (use `write.2`) lands in page `page`
/// of decode `d`, granted now to `owner`.
pub(crate) fn landing(
    w: &mut World,
    d: usize,
    page: u32,
    owner: Option<(usize, u64, u64)>,
    write: (usize, u64, u64),
) {
    w.checking(Invariant::GivenBack);
    w.checking(Invariant::ForeignBytes);
    let (req, id, dgen) = write;
    match owner {
        None => w.broke(
            Invariant::GivenBack,
            format!("a write of room {id} (use {dgen}) landed in d{d}'s page {page}, given back"),
        ),
        Some((_, oid, ogen)) if (oid, ogen) != (id, dgen) => w.broke(
            Invariant::GivenBack,
            format!(
                "a write of room {id} (use {dgen}) landed in d{d}'s page {page}, given back \
                 and granted to room {oid} (use {ogen}) since"
            ),
        ),
        Some((oreq, _, _)) if oreq != req => w.broke(
            Invariant::ForeignBytes,
            format!(
                "request {req}'s bytes landed in d{d}'s page {page}, granted to request {oreq} \
                 (room {id}, use {dgen})"
            ),
        ),
        Some(_) => {}
    }
}

/// Decode room `id` just succeeded: every page must have landed once from each of its
/// prefill engines.
pub(crate) fn success(w: &mut World, d: usize, id: u64) {
    w.checking(Invariant::TrueSuccess);
    let room = &w.decodes[d].rooms[&id];
    let n = room.core.peers.len();
    let missing = (0..n)
        .flat_map(|i| (0..room.layers).map(move |b| (i, b)))
        .flat_map(|(i, b)| room.pages.iter().map(move |&pg| (i, b, pg)))
        .find(|k| room.landed_count(k) != 1);
    if let Some((i, b, pg)) = missing {
        let got = room.landed_count(&(i, b, pg));
        let detail = format!(
            "d{d} room {id} succeeded with page {pg} of kv buffer {b} from its prefill engine \
             {i} landed {got} time(s)"
        );
        w.broke(Invariant::TrueSuccess, detail);
    }
}

/// An abort of decode use `dgen` may fail room `id` only if the engine has heard of no
/// later use of the id from that decode engine: a later one supersedes it (the two
/// cannot be live together on the decode side, and the link keeps their order).
///
/// Generation 0 is no use's: a stranger's abort, not a late message (what a stranger
/// may do is [`bound`]'s).
pub(crate) fn not_superseded(w: &mut World, p: usize, peer: SimPeer, id: u64, dgen: u64) {
    w.checking(Invariant::LateMessage);
    if dgen == 0 {
        return;
    }
    let engine = peer.engine().expect("sim peers know their engine");
    let newer = w.prefills[p].heard.get(&(engine, id)).copied();
    if let Some(newer) = newer.filter(|&g| g > dgen) {
        w.broke(
            Invariant::LateMessage,
            format!(
                "p{p} room {id} failed by d{}'s abort of use {dgen} after it heard of use \
                 {newer}",
                peer.node
            ),
        );
    }
}

/// A room bound to its request's decode engines fails by no other engine's abort.
pub(crate) fn bound(w: &mut World, p: usize, peer: SimPeer, id: u64) {
    w.checking(Invariant::Stranger);
    let req = w.prefills[p].rooms[&id].req;
    let r = &w.requests[req];
    if r.bound && !r.decodes.contains(&peer.node) {
        let detail = format!(
            "d{}, not bound to p{p}'s room {id} (req {req}), aborted it",
            peer.node
        );
        w.broke(Invariant::Stranger, detail);
    }
}

/// Prefill `p` plans `chunk` of room `id` (on its worker, or not): it must be the calls
/// handed on first, joined as they waited, each planned once, and by the worker if the
/// room was handed to it.
pub(crate) fn in_order(w: &mut World, p: usize, id: u64, chunk: &Chunk, worker: bool) {
    w.checking(Invariant::InOrder);
    let room = w.prefills[p].rooms.get_mut(&id).expect("a room plans");
    if !worker && room.worker_due() {
        let detail = format!(
            "p{p} room {id} (req {}) planned the call at {} on another thread while the \
             room was handed to its worker",
            room.req, chunk.start
        );
        return w.broke(Invariant::InOrder, detail);
    }
    if !room.plans_in_order(chunk) {
        let detail = format!(
            "p{p} room {id} (req {}) planned the call at {} (kv buffers {:?}, last: {}) out \
             of order or twice",
            room.req, chunk.start, chunk.buffers, chunk.is_last
        );
        w.broke(Invariant::InOrder, detail);
    }
}

/// After every step: deadlines, drains, bounds, and no call stranded.
pub(crate) fn after_step(w: &mut World) {
    let now = w.now;
    let slack = 2 * TICK_US;
    w.checking(Invariant::Terminal);
    let mut broken = None;
    for (p, e) in w.prefills.iter().enumerate() {
        for (id, r) in &e.rooms {
            if !r.state.is_terminal() && now > r.deadline + slack {
                broken = Some(format!(
                    "p{p} room {id} still {} past its deadline",
                    r.state
                ));
            }
        }
    }
    for (d, e) in w.decodes.iter().enumerate() {
        for (id, r) in &e.rooms {
            if !r.state.is_terminal() && now > r.deadline + slack {
                broken = Some(format!(
                    "d{d} room {id} still {} past its deadline",
                    r.state
                ));
            }
        }
    }
    if let Some(b) = broken {
        w.broke(Invariant::Terminal, b);
    }
    w.checking(Invariant::Drains);
    let mut stuck = None;
    for (d, e) in w.decodes.iter().enumerate() {
        for (id, r) in &e.rooms {
            let late = r
                .failed_at
                .is_some_and(|t| now > t + DRAIN_US + 4 * TICK_US);
            if late && !e.drained_now(r) {
                stuck = Some(format!(
                    "d{d} room {id} failed and not drained past its drain deadline"
                ));
            }
        }
    }
    if let Some(s) = stuck {
        w.broke(Invariant::Drains, s);
    }
    w.checking(Invariant::Bounded);
    // The holding area's bounds (8 destinations, 8 tombstones, 8 cleared-use records),
    // and an acknowledgement per destination of each room of the cluster.
    let over = w.prefills.iter().enumerate().find_map(|(p, e)| {
        let (held, acks) = e.tables();
        (held > 24 || acks > 256)
            .then(|| format!("p{p} holds {held} records and {acks} acknowledgements"))
    });
    if let Some(detail) = over {
        w.broke(Invariant::Bounded, detail);
    }
    w.checking(Invariant::Attended);
    let stranded = w.prefills.iter().enumerate().find_map(|(p, e)| {
        let mut rooms = e.rooms.iter();
        let (id, r) = rooms.find(|(_, r)| !r.state.is_terminal() && r.stranded())?;
        Some(format!(
            "p{p} room {id} (req {}) has calls waiting with no one to plan them",
            r.req
        ))
    });
    if let Some(detail) = stranded {
        w.broke(Invariant::Attended, detail);
    }
}

/// At the end of a run: every room gone, every page back, every table empty.
pub(crate) fn at_end(w: &mut World) {
    w.checking(Invariant::Terminal);
    let mut left = None;
    for (p, e) in w.prefills.iter().enumerate() {
        if let Some((id, r)) = e.rooms.iter().next() {
            let detail = format!(
                "p{p} room {id} (req {}) still {} at the end",
                r.req, r.state
            );
            left = Some((Invariant::Terminal, detail));
        } else if !e.idle() {
            let (held, acks) = e.tables();
            let detail = format!("p{p} still holds {held} records, {acks} acknowledgements");
            left = Some((Invariant::Bounded, detail));
        }
    }
    for (d, e) in w.decodes.iter().enumerate() {
        if let Some((id, r)) = e.rooms.iter().next() {
            let detail = format!(
                "d{d} room {id} (req {}) still {} (its pages not given back) at the end",
                r.req, r.state
            );
            let inv = if r.state.is_terminal() {
                Invariant::Drains
            } else {
                Invariant::Terminal
            };
            left = Some((inv, detail));
        }
    }
    if let Some((inv, detail)) = left {
        w.broke(inv, detail);
    }
}

/// Prefill `p` noticed the loss of `peer`: no live room of it still holds a destination
/// from that link.
pub(crate) fn loss_fails(w: &mut World, p: usize, peer: SimPeer) {
    w.checking(Invariant::LossFails);
    let e = &w.prefills[p];
    let live = e.rooms.iter().filter(|(_, r)| !r.state.is_terminal());
    let mut holding = live.filter(|(_, r)| r.ledger.parties().iter().any(|(q, _)| q.same(&peer)));
    if let Some((&id, r)) = holding.next() {
        let detail = format!(
            "p{p} room {id} (req {}) still {} after the loss of d{} (link {}), whose \
             destination it holds",
            r.req, r.state, peer.node, peer.inc
        );
        w.broke(Invariant::LossFails, detail);
    }
}

/// A write of prefill `p`'s room `id` (use `rgen`) read its source pages until now: the
/// host must not have taken them back.
pub(crate) fn source_held(w: &mut World, p: usize, id: u64, rgen: u64) {
    w.checking(Invariant::SourceGivenBack);
    if w.prefills[p].released.contains(&(id, rgen)) {
        let detail = format!(
            "a write of p{p}'s room {id} (use {rgen}) read its source pages after they were \
             given back"
        );
        w.broke(Invariant::SourceGivenBack, detail);
    }
}
