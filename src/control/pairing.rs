//! Which of a prefill engine's buffers fills which of a decode engine's, and whether
//! their layouts can meet.
//!
//! Buffers pair by position when neither side gives layer ids, and by layer id when both
//! do (several buffers of one layer, such as K and V, pair in the order registered). A
//! pipeline stage registers only its layers; the decode room is complete only when its
//! prefill engines together deliver every decode buffer exactly once.
//!
//! Layouts ([`KvLayout`], `kvxfer_register_kv_layout`): both sides register one or
//! neither. Without, paired buffers are copied byte for byte and must have one
//! `item_len`. With, the model must be the same on both sides (kind, `kv_heads`,
//! `head_dim`, `dtype_bytes`) and one side's `page_tokens` must divide the other's; the
//! `item_len`s may then differ (each side checked its own against its layout when it
//! registered). Layouts equal in every field copy pages byte for byte; any other pair
//! moves head slices and tokens through a [`Slicing`] (`crate::slice`).

use crate::layout::KvLayout;
use crate::proto::{BufferInfo, Registration};
use crate::slice::Slicing;
use std::ops::Range;

/// The layouts of a pair of engines, each side's if it registered one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Layouts {
    pub decode: Option<KvLayout>,
    pub prefill: Option<KvLayout>,
}

/// What the registration exchange agreed between a decode and a prefill engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pairing {
    /// For each prefill kv buffer, the decode kv buffer it fills.
    pub map: Vec<u32>,
    /// Both sides' layouts (both `None`: a byte copy of paired buffers).
    pub layouts: Layouts,
}

impl Pairing {
    /// How the prefill's pages map into the decode's when both registered layouts and
    /// they differ (head slices, other page sizes or orders); `None` for a byte copy of
    /// whole pages.
    pub fn slicing(&self) -> Option<Slicing> {
        match self.layouts {
            Layouts {
                decode: Some(decode),
                prefill: Some(prefill),
            } if decode != prefill => Some(Slicing { prefill, decode }),
            _ => None,
        }
    }
}

/// Pairs a decode engine's registration with a prefill engine's: their layouts must meet
/// (see the module documentation), and their kv buffers
/// must pair. Or why they cannot, naming the field and both values, decode's first.
pub(crate) fn pair_kv(decode: &Registration, prefill: &Registration) -> Result<Pairing, String> {
    let layouts = Layouts {
        decode: decode.layout,
        prefill: prefill.layout,
    };
    check_layouts(&layouts)?;
    // With layouts, each side's item_len is its own layout's page size.
    let map = pair_buffers(&decode.kv, &prefill.kv, layouts.decode.is_none())?;
    Ok(Pairing { map, layouts })
}

/// Whether two layouts can meet: both or neither registered; with both, the same model
/// (kind, `kv_heads`, `head_dim`, `dtype_bytes`) and page sizes of which one divides the
/// other.
fn check_layouts(l: &Layouts) -> Result<(), String> {
    let (d, p) = match (&l.decode, &l.prefill) {
        (None, None) => return Ok(()),
        (Some(d), Some(p)) => (d, p),
        (d, p) => {
            let (none, other, layout) = match (d, p) {
                (Some(d), _) => ("prefill", "decode", d),
                (_, Some(p)) => ("decode", "prefill", p),
                _ => unreachable!("one side has a layout"),
            };
            return Err(format!(
                "{none} engine registered no kv layout; {other} did ({layout}): a byte copy \
                 between a sliced and an unsliced layout would put heads in the wrong place; \
                 register both sides with kvxfer_register_kv_layout, or neither"
            ));
        }
    };
    if d.kind != p.kind {
        return Err(format!(
            "kv kind differs: {} on decode, {} on prefill",
            d.kind, p.kind
        ));
    }
    for (field, dv, pv) in [
        ("kv_heads", d.kv_heads, p.kv_heads),
        ("head_dim", d.head_dim, p.head_dim),
        ("dtype_bytes", d.dtype_bytes, p.dtype_bytes),
    ] {
        if dv != pv {
            return Err(format!(
                "kv layout {field} differs: {dv} on decode, {pv} on prefill"
            ));
        }
    }
    let (dt, pt) = (d.page_tokens, p.page_tokens);
    if dt % pt != 0 && pt % dt != 0 {
        return Err(format!(
            "kv layout page_tokens {dt} on decode and {pt} on prefill: neither divides the \
             other"
        ));
    }
    Ok(())
}

