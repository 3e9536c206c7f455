//! One side's registered memory: every KV buffer (and the aux buffer) cut into slots of
//! `max_pages` pages, one slot per room in flight. Page `k` of the room in slot `s` is
//! page `s * max_pages + k` of every buffer (scattered inside the slot on the decode side
//! with `--dst-order shuffled`).
//!
//! A rank's pool in a transfer between layouts has that rank's layout ([`KvLayout`]):
//! its pages hold its heads of `page_tokens` tokens, in the per-head pattern
//! ([`pattern::Cells`]).

use kvxfer::{BufferDesc, Engine, KvLayout};

use crate::args::DstOrder;
use crate::params::Params;
use crate::pattern::{self, mix, Cells};
use crate::sys::{self, Pages, Region};

pub struct Pool {
    pub kv: Vec<Region>,
    pub aux: Option<Region>,
    pub item_len: usize,
    pub aux_len: usize,
    pub slot_pages: usize,
    pub slots: usize,
    /// Tokens per page.
    pub page_tokens: usize,
    /// The rank's layout, registered with `register_kv_layout` (None: `register_kv` and
    /// the per-page pattern).
    pub layout: Option<KvLayout>,
    cells: Option<Cells>,
    /// Page order inside a slot (identity when contiguous).
    perm: Vec<u32>,
    /// Share of the pool's bytes the kernel backed with huge pages, where it says.
    pub huge_fraction: Option<f64>,
}

impl Pool {
    /// Bytes a pool of `slots` slots with `layout` (or the plain one) registers.
    pub fn bytes(p: &Params, slots: usize, layout: Option<&KvLayout>) -> u64 {
        let (item_len, slot_pages) = Pool::geometry(p, layout);
        (slots * slot_pages * item_len * p.n_buffers() + slots * p.aux_bytes) as u64
    }

    /// Bytes per page of one buffer, and pages per slot.
    fn geometry(p: &Params, layout: Option<&KvLayout>) -> (usize, usize) {
        match layout {
            None => (p.item_len(), p.max_pages()),
            Some(l) => (
                l.page_bytes().expect("a checked layout") as usize,
                p.prompt_max.div_ceil(l.page_tokens as usize),
            ),
        }
    }

    /// A pool with the plain layout (`register_kv`, the per-page pattern).
    pub fn new(p: &Params, slots: usize, order: DstOrder) -> Pool {
        Pool::with_layout(p, slots, order, None)
    }

    /// A pool with `layout` (or the plain one).
    pub fn with_layout(
        p: &Params,
        slots: usize,
        order: DstOrder,
        layout: Option<KvLayout>,
    ) -> Pool {
        let (item_len, slot_pages) = Pool::geometry(p, layout.as_ref());
        let huge_before = sys::huge_bytes();
        let kv: Vec<Region> = (0..p.n_buffers())
            .map(|_| Region::new(slots * slot_pages * item_len, p.pool_pages))
            .collect();
        let aux = (p.aux_bytes > 0).then(|| Region::new(slots * p.aux_bytes, p.pool_pages));
        let total = kv
            .iter()
            .chain(&aux)
            .map(|r| r.mapped() as u64)
            .sum::<u64>();
        let huge_fraction = match (huge_before, sys::huge_bytes()) {
            (Some(b), Some(a)) => Some(a.saturating_sub(b) as f64 / total as f64),
            _ => None,
        };
        if p.pool_pages == Pages::Huge && huge_fraction.is_some_and(|f| f < 0.9) {
            eprintln!(
                "kvxfer-bench: only {:.0}% of the pool is on huge pages (transparent huge \
                 pages off, or memory too fragmented); figures will be lower",
                huge_fraction.unwrap_or(0.0) * 100.0
            );
        }
        let mut perm: Vec<u32> = (0..slot_pages as u32).collect();
        if order == DstOrder::Shuffled {
            for i in (1..perm.len()).rev() {
                let j = (mix(p.seed ^ i as u64) % (i as u64 + 1)) as usize;
                perm.swap(i, j);
            }
        }
        let cells = layout.as_ref().map(Cells::of);
        debug_assert!(cells
            .as_ref()
            .is_none_or(|c| c.page_words() * 8 == item_len));
        Pool {
            kv,
            aux,
            item_len,
            aux_len: p.aux_bytes,
            slot_pages,
            slots,
            page_tokens: layout.map_or(p.page_tokens, |l| l.page_tokens as usize),
            cells,
            layout,
            perm,
            huge_fraction,
        }
    }

    pub fn register(&self, e: &Engine) -> Result<(), String> {
        let bufs = self
            .kv
            .iter()
            .map(|r| BufferDesc::host(r.addr(), r.len(), self.item_len))
            .collect();
        match self.layout {
            None => e
                .register_kv(bufs)
                .map_err(|e| format!("register_kv: {e}"))?,
            Some(l) => e
                .register_kv_layout(bufs, None, l)
                .map_err(|e| format!("register_kv_layout ({l}): {e}"))?,
        }
        if let Some(a) = &self.aux {
            e.register_aux(vec![BufferDesc::host(a.addr(), a.len(), self.aux_len)])
                .map_err(|e| format!("register_aux: {e}"))?;
        }
        Ok(())
    }

    /// Pages of a prompt of `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }

