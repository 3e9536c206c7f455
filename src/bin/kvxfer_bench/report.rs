//! Output: percentiles, the human table, and the one-line JSON object (written by hand:
//! the benchmark has no dependency beyond the crate).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::args::{Params, Verify};
use crate::baseline::Measured;
use crate::decode::Report;

/// A JSON value.
pub enum J {
    Num(f64),
    Int(u64),
    Str(String),
    Bool(bool),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

impl J {
    pub fn obj(fields: Vec<(&str, J)>) -> J {
        J::Obj(
            fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }

    pub fn render(&self, out: &mut String) {
        match self {
            J::Num(x) if x.is_finite() => {
                let _ = write!(out, "{}", (x * 1e6).round() / 1e6);
            }
            J::Num(_) => out.push_str("null"),
            J::Int(n) => {
                let _ = write!(out, "{n}");
            }
            J::Bool(b) => {
                let _ = write!(out, "{b}");
            }
            J::Str(s) => {
                out.push('"');
                for c in s.chars() {
                    match c {
                        '"' => out.push_str("\\\""),
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        c if (c as u32) < 0x20 => {
                            let _ = write!(out, "\\u{:04x}", c as u32);
                        }
                        c => out.push(c),
                    }
                }
                out.push('"');
            }
            J::Arr(v) => {
                out.push('[');
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    x.render(out);
                }
                out.push(']');
            }
            J::Obj(v) => {
                out.push('{');
                for (i, (k, x)) in v.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    J::Str(k.clone()).render(out);
                    out.push(':');
                    x.render(out);
                }
                out.push('}');
            }
        }
    }

    pub fn to_line(&self) -> String {
        let mut s = String::new();
        self.render(&mut s);
        s
    }
}

/// Nearest-rank percentile of sorted nanoseconds, in milliseconds (NaN when empty).
pub fn pct_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e6
}

fn lat_json(v: &[u64]) -> J {
    J::obj(vec![
        ("p50", J::Num(pct_ms(v, 0.50))),
        ("p99", J::Num(pct_ms(v, 0.99))),
        ("p999", J::Num(pct_ms(v, 0.999))),
        ("max", J::Num(pct_ms(v, 1.0))),
        ("n", J::Int(v.len() as u64)),
    ])
}

fn counts_json(m: &BTreeMap<String, u64>) -> J {
    J::Obj(m.iter().map(|(k, v)| (k.clone(), J::Int(*v))).collect())
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn verify_name(v: Verify) -> &'static str {
    match v {
        Verify::Full => "full",
        Verify::Sample => "sample",
        Verify::None => "none",
    }
}

/// The figures derived from a report.
pub struct Derived {
    /// Each kvxfer phase against the mean of the TCP baselines on either side of it.
    pub phase_ratios: Vec<f64>,
    pub tcp_gbps: f64,
    pub memcpy_gbps: f64,
    /// CPU seconds of the TCP baselines, receiving and sending side, and their GB.
    pub tcp_cpu_recv: f64,
    pub tcp_cpu_send: f64,
    pub tcp_gb: f64,
    /// Baseline CPU per GB (both sides) over the engines' (both sides, benchmark threads
    /// excluded): above 1, the engines spend less CPU per byte than a plain stream.
    pub cpu_ratio: f64,
    /// CPU seconds per wall second, both processes.
    pub kv_cores: f64,
    pub tcp_cores: f64,
    pub e2e: Vec<u64>,
    pub dec: Vec<u64>,
    pub pre: Vec<u64>,
    pub gb: f64,
}

/// CPU seconds of both processes during the kvxfer phases, less the benchmark's own
/// threads (the checkers and the two scheduler loops).
pub fn engine_cpu_s(k: &crate::decode::KvResult) -> f64 {
    k.cpu_decode.secs() - k.verify_cpu_s - k.driver_cpu_s + k.cpu_prefill.secs()
        - k.prefill_driver_cpu_s
}

