//! What a run measured, as one model ([`Model`]) computed once from its report: the
//! `--json` line serializes it, and the human table (`human.rs`) is written from it.
//! Also the percentiles and the comparisons of the runs that alternate two kinds of
//! phase (`--auth both`, TP sizes; `--layerwise` in `sweep.rs`).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::args::Named;
use crate::baseline::Measured;
use crate::params::Params;
use crate::results::{KvResult, Report};
use crate::shape::Side;
use crate::sweep::{layerwise_split, LayerwiseSplit};
use crate::sys::{HostBusy, Usage};

/// Nearest-rank percentile of sorted nanoseconds, in milliseconds (NaN when empty).
pub fn pct_ms(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e6
}

/// Percentiles of a latency, in milliseconds.
#[derive(Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub n: usize,
}

impl Latency {
    /// Of nanoseconds, in any order.
    pub fn of(ns: &[u64]) -> Latency {
        let v = sorted(ns);
        Latency {
            p50: pct_ms(&v, 0.50),
            p99: pct_ms(&v, 0.99),
            p999: pct_ms(&v, 0.999),
            max: pct_ms(&v, 1.0),
            n: v.len(),
        }
    }
}

pub(crate) fn sorted(v: &[u64]) -> Vec<u64> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// `--auth both`: the phases without and with authentication, side by side.
#[derive(Serialize)]
pub struct AuthSplit {
    pub off_gbps: f64,
    pub on_gbps: f64,
    pub gbps_ratio: f64,
    pub off_rooms_per_sec: f64,
    pub on_rooms_per_sec: f64,
    pub rooms_per_sec_ratio: f64,
}

pub fn auth_split(r: &Report) -> Option<AuthSplit> {
    let total = |auth: bool| {
        let mut t = KvResult::default();
        r.phases.iter().filter(|k| k.auth == auth).for_each(|k| {
            (t.bytes, t.ok, t.secs) = (t.bytes + k.bytes, t.ok + k.ok, t.secs + k.secs)
        });
        (t.secs > 0.0).then_some(t)
    };
    let (off, on) = (total(false)?, total(true)?);
    Some(AuthSplit {
        off_gbps: off.gbps(),
        on_gbps: on.gbps(),
        gbps_ratio: on.gbps() / off.gbps(),
        off_rooms_per_sec: off.rooms_per_sec(),
        on_rooms_per_sec: on.rooms_per_sec(),
        rooms_per_sec_ratio: on.rooms_per_sec() / off.rooms_per_sec(),
    })
}

/// `--prefill-tp`/`--decode-tp`: the TP phases against the equal-TP (1 -> 1) phases of
/// the same model and prompts, measured in turn in the same run.
#[derive(Serialize)]
pub struct TpSplit {
    pub tp_gbps: f64,
    pub equal_gbps: f64,
    /// TP over equal, all phases together.
    pub gbps_ratio: f64,
    /// TP over equal for each pair of adjacent phases (one of each), in order.
    pub gbps_ratio_per_pair: Vec<f64>,
    pub tp_rooms_per_sec: f64,
    pub equal_rooms_per_sec: f64,
    pub rooms_per_sec_ratio: f64,
    pub rooms_per_sec_ratio_per_pair: Vec<f64>,
    /// KV bytes delivered per room (every decode rank's together): the same on both
    /// unless heads are replicated on the decode side (MLA: each decode rank receives
    /// the whole latent).
    pub tp_bytes_per_room: f64,
    pub equal_bytes_per_room: f64,
    /// Data runs the prefill engines wrote (TCP frames, RDMA writes) per page of one
    /// buffer at the prefill's page size.
    pub tp_runs_per_page: f64,
    pub equal_runs_per_page: f64,
}

pub fn tp_split(p: &Params, r: &Report) -> Option<TpSplit> {
    if !p.layouts() {
        return None;
    }
    let total = |tp: bool| {
        let mut t = KvResult::default();
        r.phases
            .iter()
            .filter(|k| k.tp == tp)
            .for_each(|k| t.absorb(k));
        (t.secs > 0.0).then_some(t)
    };
    let (tp, eq) = (total(true)?, total(false)?);
    let per_pair = |f: fn(&KvResult) -> f64| -> Vec<f64> {
        r.phases
            .chunks_exact(2)
            .filter_map(|w| {
                let (t, e) = if w[0].tp {
                    (&w[0], &w[1])
                } else {
                    (&w[1], &w[0])
                };
                (t.tp && !e.tp).then(|| f(t) / f(e))
            })
            .collect()
    };
    let per_room = |k: &KvResult| k.bytes as f64 / k.ok as f64;
    Some(TpSplit {
        tp_gbps: tp.gbps(),
        equal_gbps: eq.gbps(),
        gbps_ratio: tp.gbps() / eq.gbps(),
        gbps_ratio_per_pair: per_pair(KvResult::gbps),
        tp_rooms_per_sec: tp.rooms_per_sec(),
        equal_rooms_per_sec: eq.rooms_per_sec(),
        rooms_per_sec_ratio: tp.rooms_per_sec() / eq.rooms_per_sec(),
        rooms_per_sec_ratio_per_pair: per_pair(KvResult::rooms_per_sec),
        tp_bytes_per_room: per_room(&tp),
        equal_bytes_per_room: per_room(&eq),
        tp_runs_per_page: tp.runs_per_page(),
        equal_runs_per_page: eq.runs_per_page(),
    })
}

