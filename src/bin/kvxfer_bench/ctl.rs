//! The control channel between the decode side (which drives the run) and the prefill
//! side: text lines over the child's stdin/stdout, or over a TCP connection between two
//! hosts. The data itself moves only through the engines (and the baseline streams).
//!
//! decode -> prefill: `plan ARGS...`, `tcp CONNS BYTES SECS`, `run`, `upto N`, `end N`,
//! `quit`. prefill -> decode: `ready ENGINE_ADDR BASELINE_ADDR` or `error MESSAGE`,
//! `tcpdone BYTES CPU_US`, `prec ...` per room then `pdone ...` after a run.

use std::io::{self, BufRead, BufReader, Write};

use crate::pattern::mix;

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

    /// Writes one line and flushes it.
    pub fn send(&mut self, line: &str) -> Result<(), String> {
        self.send_lazy(line)?;
        self.flush()
    }

    /// Writes one line without flushing (batching many lines).
    pub fn send_lazy(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.w, "{line}").map_err(|e| format!("control channel write failed: {e}"))
    }

    pub fn flush(&mut self) -> Result<(), String> {
        self.w
            .flush()
            .map_err(|e| format!("control channel write failed: {e}"))
    }

    /// Reads one line (without its newline); the end of the stream is an error.
    pub fn recv(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.r.read_line(&mut line) {
            Ok(0) => Err("the other side closed the control channel".into()),
            Ok(_) => Ok(line.trim_end().to_string()),
            Err(e) => Err(format!("control channel read failed: {e}")),
        }
    }

    /// Splits into the reading and the writing half.
    pub fn split(self) -> (Box<dyn BufRead + Send>, Box<dyn Write + Send>) {
        (self.r, self.w)
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
    pub pages: usize,
    pub abort: Option<AbortAt>,
}

pub fn room_plan(p: &crate::args::Params, idx: u64) -> RoomPlan {
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
        pages: p.pages_for(tokens),
        abort,
    }
}

/// The router's room id for room `idx` of a run (both sides agree on it).
pub fn room_id(p: &crate::args::Params, idx: u64) -> u64 {
    (mix(p.seed) & 0xFFFF_FFFF_0000_0000) | (idx & 0xFFFF_FFFF)
}
