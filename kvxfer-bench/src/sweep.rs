//! `--layerwise`: time-to-first-token of layer-wise against whole-chunk sending at each
//! compute value of the sweep, measured in turn in the same run, and the bulk GB/s of both
//! with no compute.

use std::fmt::Write as _;

use serde::Serialize;

use crate::params::Params;
use crate::report::{min_max, pct, pct_ms, sorted, Latency};
use crate::results::{KvResult, Report};

/// Percentiles of how late the prefill scheduler woke after a layer's end, in µs.
#[derive(Serialize)]
pub struct LateUs {
    p50: f64,
    p99: f64,
    max: f64,
    n: usize,
}

/// One compute value of the sweep: its layer-wise and whole-chunk phases side by side.
#[derive(Serialize)]
pub struct SweepPoint {
    compute_us_per_layer: u64,
    /// The compute alone of a room (every layer of every chunk), ms: the median room.
    compute_ms: f64,
    /// Pairs of adjacent phases (one of each way of sending) at this value.
    pairs: usize,
    layerwise_ttft_ms: Latency,
    whole_chunk_ttft_ms: Latency,
    /// Layer-wise TTFT over whole-chunk TTFT, every room of the value together: p50 over
    /// p50, p99 over p99.
    ttft_ratio_p50: f64,
    ttft_ratio_p99: f64,
    /// The same ratios pair by pair, in order, and their median over the pairs (the
    /// figure that the targets are read on: noise that hits one phase moves one pair).
    ttft_ratio_p50_per_pair: Vec<f64>,
    ttft_ratio_p99_per_pair: Vec<f64>,
    ttft_ratio_p50_median: f64,
    ttft_ratio_p99_median: f64,
    /// 1 - the median ratio at p50: how much sooner layer-wise gives the first token.
    reduction_p50: f64,
    /// Each room's TTFT over its compute alone: the median and the 99th percentile room
    /// (null with no compute).
    layerwise_over_compute_p50: f64,
    layerwise_over_compute_p99: f64,
    whole_chunk_over_compute_p50: f64,
    whole_chunk_over_compute_p99: f64,
    /// GB/s delivered by each way of sending, their ratio over the value's phases, and
    /// pair by pair.
    layerwise_gbps: f64,
    whole_chunk_gbps: f64,
    gbps_ratio: f64,
    gbps_ratio_per_pair: Vec<f64>,
    /// The median room's time on the link ([`KvResult::room_link`]), ms, of each way,
    /// and layer-wise over whole-chunk pair by pair and their median: with no compute,
    /// the bulk comparison that the number of rooms in flight does not move.
    layerwise_room_link_ms: f64,
    whole_chunk_room_link_ms: f64,
    room_link_ratio_per_pair: Vec<f64>,
    room_link_ratio_median: f64,
    /// Pair by pair, the cores of this host busy with other work than the run during
    /// the layer-wise and the whole-chunk phase ([`KvResult::others_cores`]): a pair
    /// whose two phases differ by a core compared a link on the whole host with one on
    /// half of it.
    others_cores_per_pair: Vec<[Option<f64>; 2]>,
    /// Where a room's time goes past its compute: TTFT = compute + the scheduler's late
    /// wake after the last layer + the rest (the last enqueue's transfer, whatever earlier
    /// layers still had to move, SUCCESS reaching the decode poll); ms, median and p99
    /// room of each part.
    layerwise_last_wake_ms: [f64; 2],
    layerwise_after_last_enqueue_ms: [f64; 2],
    whole_chunk_last_wake_ms: [f64; 2],
    whole_chunk_after_last_enqueue_ms: [f64; 2],
}

/// The whole sweep.
#[derive(Serialize)]
pub struct LayerwiseSplit {
    /// KV bytes of one model layer of one chunk (what one `enqueue_layers` call sends),
    /// and how long it takes at the mean TCP stream of the run, µs (null without
    /// baselines): the sweep's scale.
    layer_bytes: u64,
    layer_us_at_tcp: f64,
    /// One point per compute value, in the order of `--compute-us-per-layer` (then 0).
    sweep: Vec<SweepPoint>,
    /// How late the prefill scheduler woke after each layer's end (its sleep's
    /// overshoot, plus whatever else held the thread), over the phases with compute.
    compute_late_us: LateUs,
}

/// The parts of TTFT past the compute ([`SweepPoint`]): the last wake's lateness and
/// the rest, ns per room.
fn tail(k: &KvResult) -> (Vec<u64>, Vec<u64>) {
    let rest = k
        .ttft
        .iter()
        .zip(&k.compute)
        .zip(&k.last_late)
        .map(|((&t, &c), &l)| t.saturating_sub(c + l))
        .collect();
    (k.last_late.clone(), rest)
}

/// Median and p99 of nanoseconds, in ms.
fn p50_p99(ns: &[u64]) -> [f64; 2] {
    let v = sorted(ns);
    [pct_ms(&v, 0.5), pct_ms(&v, 0.99)]
}