/// Nearest-rank percentile of sorted values (NaN when empty).
pub(crate) fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub(crate) fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

/// The figures derived from a report.
struct Derived {
    /// Each kvxfer phase against the mean of the TCP baselines on either side of it.
    pub phase_ratios: Vec<f64>,
    pub tcp_gbps: f64,
    pub memcpy_gbps: f64,
    /// With `--same-host`: the mean of the scattered, threaded memcpy of the pages.
    pub memcpy_pages_gbps: Option<f64>,
    /// The TCP baselines together: receiving (decode) and sending (prefill) side, and
    /// their GB.
    pub tcp_recv: Usage,
    pub tcp_send: Usage,
    pub tcp_gb: f64,
    /// Baseline CPU per GB (both sides) over the engines' (both sides, benchmark threads
    /// excluded): above 1, the engines spend less CPU per byte than a plain stream.
    pub cpu_ratio: f64,
    /// CPU seconds per wall second, both processes.
    pub kv_cores: f64,
    pub tcp_cores: f64,
    /// The host's CPUs busy per wall second (every process and the kernel's threads),
    /// during the kvxfer phases and during the TCP streams; `None` where the host does
    /// not say.
    pub host_kv_cores: Option<f64>,
    pub host_tcp_cores: Option<f64>,
    pub gb: f64,
}

/// CPU seconds of both processes during the kvxfer phases, less the benchmark's own
/// threads (the checkers and the two scheduler loops).
pub fn engine_cpu_s(k: &KvResult) -> f64 {
    k.decode.secs() - k.decode_bench().secs() + k.prefill.secs() - k.prefill_driver.secs()
}

fn derive(r: &Report) -> Derived {
    let phase_ratios = r
        .phases
        .iter()
        .enumerate()
        .filter_map(|(i, k)| {
            let (a, b) = (r.tcp.get(i)?, r.tcp.get(i + 1)?);
            Some(k.gbps() / ((a.gbps() + b.gbps()) / 2.0))
        })
        .collect();
    let tcp_recv: Usage = r.tcp.iter().map(|m| m.usage).sum();
    let tcp_send: Usage = r.tcp_send.iter().copied().sum();
    let tcp_gb: f64 = r.tcp.iter().map(|m| m.bytes as f64 / 1e9).sum();
    let tcp_secs: f64 = r.tcp.iter().map(|m| m.secs).sum();
    let k = &r.kv;
    let gb = k.gb();
    Derived {
        tcp_recv,
        tcp_send,
        tcp_gb,
        cpu_ratio: ((tcp_recv.secs() + tcp_send.secs()) / tcp_gb) / (engine_cpu_s(k) / gb),
        kv_cores: (k.decode.secs() + k.prefill.secs()) / k.secs,
        tcp_cores: (tcp_recv.secs() + tcp_send.secs()) / tcp_secs,
        host_kv_cores: k.host.cores(),
        host_tcp_cores: r.tcp.iter().map(|m| m.host).sum::<HostBusy>().cores(),
        phase_ratios,
        tcp_gbps: mean(&r.tcp.iter().map(Measured::gbps).collect::<Vec<_>>()),
        memcpy_gbps: mean(&r.memcpy.iter().map(Measured::gbps).collect::<Vec<_>>()),
        memcpy_pages_gbps: (!r.memcpy_pages.is_empty()).then(|| {
            mean(
                &r.memcpy_pages
                    .iter()
                    .map(Measured::gbps)
                    .collect::<Vec<_>>(),
            )
        }),
        gb,
    }
}

