//! The parameters of a run ([`Params`]: a preset with the options laid over it), checked
//! as a whole, and the plan of its phases. The decode side hands the prefill side its
//! `Params` as one JSON object, so both sides run the same plan. The model's shape
//! arithmetic is in `shape.rs`.

use serde::{Deserialize, Serialize};

use crate::args::{Auth, DstOrder, Layout, LogLevel, Named, Order, Sched, Transport, Verify};
use crate::args::{Integrity, SameHost, VerifyPriority};
use crate::preset::Preset;
use crate::shape::Side;
use crate::sys::Pages;

/// The most ranks on either side (each an engine in one process).
const MAX_TP: usize = 16;

/// The parameters of a run, the same on both sides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub preset: Preset,
    pub layers: usize,
    pub layout: Layout,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub latent_dim: usize,
    pub dtype_bytes: usize,
    pub page_tokens: usize,
    pub aux_bytes: usize,
    pub prompt_min: usize,
    pub prompt_max: usize,
    pub chunk_tokens: usize,
    pub concurrency: usize,
    pub rooms: u64,
    pub repeat: usize,
    pub duration: Option<f64>,
    pub abort_rate: f64,
    pub dst_order: DstOrder,
    pub seed: u64,
    pub transport: Transport,
    /// The engines' `same_host` setting.
    #[serde(default)]
    pub same_host: SameHost,
    /// The engines' `integrity` setting.
    #[serde(default)]
    pub integrity: Integrity,
    pub workers: Option<usize>,
    pub conns: usize,
    pub log_level: LogLevel,
    pub auth: Auth,
    /// The run's cluster key (hex), made by the decode side when `auth` is not off.
    pub auth_key: Option<String>,
    /// `--tls`: the authenticated engines also run TLS and `encrypt_data`.
    pub tls: bool,
    /// The run's certificates, made by the decode side with `tls`.
    pub tls_pem: Option<crate::tls::TlsPem>,
    pub verify: Verify,
    pub verify_threads: usize,
    pub verify_priority: VerifyPriority,
    pub baselines: bool,
    pub baseline_buf_mib: usize,
    /// Pages backing the pools and the baselines' buffers.
    pub pool_pages: Pages,
    pub baseline_write_kib: usize,
    pub baseline_read_kib: usize,
    pub sched: Sched,
    pub poll_us: u64,
    pub max_mem_gib: f64,
    pub quick: bool,
    pub json: bool,
    /// `--room-log`: where the decode side appends each room's times.
    #[serde(default)]
    pub room_log: Option<String>,
    /// Prefill and decode ranks (`--prefill-tp`, `--decode-tp`).
    pub prefill_tp: usize,
    pub decode_tp: usize,
    pub page_order: Order,
    /// `--decode-page-tokens`, when given.
    pub decode_page_tokens: Option<usize>,
    /// `--layerwise`: the phases alternate layer-wise and whole-chunk sending at each
    /// value of `compute_us_per_layer` (simulated compute per model layer) and with none.
    pub layerwise: bool,
    pub compute_us_per_layer: Vec<u64>,
}

/// How the prefill scheduler feeds a phase's rooms to its engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Feed {
    /// Simulated compute (`--layerwise` runs): each chunk's layers are computed in turn,
    /// `compute_us_per_layer` each, one room after another on the scheduler thread.
    /// Without it, every chunk of a room is enqueued when the room is created.
    pub simulate: bool,
    /// Each model layer enqueued as soon as it is computed (`enqueue_layers`), rather
    /// than each chunk after its last layer (`enqueue_chunk`).
    pub by_layer: bool,
    pub compute_us_per_layer: u64,
}

impl Feed {
    /// The phase's name in the table.
    pub fn name(self) -> String {
        format!(
            "{}, {} us/layer",
            if self.by_layer {
                "layer-wise"
            } else {
                "whole-chunk"
            },
            self.compute_us_per_layer
        )
    }
}

/// Most microseconds of compute per layer (`--compute-us-per-layer`): one second.
const MAX_COMPUTE_US: u64 = 1_000_000;

