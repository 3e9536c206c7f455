//! The command line ([`Cli`], parsed by clap), the values of its options, and how it
//! resolves into the parameters of a run ([`Params`]: a preset with the options laid
//! over it).

use clap::{Args, Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::params::Params;
use crate::preset::Preset;
use crate::sys::Pages;

const USAGE: &str = "\
kvxfer-bench [--preset NAME] [OPTIONS]         prefill + decode over loopback (two processes)
       kvxfer-bench table [--quick] [--json]          room table microbenchmark (same as --preset table)
       kvxfer-bench --role prefill --listen HOST:PORT two hosts: the prefill side, waits for one run
       kvxfer-bench --role decode --prefill-addr HOST:PORT [--preset NAME] [OPTIONS]
                                                      two hosts: the decode side, drives the run";

const AFTER_HELP: &str = "What the figures mean: docs/BENCHMARKS.md.";

/// kvxfer-bench: the libkvxfer engine against the limits of this host, measured side by side
#[derive(Debug, Parser)]
#[command(name = "kvxfer-bench", override_usage = USAGE, after_help = AFTER_HELP)]
// A later occurrence of an option replaces an earlier one (extra options appended to a
// command line win, as `make bench BENCH_ARGS=...` relies on).
#[command(args_override_self = true)]
pub struct Cli {
    /// A preset, the same as --preset (`kvxfer-bench table`: the room table
    /// microbenchmark)
    #[arg(
        value_name = "COMMAND",
        conflicts_with = "preset",
        hide_possible_values = true
    )]
    command: Option<Preset>,
    /// The model shape and traffic to start from
    #[arg(long, default_value_t = Preset::Llama3_8b)]
    preset: Preset,
    #[command(flatten)]
    shape: Shape,
    #[command(flatten)]
    tp: Parallel,
    #[command(flatten)]
    traffic: Traffic,
    #[command(flatten)]
    layerwise: LayerWise,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    measure: Measurement,
    #[command(flatten)]
    hosts: TwoHosts,
}

// Each group's options override the preset's value when given; the defaults in brackets
// are the presets'.

