//! The human table: a writer over the run's [`Model`], the same figures as the `--json`
//! line, section by section.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::args::{Auth, Named};
use crate::params::{Feed, Params};
use crate::report::{min_max, Latency, Model, PerGb, PhaseRow};
use crate::shape::Side;

/// The whole table of run `m` of `p`.
pub fn write(p: &Params, m: &Model) -> String {
    let mut o = String::new();
    header(&mut o, p, m);
    phases(&mut o, p, m);
    comparisons(&mut o, p, m);
    baselines(&mut o, m);
    per_gb(&mut o, p, m);
    rooms(&mut o, m);
    failures(&mut o, m);
    o
}

/// `x / base` as a ratio, or "-" without a base.
fn ratio(x: f64, base: f64) -> String {
    if base.is_finite() && base > 0.0 {
        format!("{:.2}x", x / base)
    } else {
        "-".into()
    }
}

/// Two figures of a row of the per-GB block: "decode / prefill".
fn pair(a: f64, b: f64, decimals: usize) -> String {
    format!("{a:.decimals$} / {b:.decimals$}")
}

/// "TP N->M", with the page sizes when they differ.
fn tp_name(p: &Params) -> String {
    let mut name = format!("TP {}->{}", p.prefill_tp, p.decode_tp);
    if p.side_page_tokens(Side::Decode) != p.page_tokens {
        name += &format!(
            " pages {}->{}",
            p.page_tokens,
            p.side_page_tokens(Side::Decode)
        );
    }
    name
}

/// A phase's name in the table: its number, and what sets it apart from the others.
fn phase_name(p: &Params, ph: &PhaseRow) -> String {
    let auth = match (p.auth, ph.auth) {
        (Auth::Both, true) if p.tls => ", auth+tls+encrypt",
        (Auth::Both, true) => ", auth on",
        (Auth::Both, false) => ", auth off",
        _ => "",
    };
    let kind = match (p.layouts(), ph.tp, ph.layerwise) {
        (false, _, Some(by_layer)) => Feed {
            simulate: true,
            by_layer,
            compute_us_per_layer: ph.compute_us_per_layer.unwrap_or(0),
        }
        .name(),
        (false, _, None) => String::new(),
        (true, true, _) => tp_name(p),
        (true, false, _) => "TP 1->1".into(),
    };
    format!(
        "kvxfer, phase {}{auth}{}{kind}",
        ph.phase,
        if kind.is_empty() { "" } else { ", " }
    )
}

/// The run's settings, the host, and the kvxfer total.
fn header(o: &mut String, p: &Params, m: &Model) {
    let _ = writeln!(
        o,
        "\nkvxfer-bench {}  (transport {}, same_host {}, integrity {}, verify {} at {} \
         priority, {} connection(s) per peer, workers {}, auth {}{})",
        m.preset,
        m.transport,
        m.same_host,
        m.integrity,
        m.verify,
        m.verify_priority,
        p.conns,
        p.workers.map_or("default".to_string(), |w| w.to_string()),
        p.auth.name(),
        if p.tls {
            ", with TLS and encrypt_data"
        } else {
            ""
        }
    );
    let _ = writeln!(o, "  {}", p.shape_line());
    let _ = writeln!(
        o,
        "  host load average {:.2} before, {:.2} after (2 cores here: other work shares them)",
        m.loadavg[0], m.loadavg[1]
    );
    let _ = writeln!(
        o,
        "  pools and baseline buffers on {} pages{}",
        m.pool_pages,
        m.decode_pool_huge_fraction
            .map_or(String::new(), |f| format!(
                " ({:.0}% of the decode pool in huge pages)",
                f * 100.0
            ))
    );
    let _ = writeln!(
        o,
        "  {:<36} {:>8} {:>9}   CPU s per GB, decode process / prefill process",
        "", "GB/s", "kvxfer/x"
    );
    let c = &m.cpu_s_per_gb;
    let _ = writeln!(
        o,
        "  {:<36} {:>8.3} {:>9}   {:.3} / {:.3} (checker {:.3}, scheduler loops {:.3} + {:.3})",
        "kvxfer, delivered and verified",
        m.gbps,
        "",
        c.decode,
        c.prefill,
        c.decode_verify,
        c.decode_driver,
        c.prefill_driver
    );
}

