//! Layer-wise enqueueing (issue 14): a chunk's layers handed over one range at a time,
//! as a prefill computes them, land exactly as the whole chunk would; every mix that
//! leaves a layer out, repeats one or closes too early fails the room naming the chunk
//! and the layer; an abort between two layers of a chunk ends the room with nothing more
//! written.

mod common;

use common::{wait_terminal, Pair, POISON};
use kvxfer::{Cause, ErrorKind, RoomPeers, State};

/// 4 KV buffers registered without layer ids: layer `i` is buffer `i`.
const LAYERS: u32 = 4;

fn pair() -> Pair {
    Pair::builder()
        .bufs(LAYERS as usize)
        .pages(64)
        .item(1024)
        .build()
}

/// Two chunks of 3 source pages, into scattered destination pages.
const SRC: [[u32; 3]; 2] = [[1, 2, 3], [4, 5, 6]];
const DST: [u32; 6] = [40, 22, 23, 9, 50, 51];

fn all_src() -> Vec<u32> {
    SRC.concat()
}

/// Runs room `room` with the calls `(chunk, layer_first, layer_count)` in order, the
/// last one closing the room; checks both sides SUCCESS and every page of every layer.
fn run(t: &Pair, room: u64, calls: &[(usize, u32, u32)]) {
    t.open(room, &DST);
    for (i, &(c, first, count)) in calls.iter().enumerate() {
        t.p.enqueue_layers(room, &SRC[c], first, count, i + 1 == calls.len(), None)
            .unwrap();
    }
    assert_eq!(wait_terminal(&t.p, room), State::Success);
    assert_eq!(wait_terminal(&t.d, room), State::Success);
    t.assert_pages(&all_src(), &DST);
    t.repoison(&DST);
}

#[test]
fn layers_in_order_in_reverse_interleaved_and_one_at_a_time_land_as_whole_chunks_do() {
    let t = pair();
    // In order, one layer a call, chunk by chunk.
    let in_order: Vec<_> = (0..2)
        .flat_map(|c| (0..LAYERS).map(move |l| (c, l, 1)))
        .collect();
    run(&t, 1, &in_order);
    // In reverse.
    let reverse: Vec<_> = (0..2)
        .flat_map(|c| (0..LAYERS).rev().map(move |l| (c, l, 1)))
        .collect();
    run(&t, 2, &reverse);
    // Interleaved across chunks: each layer of both chunks before the next layer (chunks
    // take their destination pages in the order they open); the call that closes the
    // room adds the last layer of chunk 0, not of chunk 1.
    let interleaved: Vec<_> = (0..LAYERS)
        .flat_map(|l| {
            if l + 1 < LAYERS {
                [(0, l, 1), (1, l, 1)]
            } else {
                [(1, l, 1), (0, l, 1)]
            }
        })
        .collect();
    run(&t, 3, &interleaved);
    // Ranges of layers: 0-1 then 2-3.
    run(&t, 4, &[(0, 0, 2), (1, 0, 2), (0, 2, 2), (1, 2, 2)]);
    // Whole chunks through enqueue_layers: every layer in one call.
    run(&t, 5, &[(0, 0, LAYERS), (1, 0, LAYERS)]);
    for r in 1..=5 {
        t.p.room_clear(r).unwrap();
        t.d.room_clear(r).unwrap();
    }
}