#[derive(Debug, Args)]
#[command(next_help_heading = "Model shape (overrides the preset)")]
struct Shape {
    /// Layers of the model
    #[arg(long)]
    layers: Option<usize>,
    /// Separate K and V buffers per layer, or one latent buffer per layer
    #[arg(long)]
    layout: Option<Layout>,
    /// KV heads (kv layout)
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head dimension (kv layout)
    #[arg(long)]
    head_dim: Option<usize>,
    /// Values per token (mla layout)
    #[arg(long)]
    latent_dim: Option<usize>,
    /// Bytes per value
    #[arg(long)]
    dtype_bytes: Option<usize>,
    /// Tokens per page
    #[arg(long)]
    page_tokens: Option<usize>,
    /// Bytes of each room's aux row (0 = no aux buffer) [64]
    #[arg(long)]
    aux_bytes: Option<usize>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Tensor parallelism (issue 13)")]
struct Parallel {
    /// Prefill ranks: as many prefill engines in the prefill process, each holding its
    /// slice of the KV heads (the whole latent with --layout mla), registered with its
    /// layout; with either TP above 1 the kvxfer phases alternate with phases of the same
    /// model and prompts at TP 1 -> 1 [1]
    #[arg(long, value_name = "N")]
    prefill_tp: Option<usize>,
    /// Decode ranks: as many decode engines in the decode process; a room counts as done
    /// when every decode rank's room reached SUCCESS [1]
    #[arg(long, value_name = "M")]
    decode_tp: Option<usize>,
    /// The order of a page's elements on both sides, heads-major or tokens-major (with
    /// --prefill-tp, --decode-tp or --decode-page-tokens) [hnd]
    #[arg(long)]
    page_order: Option<Order>,
    /// Tokens per decode page, when they differ from the prefill's --page-tokens (one
    /// must divide the other) [--page-tokens]
    #[arg(long, value_name = "N")]
    decode_page_tokens: Option<usize>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Traffic")]
struct Traffic {
    /// Prompt tokens: fixed, or uniform in A..=B [4096; single-page 16; quick 1024]
    #[arg(long, value_name = "N|A-B", value_parser = parse_prompt)]
    prompt: Option<(usize, usize)>,
    /// Chunked prefill size, a multiple of the page size [2048]
    #[arg(long)]
    chunk_tokens: Option<usize>,
    /// Rooms in flight [4; single-page 64; model presets quick 2]
    #[arg(long)]
    concurrency: Option<usize>,
    /// Rooms per kvxfer phase [16; single-page 30000; quick 8 / 5000]
    #[arg(long, overrides_with = "duration")]
    rooms: Option<u64>,
    /// Run each kvxfer phase this long instead of --rooms
    #[arg(long, value_name = "SECS", overrides_with = "rooms")]
    duration: Option<f64>,
    /// kvxfer phases, each between two rounds of baselines [3; quick 1]
    #[arg(long)]
    repeat: Option<usize>,
    /// Fraction of rooms aborted on purpose (counted as expected failures) [0]
    #[arg(long)]
    abort_rate: Option<f64>,
    /// Destination pages in order, or scattered inside a slot [contiguous]
    #[arg(long)]
    dst_order: Option<DstOrder>,
    /// Room plan seed [1]
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Layer by layer (issue 14)")]
struct LayerWise {
    /// Simulate a prefill that computes layer by layer (a wait of --compute-us-per-layer
    /// per model layer of each chunk, on the prefill scheduler thread) and alternate, in
    /// the same run and at each compute value, phases that enqueue each layer as soon as
    /// it is computed (enqueue_layers) with phases that enqueue each chunk after its last
    /// layer (enqueue_chunk); also with no compute (bulk GB/s). Reports
    /// time-to-first-token (first layer computed -> decode SUCCESS) of each at each
    /// value. One host only (TTFT compares the two processes' CLOCK_MONOTONIC), TP 1 -> 1
    #[arg(long)]
    layerwise: bool,
    /// --layerwise: microseconds of simulated compute per model layer (its K and V
    /// buffers, or its latent buffer with --layout mla), per chunk; a comma-separated
    /// list sweeps them in one run (0, no compute, is added when absent)
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',')]
    compute_us_per_layer: Option<Vec<u64>>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Engine")]
struct EngineArgs {
    /// The engines' transport [tcp]
    #[arg(long)]
    transport: Option<Transport>,
    /// The engines' same_host setting: off keeps two processes on one host on TCP (the
    /// stream baseline's path); require makes them copy directly between the processes
    /// (the run fails if they cannot) [off]
    #[arg(long)]
    same_host: Option<SameHost>,
    /// The engines' integrity setting: verify (every data run's digest checked where it
    /// landed) or off (the engine's default) [off]
    #[arg(long)]
    integrity: Option<Integrity>,
    /// Engine worker threads [engine default]
    #[arg(long)]
    workers: Option<usize>,
    /// Data connections per peer (also the TCP baseline's) [2]
    #[arg(long)]
    conns: Option<usize>,
    /// The engines' log level [error]
    #[arg(long)]
    log_level: Option<LogLevel>,
    /// Engines without or with a cluster key (a fresh one per run, handed to the prefill
    /// side with the plan); both: two engine pairs, kvxfer phases alternating off on, on
    /// off, off on, ... and the report gives the on/off ratios [off]
    #[arg(long)]
    auth: Option<Auth>,
    /// The engines with a cluster key (--auth on, or the "on" pair of --auth both) also
    /// run TLS 1.3 on their control connection and seal their data (encrypt_data=true),
    /// with a CA and certificates made for the run; --auth both --tls gives the cost of
    /// TLS and encrypt_data as the on/off ratio
    #[arg(long)]
    tls: bool,
    /// The run's cluster key in hex, instead of a fresh one
    #[arg(long, value_name = "HEX", hide = true)]
    auth_key: Option<String>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Measurement")]
struct Measurement {
    /// Check every delivered byte, the stamps of every page plus the whole body of 1
    /// page in 16, or nothing [full]
    #[arg(long)]
    verify: Option<Verify>,
    /// Decode-side checker threads [1]
    #[arg(long)]
    verify_threads: Option<usize>,
    /// The checker threads' scheduling: `idle` (SCHED_IDLE) runs a check only on a core
    /// that nothing else wants, so checking never takes a core from the engines'
    /// threads; every check is still done and its CPU counted. `normal` as every other
    /// thread [idle]
    #[arg(long)]
    verify_priority: Option<VerifyPriority>,
    /// Skip the TCP stream and memcpy baselines
    #[arg(long)]
    no_baselines: bool,
    /// Per-connection buffer of the TCP baseline [64]
    #[arg(long)]
    baseline_buf_mib: Option<usize>,
    /// The TCP baseline's write size [4096]
    #[arg(long)]
    baseline_write_kib: Option<usize>,
    /// The TCP baseline's read size [4096]
    #[arg(long)]
    baseline_read_kib: Option<usize>,
    /// How the scheduler loops idle: `wait` sleeps in the engine's wait until a room
    /// changes state (or the bench's own work wakes it), `poll` sleeps --poll-us [wait;
    /// single-page poll]
    #[arg(long)]
    sched: Option<Sched>,
    /// `--sched poll`: the loop's sleep when nothing changed; `--sched wait`: the
    /// longest sleep while a failed room drains [500; single-page 100]
    #[arg(long)]
    poll_us: Option<u64>,
    /// Refuse to register more memory than this (both sides) [16]
    #[arg(long)]
    max_mem_gib: Option<f64>,
    /// Pages under the pools and the baselines' buffers: 2 MiB transparent huge pages, as
    /// a server's KV pool would use, or 4 KiB pages [huge]
    #[arg(long)]
    pool_pages: Option<Pages>,
    /// A smoke-test size that finishes in seconds
    #[arg(long)]
    quick: bool,
    /// The last line printed is one JSON object
    #[arg(long)]
    json: bool,
    /// Append one JSON line per room to FILE: its phase, how it was fed and its times
    /// on both sides (CLOCK_MONOTONIC ns)
    #[arg(long, value_name = "FILE")]
    room_log: Option<String>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Two hosts")]
struct TwoHosts {
    /// Which side of a two-host run this process is
    #[arg(long)]
    role: Option<Role>,
    /// The decode side: where the prefill bench listens
    #[arg(long, value_name = "HOST:PORT")]
    prefill_addr: Option<String>,
    /// The prefill side: where to wait for the decode bench
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<String>,
    /// The prefill side of a local run: driven over stdin/stdout by its parent
    #[arg(long, value_parser = ["stdio"], hide = true)]
    control: Option<String>,
}

fn parse_prompt(v: &str) -> Result<(usize, usize), String> {
    let num = |s: &str| {
        s.parse::<usize>()
            .map_err(|_| format!("'{s}' is not a token count"))
    };
    match v.split_once('-') {
        Some((a, b)) => Ok((num(a)?, num(b)?)),
        None => num(v).map(|n| (n, n)),
    }
}

/// A value of an option, named as on the command line (and so in the plan handed to the
/// prefill side and in the report).
pub trait Named: ValueEnum {
    fn name(&self) -> String {
        self.to_possible_value()
            .expect("no value is skipped")
            .get_name()
            .to_string()
    }
}

/// Writes the command-line name (clap's `default_value_t` shows it).
macro_rules! display_named {
    ($($t:ty),*) => {$(
        impl Named for $t {}
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.name())
            }
        }
    )*};
}
display_named!(
    Preset,
    Layout,
    Order,
    Sched,
    Verify,
    VerifyPriority,
    DstOrder,
    Auth,
    Transport,
    SameHost,
    Integrity,
    LogLevel
);

/// The engines' transport (`--transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Tcp,
    Rdma,
    Auto,
}

