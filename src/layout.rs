//! How an engine's KV pages are laid out: which of the model's KV heads this rank holds,
//! how wide a head is, how many tokens a page holds and in which order. An engine that
//! registers its KV buffers with a layout (`kvxfer_register_kv_layout`) tells its peers
//! at the registration exchange, which refuses layouts that cannot meet
//! (`control::pairing`). Without a layout, buffers are copied byte for byte and must be
//! laid out alike on both sides.

use std::fmt;
use std::ops::Range;

/// The order of one page's elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageOrder {
    /// Heads-major: a page is `[head][token][dim]`.
    Hnd,
    /// Tokens-major: a page is `[token][head][dim]`.
    Nhd,
}

impl PageOrder {
    /// Total conversion from the C and wire value (`0` = HND, `1` = NHD).
    pub fn from_value(v: u32) -> Option<PageOrder> {
        match v {
            0 => Some(PageOrder::Hnd),
            1 => Some(PageOrder::Nhd),
            _ => None,
        }
    }

    /// The C and wire value.
    pub fn value(self) -> u32 {
        match self {
            PageOrder::Hnd => 0,
            PageOrder::Nhd => 1,
        }
    }
}

impl fmt::Display for PageOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageOrder::Hnd => "HND",
            PageOrder::Nhd => "NHD",
        })
    }
}

/// What the KV buffers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvKind {
    /// MHA/GQA: K or V buffers, each rank holding a slice of the model's KV heads (or a
    /// replica of one head when the model has fewer KV heads than ranks).
    Heads,
    /// MLA: one latent per token (`kv_heads` 1, `head_dim` its width), the whole of it
    /// replicated on every rank.
    Latent,
}

impl KvKind {
    /// Total conversion from the C and wire value (`0` = heads, `1` = latent).
    pub fn from_value(v: u32) -> Option<KvKind> {
        match v {
            0 => Some(KvKind::Heads),
            1 => Some(KvKind::Latent),
            _ => None,
        }
    }

    /// The C and wire value.
    pub fn value(self) -> u32 {
        match self {
            KvKind::Heads => 0,
            KvKind::Latent => 1,
        }
    }
}

impl fmt::Display for KvKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvKind::Heads => "MHA/GQA heads",
            KvKind::Latent => "MLA (latent)",
        })
    }
}

/// The layout of one engine's KV pages: the model's (`kv_heads`, `head_dim`,
/// `dtype_bytes`, `kind`), this rank's place among its tensor-parallel ranks (`tp_rank`,
/// `tp_size`) and its pages (`page_tokens`, `order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// KV heads of the whole model (not per rank); 1 for a latent.
    pub kv_heads: u32,
    /// Elements per head (for a latent, its width, e.g. 576).
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// This engine's tensor-parallel rank, below `tp_size`.
    pub tp_rank: u32,
    /// Tensor-parallel ranks of this side.
    pub tp_size: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// The order of a page's elements.
    pub order: PageOrder,
    /// K/V heads or a latent.
    pub kind: KvKind,
}

/// Why a [`KvLayout`] is invalid. It allocates nothing (the codec makes one from any
/// peer's bytes); `Display` names the field and its value, [`LayoutError::field`] the
/// field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutError {
    /// A field that must be at least 1 is 0.
    Zero {
        /// The field.
        field: &'static str,
    },
    /// `tp_rank >= tp_size`.
    RankNotBelowSize { tp_rank: u32, tp_size: u32 },
    /// Heads: at least as many heads as ranks, but not a multiple of them.
    HeadsNotMultipleOfRanks { kv_heads: u32, tp_size: u32 },
    /// Heads: fewer heads than ranks, and the ranks not a multiple of them.
    RanksNotMultipleOfHeads { tp_size: u32, kv_heads: u32 },
    /// A latent with `kv_heads` other than 1.
    LatentNotOneHead { kv_heads: u32 },
    /// `page_tokens × heads × head_dim × dtype_bytes` overflows a u64.
    PageBytesOverflow {
        page_tokens: u32,
        heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
    },
}