/// For each prefill buffer, the decode buffer it fills; or why they cannot pair. With
/// `same_item_len`, paired buffers must also have one `item_len`.
fn pair_buffers(
    decode: &[BufferInfo],
    prefill: &[BufferInfo],
    same_item_len: bool,
) -> Result<Vec<u32>, String> {
    let d_ids = decode.iter().filter(|b| b.layer().is_some()).count();
    let p_ids = prefill.iter().filter(|b| b.layer().is_some()).count();
    let map: Vec<u32> = match (d_ids, p_ids) {
        (0, 0) => {
            if decode.len() != prefill.len() {
                return Err(format!(
                    "{} kv buffers on decode, {} on prefill (without layer ids they pair by \
                     position and must agree)",
                    decode.len(),
                    prefill.len()
                ));
            }
            (0..prefill.len() as u32).collect()
        }
        (d, p) if d == decode.len() && p == prefill.len() => {
            let mut map = Vec::with_capacity(prefill.len());
            for (i, b) in prefill.iter().enumerate() {
                let layer = b.layer_id;
                let nth = prefill[..i].iter().filter(|x| x.layer_id == layer).count();
                let j = decode
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| x.layer_id == layer)
                    .nth(nth)
                    .map(|(j, _)| j)
                    .ok_or_else(|| {
                        format!(
                            "prefill kv buffer {i} (layer {layer}, #{nth} of that layer) has no \
                             decode buffer with that layer"
                        )
                    })?;
                map.push(j as u32);
            }
            map
        }
        _ => {
            return Err(
                "layer ids must be given for every kv buffer on both sides, or on none".into(),
            )
        }
    };
    for (i, &j) in map.iter().enumerate().filter(|_| same_item_len) {
        let (p, d) = (&prefill[i], &decode[j as usize]);
        if p.item_len != d.item_len {
            return Err(format!(
                "kv buffer {j} has item_len {} on decode and {} on prefill (prefill buffer {i})",
                d.item_len, p.item_len
            ));
        }
    }
    Ok(map)
}

/// Checks aux buffers: a prefill engine registers none or the same list as decode.
pub(crate) fn check_aux(decode: &[BufferInfo], prefill: &[BufferInfo]) -> Result<(), String> {
    if prefill.is_empty() {
        return Ok(());
    }
    if decode.len() != prefill.len() {
        return Err(format!(
            "{} aux buffers on decode, {} on prefill",
            decode.len(),
            prefill.len()
        ));
    }
    for (i, (d, p)) in decode.iter().zip(prefill).enumerate() {
        if d.item_len != p.item_len {
            return Err(format!(
                "aux buffer {i} has item_len {} on decode and {} on prefill",
                d.item_len, p.item_len
            ));
        }
    }
    Ok(())
}

/// What one of a room's prefill engines delivers: for each of its kv buffers the decode
/// buffer it fills (its pairing's map), and of each page the heads it sends (`None`:
/// whole pages, a byte copy).
pub(crate) struct Delivery<'a> {
    pub map: &'a [u32],
    pub heads: Option<Range<u32>>,
}

