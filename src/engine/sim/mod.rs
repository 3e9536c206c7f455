//! A deterministic simulator of a cluster of engines (issue 37): several prefill and
//! decode engines on one virtual clock, a modelled network, a workload of requests with
//! cancellations from both sides, id reuse, bound rooms, strangers, lost connections;
//! and the invariants of DESIGN §1 checked after every step.
//!
//! The engines' decisions are the library's own pure cores: the prefill room's
//! [`Ledger`](super::prefill::ledger::Ledger), the [`Holding`](super::prefill::holding)
//! area, the [`AckTable`](super::prefill::acks::AckTable), the planning hand-off
//! ([`Planning`](super::prefill::planning::Planning)) and the state rule
//! [`transition`](crate::room::transition). Around them the simulator is a second, single
//! threaded shell (the live engine's threads, locks and sockets are the first; the tests
//! over real sockets prove that one): `prefill/` and `decode/` model the two roles, and
//! run the library's routing of each role's messages (`src/engine/prefill/arrivals/`,
//! `src/engine/decode/arrivals/`) through their `shell.rs`.
//!
//! Everything comes from one seed: the cluster, the workload, every delay and fault. A
//! run is a pure function of its seed and [`Config`], so a failing seed replays
//! identically; [`shrink`] looks for the smallest workload that still fails, and
//! [`Run::trace`] prints its schedule. `make sim-soak` runs seeds for `SIM_SECS`.
//!
//! Virtual time is in microseconds.

mod check;
mod decode;
mod net;
mod prefill;
mod scenarios;
#[cfg(test)]
mod tests;
mod workload;

use std::collections::HashMap;

use crate::engine::bugs::{self, Bug};
use crate::engine::peer_ref::PeerRef;
use crate::engine::watchdog;
use crate::room::Cause;
use check::{Invariant, Violation};
use decode::DEngine;
use net::{Msg, Net, Node};
use prefill::PEngine;
use workload::subset;
pub(crate) use workload::{Host, Request};

/// The simulator's random numbers: SplitMix64, our own so that a seed names the same
/// schedule whatever version of a random-number crate the build resolves.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6A09_E667_F3BC_C908)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// An engine of the other role as one engine knows it: by index and link incarnation
/// (a link made again is a new peer, as a new `Arc<Peer>` is in the engine), and the
/// other engine's own incarnation (`epoch`: it crashed and started again that often).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SimPeer {
    pub node: usize,
    pub inc: u32,
    pub epoch: u32,
}

impl PeerRef for SimPeer {
    fn same(&self, other: &Self) -> bool {
        (self.node, self.inc) == (other.node, other.inc)
    }

    /// The engine id it says in its `Hello`: new at every start of the engine.
    fn engine(&self) -> Option<u64> {
        Some(engine_id(self.node, self.epoch))
    }
}

/// The engine id of engine `node` in its incarnation `epoch`.
pub(crate) fn engine_id(node: usize, epoch: u32) -> u64 {
    ((node as u64 + 1) << 32) | u64::from(epoch)
}

/// The deadlines of the simulated engines (µs of virtual time).
pub(crate) const BOOTSTRAP_US: u64 = 30_000;
pub(crate) const WAITING_US: u64 = 30_000;
pub(crate) const TRANSFER_US: u64 = 30_000;
pub(crate) const DRAIN_US: u64 = 20_000;
/// The watchdogs' period.
pub(crate) const TICK_US: u64 = 1_000;

/// What one run simulates; all of it derived from the seed but the size of the workload
/// (which [`shrink`] lowers) and the bug put back, if any.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    pub seed: u64,
    /// Requests in the workload.
    pub requests: usize,
    pub bug: Option<Bug>,
    /// Requests (by index, below 64) left out: they start and end at once, drawing no
    /// random number and scheduling nothing ([`shrink`] sets them).
    pub skip: u64,
}

/// Something the simulator does at a virtual time.
#[derive(Debug, Clone)]
pub(crate) enum Ev {
    /// A message reaches `to` over the connection between prefill `p` and decode `d`
    /// (its incarnation `inc`).
    Deliver {
        p: usize,
        d: usize,
        inc: u32,
        to: Node,
        msg: Msg,
    },
    /// A write of prefill `p` completed (over RDMA: it landed, or its link is gone).
    WriteDone {
        p: usize,
        id: u64,
        rgen: u64,
    },
    /// Prefill `p`'s sender writes the next page of room `id` (use `rgen`).
    SendStep {
        p: usize,
        id: u64,
        rgen: u64,
    },
    /// Prefill `p`'s worker starts on room `id` (use `rgen`), handed to it.
    Worker {
        p: usize,
        id: u64,
        rgen: u64,
    },
    /// Decode `d` sends the destination of room `id` (use `dgen`), if still live.
    DestOut {
        d: usize,
        id: u64,
        dgen: u64,
    },
    Tick(Node),
    /// The connection between `p` and `d` breaks; each side notices later.
    Cut {
        p: usize,
        d: usize,
    },
    /// `node` notices that its connection (incarnation `inc`) to the other side broke.
    Noticed {
        node: Node,
        other: usize,
        inc: u32,
    },
    Reconnect {
        p: usize,
        d: usize,
    },
    /// The link between `p` and `d` stalls for `us` µs: messages sent meanwhile wait
    /// (those already on their way arrive as scheduled).
    Stall {
        p: usize,
        d: usize,
        us: u64,
    },
    /// The engine's process dies (every link breaks, its rooms and memory are gone) and
    /// starts again at once as a new incarnation, with a new engine id.
    Crash(Node),
    Host(Host),
}

