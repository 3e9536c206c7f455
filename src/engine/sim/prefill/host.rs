//! The prefill hosts' scheduler: create a request's room (adopting what waited for it),
//! enqueue its chunks, abort it, poll it and clear it.

use std::collections::VecDeque;
use std::sync::Arc;

use super::*;
use crate::engine::sim::Request;

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
            calls: calls(&r),
            admitted: Chunks::default(),
            hand_off: HandOff::default(),
            todo: VecDeque::new(),
            stepping: false,
            io: 0,
            completion: Completion::default(),
        },
    );
    w.note(|| format!("p{p} creates room {} (req {req}, use {rgen})", r.id));
    let rgen = w.prefills[p].rooms[&r.id].rgen;
    arrivals::adopt_held(&mut Sim { w, p }, &(r.id, rgen));
    let mut after = 0;
    for _ in 0..r.chunks * r.layers {
        after += w.rng.range(0, 1_000);
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

/// The calls a host makes for request `r`: each chunk whole, or layer by layer (the
/// layers of one chunk in a random order is not modelled: in order).
fn calls(r: &Request) -> VecDeque<(u32, Option<u32>)> {
    let layered = r.layers > 1;
    (0..r.chunks)
        .flat_map(|k| (0..r.layers).map(move |l| (k, layered.then_some(l))))
        .collect()
}

/// The host's next call for its room: admitted by the library's `Chunks` (a call it
/// refuses fails the room, as `enqueue` does), then held until the room is ready, or
/// handed on at once (and planned here if it is the caller's), as `enqueue` does.
pub(crate) fn host_enqueue(w: &mut World, req: usize, p: usize) {
    let Some(id) = room_of(w, req, p) else {
        return;
    };
    let r = w.requests[req].clone();
    // Now and then a faulty host repeats a layer it enqueued (layer by layer only: a
    // whole chunk again is a new chunk).
    let repeat = r.layers > 1 && w.rng.chance(1);
    if repeat {
        // The same call comes again next: one more call than planned.
        let after = w.rng.range(0, 1_000);
        w.at(after, Ev::Host(Host::PrefillEnqueue { req, p }));
    }
    let room = w.prefills[p].rooms.get_mut(&id).expect("room");
    if room.state.is_terminal() {
        return;
    }
    let Some(&(k, layer)) = room.calls.front() else {
        return;
    };
    if !repeat {
        room.calls.pop_front();
    }
    let (c, n) = (r.chunks as usize, r.pages);
    let (first, end) = (k as usize * n / c, (k as usize + 1) * n / c);
    // Source pages: any numbers, one list per chunk.
    let pages: Vec<u32> = (first..end).map(|i| 1_000 + i as u32).collect();
    let mask: Option<Vec<bool>> = layer.map(|l| (0..r.layers).map(|b| b == l).collect());
    let is_last = room.calls.is_empty() && !repeat;
    let admitted = room
        .admitted
        .admit(&pages, mask.as_deref(), is_last, |b| b as u32);
    let placed = match admitted {
        Ok(placed) => placed,
        Err(why) => return fail(w, p, id, (Cause::Mismatch, why), None),
    };
    let chunk = Chunk {
        pages,
        is_last,
        aux: None,
        start: placed.start,
        buffers: mask.map(Arc::from),
        total: placed.total,
    };
    if !matches!(room.state, State::WaitingForInput | State::Transferring) {
        return layers::join(&mut room.hand_off.held, chunk);
    }
    if let Some(chunk) = hand_on(w, p, id, chunk) {
        plan_waiting(w, p, id, Planner::Caller, chunk);
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
    let gens = room.ledger.generations();
    let complete = room.ledger.complete();
    // The host takes the source pages back once the drain rule says so: at once, or
    // when the last write in flight completes (`write_done`).
    if crate::room::drained(room.state, room.io) {
        e.released.insert((id, room.rgen));
    } else {
        e.draining.push((id, room));
    }
    w.note(|| format!("p{p} clears room {id} (req {req})"));
    w.room_done(req);
    arrivals::cleared(&mut Sim { w, p }, id, reason, gens, complete);
}
