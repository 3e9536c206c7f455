//! The workload: requests, each a room id with its prefill and decode engines, started
//! one after the other, and what their hosts do to them (create, enqueue, abort, poll,
//! clear), with strangers' aborts and broken links among them.

use super::net::{Msg, Node};
use super::{decode, prefill, Ev, Rng, World, TICK_US};

/// One request of the workload: the rooms its prefill and decode engines create for it
/// under one id, and what its hosts do to them.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub id: u64,
    pub prefills: Vec<usize>,
    pub decodes: Vec<usize>,
    /// Pages each decode engine grants.
    pub pages: usize,
    /// Chunks the prefill hosts enqueue (the last closes the room).
    pub chunks: u32,
    /// Layers (kv buffers) of the model; with more than one, a host enqueues each
    /// chunk layer by layer (`kvxfer_enqueue_layers`).
    pub layers: u32,
    /// The prefill rooms are bound to the decode engines.
    pub bound: bool,
    /// The prefill hosts never create their rooms (the request was cancelled before
    /// prefill scheduled it).
    pub prefill_skips: bool,
}

/// What the hosts' schedulers do.
#[derive(Debug, Clone)]
pub(crate) enum Host {
    Start {
        req: usize,
    },
    PrefillCreate {
        req: usize,
        p: usize,
    },
    PrefillEnqueue {
        req: usize,
        p: usize,
    },
    PrefillAbort {
        req: usize,
        p: usize,
    },
    PrefillPoll {
        req: usize,
        p: usize,
    },
    DecodeCreate {
        req: usize,
        d: usize,
    },
    DecodeAbort {
        req: usize,
        d: usize,
    },
    DecodePoll {
        req: usize,
        d: usize,
    },
    /// Prefill engine `p`, none of request `req`'s, aborts its decode room on `d`.
    PrefillStranger {
        p: usize,
        d: usize,
        req: usize,
    },
    /// Decode engine `d` sends prefill `p` an abort for `id` that no room of its asked
    /// for (a stranger to the room, or a confused engine).
    Stranger {
        d: usize,
        p: usize,
        id: u64,
    },
}

/// A random non-empty subset of `0..n`, in order.
pub(super) fn subset(rng: &mut Rng, n: usize) -> Vec<usize> {
    loop {
        let v: Vec<usize> = (0..n).filter(|_| rng.chance(60)).collect();
        if !v.is_empty() {
            return v;
        }
    }
}

impl World {
    /// The workload: requests start one after the other, spread over time.
    pub(super) fn plan(&mut self) {
        let mut start = 0;
        for req in 0..self.requests.len() {
            start += self.rng.range(200, 3_000);
            self.net.queue.push(start, Ev::Host(Host::Start { req }));
        }
        for p in 0..self.prefills.len() {
            self.net.queue.push(TICK_US, Ev::Tick(Node::Prefill(p)));
        }
        for d in 0..self.decodes.len() {
            self.net.queue.push(TICK_US, Ev::Tick(Node::Decode(d)));
        }
    }