pub fn derive(r: &Report) -> Derived {
    let sorted = |v: &Vec<u64>| {
        let mut v = v.clone();
        v.sort_unstable();
        v
    };
    let phase_ratios = r
        .kv_runs
        .iter()
        .enumerate()
        .filter_map(|(i, (g, _))| {
            let (a, b) = (r.tcp.get(i)?, r.tcp.get(i + 1)?);
            Some(g / ((a.gbps() + b.gbps()) / 2.0))
        })
        .collect();
    let tcp_cpu_recv: f64 = r.tcp.iter().map(|m| m.cpu.secs()).sum();
    let tcp_cpu_send: f64 = r.tcp_send_cpu.iter().map(|c| c.secs()).sum();
    let tcp_gb: f64 = r.tcp.iter().map(|m| m.bytes as f64 / 1e9).sum();
    let tcp_secs: f64 = r.tcp.iter().map(|m| m.secs).sum();
    let k = &r.kv;
    let engine_cpu = engine_cpu_s(k);
    let gb = k.bytes as f64 / 1e9;
    Derived {
        tcp_cpu_recv,
        tcp_cpu_send,
        tcp_gb,
        cpu_ratio: ((tcp_cpu_recv + tcp_cpu_send) / tcp_gb) / (engine_cpu / gb),
        kv_cores: (k.cpu_decode.secs() + k.cpu_prefill.secs()) / k.secs,
        tcp_cores: (tcp_cpu_recv + tcp_cpu_send) / tcp_secs,
        phase_ratios,
        tcp_gbps: mean(&r.tcp.iter().map(Measured::gbps).collect::<Vec<_>>()),
        memcpy_gbps: mean(&r.memcpy.iter().map(Measured::gbps).collect::<Vec<_>>()),
        e2e: sorted(&r.kv.lat_e2e),
        dec: sorted(&r.kv.lat_decode),
        pre: sorted(&r.kv.lat_prefill),
        gb: r.kv.bytes as f64 / 1e9,
    }
}

