//! Per-engine counters and gauges, readable as a struct and as Prometheus text.
//!
//! Every metric is one row of [`metrics_table!`]; the rows make the counters
//! ([`Metrics`]), the snapshot ([`MetricsSnapshot`]), the Prometheus text and, in
//! `ffi/engine.rs`, the copy into the C struct `kvxfer_metrics`. The counting rows
//! live here, in the node's [`Metrics`]; the computed rows (rooms by state, in flight,
//! draining) are the engine's, filled in by `metrics()` in `engine/core.rs`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::room::{Cause, State};

/// The metrics, one row each, in the order of the fields of the C struct
/// `kvxfer_metrics` (a test in `ffi/engine.rs` holds the two together). A row is
///
/// `kind snapshot_field (C fields) "Prometheus series" "help";`
///
/// and its kind says where the value comes from and how it is shown:
/// - `counter`: an `AtomicU64` in [`Metrics`], a `u64` in the snapshot, a Prometheus
///   counter;
/// - `gauge`: a `u64` the engine computes from its rooms (`engine/core.rs`), a
///   Prometheus gauge;
/// - `by_cause`: one counter per [`Cause`], indexed by position in [`Cause::ALL`]; in C
///   the total and the array indexed by `kvxfer_failure_cause` value, in Prometheus one
///   series per cause (label `cause`);
/// - `by_state`: rooms present per [`State`], indexed by state value; a gauge per state
///   (label `state`).
///
/// Adding a counter is one row here and one field in `kvxfer_metrics`; the code that
/// increments it names it as `metrics.<snapshot_field>`.
#[macro_export]
#[doc(hidden)]
macro_rules! metrics_table {
    ($then:ident) => {
        $then! {
            counter rooms_created (rooms_created)
                "kvxfer_rooms_created_total" "Rooms created.";
            counter rooms_succeeded (rooms_succeeded)
                "kvxfer_rooms_succeeded_total" "Rooms that reached SUCCESS.";
            by_cause rooms_failed (rooms_failed, rooms_failed_by_cause)
                "kvxfer_rooms_failed_total" "Rooms that reached FAILED, by cause.";
            by_state rooms_by_state (rooms_by_state)
                "kvxfer_rooms" "Rooms present, by state.";
            gauge inflight (inflight)
                "kvxfer_rooms_inflight" "Rooms not yet terminal.";
            counter bytes_sent (bytes_sent)
                "kvxfer_bytes_sent_total" "KV payload bytes written to peers.";
            counter bytes_received (bytes_received)
                "kvxfer_bytes_received_total" "KV payload bytes read from peers.";
            counter chunks (chunks)
                "kvxfer_chunks_total" "Chunks fully sent.";
            counter peers_lost (peers_lost)
                "kvxfer_peers_lost_total" "Peer engines lost.";
            counter protocol_errors (protocol_errors)
                "kvxfer_protocol_errors_total" "Malformed or unexpected frames.";
            counter dropped_frames (dropped_frames)
                "kvxfer_dropped_frames_total" "Data frames discarded for gone or terminal rooms.";
            counter unknown_room_frames (unknown_room_frames)
                "kvxfer_unknown_room_frames_total" "Peer messages naming an unknown room.";
            counter held (held_destinations)
                "kvxfer_held_destinations_total" "Destinations that arrived before their room.";
            counter held_overflow (held_overflow)
                "kvxfer_held_overflow_total" "Early destinations refused: holding area full.";
            counter held_expired (held_expired)
                "kvxfer_held_expired_total" "Early destinations whose room never came.";
            counter tombstone_overflow (tombstone_overflow)
                "kvxfer_tombstone_overflow_total"
                "Aborts or losses before their room that the holding area had no place for.";
            counter cleared_overflow (cleared_overflow)
                "kvxfer_cleared_overflow_total"
                "Cleared prefill rooms the holding area had no place to remember.";
            gauge rooms_draining (rooms_draining)
                "kvxfer_rooms_draining"
                "Rooms cleared before they drained, draining in the background.";
            counter auth_failures (auth_failures)
                "kvxfer_auth_failures_total"
                "Connections refused at authentication (no key, wrong key, bad proof, replay, TLS, not on this host, ...).";
            counter binding_refusals (binding_refusals)
                "kvxfer_binding_refusals_total"
                "Destinations and aborts refused: the room is bound to other decode engines.";
            counter data_runs_sent (data_runs_sent)
                "kvxfer_data_runs_sent_total"
                "Data runs written to peers (TCP data frames, RDMA writes), KV and aux.";
            counter peer_limit_refusals (peer_limit_refusals)
                "kvxfer_peer_limit_refusals_total"
                "Authenticated connections refused past a bound: more decode engines than a prefill engine serves, a data connection index out of range or already live.";
            counter bytes_verified (bytes_verified)
                "kvxfer_bytes_verified_total"
                "Decode: KV and aux bytes whose digest matched where they landed (integrity=verify).";
            counter integrity_failures (integrity_failures)
                "kvxfer_integrity_failures_total"
                "Rooms failed because a data run's digest did not match (decode: found; prefill: told).";
            counter pairings_tcp (pairings_tcp)
                "kvxfer_pairings_tcp_total" "Peer pairings whose data takes TCP.";
            counter pairings_rdma (pairings_rdma)
                "kvxfer_pairings_rdma_total" "Peer pairings whose data takes RDMA.";
            counter pairings_same_host (pairings_same_host)
                "kvxfer_pairings_same_host_total"
                "Peer pairings whose data is copied directly between the two processes.";
            counter same_host_fallbacks (same_host_fallbacks)
                "kvxfer_same_host_fallbacks_total"
                "Pairings on one host that took TCP because the same-host path could not be used.";
            counter registry_registrations (registry_registrations)
                "kvxfer_registry_registrations_total"
                "Discovery: times this engine put its entry into the registry (at start, when its registration changed, after its lease was lost).";
            counter registry_errors (registry_errors)
                "kvxfer_registry_errors_total"
                "Discovery: calls to etcd that failed (each retry counts) and watches that broke.";
            counter registry_outages (registry_outages)
                "kvxfer_registry_outages_total"
                "Discovery: times etcd stopped answering this engine (or did not answer at its start).";
            counter registry_rejected (registry_rejected)
                "kvxfer_registry_rejected_total"
                "Discovery: registry entries ignored: not signed with the cluster key, malformed, under another name, or an older incarnation than one seen.";
            counter registry_departures (registry_departures)
                "kvxfer_registry_departures_total"
                "Discovery: peers lost because their entry left the registry (lease expired, deleted) or a new incarnation replaced it.";
            counter pairings_cuda_ipc (pairings_cuda_ipc)
                "kvxfer_pairings_cuda_ipc_total"
                "Peer pairings on one host whose device pages are copied device to device through CUDA IPC.";
        }
    };
}

