//! The model's shape arithmetic over a run's [`Params`]: buffers, page sizes, chunks,
//! and each rank's KV layout between tensor-parallel sizes.

use std::fmt::Write as _;

use kvxfer::{KvKind, KvLayout, PageOrder};

use crate::args::{Layout, Named, Order};
use crate::params::Params;

/// Which side of a transfer a layout is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Prefill,
    Decode,
}

impl Params {
    /// The kv buffers of one model layer (K and V, or the latent): the `layer_count` of
    /// one `enqueue_layers` call, since the pool registers its buffers without layer ids
    /// (a layer is a buffer's position).
    pub fn buffers_per_layer(&self) -> usize {
        match self.layout {
            Layout::Kv => 2,
            Layout::Mla => 1,
        }
    }

    /// Chunks of a room of `pages` pages.
    pub fn chunks_for(&self, pages: usize) -> usize {
        pages.div_ceil(self.chunk_pages())
    }

    /// Whether the run moves KV between layouts (each rank an engine registered with its
    /// layout, the per-head pattern) rather than whole pages between two engines.
    pub fn layouts(&self) -> bool {
        self.prefill_tp > 1
            || self.decode_tp > 1
            || self
                .decode_page_tokens
                .is_some_and(|d| d != self.page_tokens)
    }

    /// Tokens per page on `side`.
    pub fn side_page_tokens(&self, side: Side) -> usize {
        match side {
            Side::Prefill => self.page_tokens,
            Side::Decode => self.decode_page_tokens.unwrap_or(self.page_tokens),
        }
    }

    /// Bytes of one head of one token (of the latent with --layout mla).
    pub fn cell_bytes(&self) -> usize {
        match self.layout {
            Layout::Kv => self.head_dim * self.dtype_bytes,
            Layout::Mla => self.latent_dim * self.dtype_bytes,
        }
    }

    pub(crate) fn kv_heads_of_layout(&self) -> usize {
        match self.layout {
            Layout::Kv => self.kv_heads,
            Layout::Mla => 1,
        }
    }

    /// The layout of rank `rank` of `tp` on `side` (TP 1 on both sides with the prefill's
    /// pages: the equal-TP comparison).
    pub fn layout(&self, side: Side, tp: usize, rank: usize) -> KvLayout {
        let (kind, head_dim) = match self.layout {
            Layout::Kv => (KvKind::Heads, self.head_dim),
            Layout::Mla => (KvKind::Latent, self.latent_dim),
        };
        KvLayout {
            kv_heads: self.kv_heads_of_layout() as u32,
            head_dim: head_dim as u32,
            dtype_bytes: self.dtype_bytes as u32,
            tp_rank: rank as u32,
            tp_size: tp as u32,
            page_tokens: self.side_page_tokens(side) as u32,
            order: match self.page_order {
                Order::Hnd => PageOrder::Hnd,
                Order::Nhd => PageOrder::Nhd,
            },
            kind,
        }
    }

    /// The layouts of the ranks of `side` in a run between layouts.
    pub fn rank_layouts(&self, side: Side) -> Vec<KvLayout> {
        let tp = match side {
            Side::Prefill => self.prefill_tp,
            Side::Decode => self.decode_tp,
        };
        (0..tp).map(|r| self.layout(side, tp, r)).collect()
    }

    /// The equal-TP comparison's layout: TP 1, the prefill's pages (on both sides).
    pub fn equal_layout(&self) -> KvLayout {
        self.layout(Side::Prefill, 1, 0)
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
        if self.layouts() {
            let _ = write!(
                s,
                "; TP {} -> {}, {} pages",
                self.prefill_tp,
                self.decode_tp,
                self.page_order.name().to_uppercase()
            );
            if let Some(d) = self.decode_page_tokens {
                let _ = write!(s, ", decode pages of {d} tokens");
            }
        }
        s
    }
}
