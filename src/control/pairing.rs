//! Which of a prefill engine's buffers fills which of a decode engine's.
//!
//! Buffers pair by position when neither side gives layer ids, and by layer id when both
//! do (several buffers of one layer, such as K and V, pair in the order registered). A
//! pipeline stage registers only its layers; the decode room is complete only when its
//! prefill engines together deliver every decode buffer exactly once.

use crate::proto::BufferInfo;

/// For each prefill buffer, the decode buffer it fills; or why they cannot pair.
pub(crate) fn pair_kv(decode: &[BufferInfo], prefill: &[BufferInfo]) -> Result<Vec<u32>, String> {
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
    for (i, &j) in map.iter().enumerate() {
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
        assert_eq!(pair_kv(&d, &[b(64, -1), b(32, -1)]).unwrap(), vec![0, 1]);
        let e = pair_kv(&d, &[b(64, -1)]).unwrap_err();
        assert!(e.contains("2 kv buffers on decode, 1 on prefill"), "{e}");
        let e = pair_kv(&d, &[b(64, -1), b(16, -1)]).unwrap_err();
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
        let m0 = pair_kv(&d, &stage0).unwrap();
        let m1 = pair_kv(&d, &stage1).unwrap();
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
        assert!(pair_kv(&d, &[b(64, -1), b(64, -1)]).is_err());
        let e = pair_kv(&d, &[b(64, 7)]).unwrap_err();
        assert!(e.contains("layer 7"), "{e}");
        // A third buffer of layer 0 has no partner.
        let e = pair_kv(&d, &[b(64, 0), b(64, 0)]).unwrap_err();
        assert!(e.contains("#1 of that layer"), "{e}");
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
