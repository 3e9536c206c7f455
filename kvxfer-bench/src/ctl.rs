//! The control channel between the decode side (which drives the run) and the prefill
//! side: one JSON message per line over the child's stdin/stdout, or over a TCP connection
//! between two hosts. The data itself moves only through the engines (and the baseline
//! streams).
//!
//! decode -> prefill ([`ToPrefill`]): `plan`, then any number of `tcp` (a baseline) and
//! `run` (a kvxfer phase, during which `upto` and `end` announce its rooms), then `quit`.
//! prefill -> decode ([`ToDecode`]): `ready` or `error` for the plan, `tcp_ready` and
//! `tcp_done` for a baseline, `phase_done` (every room's record) after a phase.

use std::fmt;
use std::io::{self, BufRead, BufReader, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::params::{Feed, Params};
use crate::pattern::mix;
use crate::sys::Usage;

/// What the decode side tells the prefill side.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToPrefill {
    /// The run's parameters; the first message.
    Plan(Box<Params>),
    /// A TCP baseline: accept `conns` streams and send `bytes` over them (for `secs`
    /// instead when non-zero).
    Tcp {
        conns: usize,
        bytes: u64,
        secs: f64,
    },
    /// A kvxfer phase on the prefill engines of set `engine` (one engine per rank), its
    /// rooms counted from `start`, fed to the engines as `feed` says.
    Run {
        start: u64,
        engine: usize,
        feed: Feed,
    },
    /// The rooms below this index have their destination.
    Upto(u64),
    /// The phase has no rooms from this index on.
    End(u64),
    Quit,
}

/// What the prefill side tells the decode side.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToDecode {
    /// The plan is set up: the prefill engines' addresses, by set (one set per `--auth`
    /// pair, in pair order, of one engine each; between layouts, the ranks of the TP
    /// phases, then the one rank of the equal-TP phases) and rank, and the TCP
    /// baseline's listener.
    Ready {
        engines: Vec<Vec<String>>,
        baseline: String,
    },
    /// The plan could not be set up.
    Error(String),
    /// The baseline's buffers are ready: connect.
    TcpReady,
    /// The baseline was sent: bytes, and this process's usage over it.
    TcpDone { bytes: u64, usage: Usage },
    /// A phase ended: every room's record in index order (every rank's together), this
    /// process's usage over the phase, the prefill scheduler loops' own, and the data
    /// runs the phase's engines wrote (their `data_runs_sent`).
    PhaseDone {
        rooms: Vec<PrefillRoom>,
        usage: Usage,
        driver: Usage,
        runs: u64,
    },
}

impl ToDecode {
    /// The message's name, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            ToDecode::Ready { .. } => "ready",
            ToDecode::Error(_) => "error",
            ToDecode::TcpReady => "tcp_ready",
            ToDecode::TcpDone { .. } => "tcp_done",
            ToDecode::PhaseDone { .. } => "phase_done",
        }
    }
}

/// One room of a phase as the prefill side saw it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillRoom {
    /// CLOCK_MONOTONIC ns of the first enqueue.
    pub t_enq: u64,
    /// When the scheduler saw the room terminal.
    pub t_term: u64,
    pub outcome: Outcome,
    /// A phase with simulated compute (`--layerwise`): the room's forward pass.
    pub compute: Option<Computed>,
}

/// A room's simulated forward pass on the prefill scheduler thread (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Computed {
    /// Its first layer's compute began: where time-to-first-token starts.
    pub start: u64,
    /// The scheduler woke after its last layer's compute (the last layer's end on the
    /// compute timeline is `start` plus the compute alone; this is later by that wake's
    /// overshoot); 0 when the room ended before its compute did.
    pub end: u64,
    /// Per layer computed: how late the scheduler woke after the layer's end (the
    /// sleep's overshoot, plus whatever else held the thread).
    pub late_ns: Vec<u64>,
}

impl Computed {
    /// Time-to-first-token: from the first layer's compute to the decode side's SUCCESS
    /// at `t_done`, both on this host's CLOCK_MONOTONIC.
    pub fn ttft_ns(&self, t_done: u64) -> u64 {
        t_done.saturating_sub(self.start)
    }
}

/// How a room ended on the prefill side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok,
    /// FAILED with the engine's cause name (or `create_error`, `poll_error`, `unknown`),
    /// recorded locally or reported by the peer.
    Failed {
        cause: String,
        from_peer: bool,
    },
}

impl Outcome {
    pub fn local(cause: &str) -> Outcome {
        Outcome::Failed {
            cause: cause.into(),
            from_peer: false,
        }
    }
}

