//! One phase on the prefill side: each rank's scheduler loop as a driver ([`Driver`])
//! whose steps run the simulated compute, create the rooms the decode side announced
//! and enqueue their chunks, and poll the rooms in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvxfer::{Engine, RoomPeers, State};

use super::forwards::Forwards;
use super::Set;
use crate::ctl::{self, room_id, room_plan, AbortAt, Outcome, PrefillRoom};
use crate::params::{Feed, Params};
use crate::pool::Pool;
use crate::sys::{mono_ns, precise_sleeps, sleep_until_ns, Usage};

/// What the decode side announced of the phase in flight: the rooms that exist so far
/// (`upto`) and, once no more will, how many there are (`end`; `u64::MAX` until then).
pub(super) struct Announced<'a> {
    pub upto: &'a AtomicU64,
    pub end: &'a AtomicU64,
}

impl Announced<'_> {
    /// The rooms that may be created now.
    fn limit(&self) -> u64 {
        self.upto
            .load(Ordering::Acquire)
            .min(self.end.load(Ordering::Acquire))
    }

    fn end(&self) -> u64 {
        self.end.load(Ordering::Acquire)
    }
}

/// One phase on every rank of `set`, each rank's scheduler loop on a thread of its own
/// (as each rank of a server has its own): every room's record, every rank's together,
/// and the loops' usage.
pub(super) fn run_ranks(
    p: &Params,
    set: &Set,
    pools: &[Pool],
    (start, feed): (u64, Feed),
    announced: &Announced<'_>,
) -> Result<(Vec<PrefillRoom>, Usage), String> {
    let per_rank: Vec<Result<(Vec<PrefillRoom>, Usage), String>> = std::thread::scope(|scope| {
        let loops: Vec<_> = set
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, (engine, pool))| {
                let pool = &pools[*pool];
                scope.spawn(move || {
                    let u0 = Usage::thread();
                    // A planned prefill abort comes from rank 0; the engines fail the
                    // room on every other rank.
                    let d = Driver::new(p, engine, pool, (start, feed), (set.decoders, rank == 0));
                    let rooms = d.run(announced)?;
                    Ok((rooms, Usage::thread().since(u0)))
                })
            })
            .collect();
        loops
            .into_iter()
            .map(|l| {
                l.join()
                    .unwrap_or_else(|_| Err("a prefill loop panicked".into()))
            })
            .collect()
    });
    // Every rank saw the end: the next phase's announcements start afresh.
    announced.end.store(u64::MAX, Ordering::Release);
    let mut driver = Usage::default();
    let mut ranks = Vec::with_capacity(per_rank.len());
    for r in per_rank {
        let (rooms, u) = r?;
        driver = driver + u;
        ranks.push(rooms);
    }
    let n = ranks.iter().map(Vec::len).min().unwrap_or(0);
    if ranks.iter().any(|r| r.len() != n) {
        return Err("the prefill ranks ran different numbers of rooms".into());
    }
    let rooms = (0..n)
        .map(|i| PrefillRoom::merge(&ranks.iter().map(|r| r[i].clone()).collect::<Vec<_>>()))
        .collect();
    Ok((rooms, driver))
}

/// A room in flight.
struct Live {
    idx: usize,
    id: u64,
    slot: usize,
    /// This rank makes the room's planned prefill abort.
    abort: bool,
    aborted: bool,
}

/// The prefill scheduler loop of one rank over one phase: its state, and the steps of
/// one turn.
struct Driver<'a> {
    p: &'a Params,
    engine: &'a Engine,
    pool: &'a Pool,
    /// The phase's first room index.
    start: u64,
    /// The decode ranks each room waits for; whether this rank makes the planned
    /// prefill aborts.
    decoders: usize,
    aborts: bool,
    free: Vec<usize>,
    live: Vec<Live>,
    recs: Vec<PrefillRoom>,
    /// The simulated compute (`--layerwise`), if the phase has it.
    forwards: Option<Forwards>,
}

