//! The prefill hosts' scheduler: create a request's room (adopting what waited for it),
//! enqueue its chunks, abort it, poll it and clear it.

use std::collections::VecDeque;

use super::*;

/// The host creates the request's room (retrying while an earlier use of the id is not
/// cleared yet), which adopts what waited for it.
pub(crate) fn host_create(w: &mut World, req: usize, p: usize) {
    let r = w.requests[req].clone();
    let e = &mut w.prefills[p];
    if e.rooms.contains_key(&r.id) {
        let n = e.retries.entry(req).or_default();
        *n += 1;
        if *n < 100 {
            w.at(TICK_US, Ev::Host(Host::PrefillCreate { req, p }));
        } else {
            w.room_done(req);
        }
        return;
    }
    let bound = r.bound.then(|| {
        let epoch = |d: usize| w.decodes[d].epoch;
        r.decodes.iter().map(|&d| engine_id(d, epoch(d))).collect()
    });
    let rgen = w.next_rgen;
    w.next_rgen += 1;
    e.rooms.insert(
        r.id,
        PRoom {
            req,
            rgen,
            state: State::Bootstrapping,
            reason: None,
            ledger: Ledger::new(r.decodes.len(), bound),
            deadline: w.now + BOOTSTRAP_US,
            chunks: r.chunks,
            enqueued: 0,
            todo: VecDeque::new(),
            planned: 0,
            stepping: false,
            io: 0,
        },
    );
    w.note(|| format!("p{p} creates room {} (req {req}, use {rgen})", r.id));
    let (tombs, held) = w.prefills[p].holding.adopt(r.id);
    for t in tombs {
        let room = w.prefills[p].rooms.get_mut(&r.id).expect("created");
        if !room.ledger.admits(t.peer.engine()) {
            continue;
        }
        let reason = match t.grave {
            Grave::Aborted(why) => {
                room.ledger.remember(&t.peer, t.generation);
                check::not_superseded(w, p, t.peer, r.id, t.generation);
                (Cause::Aborted, why)
            }
            Grave::Lost(why) => (Cause::PeerLost, why),
        };
        fail(w, p, r.id, reason, Some(t.peer));
    }
    for h in held {
        attach(w, p, r.id, h.peer, h.generation, h.pages);
    }
    let mut after = 0;
    for _ in 0..r.chunks {
        after += w.rng.range(0, 2_000);
        w.at(after, Ev::Host(Host::PrefillEnqueue { req, p }));
    }
    w.at(TICK_US, Ev::Host(Host::PrefillPoll { req, p }));
}

/// The request's room of this engine, if it is the current use of its id.
fn room_of(w: &World, req: usize, p: usize) -> Option<u64> {
    let id = w.requests[req].id;
    w.prefills[p]
        .rooms
        .get(&id)
        .filter(|r| r.req == req)
        .map(|_| id)
}

pub(crate) fn host_enqueue(w: &mut World, req: usize, p: usize) {
    let Some(id) = room_of(w, req, p) else {
        return;
    };
    let room = w.prefills[p].rooms.get_mut(&id).expect("room");
    if room.state.is_terminal() {
        return;
    }
    room.enqueued += 1;
    if matches!(room.state, State::WaitingForInput | State::Transferring) {
        plan(w, p, id);
    }
}

pub(crate) fn host_abort(w: &mut World, req: usize, p: usize) {
    if let Some(id) = room_of(w, req, p) {
        let why = format!("prefill host p{p} cancelled [req {req}]");
        fail(w, p, id, (Cause::Aborted, why), None);
    }
}

/// The host polls its room and clears it once terminal; a cleared room leaves its
/// record, and drains its writes in flight.
pub(crate) fn host_poll(w: &mut World, req: usize, p: usize) {
    let Some(id) = room_of(w, req, p) else {
        return;
    };
    if !w.prefills[p].rooms[&id].state.is_terminal() {
        return w.at(TICK_US, Ev::Host(Host::PrefillPoll { req, p }));
    }
    let e = &mut w.prefills[p];
    let room = e.rooms.remove(&id).expect("room");
    let reason = room.reason.as_ref().map(|r| r.1.clone());
    let expires = w.now + BOOTSTRAP_US + WAITING_US;
    let gens = room.ledger.generations();
    let _ = e
        .holding
        .clear_use(id, reason, gens, room.ledger.complete(), expires);
    if room.io > 0 {
        e.draining.push((id, room));
    }
    w.note(|| format!("p{p} clears room {id} (req {req})"));
    w.room_done(req);
    for (h, reason) in w.prefills[p].holding.take_cleared_dests(id) {
        let why = format!("prefill room {id} is a cleared use: {reason:?}");
        refuse(w, p, h.peer, id, h.generation, why);
    }
}
