//! What a run measured, before it is reported: each kvxfer phase's figures ([`KvResult`])
//! and the baselines beside them ([`Report`]).

use std::collections::BTreeMap;

use crate::baseline::Measured;
use crate::params::Feed;
use crate::sys::{HostBusy, Usage};

/// Everything one run measured.
#[derive(Debug, Default)]
pub struct Report {
    /// Every kvxfer phase together.
    pub kv: KvResult,
    /// Each kvxfer phase on its own, in order.
    pub phases: Vec<KvResult>,
    /// Each TCP baseline, as the decode (receiving) side measured it.
    pub tcp: Vec<Measured>,
    /// The prefill (sending) side's usage over each TCP baseline.
    pub tcp_send: Vec<Usage>,
    pub memcpy: Vec<Measured>,
    /// With `--same-host`: memcpy of the pages, scattered, on `conns` threads.
    pub memcpy_pages: Vec<Measured>,
    /// Both processes on one host: cross-process latencies are valid.
    pub same_host: bool,
    /// The 1-minute load average before and after the run (other work on the host).
    pub loadavg: (f64, f64),
    /// `--pool-pages`, and the share of the decode pool the kernel put on huge pages.
    pub pool_pages: &'static str,
    pub pool_huge_fraction: Option<f64>,
}

/// The 1-minute load average, NaN if unknown.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// A kvxfer phase, or several added up.
#[derive(Debug, Clone, Default)]
pub struct KvResult {
    /// Whether the phase's engines authenticated (`--auth`; a sum: whether any did).
    pub auth: bool,
    /// A phase of the TP ranks (`--prefill-tp`, `--decode-tp`), not of the equal-TP
    /// comparison (a sum: whether any was).
    pub tp: bool,
    /// How the prefill side fed the phase's rooms (`--layerwise`: simulated compute,
    /// layer-wise or whole-chunk; not added up: a sum keeps its own).
    pub feed: Feed,
    /// Nanoseconds, successful rooms of a phase with simulated compute, one host only:
    /// time-to-first-token, the first layer's compute (prefill) to decode SUCCESS.
    pub ttft: Vec<u64>,
    /// The same rooms' compute alone: every layer of every chunk at
    /// `--compute-us-per-layer`.
    pub compute: Vec<u64>,
    /// Every layer computed in the phase: how late the prefill scheduler woke after the
    /// layer's end (its sleep's overshoot).
    pub late: Vec<u64>,
    /// The rooms of `ttft`: how late the scheduler woke after the last layer's end, so
    /// that TTFT = compute + this + what came after the last enqueue.
    pub last_late: Vec<u64>,
    /// Nanoseconds, successful rooms, one host only: the time the link gave each room,
    /// rooms taken in the order they reached SUCCESS: from the previous room's SUCCESS
    /// (or the room's first enqueue, if later) to its own. With every layer enqueued at
    /// once (no compute) it is a room's transfer whatever the number of rooms in flight
    /// queued before it, where TTFT is that number times it. The first room of a phase
    /// to succeed has none.
    pub room_link: Vec<u64>,
    /// Data runs the prefill engines wrote (`data_runs_sent`: TCP frames, RDMA writes).
    pub runs: u64,
    /// Pages of one buffer at the prefill's page size (every head of `page_tokens`
    /// tokens) times KV buffers, over the rooms that succeeded: what `runs` is counted
    /// per.
    pub buffer_pages: u64,
    /// Rooms started.
    pub rooms: u64,
    /// Rooms that reached SUCCESS on the decode side and whose pages checked.
    pub ok: u64,
    /// KV payload bytes of those rooms.
    pub bytes: u64,
    /// Bytes whose every word was checked (all of `bytes` with --verify full).
    pub bytes_checked: u64,
    pub secs: f64,
    /// The host's CPUs while the phase ran (the prefill process and the kernel's threads
    /// too, when both sides share the host).
    pub host: HostBusy,
    /// Nanoseconds, successful rooms only: first enqueue (prefill) to decode SUCCESS.
    pub lat_e2e: Vec<u64>,
    /// set_destination to decode SUCCESS.
    pub lat_decode: Vec<u64>,
    /// First enqueue to prefill SUCCESS.
    pub lat_prefill: Vec<u64>,
    /// First enqueue (prefill) to the decode side's first poll that saw the room
    /// TRANSFERRING (its first data had landed), or SUCCESS when no poll caught it
    /// transferring.
    pub lat_first: Vec<u64>,
    /// Rooms of `lat_first` first seen at SUCCESS.
    pub first_at_success: u64,
    pub failed: BTreeMap<String, u64>,
    pub prefill_failed: BTreeMap<String, u64>,
    pub expected: u64,
    pub unexpected: u64,
    pub prefill_expected: u64,
    pub prefill_unexpected: u64,
    pub aborts_planned: u64,
    pub aborts_too_late: u64,
    /// Rooms the prefill side saw FAILED but the decode side SUCCESS (the two engines
    /// disagree: the decode side took data the prefill side had given up on).
    pub split_prefill_failed_decode_ok: u64,
    /// Rooms the prefill side saw SUCCESS but the decode side FAILED (expected when the
    /// decode side aborts after the prefill finished sending).
    pub split_prefill_ok_decode_failed: u64,
    /// Each process over the phase (engine and benchmark threads).
    pub decode: Usage,
    pub prefill: Usage,
    /// The benchmark's own threads: the decode checkers and the two scheduler loops.
    pub verify: Usage,
    pub driver: Usage,
    pub prefill_driver: Usage,
    /// The first few unexpected failures, verbatim.
    pub errors: Vec<String>,
}

