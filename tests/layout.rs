//! KV layouts at the registration exchange, two engines over loopback: equal layouts
//! (with layer ids) move bytes exactly as a plain registration does, and every layout
//! that cannot meet, or that the data path cannot move yet, is refused on both sides
//! with a reason naming the field and both values.

use kvxfer::{Cause, Engine, KvKind, KvLayout, PageOrder, RoomPeers, State};

mod common;

use common::{poisoned, source, wait_terminal, Region, POISON};

const BUFS: usize = 4;
const PAGES: usize = 16;

/// GQA: 8 KV heads of 16 fp16 elements, 4-token HND pages, one rank: 1024-byte pages.
const GQA: KvLayout = KvLayout {
    kv_heads: 8,
    head_dim: 16,
    dtype_bytes: 2,
    tp_rank: 0,
    tp_size: 1,
    page_tokens: 4,
    order: PageOrder::Hnd,
    kind: KvKind::Heads,
};

/// MLA: a 128-element fp16 latent, 4-token pages (1024 bytes), rank `rank` of `tp`.
fn mla(tp: u32, rank: u32) -> KvLayout {
    KvLayout {
        kv_heads: 1,
        head_dim: 128,
        kind: KvKind::Latent,
        tp_size: tp,
        tp_rank: rank,
        ..GQA
    }
}

/// Page bytes of a side: its layout's, or 1024 without one.
fn item(layout: Option<KvLayout>) -> usize {
    layout.map_or(1024, |l| l.page_bytes().unwrap() as usize)
}

/// A prefill and a decode engine, each with [`BUFS`] buffers of [`PAGES`] pages of its
/// layout's size (source pattern on prefill, POISON on decode), registered with that
/// layout (or plainly without one) and layer ids 0, 0, 1, 1 if `layers`. The engines
/// come first, so that they stop before their memory is freed.
struct Two {
    p: Engine,
    d: Engine,
    dmem: Vec<Region>,
    pmem: Vec<Region>,
}

fn two(
    d: Option<KvLayout>,
    p: Option<KvLayout>,
    layers: bool,
    prefill_keys: &[(&str, &str)],
) -> Two {
    let pmem = source(BUFS, PAGES, item(p));
    let dmem = poisoned(BUFS, PAGES, item(d));
    let ids = || layers.then(|| vec![0, 0, 1, 1]);
    let start = |role, layout: Option<KvLayout>, mem: &[Region], keys: &[(&str, &str)]| {
        let e = common::start(role, keys, common::quiet());
        let bufs = common::descs(mem);
        match (layout, ids()) {
            (Some(l), layers) => e.register_kv_layout(bufs, layers, l).unwrap(),
            (None, Some(layers)) => e.register_kv_layers(bufs, layers).unwrap(),
            (None, None) => e.register_kv(bufs).unwrap(),
        }
        e
    };
    Two {
        p: start("prefill", p, &pmem, prefill_keys),
        d: start("decode", d, &dmem, &[]),
        dmem,
        pmem,
    }
}

/// Moves source pages `src` into decode pages `dst` as room `room`; how it ended on
/// each side.
fn transfer(t: &Two, room: u64, src: &[u32], dst: &[u32]) -> (State, State) {
    t.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
    t.d.room_create(room, RoomPeers::Prefills(vec![t.p.address().into()]))
        .unwrap();
    t.d.room_set_destination(room, dst, None).unwrap();
    t.p.enqueue_chunk(room, src, true, None).unwrap();
    (wait_terminal(&t.p, room), wait_terminal(&t.d, room))
}

/// Whether every decode page holds the source page that went to it (`moved`: source,
/// destination) and every other decode page only POISON.
fn exactly_delivered(t: &Two, moved: &[(u32, u32)]) {
    for (b, (d, p)) in t.dmem.iter().zip(&t.pmem).enumerate() {
        for page in 0..PAGES as u32 {
            match moved.iter().find(|(_, dst)| *dst == page) {
                Some((src, _)) => assert_eq!(d.page(page), p.page(*src), "buffer {b} page {page}"),
                None => assert!(
                    d.page(page).iter().all(|&x| x == POISON),
                    "buffer {b}: page {page} was written"
                ),
            }
        }
    }
}

