//! The bytes the prefill side sends and the decode side checks.
//!
//! A page of `W` u64 words holding page `k` of a room (its k-th page, counted from 0) in
//! KV buffer `b` reads:
//!
//! ```text
//! word 0        stamp(room, b, k)
//! word j        body(b, k) + j * G          for 1 <= j < W-1
//! word W-1      !stamp(room, b, k)
//! ```
//!
//! The stamps carry the room id, so a page left over from an earlier room, a page of
//! another room, or a page cut short (old tail) fails the check; the body depends on
//! the buffer, the page index and the word offset, so a page landing in the wrong buffer,
//! at the wrong index or shifted fails too. The body does not depend on the room, which
//! lets the prefill side write the bodies of its source pool once, before timing, and
//! only write the two stamps of each page per room (prefill compute is the GPU's job,
//! not this host's CPU). Aux rows use the same layout with `b = AUX`, `k = 0`.

//!
//! Transfers between different layouts (`--prefill-tp`, `--decode-tp`,
//! `--decode-page-tokens`) assemble a decode page from several prefill ranks' pages, head
//! by head, so their pattern is per cell: the `head_bytes` of one head of one token. The
//! cell of head `h` of token `t` (counted from the room's first token) in buffer `b`, of
//! `W` words, reads
//!
//! ```text
//! word 0        cell_stamp(room, b, t, h)
//! word j        cell_body(b, t, h) + j * G  for 1 <= j < W-1
//! word W-1      !cell_stamp(room, b, t, h)
//! ```
//!
//! wherever a rank's layout puts it ([`Cells`]). A head landing at another head's place,
//! a token at another token's, a cell of another buffer or left from an earlier room all
//! fail the stamps; a cell shifted or damaged inside fails its body.

use std::ops::Range;

use kvxfer::{KvLayout, PageOrder};

/// The buffer id used for the aux row.
pub const AUX: u32 = u32::MAX;

const G: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn key(b: u32, k: u32) -> u64 {
    ((b as u64) << 32) | k as u64
}

/// The first word of page `k` of `room` in buffer `b`.
pub fn stamp(room: u64, b: u32, k: u32) -> u64 {
    mix(room.wrapping_mul(G) ^ mix(key(b, k)))
}

fn body_base(b: u32, k: u32) -> u64 {
    mix(0x6B76_7866_6265_6E63 ^ key(b, k))
}

/// Writes the body of page `k` of buffer `b` (stamps zeroed).
pub fn fill_body(words: &mut [u64], b: u32, k: u32) {
    let base = body_base(b, k);
    let mut e = base;
    for w in words.iter_mut() {
        *w = e;
        e = e.wrapping_add(G);
    }
    words[0] = 0;
    let last = words.len() - 1;
    words[last] = 0;
}

/// The two stamp words of page `k` of `room` in buffer `b`: (first, last).
pub fn stamps(room: u64, b: u32, k: u32) -> (u64, u64) {
    let s = stamp(room, b, k);
    (s, !s)
}

/// How much of each page the decode side checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Every word.
    Full,
    /// The stamps only.
    Stamps,
}

/// Whether `--verify sample` checks the body of this page (one page in 16, chosen by a
/// hash of the room, buffer and page, so that every position gets checked over a run).
pub fn sampled(room: u64, b: u32, k: u32) -> bool {
    mix(stamp(room, b, k)) & 15 == 0
}

/// Checks page `k` of `room` in buffer `b`. On a mismatch, says where.
pub fn check(words: &[u64], room: u64, b: u32, k: u32, depth: Depth) -> Result<(), String> {
    let n = words.len();
    let (first, last) = stamps(room, b, k);
    let mut acc = (words[0] ^ first) | (words[n - 1] ^ last);
    if depth == Depth::Full {
        let base = body_base(b, k);
        let mut e = base.wrapping_add(G);
        // Branch-free so that it vectorises; the slow search below runs only on failure.
        for &w in &words[1..n - 1] {
            acc |= w ^ e;
            e = e.wrapping_add(G);
        }
    }
    if acc == 0 {
        return Ok(());
    }
    let base = body_base(b, k);
    let bad = (0..n)
        .find(|&j| {
            let want = match j {
                0 => first,
                j if j == n - 1 => last,
                j => base.wrapping_add((j as u64).wrapping_mul(G)),
            };
            words[j] != want
        })
        .unwrap_or(0);
    let what = if bad == 0 || bad == n - 1 {
        "stamp (wrong room, or stale or torn page)"
    } else {
        "body (wrong buffer, page or offset)"
    };
    Err(format!(
        "buffer {} page {k} of room {room}: word {bad} of {n} differs in its {what}",
        if b == AUX {
            "aux".to_string()
        } else {
            b.to_string()
        }
    ))
}