impl LayoutError {
    /// The field at fault, such as `"tp_rank"`.
    pub fn field(&self) -> &'static str {
        match self {
            LayoutError::Zero { field } => field,
            LayoutError::RankNotBelowSize { .. } => "tp_rank",
            LayoutError::HeadsNotMultipleOfRanks { .. } => "kv_heads",
            LayoutError::RanksNotMultipleOfHeads { .. } => "tp_size",
            LayoutError::LatentNotOneHead { .. } => "kv_heads",
            LayoutError::PageBytesOverflow { .. } => "page_tokens",
        }
    }
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LayoutError::Zero { field } => write!(f, "{field} is 0; it must be at least 1"),
            LayoutError::RankNotBelowSize { tp_rank, tp_size } => {
                write!(f, "tp_rank {tp_rank} is not below tp_size {tp_size}")
            }
            LayoutError::HeadsNotMultipleOfRanks { kv_heads, tp_size } => write!(
                f,
                "kv_heads {kv_heads} is not a multiple of tp_size {tp_size}: each rank must \
                 hold as many heads"
            ),
            LayoutError::RanksNotMultipleOfHeads { tp_size, kv_heads } => write!(
                f,
                "tp_size {tp_size} is not a multiple of kv_heads {kv_heads}: with fewer heads \
                 than ranks each head is replicated on tp_size / kv_heads ranks"
            ),
            LayoutError::LatentNotOneHead { kv_heads } => write!(
                f,
                "kv_heads {kv_heads} with kind latent (MLA): the latent is one head, \
                 replicated on every rank, so kv_heads must be 1"
            ),
            LayoutError::PageBytesOverflow {
                page_tokens,
                heads,
                head_dim,
                dtype_bytes,
            } => write!(
                f,
                "page_tokens {page_tokens} x {heads} heads x head_dim {head_dim} x dtype_bytes \
                 {dtype_bytes} bytes per page overflow a u64"
            ),
        }
    }
}

impl std::error::Error for LayoutError {}

impl KvLayout {
    /// Checks the layout on its own: every field nonzero; `tp_rank` below `tp_size`;
    /// with heads, `kv_heads` a multiple of `tp_size` (each rank holds as many) or, with
    /// fewer heads than ranks, `tp_size` a multiple of `kv_heads` (each head replicated on
    /// as many ranks); a latent has `kv_heads` 1; a page's bytes fit in a u64.
    pub fn check(&self) -> Result<(), LayoutError> {
        for (field, v) in [
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("tp_size", self.tp_size),
            ("page_tokens", self.page_tokens),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { field });
            }
        }
        let (kv_heads, tp_size) = (self.kv_heads, self.tp_size);
        if self.tp_rank >= tp_size {
            return Err(LayoutError::RankNotBelowSize {
                tp_rank: self.tp_rank,
                tp_size,
            });
        }
        match self.kind {
            KvKind::Latent if kv_heads != 1 => {
                return Err(LayoutError::LatentNotOneHead { kv_heads });
            }
            KvKind::Heads if kv_heads >= tp_size && kv_heads % tp_size != 0 => {
                return Err(LayoutError::HeadsNotMultipleOfRanks { kv_heads, tp_size });
            }
            KvKind::Heads if kv_heads < tp_size && tp_size % kv_heads != 0 => {
                return Err(LayoutError::RanksNotMultipleOfHeads { tp_size, kv_heads });
            }
            _ => {}
        }
        if self.page_bytes().is_none() {
            return Err(LayoutError::PageBytesOverflow {
                page_tokens: self.page_tokens,
                heads: self.heads().len() as u32,
                head_dim: self.head_dim,
                dtype_bytes: self.dtype_bytes,
            });
        }
        Ok(())
    }

    /// The model heads this rank holds: with at least as many heads as ranks, its
    /// `kv_heads / tp_size` consecutive heads; with fewer, the one head it replicates
    /// (`tp_rank / (tp_size / kv_heads)`); for a latent, `0..1`. Meaningful only for a
    /// layout that passed [`KvLayout::check`] (an unchecked one gives an empty range
    /// rather than divide by zero).
    pub fn heads(&self) -> Range<u32> {
        let (h, tp, r) = (self.kv_heads, self.tp_size, self.tp_rank);
        match self.kind {
            KvKind::Latent => 0..1,
            _ if h == 0 || tp == 0 => 0..0,
            KvKind::Heads if h >= tp => {
                let per = h / tp;
                r.saturating_mul(per)..(r.saturating_add(1)).saturating_mul(per)
            }
            KvKind::Heads => {
                let head = r / (tp / h);
                head..head + 1
            }
        }
    }

    /// Bytes of one page of one buffer: `page_tokens × heads().len() × head_dim ×
    /// dtype_bytes`; `None` if that overflows a u64.
    pub fn page_bytes(&self) -> Option<u64> {
        u64::from(self.page_tokens)
            .checked_mul(u64::from(self.heads().len() as u32))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.dtype_bytes))
    }

    /// The product behind [`KvLayout::page_bytes`], for messages: `"page_tokens 16 x 2
    /// heads x head_dim 128 x dtype_bytes 2"`.
    pub fn page_bytes_product(&self) -> String {
        format!(
            "page_tokens {} x {} heads x head_dim {} x dtype_bytes {}",
            self.page_tokens,
            self.heads().len(),
            self.head_dim,
            self.dtype_bytes
        )
    }
}

