//! Per-engine counters and gauges, readable as a struct and as Prometheus text.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Shared;
use crate::room::{Cause, State};

/// Counters, all Relaxed: each is an independent tally read for reporting.
#[derive(Default)]
pub(crate) struct Metrics {
    pub rooms_created: AtomicU64,
    pub rooms_succeeded: AtomicU64,
    pub rooms_failed: [AtomicU64; Cause::ALL.len()],
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub chunks: AtomicU64,
    pub peers_lost: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub dropped_frames: AtomicU64,
    pub unknown_room_frames: AtomicU64,
    pub held: AtomicU64,
    pub held_overflow: AtomicU64,
    pub held_expired: AtomicU64,
}

impl Metrics {
    pub fn created(&self) {
        self.rooms_created.fetch_add(1, Ordering::Relaxed);
    }
    pub fn succeeded(&self) {
        self.rooms_succeeded.fetch_add(1, Ordering::Relaxed);
    }
    pub fn failed(&self, cause: Cause) {
        let i = Cause::ALL.iter().position(|&c| c == cause).unwrap_or(0);
        self.rooms_failed[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// A consistent-enough copy of an engine's metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Rooms currently present, by state (index = state value: failed, bootstrapping,
    /// waiting_for_input, transferring, success).
    pub rooms_by_state: [u64; 5],
    /// Rooms created since start.
    pub rooms_created: u64,
    /// Rooms that reached SUCCESS.
    pub rooms_succeeded: u64,
    /// Rooms that reached FAILED, by cause (index = position in `Cause::ALL`).
    pub rooms_failed: [u64; 10],
    /// Payload bytes written to peers.
    pub bytes_sent: u64,
    /// Payload bytes read from peers.
    pub bytes_received: u64,
    /// Chunks fully sent.
    pub chunks: u64,
    /// Rooms live now (not terminal).
    pub inflight: u64,
    /// Peer engines lost.
    pub peers_lost: u64,
    /// Malformed or out-of-protocol frames.
    pub protocol_errors: u64,
    /// Data frames discarded because their room was gone or terminal.
    pub dropped_frames: u64,
    /// Peer messages naming an unknown room.
    pub unknown_room_frames: u64,
    /// Early destinations held (prefill), overflowed, and expired.
    pub held: u64,
    /// Early destinations refused because the holding area was full.
    pub held_overflow: u64,
    /// Early destinations whose room never came.
    pub held_expired: u64,
}

impl MetricsSnapshot {
    /// Rooms failed in all.
    pub fn rooms_failed_total(&self) -> u64 {
        self.rooms_failed.iter().sum()
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn prometheus(&self, role: &str) -> String {
        let mut o = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                o,
                "# HELP kvxfer_{name} {help}\n# TYPE kvxfer_{name} counter"
            );
            let _ = writeln!(o, "kvxfer_{name}{{role=\"{role}\"}} {v}");
        };
        counter("rooms_created_total", "Rooms created.", self.rooms_created);
        counter(
            "rooms_succeeded_total",
            "Rooms that reached SUCCESS.",
            self.rooms_succeeded,
        );
        counter(
            "bytes_sent_total",
            "KV payload bytes written to peers.",
            self.bytes_sent,
        );
        counter(
            "bytes_received_total",
            "KV payload bytes read from peers.",
            self.bytes_received,
        );
        counter("chunks_total", "Chunks fully sent.", self.chunks);
        counter("peers_lost_total", "Peer engines lost.", self.peers_lost);
        counter(
            "protocol_errors_total",
            "Malformed or unexpected frames.",
            self.protocol_errors,
        );
        counter(
            "dropped_frames_total",
            "Data frames discarded for gone or terminal rooms.",
            self.dropped_frames,
        );
        counter(
            "unknown_room_frames_total",
            "Peer messages naming an unknown room.",
            self.unknown_room_frames,
        );
        counter(
            "held_destinations_total",
            "Destinations that arrived before their room.",
            self.held,
        );
        counter(
            "held_overflow_total",
            "Early destinations refused: holding area full.",
            self.held_overflow,
        );
        counter(
            "held_expired_total",
            "Early destinations whose room never came.",
            self.held_expired,
        );
        let _ = writeln!(o, "# HELP kvxfer_rooms_failed_total Rooms that reached FAILED, by cause.\n# TYPE kvxfer_rooms_failed_total counter");
        for (c, v) in Cause::ALL.iter().zip(self.rooms_failed) {
            let _ = writeln!(
                o,
                "kvxfer_rooms_failed_total{{role=\"{role}\",cause=\"{}\"}} {v}",
                c.name()
            );
        }
        let _ = writeln!(
            o,
            "# HELP kvxfer_rooms Rooms present, by state.\n# TYPE kvxfer_rooms gauge"
        );
        for (i, v) in self.rooms_by_state.iter().enumerate() {
            let s = State::from_u8(i as u8).map_or("unknown", State::name);
            let _ = writeln!(o, "kvxfer_rooms{{role=\"{role}\",state=\"{s}\"}} {v}");
        }
        let _ = writeln!(o, "# HELP kvxfer_rooms_inflight Rooms not yet terminal.\n# TYPE kvxfer_rooms_inflight gauge");
        let _ = writeln!(
            o,
            "kvxfer_rooms_inflight{{role=\"{role}\"}} {}",
            self.inflight
        );
        o
    }
}

impl Shared {
    pub(crate) fn metrics_snapshot(&self) -> MetricsSnapshot {
        let m = &self.metrics;
        let mut s = MetricsSnapshot {
            rooms_created: m.rooms_created.load(Ordering::Relaxed),
            rooms_succeeded: m.rooms_succeeded.load(Ordering::Relaxed),
            bytes_sent: m.bytes_sent.load(Ordering::Relaxed),
            bytes_received: m.bytes_received.load(Ordering::Relaxed),
            chunks: m.chunks.load(Ordering::Relaxed),
            peers_lost: m.peers_lost.load(Ordering::Relaxed),
            protocol_errors: m.protocol_errors.load(Ordering::Relaxed),
            dropped_frames: m.dropped_frames.load(Ordering::Relaxed),
            unknown_room_frames: m.unknown_room_frames.load(Ordering::Relaxed),
            held: m.held.load(Ordering::Relaxed),
            held_overflow: m.held_overflow.load(Ordering::Relaxed),
            held_expired: m.held_expired.load(Ordering::Relaxed),
            ..Default::default()
        };
        for (i, c) in m.rooms_failed.iter().enumerate() {
            s.rooms_failed[i] = c.load(Ordering::Relaxed);
        }
        for room in self.rooms.snapshot() {
            let st = room.state();
            s.rooms_by_state[st as usize] += 1;
            if !st.is_terminal() {
                s.inflight += 1;
            }
        }
        s
    }
}