/// What a run measured, computed once from its [`Report`]: the `--json` line is this
/// object (its keys listed in docs/BENCHMARKS.md), and the human table is written from it
/// (`human.rs`).
#[derive(Serialize)]
pub struct Model {
    pub preset: String,
    pub transport: String,
    pub same_host: String,
    pub integrity: String,
    pub verify: String,
    pub verify_priority: String,
    pub bytes: u64,
    pub bytes_checked: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub baseline_tcp_gbps: f64,
    pub baseline_memcpy_gbps: f64,
    pub baseline_tcp_runs_gbps: Vec<f64>,
    pub baseline_memcpy_runs_gbps: Vec<f64>,
    pub baseline_memcpy_pages_gbps: Option<f64>,
    pub ratio_vs_memcpy_pages: Option<f64>,
    pub ratio_vs_tcp: f64,
    pub kvxfer_runs_gbps: Vec<f64>,
    pub ratio_vs_tcp_per_phase: Vec<f64>,
    pub ratio_vs_memcpy: f64,
    pub auth: String,
    /// `--tls`: the "on" engines also ran TLS and encrypt_data.
    pub tls: bool,
    pub kvxfer_runs_auth: Vec<bool>,
    pub kvxfer_runs_rooms_per_sec: Vec<f64>,
    pub auth_on_vs_off: Option<AuthSplit>,
    pub prefill_tp: usize,
    pub decode_tp: usize,
    /// "hnd" or "nhd" between layouts, null at TP 1 -> 1 (whole pages copied).
    pub page_order: Option<String>,
    pub decode_page_tokens: usize,
    pub tp_vs_equal: Option<TpSplit>,
    pub layerwise: Option<LayerwiseSplit>,
    pub cpu_ratio_vs_tcp: f64,
    pub cores_busy: CoresBusy,
    pub loadavg: [f64; 2],
    pub pool_pages: &'static str,
    pub decode_pool_huge_fraction: Option<f64>,
    pub rooms: u64,
    pub rooms_ok: u64,
    pub rooms_per_sec: f64,
    pub latency_ms: Latency,
    pub latency_basis: &'static str,
    pub latency_decode_ms: Latency,
    pub latency_prefill_ms: Latency,
    pub first_byte_ms: Latency,
    pub first_byte_basis: &'static str,
    pub first_byte_seen_at_success: u64,
    pub failed_by_reason: BTreeMap<String, u64>,
    pub prefill_failed_by_reason: BTreeMap<String, u64>,
    pub expected_failures: u64,
    pub unexpected_failures: u64,
    pub prefill_expected_failures: u64,
    pub prefill_unexpected_failures: u64,
    pub aborts_planned: u64,
    pub aborts_too_late: u64,
    pub split_prefill_failed_decode_ok: u64,
    pub split_prefill_ok_decode_failed: u64,
    pub cpu_s_per_gb: CpuPerGb,
    pub switches_per_gb: SwitchesPerGb,
    pub phases: Vec<PhaseRow>,
    pub baseline_tcp_runs: Vec<TcpRun>,
    pub config: RunConfig,
    pub errors: Vec<String>,
    /// Both processes on one host (cross-process latencies were measured). Not in the
    /// JSON line: `latency_basis` says it.
    #[serde(skip)]
    pub one_host: bool,
    /// The CPU of both sides' TCP streams together, per GB streamed; and of the
    /// benchmark's own threads in the kvxfer phases, per GB delivered (decode / prefill).
    /// Not in the JSON line: the parts are.
    #[serde(skip)]
    pub tcp_cpu_s_per_gb: f64,
    #[serde(skip)]
    pub bench_threads: [PerGb; 2],
}

const FIRST_BYTE_BASIS: &str = "first enqueue (prefill) to the decode side's first poll that \
                                saw TRANSFERRING (or SUCCESS, when none did)";

/// CPU seconds per wall second: both processes, and the whole host (the processes, the
/// kernel's threads, anything else running).
#[derive(Serialize)]
pub struct CoresBusy {
    pub kvxfer: f64,
    pub baseline_tcp: f64,
    pub host_kvxfer: Option<f64>,
    pub host_baseline_tcp: Option<f64>,
}

/// CPU seconds per GB delivered (the baselines': per GB streamed).
#[derive(Serialize)]
pub struct CpuPerGb {
    pub decode: f64,
    pub decode_verify: f64,
    pub decode_driver: f64,
    pub prefill_driver: f64,
    pub engines: f64,
    pub decode_sys: f64,
    pub prefill: f64,
    pub prefill_sys: f64,
    pub baseline_tcp_recv: f64,
    pub baseline_tcp_send: f64,
}

/// Context switches per GB over every kvxfer phase (the baselines': per GB streamed):
/// each process, and the benchmark's own threads inside it.
#[derive(Serialize)]
pub struct SwitchesPerGb {
    pub decode_voluntary: f64,
    pub decode_involuntary: f64,
    pub decode_bench_voluntary: f64,
    pub decode_bench_involuntary: f64,
    pub prefill_voluntary: f64,
    pub prefill_involuntary: f64,
    pub prefill_bench_voluntary: f64,
    pub prefill_bench_involuntary: f64,
    pub baseline_tcp_recv_voluntary: f64,
    pub baseline_tcp_recv_involuntary: f64,
    pub baseline_tcp_send_voluntary: f64,
    pub baseline_tcp_send_involuntary: f64,
}

/// What one process (or some of its threads) used over a phase, per GB moved.
#[derive(Serialize)]
pub struct PerGb {
    pub cpu_s_per_gb: f64,
    pub voluntary_switches_per_gb: f64,
    pub involuntary_switches_per_gb: f64,
}

impl PerGb {
    fn of(u: Usage, gb: f64) -> PerGb {
        PerGb {
            cpu_s_per_gb: u.secs() / gb,
            voluntary_switches_per_gb: u.voluntary as f64 / gb,
            involuntary_switches_per_gb: u.involuntary as f64 / gb,
        }
    }
}

/// A process over a kvxfer phase, and the benchmark's threads in it (decode: the
/// checkers and the scheduler loop; prefill: the scheduler loop).
#[derive(Serialize)]
pub struct Process {
    #[serde(flatten)]
    pub all: PerGb,
    pub bench_threads: PerGb,
}

/// One kvxfer phase on its own.
#[derive(Serialize)]
pub struct PhaseRow {
    pub phase: usize,
    pub auth: bool,
    /// A phase of the TP ranks (false: the equal-TP comparison, or no TP).
    pub tp: bool,
    /// `--layerwise`: whether the phase enqueued layer by layer, its compute per layer
    /// (0: a bulk phase), and its rooms' time-to-first-token (null otherwise).
    pub layerwise: Option<bool>,
    pub compute_us_per_layer: Option<u64>,
    pub ttft_ms: Latency,
    pub runs_per_page: f64,
    pub gb: f64,
    pub gbps: f64,
    pub rooms_per_sec: f64,
    pub first_byte_ms: Latency,
    /// Cores busy with other work than the run on this host during the phase (both
    /// sides on one host; null otherwise, or where the host does not say).
    pub others_cores: Option<f64>,
    pub decode: Process,
    pub prefill: Process,
}

