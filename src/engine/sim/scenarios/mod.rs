//! The interleavings that tests over real engines held open with pause points
//! (`src/testing.rs`), found among the simulator's seeds (issue 37, item 5).
//!
//! A scenario is an ordering of inputs at one room: an abort that lands while the
//! room's sender is between two pages of a chunk, one that lands after the last page
//! went out and before the completion claim, a decode room that fails before its
//! destination goes out. [`Watcher`] recognises each from the events and the rooms'
//! public state alone (not from the schedule's text), then checks what must follow it
//! until the run ends. Its tests (`tests.rs`) assert that a few hundred seeds reach
//! every one with every invariant kept, and that the bug switch (`engine/bugs.rs`)
//! breaking the rule each one pins is caught at that very room. `docs/ARCHITECTURE.md` lists the
//! pause points, and which of them the simulator made unnecessary.
//!
//! The simulated sender writes one page of one kv buffer to one destination per step,
//! so a prefill room writes `pages x layers x decode engines` times; a write is a
//! sender step that raised the room's io count.

use std::collections::{BTreeMap, HashMap};

use super::net::{Msg, Node};
use super::*;
use crate::room::State;

/// Where the abort that failed a prefill room came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Origin {
    /// The prefill engine's own host (`room_abort` on the prefill side).
    Host,
    /// A decode engine's Abort.
    Decode,
}

/// An ordering a scenario looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Seen {
    /// The silent pin: an abort fails a prefill room that wrote some of its pages and
    /// not all (`between`: exactly its first chunks' pages; `before_last`: no page of
    /// its last chunk yet; `last_queued`: its host had made its last call; `layered`:
    /// the calls came layer by layer). What follows: no write of that use any more, and
    /// no decode room of the request succeeds.
    AbortMidRoom {
        from: Origin,
        between: bool,
        before_last: bool,
        last_queued: bool,
        layered: bool,
    },
    /// An abort fails a prefill room every page of which went out, before the last
    /// write completed: the completion claim must lose. What follows: no Done of that
    /// use reaches a decode engine, and no decode room of the request succeeds.
    AbortBeforeClaim { from: Origin },
    /// The prefill host aborts a room that claimed SUCCESS: it stays SUCCESS.
    AbortAfterClaim,
    /// The prefill host clears a failed room that wrote some of its pages and has
    /// writes in flight: they drain (the invariants: no byte lands in a page given
    /// back, nothing is left at the end).
    ClearedWritesInFlight,
    /// A decode room failed before the step that sends its destination: the
    /// destination never goes out.
    DestinationAfterFailure,
}

/// One use of a room: prefill `p`'s use `rgen`, or decode `d`'s use `dgen` of id `id` in
/// its incarnation `epoch` (a decode engine that starts again counts its generations
/// from 1 again; prefill uses are counted across every engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    Prefill {
        p: usize,
        id: u64,
        rgen: u64,
    },
    Decode {
        d: usize,
        epoch: u32,
        id: u64,
        dgen: u64,
    },
}

impl std::fmt::Display for Use {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Use::Prefill { p, id, rgen } => write!(f, "p{p} room {id} (use {rgen})"),
            Use::Decode { d, id, dgen, .. } => write!(f, "d{d} room {id} (use {dgen})"),
        }
    }
}

/// A scenario reached in a run.
#[derive(Debug, Clone)]
pub(crate) struct Sighting {
    pub seen: Seen,
    pub seed: u64,
    /// When (virtual µs).
    pub at: u64,
    room: Use,
    req: usize,
    /// The links (the other engine, the link's incarnation) and decode generations that
    /// nothing of this use may go over: for [`Seen::AbortBeforeClaim`] its destinations
    /// (no Done), for [`Seen::DestinationAfterFailure`] the room's prefill engines (no
    /// destination).
    links: Vec<(usize, u32, u64)>,
    /// What broke after it: a check of the scenario, or an invariant at a step about
    /// its room.
    pub broken: Option<String>,
}

impl Sighting {
    /// What was seen where, and how to print its run's schedule (`SIM_REPLAY`).
    pub fn replay(&self) -> String {
        format!(
            "{:?} at {} µs, {} (req {}), seed {}: SIM_REPLAY={} cargo test --lib \
             engine::sim::tests::replay -- --ignored --nocapture",
            self.seen, self.at, self.room, self.req, self.seed, self.seed
        )
    }
}