/// Where the cells of one page of a rank lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cells {
    /// The model heads the rank holds.
    pub heads: Range<u32>,
    pub page_tokens: u32,
    pub order: PageOrder,
    /// Words per cell (`head_dim × dtype_bytes / 8`).
    pub cell_words: usize,
}

impl Cells {
    /// The cells of a page laid out as `l`.
    pub fn of(l: &KvLayout) -> Cells {
        Cells {
            heads: l.heads(),
            page_tokens: l.page_tokens,
            order: l.order,
            cell_words: (l.head_dim * l.dtype_bytes) as usize / 8,
        }
    }

    /// Words of one page.
    pub fn page_words(&self) -> usize {
        self.page_tokens as usize * self.heads.len() * self.cell_words
    }

    /// The word where the cell of model head `head` of the token in `slot` starts.
    pub fn at(&self, slot: u32, head: u32) -> usize {
        let h = (head - self.heads.start) as usize;
        let (slot, pt, n) = (slot as usize, self.page_tokens as usize, self.heads.len());
        let cell = match self.order {
            PageOrder::Hnd => h * pt + slot,
            PageOrder::Nhd => slot * n + h,
        };
        cell * self.cell_words
    }

    /// Every cell of page `k` of a room: (word offset, token, head), the tokens below
    /// `tokens` only.
    fn each(&self, k: u32, tokens: u64) -> impl Iterator<Item = (usize, u32, u32)> + '_ {
        let first = k as u64 * self.page_tokens as u64;
        (0..self.page_tokens)
            .take_while(move |&s| first + (s as u64) < tokens)
            .flat_map(move |s| {
                self.heads
                    .clone()
                    .map(move |h| (self.at(s, h), first as u32 + s, h))
            })
    }
}

fn cell_key(b: u32, t: u32, h: u32) -> u64 {
    mix(key(b, t) ^ mix(0x6365_6C6C_0000_0000 ^ h as u64))
}

/// The first word of the cell of head `h` of token `t` of `room` in buffer `b`.
pub fn cell_stamp(room: u64, b: u32, t: u32, h: u32) -> u64 {
    mix(room.wrapping_mul(G) ^ cell_key(b, t, h))
}

fn cell_base(b: u32, t: u32, h: u32) -> u64 {
    mix(0x6B76_6365_6C6C_6264 ^ cell_key(b, t, h))
}

/// Writes the bodies of every cell of page `k` of buffer `b` (stamps zeroed).
pub fn fill_cell_bodies(page: &mut [u64], c: &Cells, b: u32, k: u32) {
    let w = c.cell_words;
    for (at, t, h) in c.each(k, u64::MAX) {
        let cell = &mut page[at..at + w];
        let mut e = cell_base(b, t, h);
        for x in cell.iter_mut() {
            *x = e;
            e = e.wrapping_add(G);
        }
        cell[0] = 0;
        cell[w - 1] = 0;
    }
}

/// Writes the stamps of `room` into every cell of page `k` of buffer `b`.
pub fn stamp_cells(page: &mut [u64], c: &Cells, room: u64, b: u32, k: u32) {
    let w = c.cell_words;
    for (at, t, h) in c.each(k, u64::MAX) {
        let s = cell_stamp(room, b, t, h);
        page[at] = s;
        page[at + w - 1] = !s;
    }
}