/// Each room's TTFT over its compute alone, sorted (none without compute).
fn over_compute(k: &KvResult) -> Vec<f64> {
    let mut v: Vec<f64> = k
        .ttft
        .iter()
        .zip(&k.compute)
        .filter(|(_, &c)| c > 0)
        .map(|(&t, &c)| t as f64 / c as f64)
        .collect();
    v.sort_unstable_by(f64::total_cmp);
    v
}

/// The median of some values, in any order (NaN when none).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_unstable_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The point of compute value `us`: its phases of each way, every room together and
/// pair by pair.
fn point(r: &Report, us: u64) -> SweepPoint {
    let at = |k: &&KvResult| k.feed.simulate && k.feed.compute_us_per_layer == us;
    let total = |by_layer: bool| {
        let mut t = KvResult::default();
        r.phases
            .iter()
            .filter(at)
            .filter(|k| k.feed.by_layer == by_layer)
            .for_each(|k| t.absorb(k));
        t
    };
    let (lw, wc) = (total(true), total(false));
    // Adjacent phases of this value, one of each way of sending.
    let pairs: Vec<(&KvResult, &KvResult)> = r
        .phases
        .chunks_exact(2)
        .filter(|w| at(&&w[0]) && at(&&w[1]) && w[0].feed.by_layer != w[1].feed.by_layer)
        .map(|w| {
            if w[0].feed.by_layer {
                (&w[0], &w[1])
            } else {
                (&w[1], &w[0])
            }
        })
        .collect();
    let q = |k: &KvResult, q: f64| pct_ms(&sorted(&k.ttft), q);
    let per_pair = |f: &dyn Fn(&KvResult, &KvResult) -> f64| -> Vec<f64> {
        pairs.iter().map(|(l, c)| f(l, c)).collect()
    };
    let r50 = per_pair(&|l, c| q(l, 0.5) / q(c, 0.5));
    let r99 = per_pair(&|l, c| q(l, 0.99) / q(c, 0.99));
    let link = |k: &KvResult| pct_ms(&sorted(&k.room_link), 0.5);
    let rl = per_pair(&|l, c| link(l) / link(c));
    let (lw_over, wc_over) = (over_compute(&lw), over_compute(&wc));
    let compute: Vec<u64> = lw.compute.iter().chain(&wc.compute).copied().collect();
    let (lw_wake, lw_rest) = tail(&lw);
    let (wc_wake, wc_rest) = tail(&wc);
    SweepPoint {
        compute_us_per_layer: us,
        compute_ms: pct_ms(&sorted(&compute), 0.5),
        pairs: pairs.len(),
        layerwise_ttft_ms: Latency::of(&lw.ttft),
        whole_chunk_ttft_ms: Latency::of(&wc.ttft),
        ttft_ratio_p50: q(&lw, 0.5) / q(&wc, 0.5),
        ttft_ratio_p99: q(&lw, 0.99) / q(&wc, 0.99),
        ttft_ratio_p50_median: median(&r50),
        ttft_ratio_p99_median: median(&r99),
        reduction_p50: 1.0 - median(&r50),
        ttft_ratio_p50_per_pair: r50,
        ttft_ratio_p99_per_pair: r99,
        layerwise_over_compute_p50: pct(&lw_over, 0.5),
        layerwise_over_compute_p99: pct(&lw_over, 0.99),
        whole_chunk_over_compute_p50: pct(&wc_over, 0.5),
        whole_chunk_over_compute_p99: pct(&wc_over, 0.99),
        layerwise_gbps: lw.gbps(),
        whole_chunk_gbps: wc.gbps(),
        gbps_ratio: lw.gbps() / wc.gbps(),
        gbps_ratio_per_pair: per_pair(&|l, c| l.gbps() / c.gbps()),
        layerwise_room_link_ms: link(&lw),
        whole_chunk_room_link_ms: link(&wc),
        room_link_ratio_median: median(&rl),
        room_link_ratio_per_pair: rl,
        others_cores_per_pair: pairs
            .iter()
            .map(|(l, c)| [l.others_cores(), c.others_cores()])
            .collect(),
        layerwise_last_wake_ms: p50_p99(&lw_wake),
        layerwise_after_last_enqueue_ms: p50_p99(&lw_rest),
        whole_chunk_last_wake_ms: p50_p99(&wc_wake),
        whole_chunk_after_last_enqueue_ms: p50_p99(&wc_rest),
    }
}

/// KV bytes of one model layer of one chunk of the longest prompt.
fn layer_bytes(p: &Params) -> u64 {
    let pages = p.chunk_pages().min(p.max_pages());
    (pages * p.item_len() * p.buffers_per_layer()) as u64
}

