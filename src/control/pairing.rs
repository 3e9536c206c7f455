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
//! registered). What the data path can move today (layouts equal in every field) is
//! [`check_data_path_supports`]'s answer.

use crate::layout::{KvKind, KvLayout};
use crate::proto::{BufferInfo, Registration};

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

/// Pairs a decode engine's registration with a prefill engine's: their layouts must meet
/// (see the module documentation) and be ones the data path moves, and their kv buffers
/// must pair. Or why they cannot, naming the field and both values, decode's first.
pub(crate) fn pair_kv(decode: &Registration, prefill: &Registration) -> Result<Pairing, String> {
    let layouts = Layouts {
        decode: decode.layout,
        prefill: prefill.layout,
    };
    check_layouts(&layouts)?;
    // With layouts, each side's item_len is its own layout's page size.
    let map = pair_buffers(&decode.kv, &prefill.kv, layouts.decode.is_none())?;
    if let (Some(d), Some(p)) = (&layouts.decode, &layouts.prefill) {
        check_data_path_supports(d, p)?;
    }
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

/// Whether the data path can move pages between two layouts that can meet. Today it
/// copies whole pages byte for byte, so only layouts equal in every field pair; what
/// differs in tensor-parallel rank or size (head slicing, or a latent sent once per
/// decode rank), page size or page order is refused as not built yet.
///
/// This is the one place that says so: the data path replaces it when it moves more.
pub(crate) fn check_data_path_supports(
    decode: &KvLayout,
    prefill: &KvLayout,
) -> Result<(), String> {
    let (d, p) = (decode, prefill);
    if d == p {
        return Ok(());
    }
    // check_layouts saw the same kind, kv_heads, head_dim and dtype_bytes: what differs
    // is the rank, the page size or the page order.
    let what = if (d.tp_size, d.tp_rank) != (p.tp_size, p.tp_rank) {
        let (dh, ph) = (d.heads(), p.heads());
        match d.kind {
            KvKind::Heads => format!(
                "head-sliced transfer between decode tp {} rank {} (heads {}..{} of {}) and \
                 prefill tp {} rank {} (heads {}..{})",
                d.tp_size,
                d.tp_rank,
                dh.start,
                dh.end,
                d.kv_heads,
                p.tp_size,
                p.tp_rank,
                ph.start,
                ph.end
            ),
            KvKind::Latent => format!(
                "latent (MLA) transfer between decode tp {} rank {} and prefill tp {} rank {}",
                d.tp_size, d.tp_rank, p.tp_size, p.tp_rank
            ),
        }
    } else if d.page_tokens != p.page_tokens {
        format!(
            "a page-size change (page_tokens {} on decode, {} on prefill)",
            d.page_tokens, p.page_tokens
        )
    } else {
        format!(
            "a page-order change ({} on decode, {} on prefill)",
            d.order, p.order
        )
    };
    Err(format!(
        "{what} is not built yet: today only layouts equal in every field pair (a byte copy)"
    ))
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

/// Checks that the maps of a room's prefill engines cover every decode buffer exactly
/// once.
pub(crate) fn check_coverage(n_decode: usize, maps: &[&[u32]]) -> Result<(), String> {
    let mut seen = vec![0u32; n_decode];
    for m in maps {
        for &j in m.iter() {
            seen[j as usize] += 1;
        }
    }
    if let Some(j) = seen.iter().position(|&c| c == 0) {
        return Err(format!(
            "decode kv buffer {j} is delivered by none of the room's prefill engines"
        ));
    }
    if let Some(j) = seen.iter().position(|&c| c > 1) {
        return Err(format!(
            "decode kv buffer {j} would be written by {} prefill engines; pipeline stages must \
             register layer ids (kvxfer_register_kv_layers) for their own layers only",
            seen[j]
        ));
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
        check_coverage(8, &[&m0, &m1]).unwrap();
        let e = check_coverage(8, &[&m0]).unwrap_err();
        assert!(e.contains("decode kv buffer 4 is delivered by none"), "{e}");
        let e = check_coverage(8, &[&m0, &m0, &m1]).unwrap_err();
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

    use crate::layout::PageOrder;

    /// GQA, 8 KV heads of 128 fp16 elements, 16-token HND pages: rank `rank` of `tp`.
    fn gqa(tp: u32, rank: u32) -> KvLayout {
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

    fn mla(tp: u32, rank: u32) -> KvLayout {
        KvLayout {
            kv_heads: 1,
            head_dim: 576,
            kind: KvKind::Latent,
            ..gqa(tp, rank)
        }
    }

    /// A registration of two buffers of `layout`'s page size (1024 bytes without one).
    fn reg(layout: Option<KvLayout>) -> Registration {
        let item = layout.map_or(1024, |l| l.page_bytes().unwrap());
        Registration {
            kv: vec![b(item, -1), b(item, -1)],
            aux: vec![],
            layout,
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
    fn page_size_changes_are_refused_as_not_built_yet() {
        let l = gqa(1, 0);
        for (d, p) in [(64, 16), (16, 64)] {
            let e = refused(
                KvLayout {
                    page_tokens: d,
                    ..l
                },
                KvLayout {
                    page_tokens: p,
                    ..l
                },
            );
            assert_eq!(
                e,
                format!(
                    "a page-size change (page_tokens {d} on decode, {p} on prefill) is not \
                     built yet: today only layouts equal in every field pair (a byte copy)"
                )
            );
        }
    }

    #[test]
    fn head_slicing_is_refused_as_not_built_yet_naming_both_ranks() {
        let e = refused(gqa(2, 0), gqa(4, 1));
        assert!(
            e.starts_with(
                "head-sliced transfer between decode tp 2 rank 0 (heads 0..4 of 8) and \
                 prefill tp 4 rank 1 (heads 2..4) is not built yet"
            ),
            "{e}"
        );
        // Same size, other rank; and ranks that replicate one same head: still not a
        // byte copy the data path makes today.
        let e = refused(gqa(2, 0), gqa(2, 1));
        assert!(
            e.contains("decode tp 2 rank 0") && e.contains("prefill tp 2 rank 1"),
            "{e}"
        );
        let two = |tp, rank| KvLayout {
            kv_heads: 2,
            ..gqa(tp, rank)
        };
        let e = refused(two(4, 1), two(2, 0));
        assert!(
            e.contains("(heads 0..1 of 2)") && e.contains("(heads 0..1)"),
            "{e}"
        );
    }

    #[test]
    fn a_latent_between_other_ranks_is_refused_as_not_built_yet() {
        let e = refused(mla(2, 1), mla(4, 3));
        assert_eq!(
            e,
            "latent (MLA) transfer between decode tp 2 rank 1 and prefill tp 4 rank 3 is not \
             built yet: today only layouts equal in every field pair (a byte copy)"
        );
        pair(Some(mla(4, 3)), Some(mla(4, 3))).unwrap();
    }

    #[test]
    fn a_page_order_change_is_refused_as_not_built_yet() {
        let nhd = |l: KvLayout| KvLayout {
            order: PageOrder::Nhd,
            ..l
        };
        let e = refused(nhd(gqa(2, 1)), gqa(2, 1));
        assert!(
            e.starts_with("a page-order change (NHD on decode, HND on prefill) is not built yet"),
            "{e}"
        );
        let e = refused(mla(1, 0), nhd(mla(1, 0)));
        assert!(
            e.starts_with("a page-order change (HND on decode, NHD on prefill)"),
            "{e}"
        );
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