/// The simulated cluster.
pub(crate) struct World {
    pub now: u64,
    pub rng: Rng,
    pub net: Net,
    pub prefills: Vec<PEngine>,
    pub decodes: Vec<DEngine>,
    pub requests: Vec<Request>,
    /// The schedule so far, one line a step (kept when tracing).
    pub trace: Option<Vec<String>>,
    /// The first invariant broken.
    pub violation: Option<Violation>,
    pub steps: u64,
    /// The next prefill room generation (one counter for every incarnation of every
    /// prefill engine, so that a crashed engine's leftover events match no new room).
    pub next_rgen: u64,
    /// Which invariant checks ran, and how often.
    pub checked: HashMap<Invariant, u64>,
    /// Virtual time when the workload's last request started.
    pub last_start: u64,
    /// How many requests started.
    started: usize,
    /// The requests left out (`Config::skip`).
    skip: u64,
    /// Room ids: how many, and which request holds each one in use.
    ids: u64,
    in_use: HashMap<u64, usize>,
    /// Per request: the engines that have yet to create or clear its room.
    open: Vec<usize>,
}

/// The result of one run.
pub(crate) struct Run {
    pub config: Config,
    pub violation: Option<Violation>,
    pub steps: u64,
    pub checked: HashMap<Invariant, u64>,
    pub trace: Vec<String>,
}

impl World {
    fn new(config: Config, trace: bool) -> World {
        let mut rng = Rng::new(config.seed);
        let n_p = rng.range(1, 3) as usize;
        let n_d = rng.range(1, 3) as usize;
        let rdma = rng.chance(60);
        let ids = rng.range(2, 6);
        let mut requests = Vec::with_capacity(config.requests);
        for _ in 0..config.requests {
            let prefills = subset(&mut rng, n_p);
            let decodes = subset(&mut rng, n_d);
            requests.push(Request {
                id: 0,
                prefills,
                decodes,
                pages: rng.range(1, 4) as usize,
                chunks: 0,
                layers: 0,
                bound: rng.chance(30),
                prefill_skips: rng.chance(5),
            });
        }
        for r in &mut requests {
            r.chunks = rng.range(1, r.pages.min(3) as u64) as u32;
            r.layers = rng.range(1, 2) as u32;
        }
        World {
            now: 0,
            net: Net::new(n_p, n_d, rdma),
            prefills: (0..n_p).map(|_| PEngine::new(rdma, 0)).collect(),
            decodes: (0..n_d).map(|_| DEngine::new(rdma, 0)).collect(),
            rng,
            requests,
            trace: trace.then(Vec::new),
            violation: None,
            steps: 0,
            checked: HashMap::new(),
            next_rgen: 1,
            last_start: 0,
            started: 0,
            skip: config.skip,
            ids,
            in_use: HashMap::new(),
            open: vec![0; config.requests],
        }
    }

    /// Schedules `ev` `after` µs from now.
    pub fn at(&mut self, after: u64, ev: Ev) {
        self.net.queue.push(self.now + after, ev);
    }

