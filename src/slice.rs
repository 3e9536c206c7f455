//! Which bytes of a prefill rank's KV pages go where in a decode rank's pages, when the
//! two sides' layouts ([`KvLayout`]) differ: other tensor-parallel sizes or ranks, page
//! sizes or page orders.
//!
//! A KV buffer's page holds `page_tokens` tokens of the heads its rank holds, head dim ×
//! dtype bytes per head and token, in one of two orders: heads-major (HND:
//! `[head][token][byte]`) or tokens-major (NHD: `[token][head][byte]`). An MLA latent is
//! one replicated "head" on every rank.
//!
//! Three questions, answered here without any I/O so that every rule can be tested on its
//! own:
//! - [`assigned`]: which heads a given prefill rank sends to a given decode rank. Every
//!   head a decode rank holds comes from exactly one prefill rank; where the prefill side
//!   replicates heads (fewer KV heads than ranks) or the latent, the replica is chosen by
//!   the decode rank so that the senders spread.
//! - [`chunk_tokens`]: which tokens of the room a chunk of source pages moves, given
//!   the page sizes of the two sides and the length of the destination; or why the chunk
//!   does not fit.
//! - [`plan`]: the byte segments (contiguous on both sides) that move those heads of
//!   those tokens, merged wherever both sides continue.

use std::ops::Range;

use crate::layout::{KvKind, KvLayout, PageOrder};

/// A rank's layout as the slicing reads it: how many ranks hold each of its heads (1
/// unless there are fewer heads than ranks; every rank for an MLA latent), the bytes of
/// one head of one token, and where a head of a token lies in a page.
trait Place {
    fn replicas(&self) -> u32;
    fn head_bytes(&self) -> u64;
    fn offset(&self, slot: u32, head: u32) -> u64;
}

impl Place for KvLayout {
    fn replicas(&self) -> u32 {
        match self.kind {
            KvKind::Latent => self.tp_size,
            KvKind::Heads if self.kv_heads >= self.tp_size => 1,
            KvKind::Heads => self.tp_size / self.kv_heads,
        }
    }

    fn head_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.dtype_bytes)
    }

    fn offset(&self, slot: u32, head: u32) -> u64 {
        let held = self.heads();
        let h = u64::from(head - held.start);
        let e = self.head_bytes();
        match self.order {
            PageOrder::Hnd => (h * u64::from(self.page_tokens) + u64::from(slot)) * e,
            PageOrder::Nhd => (u64::from(slot) * held.len() as u64 + h) * e,
        }
    }
}

/// The heads that prefill rank `p` sends to decode rank `d` (empty if none).
///
/// A head the decode rank holds is sent by the one prefill rank that holds it, or, where
/// the prefill side holds it on several ranks (replicated heads, the MLA latent), by the
/// replica whose index is the decode rank's modulo the replica count: decode ranks that
/// need the same head pull it from different prefill ranks.
pub fn assigned(p: &KvLayout, d: &KvLayout) -> Range<u32> {
    let (ph, dh) = (p.heads(), d.heads());
    let o = ph.start.max(dh.start)..ph.end.min(dh.end);
    if o.is_empty() {
        return 0..0;
    }
    let k = p.replicas();
    if k > 1 && p.tp_rank % k != d.tp_rank % k {
        return 0..0;
    }
    o
}