/// One row per kvxfer phase.
fn phases(o: &mut String, p: &Params, m: &Model) {
    for (i, ph) in m.phases.iter().enumerate() {
        // On one host only (across hosts the two clocks differ).
        let mut first = if ph.first_byte_ms.n == 0 {
            String::new()
        } else {
            format!(
                "; first byte p50 {:.3} p99 {:.3} ms",
                ph.first_byte_ms.p50, ph.first_byte_ms.p99
            )
        };
        if ph.ttft_ms.n > 0 && ph.compute_us_per_layer.is_some_and(|us| us > 0) {
            first += &format!(
                "; TTFT p50 {:.3} p99 {:.3} ms",
                ph.ttft_ms.p50, ph.ttft_ms.p99
            );
        }
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}   {:.0} rooms/s, {:.3} runs/page{first}",
            phase_name(p, ph),
            ph.gbps,
            m.ratio_vs_tcp_per_phase
                .get(i)
                .map_or(String::new(), |x| format!("{x:.2}x tcp")),
            ph.rooms_per_sec,
            ph.runs_per_page,
        );
    }
}

/// The runs that alternate two kinds of phase: TP against 1 -> 1, layer-wise against
/// whole-chunk, authentication on against off.
fn comparisons(o: &mut String, p: &Params, m: &Model) {
    if let Some(t) = &m.tp_vs_equal {
        let (lo, hi) = min_max(&t.gbps_ratio_per_pair);
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}   pairs of phases {lo:.3}x..{hi:.3}x; {:.0} / {:.0} rooms/s = \
             {:.3}x; runs/page {:.3} / {:.3}",
            format!("kvxfer, {} / 1->1", tp_name(p)),
            t.tp_gbps,
            format!("{:.3}x", t.gbps_ratio),
            t.tp_rooms_per_sec,
            t.equal_rooms_per_sec,
            t.rooms_per_sec_ratio,
            t.tp_runs_per_page,
            t.equal_runs_per_page
        );
        if t.tp_bytes_per_room != t.equal_bytes_per_room {
            let _ = writeln!(
                o,
                "  (the TP phases deliver {:.3}x the bytes per room of the 1->1 phases: heads \
                 replicated on the decode ranks, or a last decode page of another size)",
                t.tp_bytes_per_room / t.equal_bytes_per_room
            );
        }
    }
    if let Some(l) = &m.layerwise {
        o.push_str(&crate::sweep::rows(p, l));
    }
    if let Some(a) = &m.auth_on_vs_off {
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}   {:.0} / {:.0} rooms/s = {:.3}x",
            if p.tls {
                "kvxfer, auth+tls+encrypt / off"
            } else {
                "kvxfer, auth on / off"
            },
            a.on_gbps,
            format!("{:.3}x", a.gbps_ratio),
            a.on_rooms_per_sec,
            a.off_rooms_per_sec,
            a.rooms_per_sec_ratio
        );
    }
}

/// The TCP stream and memcpy runs, and the CPU of the engines against the stream.
fn baselines(o: &mut String, m: &Model) {
    for t in &m.baseline_tcp_runs {
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}   {:.3} / {:.3}",
            format!("baseline tcp stream, run {}", t.run),
            t.gbps,
            ratio(m.gbps, t.gbps),
            t.decode.cpu_s_per_gb,
            t.prefill.cpu_s_per_gb
        );
    }
    let mean = |o: &mut String, name: &str, gbps: f64| {
        let _ = writeln!(o, "  {name:<36} {gbps:>8.3} {:>9}", ratio(m.gbps, gbps));
    };
    if !m.baseline_tcp_runs.is_empty() {
        mean(o, "baseline tcp stream, mean", m.baseline_tcp_gbps);
    }
    for (i, &gbps) in m.baseline_memcpy_runs_gbps.iter().enumerate() {
        mean(o, &format!("baseline memcpy, run {}", i + 1), gbps);
    }
    if !m.baseline_memcpy_runs_gbps.is_empty() {
        mean(o, "baseline memcpy, mean", m.baseline_memcpy_gbps);
    }
    if let Some(gbps) = m.baseline_memcpy_pages_gbps {
        let name = format!("memcpy of the pages, {} threads", m.config.conns);
        mean(o, &name, gbps);
    }
    if m.baseline_tcp_runs.is_empty() {
        return;
    }
    let c = &m.cores_busy;
    let _ = writeln!(
        o,
        "  CPU per GB, both sides: engines {:.3} s (benchmark threads excluded), tcp stream \
         {:.3} s: {:.2}x; cores busy: kvxfer {:.2}, tcp stream {:.2}",
        m.cpu_s_per_gb.engines, m.tcp_cpu_s_per_gb, m.cpu_ratio_vs_tcp, c.kvxfer, c.baseline_tcp
    );
    if let (Some(kv), Some(tcp)) = (c.host_kvxfer, c.host_baseline_tcp) {
        let _ = writeln!(
            o,
            "  this host's CPUs busy (the kernel's threads too: a loopback stream's \
             receive work runs in ksoftirqd): kvxfer {kv:.2}, tcp stream {tcp:.2}"
        );
    }
}