    /// Records a step of the schedule.
    pub fn note(&mut self, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(format!("{:>9} {}", self.now, line()));
        }
    }

    /// Records that `inv` is broken (the first one wins).
    pub fn broke(&mut self, inv: Invariant, detail: String) {
        if self.violation.is_none() {
            self.violation = Some(Violation {
                invariant: inv,
                detail,
                at: self.now,
            });
        }
    }

    /// Counts one check of `inv`.
    pub fn checking(&mut self, inv: Invariant) {
        *self.checked.entry(inv).or_default() += 1;
    }

    /// Whether anything is left to do: every request started and is over (no host will
    /// create a room any more), no message is on its way, and every engine is idle.
    fn settled(&self) -> bool {
        self.started == self.requests.len()
            && self.in_use.is_empty()
            && self.net.queue.in_flight == 0
            && self.now > self.last_start + 10_000
            && self.prefills.iter().all(PEngine::idle)
            && self.decodes.iter().all(DEngine::idle)
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Deliver { p, d, inc, to, msg } => {
                if !self.net.alive(p, d, inc) {
                    if let (true, Msg::Write { id, rgen, .. }) = (self.net.rdma, &msg) {
                        // A write flushed by its broken queue pair still completes.
                        let (id, rgen) = (*id, *rgen);
                        self.at(1, Ev::WriteDone { p, id, rgen });
                    }
                    return self.note(|| format!("dropped on a broken link: {msg:?}"));
                }
                match to {
                    Node::Prefill(_) => prefill::on_message(self, p, d, inc, msg),
                    Node::Decode(_) => decode::on_message(self, d, p, inc, msg),
                }
            }
            Ev::WriteDone { p, id, rgen } => prefill::write_done(self, p, id, rgen),
            Ev::SendStep { p, id, rgen } => prefill::send_step(self, p, id, rgen),
            Ev::Worker { p, id, rgen } => prefill::worker(self, p, id, rgen),
            Ev::DestOut { d, id, dgen } => decode::dest_out(self, d, id, dgen),
            Ev::Tick(node) => {
                match node {
                    Node::Prefill(p) => prefill::tick(self, p),
                    Node::Decode(d) => decode::tick(self, d),
                }
                self.at(TICK_US, Ev::Tick(node));
            }
            Ev::Cut { p, d } => self.cut(p, d),
            Ev::Noticed { node, other, inc } => match node {
                Node::Prefill(p) => prefill::lost(self, p, other, inc),
                Node::Decode(d) => decode::lost(self, d, other, inc),
            },
            Ev::Reconnect { p, d } => {
                let inc = self.net.reconnect(p, d);
                self.note(|| format!("link p{p}-d{d} up again (inc {inc})"));
            }
            Ev::Host(h) => self.host(h),
            Ev::Crash(node) => self.crash(node),
            Ev::Stall { p, d, us } => {
                self.note(|| format!("link p{p}-d{d} stalls for {us} µs"));
                self.net.stall(p, d, self.now + us);
            }
        }
    }

    /// Breaks the link between `p` and `d` (if up); each side notices later, and the
    /// link is made again later still.
    pub fn cut(&mut self, p: usize, d: usize) {
        let Some(inc) = self.net.cut(p, d) else {
            return;
        };
        self.note(|| format!("link p{p}-d{d} (inc {inc}) cut"));
        let (a, b) = (self.rng.range(0, 2_000), self.rng.range(0, 5_000));
        let decode = Node::Decode(d);
        let prefill = Node::Prefill(p);
        self.at(
            a,
            Ev::Noticed {
                node: decode,
                other: p,
                inc,
            },
        );
        self.at(
            b,
            Ev::Noticed {
                node: prefill,
                other: d,
                inc,
            },
        );
        let back = 5_000 + self.rng.range(1_000, 15_000);
        self.at(back, Ev::Reconnect { p, d });
    }

    /// `node` crashes and starts again: its links break, its rooms are gone (their
    /// hosts with them).
    fn crash(&mut self, node: Node) {
        self.note(|| format!("{node:?} crashes and starts again"));
        let rooms: Vec<usize> = match node {
            Node::Prefill(p) => {
                (0..self.decodes.len()).for_each(|d| self.cut(p, d));
                let fresh = PEngine::new(self.net.rdma, self.prefills[p].epoch + 1);
                let old = std::mem::replace(&mut self.prefills[p], fresh);
                old.rooms.values().map(|r| r.req).collect()
            }
            Node::Decode(d) => {
                (0..self.prefills.len()).for_each(|p| self.cut(p, d));
                let fresh = DEngine::new(self.net.rdma, self.decodes[d].epoch + 1);
                let old = std::mem::replace(&mut self.decodes[d], fresh);
                old.rooms.values().map(|r| r.req).collect()
            }
        };
        for req in rooms {
            self.room_done(req);
        }
    }

    /// Prefill engine `p` as a decode engine knows it over link incarnation `inc`.
    pub fn prefill_peer(&self, p: usize, inc: u32) -> SimPeer {
        let epoch = self.prefills[p].epoch;
        SimPeer {
            node: p,
            inc,
            epoch,
        }
    }

    /// Decode engine `d` as a prefill engine knows it over link incarnation `inc`.
    pub fn decode_peer(&self, d: usize, inc: u32) -> SimPeer {
        let epoch = self.decodes[d].epoch;
        SimPeer {
            node: d,
            inc,
            epoch,
        }
    }

    /// Sends `msg` from decode `d` to prefill `p` over the link of incarnation `inc`
    /// (dropped if that link is gone).
    pub fn send_to_prefill(&mut self, d: usize, p: usize, inc: u32, msg: Msg) {
        if !self.net.alive(p, d, inc) {
            return;
        }
        let delay = self.rng.range(10, 2_000);
        self.net.send(self.now, delay, p, d, Node::Prefill(p), msg);
    }

    /// Sends `msg` from prefill `p` to decode `d` over the link of incarnation `inc`
    /// (dropped if that link is gone).
    pub fn send_to_decode(&mut self, p: usize, d: usize, inc: u32, msg: Msg) {
        if !self.net.alive(p, d, inc) {
            return;
        }
        let delay = self.rng.range(10, 2_000);
        self.net.send(self.now, delay, p, d, Node::Decode(d), msg);
    }
}