impl KvResult {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }

    /// Cores of this host busy with other work than the run's two processes while the
    /// phase ran: the host's busy CPUs less both processes' CPU, per wall second (never
    /// below 0; it counts the kernel's threads' share of the run's own traffic too,
    /// `ksoftirqd`, a few % of a core on loopback). Another build or test on a two-core
    /// host takes the link's CPU: a phase with a core of other work ran on half the
    /// host. `None` where the host does not say; meaningful only when both sides share
    /// the host.
    pub fn others_cores(&self) -> Option<f64> {
        let host = self.host.cores()?;
        let own = (self.decode.secs() + self.prefill.secs()) / self.secs;
        Some((host - own).max(0.0))
    }
    pub fn rooms_per_sec(&self) -> f64 {
        self.ok as f64 / self.secs
    }
    /// Data runs (TCP frames, RDMA writes) per page of one buffer.
    pub fn runs_per_page(&self) -> f64 {
        self.runs as f64 / self.buffer_pages as f64
    }
    /// Payload GB delivered and verified.
    pub fn gb(&self) -> f64 {
        self.bytes as f64 / 1e9
    }
    /// The benchmark's own threads in the decode process.
    pub fn decode_bench(&self) -> Usage {
        self.verify + self.driver
    }
    /// Adds another phase's figures to these.
    pub fn absorb(&mut self, o: &KvResult) {
        self.auth |= o.auth;
        self.tp |= o.tp;
        self.ttft.extend(&o.ttft);
        self.room_link.extend(&o.room_link);
        self.compute.extend(&o.compute);
        self.late.extend(&o.late);
        self.last_late.extend(&o.last_late);
        self.runs += o.runs;
        self.buffer_pages += o.buffer_pages;
        self.rooms += o.rooms;
        self.ok += o.ok;
        self.bytes += o.bytes;
        self.bytes_checked += o.bytes_checked;
        self.secs += o.secs;
        self.lat_e2e.extend(&o.lat_e2e);
        self.lat_decode.extend(&o.lat_decode);
        self.lat_prefill.extend(&o.lat_prefill);
        self.lat_first.extend(&o.lat_first);
        self.first_at_success += o.first_at_success;
        for (k, v) in &o.failed {
            *self.failed.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.prefill_failed {
            *self.prefill_failed.entry(k.clone()).or_default() += v;
        }
        self.expected += o.expected;
        self.unexpected += o.unexpected;
        self.prefill_expected += o.prefill_expected;
        self.prefill_unexpected += o.prefill_unexpected;
        self.aborts_planned += o.aborts_planned;
        self.aborts_too_late += o.aborts_too_late;
        self.split_prefill_failed_decode_ok += o.split_prefill_failed_decode_ok;
        self.split_prefill_ok_decode_failed += o.split_prefill_ok_decode_failed;
        self.decode = self.decode + o.decode;
        self.host = self.host + o.host;
        self.prefill = self.prefill + o.prefill;
        self.verify = self.verify + o.verify;
        self.driver = self.driver + o.driver;
        self.prefill_driver = self.prefill_driver + o.prefill_driver;
        for e in &o.errors {
            self.note(e.clone());
        }
    }

    pub(crate) fn note(&mut self, e: String) {
        if self.errors.len() < 8 {
            self.errors.push(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_added_up_keep_every_rooms_ttft_compute_and_lateness() {
        let feed = Feed {
            simulate: true,
            by_layer: true,
            compute_us_per_layer: 10,
        };
        let a = KvResult {
            feed,
            ttft: vec![3, 4],
            compute: vec![2, 2],
            late: vec![7],
            last_late: vec![1, 2],
            ..Default::default()
        };
        let mut t = KvResult::default();
        t.absorb(&a);
        t.absorb(&a);
        assert_eq!(t.ttft, [3, 4, 3, 4]);
        assert_eq!(t.compute.len(), 4);
        assert_eq!(t.late, [7, 7]);
        assert_eq!(t.last_late, [1, 2, 1, 2]);
    }
}