/// One TCP baseline on its own.
#[derive(Serialize)]
pub struct TcpRun {
    pub run: usize,
    pub gb: f64,
    pub gbps: f64,
    pub decode: PerGb,
    pub prefill: PerGb,
}

#[derive(Serialize)]
pub struct RunConfig {
    pub layers: usize,
    pub buffers: usize,
    pub item_len: usize,
    pub page_tokens: usize,
    pub prompt_min: usize,
    pub prompt_max: usize,
    pub chunk_tokens: usize,
    pub concurrency: usize,
    pub abort_rate: f64,
    pub conns: usize,
    /// A count, or "default".
    pub workers: serde_json::Value,
    pub quick: bool,
}

fn phase_row(i: usize, k: &KvResult, one_host: bool) -> PhaseRow {
    let gb = k.gb();
    PhaseRow {
        phase: i + 1,
        auth: k.auth,
        tp: k.tp,
        layerwise: k.feed.simulate.then_some(k.feed.by_layer),
        compute_us_per_layer: k.feed.simulate.then_some(k.feed.compute_us_per_layer),
        ttft_ms: Latency::of(&k.ttft),
        runs_per_page: k.runs_per_page(),
        gb,
        gbps: k.gbps(),
        rooms_per_sec: k.rooms_per_sec(),
        first_byte_ms: Latency::of(&k.lat_first),
        others_cores: k.others_cores().filter(|_| one_host),
        decode: Process {
            all: PerGb::of(k.decode, gb),
            bench_threads: PerGb::of(k.decode_bench(), gb),
        },
        prefill: Process {
            all: PerGb::of(k.prefill, gb),
            bench_threads: PerGb::of(k.prefill_driver, gb),
        },
    }
}

fn tcp_run(i: usize, m: &Measured, send: Usage) -> TcpRun {
    let gb = m.bytes as f64 / 1e9;
    TcpRun {
        run: i + 1,
        gb,
        gbps: m.gbps(),
        decode: PerGb::of(m.usage, gb),
        prefill: PerGb::of(send, gb),
    }
}

fn cpu_per_gb(k: &KvResult, d: &Derived) -> CpuPerGb {
    let per_gb = |s: f64| s / d.gb;
    CpuPerGb {
        decode: per_gb(k.decode.secs()),
        decode_verify: per_gb(k.verify.secs()),
        decode_driver: per_gb(k.driver.secs()),
        prefill_driver: per_gb(k.prefill_driver.secs()),
        engines: per_gb(engine_cpu_s(k)),
        decode_sys: per_gb(k.decode.sys_secs()),
        prefill: per_gb(k.prefill.secs()),
        prefill_sys: per_gb(k.prefill.sys_secs()),
        baseline_tcp_recv: d.tcp_recv.secs() / d.tcp_gb,
        baseline_tcp_send: d.tcp_send.secs() / d.tcp_gb,
    }
}

fn switches_per_gb(k: &KvResult, d: &Derived) -> SwitchesPerGb {
    let per_gb = |n: u64| n as f64 / d.gb;
    let per_tcp_gb = |n: u64| n as f64 / d.tcp_gb;
    let (kb, pb, tr, ts) = (k.decode_bench(), k.prefill_driver, d.tcp_recv, d.tcp_send);
    SwitchesPerGb {
        decode_voluntary: per_gb(k.decode.voluntary),
        decode_involuntary: per_gb(k.decode.involuntary),
        decode_bench_voluntary: per_gb(kb.voluntary),
        decode_bench_involuntary: per_gb(kb.involuntary),
        prefill_voluntary: per_gb(k.prefill.voluntary),
        prefill_involuntary: per_gb(k.prefill.involuntary),
        prefill_bench_voluntary: per_gb(pb.voluntary),
        prefill_bench_involuntary: per_gb(pb.involuntary),
        baseline_tcp_recv_voluntary: per_tcp_gb(tr.voluntary),
        baseline_tcp_recv_involuntary: per_tcp_gb(tr.involuntary),
        baseline_tcp_send_voluntary: per_tcp_gb(ts.voluntary),
        baseline_tcp_send_involuntary: per_tcp_gb(ts.involuntary),
    }
}

fn run_config(p: &Params) -> RunConfig {
    RunConfig {
        layers: p.layers,
        buffers: p.n_buffers(),
        item_len: p.item_len(),
        page_tokens: p.page_tokens,
        prompt_min: p.prompt_min,
        prompt_max: p.prompt_max,
        chunk_tokens: p.chunk_tokens,
        concurrency: p.concurrency,
        abort_rate: p.abort_rate,
        conns: p.conns,
        workers: p.workers.map_or("default".into(), Into::into),
        quick: p.quick,
    }
}