/// The longest a run may go on in virtual time: well past every deadline of the last
/// request.
const HORIZON_US: u64 = 2_000_000;

/// Runs one seed; with `trace`, keeps the schedule.
pub(crate) fn run(config: Config, trace: bool) -> Run {
    run_observed(config, trace, |_, _| (), |(), _| ())
}

/// Runs one seed as [`run`] does, showing every step to an observer: `before` sees the
/// world and the event about to happen and returns what `after` needs; `after` sees the
/// world once the step and its checks are done. The observer cannot change the run.
pub(crate) fn run_observed<O>(
    config: Config,
    trace: bool,
    mut before: impl FnMut(&World, &Ev) -> O,
    mut after: impl FnMut(O, &World),
) -> Run {
    bugs::with(config.bug, || {
        let mut w = World::new(config, trace);
        w.plan();
        while let Some((t, ev)) = w.net.queue.pop() {
            if t > HORIZON_US {
                break;
            }
            w.now = t;
            w.steps += 1;
            let seen = before(&w, &ev);
            w.step(ev);
            check::after_step(&mut w);
            after(seen, &w);
            if w.violation.is_some() || w.settled() {
                break;
            }
        }
        if w.violation.is_none() {
            check::at_end(&mut w);
        }
        Run {
            config,
            violation: w.violation,
            steps: w.steps,
            checked: w.checked,
            trace: w.trace.unwrap_or_default(),
        }
    })
}

/// A shorter schedule of `config`'s seed that breaks the same invariant (fewer requests,
/// some left out, fewer steps to the violation), with its schedule; `None` if the seed
/// passes.
pub(crate) fn shrink(config: Config) -> Option<Run> {
    // A candidate: the steps its run took to break the same invariant, if it does.
    let steps = |c: &Config, broken| {
        let r = run(*c, false);
        r.violation
            .filter(|v| v.invariant == broken)
            .map(|_| r.steps)
    };
    let first = run(config, false);
    let broken = first.violation?.invariant;
    let mut best = (first.steps, config);
    // The workload size that breaks it in the fewest steps, then each request left out
    // in turn while that still breaks it in no more steps.
    for requests in 1..config.requests {
        let c = Config { requests, ..config };
        if let Some(n) = steps(&c, broken).filter(|&n| n < best.0) {
            best = (n, c);
        }
    }
    for i in 0..best.1.requests.min(64) {
        let c = Config {
            skip: best.1.skip | 1 << i,
            ..best.1
        };
        if let Some(n) = steps(&c, broken).filter(|&n| n <= best.0) {
            best = (n, c);
        }
    }
    Some(run(best.1, true))
}

/// Renders a failing run for a test's message: the seed to replay, the invariant, and
/// the schedule.
pub(crate) fn report(r: &Run) -> String {
    let v = r.violation.as_ref().expect("a failing run");
    format!(
        "seed {} with {} request(s), {} left out (bug {:?}) broke {:?} at {} µs: {}\n\
         replay: sim::run(Config {{ seed: {}, requests: {}, bug: {:?}, skip: {:#x} }}, true)\n\
         schedule:\n{}",
        r.config.seed,
        r.config.requests,
        r.config.skip.count_ones(),
        r.config.bug,
        v.invariant,
        v.at,
        v.detail,
        r.config.seed,
        r.config.requests,
        r.config.bug,
        r.config.skip,
        r.trace.join("\n")
    )
}

/// A failure recorded by a simulated engine: its cause and message.
pub(crate) type Reason = (Cause, String);

/// The engine's deadline rule ([`watchdog::overdue`]) on the simulated clock: the
/// failure of a room in `state` past `deadline` at `now`, if it is overdue.
pub(crate) fn overdue(state: crate::room::State, deadline: u64, now: u64) -> Option<Reason> {
    // The settings in the simulator's unit (µs), for the reason's text.
    let config = crate::config::Config {
        bootstrap_timeout_ms: BOOTSTRAP_US,
        waiting_timeout_ms: WAITING_US,
        transfer_timeout_ms: TRANSFER_US,
        ..Default::default()
    };
    let (cause, what, n) = watchdog::overdue(state, deadline, now, &config)?;
    Some((
        cause,
        format!("deadline {what}={n} (µs here) in state {state}"),
    ))
}