impl PrefillRoom {
    /// One room as every rank saw it: from the first rank's enqueue to the last rank's
    /// end; SUCCESS if every rank's was, else the first rank's own failure (one not
    /// reported by a peer), or the first failure.
    pub fn merge(ranks: &[PrefillRoom]) -> PrefillRoom {
        let failed = || {
            ranks
                .iter()
                .map(|r| &r.outcome)
                .filter(|o| **o != Outcome::Ok)
        };
        let own = failed().find(|o| {
            matches!(
                o,
                Outcome::Failed {
                    from_peer: false,
                    ..
                }
            )
        });
        PrefillRoom {
            t_enq: ranks.iter().map(|r| r.t_enq).min().unwrap_or(0),
            t_term: ranks.iter().map(|r| r.t_term).max().unwrap_or(0),
            outcome: own
                .or_else(|| failed().next())
                .cloned()
                .unwrap_or(Outcome::Ok),
            // --layerwise runs TP 1 -> 1: one rank computes.
            compute: ranks.first().and_then(|r| r.compute.clone()),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Ok => f.write_str("ok"),
            Outcome::Failed { cause, from_peer } => {
                write!(f, "{cause}:{}", if *from_peer { "peer" } else { "local" })
            }
        }
    }
}

/// One end of the control channel.
pub struct Ctl {
    r: Box<dyn BufRead + Send>,
    w: Box<dyn Write + Send>,
}

impl Ctl {
    pub fn new(r: impl io::Read + Send + 'static, w: impl Write + Send + 'static) -> Ctl {
        Ctl {
            r: Box::new(BufReader::new(r)),
            w: Box::new(io::BufWriter::new(w)),
        }
    }

    /// Writes one message and flushes it.
    pub fn send(&mut self, m: &impl Serialize) -> Result<(), String> {
        send(&mut self.w, m)
    }

    /// Reads one message; the end of the stream is an error.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T, String> {
        recv(&mut self.r)
    }

    /// Splits into the reading and the writing half.
    pub fn split(self) -> (Box<dyn BufRead + Send>, Box<dyn Write + Send>) {
        (self.r, self.w)
    }
}

/// Writes `m` as one line and flushes it.
pub fn send(w: &mut dyn Write, m: &impl Serialize) -> Result<(), String> {
    let mut line = serde_json::to_vec(m).map_err(|e| format!("control message: {e}"))?;
    line.push(b'\n');
    w.write_all(&line)
        .and_then(|()| w.flush())
        .map_err(|e| format!("control channel write failed: {e}"))
}

/// Reads one line as a `T`; the end of the stream is an error.
pub fn recv<T: DeserializeOwned>(r: &mut dyn BufRead) -> Result<T, String> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) => Err("the other side closed the control channel".into()),
        Ok(_) => serde_json::from_str(&line).map_err(|e| {
            let line = line.trim_end();
            let shown: String = line.chars().take(200).collect();
            format!("bad control message '{shown}': {e}")
        }),
        Err(e) => Err(format!("control channel read failed: {e}")),
    }
}

/// Which side aborts a planned abort, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortAt {
    /// The decode scheduler, right after sending the destination.
    DecodeEarly,
    /// The decode scheduler, once it sees the room transferring.
    DecodeMid,
    /// The prefill scheduler, once the room has its destination (waiting or
    /// transferring). Not earlier: a prefill room cleared before the decode destination
    /// arrives leaves that destination waiting in the holding area until it expires.
    PrefillMid,
}

/// What both sides know about room `idx` of a run, derived from the seed alone.
#[derive(Debug, Clone, Copy)]
pub struct RoomPlan {
    /// Prompt tokens.
    pub tokens: usize,
    /// Pages at the prefill's page size.
    pub pages: usize,
    pub abort: Option<AbortAt>,
}

pub fn room_plan(p: &Params, idx: u64) -> RoomPlan {
    let h = mix(p.seed ^ mix(idx.wrapping_add(0x5151)));
    let span = (p.prompt_max - p.prompt_min + 1) as u64;
    let tokens = p.prompt_min + (h % span) as usize;
    let h2 = mix(h);
    let u = (h2 >> 11) as f64 / (1u64 << 53) as f64;
    let abort = (u < p.abort_rate).then(|| match mix(h2) % 3 {
        0 => AbortAt::DecodeEarly,
        1 => AbortAt::DecodeMid,
        _ => AbortAt::PrefillMid,
    });
    RoomPlan {
        tokens,
        pages: p.pages_for(tokens),
        abort,
    }
}

/// Both sides' scheduler loops found nothing to do: wait as `--sched` says, for a room
/// of `engine` to change state after `seen` (the engine's count of changes read before
/// the rooms were polled) or for `longest`, or sleep `--poll-us`.
pub fn idle(p: &Params, engine: &kvxfer::Engine, seen: u64, longest: std::time::Duration) {
    match p.sched {
        crate::args::Sched::Wait => {
            engine.wait(seen, longest);
        }
        crate::args::Sched::Poll => {
            std::thread::sleep(std::time::Duration::from_micros(p.poll_us));
        }
    }
}

/// The router's room id for room `idx` of a run (both sides agree on it).
pub fn room_id(p: &Params, idx: u64) -> u64 {
    (mix(p.seed) & 0xFFFF_FFFF_0000_0000) | (idx & 0xFFFF_FFFF)
}