/// A prefill room before a step.
struct PWas {
    rgen: u64,
    req: usize,
    state: State,
    io: u32,
}

/// A decode room before a step.
struct DWas {
    dgen: u64,
    req: usize,
    state: State,
}

/// Every room before a step (ordered, so that a run's sightings come in one order).
struct Before {
    p: BTreeMap<(usize, u64), PWas>,
    d: BTreeMap<(usize, u64), DWas>,
}

impl Before {
    fn of(w: &World) -> Before {
        let mut p = BTreeMap::new();
        for (i, e) in w.prefills.iter().enumerate() {
            for (&id, r) in &e.rooms {
                let was = PWas {
                    rgen: r.rgen,
                    req: r.req,
                    state: r.state,
                    io: r.io,
                };
                p.insert((i, id), was);
            }
        }
        let mut d = BTreeMap::new();
        for (i, e) in w.decodes.iter().enumerate() {
            for (&id, r) in &e.rooms {
                let was = DWas {
                    dgen: r.dgen,
                    req: r.req,
                    state: r.state,
                };
                d.insert((i, id), was);
            }
        }
        Before { p, d }
    }
}

/// The use a step is about: a prefill use's sender step, write completion or write
/// landing; a decode use's destination step or destination arriving (of the decode
/// engine's incarnation now).
fn about(ev: &Ev, w: &World) -> Option<Use> {
    match *ev {
        Ev::SendStep { p, id, rgen } | Ev::WriteDone { p, id, rgen } => {
            Some(Use::Prefill { p, id, rgen })
        }
        Ev::Deliver {
            p,
            msg: Msg::Write { id, rgen, .. },
            ..
        } => Some(Use::Prefill { p, id, rgen }),
        Ev::DestOut { d, id, dgen }
        | Ev::Deliver {
            d,
            msg: Msg::Dest { id, dgen, .. },
            ..
        } => Some(Use::Decode {
            d,
            epoch: w.decodes[d].epoch,
            id,
            dgen,
        }),
        _ => None,
    }
}

/// Watches one run for the scenarios, step by step.
pub(crate) struct Watcher {
    seed: u64,
    /// Writes made per prefill use (engine, use).
    writes: HashMap<(usize, u64), usize>,
    /// Calls its host made while it was live, per prefill use.
    calls: HashMap<(usize, u64), usize>,
    pub sightings: Vec<Sighting>,
}

impl Watcher {
    pub fn new(seed: u64) -> Watcher {
        Watcher {
            seed,
            writes: HashMap::new(),
            calls: HashMap::new(),
            sightings: Vec::new(),
        }
    }

    /// Marks every sighting of a room for which `what` holds broken, with `why`.
    fn breaks(&mut self, what: impl Fn(&Sighting) -> bool, why: impl Fn(&Sighting) -> String) {
        for s in self.sightings.iter_mut().filter(|s| s.broken.is_none()) {
            if what(s) {
                s.broken = Some(why(s));
            }
        }
    }

    /// `ev` was applied to the world: it was `was` before and is `w` now.
    fn step(&mut self, ev: &Ev, was: &Before, w: &World) {
        self.count(ev, was, w);
        self.follow(ev, was, w);
        self.failures(ev, was, w);
        self.host(ev, was, w);
        if let Ev::DestOut { d, id, dgen } = *ev {
            let failed = was.d.get(&(d, id)).filter(|r| r.dgen == dgen);
            if let Some(r) = failed.filter(|r| r.state == State::Failed) {
                let e = &w.decodes[d];
                let room = Use::Decode {
                    d,
                    epoch: e.epoch,
                    id,
                    dgen,
                };
                // Its prefill engines, over the links it knew them by (the step
                // changed no room).
                let peers = e.rooms.get(&id).map_or(&[][..], |r| &r.core.peers[..]);
                let links = peers.iter().map(|q| (q.node, q.inc, dgen)).collect();
                self.saw(Seen::DestinationAfterFailure, w, room, r.req, links);
            }
        }
        if let Some(v) = &w.violation {
            // The run ends here; a sighting of the room this step is about broke it.
            if let Some(u) = about(ev, w) {
                let why = format!("{:?} broken: {}", v.invariant, v.detail);
                self.breaks(|s| s.room == u, |_| why.clone());
            }
        }
    }