impl Model {
    /// The figures of run `r` of `p`.
    pub fn of(p: &Params, r: &Report) -> Model {
        let d = derive(r);
        let k = &r.kv;
        let (lat, basis) = if r.same_host {
            (&k.lat_e2e, "first enqueue (prefill) to decode SUCCESS")
        } else {
            (&k.lat_decode, "decode set_destination to decode SUCCESS")
        };
        let gbps = k.gbps();
        Model {
            preset: p.preset.name(),
            transport: p.transport.name(),
            same_host: p.same_host.name(),
            integrity: p.integrity.name(),
            verify: p.verify.name(),
            verify_priority: p.verify_priority.name(),
            bytes: k.bytes,
            bytes_checked: k.bytes_checked,
            seconds: k.secs,
            gbps,
            baseline_tcp_gbps: d.tcp_gbps,
            baseline_memcpy_gbps: d.memcpy_gbps,
            baseline_tcp_runs_gbps: r.tcp.iter().map(Measured::gbps).collect(),
            baseline_memcpy_runs_gbps: r.memcpy.iter().map(Measured::gbps).collect(),
            baseline_memcpy_pages_gbps: d.memcpy_pages_gbps,
            ratio_vs_memcpy_pages: d.memcpy_pages_gbps.map(|m| gbps / m),
            ratio_vs_tcp: gbps / d.tcp_gbps,
            kvxfer_runs_gbps: r.phases.iter().map(KvResult::gbps).collect(),
            ratio_vs_tcp_per_phase: d.phase_ratios.clone(),
            ratio_vs_memcpy: gbps / d.memcpy_gbps,
            auth: p.auth.name(),
            tls: p.tls,
            kvxfer_runs_auth: r.phases.iter().map(|k| k.auth).collect(),
            kvxfer_runs_rooms_per_sec: r.phases.iter().map(KvResult::rooms_per_sec).collect(),
            auth_on_vs_off: auth_split(r),
            prefill_tp: p.prefill_tp,
            decode_tp: p.decode_tp,
            page_order: p.layouts().then(|| p.page_order.name()),
            decode_page_tokens: p.side_page_tokens(Side::Decode),
            tp_vs_equal: tp_split(p, r),
            layerwise: layerwise_split(p, r, d.tcp_gbps),
            cpu_ratio_vs_tcp: d.cpu_ratio,
            cores_busy: CoresBusy {
                kvxfer: d.kv_cores,
                baseline_tcp: d.tcp_cores,
                host_kvxfer: d.host_kv_cores,
                host_baseline_tcp: d.host_tcp_cores,
            },
            loadavg: [r.loadavg.0, r.loadavg.1],
            pool_pages: r.pool_pages,
            decode_pool_huge_fraction: r.pool_huge_fraction,
            rooms: k.rooms,
            rooms_ok: k.ok,
            rooms_per_sec: k.rooms_per_sec(),
            latency_ms: Latency::of(lat),
            latency_basis: basis,
            latency_decode_ms: Latency::of(&k.lat_decode),
            latency_prefill_ms: Latency::of(&k.lat_prefill),
            first_byte_ms: Latency::of(&k.lat_first),
            first_byte_basis: FIRST_BYTE_BASIS,
            first_byte_seen_at_success: k.first_at_success,
            failed_by_reason: k.failed.clone(),
            prefill_failed_by_reason: k.prefill_failed.clone(),
            expected_failures: k.expected,
            unexpected_failures: k.unexpected,
            prefill_expected_failures: k.prefill_expected,
            prefill_unexpected_failures: k.prefill_unexpected,
            aborts_planned: k.aborts_planned,
            aborts_too_late: k.aborts_too_late,
            split_prefill_failed_decode_ok: k.split_prefill_failed_decode_ok,
            split_prefill_ok_decode_failed: k.split_prefill_ok_decode_failed,
            cpu_s_per_gb: cpu_per_gb(k, &d),
            switches_per_gb: switches_per_gb(k, &d),
            phases: r
                .phases
                .iter()
                .enumerate()
                .map(|(i, k)| phase_row(i, k, r.same_host))
                .collect(),
            baseline_tcp_runs: r
                .tcp
                .iter()
                .zip(&r.tcp_send)
                .enumerate()
                .map(|(i, (m, send))| tcp_run(i, m, *send))
                .collect(),
            config: run_config(p),
            errors: k.errors.clone(),
            one_host: r.same_host,
            tcp_cpu_s_per_gb: (d.tcp_recv.secs() + d.tcp_send.secs()) / d.tcp_gb,
            bench_threads: [
                PerGb::of(k.decode_bench(), d.gb),
                PerGb::of(k.prefill_driver, d.gb),
            ],
        }
    }