impl Params {
    /// Checks what the options cannot express on their own (also on the prefill side, for
    /// the plan it was handed).
    pub fn validate(&self) -> Result<(), String> {
        let item = self.item_len();
        if self.layers == 0 || self.layers > 2048 {
            return Err(format!("--layers {} is outside 1..=2048", self.layers));
        }
        if item % 8 != 0 || item < 24 {
            return Err(format!(
                "a page of {item} bytes per buffer: the checked pattern needs a multiple of 8 \
                 bytes, at least 24"
            ));
        }
        if self.aux_bytes != 0 && (self.aux_bytes % 8 != 0 || self.aux_bytes < 24) {
            return Err("--aux-bytes must be 0 or a multiple of 8, at least 24".into());
        }
        if self.page_tokens == 0
            || self.chunk_tokens == 0
            || self.chunk_tokens % self.page_tokens != 0
        {
            return Err(format!(
                "--chunk-tokens {} must be a positive multiple of --page-tokens {}",
                self.chunk_tokens, self.page_tokens
            ));
        }
        if self.prompt_min == 0 || self.prompt_min > self.prompt_max {
            return Err(format!(
                "--prompt {}-{} is not a range of positive token counts",
                self.prompt_min, self.prompt_max
            ));
        }
        if self.max_pages() > u32::MAX as usize / 4 {
            return Err("prompts too long for u32 page indices".into());
        }
        if self.concurrency == 0 || self.concurrency > 100_000 {
            return Err("--concurrency must be 1 to 100000".into());
        }
        if !(0.0..=1.0).contains(&self.abort_rate) {
            return Err("--abort-rate must be between 0 and 1".into());
        }
        if self.repeat == 0 {
            return Err("--repeat must be at least 1".into());
        }
        if self.tls && self.auth == Auth::Off {
            return Err(
                "--tls applies to the engines with a cluster key: add --auth on or \
                        --auth both"
                    .into(),
            );
        }
        if self.conns == 0 || self.verify_threads == 0 {
            return Err("--conns and --verify-threads must be positive".into());
        }
        let (w, r) = (self.baseline_write_kib, self.baseline_read_kib);
        if w == 0 || r == 0 || (self.baseline_buf_mib << 10) < w.max(r) {
            return Err(
                "--baseline-write-kib and --baseline-read-kib must be positive and fit in \
                 --baseline-buf-mib"
                    .into(),
            );
        }
        if self.duration.is_some_and(|d| d.is_nan() || d <= 0.0) {
            return Err("--duration must be positive".into());
        }
        if self.rooms == 0 && self.duration.is_none() {
            return Err("--rooms must be positive".into());
        }
        self.validate_tp()?;
        self.validate_layerwise()
    }

    /// The checks of `--layerwise` and `--compute-us-per-layer`.
    fn validate_layerwise(&self) -> Result<(), String> {
        let list = &self.compute_us_per_layer;
        let shown = || {
            let v: Vec<String> = list.iter().map(u64::to_string).collect();
            v.join(",")
        };
        if !self.layerwise {
            if !list.is_empty() {
                return Err(format!(
                    "--compute-us-per-layer {} applies to --layerwise runs (the simulated \
                     compute of a prefill that computes layer by layer)",
                    shown()
                ));
            }
            return Ok(());
        }
        if !list.iter().any(|&n| n > 0) || list.iter().any(|&n| n > MAX_COMPUTE_US) {
            return Err(format!(
                "--layerwise needs --compute-us-per-layer N[,N...], each 0..={MAX_COMPUTE_US} \
                 and one at least 1 (microseconds of compute per model layer; the run adds \
                 phases with no compute itself), not {}",
                if list.is_empty() {
                    "none".into()
                } else {
                    shown()
                }
            ));
        }
        if let Some(n) = list
            .iter()
            .enumerate()
            .find_map(|(i, n)| list[..i].contains(n).then_some(n))
        {
            return Err(format!(
                "--compute-us-per-layer lists {n} twice: each value is a point of the sweep"
            ));
        }
        if self.layouts() {
            return Err(
                "--layerwise runs TP 1 -> 1 (one engine pair): drop --prefill-tp, --decode-tp \
                 and --decode-page-tokens"
                    .into(),
            );
        }
        if self.auth == Auth::Both {
            return Err(
                "--auth both and --layerwise each alternate two kinds of phase: run them \
                 separately (--auth on or off with --layerwise)"
                    .into(),
            );
        }
        if self.duration.is_some() {
            return Err(
                "--layerwise compares phases of the same rooms: use --rooms, not --duration".into(),
            );
        }
        Ok(())
    }