/// Checks the cells of the tokens below `tokens` in page `k` of `room` in buffer `b`:
/// their stamps, and with `Depth::Full` their bodies. On a mismatch, says where.
pub fn check_cells(
    page: &[u64],
    c: &Cells,
    room: u64,
    b: u32,
    k: u32,
    tokens: u64,
    depth: Depth,
) -> Result<(), String> {
    let w = c.cell_words;
    let mut acc = 0u64;
    for (at, t, h) in c.each(k, tokens) {
        let cell = &page[at..at + w];
        let s = cell_stamp(room, b, t, h);
        acc |= (cell[0] ^ s) | (cell[w - 1] ^ !s);
        if depth == Depth::Full {
            let mut e = cell_base(b, t, h).wrapping_add(G);
            for &x in &cell[1..w - 1] {
                acc |= x ^ e;
                e = e.wrapping_add(G);
            }
        }
    }
    if acc == 0 {
        return Ok(());
    }
    // The slow search, on failure only.
    for (at, t, h) in c.each(k, tokens) {
        let cell = &page[at..at + w];
        let s = cell_stamp(room, b, t, h);
        let base = cell_base(b, t, h);
        let bad = (0..w).find(|&j| {
            let want = match j {
                0 => s,
                j if j == w - 1 => !s,
                _ if depth == Depth::Stamps => return false,
                j => base.wrapping_add((j as u64).wrapping_mul(G)),
            };
            cell[j] != want
        });
        if let Some(j) = bad {
            let what = if j == 0 || j == w - 1 {
                "stamp (another room, token, head or buffer landed here, or a stale cell)"
            } else {
                "body (shifted or damaged bytes)"
            };
            return Err(format!(
                "buffer {b} page {k} of room {room}: the cell of token {t} head {h} (word {at}) \
                 differs in word {j} of {w}, its {what}"
            ));
        }
    }
    unreachable!("a difference was seen")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(room: u64, b: u32, k: u32, n: usize) -> Vec<u64> {
        let mut w = vec![0; n];
        fill_body(&mut w, b, k);
        let (f, l) = stamps(room, b, k);
        w[0] = f;
        w[n - 1] = l;
        w
    }

    #[test]
    fn a_written_page_checks_and_every_kind_of_damage_is_caught() {
        let p = page(7, 3, 11, 64);
        assert!(check(&p, 7, 3, 11, Depth::Full).is_ok());
        assert!(check(&p, 8, 3, 11, Depth::Stamps).is_err());
        assert!(check(&p, 7, 4, 11, Depth::Full).is_err());
        assert!(check(&p, 7, 3, 12, Depth::Full).is_err());
        let mut q = p.clone();
        q[30] ^= 1;
        assert!(check(&q, 7, 3, 11, Depth::Stamps).is_ok());
        let e = check(&q, 7, 3, 11, Depth::Full).unwrap_err();
        assert!(e.contains("word 30"), "{e}");
        let mut torn = p.clone();
        torn[63] = page(6, 3, 11, 64)[63];
        assert!(check(&torn, 7, 3, 11, Depth::Stamps).is_err());
    }

    fn layout(tp: u32, rank: u32, page_tokens: u32, order: PageOrder) -> KvLayout {
        KvLayout {
            kv_heads: 8,
            head_dim: 16,
            dtype_bytes: 2,
            tp_rank: rank,
            tp_size: tp,
            page_tokens,
            order,
            kind: kvxfer::KvKind::Heads,
        }
    }

    /// Source pages of `room` (buffer `b`, `pages` pages) on each prefill rank of `tp`.
    fn prefill_pages(room: u64, b: u32, tp: u32, pages: u32) -> Vec<(Cells, Vec<Vec<u64>>)> {
        (0..tp)
            .map(|r| {
                let c = Cells::of(&layout(tp, r, 16, PageOrder::Hnd));
                let pages = (0..pages)
                    .map(|k| {
                        let mut page = vec![0; c.page_words()];
                        fill_cell_bodies(&mut page, &c, b, k);
                        stamp_cells(&mut page, &c, room, b, k);
                        page
                    })
                    .collect();
                (c, pages)
            })
            .collect()
    }

    /// Decode page `j` of rank `d` (`d_tp` ranks, `d_pt`-token NHD pages) assembled cell
    /// by cell from the prefill ranks, as the engine would; `pick` chooses which
    /// (token, head) lands at each place.
    fn assemble(
        src: &[(Cells, Vec<Vec<u64>>)],
        d: &Cells,
        j: u32,
        pick: impl Fn(u32, u32) -> (u32, u32),
    ) -> Vec<u64> {
        let mut page = vec![0; d.page_words()];
        for slot in 0..d.page_tokens {
            for h in d.heads.clone() {
                let (t, from_h) = pick(j * d.page_tokens + slot, h);
                let (c, pages) = src.iter().find(|(c, _)| c.heads.contains(&from_h)).unwrap();
                let from = &pages[(t / c.page_tokens) as usize];
                let at = c.at(t % c.page_tokens, from_h);
                let to = d.at(slot, h);
                page[to..to + d.cell_words].copy_from_slice(&from[at..at + c.cell_words]);
            }
        }
        page
    }

    #[test]
    fn cells_assembled_from_several_ranks_check_and_every_kind_of_damage_is_caught() {
        let src = prefill_pages(7, 3, 4, 4);
        // Decode rank 1 of 2 (heads 4..8), 32-token NHD pages: page 1 = tokens 32..64.
        let d = Cells::of(&layout(2, 1, 32, PageOrder::Nhd));
        let check = |page: &[u64], depth| check_cells(page, &d, 7, 3, 1, 64, depth);
        let good = assemble(&src, &d, 1, |t, h| (t, h));
        check(&good, Depth::Full).unwrap();
        // A head at another head's place.
        let heads = assemble(&src, &d, 1, |t, h| (t, if h == 5 { 6 } else { h }));
        let e = check(&heads, Depth::Stamps).unwrap_err();
        assert!(e.contains("token 32 head 5") && e.contains("stamp"), "{e}");
        // A token at another token's place.
        let tokens = assemble(&src, &d, 1, |t, h| (if t == 40 { 41 } else { t }, h));
        let e = check(&tokens, Depth::Stamps).unwrap_err();
        assert!(e.contains("token 40 head 4"), "{e}");
        // A stale cell of an earlier room, a cell of another buffer, a torn cell.
        let old = prefill_pages(6, 3, 4, 4);
        let other = prefill_pages(7, 2, 4, 4);
        for (what, from) in [("stale", &old), ("buffer", &other)] {
            let mut page = good.clone();
            let at = d.at(9, 7);
            let c = &from[3].0;
            let cell = &from[3].1[2][c.at(41 - 32, 7)..][..d.cell_words];
            page[at..at + d.cell_words].copy_from_slice(cell);
            let e = check(&page, Depth::Stamps).unwrap_err();
            assert!(e.contains("token 41 head 7"), "{what}: {e}");
        }
        let mut torn = good.clone();
        let at = d.at(0, 4) + d.cell_words - 1;
        torn[at] = !cell_stamp(6, 3, 32, 4);
        assert!(check(&torn, Depth::Stamps).is_err());
        // Damage inside a body: only a full check sees it.
        let mut body = good.clone();
        body[d.at(3, 6) + 2] ^= 1 << 17;
        check(&body, Depth::Stamps).unwrap();
        let e = check(&body, Depth::Full).unwrap_err();
        assert!(e.contains("token 35 head 6") && e.contains("body"), "{e}");
        // A whole page shifted by one word.
        let mut shifted = good.clone();
        shifted.rotate_right(1);
        assert!(check(&shifted, Depth::Stamps).is_err());
    }

    #[test]
    fn cells_past_the_moved_tokens_are_not_checked() {
        let src = prefill_pages(7, 0, 2, 2);
        let d = Cells::of(&layout(1, 0, 32, PageOrder::Hnd));
        let mut page = assemble(&src, &d, 0, |t, h| (t, h));
        check_cells(&page, &d, 7, 0, 0, 32, Depth::Full).unwrap();
        for h in 0..8 {
            page[d.at(20, h)] = 0;
        }
        check_cells(&page, &d, 7, 0, 0, 20, Depth::Full).unwrap();
        let e = check_cells(&page, &d, 7, 0, 0, 21, Depth::Full).unwrap_err();
        assert!(e.contains("token 20 head 0"), "{e}");
    }

    #[test]
    fn a_cell_lies_where_each_order_puts_it() {
        let hnd = Cells::of(&layout(4, 1, 16, PageOrder::Hnd));
        let nhd = Cells::of(&layout(4, 1, 16, PageOrder::Nhd));
        // Rank 1 of 4 holds heads 2 and 3; a cell is 4 words.
        assert_eq!((hnd.heads.clone(), hnd.cell_words), (2..4, 4));
        assert_eq!(hnd.page_words(), 16 * 2 * 4);
        assert_eq!(hnd.at(5, 3), (16 + 5) * 4);
        assert_eq!(nhd.at(5, 3), (5 * 2 + 1) * 4);
    }
}