impl fmt::Display for KvLayout {
    /// One line naming every field: `"MHA/GQA heads: kv_heads 8, head_dim 128,
    /// dtype_bytes 2, tp 4 rank 1 (heads 2..4), page_tokens 16, HND"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let heads = self.heads();
        write!(
            f,
            "{}: kv_heads {}, head_dim {}, dtype_bytes {}, tp {} rank {} (heads {}..{}), \
             page_tokens {}, {}",
            self.kind,
            self.kv_heads,
            self.head_dim,
            self.dtype_bytes,
            self.tp_size,
            self.tp_rank,
            heads.start,
            heads.end,
            self.page_tokens,
            self.order
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// GQA with 8 KV heads of 128 fp16 elements, 16-token HND pages, rank `rank` of `tp`.
    pub(crate) fn gqa(tp: u32, rank: u32) -> KvLayout {
        KvLayout {
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            tp_rank: rank,
            tp_size: tp,
            page_tokens: 16,
            order: PageOrder::Hnd,
            kind: KvKind::Heads,
        }
    }

    pub(crate) fn mla(tp: u32, rank: u32) -> KvLayout {
        KvLayout {
            kv_heads: 1,
            head_dim: 576,
            kind: KvKind::Latent,
            ..gqa(tp, rank)
        }
    }

    fn err(l: KvLayout) -> LayoutError {
        l.check().unwrap_err()
    }

    #[test]
    fn every_zero_field_is_refused_by_name() {
        let ok = gqa(4, 1);
        ok.check().unwrap();
        let cases: [(&str, KvLayout); 5] = [
            ("kv_heads", KvLayout { kv_heads: 0, ..ok }),
            ("head_dim", KvLayout { head_dim: 0, ..ok }),
            (
                "dtype_bytes",
                KvLayout {
                    dtype_bytes: 0,
                    ..ok
                },
            ),
            ("tp_size", KvLayout { tp_size: 0, ..ok }),
            (
                "page_tokens",
                KvLayout {
                    page_tokens: 0,
                    ..ok
                },
            ),
        ];
        for (field, l) in cases {
            let e = err(l);
            assert_eq!(e.field(), field);
            assert_eq!(
                e.to_string(),
                format!("{field} is 0; it must be at least 1")
            );
        }
    }

    #[test]
    fn the_rank_must_be_below_the_size() {
        let e = err(gqa(4, 4));
        assert_eq!(e.field(), "tp_rank");
        assert!(
            e.to_string().contains("tp_rank 4 is not below tp_size 4"),
            "{e}"
        );
        gqa(4, 3).check().unwrap();
    }

    #[test]
    fn heads_must_divide_among_the_ranks_or_the_ranks_among_the_heads() {
        // 8 heads over 3 ranks: neither divides.
        let e = err(gqa(3, 0));
        assert_eq!(e.field(), "kv_heads");
        assert!(
            e.to_string()
                .contains("kv_heads 8 is not a multiple of tp_size 3"),
            "{e}"
        );
        let six = |tp| KvLayout {
            kv_heads: 6,
            ..gqa(tp, 0)
        };
        let e = err(six(4));
        assert_eq!(e.field(), "kv_heads");
        assert!(
            e.to_string()
                .contains("kv_heads 6 is not a multiple of tp_size 4"),
            "{e}"
        );
        six(3).check().unwrap();
        six(12).check().unwrap();
        let e = err(six(8));
        assert!(
            e.to_string()
                .contains("tp_size 8 is not a multiple of kv_heads 6"),
            "{e}"
        );
        for tp in [1, 2, 4, 8, 16] {
            gqa(tp, tp - 1).check().unwrap();
        }
    }

    #[test]
    fn a_latent_is_one_head() {
        mla(4, 3).check().unwrap();
        let e = err(KvLayout {
            kv_heads: 2,
            ..mla(4, 0)
        });
        assert_eq!(e.field(), "kv_heads");
        assert!(e.to_string().contains("kv_heads 2 with kind latent"), "{e}");
        // With heads, one head over many ranks is replication, not an error.
        KvLayout {
            kv_heads: 1,
            ..gqa(4, 2)
        }
        .check()
        .unwrap();
    }

    #[test]
    fn a_page_that_overflows_a_u64_is_refused() {
        let huge = KvLayout {
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            dtype_bytes: u32::MAX,
            page_tokens: u32::MAX,
            ..gqa(1, 0)
        };
        assert_eq!(huge.page_bytes(), None);
        let e = err(huge);
        assert_eq!(e.field(), "page_tokens");
        assert!(e.to_string().contains("overflow a u64"), "{e}");
    }

    #[test]
    fn each_rank_holds_its_slice_of_the_heads() {
        assert_eq!(gqa(1, 0).heads(), 0..8);
        assert_eq!(gqa(2, 1).heads(), 4..8);
        assert_eq!(gqa(4, 0).heads(), 0..2);
        assert_eq!(gqa(4, 3).heads(), 6..8);
        assert_eq!(gqa(8, 5).heads(), 5..6);
    }

    #[test]
    fn with_fewer_heads_than_ranks_each_rank_replicates_one_head() {
        // 2 heads over 8 ranks: ranks 0..4 hold head 0, ranks 4..8 head 1.
        let two = |rank| KvLayout {
            kv_heads: 2,
            ..gqa(8, rank)
        };
        let held: Vec<Range<u32>> = (0..8).map(|r| two(r).heads()).collect();
        assert_eq!(held, [0..1, 0..1, 0..1, 0..1, 1..2, 1..2, 1..2, 1..2]);
    }

    #[test]
    fn a_latent_is_held_whole_by_every_rank() {
        for rank in 0..4 {
            assert_eq!(mla(4, rank).heads(), 0..1);
        }
    }

    #[test]
    fn page_bytes_is_tokens_times_own_heads_times_dim_times_dtype() {
        assert_eq!(gqa(1, 0).page_bytes(), Some(16 * 8 * 128 * 2));
        assert_eq!(gqa(4, 2).page_bytes(), Some(16 * 2 * 128 * 2));
        let two = KvLayout {
            kv_heads: 2,
            ..gqa(8, 7)
        };
        assert_eq!(two.page_bytes(), Some(16 * 128 * 2));
        assert_eq!(mla(8, 3).page_bytes(), Some(16 * 576 * 2));
        assert_eq!(
            gqa(4, 2).page_bytes_product(),
            "page_tokens 16 x 2 heads x head_dim 128 x dtype_bytes 2"
        );
    }

    #[test]
    fn enum_values_convert_both_ways_and_unknown_values_are_none() {
        for o in [PageOrder::Hnd, PageOrder::Nhd] {
            assert_eq!(PageOrder::from_value(o.value()), Some(o));
        }
        for k in [KvKind::Heads, KvKind::Latent] {
            assert_eq!(KvKind::from_value(k.value()), Some(k));
        }
        assert_eq!(PageOrder::from_value(2), None);
        assert_eq!(KvKind::from_value(u32::MAX), None);
    }

    #[test]
    fn display_names_every_field() {
        assert_eq!(
            gqa(4, 1).to_string(),
            "MHA/GQA heads: kv_heads 8, head_dim 128, dtype_bytes 2, tp 4 rank 1 (heads 2..4), \
             page_tokens 16, HND"
        );
        let m = KvLayout {
            order: PageOrder::Nhd,
            ..mla(2, 0)
        };
        assert!(
            m.to_string()
                .starts_with("MLA (latent): kv_heads 1, head_dim 576"),
            "{m}"
        );
        assert!(m.to_string().ends_with("NHD"), "{m}");
    }
}
