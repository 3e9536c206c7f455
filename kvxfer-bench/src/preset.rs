//! The presets (`--preset`): each one's name, description and parameters, here and
//! nowhere else. A preset is a model shape and its traffic, the starting point that the
//! options override; `table` is the room table microbenchmark.

use clap::ValueEnum;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::args::{Auth, DstOrder, Layout, LogLevel, Named, Order, Sched, Transport, Verify};
use crate::args::{Integrity, SameHost, VerifyPriority};
use crate::params::Params;
use crate::sys::Pages;

/// A model shape and its traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// 32 layers, separate K and V buffers, 8 KV heads, head dim 128, bf16, 16-token pages
    /// (32 KiB per buffer page), 4096-token prompts
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// 61 layers, one latent buffer per layer (576 values/token), bf16, 64-token pages
    /// (FlashMLA's block size), 4096-token prompts
    DeepseekMla,
    /// One page per room, many rooms: 2 layers, K and V, 2 KV heads, head dim 64
    SinglePage,
    /// The room table microbenchmark (`kvxfer-bench table`)
    Table,
}

impl Serialize for Preset {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for Preset {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Preset::from_str(&name, false).map_err(serde::de::Error::custom)
    }
}

impl Preset {
    /// The parameters of a run of this preset, before any option (`quick`: the smoke-test
    /// size).
    pub fn params(self, quick: bool) -> Params {
        let mut p = Params {
            preset: self,
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
            transport: Transport::Tcp,
            same_host: SameHost::Off,
            integrity: Integrity::Off,
            workers: None,
            conns: 2,
            log_level: LogLevel::Error,
            auth: Auth::Off,
            auth_key: None,
            tls: false,
            tls_pem: None,
            verify: Verify::Full,
            verify_threads: 1,
            verify_priority: VerifyPriority::Idle,
            baselines: true,
            baseline_buf_mib: 64,
            pool_pages: Pages::Huge,
            baseline_write_kib: 4096,
            baseline_read_kib: 4096,
            sched: Sched::Wait,
            poll_us: 100,
            max_mem_gib: 16.0,
            quick,
            json: false,
            room_log: None,
            prefill_tp: 1,
            decode_tp: 1,
            page_order: Order::Hnd,
            decode_page_tokens: None,
            layerwise: false,
            compute_us_per_layer: Vec::new(),
        };
        // The model presets' smoke-test size.
        let quick_model = |p: &mut Params| {
            if quick {
                (p.prompt_min, p.prompt_max, p.rooms, p.concurrency) = (1024, 1024, 8, 2);
            }
        };
        match self {
            Preset::Llama3_8b => {
                p.poll_us = 500;
                quick_model(&mut p);
            }
            Preset::DeepseekMla => {
                p.layers = 61;
                p.layout = Layout::Mla;
                p.page_tokens = 64;
                p.poll_us = 500;
                quick_model(&mut p);
            }
            Preset::SinglePage => {
                p.layers = 2;
                p.kv_heads = 2;
                p.head_dim = 64;
                (p.prompt_min, p.prompt_max, p.chunk_tokens) = (16, 16, 16);
                p.concurrency = 64;
                p.rooms = if quick { 5_000 } else { 30_000 };
                // Tens of thousands of rooms a second, each changing state a few times:
                // a timer that finds several rooms done per look costs less than a
                // wakeup per change (measured: about 10% more rooms/s than waiting).
                p.sched = Sched::Poll;
            }
            Preset::Table => {}
        }
        p
    }
}