impl<'a> Driver<'a> {
    fn new(
        p: &'a Params,
        engine: &'a Engine,
        pool: &'a Pool,
        (start, feed): (u64, Feed),
        (decoders, aborts): (usize, bool),
    ) -> Driver<'a> {
        let forwards = feed.simulate.then(|| Forwards::new(p, feed));
        if forwards.is_some() {
            // The layers' ends are sleeps of this thread: let them end on time.
            precise_sleeps();
        }
        Driver {
            p,
            engine,
            pool,
            start,
            decoders,
            aborts,
            free: (0..pool.slots).rev().collect(),
            live: Vec::with_capacity(pool.slots),
            recs: Vec::new(),
            forwards,
        }
    }

    /// Turns until every announced room was created and ended; each room's record.
    fn run(mut self, announced: &Announced<'_>) -> Result<Vec<PrefillRoom>, String> {
        loop {
            let seen = self.engine.changes();
            // The compute first, so that a layer is enqueued as soon as the thread wakes
            // at its end.
            let (mut progress, next_layer_end) = match self.forwards.as_mut() {
                Some(fw) => fw.step(self.engine, &mut self.recs),
                None => (false, None),
            };
            progress |= self.create_rooms(announced.limit());
            progress |= self.poll_rooms();
            if self.start + self.recs.len() as u64 >= announced.end() && self.live.is_empty() {
                return Ok(self.recs);
            }
            if !progress {
                match next_layer_end {
                    // Computing: the thread sleeps until the layer's end (what happens
                    // meanwhile waits for the next layer's end).
                    Some(t) => sleep_until_ns(t),
                    // Everything that gives this loop work wakes the wait: a room's
                    // change of state, an announcement. The bound is a safety net, not
                    // a poll.
                    None => ctl::idle(self.p, self.engine, seen, Duration::from_millis(100)),
                }
            }
        }
    }

    /// Creates the announced rooms up to `limit` while a slot is free.
    fn create_rooms(&mut self, limit: u64) -> bool {
        let mut progress = false;
        while self.start + (self.recs.len() as u64) < limit {
            let Some(slot) = self.free.pop() else { break };
            progress = true;
            self.create(slot);
        }
        progress
    }

    /// Creates the next room in `slot`, stamped with its pattern, and enqueues its
    /// chunks (or queues it for its compute).
    fn create(&mut self, slot: usize) {
        let (p, engine, pool) = (self.p, self.engine, self.pool);
        let idx = self.recs.len();
        let plan = room_plan(p, self.start + idx as u64);
        let id = room_id(p, self.start + idx as u64);
        pool.stamp(slot, plan.pages, id);
        let t_enq = mono_ns();
        let r = engine
            .room_create(id, RoomPeers::Decoders(self.decoders))
            .and_then(|()| self.feed(id, idx, slot, plan.pages, t_enq));
        self.recs.push(PrefillRoom {
            t_enq,
            t_term: 0,
            outcome: Outcome::local("unknown"),
            compute: None,
        });
        // A room the decode side aborted before it was created here is failed at
        // creation (the early abort was held for it): enqueueing into it is refused and
        // its reason is collected by the poll like any other.
        let failed_at_birth = r.is_err() && engine.room_poll(id).ok() == Some(State::Failed);
        let live = |abort| Live {
            idx,
            id,
            slot,
            abort,
            aborted: false,
        };
        match r {
            Ok(()) => self
                .live
                .push(live(self.aborts && plan.abort == Some(AbortAt::PrefillMid))),
            Err(_) if failed_at_birth => self.live.push(live(false)),
            Err(e) => {
                eprintln!("kvxfer-bench prefill: room {id}: {e}");
                let _ = engine.room_abort(id, "bench: setup failed");
                let _ = engine.room_clear(id);
                self.recs[idx].outcome = Outcome::local("create_error");
                self.recs[idx].t_term = mono_ns();
                self.free.push(slot);
            }
        }
    }

    /// Feeds new room `id` (record `idx`) of `pages` source pages in `slot`: queued for
    /// its compute, or every chunk enqueued now.
    fn feed(
        &mut self,
        id: u64,
        idx: usize,
        slot: usize,
        pages: usize,
        t_enq: u64,
    ) -> kvxfer::Result<()> {
        let pool = self.pool;
        let pages = pool.pages(slot, pages);
        let chunk = self.p.chunk_pages();
        let aux = pool.aux.is_some().then_some(slot as u32);
        if let Some(fw) = self.forwards.as_mut() {
            // Enqueued as its layers are computed.
            let chunks = pages.chunks(chunk).map(<[u32]>::to_vec).collect();
            fw.queue((idx, id), chunks, aux, t_enq);
            return Ok(());
        }
        let parts: Vec<&[u32]> = pages.chunks(chunk).collect();
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            self.engine
                .enqueue_chunk(id, part, last, if last { aux } else { None })?;
        }
        Ok(())
    }

    /// Polls every room in flight: an ended room's slot is free again, and a planned
    /// abort made once the room has its destination.
    fn poll_rooms(&mut self) -> bool {
        let mut progress = false;
        let mut i = 0;
        while i < self.live.len() {
            let state = self.engine.room_poll(self.live[i].id);
            match state {
                Ok(State::Success) | Ok(State::Failed) | Err(_) => {
                    self.ended(i, state);
                    progress = true;
                    continue;
                }
                Ok(State::WaitingForInput) | Ok(State::Transferring) => {
                    let r = &mut self.live[i];
                    if r.abort && !r.aborted {
                        let _ = self
                            .engine
                            .room_abort(r.id, "bench: planned abort (prefill)");
                        r.aborted = true;
                        progress = true;
                    }
                }
                Ok(_) => {}
            }
            i += 1;
        }
        progress
    }

    /// Room `live[i]` ended in `state`: its outcome recorded, cleared, its slot free.
    fn ended(&mut self, i: usize, state: kvxfer::Result<State>) {
        let engine = self.engine;
        let r = self.live.swap_remove(i);
        let now = mono_ns();
        let outcome = match state {
            Ok(State::Success) => Outcome::Ok,
            Ok(_) => match engine.room_failure(r.id) {
                Ok(f) => Outcome::Failed {
                    cause: f.cause.name().into(),
                    from_peer: f.from_peer,
                },
                Err(_) => Outcome::local("unknown"),
            },
            Err(_) => Outcome::local("poll_error"),
        };
        // The slot is reused at once, as a server frees a finished request's pages.
        // After a failure a worker may still be inside one frame write from it; those
        // bytes belong to a failed room, which the decode side refuses, so the new
        // room's stamps cannot reach a checked page.
        let _ = engine.room_clear(r.id);
        if let Some(fw) = self.forwards.as_mut() {
            fw.drop_room(r.id, &mut self.recs);
        }
        self.free.push(r.slot);
        self.recs[r.idx].t_term = now;
        self.recs[r.idx].outcome = outcome;
    }
}