/// The tokens of the room that a chunk of `n_src` source pages moves, when the room's
/// earlier chunks moved `src_before` source pages and the destination has `n_dst` pages.
///
/// A chunk's tokens are its pages' slots, from `src_before × Ps`. Tokens past the end of
/// the destination are refused, except that a chunk's last source page may be partly
/// past it (a prompt's last page is partial; a chunk after that one overflows). With
/// `last` (the room's source pages end with this chunk), the room must also reach the
/// last destination page. With equal page sizes that is the rule of whole pages: a room
/// moves as many pages as its destination has.
pub fn chunk_tokens(
    src_page_tokens: u32,
    dst_page_tokens: u32,
    src_before: u64,
    n_src: u64,
    n_dst: u64,
    last: bool,
) -> Result<Range<u64>, String> {
    let (ps, pd) = (u64::from(src_page_tokens), u64::from(dst_page_tokens));
    let cap = n_dst * pd;
    let start = src_before * ps;
    let end = (src_before + n_src) * ps;
    if n_src == 0 && !last {
        // An empty chunk moves nothing, even after a page that reached past the end.
        return Ok(start.min(cap)..start.min(cap));
    }
    if end > cap {
        // Only a chunk's last source page may reach past the destination.
        let past_ok = n_src > 0 && end - ps < cap;
        if !past_ok {
            return Err(format!(
                "{} source pages of {ps} tokens hold {end} tokens; the destination's {n_dst} \
                 pages of {pd} tokens hold {cap}",
                src_before + n_src
            ));
        }
    }
    let end = end.min(cap);
    if last && end.div_ceil(pd) != n_dst {
        return Err(format!(
            "the last chunk ends at token {end}, which fills {} of the destination's {n_dst} \
             pages of {pd} tokens",
            end.div_ceil(pd)
        ));
    }
    Ok(start..end)
}

/// A run of bytes contiguous in one source page and in one destination page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    pub src_page: u32,
    pub src_off: u64,
    pub dst_page: u32,
    pub dst_off: u64,
    pub len: u64,
}

/// Appends to `out` the segments that move `heads` of `tokens` from the source pages to
/// the destination pages.
///
/// `src_pages` are the chunk's source pages (token `tokens.start` is slot 0 of
/// `src_pages[0]`, so `tokens.start` is a multiple of the source page size);
/// `dst_pages` is the room's whole destination (token `t` lands in `dst_pages[t / Pd]`).
/// `tokens` must lie within both, as [`chunk_tokens`] gives them. Segments come per
/// stretch of tokens that stays in one source page and one destination page, in token
/// order, and a segment is merged into the one before it when it continues it on both
/// sides.
pub fn plan(
    src: &KvLayout,
    dst: &KvLayout,
    heads: Range<u32>,
    tokens: Range<u64>,
    src_pages: &[u32],
    dst_pages: &[u32],
    out: &mut Vec<Segment>,
) {
    if heads.is_empty() || tokens.is_empty() {
        return;
    }
    let (ps, pd) = (u64::from(src.page_tokens), u64::from(dst.page_tokens));
    debug_assert_eq!(src.head_bytes(), dst.head_bytes());
    debug_assert_eq!(tokens.start % ps, 0);
    let e = src.head_bytes();
    let first = tokens.start;
    let mut t = tokens.start;
    while t < tokens.end {
        let (si, ss) = ((t - first) / ps, (t % ps) as u32);
        let (di, ds) = (t / pd, (t % pd) as u32);
        let n = (ps - u64::from(ss))
            .min(pd - u64::from(ds))
            .min(tokens.end - t) as u32;
        let (sp, dp) = (src_pages[si as usize], dst_pages[di as usize]);
        let mut push = |ts: u32, td: u32, h: u32, len: u64| {
            let seg = Segment {
                src_page: sp,
                src_off: src.offset(ts, h),
                dst_page: dp,
                dst_off: dst.offset(td, h),
                len,
            };
            match out.last_mut() {
                Some(l)
                    if l.src_page == sp
                        && l.dst_page == dp
                        && l.src_off + l.len == seg.src_off
                        && l.dst_off + l.len == seg.dst_off =>
                {
                    l.len += len
                }
                _ => out.push(seg),
            }
        };
        match (src.order, dst.order) {
            // Each head's tokens are contiguous on both sides.
            (PageOrder::Hnd, PageOrder::Hnd) => {
                for h in heads.clone() {
                    push(ss, ds, h, u64::from(n) * e);
                }
            }
            // Each token's heads are contiguous on both sides.
            (PageOrder::Nhd, PageOrder::Nhd) => {
                for i in 0..n {
                    push(ss + i, ds + i, heads.start, heads.len() as u64 * e);
                }
            }
            // One head of one token at a time.
            _ => {
                for i in 0..n {
                    for h in heads.clone() {
                        push(ss + i, ds + i, h, e);
                    }
                }
            }
        }
        t += u64::from(n);
    }
}