    /// KV bytes a room of `tokens` tokens delivered into this pool (decode side): whole
    /// pages with the plain layout, this rank's heads of every token moved with one.
    pub fn room_bytes(&self, pages: usize, tokens: u64) -> u64 {
        let per_buffer = match &self.cells {
            None => (pages * self.item_len) as u64,
            Some(c) => tokens * (c.heads.len() * c.cell_words * 8) as u64,
        };
        per_buffer * self.kv.len() as u64
    }

    /// The engine page index of page `k` of the room in `slot`.
    pub fn page(&self, slot: usize, k: usize) -> u32 {
        (slot * self.slot_pages) as u32 + self.perm[k]
    }

    /// The engine page indices of the first `n` pages of `slot`.
    pub fn pages(&self, slot: usize, n: usize) -> Vec<u32> {
        (0..n).map(|k| self.page(slot, k)).collect()
    }

    fn words(&self) -> usize {
        self.item_len / 8
    }

    /// Prefill side, before timing: the body of every page of every slot.
    pub fn fill_bodies(&self) {
        let w = self.words();
        for (b, r) in self.kv.iter().enumerate() {
            for slot in 0..self.slots {
                for k in 0..self.slot_pages {
                    let off = self.page(slot, k) as usize * self.item_len;
                    // SAFETY: nothing is registered with a peer yet.
                    let words = unsafe { r.words_mut(off, w) };
                    match &self.cells {
                        None => pattern::fill_body(words, b as u32, k as u32),
                        Some(c) => pattern::fill_cell_bodies(words, c, b as u32, k as u32),
                    }
                }
            }
        }
        if let Some(a) = &self.aux {
            for slot in 0..self.slots {
                // SAFETY: as above.
                let words = unsafe { a.words_mut(slot * self.aux_len, self.aux_len / 8) };
                pattern::fill_body(words, pattern::AUX, 0);
            }
        }
    }

    /// Prefill side: writes the stamps of `room` into the first `n` pages of `slot` and
    /// its aux row.
    ///
    /// The slot must belong to no live room of this engine (see the prefill loop for a
    /// failed room's slot).
    pub fn stamp(&self, slot: usize, n: usize, room: u64) {
        let w = self.words();
        for (b, r) in self.kv.iter().enumerate() {
            for k in 0..n {
                let off = self.page(slot, k) as usize * self.item_len;
                if let Some(c) = &self.cells {
                    // SAFETY: the slot is ours (see above): no engine thread reads it
                    // for a live room.
                    let words = unsafe { r.words_mut(off, w) };
                    pattern::stamp_cells(words, c, room, b as u32, k as u32);
                    continue;
                }
                let (first, last) = pattern::stamps(room, b as u32, k as u32);
                // SAFETY: the slot is ours (see above): no engine thread reads it for a
                // live room.
                unsafe {
                    r.words_mut(off, 1)[0] = first;
                    r.words_mut(off + (w - 1) * 8, 1)[0] = last;
                }
            }
        }
        if let Some(a) = &self.aux {
            let (first, last) = pattern::stamps(room, pattern::AUX, 0);
            let off = slot * self.aux_len;
            // SAFETY: as above.
            unsafe {
                a.words_mut(off, 1)[0] = first;
                a.words_mut(off + self.aux_len - 8, 1)[0] = last;
            }
        }
    }

    /// Decode side, after SUCCESS: checks the first `n` pages of `slot` (with a layout:
    /// the cells of the first `tokens` tokens) and its aux row against `room`'s pattern.
    /// Returns the KV bytes checked word by word.
    pub fn verify(
        &self,
        slot: usize,
        n: usize,
        tokens: u64,
        room: u64,
        verify: crate::args::Verify,
    ) -> Result<u64, String> {
        use crate::args::Verify;
        if verify == Verify::None {
            return Ok(0);
        }
        let w = self.words();
        let mut checked = 0u64;
        for (b, r) in self.kv.iter().enumerate() {
            for k in 0..n {
                let depth = match verify {
                    Verify::Full => pattern::Depth::Full,
                    Verify::Sample if pattern::sampled(room, b as u32, k as u32) => {
                        pattern::Depth::Full
                    }
                    Verify::Sample | Verify::None => pattern::Depth::Stamps,
                };
                let off = self.page(slot, k) as usize * self.item_len;
                // SAFETY: the room is SUCCESS (and cleared): the engine writes no more
                // into its pages, and the slot is not reused before this returns.
                let words = unsafe { r.words(off, w) };
                let (b, k) = (b as u32, k as u32);
                match &self.cells {
                    None => pattern::check(words, room, b, k, depth)?,
                    Some(c) => pattern::check_cells(words, c, room, b, k, tokens, depth)?,
                }
                if depth == pattern::Depth::Full {
                    checked += match &self.cells {
                        None => self.item_len as u64,
                        Some(c) => {
                            let first = k as u64 * self.page_tokens as u64;
                            let held = tokens.saturating_sub(first).min(self.page_tokens as u64);
                            held * (c.heads.len() * c.cell_words * 8) as u64
                        }
                    };
                }
            }
        }
        if let Some(a) = &self.aux {
            // SAFETY: as above.
            let words = unsafe { a.words(slot * self.aux_len, self.aux_len / 8) };
            pattern::check(words, room, pattern::AUX, 0, pattern::Depth::Full)?;
        }
        Ok(checked)
    }
}