#[test]
fn equal_layouts_with_layer_ids_move_every_byte_as_a_plain_registration_does() {
    let moved = [(1, 9), (2, 3), (7, 4)];
    let (src, dst): (Vec<u32>, Vec<u32>) = moved.iter().copied().unzip();
    // A sliced rank and an MLA rank with equal layouts pair too.
    let gqa_rank = KvLayout {
        tp_size: 4,
        tp_rank: 2,
        ..GQA
    };
    for layout in [Some(GQA), Some(gqa_rank), Some(mla(2, 1)), None] {
        let t = two(layout, layout, true, &[]);
        assert_eq!(
            transfer(&t, 1, &src, &dst),
            (State::Success, State::Success),
            "layout {layout:?}"
        );
        exactly_delivered(&t, &moved);
        assert_eq!(
            t.d.metrics().bytes_received,
            (3 * item(layout) * BUFS) as u64,
            "layout {layout:?}"
        );
    }
}

/// Creates room 3 on the prefill engine (its bootstrap deadline short), then on the
/// decode engine, whose connection is refused at the registration exchange. The decode
/// room fails at once as MISMATCH, the prefill room at its bootstrap deadline (no decode
/// engine named it before the refusal); both reasons carry `want`, and no page is written.
fn assert_refused_both_sides(d: Option<KvLayout>, p: Option<KvLayout>, want: &str) {
    let t = two(d, p, false, &[("bootstrap_timeout_ms", "1000")]);
    t.p.room_create(3, RoomPeers::Decoders(1)).unwrap();
    t.d.room_create(3, RoomPeers::Prefills(vec![t.p.address().into()]))
        .unwrap();
    assert_eq!(wait_terminal(&t.d, 3), State::Failed);
    let why = t.d.room_failure(3).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "decode: {why}");
    assert!(
        why.message.contains("registration mismatch"),
        "decode: {why}"
    );
    assert!(why.message.contains(want), "decode: {why}\nwant: {want}");
    assert_eq!(wait_terminal(&t.p, 3), State::Failed);
    let why = t.p.room_failure(3).unwrap();
    assert_eq!(why.cause, Cause::BootstrapTimeout, "prefill: {why}");
    assert!(
        why.message
            .contains("meanwhile a decode engine's registration was refused"),
        "prefill: {why}"
    );
    assert!(why.message.contains(want), "prefill: {why}\nwant: {want}");
    exactly_delivered(&t, &[]);
}

#[test]
fn a_layout_on_decode_only_is_refused_naming_the_prefill_as_having_none() {
    assert_refused_both_sides(
        Some(GQA),
        None,
        "prefill engine registered no kv layout; decode did (MHA/GQA heads: kv_heads 8, \
         head_dim 16",
    );
}

#[test]
fn a_layout_on_prefill_only_is_refused_naming_the_decode_as_having_none() {
    assert_refused_both_sides(
        None,
        Some(mla(1, 0)),
        "decode engine registered no kv layout; prefill did (MLA (latent): kv_heads 1",
    );
}

#[test]
fn mla_against_mha_is_refused_naming_both_kinds() {
    assert_refused_both_sides(
        Some(mla(1, 0)),
        Some(GQA),
        "kv kind differs: MLA (latent) on decode, MHA/GQA heads on prefill",
    );
}

#[test]
fn another_head_dim_is_refused_naming_both_values() {
    let d = KvLayout {
        head_dim: 32,
        ..GQA
    };
    assert_refused_both_sides(
        Some(d),
        Some(GQA),
        "kv layout head_dim differs: 32 on decode, 16 on prefill",
    );
}

#[test]
fn another_kv_head_count_is_refused_naming_both_values() {
    let p = KvLayout { kv_heads: 4, ..GQA };
    assert_refused_both_sides(
        Some(GQA),
        Some(p),
        "kv layout kv_heads differs: 8 on decode, 4 on prefill",
    );
}

#[test]
fn another_dtype_is_refused_naming_both_values() {
    let d = KvLayout {
        dtype_bytes: 1,
        ..GQA
    };
    assert_refused_both_sides(
        Some(d),
        Some(GQA),
        "kv layout dtype_bytes differs: 1 on decode, 2 on prefill",
    );
}

#[test]
fn page_sizes_that_do_not_divide_are_refused_naming_both() {
    let p = KvLayout {
        page_tokens: 6,
        ..GQA
    };
    assert_refused_both_sides(
        Some(GQA),
        Some(p),
        "kv layout page_tokens 4 on decode and 6 on prefill: neither divides the other",
    );
}