/// [`Metrics`]: the rows that count (`counter`, `by_cause`), as atomics.
macro_rules! counters_struct {
    ([$($done:tt)*]) => {
        /// Counters, all Relaxed: each is an independent tally read for reporting.
        #[derive(Default)]
        pub(crate) struct Metrics { $($done)* }
    };
    ([$($done:tt)*] counter $name:ident $help:literal; $($rest:tt)*) => {
        counters_struct!([$($done)* #[doc = $help] pub $name: AtomicU64,] $($rest)*);
    };
    ([$($done:tt)*] by_cause $name:ident $help:literal; $($rest:tt)*) => {
        counters_struct!(
            [$($done)* #[doc = $help] pub $name: [AtomicU64; Cause::ALL.len()],] $($rest)*
        );
    };
    ([$($done:tt)*] $computed:ident $name:ident $help:literal; $($rest:tt)*) => {
        counters_struct!([$($done)*] $($rest)*);
    };
}

/// A row's type in [`MetricsSnapshot`].
macro_rules! snapshot_type {
    (by_cause) => {
        [u64; Cause::ALL.len()]
    };
    (by_state) => {
        [u64; 5]
    };
    ($scalar:ident) => {
        u64
    };
}

/// How a row's array is indexed, for the field's documentation.
macro_rules! snapshot_index {
    (by_cause) => {
        "Indexed by position in [`Cause::ALL`]."
    };
    (by_state) => {
        "Indexed by state value ([`State`] as `u8`)."
    };
    ($scalar:ident) => {
        ""
    };
}

/// Reads a counting row from `$m` into `$s`; computed rows are left to the caller.
macro_rules! load_row {
    (counter $s:ident.$name:ident = $m:ident) => {
        $s.$name = $m.$name.load(Ordering::Relaxed)
    };
    (by_cause $s:ident.$name:ident = $m:ident) => {
        for (v, c) in $s.$name.iter_mut().zip(&$m.$name) {
            *v = c.load(Ordering::Relaxed);
        }
    };
    ($computed:ident $s:ident.$name:ident = $m:ident) => {};
}

/// Writes a row's Prometheus series.
macro_rules! text_row {
    (counter $o:ident, $v:expr, $series:literal, $help:literal) => {
        $o.scalar($series, $help, "counter", $v)
    };
    (gauge $o:ident, $v:expr, $series:literal, $help:literal) => {
        $o.scalar($series, $help, "gauge", $v)
    };
    (by_cause $o:ident, $v:expr, $series:literal, $help:literal) => {
        $o.labelled(
            $series,
            $help,
            "counter",
            "cause",
            Cause::ALL.iter().map(|c| c.name()).zip($v),
        )
    };
    (by_state $o:ident, $v:expr, $series:literal, $help:literal) => {
        $o.labelled(
            $series,
            $help,
            "gauge",
            "state",
            (0..)
                .map(|i| State::from_u8(i).map_or("unknown", State::name))
                .zip($v),
        )
    };
}

macro_rules! engine_metrics {
    ($($kind:ident $name:ident ($($c:ident),+) $series:literal $help:literal;)*) => {
        counters_struct!([] $($kind $name $help;)*);

        /// A consistent-enough copy of an engine's metrics.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct MetricsSnapshot {
            $(
                #[doc = $help]
                #[doc = ""]
                #[doc = snapshot_index!($kind)]
                pub $name: snapshot_type!($kind),
            )*
        }

        impl Metrics {
            /// The counting rows' values; the computed ones (`gauge`, `by_state`)
            /// stay 0: they are the engine's to fill in (`engine/core.rs`).
            pub fn snapshot(&self) -> MetricsSnapshot {
                let mut s = MetricsSnapshot::default();
                $(load_row!($kind s.$name = self);)*
                s
            }
        }

        impl MetricsSnapshot {
            /// Prometheus text exposition format (version 0.0.4), every series labelled
            /// with `role`.
            pub fn prometheus(&self, role: &str) -> String {
                let mut o = Text { out: String::new(), role };
                $(text_row!($kind o, self.$name, $series, $help);)*
                o.out
            }
        }
    };
}

crate::metrics_table!(engine_metrics);

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

impl MetricsSnapshot {
    /// Rooms failed in all.
    pub fn rooms_failed_total(&self) -> u64 {
        self.rooms_failed.iter().sum()
    }
}

/// Prometheus text being written for one engine.
struct Text<'a> {
    out: String,
    role: &'a str,
}

impl Text<'_> {
    fn family(&mut self, series: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {series} {help}\n# TYPE {series} {kind}");
    }

    fn scalar(&mut self, series: &str, help: &str, kind: &str, v: u64) {
        self.family(series, help, kind);
        let _ = writeln!(self.out, "{series}{{role=\"{}\"}} {v}", self.role);
    }

    fn labelled<'v>(
        &mut self,
        series: &str,
        help: &str,
        kind: &str,
        label: &str,
        values: impl Iterator<Item = (&'v str, u64)>,
    ) {
        self.family(series, help, kind);
        for (name, v) in values {
            let _ = writeln!(
                self.out,
                "{series}{{role=\"{}\",{label}=\"{name}\"}} {v}",
                self.role
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot whose every value is distinct.
    fn distinct() -> MetricsSnapshot {
        let mut s = MetricsSnapshot::default();
        let mut next = 1u64..;
        macro_rules! fill {
            ($($kind:ident $name:ident ($($c:ident),+) $series:literal $help:literal;)*) => {
                $(fill!(@ $kind s.$name);)*
            };
            (@ by_cause $s:ident.$name:ident) => {
                $s.$name.iter_mut().for_each(|v| *v = next.next().unwrap())
            };
            (@ by_state $s:ident.$name:ident) => {
                $s.$name.iter_mut().for_each(|v| *v = next.next().unwrap())
            };
            (@ $scalar:ident $s:ident.$name:ident) => {
                $s.$name = next.next().unwrap()
            };
        }
        crate::metrics_table!(fill);
        s
    }

    #[test]
    fn counters_reach_the_snapshot_and_computed_rows_are_left_to_the_caller() {
        let m = Metrics::default();
        m.created();
        m.created();
        m.succeeded();
        m.failed(Cause::Mismatch);
        m.held.fetch_add(7, Ordering::Relaxed);
        m.auth_failures.fetch_add(3, Ordering::Relaxed);
        m.data_runs_sent.fetch_add(5, Ordering::Relaxed);
        let s = m.snapshot();
        assert_eq!((s.rooms_created, s.rooms_succeeded), (2, 1));
        assert_eq!(s.rooms_failed[6], 1, "MISMATCH is the 7th cause: {s:?}");
        assert_eq!(s.rooms_failed_total(), 1);
        assert_eq!((s.held, s.auth_failures, s.data_runs_sent), (7, 3, 5));
        assert_eq!((s.inflight, s.rooms_draining), (0, 0));
        assert_eq!(s.rooms_by_state, [0; 5]);
    }

    /// The series of the text format, each with its type and its value, for a snapshot
    /// whose values are all distinct: every value appears once, under its own name.
    #[test]
    fn every_value_appears_once_in_the_text_under_its_series_and_labels() {
        let s = distinct();
        let text = s.prometheus("decode");
        let line = |l: &str| text.lines().any(|t| t == l);
        assert!(line("# TYPE kvxfer_rooms_created_total counter"), "{text}");
        assert!(
            line("kvxfer_rooms_created_total{role=\"decode\"} 1"),
            "{text}"
        );
        assert!(line(&format!(
            "kvxfer_held_destinations_total{{role=\"decode\"}} {}",
            s.held
        )));
        assert!(line("# TYPE kvxfer_rooms_draining gauge"));
        assert!(line(&format!(
            "kvxfer_rooms_draining{{role=\"decode\"}} {}",
            s.rooms_draining
        )));
        assert!(line(&format!(
            "kvxfer_rooms_failed_total{{role=\"decode\",cause=\"peer_lost\"}} {}",
            s.rooms_failed[1]
        )));
        assert!(line(&format!(
            "kvxfer_rooms{{role=\"decode\",state=\"waiting_for_input\"}} {}",
            s.rooms_by_state[2]
        )));
        assert!(line("# TYPE kvxfer_rooms gauge"));
        // Every sample line carries one distinct value, none missing, none twice: 30
        // counters, 11 causes, 5 states and 2 gauges.
        let mut values: Vec<u64> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        values.sort_unstable();
        let n = values.len() as u64;
        assert_eq!(values, (1..=n).collect::<Vec<_>>(), "{text}");
        assert_eq!(n, 48, "{text}");
        // One HELP and one TYPE per series, every series prefixed.
        let types = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!((types, helps), (34, 34), "{text}");
        assert!(text
            .lines()
            .all(|l| l.starts_with("kvxfer_") || l.starts_with("# ")));
    }
}