    /// The compute values of a `--layerwise` run in order: those given, then 0 (the bulk
    /// phases) if it was not among them.
    pub fn sweep(&self) -> Vec<u64> {
        let mut v = self.compute_us_per_layer.clone();
        if !v.contains(&0) {
            v.push(0);
        }
        v
    }

    /// The compute alone of a room of `pages` pages under `feed`, in nanoseconds: every
    /// layer of every chunk.
    pub fn compute_ns(&self, feed: Feed, pages: usize) -> u64 {
        (self.chunks_for(pages) * self.layers) as u64 * feed.compute_us_per_layer * 1000
    }

    /// The kinds of the kvxfer phases in order, each with the engine set it runs on
    /// (`sets`: one per --auth pair or per TP kind). `--layerwise`: a layer-wise and a
    /// whole-chunk phase at each value of the sweep in turn, the order of each pair
    /// swapped every repeat (LW WC lw wc, WC LW wc lw, ...) so neither always runs first. Else
    /// the sets take turns, --repeat phases of each, in the order 0 1, 1 0, 0 1, ... (two
    /// sets) so that neither always runs first (the first phase also pays for first
    /// touches and connection setup) or drifts with the host.
    pub fn phase_plan(&self, sets: usize) -> Vec<(usize, Feed)> {
        if self.layerwise {
            let feed = |by_layer: bool, us: u64| Feed {
                simulate: true,
                by_layer,
                compute_us_per_layer: us,
            };
            let sweep = self.sweep();
            return (0..self.repeat)
                .flat_map(|rep| {
                    let first = rep % 2 == 0;
                    sweep
                        .iter()
                        .flat_map(move |&n| [feed(first, n), feed(!first, n)])
                        .collect::<Vec<_>>()
                })
                .map(|f| (0, f))
                .collect();
        }
        (0..self.repeat * sets)
            .map(|phase| {
                let set = match sets {
                    2 if (phase / 2) % 2 == 1 => 1 - phase % 2,
                    n => phase % n,
                };
                (set, Feed::default())
            })
            .collect()
    }

    /// The checks of a run between layouts (`--prefill-tp`, `--decode-tp`,
    /// `--page-order`, `--decode-page-tokens`).
    fn validate_tp(&self) -> Result<(), String> {
        for (opt, tp) in [
            ("--prefill-tp", self.prefill_tp),
            ("--decode-tp", self.decode_tp),
        ] {
            if !(1..=MAX_TP).contains(&tp) {
                return Err(format!("{opt} {tp} is outside 1..={MAX_TP}"));
            }
        }
        if !self.layouts() {
            if self.page_order != Order::Hnd {
                return Err(format!(
                    "--page-order {} applies to transfers between layouts (--prefill-tp, \
                     --decode-tp or --decode-page-tokens): at TP 1 -> 1 whole pages are \
                     copied, whatever their order",
                    self.page_order.name()
                ));
            }
            return Ok(());
        }
        if self.auth == Auth::Both {
            return Err(
                "--auth both and --prefill-tp/--decode-tp each alternate two kinds of phase: \
                 run them separately (--auth on or off with TP)"
                    .into(),
            );
        }
        let cell = self.cell_bytes();
        if cell % 8 != 0 || cell < 24 {
            return Err(format!(
                "a head of {cell} bytes (--head-dim x --dtype-bytes, or --latent-dim x \
                 --dtype-bytes): the per-head pattern of a transfer between layouts needs a \
                 multiple of 8 bytes, at least 24"
            ));
        }
        if let Some(d) = self.decode_page_tokens {
            let pt = self.page_tokens;
            if d == 0 || (d % pt != 0 && pt % d != 0) {
                return Err(format!(
                    "--decode-page-tokens {d} and --page-tokens {pt}: one must divide the other"
                ));
            }
            if self.chunk_tokens % d != 0 {
                return Err(format!(
                    "--chunk-tokens {} must be a multiple of --decode-page-tokens {d}",
                    self.chunk_tokens
                ));
            }
        }
        let sides = [
            (Side::Prefill, "--prefill-tp", self.prefill_tp),
            (Side::Decode, "--decode-tp", self.decode_tp),
        ];
        for (side, opt, tp) in sides {
            self.layout(side, tp, 0).check().map_err(|e| {
                format!(
                    "{opt} {tp} with --kv-heads {}: {e}",
                    self.kv_heads_of_layout()
                )
            })?;
        }
        Ok(())
    }
}