/// The engines' `same_host` setting (`--same-host`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SameHost {
    #[default]
    Off,
    Auto,
    Require,
}

/// The engines' `integrity` setting (`--integrity`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Integrity {
    Verify,
    #[default]
    Off,
}

/// The engines' log level (`--log-level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Separate K and V buffers per layer.
    Kv,
    /// One latent buffer per layer.
    Mla,
}

/// The order of a page's elements (`--page-order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Heads-major: `[head][token][dim]`.
    Hnd,
    /// Tokens-major: `[token][head][dim]`.
    Nhd,
}

/// How a scheduler loop with nothing to do waits (`--sched`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sched {
    /// In `Engine::wait`, until a room changes state or the bench's own work (a checked
    /// room, an announcement from the other side) wakes it with `Engine::wake`.
    Wait,
    /// A fixed sleep of `--poll-us`, then every room is polled again.
    Poll,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    Full,
    Sample,
    None,
}

/// How the decode side's checker threads are scheduled (`--verify-priority`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyPriority {
    /// `SCHED_IDLE`: on a core only when nothing else wants it.
    Idle,
    /// The default policy, like every other thread.
    Normal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DstOrder {
    Contiguous,
    Shuffled,
}

/// Which engine pairs run: without authentication, with it, or both in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Auth {
    Off,
    On,
    Both,
}