    /// Request `req` starts under an id no earlier request still holds (the router
    /// reuses an id once every engine cleared its room); its hosts' actions follow.
    fn start(&mut self, req: usize) {
        if req < 64 && self.skip & 1 << req != 0 {
            self.started += 1;
            return;
        }
        let free: Vec<u64> = (1..=self.ids)
            .filter(|id| !self.in_use.contains_key(id))
            .collect();
        if free.is_empty() {
            return self.at(TICK_US, Ev::Host(Host::Start { req }));
        }
        let id = free[self.rng.range(0, free.len() as u64 - 1) as usize];
        self.requests[req].id = id;
        self.in_use.insert(id, req);
        self.started += 1;
        self.last_start = self.now;
        let r = self.requests[req].clone();
        let mut open = 0;
        for &p in &r.prefills {
            if !r.prefill_skips {
                open += 1;
                let t = self.rng.range(0, 4_000);
                self.at(t, Ev::Host(Host::PrefillCreate { req, p }));
            }
            if self.rng.chance(10) {
                let t = self.rng.range(0, 10_000);
                self.at(t, Ev::Host(Host::PrefillAbort { req, p }));
            }
        }
        for &d in &r.decodes {
            open += 1;
            let t = self.rng.range(0, 4_000);
            self.at(t, Ev::Host(Host::DecodeCreate { req, d }));
            if self.rng.chance(20) {
                let t = self.rng.range(0, 10_000);
                self.at(t, Ev::Host(Host::DecodeAbort { req, d }));
            }
        }
        self.open[req] = open;
        self.note(|| format!("request {req} starts as room {id}: {r:?}"));
        if self.rng.chance(5) {
            let d = self.rng.range(0, self.decodes.len() as u64 - 1) as usize;
            let p = self.rng.range(0, self.prefills.len() as u64 - 1) as usize;
            let t = self.rng.range(0, 6_000);
            self.at(t, Ev::Host(Host::Stranger { d, p, id }));
        }
        if self.rng.chance(5) {
            // A prefill engine of the cluster that is none of the request's aborts a
            // decode room of it, naming its generation.
            let d = r.decodes[self.rng.range(0, r.decodes.len() as u64 - 1) as usize];
            let p = self.rng.range(0, self.prefills.len() as u64 - 1) as usize;
            let t = self.rng.range(0, 6_000);
            if !r.prefills.contains(&p) {
                self.at(t, Ev::Host(Host::PrefillStranger { p, d, req }));
            }
        }
        if self.rng.chance(4) {
            let d = self.rng.range(0, self.decodes.len() as u64 - 1) as usize;
            let p = self.rng.range(0, self.prefills.len() as u64 - 1) as usize;
            let t = self.rng.range(0, 6_000);
            self.at(t, Ev::Cut { p, d });
        }
        if self.rng.chance(6) {
            // A stall long enough to meet the deadlines now and then.
            let d = self.rng.range(0, self.decodes.len() as u64 - 1) as usize;
            let p = self.rng.range(0, self.prefills.len() as u64 - 1) as usize;
            let (t, us) = (self.rng.range(0, 6_000), self.rng.range(1_000, 40_000));
            self.at(t, Ev::Stall { p, d, us });
        }
        if self.rng.chance(2) {
            let node = if self.rng.chance(50) {
                Node::Prefill(self.rng.range(0, self.prefills.len() as u64 - 1) as usize)
            } else {
                Node::Decode(self.rng.range(0, self.decodes.len() as u64 - 1) as usize)
            };
            let t = self.rng.range(0, 8_000);
            self.at(t, Ev::Crash(node));
        }
    }

    /// One engine is done with request `req`'s room (cleared it, or gave up creating
    /// it); the last one frees the id.
    pub fn room_done(&mut self, req: usize) {
        self.open[req] -= 1;
        if self.open[req] == 0 {
            let id = self.requests[req].id;
            self.in_use.remove(&id);
            self.note(|| format!("request {req} is over: room {id} may be reused"));
        }
    }

    pub(super) fn host(&mut self, h: Host) {
        match h {
            Host::PrefillCreate { req, p } => prefill::host_create(self, req, p),
            Host::PrefillEnqueue { req, p } => prefill::host_enqueue(self, req, p),
            Host::PrefillAbort { req, p } => prefill::host_abort(self, req, p),
            Host::PrefillPoll { req, p } => prefill::host_poll(self, req, p),
            Host::DecodeCreate { req, d } => decode::host_create(self, req, d),
            Host::DecodeAbort { req, d } => decode::host_abort(self, req, d),
            Host::DecodePoll { req, d } => decode::host_poll(self, req, d),
            Host::Start { req } => self.start(req),
            Host::PrefillStranger { p, d, req } => {
                let id = self.requests[req].id;
                let dgen = self.decodes[d].rooms.get(&id).filter(|r| r.req == req);
                if let (Some(dgen), Some(inc)) = (dgen.map(|r| r.dgen), self.net.up(p, d)) {
                    self.note(|| format!("p{p}, a stranger, aborts d{d}'s room {id}"));
                    let reason = format!("stranger p{p}");
                    self.send_to_decode(p, d, inc, Msg::Abort { id, dgen, reason });
                }
            }
            Host::Stranger { d, p, id } => {
                let reason = format!("stranger d{d} [req none]");
                self.note(|| format!("d{d} sends p{p} a stranger's abort of room {id}"));
                // A generation no use of the id has (decode generations start at 1).
                if let Some(inc) = self.net.up(p, d) {
                    let peer = self.prefill_peer(p, inc);
                    self.decodes[d].stranger_abort(id, peer);
                    self.send_to_prefill(
                        d,
                        p,
                        inc,
                        Msg::Abort {
                            id,
                            dgen: 0,
                            reason,
                        },
                    );
                }
            }
        }
    }
}