#[test]
fn layer_ids_name_every_buffer_of_their_layer() {
    // K and V of 2 layers: ids 0, 0, 1, 1.
    let src = common::source(4, 16, 256);
    let dst = common::poisoned(4, 16, 256);
    let p = common::start("prefill", &[], common::quiet());
    p.register_kv_layers(common::descs(&src), vec![0, 0, 1, 1])
        .unwrap();
    let d = common::start("decode", &[], common::quiet());
    d.register_kv_layers(common::descs(&dst), vec![0, 0, 1, 1])
        .unwrap();
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    d.room_create(1, RoomPeers::Prefills(vec![p.address().into()]))
        .unwrap();
    d.room_set_destination(1, &[7, 8], None).unwrap();
    p.enqueue_layers(1, &[2, 3], 1, 1, false, None).unwrap();
    // Layer 1 (buffers 2 and 3) lands while layer 0 is not enqueued yet.
    common::wait_until("layer 1 to land", || {
        dst[2].page(7) == src[2].page(2) && dst[3].page(8) == src[3].page(3)
    });
    assert!(dst[0].holds_only(POISON) && dst[1].holds_only(POISON));
    let e = p.enqueue_layers(1, &[2, 3], 2, 1, true, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("layer 2 has no kv buffer"), "{e}");
    assert_eq!(
        p.room_poll(1).unwrap(),
        State::Transferring,
        "a bad range fails nothing"
    );
    p.enqueue_layers(1, &[2, 3], 0, 1, true, None).unwrap();
    assert_eq!(wait_terminal(&d, 1), State::Success);
    for b in 0..4 {
        assert_eq!(dst[b].page(7), src[b].page(2));
        assert_eq!(dst[b].page(8), src[b].page(3));
    }
}

/// A call that breaks the chunk rules: the call fails with INVALID_ARGUMENT and the
/// reason, and the room fails on both sides with it.
fn assert_refused(t: &Pair, room: u64, e: kvxfer::Error, want: &str) {
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains(want), "{e}");
    assert_eq!(wait_terminal(&t.p, room), State::Failed);
    assert_eq!(wait_terminal(&t.d, room), State::Failed);
    for (side, from_peer) in [(&t.p, false), (&t.d, true)] {
        let why = side.room_failure(room).unwrap();
        assert_eq!(why.from_peer, from_peer, "{why}");
        assert!(why.message.contains(want), "{why}");
    }
    assert_eq!(t.p.room_poll(room).unwrap(), State::Failed);
}

#[test]
fn a_repeated_layer_a_missing_layer_and_an_overlapping_chunk_fail_the_room_naming_them() {
    let t = pair();
    // A layer twice.
    t.open(1, &DST);
    t.p.enqueue_layers(1, &SRC[0], 0, 2, false, None).unwrap();
    let e =
        t.p.enqueue_layers(1, &SRC[0], 1, 1, false, None)
            .unwrap_err();
    assert_refused(
        &t,
        1,
        e,
        "chunk 0 (3 pages from source page 1): layer 1 was already enqueued",
    );
    // The room closed while chunk 0 misses layer 3.
    t.open(2, &DST);
    t.p.enqueue_layers(2, &SRC[0], 0, 3, false, None).unwrap();
    let e =
        t.p.enqueue_layers(2, &SRC[1], 0, LAYERS, true, None)
            .unwrap_err();
    assert_refused(
        &t,
        2,
        e,
        "the room was closed (is_last) while chunk 0 (3 pages from source page 1) misses layer 3",
    );
    // Pages that overlap an open chunk's.
    t.open(3, &DST);
    t.p.enqueue_layers(3, &SRC[0], 0, 1, false, None).unwrap();
    let e =
        t.p.enqueue_layers(3, &[3, 4, 5], 1, 1, false, None)
            .unwrap_err();
    assert_refused(&t, 3, e, "overlap those of chunk 0");
    // More pages than the destination: the room fails as for whole chunks.
    t.open(4, &DST[..3]);
    t.p.enqueue_layers(4, &SRC[0], 0, 1, false, None).unwrap();
    t.p.enqueue_layers(4, &SRC[1], 0, 1, false, None).unwrap();
    assert_eq!(wait_terminal(&t.p, 4), State::Failed);
    let why = t.p.room_failure(4).unwrap();
    assert_eq!(why.cause, Cause::Mismatch);
    assert!(why.message.contains("overflows the destination"), "{why}");
    // A layer enqueued after the room failed is refused with the reason.
    let e =
        t.p.enqueue_layers(4, &SRC[1], 1, 1, false, None)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WrongState);
    assert!(e.to_string().contains("overflows the destination"), "{e}");
    // Arguments that name no layer fail the call and leave the room live.
    t.open(5, &DST);
    for (first, count, want) in [
        (0, 0, "layer_count is 0"),
        (3, 2, "layer 4 is out of range"),
    ] {
        let e =
            t.p.enqueue_layers(5, &SRC[0], first, count, false, None)
                .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains(want), "{e}");
    }
    assert!(!t.p.room_poll(5).unwrap().is_terminal());
    // Decode engines take no layers.
    let e =
        t.d.enqueue_layers(5, &SRC[0], 0, 1, false, None)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WrongRole);
}