    /// The `--json` line.
    pub fn json(&self) -> String {
        serde_json::to_string(self).expect("a report is plain data")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `--json` line of run `r`.
    fn json(p: &Params, r: &Report) -> String {
        Model::of(p, r).json()
    }

    /// The human table of run `r`.
    fn human(p: &Params, r: &Report) -> String {
        crate::human::write(p, &Model::of(p, r))
    }
    use crate::args::Cli;
    use crate::params::Feed;
    use clap::Parser;

    /// The top-level keys of the `--json` line (docs/BENCHMARKS.md lists them;
    /// make bench, scripts/rdma-bench.sh and bench/peers/ read them).
    const KEYS: &[&str] = &[
        "preset",
        "transport",
        "same_host",
        "integrity",
        "verify",
        "verify_priority",
        "bytes",
        "bytes_checked",
        "seconds",
        "gbps",
        "baseline_tcp_gbps",
        "baseline_memcpy_gbps",
        "baseline_tcp_runs_gbps",
        "baseline_memcpy_runs_gbps",
        "baseline_memcpy_pages_gbps",
        "ratio_vs_memcpy_pages",
        "ratio_vs_tcp",
        "kvxfer_runs_gbps",
        "ratio_vs_tcp_per_phase",
        "ratio_vs_memcpy",
        "auth",
        "tls",
        "kvxfer_runs_auth",
        "kvxfer_runs_rooms_per_sec",
        "auth_on_vs_off",
        "prefill_tp",
        "decode_tp",
        "page_order",
        "decode_page_tokens",
        "tp_vs_equal",
        "layerwise",
        "cpu_ratio_vs_tcp",
        "cores_busy",
        "loadavg",
        "pool_pages",
        "decode_pool_huge_fraction",
        "rooms",
        "rooms_ok",
        "rooms_per_sec",
        "latency_ms",
        "latency_basis",
        "latency_decode_ms",
        "latency_prefill_ms",
        "first_byte_ms",
        "first_byte_basis",
        "first_byte_seen_at_success",
        "failed_by_reason",
        "prefill_failed_by_reason",
        "expected_failures",
        "unexpected_failures",
        "prefill_expected_failures",
        "prefill_unexpected_failures",
        "aborts_planned",
        "aborts_too_late",
        "split_prefill_failed_decode_ok",
        "split_prefill_ok_decode_failed",
        "cpu_s_per_gb",
        "switches_per_gb",
        "phases",
        "baseline_tcp_runs",
        "config",
        "errors",
    ];

    /// An object's keys, sorted (serde_json's map is ordered by key).
    fn keys(v: &serde_json::Value) -> Vec<&str> {
        v.as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect()
    }

    #[test]
    fn the_json_line_has_the_documented_keys_and_nulls_for_what_was_not_measured() {
        let (_, p) = Cli::parse_from(["kvxfer-bench", "--preset", "single-page"])
            .resolve()
            .unwrap();
        let mut r = Report {
            same_host: true,
            ..Default::default()
        };
        let mut k = KvResult {
            rooms: 3,
            ok: 2,
            bytes: 2 * p.page_bytes(),
            secs: 0.5,
            lat_e2e: vec![2_000_000, 1_000_000],
            ..Default::default()
        };
        k.failed.insert("aborted".into(), 1);
        r.kv.absorb(&k);
        r.phases.push(k);
        let v: serde_json::Value = serde_json::from_str(&json(&p, &r)).unwrap();
        let mut want: Vec<&str> = KEYS.to_vec();
        want.sort_unstable();
        assert_eq!(keys(&v), want);
        assert_eq!(v["preset"], "single-page");
        assert_eq!(v["rooms_ok"], 2);
        assert_eq!(v["latency_ms"]["p50"], 1.0);
        assert_eq!(v["latency_ms"]["n"], 2);
        assert_eq!(v["failed_by_reason"]["aborted"], 1);
        assert_eq!(v["config"]["workers"], "default");
        // No baselines ran and no huge-page figure exists: null, not a made-up number.
        assert!(v["baseline_tcp_gbps"].is_null());
        assert!(v["ratio_vs_tcp"].is_null());
        assert!(v["auth_on_vs_off"].is_null());
        assert!(v["decode_pool_huge_fraction"].is_null());
        assert!(v["first_byte_ms"]["p50"].is_null());
        assert_eq!(v["phases"].as_array().unwrap().len(), 1);
        assert_eq!(v["baseline_tcp_runs"], serde_json::json!([]));
    }

    #[test]
    fn each_phase_and_each_stream_reports_its_own_first_byte_cpu_and_switches_per_gb() {
        let (_, p) = Cli::parse_from(["kvxfer-bench"]).resolve().unwrap();
        let usage = |cpu_ms: u64, voluntary: u64, involuntary: u64| Usage {
            user_us: cpu_ms * 600,
            sys_us: cpu_ms * 400,
            voluntary,
            involuntary,
        };
        let phase = |gb: u64, first_ms: &[u64], auth: bool| KvResult {
            auth,
            ok: first_ms.len() as u64,
            bytes: gb * 1_000_000_000,
            secs: 1.0,
            lat_first: first_ms.iter().map(|ms| ms * 1_000_000).collect(),
            decode: usage(300 * gb, 2000 * gb, 10 * gb),
            prefill: usage(200 * gb, 1000 * gb, 4 * gb),
            driver: usage(50 * gb, 900 * gb, 0),
            prefill_driver: usage(40 * gb, 800 * gb, 0),
            ..Default::default()
        };
        let mut r = Report {
            same_host: true,
            ..Default::default()
        };
        for k in [phase(2, &[4, 1, 3, 2], false), phase(1, &[9], true)] {
            r.kv.absorb(&k);
            r.phases.push(k);
        }
        r.tcp.push(Measured {
            bytes: 2_000_000_000,
            secs: 0.5,
            usage: usage(500, 400, 2),
            host: HostBusy {
                busy_s: 0.95,
                wall_s: 0.5,
            },
        });
        r.tcp_send.push(usage(400, 300, 6));
        let v: serde_json::Value = serde_json::from_str(&json(&p, &r)).unwrap();
        // The host's busy CPUs: the stream's as read; none read during the phases.
        assert_eq!(v["cores_busy"]["host_baseline_tcp"], 1.9);
        assert!(v["cores_busy"]["host_kvxfer"].is_null());
        let ph = &v["phases"];
        assert_eq!(ph[0]["phase"], 1);
        assert_eq!(ph[0]["first_byte_ms"]["p50"], 2.0);
        assert_eq!(ph[0]["first_byte_ms"]["p99"], 4.0);
        assert_eq!(ph[1]["first_byte_ms"]["p50"], 9.0);
        assert_eq!(ph[1]["auth"], true);
        assert_eq!(v["first_byte_ms"]["n"], 5);
        let dec = &ph[0]["decode"];
        assert_eq!(dec["cpu_s_per_gb"], 0.3);
        assert_eq!(dec["voluntary_switches_per_gb"], 2000.0);
        assert_eq!(dec["involuntary_switches_per_gb"], 10.0);
        assert_eq!(dec["bench_threads"]["voluntary_switches_per_gb"], 900.0);
        assert_eq!(ph[1]["prefill"]["involuntary_switches_per_gb"], 4.0);
        let tcp = &v["baseline_tcp_runs"][0];
        assert_eq!(
            (tcp["run"].clone(), tcp["gbps"].clone()),
            (1.into(), 4.0.into())
        );
        assert_eq!(tcp["decode"]["cpu_s_per_gb"], 0.25);
        assert_eq!(tcp["prefill"]["involuntary_switches_per_gb"], 3.0);
        let sw = &v["switches_per_gb"];
        assert_eq!(sw["decode_voluntary"], 2000.0);
        assert_eq!(sw["prefill_bench_voluntary"], 800.0);
        assert_eq!(sw["baseline_tcp_send_voluntary"], 150.0);
        let text = human(&p, &r);
        assert!(text.contains("first byte p50 2.000 p99 4.000 ms"), "{text}");
        assert!(text.contains("0.300 / 0.200"), "{text}");
        assert!(text.contains("2000 / 1000"), "{text}");
    }

    #[test]
    fn a_tp_run_reports_its_phases_against_the_equal_tp_phases_pair_by_pair() {
        let (_, p) = Cli::parse_from(["kvxfer-bench", "--prefill-tp", "4", "--decode-tp", "2"])
            .resolve()
            .unwrap();
        let phase = |tp: bool, gbps: u64, runs: u64| KvResult {
            tp,
            ok: 10,
            bytes: gbps * 1_000_000_000,
            secs: 1.0,
            runs,
            buffer_pages: 1000,
            ..Default::default()
        };
        let mut r = Report::default();
        // The order alternates: TP first, then equal first.
        for k in [
            phase(true, 2, 4000),
            phase(false, 4, 16),
            phase(false, 5, 16),
            phase(true, 4, 4000),
        ] {
            r.kv.absorb(&k);
            r.phases.push(k);
        }
        let v: serde_json::Value = serde_json::from_str(&json(&p, &r)).unwrap();
        assert_eq!(
            (v["prefill_tp"].clone(), v["decode_tp"].clone()),
            (4.into(), 2.into())
        );
        assert_eq!(v["page_order"], "hnd");
        assert_eq!(v["decode_page_tokens"], 16);
        let t = &v["tp_vs_equal"];
        assert_eq!(
            (t["tp_gbps"].clone(), t["equal_gbps"].clone()),
            (3.0.into(), 4.5.into())
        );
        assert_eq!(t["gbps_ratio_per_pair"], serde_json::json!([0.5, 0.8]));
        assert_eq!(t["tp_runs_per_page"], 4.0);
        assert_eq!(t["equal_runs_per_page"], 0.016);
        assert_eq!(v["phases"][1]["tp"], false);
        assert_eq!(v["phases"][3]["runs_per_page"], 4.0);
        let text = human(&p, &r);
        assert!(text.contains("kvxfer, TP 4->2 / 1->1"), "{text}");
        assert!(text.contains("pairs of phases 0.500x..0.800x"), "{text}");
        assert!(text.contains("kvxfer, phase 2, TP 1->1"), "{text}");
        // Without TP: no comparison, no page order.
        let (_, plain) = Cli::parse_from(["kvxfer-bench"]).resolve().unwrap();
        let v: serde_json::Value = serde_json::from_str(&json(&plain, &r)).unwrap();
        assert!(v["tp_vs_equal"].is_null() && v["page_order"].is_null());
    }

    #[test]
    fn a_layerwise_run_reports_ttft_against_compute_and_whole_chunk_pair_by_pair() {
        let (_, p) = Cli::parse_from([
            "kvxfer-bench",
            "--layerwise",
            "--compute-us-per-layer",
            "1000",
            "--chunk-tokens",
            "4096",
        ])
        .resolve()
        .unwrap();
        let ms = |v: &[u64]| v.iter().map(|x| x * 1_000_000).collect::<Vec<_>>();
        // Compute alone: 32 layers x 1 ms = 32 ms a room.
        let phase = |by_layer: bool, us: u64, ttft: &[u64], gbps: u64| KvResult {
            feed: Feed {
                simulate: true,
                by_layer,
                compute_us_per_layer: us,
            },
            ok: ttft.len() as u64,
            bytes: gbps * 1_000_000_000,
            secs: 1.0,
            ttft: ms(ttft),
            compute: vec![us * 32_000; ttft.len()],
            late: vec![50_000, 150_000],
            last_late: vec![1_000_000; ttft.len()],
            ..Default::default()
        };
        let mut r = Report::default();
        for k in [
            phase(true, 1000, &[32, 34, 40], 1),
            phase(false, 1000, &[64, 64, 80], 1),
            phase(true, 0, &[20], 4),
            phase(false, 0, &[20], 5),
            phase(false, 1000, &[48, 48, 48], 1),
            phase(true, 1000, &[36, 36, 36], 1),
            phase(false, 0, &[20], 4),
            phase(true, 0, &[20], 4),
        ] {
            r.kv.absorb(&k);
            r.phases.push(k);
        }
        let v: serde_json::Value = serde_json::from_str(&json(&p, &r)).unwrap();
        let l = &v["layerwise"];
        // 256 pages of a 4096-token chunk x 32 KiB x K and V.
        assert_eq!(l["layer_bytes"], 16 << 20);
        assert!(l["layer_us_at_tcp"].is_null(), "no baselines: {l}");
        let sweep = l["sweep"].as_array().unwrap();
        assert_eq!(sweep.len(), 2);
        let s = &sweep[0];
        assert_eq!(s["compute_us_per_layer"], 1000);
        assert_eq!(s["compute_ms"], 32.0);
        assert_eq!(s["pairs"], 2);
        // Layer-wise 32 34 36 36 36 40, whole-chunk 48 48 48 64 64 80.
        assert_eq!(s["layerwise_ttft_ms"]["p50"], 36.0);
        assert_eq!(s["layerwise_ttft_ms"]["n"], 6);
        assert_eq!(s["whole_chunk_ttft_ms"]["p50"], 48.0);
        assert_eq!(s["whole_chunk_ttft_ms"]["p99"], 80.0);
        assert_eq!(s["ttft_ratio_p50"], 0.75);
        assert_eq!(s["ttft_ratio_p99"], 0.5);
        assert_eq!(s["layerwise_over_compute_p50"], 36.0 / 32.0);
        assert_eq!(s["layerwise_over_compute_p99"], 40.0 / 32.0);
        assert_eq!(s["whole_chunk_over_compute_p50"], 1.5);
        // Pair 1: 34 against 64 (p99 40 against 80); pair 2: 36 against 48.
        assert_eq!(
            s["ttft_ratio_p50_per_pair"],
            serde_json::json!([34.0 / 64.0, 0.75])
        );
        assert_eq!(s["ttft_ratio_p99_per_pair"], serde_json::json!([0.5, 0.75]));
        assert_eq!(s["ttft_ratio_p50_median"], (34.0 / 64.0 + 0.75) / 2.0);
        assert_eq!(s["ttft_ratio_p99_median"], 0.625);
        assert_eq!(s["reduction_p50"], 1.0 - (34.0 / 64.0 + 0.75) / 2.0);
        assert_eq!(l["compute_late_us"]["p50"], 50.0);
        assert_eq!(l["compute_late_us"]["max"], 150.0);
        assert_eq!(l["compute_late_us"]["n"], 8);
        // Layer-wise 36 ms = 32 of compute + 1 of late wake + 3 after the last enqueue.
        assert_eq!(s["layerwise_last_wake_ms"], serde_json::json!([1.0, 1.0]));
        assert_eq!(s["layerwise_after_last_enqueue_ms"][0], 3.0);
        assert_eq!(s["whole_chunk_after_last_enqueue_ms"][1], 47.0);
        // No compute: GB/s layer-wise 4 + 4 against whole-chunk 5 + 4 in 2 s each, and
        // no TTFT over a compute of 0.
        let b = &sweep[1];
        assert_eq!(b["compute_us_per_layer"], 0);
        assert_eq!(b["layerwise_gbps"], 4.0);
        assert_eq!(b["whole_chunk_gbps"], 4.5);
        assert_eq!(b["gbps_ratio_per_pair"], serde_json::json!([0.8, 1.0]));
        assert!(b["layerwise_over_compute_p50"].is_null(), "{b}");
        let ph = &v["phases"];
        assert_eq!(ph[1]["layerwise"], false);
        assert_eq!(ph[2]["compute_us_per_layer"], 0);
        assert_eq!(ph[0]["ttft_ms"]["p50"], 34.0);
        let text = human(&p, &r);
        for row in [
            "kvxfer, phase 1, layer-wise, 1000 us/layer",
            "kvxfer, phase 8, layer-wise, 0 us/layer",
            "32 layers x 1 chunk(s) a room, 16.0 MiB a layer",
            "2 pairs, LW/WC p50 0.531x..0.750x; x the compute alone, p50: 1.125 / 1.500",
        ] {
            assert!(text.contains(row), "{row}: {text}");
        }
        // Without --layerwise: no comparison, no phase kinds.
        let (_, plain) = Cli::parse_from(["kvxfer-bench"]).resolve().unwrap();
        let mut r = Report::default();
        r.phases.push(KvResult::default());
        let v: serde_json::Value = serde_json::from_str(&json(&plain, &r)).unwrap();
        assert!(v["layerwise"].is_null());
        assert!(v["phases"][0]["layerwise"].is_null());
    }
}
