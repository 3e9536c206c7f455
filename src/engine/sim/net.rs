//! The simulated network: one link between each prefill and decode engine, each
//! direction first in, first out with its own random delays (so that messages on
//! different links overtake each other), broken and made again as a new incarnation;
//! and the queue of everything scheduled.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::Ev;

/// An engine: prefill or decode, by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Node {
    Prefill(usize),
    Decode(usize),
}

/// What the engines tell each other (the control messages, and the data writes as one
/// page each).
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    Dest {
        id: u64,
        dgen: u64,
        pages: Vec<u32>,
    },
    Abort {
        id: u64,
        dgen: u64,
        reason: String,
    },
    AbortAck {
        id: u64,
        dgen: u64,
    },
    /// The prefill engine sent every page of the destination (`pages` of them).
    Done {
        id: u64,
        dgen: u64,
        pages: u32,
    },
    /// One destination page of kv buffer `buffer` written for request `req` by the
    /// prefill room's use `rgen`.
    Write {
        id: u64,
        dgen: u64,
        page: u32,
        buffer: u32,
        req: usize,
        rgen: u64,
    },
}

/// Events by time; ties in the order they were scheduled.
#[derive(Default)]
pub(crate) struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64)>>,
    events: std::collections::HashMap<u64, Ev>,
    seq: u64,
    /// Messages on their way.
    pub in_flight: usize,
}

impl Queue {
    pub fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.in_flight += usize::from(matches!(ev, Ev::Deliver { .. }));
        self.heap.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, ev);
    }

    pub fn pop(&mut self) -> Option<(u64, Ev)> {
        let Reverse((at, seq)) = self.heap.pop()?;
        let ev = self.events.remove(&seq).expect("scheduled");
        self.in_flight -= usize::from(matches!(ev, Ev::Deliver { .. }));
        Some((at, ev))
    }
}

#[derive(Clone, Copy)]
struct Link {
    inc: u32,
    up: bool,
    /// The last delivery time scheduled, per lane: to the prefill, to the decode, and
    /// the data writes to the decode (their own connection or queue pair, in no order
    /// with the control messages).
    last: [u64; 3],
    /// Nothing is delivered before this time (a stalled link, a slow reader).
    stalled_until: u64,
}

pub(crate) struct Net {
    pub queue: Queue,
    /// Whether writes go over RDMA (land whatever the decode room's state) or TCP (the
    /// decode engine's receiver checks each).
    pub rdma: bool,
    links: Vec<Vec<Link>>,
}

impl Net {
    pub fn new(n_p: usize, n_d: usize, rdma: bool) -> Net {
        let link = Link {
            inc: 1,
            up: true,
            last: [0, 0, 0],
            stalled_until: 0,
        };
        Net {
            queue: Queue::default(),
            rdma,
            links: vec![vec![link; n_d]; n_p],
        }
    }

    /// The current incarnation of the link between `p` and `d`, if it is up.
    pub fn up(&self, p: usize, d: usize) -> Option<u32> {
        let l = &self.links[p][d];
        l.up.then_some(l.inc)
    }

    /// Whether incarnation `inc` of the link is the one up.
    pub fn alive(&self, p: usize, d: usize, inc: u32) -> bool {
        self.up(p, d) == Some(inc)
    }

    /// Queues `msg` to `to` over the current link, delivered `delay` µs from `now` but
    /// never before what the link carries ahead of it. Dropped if the link is down.
    pub fn send(&mut self, now: u64, delay: u64, p: usize, d: usize, to: super::Node, msg: Msg) {
        let l = &mut self.links[p][d];
        if !l.up {
            return;
        }
        let dir = match (to, &msg) {
            (Node::Prefill(_), _) => 0,
            (Node::Decode(_), Msg::Write { .. }) => 2,
            (Node::Decode(_), _) => 1,
        };
        let at = (now + delay).max(l.last[dir]).max(l.stalled_until);
        l.last[dir] = at;
        let inc = l.inc;
        self.queue.push(at, Ev::Deliver { p, d, inc, to, msg });
    }

    /// The link delivers nothing before `until` (what it carries waits, in order).
    pub fn stall(&mut self, p: usize, d: usize, until: u64) {
        let l = &mut self.links[p][d];
        l.stalled_until = l.stalled_until.max(until);
    }

    /// Breaks the link: what it carries is lost. Returns the incarnation broken, if it
    /// was up.
    pub fn cut(&mut self, p: usize, d: usize) -> Option<u32> {
        let l = &mut self.links[p][d];
        if !l.up {
            return None;
        }
        l.up = false;
        Some(l.inc)
    }

    /// Makes the link again, as a new incarnation; returns it.
    pub fn reconnect(&mut self, p: usize, d: usize) -> u32 {
        let l = &mut self.links[p][d];
        if !l.up {
            l.inc += 1;
            l.up = true;
        }
        l.inc
    }
}
