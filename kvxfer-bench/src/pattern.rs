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
}