pub fn json(p: &Params, r: &Report) -> String {
    let d = derive(r);
    let k = &r.kv;
    let gbps = k.gbps();
    let per_gb = |s: f64| J::Num(s / d.gb);
    let (lat, basis) = if r.same_host {
        (&d.e2e, "first enqueue (prefill) to decode SUCCESS")
    } else {
        (&d.dec, "decode set_destination to decode SUCCESS")
    };
    J::obj(vec![
        ("preset", J::Str(p.preset.clone())),
        ("transport", J::Str(p.transport.clone())),
        ("verify", J::Str(verify_name(p.verify).into())),
        ("bytes", J::Int(k.bytes)),
        ("bytes_checked", J::Int(k.bytes_checked)),
        ("seconds", J::Num(k.secs)),
        ("gbps", J::Num(gbps)),
        ("baseline_tcp_gbps", J::Num(d.tcp_gbps)),
        ("baseline_memcpy_gbps", J::Num(d.memcpy_gbps)),
        (
            "baseline_tcp_runs_gbps",
            J::Arr(r.tcp.iter().map(|m| J::Num(m.gbps())).collect()),
        ),
        (
            "baseline_memcpy_runs_gbps",
            J::Arr(r.memcpy.iter().map(|m| J::Num(m.gbps())).collect()),
        ),
        ("ratio_vs_tcp", J::Num(gbps / d.tcp_gbps)),
        (
            "kvxfer_runs_gbps",
            J::Arr(r.kv_runs.iter().map(|(g, _)| J::Num(*g)).collect()),
        ),
        (
            "ratio_vs_tcp_per_phase",
            J::Arr(d.phase_ratios.iter().map(|x| J::Num(*x)).collect()),
        ),
        ("ratio_vs_memcpy", J::Num(gbps / d.memcpy_gbps)),
        ("cpu_ratio_vs_tcp", J::Num(d.cpu_ratio)),
        (
            "cores_busy",
            J::obj(vec![
                ("kvxfer", J::Num(d.kv_cores)),
                ("baseline_tcp", J::Num(d.tcp_cores)),
            ]),
        ),
        (
            "loadavg",
            J::Arr(vec![J::Num(r.loadavg.0), J::Num(r.loadavg.1)]),
        ),
        ("pool_pages", J::Str(r.pool_pages.into())),
        (
            "decode_pool_huge_fraction",
            J::Num(r.pool_huge_fraction.unwrap_or(f64::NAN)),
        ),
        ("rooms", J::Int(k.rooms)),
        ("rooms_ok", J::Int(k.ok)),
        ("rooms_per_sec", J::Num(k.rooms_per_sec())),
        ("latency_ms", lat_json(lat)),
        ("latency_basis", J::Str(basis.into())),
        ("latency_decode_ms", lat_json(&d.dec)),
        ("latency_prefill_ms", lat_json(&d.pre)),
        ("failed_by_reason", counts_json(&k.failed)),
        ("prefill_failed_by_reason", counts_json(&k.prefill_failed)),
        ("expected_failures", J::Int(k.expected)),
        ("unexpected_failures", J::Int(k.unexpected)),
        ("prefill_expected_failures", J::Int(k.prefill_expected)),
        ("prefill_unexpected_failures", J::Int(k.prefill_unexpected)),
        ("aborts_planned", J::Int(k.aborts_planned)),
        ("aborts_too_late", J::Int(k.aborts_too_late)),
        (
            "split_prefill_failed_decode_ok",
            J::Int(k.split_prefill_failed_decode_ok),
        ),
        (
            "split_prefill_ok_decode_failed",
            J::Int(k.split_prefill_ok_decode_failed),
        ),
        (
            "cpu_s_per_gb",
            J::obj(vec![
                ("decode", per_gb(k.cpu_decode.secs())),
                ("decode_verify", per_gb(k.verify_cpu_s)),
                ("decode_driver", per_gb(k.driver_cpu_s)),
                ("prefill_driver", per_gb(k.prefill_driver_cpu_s)),
                ("engines", per_gb(engine_cpu_s(k))),
                ("decode_sys", per_gb(k.cpu_decode.sys_us as f64 / 1e6)),
                ("prefill", per_gb(k.cpu_prefill.secs())),
                ("prefill_sys", per_gb(k.cpu_prefill.sys_us as f64 / 1e6)),
                ("baseline_tcp_recv", J::Num(d.tcp_cpu_recv / d.tcp_gb)),
                ("baseline_tcp_send", J::Num(d.tcp_cpu_send / d.tcp_gb)),
            ]),
        ),
        (
            "config",
            J::obj(vec![
                ("layers", J::Int(p.layers as u64)),
                ("buffers", J::Int(p.n_buffers() as u64)),
                ("item_len", J::Int(p.item_len() as u64)),
                ("page_tokens", J::Int(p.page_tokens as u64)),
                ("prompt_min", J::Int(p.prompt_min as u64)),
                ("prompt_max", J::Int(p.prompt_max as u64)),
                ("chunk_tokens", J::Int(p.chunk_tokens as u64)),
                ("concurrency", J::Int(p.concurrency as u64)),
                ("abort_rate", J::Num(p.abort_rate)),
                ("conns", J::Int(p.conns as u64)),
                (
                    "workers",
                    p.workers
                        .map_or(J::Str("default".into()), |w| J::Int(w as u64)),
                ),
                ("quick", J::Bool(p.quick)),
            ]),
        ),
        (
            "errors",
            J::Arr(k.errors.iter().map(|e| J::Str(e.clone())).collect()),
        ),
    ])
    .to_line()
}

fn ratio(x: f64, base: f64) -> String {
    if base.is_finite() && base > 0.0 {
        format!("{:.2}x", x / base)
    } else {
        "-".into()
    }
}

