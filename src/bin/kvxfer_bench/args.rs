//! The command line: presets, free parameters, and the canonical argument list the
//! decode side hands to the prefill side (so both sides parse one format).

use std::fmt::Write as _;

use crate::sys::Pages;

pub const USAGE: &str = "\
kvxfer-bench: the libkvxfer engine against the limits of this host, measured side by side

USAGE
  kvxfer-bench [--preset NAME] [OPTIONS]         prefill + decode over loopback (two processes)
  kvxfer-bench table [--quick] [--json]          room table microbenchmark (same as --preset table)
  kvxfer-bench --role prefill --listen HOST:PORT two hosts: the prefill side, waits for one run
  kvxfer-bench --role decode --prefill-addr HOST:PORT [--preset NAME] [OPTIONS]
                                                 two hosts: the decode side, drives the run

PRESETS
  llama3-8b     32 layers, separate K and V buffers, 8 KV heads, head dim 128, bf16,
                16-token pages (32 KiB per buffer page), 4096-token prompts   [default]
  deepseek-mla  61 layers, one latent buffer per layer (576 values/token), bf16,
                64-token pages (FlashMLA's block size), 4096-token prompts
  single-page   one page per room, many rooms: 2 layers, K and V, 2 KV heads, head dim 64
  table         the room table microbenchmark

MODEL SHAPE (override the preset)
  --layers N  --layout kv|mla  --kv-heads N  --head-dim N  --latent-dim N
  --dtype-bytes N  --page-tokens N  --aux-bytes N (one aux row per room; 0 = none)

TRAFFIC
  --prompt N | A-B          prompt tokens: fixed, or uniform in A..=B [4096; single-page 16;
                            quick 1024]
  --chunk-tokens N          chunked prefill size, a multiple of the page size [2048]
  --concurrency N           rooms in flight [4; single-page 64; model presets quick 2]
  --rooms N                 rooms per kvxfer phase [16; single-page 30000; quick 8 / 5000]
  --duration SECS           run each kvxfer phase this long instead of --rooms
  --repeat N                kvxfer phases, each between two rounds of baselines [3; quick 1]
  --abort-rate F            fraction of rooms aborted on purpose (counted as expected failures)
  --dst-order contiguous|shuffled   destination pages in order, or scattered inside a slot
  --seed N                  room plan seed

ENGINE
  --transport tcp|rdma|auto [tcp]  --workers N [engine default]
  --conns N                 data connections per peer (also the TCP baseline's) [2]
  --log-level error|warn|info|debug|trace

MEASUREMENT
  --verify full|sample|none  check every delivered byte [default], the stamps of every page
                            plus the whole body of 1 page in 16, or nothing
  --verify-threads N        decode-side checker threads
  --no-baselines            skip the TCP stream and memcpy baselines
  --baseline-buf-mib N      per-connection buffer of the TCP baseline [64]
  --baseline-write-kib N  --baseline-read-kib N   its write and read sizes [4096]
  --poll-us N               scheduler loop sleep when nothing changed [500; single-page 100]
  --max-mem-gib F           refuse to register more memory than this (both sides)
  --pool-pages huge|4k      pages under the pools and the baselines' buffers: 2 MiB
                            transparent huge pages, as a server's KV pool would use [huge],
                            or 4 KiB pages
  --quick                   a smoke-test size that finishes in seconds
  --json                    the last line printed is one JSON object
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Separate K and V buffers per layer.
    Kv,
    /// One latent buffer per layer.
    Mla,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    Full,
    Sample,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DstOrder {
    Contiguous,
    Shuffled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Both sides on this host: the decode side here, the prefill in a child process.
    Local,
    /// The decode side of a two-host run.
    Decode,
    /// The prefill side (a child, or the prefill host of a two-host run).
    Prefill,
}

#[derive(Debug, Clone)]
pub struct Params {
    pub preset: String,
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
    pub transport: String,
    pub workers: Option<usize>,
    pub conns: usize,
    pub log_level: String,
    pub verify: Verify,
    pub verify_threads: usize,
    pub baselines: bool,
    pub baseline_buf_mib: usize,
    /// Pages backing the pools and the baselines' buffers.
    pub pool_pages: Pages,
    pub baseline_write_kib: usize,
    pub baseline_read_kib: usize,
    pub poll_us: u64,
    pub max_mem_gib: f64,
    pub quick: bool,
    pub json: bool,
    pub table: bool,
    pub role: Role,
    pub prefill_addr: Option<String>,
    pub listen: Option<String>,
    /// The prefill side talks to its parent over stdin/stdout.
    pub control_stdio: bool,
}

impl Params {
    fn preset(name: &str, quick: bool) -> Result<Params, String> {
        let mut p = Params {
            preset: name.to_string(),
            layers: 32,
            layout: Layout::Kv,
            kv_heads: 8,
            head_dim: 128,
            latent_dim: 576,
            dtype_bytes: 2,
            page_tokens: 16,
            aux_bytes: 64,
            prompt_min: 4096,
            prompt_max: 4096,
            chunk_tokens: 2048,
            concurrency: 4,
            rooms: 16,
            repeat: if quick { 1 } else { 3 },
            duration: None,
            abort_rate: 0.0,
            dst_order: DstOrder::Contiguous,
            seed: 1,
            transport: "tcp".into(),
            workers: None,
            conns: 2,
            log_level: "error".into(),
            verify: Verify::Full,
            verify_threads: 1,
            baselines: true,
            baseline_buf_mib: 64,
            pool_pages: Pages::Huge,
            baseline_write_kib: 4096,
            baseline_read_kib: 4096,
            poll_us: 100,
            max_mem_gib: 16.0,
            quick,
            json: false,
            table: false,
            role: Role::Local,
            prefill_addr: None,
            listen: None,
            control_stdio: false,
        };
        match name {
            "llama3-8b" => {
                p.poll_us = 500;
                if quick {
                    (p.prompt_min, p.prompt_max, p.rooms, p.concurrency) = (1024, 1024, 8, 2);
                }
            }
            "deepseek-mla" => {
                p.layers = 61;
                p.layout = Layout::Mla;
                p.page_tokens = 64;
                p.poll_us = 500;
                if quick {
                    (p.prompt_min, p.prompt_max, p.rooms, p.concurrency) = (1024, 1024, 8, 2);
                }
            }
            "single-page" => {
                p.layers = 2;
                p.kv_heads = 2;
                p.head_dim = 64;
                (p.prompt_min, p.prompt_max, p.chunk_tokens) = (16, 16, 16);
                p.concurrency = 64;
                p.rooms = if quick { 5_000 } else { 30_000 };
            }
            "table" => p.table = true,
            _ => {
                return Err(format!(
                    "unknown preset '{name}' (known: llama3-8b, deepseek-mla, single-page, table)"
                ))
            }
        }
        Ok(p)
    }

    /// Parses the arguments after the program name.
    pub fn parse(args: &[String]) -> Result<Params, String> {
        let mut opts: Vec<(String, String)> = Vec::new();
        let mut flags: Vec<String> = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let a = &args[i];
            i += 1;
            if a == "table" && opts.is_empty() && flags.is_empty() {
                opts.push(("preset".into(), "table".into()));
                continue;
            }
            let Some(name) = a.strip_prefix("--") else {
                return Err(format!("unexpected argument '{a}' (see --help)"));
            };
            if let Some((k, v)) = name.split_once('=') {
                opts.push((k.to_string(), v.to_string()));
                continue;
            }
            if matches!(name, "json" | "quick" | "no-baselines" | "help") {
                flags.push(name.to_string());
                continue;
            }
            let Some(v) = args.get(i) else {
                return Err(format!("--{name} needs a value (see --help)"));
            };
            i += 1;
            opts.push((name.to_string(), v.clone()));
        }
        if flags.iter().any(|f| f == "help") {
            return Err(String::new());
        }
        let quick = flags.iter().any(|f| f == "quick");
        let preset = opts
            .iter()
            .rev()
            .find(|(k, _)| k == "preset")
            .map_or("llama3-8b", |(_, v)| v.as_str());
        let mut p = Params::preset(preset, quick)?;
        p.json = flags.iter().any(|f| f == "json");
        p.baselines = !flags.iter().any(|f| f == "no-baselines");
        for (k, v) in &opts {
            p.set(k, v)?;
        }
        p.validate()?;
        Ok(p)
    }

    fn set(&mut self, k: &str, v: &str) -> Result<(), String> {
        fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("--{k}: '{v}' is not a valid number"))
        }
        match k {
            "preset" => {}
            "layers" => self.layers = num(k, v)?,
            "layout" => {
                self.layout = match v {
                    "kv" => Layout::Kv,
                    "mla" => Layout::Mla,
                    _ => return Err(format!("--layout: '{v}' is not kv or mla")),
                }
            }
            "kv-heads" => self.kv_heads = num(k, v)?,
            "head-dim" => self.head_dim = num(k, v)?,
            "latent-dim" => self.latent_dim = num(k, v)?,
            "dtype-bytes" => self.dtype_bytes = num(k, v)?,
            "page-tokens" => self.page_tokens = num(k, v)?,
            "aux-bytes" => self.aux_bytes = num(k, v)?,
            "prompt" => {
                (self.prompt_min, self.prompt_max) = match v.split_once('-') {
                    Some((a, b)) => (num(k, a)?, num(k, b)?),
                    None => {
                        let n = num(k, v)?;
                        (n, n)
                    }
                }
            }
            "chunk-tokens" => self.chunk_tokens = num(k, v)?,
            "concurrency" => self.concurrency = num(k, v)?,
            "rooms" => {
                self.rooms = num(k, v)?;
                self.duration = None;
            }
            "duration" => self.duration = Some(num(k, v)?),
            "repeat" => self.repeat = num(k, v)?,
            "abort-rate" => self.abort_rate = num(k, v)?,
            "dst-order" => {
                self.dst_order = match v {
                    "contiguous" => DstOrder::Contiguous,
                    "shuffled" => DstOrder::Shuffled,
                    _ => return Err(format!("--dst-order: '{v}' is not contiguous or shuffled")),
                }
            }
            "seed" => self.seed = num(k, v)?,
            "transport" => self.transport = v.to_string(),
            "workers" => self.workers = Some(num(k, v)?),
            "conns" => self.conns = num(k, v)?,
            "log-level" => self.log_level = v.to_string(),
            "verify" => {
                self.verify = match v {
                    "full" => Verify::Full,
                    "sample" => Verify::Sample,
                    "none" => Verify::None,
                    _ => return Err(format!("--verify: '{v}' is not full, sample or none")),
                }
            }
            "verify-threads" => self.verify_threads = num(k, v)?,
            "baseline-buf-mib" => self.baseline_buf_mib = num(k, v)?,
            "pool-pages" => {
                self.pool_pages = match v {
                    "huge" => Pages::Huge,
                    "4k" => Pages::Small,
                    _ => return Err(format!("--pool-pages: '{v}' is not huge or 4k")),
                }
            }
            "baseline-write-kib" => self.baseline_write_kib = num(k, v)?,
            "baseline-read-kib" => self.baseline_read_kib = num(k, v)?,
            "poll-us" => self.poll_us = num(k, v)?,
            "max-mem-gib" => self.max_mem_gib = num(k, v)?,
            "role" => {
                self.role = match v {
                    "prefill" => Role::Prefill,
                    "decode" => Role::Decode,
                    _ => return Err(format!("--role: '{v}' is not prefill or decode")),
                }
            }
            "prefill-addr" => self.prefill_addr = Some(v.to_string()),
            "listen" => self.listen = Some(v.to_string()),
            "control" => {
                if v != "stdio" {
                    return Err(format!("--control: '{v}' is not stdio"));
                }
                self.control_stdio = true;
            }
            _ => return Err(format!("unknown option --{k} (see --help)")),
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), String> {
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
        if self.role == Role::Decode && self.prefill_addr.is_none() {
            return Err("--role decode needs --prefill-addr HOST:PORT".into());
        }
        if self.role == Role::Prefill && self.listen.is_none() && !self.control_stdio {
            return Err("--role prefill needs --listen HOST:PORT".into());
        }
        Ok(())
    }

    /// KV buffers each engine registers.
    pub fn n_buffers(&self) -> usize {
        match self.layout {
            Layout::Kv => 2 * self.layers,
            Layout::Mla => self.layers,
        }
    }

    /// Bytes of one page in one buffer.
    pub fn item_len(&self) -> usize {
        let per_token = match self.layout {
            Layout::Kv => self.kv_heads * self.head_dim,
            Layout::Mla => self.latent_dim,
        };
        per_token * self.dtype_bytes * self.page_tokens
    }

    /// Pages of a prompt of `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// Pages of the longest prompt: the size of a pool slot.
    pub fn max_pages(&self) -> usize {
        self.pages_for(self.prompt_max)
    }

    /// Pages per chunk.
    pub fn chunk_pages(&self) -> usize {
        self.chunk_tokens / self.page_tokens
    }

    /// KV payload bytes of one page across every buffer.
    pub fn page_bytes(&self) -> u64 {
        (self.item_len() * self.n_buffers()) as u64
    }

    /// The options the prefill side needs, in command-line form.
    pub fn plan_args(&self) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut put = |k: &str, v: String| {
            a.push(format!("--{k}"));
            a.push(v);
        };
        put("preset", self.preset.clone());
        put("layers", self.layers.to_string());
        put(
            "layout",
            match self.layout {
                Layout::Kv => "kv",
                Layout::Mla => "mla",
            }
            .into(),
        );
        put("kv-heads", self.kv_heads.to_string());
        put("head-dim", self.head_dim.to_string());
        put("latent-dim", self.latent_dim.to_string());
        put("dtype-bytes", self.dtype_bytes.to_string());
        put("page-tokens", self.page_tokens.to_string());
        put("aux-bytes", self.aux_bytes.to_string());
        put("prompt", format!("{}-{}", self.prompt_min, self.prompt_max));
        put("chunk-tokens", self.chunk_tokens.to_string());
        put("concurrency", self.concurrency.to_string());
        put("abort-rate", self.abort_rate.to_string());
        put("seed", self.seed.to_string());
        put("transport", self.transport.clone());
        if let Some(w) = self.workers {
            put("workers", w.to_string());
        }
        put("conns", self.conns.to_string());
        put("log-level", self.log_level.clone());
        put("baseline-buf-mib", self.baseline_buf_mib.to_string());
        put("pool-pages", self.pool_pages.name().into());
        put("baseline-write-kib", self.baseline_write_kib.to_string());
        put("baseline-read-kib", self.baseline_read_kib.to_string());
        put("poll-us", self.poll_us.to_string());
        put("role", "prefill".into());
        put("control", "stdio".into());
        a
    }

    /// One line describing the shape, for the report.
    pub fn shape_line(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "{} layers, {}, {} buffers x {} KiB pages ({} tokens), ",
            self.layers,
            match self.layout {
                Layout::Kv => format!("K+V, {} KV heads x dim {}", self.kv_heads, self.head_dim),
                Layout::Mla => format!("MLA latent {}", self.latent_dim),
            },
            self.n_buffers(),
            self.item_len() as f64 / 1024.0,
            self.page_tokens
        );
        if self.prompt_min == self.prompt_max {
            let _ = write!(s, "prompt {} tokens", self.prompt_min);
        } else {
            let _ = write!(s, "prompt {}..={} tokens", self.prompt_min, self.prompt_max);
        }
        let _ = write!(
            s,
            ", chunk {}, {} in flight",
            self.chunk_tokens, self.concurrency
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Params, String> {
        let v: Vec<String> = s.split_whitespace().map(String::from).collect();
        Params::parse(&v)
    }

    #[test]
    fn presets_have_the_documented_shapes() {
        let l = parse("--preset llama3-8b").unwrap();
        assert_eq!((l.n_buffers(), l.item_len()), (64, 32 * 1024));
        assert_eq!(l.pages_for(4096), 256);
        let d = parse("--preset deepseek-mla").unwrap();
        assert_eq!((d.n_buffers(), d.item_len()), (61, 576 * 2 * 64));
        let s = parse("--preset single-page").unwrap();
        assert_eq!(s.max_pages(), 1);
        assert!(parse("table").unwrap().table);
    }

    #[test]
    fn the_plan_round_trips_and_options_override_presets() {
        let p = parse("--preset single-page --prompt 10-20 --abort-rate 0.25 --workers 3").unwrap();
        let q = Params::parse(&p.plan_args()).unwrap();
        assert_eq!((q.prompt_min, q.prompt_max), (10, 20));
        assert_eq!(q.abort_rate, 0.25);
        assert_eq!(q.workers, Some(3));
        assert_eq!(q.role, Role::Prefill);
        assert!(parse("--chunk-tokens 10").is_err());
        assert!(parse("--bogus 1").is_err());
        assert!(parse("--role decode").is_err());
    }
}