/// The sweep of a `--layerwise` run (`tcp_gbps`: the mean TCP stream, NaN without
/// baselines); `None` for any other run.
pub fn layerwise_split(p: &Params, r: &Report, tcp_gbps: f64) -> Option<LayerwiseSplit> {
    if !p.layerwise {
        return None;
    }
    let late: Vec<u64> = r
        .phases
        .iter()
        .filter(|k| k.feed.compute_us_per_layer > 0)
        .flat_map(|k| k.late.iter().copied())
        .collect();
    let late = sorted(&late);
    let late_us = |q: f64| pct_ms(&late, q) * 1e3;
    let bytes = layer_bytes(p);
    Some(LayerwiseSplit {
        layer_bytes: bytes,
        layer_us_at_tcp: bytes as f64 / tcp_gbps / 1e3,
        sweep: p.sweep().into_iter().map(|us| point(r, us)).collect(),
        compute_late_us: LateUs {
            p50: late_us(0.5),
            p99: late_us(0.99),
            max: late_us(1.0),
            n: late.len(),
        },
    })
}

/// The rows of the `--layerwise` comparison: two lines per compute value.
pub fn rows(p: &Params, l: &LayerwiseSplit) -> String {
    let mut o = String::new();
    let chunks = p.chunks_for(p.pages_for(p.prompt_max));
    let _ = writeln!(
        o,
        "  layer by layer: {} layers x {chunks} chunk(s) a room, {:.1} MiB a layer ({:.0} us at \
         the mean tcp stream)",
        p.layers,
        l.layer_bytes as f64 / (1 << 20) as f64,
        l.layer_us_at_tcp
    );
    let _ = writeln!(
        o,
        "  TTFT (first layer's compute -> decode SUCCESS) in ms; LW/WC: layer-wise over \
         whole-chunk TTFT, the median over the pairs of phases"
    );
    let _ = writeln!(
        o,
        "  {:>8} {:>8} | {:>15} {:>8} | {:>15} {:>8} | {:>7} {:>7} | {:>13}",
        "us/layer",
        "compute",
        "layer-wise p50",
        "p99",
        "whole-chunk p50",
        "p99",
        "LW/WC",
        "p99",
        "GB/s LW / WC"
    );
    for s in &l.sweep {
        let _ = writeln!(
            o,
            "  {:>8} {:>8.1} | {:>15.1} {:>8.1} | {:>15.1} {:>8.1} | {:>6.3}x {:>6.3}x | {:>5.2} / {:<5.2}",
            s.compute_us_per_layer,
            s.compute_ms,
            s.layerwise_ttft_ms.p50,
            s.layerwise_ttft_ms.p99,
            s.whole_chunk_ttft_ms.p50,
            s.whole_chunk_ttft_ms.p99,
            s.ttft_ratio_p50_median,
            s.ttft_ratio_p99_median,
            s.layerwise_gbps,
            s.whole_chunk_gbps
        );
        let (lo, hi) = min_max(&s.ttft_ratio_p50_per_pair);
        let over = if s.compute_us_per_layer == 0 {
            String::new()
        } else {
            format!(
                "; x the compute alone, p50: {:.3} / {:.3}",
                s.layerwise_over_compute_p50, s.whole_chunk_over_compute_p50
            )
        };
        let _ = writeln!(
            o,
            "  {:>17}   {} pairs, LW/WC p50 {lo:.3}x..{hi:.3}x{over}; past the compute, p50 / p99 \
             ms: layer-wise last wake {} then {}, whole-chunk {} then {}",
            "",
            s.pairs,
            part(s.layerwise_last_wake_ms),
            part(s.layerwise_after_last_enqueue_ms),
            part(s.whole_chunk_last_wake_ms),
            part(s.whole_chunk_after_last_enqueue_ms)
        );
        let _ = writeln!(
            o,
            "  {:>17}   a room on the link, median ms: {:.1} / {:.1}, LW/WC median {:.3}x; \
             other work on this host, cores during LW / WC, pair by pair: {}",
            "",
            s.layerwise_room_link_ms,
            s.whole_chunk_room_link_ms,
            s.room_link_ratio_median,
            others(&s.others_cores_per_pair)
        );
    }
    let c = &l.compute_late_us;
    let _ = writeln!(
        o,
        "  compute sleeps (clock_nanosleep to each layer's end, 1 ns timer slack) woke late by \
         p50 {:.1} p99 {:.1} max {:.1} us over {} layers",
        c.p50, c.p99, c.max, c.n
    );
    o
}

/// Each pair's other work on the host, `LW/WC` cores (`-` where the host did not say).
fn others(pairs: &[[Option<f64>; 2]]) -> String {
    let c = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    let v: Vec<String> = pairs
        .iter()
        .map(|[l, w]| format!("{}/{}", c(*l), c(*w)))
        .collect();
    v.join(", ")
}

fn part(x: [f64; 2]) -> String {
    format!("{:.2} / {:.2}", x[0], x[1])
}