/// Per GB, each process: CPU and context switches, every phase and every stream on its
/// own line.
fn per_gb(o: &mut String, p: &Params, m: &Model) {
    let _ = writeln!(
        o,
        "  {:<36} {:>15}  {:>17}  {:>15}",
        "per GB, decode / prefill process", "CPU s", "vol. switches", "invol. switches"
    );
    let mut row = |name: String, dec: &PerGb, pre: &PerGb| {
        let _ = writeln!(
            o,
            "  {:<36} {:>15}  {:>17}  {:>15}",
            name,
            pair(dec.cpu_s_per_gb, pre.cpu_s_per_gb, 3),
            pair(
                dec.voluntary_switches_per_gb,
                pre.voluntary_switches_per_gb,
                0
            ),
            pair(
                dec.involuntary_switches_per_gb,
                pre.involuntary_switches_per_gb,
                0
            )
        );
    };
    for ph in &m.phases {
        row(phase_name(p, ph), &ph.decode.all, &ph.prefill.all);
    }
    let [dec, pre] = &m.bench_threads;
    row("  of which benchmark threads".into(), dec, pre);
    for t in &m.baseline_tcp_runs {
        let name = format!("baseline tcp stream, run {}", t.run);
        row(name, &t.decode, &t.prefill);
    }
}

/// The rooms, and their latencies.
fn rooms(o: &mut String, m: &Model) {
    let _ = writeln!(
        o,
        "  rooms: {} ok of {} started in {:.2} s: {:.1} rooms/s, {:.2} GB delivered and \
         verified ({:.2} GB checked word by word)",
        m.rooms_ok,
        m.rooms,
        m.seconds,
        m.rooms_per_sec,
        m.bytes as f64 / 1e9,
        m.bytes_checked as f64 / 1e9
    );
    let lat = |o: &mut String, name: &str, l: &Latency| {
        let _ = writeln!(
            o,
            "  latency {:<44} p50 {:>9.3}  p99 {:>9.3}  p999 {:>9.3}  max {:>9.3} ms",
            name, l.p50, l.p99, l.p999, l.max
        );
    };
    if m.one_host {
        lat(o, "first enqueue -> decode TRANSFERRING", &m.first_byte_ms);
        lat(o, "first enqueue -> decode SUCCESS", &m.latency_ms);
    }
    lat(
        o,
        "decode set_destination -> decode SUCCESS",
        &m.latency_decode_ms,
    );
    lat(o, "first enqueue -> prefill SUCCESS", &m.latency_prefill_ms);
    if m.first_byte_seen_at_success > 0 {
        let _ = writeln!(
            o,
            "  (first byte: {} of {} rooms went from waiting to SUCCESS between two polls; \
             their first byte counts as seen at SUCCESS)",
            m.first_byte_seen_at_success, m.first_byte_ms.n
        );
    }
}

/// What failed on each side, and the first errors verbatim.
fn failures(o: &mut String, m: &Model) {
    let list = |m: &BTreeMap<String, u64>| {
        if m.is_empty() {
            "none".to_string()
        } else {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let _ = writeln!(
        o,
        "  failed (decode side): {}; expected (planned aborts) {}, unexpected {}",
        list(&m.failed_by_reason),
        m.expected_failures,
        m.unexpected_failures
    );
    let _ = writeln!(
        o,
        "  failed (prefill side): {}; expected {}, unexpected {}; aborts planned {}, too late \
         to fail {}",
        list(&m.prefill_failed_by_reason),
        m.prefill_expected_failures,
        m.prefill_unexpected_failures,
        m.aborts_planned,
        m.aborts_too_late
    );
    let _ = writeln!(
        o,
        "  outcomes that differ between the sides: decode SUCCESS with prefill FAILED {}, \
         prefill SUCCESS with decode FAILED {}",
        m.split_prefill_failed_decode_ok, m.split_prefill_ok_decode_failed
    );
    for e in &m.errors {
        let _ = writeln!(o, "  error: {e}");
    }
}