    fn saw(&mut self, seen: Seen, w: &World, room: Use, req: usize, links: Vec<(usize, u32, u64)>) {
        self.sightings.push(Sighting {
            seen,
            seed: self.seed,
            at: w.now,
            room,
            req,
            links,
            broken: None,
        });
    }

    /// Counts the writes and the host's calls of each prefill use.
    fn count(&mut self, ev: &Ev, was: &Before, w: &World) {
        match *ev {
            Ev::SendStep { p, id, rgen } => {
                let before = was.p.get(&(p, id)).filter(|r| r.rgen == rgen);
                let after = w.prefills[p].rooms.get(&id).filter(|r| r.rgen == rgen);
                if let (Some(b), Some(a)) = (before, after) {
                    if a.io > b.io {
                        *self.writes.entry((p, rgen)).or_default() += 1;
                        // A room that failed keeps its batches queued, and the sender
                        // takes them: the state rule alone has it skip them (the
                        // reference design's rule resurrects the room, and this fires).
                        let room = Use::Prefill { p, id, rgen };
                        self.breaks(
                            |s| s.room == room && matches!(s.seen, Seen::AbortMidRoom { .. }),
                            |s| format!("{room} wrote a page after its abort at {} µs", s.at),
                        );
                    }
                }
            }
            Ev::Host(Host::PrefillEnqueue { req, p }) => {
                let id = w.requests[req].id;
                let live = was.p.get(&(p, id)).filter(|r| r.req == req);
                if let Some(r) = live.filter(|r| !r.state.is_terminal()) {
                    *self.calls.entry((p, r.rgen)).or_default() += 1;
                }
            }
            _ => {}
        }
    }

    /// What must follow the sightings so far: no Done and no destination where none
    /// may go, no decode room succeeding where its prefill room failed.
    fn follow(&mut self, ev: &Ev, was: &Before, w: &World) {
        match *ev {
            Ev::Deliver {
                p,
                d,
                inc,
                to: Node::Decode(_),
                msg: Msg::Done { id, dgen, .. },
            } => self.breaks(
                |s| {
                    matches!(s.room, Use::Prefill { p: q, id: i, .. } if (q, i) == (p, id))
                        && s.links.contains(&(d, inc, dgen))
                },
                |s| format!("{} sent Done to d{d} though it failed first", s.room),
            ),
            Ev::Deliver {
                p,
                d,
                inc,
                to: Node::Prefill(_),
                msg: Msg::Dest { id, dgen, .. },
            } => {
                let room = format!("d{d} room {id} (use {dgen})");
                self.breaks(
                    |s| {
                        matches!(s.room, Use::Decode { d: e, id: i, .. } if (e, i) == (d, id))
                            && s.links.contains(&(p, inc, dgen))
                    },
                    |s| {
                        format!(
                            "{room}'s destination reached p{p} though it failed at {} µs",
                            s.at
                        )
                    },
                );
            }
            _ => {}
        }
        for (&(d, id), r) in &was.d {
            let now = w.decodes[d].rooms.get(&id).filter(|n| n.dgen == r.dgen);
            if r.state != State::Success && now.is_some_and(|n| n.state == State::Success) {
                let req = r.req;
                self.breaks(
                    |s| {
                        s.req == req
                            && matches!(
                                s.seen,
                                Seen::AbortMidRoom { .. } | Seen::AbortBeforeClaim { .. }
                            )
                    },
                    |s| format!("d{d} room {id} succeeded though {} failed", s.room),
                );
            }
        }
    }