/// Checks that a room's prefill engines together deliver every decode buffer exactly
/// once: whole, from one engine, or as head slices from several that together hold
/// each of `heads` (the decode engine's) once.
pub(crate) fn check_coverage(
    n_decode: usize,
    heads: Range<u32>,
    peers: &[Delivery<'_>],
) -> Result<(), String> {
    for j in 0..n_decode as u32 {
        let paired: Vec<Option<Range<u32>>> = peers
            .iter()
            .flat_map(|p| p.map.iter().filter(|&&x| x == j).map(|_| p.heads.clone()))
            .collect();
        if paired.is_empty() {
            return Err(format!(
                "decode kv buffer {j} is delivered by none of the room's prefill engines"
            ));
        }
        // A prefill rank that holds none of this rank's heads sends nothing into it (at
        // equal TP sizes, every rank but the one whose layout equals ours).
        let from: Vec<Option<Range<u32>>> = paired
            .into_iter()
            .filter(|h| h.as_ref().is_none_or(|h| !h.is_empty()))
            .collect();
        if from.len() > 1 && from.iter().any(Option::is_none) {
            return Err(format!(
                "decode kv buffer {j} would be written by {} prefill engines; pipeline stages \
                 must register layer ids (kvxfer_register_kv_layers) for their own layers only",
                from.len()
            ));
        }
        if from.iter().any(Option::is_none) {
            continue; // whole pages, from one engine
        }
        // Head slices: they must tile the decode engine's heads.
        let mut slices: Vec<Range<u32>> = from.into_iter().flatten().collect();
        slices.sort_by_key(|h| h.start);
        let none = |a: u32, b: u32| {
            format!(
                "decode kv buffer {j}: heads {a}..{b} are sent by none of the room's prefill \
                 engines (a decode room names every prefill rank of the instance)"
            )
        };
        let mut at = heads.start;
        for h in slices {
            if h.start < at {
                return Err(format!(
                    "decode kv buffer {j}: head {} would be written by two prefill engines",
                    h.start
                ));
            }
            if h.start > at {
                return Err(none(at, h.start));
            }
            at = h.end;
        }
        if at < heads.end {
            return Err(none(at, heads.end));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(item_len: u64, layer_id: i32) -> BufferInfo {
        BufferInfo {
            len: item_len * 8,
            item_len,
            layer_id,
            addr: 0,
            rkey: 0,
        }
    }

    #[test]
    fn without_layer_ids_buffers_pair_by_position() {
        let d = [b(64, -1), b(32, -1)];
        assert_eq!(
            pair_buffers(&d, &[b(64, -1), b(32, -1)], true).unwrap(),
            vec![0, 1]
        );
        let e = pair_buffers(&d, &[b(64, -1)], true).unwrap_err();
        assert!(e.contains("2 kv buffers on decode, 1 on prefill"), "{e}");
        let e = pair_buffers(&d, &[b(64, -1), b(16, -1)], true).unwrap_err();
        assert!(
            e.contains("kv buffer 1 has item_len 32 on decode and 16"),
            "{e}"
        );
    }

    #[test]
    fn stages_pair_by_layer_and_together_cover_the_decode_buffers() {
        // Decode: layers 0..4, K and V each.
        let d: Vec<BufferInfo> = (0..4).flat_map(|l| [b(64, l), b(64, l)]).collect();
        let stage0: Vec<BufferInfo> = (0..2).flat_map(|l| [b(64, l), b(64, l)]).collect();
        let stage1: Vec<BufferInfo> = (2..4).flat_map(|l| [b(64, l), b(64, l)]).collect();
        let m0 = pair_buffers(&d, &stage0, true).unwrap();
        let m1 = pair_buffers(&d, &stage1, true).unwrap();
        assert_eq!(m0, vec![0, 1, 2, 3]);
        assert_eq!(m1, vec![4, 5, 6, 7]);
        fn whole(map: &[u32]) -> Delivery<'_> {
            Delivery { map, heads: None }
        }
        check_coverage(8, 0..0, &[whole(&m0), whole(&m1)]).unwrap();
        let e = check_coverage(8, 0..0, &[whole(&m0)]).unwrap_err();
        assert!(e.contains("decode kv buffer 4 is delivered by none"), "{e}");
        let e = check_coverage(8, 0..0, &[whole(&m0), whole(&m0), whole(&m1)]).unwrap_err();
        assert!(e.contains("written by 2"), "{e}");
    }

    #[test]
    fn head_slices_of_a_room_s_prefill_engines_must_tile_the_decode_heads() {
        let map: &[u32] = &[0, 1];
        let s = |h: Range<u32>| Delivery {
            map,
            heads: Some(h),
        };
        // Decode holds heads 4..8: two prefill ranks of 2 heads each, and ranks that
        // send it nothing.
        check_coverage(2, 4..8, &[s(0..0), s(4..6), s(6..8), s(0..0)]).unwrap();
        check_coverage(2, 4..8, &[s(6..8), s(4..6)]).unwrap();
        let e = check_coverage(2, 4..8, &[s(4..6)]).unwrap_err();
        assert!(e.contains("heads 6..8 are sent by none"), "{e}");
        let e = check_coverage(2, 4..8, &[s(0..0)]).unwrap_err();
        assert!(e.contains("heads 4..8 are sent by none"), "{e}");
        let e = check_coverage(2, 4..8, &[s(4..6), s(5..8)]).unwrap_err();
        assert!(e.contains("head 5 would be written by two"), "{e}");
        // At equal TP sizes: the rank whose layout equals ours copies whole pages, the
        // others hold none of our heads and send nothing.
        check_coverage(2, 4..8, &[s(0..0), Delivery { map, heads: None }, s(0..0)]).unwrap();
        // A byte copy of whole pages and a head slice of the same buffer.
        let e = check_coverage(2, 4..8, &[s(4..6), Delivery { map, heads: None }]).unwrap_err();
        assert!(e.contains("written by 2"), "{e}");
    }

    #[test]
    fn layer_ids_on_one_side_only_or_unknown_layers_are_refused() {
        let d = [b(64, 0), b(64, 1)];
        assert!(pair_buffers(&d, &[b(64, -1), b(64, -1)], true).is_err());
        let e = pair_buffers(&d, &[b(64, 7)], true).unwrap_err();
        assert!(e.contains("layer 7"), "{e}");
        // A third buffer of layer 0 has no partner.
        let e = pair_buffers(&d, &[b(64, 0), b(64, 0)], true).unwrap_err();
        assert!(e.contains("#1 of that layer"), "{e}");
    }

    // --- layouts ------------------------------------------------------------------------

    use crate::layout::tests::{gqa, mla};

    /// A registration of two buffers of `layout`'s page size (1024 bytes without one).
    fn reg(layout: Option<KvLayout>) -> Registration {
        let item = layout.map_or(1024, |l| l.page_bytes().unwrap());
        Registration {
            kv: vec![b(item, -1), b(item, -1)],
            aux: vec![],
            layout,
            integrity: false,
        }
    }

    fn pair(d: Option<KvLayout>, p: Option<KvLayout>) -> Result<Pairing, String> {
        pair_kv(&reg(d), &reg(p))
    }

    fn refused(d: KvLayout, p: KvLayout) -> String {
        pair(Some(d), Some(p)).unwrap_err()
    }

    #[test]
    fn equal_layouts_pair_as_a_byte_copy_and_the_pairing_keeps_both() {
        let l = gqa(2, 1);
        let got = pair(Some(l), Some(l)).unwrap();
        assert_eq!(got.map, vec![0, 1]);
        assert_eq!(
            got.layouts,
            Layouts {
                decode: Some(l),
                prefill: Some(l)
            }
        );
        let none = pair(None, None).unwrap();
        assert_eq!(none.layouts, Layouts::default());
    }

    #[test]
    fn a_layout_on_one_side_only_is_refused_naming_the_side_without() {
        let e = pair(Some(gqa(2, 0)), None).unwrap_err();
        assert!(
            e.starts_with(
                "prefill engine registered no kv layout; decode did (MHA/GQA heads: kv_heads 8"
            ),
            "{e}"
        );
        let e = pair(None, Some(mla(1, 0))).unwrap_err();
        assert!(
            e.starts_with("decode engine registered no kv layout; prefill did (MLA (latent)"),
            "{e}"
        );
        assert!(e.contains("wrong place"), "{e}");
    }

    #[test]
    fn mla_against_mha_is_refused_naming_both_kinds() {
        let e = refused(mla(1, 0), gqa(1, 0));
        assert_eq!(
            e,
            "kv kind differs: MLA (latent) on decode, MHA/GQA heads on prefill"
        );
        let e = refused(gqa(1, 0), mla(1, 0));
        assert_eq!(
            e,
            "kv kind differs: MHA/GQA heads on decode, MLA (latent) on prefill"
        );
    }

    #[test]
    fn a_different_model_is_refused_naming_the_field_and_both_values_decode_first() {
        let l = gqa(1, 0);
        let e = refused(l, KvLayout { kv_heads: 4, ..l });
        assert_eq!(e, "kv layout kv_heads differs: 8 on decode, 4 on prefill");
        let e = refused(KvLayout { head_dim: 64, ..l }, l);
        assert_eq!(
            e,
            "kv layout head_dim differs: 64 on decode, 128 on prefill"
        );
        let e = refused(
            mla(1, 0),
            KvLayout {
                head_dim: 512,
                ..mla(1, 0)
            },
        );
        assert_eq!(
            e,
            "kv layout head_dim differs: 576 on decode, 512 on prefill"
        );
        let e = refused(
            l,
            KvLayout {
                dtype_bytes: 1,
                ..l
            },
        );
        assert_eq!(
            e,
            "kv layout dtype_bytes differs: 2 on decode, 1 on prefill"
        );
    }

    #[test]
    fn page_sizes_that_do_not_divide_are_refused_naming_both() {
        let l = gqa(1, 0);
        let e = refused(
            KvLayout {
                page_tokens: 24,
                ..l
            },
            l,
        );
        assert!(
            e.starts_with(
                "kv layout page_tokens 24 on decode and 16 on prefill: neither divides the other"
            ),
            "{e}"
        );
    }

    #[test]
    fn layouts_that_meet_but_differ_pair_through_a_slicing_and_equal_ones_copy_pages() {
        let l = gqa(1, 0);
        let slicing = |d: KvLayout, p: KvLayout| pair(Some(d), Some(p)).unwrap().slicing();
        assert_eq!(slicing(l, l), None);
        assert_eq!(pair(None, None).unwrap().slicing(), None);
        for (d, p) in [
            (gqa(2, 0), gqa(4, 1)),
            (gqa(2, 0), gqa(2, 1)),
            (mla(2, 1), mla(4, 3)),
            (
                KvLayout {
                    page_tokens: 64,
                    ..l
                },
                KvLayout {
                    page_tokens: 16,
                    ..l
                },
            ),
            (
                KvLayout {
                    order: crate::layout::PageOrder::Nhd,
                    ..l
                },
                l,
            ),
        ] {
            assert_eq!(
                slicing(d, p),
                Some(Slicing {
                    prefill: p,
                    decode: d
                })
            );
        }
    }

    #[test]
    fn with_layouts_each_side_s_item_len_is_its_own() {
        let l = gqa(1, 0);
        let mut d = reg(Some(l));
        let mut p = reg(Some(l));
        d.kv[1].item_len = 4096;
        pair_kv(&d, &p).unwrap();
        // Without layouts, the same difference is refused.
        d.layout = None;
        p.layout = None;
        let e = pair_kv(&d, &p).unwrap_err();
        assert!(e.contains("kv buffer 1 has item_len 4096 on decode"), "{e}");
    }

    #[test]
    fn buffers_still_pair_by_count_with_layouts() {
        let l = gqa(1, 0);
        let mut p = reg(Some(l));
        p.kv.pop();
        let e = pair_kv(&reg(Some(l)), &p).unwrap_err();
        assert!(e.contains("2 kv buffers on decode, 1 on prefill"), "{e}");
    }

    #[test]
    fn aux_buffers_are_all_or_nothing() {
        let d = [b(16, -1)];
        check_aux(&d, &[]).unwrap();
        check_aux(&d, &[b(16, -1)]).unwrap();
        assert!(check_aux(&d, &[b(8, -1)]).is_err());
        assert!(check_aux(&[], &[b(8, -1)]).is_err());
    }
}