impl Auth {
    /// Whether each engine pair authenticates, in phase order.
    pub fn pairs(self) -> &'static [bool] {
        match self {
            Auth::Off => &[false],
            Auth::On => &[true],
            Auth::Both => &[false, true],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
}

/// What this process does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Both sides on this host: the decode side here, the prefill in a child process.
    Local,
    /// The decode side of a two-host run, driving the prefill bench at this address.
    Decode(String),
    /// The prefill side, for one run: driven by its parent over stdin/stdout (`None`),
    /// or by the first decode bench that connects to this address.
    Prefill(Option<String>),
    /// The room table microbenchmark.
    Table,
}

impl Cli {
    /// What to do and with which parameters: the preset, the options over it, checked.
    pub fn resolve(self) -> Result<(Mode, Params), String> {
        let preset = self.command.unwrap_or(self.preset);
        let mut p = preset.params(self.measure.quick);
        macro_rules! over {
            ($group:ident: $($field:ident),*) => {
                $(if let Some(v) = self.$group.$field { p.$field = v; })*
            };
        }
        over!(shape: layers, layout, kv_heads, head_dim, latent_dim, dtype_bytes, page_tokens, aux_bytes);
        over!(traffic: chunk_tokens, concurrency, rooms, repeat, abort_rate, dst_order, seed);
        over!(engine: transport, same_host, integrity, conns, log_level, auth);
        over!(tp: prefill_tp, decode_tp, page_order);
        p.decode_page_tokens = self.tp.decode_page_tokens;
        p.layerwise = self.layerwise.layerwise;
        if let Some(n) = self.layerwise.compute_us_per_layer {
            p.compute_us_per_layer = n;
        }
        over!(measure: verify, verify_threads, verify_priority, baseline_buf_mib);
        over!(measure: baseline_write_kib);
        over!(measure: baseline_read_kib, sched, poll_us, max_mem_gib, pool_pages);
        if let Some((a, b)) = self.traffic.prompt {
            (p.prompt_min, p.prompt_max) = (a, b);
        }
        // --rooms and --duration override each other: at most one is given.
        p.duration = self.traffic.duration;
        p.workers = self.engine.workers;
        p.auth_key = self.engine.auth_key;
        p.tls = self.engine.tls;
        p.baselines = !self.measure.no_baselines;
        p.json = self.measure.json;
        p.room_log = self.measure.room_log;
        p.validate()?;
        let h = self.hosts;
        let mode = match (h.role, h.prefill_addr, h.listen, h.control) {
            (Some(Role::Prefill), _, _, Some(_)) => Mode::Prefill(None),
            (Some(Role::Prefill), _, Some(l), None) => Mode::Prefill(Some(l)),
            (Some(Role::Prefill), ..) => {
                return Err("--role prefill needs --listen HOST:PORT".into())
            }
            (Some(Role::Decode), Some(_), ..) if p.layerwise => {
                return Err(
                    "--layerwise measures time-to-first-token between the two processes' \
                     CLOCK_MONOTONIC, which only one host shares: run it locally"
                        .into(),
                )
            }
            (Some(Role::Decode), Some(a), ..) => Mode::Decode(a),
            (Some(Role::Decode), None, ..) => {
                return Err("--role decode needs --prefill-addr HOST:PORT".into())
            }
            (None, ..) if preset == Preset::Table => Mode::Table,
            (None, ..) => Mode::Local,
        };
        Ok((mode, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Feed;
    use crate::shape::Side;
    use kvxfer::{KvKind, PageOrder};

    fn parse(s: &str) -> Result<(Mode, Params), String> {
        let argv = std::iter::once("kvxfer-bench").chain(s.split_whitespace());
        Cli::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .resolve()
    }

    fn params(s: &str) -> Params {
        parse(s).unwrap().1
    }

    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn presets_have_the_documented_shapes() {
        let l = params("--preset llama3-8b");
        assert_eq!((l.n_buffers(), l.item_len()), (64, 32 * 1024));
        assert_eq!(l.pages_for(4096), 256);
        assert_eq!(
            (l.rooms, l.concurrency, l.repeat, l.poll_us),
            (16, 4, 3, 500)
        );
        let q = params("--preset llama3-8b --quick");
        assert_eq!(
            (q.prompt_max, q.rooms, q.concurrency, q.repeat),
            (1024, 8, 2, 1)
        );
        let d = params("--preset deepseek-mla");
        assert_eq!((d.n_buffers(), d.item_len()), (61, 576 * 2 * 64));
        let s = params("--preset single-page");
        assert_eq!((s.max_pages(), s.rooms, s.concurrency), (1, 30_000, 64));
        assert_eq!(params("--preset single-page --quick").rooms, 5_000);
        assert_eq!(parse("table --quick --json").unwrap().0, Mode::Table);
        assert_eq!(parse("--preset table").unwrap().0, Mode::Table);
        assert_eq!(
            parse("").unwrap(),
            (Mode::Local, params("--preset llama3-8b"))
        );
    }

    #[test]
    fn options_override_the_preset_and_later_options_win() {
        let p = params("--preset single-page --prompt 10-20 --abort-rate 0.25 --workers 3");
        assert_eq!((p.prompt_min, p.prompt_max, p.abort_rate), (10, 20, 0.25));
        assert_eq!(p.workers, Some(3));
        let p = params("--conns 1 --quick --pool-pages 4k --conns 4 --quick --prompt=512");
        assert_eq!(
            (p.conns, p.quick, p.prompt_min, p.prompt_max),
            (4, true, 512, 512)
        );
        assert_eq!(p.pool_pages, Pages::Small);
        assert_eq!(params("--rooms 5 --duration 2").duration, Some(2.0));
        let p = params("--duration 2 --rooms 5");
        assert_eq!((p.duration, p.rooms), (None, 5));
        assert!(!params("--no-baselines").baselines);
        let a = params("--auth both --auth-key 00ff --dst-order shuffled --verify sample");
        assert_eq!((a.auth, a.auth_key.as_deref()), (Auth::Both, Some("00ff")));
        assert_eq!(
            (a.dst_order, a.verify),
            (DstOrder::Shuffled, Verify::Sample)
        );
        assert_eq!(Auth::Both.pairs(), [false, true]);
        let t = params("--auth both --tls");
        assert!(t.tls && t.tls_pem.is_none());
    }

    #[test]
    fn bad_command_lines_are_refused() {
        for bad in [
            "--auth maybe",
            "--tls",
            "--auth off --tls",
            "--chunk-tokens 10",
            "--bogus 1",
            "--role decode",
            "--role prefill",
            "--prompt 20-10",
            "--layers x",
            "--preset gpt",
            "table --preset llama3-8b",
            "--transport ib",
            "--control pipe --role prefill",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse("--role prefill --control stdio").unwrap().0,
            Mode::Prefill(None)
        );
        assert_eq!(
            parse("--role prefill --listen 0.0.0.0:7000").unwrap().0,
            Mode::Prefill(Some("0.0.0.0:7000".into()))
        );
        assert_eq!(
            parse("--role decode --prefill-addr h:1 --preset single-page")
                .unwrap()
                .0,
            Mode::Decode("h:1".into())
        );
    }

    #[test]
    fn tp_options_set_each_ranks_layout_and_default_to_whole_pages() {
        let d = params("");
        assert_eq!(
            (d.prefill_tp, d.decode_tp, d.page_order),
            (1, 1, Order::Hnd)
        );
        assert!(!d.layouts());
        assert!(!params("--decode-page-tokens 16").layouts());
        let p = params("--prefill-tp 4 --decode-tp 2 --page-order nhd");
        assert!(p.layouts());
        let pre = p.rank_layouts(Side::Prefill);
        assert_eq!(pre.len(), 4);
        assert_eq!(pre[3].heads(), 6..8);
        assert_eq!((pre[3].tp_rank, pre[3].order), (3, PageOrder::Nhd));
        let dec = p.rank_layouts(Side::Decode);
        assert_eq!(
            (dec[1].heads(), dec[1].page_bytes()),
            (4..8, Some(16 * 4 * 256))
        );
        let eq = p.equal_layout();
        assert_eq!((eq.tp_size, eq.heads(), eq.page_tokens), (1, 0..8, 16));
        let m = params("--preset deepseek-mla --prefill-tp 3 --decode-tp 5");
        let l = m.layout(Side::Decode, 5, 4);
        assert_eq!(
            (l.kind, l.kv_heads, l.head_dim, l.heads()),
            (KvKind::Latent, 1, 576, 0..1)
        );
        let pages = params("--decode-page-tokens 64 --prompt 1000");
        assert!(pages.layouts());
        assert_eq!(pages.layout(Side::Decode, 1, 0).page_tokens, 64);
        assert_eq!(pages.equal_layout().page_tokens, 16);
        // Replicated heads: 2 KV heads over 8 decode ranks.
        let r = params("--kv-heads 2 --decode-tp 8");
        assert_eq!(r.layout(Side::Decode, 8, 5).heads(), 1..2);
    }

    #[test]
    fn tp_sizes_that_do_not_divide_the_heads_are_refused_with_the_reason() {
        let e = parse("--prefill-tp 3").unwrap_err();
        assert!(
            e.contains(
                "--prefill-tp 3 with --kv-heads 8: kv_heads 8 is not a multiple of tp_size 3"
            ),
            "{e}"
        );
        let e = parse("--kv-heads 2 --decode-tp 3").unwrap_err();
        assert!(
            e.contains(
                "--decode-tp 3 with --kv-heads 2: tp_size 3 is not a multiple of kv_heads 2"
            ),
            "{e}"
        );
        let e = parse("--decode-page-tokens 24").unwrap_err();
        assert!(e.contains("one must divide the other"), "{e}");
        let e = parse("--decode-page-tokens 4096").unwrap_err();
        assert!(e.contains("--chunk-tokens 2048 must be a multiple"), "{e}");
        let e = parse("--page-order nhd").unwrap_err();
        assert!(
            e.contains("--page-order nhd applies to transfers between layouts"),
            "{e}"
        );
        let e = parse("--head-dim 2 --prefill-tp 2").unwrap_err();
        assert!(e.contains("a head of 4 bytes"), "{e}");
        for bad in [
            "--prefill-tp 0",
            "--decode-tp 17",
            "--auth both --prefill-tp 2",
            "--decode-page-tokens 0",
            "--page-order xyz",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn layerwise_options_are_checked_with_the_reason() {
        let p = params("--layerwise --compute-us-per-layer 4000 --chunk-tokens 4096");
        assert!(p.layerwise);
        assert_eq!(p.compute_us_per_layer, [4000]);
        assert_eq!(p.sweep(), [4000, 0]);
        assert_eq!((p.buffers_per_layer(), p.chunks_for(256)), (2, 1));
        let d = params("");
        assert!(!d.layerwise);
        assert!(d.compute_us_per_layer.is_empty());
        // A list is swept in its order; 0 stays where it was given.
        let s = params("--layerwise --compute-us-per-layer 3000,0,1500");
        assert_eq!(s.sweep(), [3000, 0, 1500]);
        for (bad, why) in [
            (
                "--layerwise",
                "--layerwise needs --compute-us-per-layer N[,N...]",
            ),
            (
                "--layerwise --compute-us-per-layer 0",
                "each 0..=1000000 and one at least 1",
            ),
            ("--layerwise --compute-us-per-layer 1000001", "not 1000001"),
            ("--layerwise --compute-us-per-layer 5,x", "invalid digit"),
            ("--layerwise --compute-us-per-layer 5,0,5", "lists 5 twice"),
            (
                "--compute-us-per-layer 5",
                "--compute-us-per-layer 5 applies to --layerwise runs",
            ),
            (
                "--layerwise --compute-us-per-layer 5 --prefill-tp 2",
                "--layerwise runs TP 1 -> 1",
            ),
            (
                "--layerwise --compute-us-per-layer 5 --auth both",
                "--auth both and --layerwise each alternate",
            ),
            (
                "--layerwise --compute-us-per-layer 5 --duration 2",
                "use --rooms, not --duration",
            ),
            (
                "--role decode --prefill-addr h:1 --layerwise --compute-us-per-layer 5",
                "which only one host shares",
            ),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // The prefill side of a two-host run is handed the plan, not the option.
        assert_eq!(
            parse("--role prefill --listen h:1 --layerwise --compute-us-per-layer 5")
                .unwrap()
                .0,
            Mode::Prefill(Some("h:1".into()))
        );
    }

    #[test]
    fn the_compute_alone_of_a_room_is_every_layer_of_every_chunk() {
        let mut p = params("--layerwise --compute-us-per-layer 1000");
        let feed = |us| Feed {
            simulate: true,
            by_layer: true,
            compute_us_per_layer: us,
        };
        // 4096 tokens in chunks of 2048: 2 chunks x 32 layers x 1 ms.
        assert_eq!(p.compute_ns(feed(1000), 256), 64_000_000);
        assert_eq!(p.compute_ns(feed(1000), 129), 64_000_000);
        assert_eq!(p.compute_ns(feed(1000), 128), 32_000_000);
        assert_eq!(p.compute_ns(feed(0), 256), 0);
        p.chunk_tokens = 4096;
        assert_eq!(p.compute_ns(feed(250), 256), 8_000_000);
        let m = params("--preset deepseek-mla --layerwise --compute-us-per-layer 10");
        assert_eq!((m.buffers_per_layer(), m.n_buffers()), (1, 61));
    }

    #[test]
    fn phases_alternate_so_that_neither_kind_always_runs_first() {
        let p = params("--layerwise --compute-us-per-layer 700 --repeat 2");
        let kinds: Vec<(usize, bool, u64)> = p
            .phase_plan(1)
            .into_iter()
            .map(|(set, f)| {
                assert!(f.simulate);
                (set, f.by_layer, f.compute_us_per_layer)
            })
            .collect();
        assert_eq!(
            kinds,
            [
                (0, true, 700),
                (0, false, 700),
                (0, true, 0),
                (0, false, 0),
                (0, false, 700),
                (0, true, 700),
                (0, false, 0),
                (0, true, 0),
            ]
        );
        let sets = |p: &Params, n| -> Vec<usize> {
            p.phase_plan(n)
                .into_iter()
                .map(|(s, f)| {
                    assert_eq!(f, Feed::default());
                    s
                })
                .collect()
        };
        let both = params("--auth both --repeat 3");
        assert_eq!(sets(&both, 2), [0, 1, 1, 0, 0, 1]);
        // A sweep: a pair at each value, in the list's order, each pair's order swapped
        // every repeat.
        let s = params("--layerwise --compute-us-per-layer 0,200 --repeat 2");
        let kinds: Vec<(bool, u64)> = s
            .phase_plan(1)
            .into_iter()
            .map(|(_, f)| (f.by_layer, f.compute_us_per_layer))
            .collect();
        assert_eq!(
            kinds,
            [
                (true, 0),
                (false, 0),
                (true, 200),
                (false, 200),
                (false, 0),
                (true, 0),
                (false, 200),
                (true, 200),
            ]
        );
        assert_eq!(sets(&params("--repeat 3"), 1), [0, 0, 0]);
    }

    #[test]
    fn the_command_lines_of_the_makefiles_and_scripts_parse() {
        // Makefile (bench-smoke), Makefile.bench, scripts/rdma-bench.sh, bench/peers/.
        for ok in [
            "--preset single-page --quick --json",
            "--preset llama3-8b --quick --abort-rate 0.2 --json",
            "--preset llama3-8b --quick --prefill-tp 2 --decode-tp 1 --json",
            "--preset llama3-8b --quick --layerwise --compute-us-per-layer 1000 --json",
            "--layerwise --compute-us-per-layer 4000 --chunk-tokens 4096 --verify sample --json",
            "--layerwise --compute-us-per-layer 0,1500,3000,4500,6000 --chunk-tokens 4096 \
             --verify sample --json",
            "--preset deepseek-mla --json --quick",
            "--preset table --json",
            "--transport rdma --json --preset llama3-8b --prompt 1024 --rooms 6 --concurrency 2 \
             --repeat 1",
            "--layers 1 --layout mla --latent-dim 1024 --dtype-bytes 2 --page-tokens 512 \
             --prompt 8192 --chunk-tokens 8192 --aux-bytes 0 --dst-order shuffled \
             --verify sample --concurrency 4 --rooms 64 --repeat 1 --conns 1 --poll-us 100 \
             --json --seed 3 --no-baselines",
        ] {
            parse(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    #[test]
    fn the_plan_round_trips_through_json() {
        let p = params(
            "--preset single-page --prompt 10-20 --abort-rate 0.25 --workers 3 \
                        --auth on --auth-key 00ff --duration 1.5 --pool-pages 4k",
        );
        let text = serde_json::to_string(&p).unwrap();
        let q: Params = serde_json::from_str(&text).unwrap();
        assert_eq!(p, q);
        assert!(text.contains(r#""pool_pages":"4k""#), "{text}");
        assert!(text.contains(r#""auth":"on""#), "{text}");
        let l = params("--layerwise --compute-us-per-layer 9");
        let text = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<Params>(&text).unwrap(), l);
    }
}