/// The silent pin, per layer: rooms whose two chunks come one layer a call, each aborted
/// from one side or the other at a random moment among the calls (or after the last).
/// Where the abort caught each room (inside a layer of a chunk that is not the last,
/// between layers, after the last) is the threads' to decide; the simulator reaches
/// each at one room (`src/engine/sim/scenarios/`), and calls that wait behind a write
/// of the room's first layer are aborted for certain in
/// `a_room_aborted_while_its_first_layer_blocks_the_link_sends_none_of_the_layers_behind_it`.
/// Every room ends in an allowed pair of states; one the abort failed is FAILED on both
/// sides with the reason and takes no call, nothing of it lands after its decode room
/// drained, and nothing stays in flight.
#[test]
fn an_abort_among_a_room_s_layer_calls_ends_failed_and_nothing_lands_after() {
    use common::{wait_until, Rng};
    let t = Pair::builder()
        .config(&[
            ("transport", "tcp"),
            ("workers", "1"),
            ("connections_per_peer", "1"),
        ])
        .bufs(LAYERS as usize)
        .pages(64)
        .item(1024)
        .build();
    let mut rng = Rng(0x5851_F42D_4C95_7F2D);
    let reason = "client went away between layers";
    let calls: Vec<(usize, u32)> = (0..2)
        .flat_map(|c| (0..LAYERS).map(move |l| (c, l)))
        .collect();
    let mut outcomes = std::collections::BTreeMap::<(&str, &str, &str), u32>::new();
    for room in 1..=24u64 {
        let from_decode = rng.below(2) == 0;
        // The abort comes before call `at` (after the last, if it is their number).
        let at = rng.below(calls.len() as u64 + 1) as usize;
        t.ready(room, &DST);
        for (i, &(c, l)) in calls.iter().enumerate() {
            if i == at {
                rng.spin_below(40_000);
                t.side(from_decode).room_abort(room, reason).unwrap();
            }
            let is_last = i + 1 == calls.len();
            match t.p.enqueue_layers(room, &SRC[c], l, 1, is_last, None) {
                Ok(()) => assert!(
                    i < at || from_decode,
                    "room {room} took a call after its abort"
                ),
                Err(e) => assert_eq!(e.kind(), ErrorKind::WrongState, "{e}"),
            }
        }
        if at == calls.len() {
            rng.spin_below(40_000);
            t.side(from_decode).room_abort(room, reason).unwrap();
        }
        let (ps, ds) = (wait_terminal(&t.p, room), wait_terminal(&t.d, room));
        let from = if from_decode { "decode" } else { "prefill" };
        *outcomes.entry((ps.name(), ds.name(), from)).or_default() += 1;
        let allowed = ps == ds || (ps == State::Success && ds == State::Failed && from_decode);
        assert!(
            allowed,
            "room {room}: prefill {ps}, decode {ds}, abort from {from}"
        );
        if ps == State::Failed {
            for (e, local) in [(&t.p, !from_decode), (&t.d, from_decode)] {
                let why = e.room_failure(room).unwrap();
                assert_eq!(why.cause, Cause::Aborted, "{why}");
                assert_eq!(why.from_peer, !local, "{why}");
                assert!(why.message.contains(reason), "{why}");
            }
        }
        if ds == State::Failed {
            wait_until("the decode room to drain", || {
                t.d.room_drained(room).unwrap()
            });
            t.repoison(&DST);
            // Nothing of the room is left behind this one on the worker or the link.
            t.marker(100 + room, &[7], &[60]);
            assert!(
                t.poisoned(&DST),
                "room {room}: a byte landed after it drained"
            );
        } else {
            t.assert_pages(&all_src(), &DST);
            t.repoison(&DST);
            t.marker(100 + room, &[7], &[60]);
        }
        for r in [room, 100 + room] {
            t.p.room_clear(r).unwrap();
            t.d.room_clear(r).unwrap();
        }
    }
    for e in [&t.p, &t.d] {
        assert_eq!(e.metrics().inflight, 0);
        assert_eq!(e.room_count(), 0);
    }
    println!("aborts among layer calls: {outcomes:?}");
}