    /// Prefill rooms this step failed by an abort: the silent pin, or the completion
    /// claim beaten.
    fn failures(&mut self, ev: &Ev, was: &Before, w: &World) {
        for (&(p, id), b) in &was.p {
            if b.state.is_terminal() {
                continue;
            }
            let Some(r) = w.prefills[p].rooms.get(&id).filter(|r| r.rgen == b.rgen) else {
                continue;
            };
            if r.state != State::Failed || !matches!(r.reason, Some((Cause::Aborted, _))) {
                continue;
            }
            let from = match *ev {
                Ev::Host(Host::PrefillAbort { p: q, .. }) if q == p => Origin::Host,
                Ev::Deliver {
                    to: Node::Prefill(q),
                    msg: Msg::Abort { .. },
                    ..
                } if q == p => Origin::Decode,
                _ => continue,
            };
            let req = &w.requests[b.req];
            let per_page = req.layers as usize * req.decodes.len();
            let (pages, chunks) = (req.pages, req.chunks as usize);
            let total = per_page * pages;
            let made = self.writes.get(&(p, b.rgen)).copied().unwrap_or(0);
            let room = Use::Prefill {
                p,
                id,
                rgen: b.rgen,
            };
            if made == total {
                let dests = r.ledger.dests().iter();
                let links = dests.map(|d| (d.peer.node, d.peer.inc, d.generation));
                self.saw(
                    Seen::AbortBeforeClaim { from },
                    w,
                    room,
                    b.req,
                    links.collect(),
                );
            } else if 0 < made && made < total {
                let calls = self.calls.get(&(p, b.rgen)).copied().unwrap_or(0);
                // The writes made before chunk `k`.
                let start = |k: usize| per_page * (k * pages / chunks);
                let seen = Seen::AbortMidRoom {
                    from,
                    between: (1..chunks).any(|k| made == start(k)),
                    before_last: made <= start(chunks - 1),
                    last_queued: calls >= chunks * req.layers as usize,
                    layered: req.layers > 1,
                };
                self.saw(seen, w, room, b.req, Vec::new());
            }
        }
    }

    /// The prefill host's abort of a room that succeeded, and its clear of a room with
    /// writes in flight.
    fn host(&mut self, ev: &Ev, was: &Before, w: &World) {
        let (req, p) = match *ev {
            Ev::Host(Host::PrefillAbort { req, p } | Host::PrefillPoll { req, p }) => (req, p),
            _ => return,
        };
        let id = w.requests[req].id;
        let Some(b) = was.p.get(&(p, id)).filter(|r| r.req == req) else {
            return;
        };
        let room = Use::Prefill {
            p,
            id,
            rgen: b.rgen,
        };
        let now = w.prefills[p].rooms.get(&id).filter(|r| r.rgen == b.rgen);
        match ev {
            Ev::Host(Host::PrefillAbort { .. }) if b.state == State::Success => {
                self.saw(Seen::AbortAfterClaim, w, room, req, Vec::new());
                if let Some(state) = now.map(|r| r.state).filter(|&s| s != State::Success) {
                    let why = format!("{room} aborted after SUCCESS is {state}");
                    self.breaks(|s| s.room == room, |_| why.clone());
                }
            }
            Ev::Host(Host::PrefillPoll { .. }) if now.is_none() && b.io > 0 => {
                let r = &w.requests[req];
                let total = r.layers as usize * r.decodes.len() * r.pages;
                let made = self.writes.get(&(p, b.rgen)).copied().unwrap_or(0);
                if made < total {
                    self.saw(Seen::ClearedWritesInFlight, w, room, req, Vec::new());
                }
            }
            _ => {}
        }
    }
}

/// Runs `config` as [`run`] does ([`run_observed`]), showing `watcher` every step.
pub(crate) fn watched(config: Config, trace: bool, watcher: &mut Watcher) -> Run {
    run_observed(
        config,
        trace,
        |w, ev| (ev.clone(), Before::of(w)),
        |(ev, was), w| watcher.step(&ev, &was, w),
    )
}

/// What seeds showed: every sighting, and the runs that broke an invariant.
pub(crate) struct Survey {
    pub sightings: Vec<Sighting>,
    pub failed: Vec<Run>,
    /// Seeds run.
    pub seeds: u64,
}

/// Runs seeds from 0 (24 requests each, `bug` put back) until `enough` says so or
/// `most` seeds ran.
pub(crate) fn survey(bug: Option<Bug>, most: u64, enough: impl Fn(&Survey) -> bool) -> Survey {
    let mut s = Survey {
        sightings: Vec::new(),
        failed: Vec::new(),
        seeds: 0,
    };
    for seed in 0..most {
        let config = Config {
            seed,
            requests: 24,
            bug,
            skip: 0,
        };
        let mut watcher = Watcher::new(seed);
        let r = watched(config, false, &mut watcher);
        s.seeds += 1;
        s.sightings.append(&mut watcher.sightings);
        if r.violation.is_some() {
            s.failed.push(r);
        }
        if enough(&s) {
            break;
        }
    }
    s
}

mod tests;