pub fn human(p: &Params, r: &Report) -> String {
    let d = derive(r);
    let k = &r.kv;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nkvxfer-bench {}  (transport {}, verify {}, {} connection(s) per peer, workers {})",
        p.preset,
        p.transport,
        verify_name(p.verify),
        p.conns,
        p.workers.map_or("default".to_string(), |w| w.to_string())
    );
    let _ = writeln!(o, "  {}", p.shape_line());
    let _ = writeln!(
        o,
        "  host load average {:.2} before, {:.2} after (2 cores here: other work shares them)",
        r.loadavg.0, r.loadavg.1
    );
    let _ = writeln!(
        o,
        "  pools and baseline buffers on {} pages{}",
        r.pool_pages,
        r.pool_huge_fraction.map_or(String::new(), |f| format!(
            " ({:.0}% of the decode pool in huge pages)",
            f * 100.0
        ))
    );
    let _ = writeln!(
        o,
        "  {:<36} {:>8} {:>9}   CPU s per GB, decode process / prefill process",
        "", "GB/s", "kvxfer/x"
    );
    let _ = writeln!(
        o,
        "  {:<36} {:>8.3} {:>9}   {:.3} / {:.3} (checker {:.3}, scheduler loops {:.3} + {:.3})",
        "kvxfer, delivered and verified",
        k.gbps(),
        "",
        k.cpu_decode.secs() / d.gb,
        k.cpu_prefill.secs() / d.gb,
        k.verify_cpu_s / d.gb,
        k.driver_cpu_s / d.gb,
        k.prefill_driver_cpu_s / d.gb
    );
    if r.kv_runs.len() > 1 {
        for (i, (g, rps)) in r.kv_runs.iter().enumerate() {
            let _ = writeln!(
                o,
                "  {:<36} {:>8.3} {:>9}   {:.0} rooms/s",
                format!("kvxfer, phase {}", i + 1),
                g,
                d.phase_ratios
                    .get(i)
                    .map_or(String::new(), |x| format!("{x:.2}x tcp")),
                rps
            );
        }
    }
    for (i, m) in r.tcp.iter().enumerate() {
        let send = r.tcp_send_cpu.get(i).map_or(f64::NAN, |c| c.secs());
        let gb = m.bytes as f64 / 1e9;
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}   {:.3} / {:.3}",
            format!("baseline tcp stream, run {}", i + 1),
            m.gbps(),
            ratio(k.gbps(), m.gbps()),
            m.cpu.secs() / gb,
            send / gb
        );
    }
    if !r.tcp.is_empty() {
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}",
            "baseline tcp stream, mean",
            d.tcp_gbps,
            ratio(k.gbps(), d.tcp_gbps)
        );
    }
    for (i, m) in r.memcpy.iter().enumerate() {
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}",
            format!("baseline memcpy, run {}", i + 1),
            m.gbps(),
            ratio(k.gbps(), m.gbps())
        );
    }
    if !r.memcpy.is_empty() {
        let _ = writeln!(
            o,
            "  {:<36} {:>8.3} {:>9}",
            "baseline memcpy, mean",
            d.memcpy_gbps,
            ratio(k.gbps(), d.memcpy_gbps)
        );
    }
    if !r.tcp.is_empty() {
        let _ = writeln!(
            o,
            "  CPU per GB, both sides: engines {:.3} s (benchmark threads excluded), tcp stream \
             {:.3} s: {:.2}x; cores busy: kvxfer {:.2}, tcp stream {:.2}",
            engine_cpu_s(k) / d.gb,
            (d.tcp_cpu_recv + d.tcp_cpu_send) / d.tcp_gb,
            d.cpu_ratio,
            d.kv_cores,
            d.tcp_cores
        );
    }
    let _ = writeln!(
        o,
        "  rooms: {} ok of {} started in {:.2} s: {:.1} rooms/s, {:.2} GB delivered and \
         verified ({:.2} GB checked word by word)",
        k.ok,
        k.rooms,
        k.secs,
        k.rooms_per_sec(),
        d.gb,
        k.bytes_checked as f64 / 1e9
    );
    let lat = |name: &str, v: &[u64]| {
        format!(
            "  latency {:<44} p50 {:>9.3}  p99 {:>9.3}  p999 {:>9.3}  max {:>9.3} ms\n",
            name,
            pct_ms(v, 0.5),
            pct_ms(v, 0.99),
            pct_ms(v, 0.999),
            pct_ms(v, 1.0)
        )
    };
    if r.same_host {
        o.push_str(&lat("first enqueue -> decode SUCCESS", &d.e2e));
    }
    o.push_str(&lat("decode set_destination -> decode SUCCESS", &d.dec));
    o.push_str(&lat("first enqueue -> prefill SUCCESS", &d.pre));
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
        list(&k.failed),
        k.expected,
        k.unexpected
    );
    let _ = writeln!(
        o,
        "  failed (prefill side): {}; expected {}, unexpected {}; aborts planned {}, too late \
         to fail {}",
        list(&k.prefill_failed),
        k.prefill_expected,
        k.prefill_unexpected,
        k.aborts_planned,
        k.aborts_too_late
    );
    let _ = writeln!(
        o,
        "  outcomes that differ between the sides: decode SUCCESS with prefill FAILED {}, \
         prefill SUCCESS with decode FAILED {}",
        k.split_prefill_failed_decode_ok, k.split_prefill_ok_decode_failed
    );
    for e in &k.errors {
        let _ = writeln!(o, "  error: {e}");
    }
    o
}