/// The silent pin, per layer, deterministically over a real socket: layer 0 of a room's
/// first chunk (16 MiB) blocks the sender because the (fake) decode engine reads
/// nothing; layer 1 of that chunk waits behind its queued batches, and the last chunk's
/// layers behind it; the room is aborted, from one side, then (another room) from the
/// other. The sender that takes the room's batches down to the reserve plans what
/// waited, finds the room terminal and skips it (`plan_chunk`), and it skips every
/// batch of the room it takes (`write_batch`; DESIGN.md invariant 4): read to its
/// end, the data connection carries only whole frames of layer 0 of chunk 0, the last
/// perhaps cut with zeros, nothing of layer 1 or of the last chunk, no Done of the
/// room; it is FAILED with the abort's reason, drains, and nothing is left.
#[test]
fn a_room_aborted_while_its_first_layer_blocks_the_link_sends_none_of_the_layers_behind_it() {
    use common::slow::{assert_cut_in_the_blocking_chunk, SlowReader, BLOCKING, LAST};
    let reason = "client went away while a layer waited";
    for from_decode in [false, true] {
        let (room, marker) = (80 + from_decode as u64, 90 + from_decode as u64);
        let mut s = SlowReader::new(2);
        s.ready(room, BLOCKING + LAST);
        let chunk0: Vec<u32> = (0..BLOCKING).collect();
        let chunk1: Vec<u32> = (BLOCKING..BLOCKING + LAST).collect();
        for (src, layer, last) in [
            (&chunk0, 0, false),
            (&chunk0, 1, false),
            (&chunk1, 0, false),
            (&chunk1, 1, true),
        ] {
            s.p.enqueue_layers(room, src, layer, 1, last, None).unwrap();
        }
        s.wait_blocked(room);
        s.abort(room, from_decode, reason);
        let frames = s.read_to_marker(room, marker);
        let cut = assert_cut_in_the_blocking_chunk(&frames);
        s.assert_nothing_left(room, marker);
        println!(
            "aborted from the {} side: {} frames of layer 0 went out, the last cut: {cut}",
            if from_decode { "decode" } else { "prefill" },
            frames.len()
        );
    }
}

/// The decode side sees layers land in layer order: a layer counts once every page of
/// the whole destination holds it, from every chunk.
#[test]
fn the_decode_side_counts_the_layers_landed_in_order() {
    let t = pair();
    t.ready(9, &DST);
    let landed = || t.d.room_layers_landed(9).unwrap();
    assert_eq!(landed(), 0);
    // Layer 1 of both chunks: not counted while layer 0 is missing.
    t.p.enqueue_layers(9, &SRC[0], 1, 1, false, None).unwrap();
    t.p.enqueue_layers(9, &SRC[1], 1, 1, false, None).unwrap();
    common::wait_until("layer 1 to land", || {
        t.d.metrics().bytes_received == 6 * 1024
    });
    assert_eq!(landed(), 0);
    // Layer 0 of chunk 0 only: layer 0 is not whole yet.
    t.p.enqueue_layers(9, &SRC[0], 0, 1, false, None).unwrap();
    common::wait_until("chunk 0's layer 0", || {
        t.d.metrics().bytes_received == 9 * 1024
    });
    assert_eq!(landed(), 0);
    t.p.enqueue_layers(9, &SRC[1], 0, 1, false, None).unwrap();
    common::wait_until("layers 0 and 1 to have landed", || landed() == 2);
    t.p.enqueue_layers(9, &SRC[0], 2, 2, false, None).unwrap();
    t.p.enqueue_layers(9, &SRC[1], 2, 1, false, None).unwrap();
    common::wait_until("layer 2 to have landed", || landed() == 3);
    t.p.enqueue_layers(9, &SRC[1], 3, 1, true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 9), State::Success);
    assert_eq!(landed(), LAYERS);
    assert_eq!(
        t.p.room_layers_landed(9).unwrap_err().kind(),
        ErrorKind::WrongRole
    );
}