/// The bytes that prefill rank `p` owes decode rank `d` per paired buffer for a room
/// that moves `tokens` tokens: what the decode side expects from that peer.
pub fn owed_bytes(p: &KvLayout, d: &KvLayout, tokens: u64) -> u64 {
    assigned(p, d).len() as u64 * tokens * d.head_bytes()
}

/// A prefill engine's pages against a decode engine's, when their layouts differ: what
/// both sides of the pair agree on from the registration exchange.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Slicing {
    pub prefill: KvLayout,
    pub decode: KvLayout,
}

impl Slicing {
    /// The heads the prefill engine sends the decode engine.
    pub fn heads(&self) -> Range<u32> {
        assigned(&self.prefill, &self.decode)
    }

    /// The tokens a room moves whose prefill sent `src_pages` source pages in all into a
    /// destination of `dst_pages` pages, or why those do not fit ([`chunk_tokens`] over
    /// the whole room).
    pub fn room_tokens(&self, src_pages: u64, dst_pages: u64) -> Result<u64, String> {
        chunk_tokens(
            self.prefill.page_tokens,
            self.decode.page_tokens,
            0,
            src_pages,
            dst_pages,
            true,
        )
        .map(|t| t.end)
    }

    /// The KV bytes the prefill engine owes per paired buffer for a room of `tokens`.
    pub fn owed(&self, tokens: u64) -> u64 {
        owed_bytes(&self.prefill, &self.decode, tokens)
    }

