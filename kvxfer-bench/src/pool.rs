//! One side's registered memory: every KV buffer (and the aux buffer) cut into slots of
//! `max_pages` pages, one slot per room in flight. Page `k` of the room in slot `s` is
//! page `s * max_pages + k` of every buffer (scattered inside the slot on the decode side
//! with `--dst-order shuffled`).

use kvxfer::{BufferDesc, Engine};

use crate::args::{DstOrder, Params};
use crate::pattern::{self, mix};
use crate::sys::{self, Pages, Region};

pub struct Pool {
    pub kv: Vec<Region>,
    pub aux: Option<Region>,
    pub item_len: usize,
    pub aux_len: usize,
    pub slot_pages: usize,
    pub slots: usize,
    /// Page order inside a slot (identity when contiguous).
    perm: Vec<u32>,
    /// Share of the pool's bytes the kernel backed with huge pages, where it says.
    pub huge_fraction: Option<f64>,
}

impl Pool {
    /// Bytes a pool of `slots` slots registers.
    pub fn bytes(p: &Params, slots: usize) -> u64 {
        (slots * p.max_pages()) as u64 * p.page_bytes() + (slots * p.aux_bytes) as u64
    }

    pub fn new(p: &Params, slots: usize, order: DstOrder) -> Pool {
        let item_len = p.item_len();
        let slot_pages = p.max_pages();
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
        Pool {
            kv,
            aux,
            item_len,
            aux_len: p.aux_bytes,
            slot_pages,
            slots,
            perm,
            huge_fraction,
        }
    }

    pub fn register(&self, e: &Engine) -> Result<(), String> {
        e.register_kv(
            self.kv
                .iter()
                .map(|r| BufferDesc {
                    base: r.addr(),
                    len: r.len(),
                    item_len: self.item_len,
                })
                .collect(),
        )
        .map_err(|e| format!("register_kv: {e}"))?;
        if let Some(a) = &self.aux {
            e.register_aux(vec![BufferDesc {
                base: a.addr(),
                len: a.len(),
                item_len: self.aux_len,
            }])
            .map_err(|e| format!("register_aux: {e}"))?;
        }
        Ok(())
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
                    pattern::fill_body(words, b as u32, k as u32);
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

    /// Decode side, after SUCCESS: checks the first `n` pages of `slot` and its aux row
    /// against `room`'s pattern. Returns the KV bytes checked.
    pub fn verify(
        &self,
        slot: usize,
        n: usize,
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
                pattern::check(words, room, b as u32, k as u32, depth)?;
                if depth == pattern::Depth::Full {
                    checked += self.item_len as u64;
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