    /// Whether bytes `off..off + len` of a decode page are the prefill engine's to write:
    /// inside the page, and within the heads it sends (for HND a band of the page, for
    /// NHD that band of one token, or whole tokens when it sends every head).
    pub fn allows(&self, off: u64, len: u64) -> bool {
        let d = &self.decode;
        let heads = self.heads();
        let (Some(page), false) = (d.page_bytes(), heads.is_empty() || len == 0) else {
            return false;
        };
        let Some(end) = off.checked_add(len).filter(|&e| e <= page) else {
            return false;
        };
        let held = d.heads();
        let (a, b) = (
            u64::from(heads.start - held.start),
            u64::from(heads.end - held.start),
        );
        let e = d.head_bytes();
        match d.order {
            PageOrder::Hnd => {
                let band = u64::from(d.page_tokens) * e;
                off >= a * band && end <= b * band
            }
            PageOrder::Nhd => {
                let row = held.len() as u64 * e;
                if heads == held {
                    return true;
                }
                let at = off % row;
                off / row == (end - 1) / row && at >= a * e && at + len <= b * e
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::layout::PageOrder as Order;

    /// A GQA rank's layout with 4-byte heads (head dim 2, 2-byte elements).
    fn shape(kv_heads: u32, tp_rank: u32, tp_size: u32, pt: u32, order: Order) -> KvLayout {
        KvLayout {
            kv_heads,
            head_dim: 2,
            dtype_bytes: 2,
            tp_rank,
            tp_size,
            page_tokens: pt,
            order,
            kind: KvKind::Heads,
        }
    }

    fn latent(tp_rank: u32, tp_size: u32, pt: u32) -> KvLayout {
        KvLayout {
            kv_heads: 1,
            kind: KvKind::Latent,
            ..shape(1, tp_rank, tp_size, pt, Order::Nhd)
        }
    }

    #[test]
    fn heads_replicate_on_as_many_ranks_as_there_are_ranks_per_head() {
        assert_eq!(shape(8, 1, 4, 16, Order::Hnd).replicas(), 1);
        // 2 heads on 8 ranks: ranks 0-3 hold head 0, ranks 4-7 head 1.
        assert_eq!(shape(2, 4, 8, 16, Order::Hnd).heads(), 1..2);
        assert_eq!(shape(2, 4, 8, 16, Order::Hnd).replicas(), 4);
        assert_eq!(latent(3, 4, 16).replicas(), 4);
        assert_eq!(shape(8, 1, 4, 16, Order::Hnd).head_bytes(), 4);
    }

    #[test]
    fn the_last_chunk_may_end_inside_the_destination_only_on_its_last_page() {
        // Equal pages: exactly as many as the destination has.
        assert_eq!(chunk_tokens(16, 16, 0, 4, 4, true), Ok(0..64));
        assert!(chunk_tokens(16, 16, 0, 3, 4, true)
            .unwrap_err()
            .contains("fills 3 of the destination's 4"));
        assert!(chunk_tokens(16, 16, 2, 3, 4, false)
            .unwrap_err()
            .contains("5 source pages of 16 tokens hold 80 tokens"));
        // 64-token source pages into 16-token destination pages: 100 tokens, 2 source
        // pages, 7 destination pages; the second source page is partly past the end.
        assert_eq!(chunk_tokens(64, 16, 1, 1, 7, true), Ok(64..112));
        assert_eq!(chunk_tokens(64, 16, 1, 1, 7, false), Ok(64..112));
        // A third source page would hold no token of the destination, in this chunk or
        // the next.
        assert!(chunk_tokens(64, 16, 1, 2, 7, true).is_err());
        assert!(chunk_tokens(64, 16, 2, 1, 7, false).is_err());
        // 16-token source pages into 64-token destination pages: the last destination
        // page is partly filled.
        assert_eq!(chunk_tokens(16, 64, 4, 3, 2, true), Ok(64..112));
        assert!(chunk_tokens(16, 64, 4, 0, 2, true)
            .unwrap_err()
            .contains("fills 1 of the destination's 2"));
        // An empty last chunk closes a room whose pages all arrived.
        assert_eq!(chunk_tokens(16, 16, 4, 0, 4, true), Ok(64..64));
        // An empty chunk after a page that reached past the end moves nothing; the room
        // (2 source pages of 64 into 7 of 16) fits.
        assert_eq!(chunk_tokens(64, 16, 2, 0, 7, false), Ok(112..112));
        assert_eq!(chunk_tokens(64, 16, 0, 2, 7, true), Ok(0..112));
    }

    #[test]
    fn equal_layouts_move_whole_pages() {
        let s = shape(8, 1, 4, 16, Order::Hnd);
        let mut out = Vec::new();
        plan(&s, &s, assigned(&s, &s), 0..32, &[7, 3], &[5, 6], &mut out);
        let page = 16 * 2 * 4;
        assert_eq!(
            out,
            vec![
                Segment {
                    src_page: 7,
                    src_off: 0,
                    dst_page: 5,
                    dst_off: 0,
                    len: page
                },
                Segment {
                    src_page: 3,
                    src_off: 0,
                    dst_page: 6,
                    dst_off: 0,
                    len: page
                },
            ]
        );
        let n = shape(8, 1, 4, 16, Order::Nhd);
        out.clear();
        plan(&n, &n, assigned(&n, &n), 0..16, &[7], &[5], &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len, page);
    }

    #[test]
    fn a_rank_of_the_wider_side_sends_one_run_per_page_in_hnd() {
        // Prefill TP 4 (2 heads each) into decode TP 2 (4 heads each): prefill rank 1
        // holds heads 2-3, the upper half of decode rank 0's page.
        let p = shape(8, 1, 4, 16, Order::Hnd);
        let d = shape(8, 0, 2, 16, Order::Hnd);
        assert_eq!(assigned(&p, &d), 2..4);
        assert_eq!(assigned(&p, &shape(8, 1, 2, 16, Order::Hnd)), 0..0);
        let mut out = Vec::new();
        plan(&p, &d, 2..4, 0..16, &[9], &[4], &mut out);
        assert_eq!(
            out,
            vec![Segment {
                src_page: 9,
                src_off: 0,
                dst_page: 4,
                dst_off: 2 * 16 * 4,
                len: 2 * 16 * 4
            }]
        );
        // NHD: one run per token.
        let (p, d) = (
            shape(8, 1, 4, 16, Order::Nhd),
            shape(8, 0, 2, 16, Order::Nhd),
        );
        out.clear();
        plan(&p, &d, 2..4, 0..16, &[9], &[4], &mut out);
        assert_eq!(out.len(), 16);
        assert_eq!(
            out[1],
            Segment {
                src_page: 9,
                src_off: 8,
                dst_page: 4,
                dst_off: 16 + 8,
                len: 8
            }
        );
    }

    #[test]
    fn replicas_are_chosen_by_the_decode_rank_so_the_senders_spread() {
        // 2 heads, prefill TP 8 (each head on 4 ranks), decode TP 1: head 0 from rank 0,
        // head 1 from rank 4.
        let d = shape(2, 0, 1, 16, Order::Hnd);
        let senders: Vec<_> = (0..8)
            .map(|r| assigned(&shape(2, r, 8, 16, Order::Hnd), &d))
            .collect();
        assert_eq!(senders[0], 0..1);
        assert_eq!(senders[4], 1..2);
        assert_eq!(senders.iter().filter(|h| !h.is_empty()).count(), 2);
        // MLA, prefill TP 2, decode TP 4: decode ranks 0 and 2 from prefill rank 0, 1 and
        // 3 from prefill rank 1.
        for dr in 0..4 {
            for pr in 0..2 {
                let want = if dr % 2 == pr { 0..1 } else { 0..0 };
                assert_eq!(assigned(&latent(pr, 2, 16), &latent(dr, 4, 16)), want);
            }
        }
    }

    #[test]
    fn a_decode_page_admits_only_the_bytes_of_the_heads_the_peer_sends() {
        // Decode TP 2 holds 4 of 8 heads; prefill rank 1 of TP 4 sends heads 2-3, the
        // second half of each 16-token page (HND) or of each token (NHD); 4-byte heads.
        let pair = |order| Slicing {
            prefill: shape(8, 1, 4, 16, order),
            decode: shape(8, 0, 2, 16, order),
        };
        let hnd = pair(Order::Hnd);
        assert!(hnd.allows(128, 128));
        assert!(hnd.allows(200, 56));
        assert!(!hnd.allows(127, 2));
        assert!(!hnd.allows(128, 129));
        assert!(!hnd.allows(0, 16));
        let nhd = pair(Order::Nhd);
        assert!(nhd.allows(8, 8));
        assert!(nhd.allows(16 * 15 + 8, 8));
        assert!(
            !nhd.allows(8, 16),
            "spans into the next token's first heads"
        );
        assert!(!nhd.allows(4, 8));
        assert!(!nhd.allows(16 * 16 + 8, 8), "past the page");
        // A peer that sends every head of the decode rank may write whole tokens.
        let all = Slicing {
            prefill: shape(8, 0, 1, 16, Order::Nhd),
            decode: shape(8, 0, 2, 16, Order::Nhd),
        };
        assert!(all.allows(0, 16 * 16));
        // A peer that sends nothing may write nothing.
        let none = Slicing {
            prefill: shape(8, 3, 4, 16, Order::Hnd),
            decode: shape(8, 0, 2, 16, Order::Hnd),
        };
        assert!(!none.allows(0, 1));
        assert_eq!(none.owed(100), 0);
        assert_eq!(hnd.owed(100), 2 * 100 * 4);
        assert_eq!(hnd.room_tokens(7, 7), Ok(112));
        assert!(hnd.room_tokens(6, 7).is_err());
    }

    /// The value of byte `k` of `head` of token `t` in buffer `b`.
    fn value(b: usize, t: u64, head: u32, k: u64) -> u8 {
        (b as u64 * 131 + t * 31 + u64::from(head) * 7 + k).wrapping_mul(2654435761) as u8 | 1
    }

    /// Every prefill rank sends its assigned heads of every chunk to every decode rank
    /// through `plan`, into poisoned decode pools; checks each byte of each head of each
    /// token at its decode position, written exactly once, and nothing else written.
    #[allow(clippy::too_many_arguments)]
    fn deliver(
        kv_heads: u32,
        ptp: u32,
        dtp: u32,
        pt: (u32, u32),
        order: (Order, Order),
        latent_kv: bool,
        prompt: u64,
        chunk_pages: u64,
    ) {
        let mk = |r, n, pt, o| {
            if latent_kv {
                KvLayout {
                    order: o,
                    ..latent(r, n, pt)
                }
            } else {
                shape(kv_heads, r, n, pt, o)
            }
        };
        let prefills: Vec<KvLayout> = (0..ptp).map(|r| mk(r, ptp, pt.0, order.0)).collect();
        let decodes: Vec<KvLayout> = (0..dtp).map(|r| mk(r, dtp, pt.1, order.1)).collect();
        let n_src = prompt.div_ceil(u64::from(pt.0));
        let n_dst = prompt.div_ceil(u64::from(pt.1));
        // Scattered pages: source page i is pool page 3i+1, destination page j is pool
        // page (n_dst - j) * 2, so runs cannot pass by accident.
        let src_pages: Vec<u32> = (0..n_src as u32).map(|i| 3 * i + 1).collect();
        let dst_pages: Vec<u32> = (0..n_dst as u32).map(|j| (n_dst as u32 - j) * 2).collect();
        let src_pool_pages = 3 * n_src as usize + 2;
        let dst_pool_pages = 2 * n_dst as usize + 2;
        let layers = 2usize;
        for d in &decodes {
            let dpb = d.page_bytes().unwrap() as usize;
            let mut pool = vec![vec![0u8; dpb * dst_pool_pages]; layers];
            let mut writes = vec![vec![0u8; dpb * dst_pool_pages]; layers];
            for p in &prefills {
                let spb = p.page_bytes().unwrap() as usize;
                // The prefill rank's pools, its heads at their place in each page.
                let mut src = vec![vec![0u8; spb * src_pool_pages]; layers];
                for (b, buf) in src.iter_mut().enumerate() {
                    for t in 0..n_src * u64::from(p.page_tokens) {
                        let (i, s) = (
                            t / u64::from(p.page_tokens),
                            (t % u64::from(p.page_tokens)) as u32,
                        );
                        for h in p.heads() {
                            for k in 0..p.head_bytes() {
                                let at = src_pages[i as usize] as usize * spb
                                    + (p.offset(s, h) + k) as usize;
                                buf[at] = value(b, t, h, k);
                            }
                        }
                    }
                }
                let heads = assigned(p, d);
                let pair = Slicing {
                    prefill: *p,
                    decode: *d,
                };
                let mut before = 0;
                while before < n_src {
                    let n = chunk_pages.min(n_src - before);
                    let last = before + n == n_src;
                    let tokens =
                        chunk_tokens(p.page_tokens, d.page_tokens, before, n, n_dst, last).unwrap();
                    let mut segs = Vec::new();
                    let chunk = &src_pages[before as usize..(before + n) as usize];
                    plan(p, d, heads.clone(), tokens, chunk, &dst_pages, &mut segs);
                    for s in segs {
                        assert!(pair.allows(s.dst_off, s.len), "{s:?} outside its heads");
                        for b in 0..layers {
                            let from = s.src_page as usize * spb + s.src_off as usize;
                            let to = s.dst_page as usize * dpb + s.dst_off as usize;
                            assert!(
                                s.src_off + s.len <= spb as u64 && s.dst_off + s.len <= dpb as u64
                            );
                            let len = s.len as usize;
                            pool[b][to..to + len].copy_from_slice(&src[b][from..from + len]);
                            for w in &mut writes[b][to..to + len] {
                                *w += 1;
                            }
                        }
                    }
                    before += n;
                }
            }
            // Every byte of the decode rank's heads of every token moved, once: the prompt
            // and the slots after it that both sides' last pages hold.
            let moved = (n_src * u64::from(pt.0)).min(n_dst * u64::from(pt.1));
            assert!(moved >= prompt);
            let mut expect = vec![vec![0u8; dpb * dst_pool_pages]; layers];
            for (b, buf) in expect.iter_mut().enumerate() {
                for t in 0..moved {
                    let (j, s) = (
                        t / u64::from(d.page_tokens),
                        (t % u64::from(d.page_tokens)) as u32,
                    );
                    for h in d.heads() {
                        for k in 0..d.head_bytes() {
                            let at = dst_pages[j as usize] as usize * dpb
                                + (d.offset(s, h) + k) as usize;
                            buf[at] = value(b, t, h, k);
                        }
                    }
                }
            }
            for b in 0..layers {
                for (i, (&got, &want)) in pool[b].iter().zip(&expect[b]).enumerate() {
                    let w = writes[b][i];
                    assert!(
                        (want != 0 && got == want && w == 1) || (want == 0 && got == 0 && w == 0),
                        "kv {kv_heads} tp {ptp}->{dtp} pages {pt:?} {order:?} latent {latent_kv}: \
                         decode rank {} buffer {b} byte {i}: got {got} want {want}, written {w} times",
                        d.tp_rank
                    );
                }
            }
            // What the decode side expects from the peers is what they sent.
            let owed: u64 = prefills.iter().map(|p| owed_bytes(p, d, moved)).sum();
            let total: u64 = writes[0].iter().map(|&w| u64::from(w)).sum();
            assert_eq!(owed, total, "owed bytes differ from the bytes sent");
            assert_eq!(total, moved * d.heads().len() as u64 * d.head_bytes());
        }
    }

    #[test]
    fn every_head_of_every_token_lands_once_for_every_tp_pair() {
        for kv in [8, 2] {
            for (p, d) in [(1, 1), (2, 1), (4, 2), (8, 2), (1, 2), (2, 4), (2, 8)] {
                for order in [(Order::Hnd, Order::Hnd), (Order::Nhd, Order::Nhd)] {
                    deliver(kv, p, d, (16, 16), order, false, 100, 3);
                }
            }
        }
    }

    #[test]
    fn pages_of_different_sizes_and_orders_land_at_their_token_positions() {
        for pt in [(16, 64), (64, 16), (16, 16), (32, 16)] {
            for order in [
                (Order::Hnd, Order::Hnd),
                (Order::Nhd, Order::Nhd),
                (Order::Hnd, Order::Nhd),
                (Order::Nhd, Order::Hnd),
            ] {
                for (p, d) in [(4, 2), (2, 4), (1, 1)] {
                    deliver(8, p, d, pt, order, false, 100, 2);
                    deliver(2, p, d, pt, order, false, 77, 1);
                }
            }
        }
    }

    #[test]
    fn the_latent_reaches_each_decode_rank_from_one_prefill_rank() {
        for (p, d) in [(4, 2), (2, 4), (1, 8), (8, 1)] {
            for pt in [(16, 16), (16, 64), (64, 16)] {
                deliver(1, p, d, pt, (Order::Nhd, Order::Nhd), true, 90, 2);
            }
        }
    }
}
