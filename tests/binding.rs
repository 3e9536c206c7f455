//! Rooms bound to the decode engines that may claim them (DESIGN.md invariant 9, issue
//! 15 item 3): a prefill room created for decode engine `d1` takes a destination or an
//! abort from `d1` only. Another engine of the cluster, `d2`, authenticated with the same
//! key, that sends one (before or after the room is created) changes nothing: the room
//! keeps waiting for `d1`, no page goes to `d2`, the refusal is counted in
//! `binding_refusals`, and a refused destination fails `d2`'s own room at once with a
//! reason naming the binding.

mod common;

use common::{engine, poisoned, wait_terminal, wait_until, Pair, Region, POISON};
use kvxfer::log::Level;
use kvxfer::{Cause, Engine, ErrorKind, RoomPeers, State};

const KEY: &str = "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0";
const BUFS: usize = 2;
const PAGES: usize = 32;
const ITEM: usize = 512;

/// A prefill engine `p` and decode engine `d1` (`t`), and a third engine `d2` of the
/// same cluster (same key) with its own memory. Fields drop in order: the engines stop
/// before the memory they write is freed.
struct Trio {
    t: Pair,
    d2: Engine,
    d2mem: Vec<Region>,
}

fn trio() -> Trio {
    let t = Pair::builder()
        .config(&[("auth_key", KEY)])
        .bufs(BUFS)
        .pages(PAGES)
        .item(ITEM)
        .log(Level::Debug)
        .build();
    let d2mem = poisoned(BUFS, PAGES, ITEM);
    let d2 = engine("decode", &d2mem, &[("auth_key", KEY)]);
    Trio { t, d2, d2mem }
}

impl Trio {
    /// `p`'s room `room`, bound to `d1`.
    fn bound_to_d1(&self, room: u64) {
        let d1 = self.t.d.engine_id();
        self.t
            .p
            .room_create(room, RoomPeers::DecodeEngines(vec![d1]))
            .unwrap();
    }

    /// A decode room `room` of `e` pulling from `p`.
    fn decode_room(&self, e: &Engine, room: u64) {
        e.room_create(room, RoomPeers::Prefills(vec![self.t.p.address().into()]))
            .unwrap();
    }

    fn refusals(&self) -> u64 {
        self.t.p.metrics().binding_refusals
    }

    /// Waits until `p` counted `n` refusals or its room `room` ended, then checks that
    /// the room is still waiting for its destination and the count is `n`.
    fn wait_refusals(&self, n: u64, room: u64) {
        let p = &self.t.p;
        wait_until(&format!("{n} binding refusals"), || {
            self.refusals() >= n || p.room_poll(room).unwrap().is_terminal()
        });
        assert_eq!(p.room_poll(room).unwrap(), State::Bootstrapping);
        assert_eq!(self.refusals(), n);
    }

    /// `d2`'s room `room` failed because `p` refused its destination.
    fn assert_d2_refused(&self, room: u64) {
        assert_eq!(wait_terminal(&self.d2, room), State::Failed);
        let why = self.d2.room_failure(room).unwrap();
        assert_eq!(why.cause, Cause::Aborted, "{why}");
        assert!(why.from_peer, "{why}");
        assert!(
            why.message.contains("bound to other decode engines"),
            "{why}"
        );
    }

    /// `d1` claims `p`'s room `room` with destination `dst`; `src` goes there (enqueued
    /// now unless `queued` before).
    fn d1_transfers(&self, room: u64, src: &[u32], dst: &[u32], queued: bool) {
        let t = &self.t;
        self.decode_room(&t.d, room);
        t.d.room_set_destination(room, dst, None).unwrap();
        if !queued {
            t.p.enqueue_chunk(room, src, true, None).unwrap();
        }
        assert_eq!(wait_terminal(&t.p, room), State::Success);
        assert_eq!(wait_terminal(&t.d, room), State::Success);
        t.assert_pages(src, dst);
    }

    fn d2_untouched(&self) -> bool {
        self.d2mem.iter().all(|m| m.holds_only(POISON))
    }
}

#[test]
fn a_third_engines_destination_or_abort_for_a_room_bound_to_another_changes_nothing() {
    let x = trio();
    let p = &x.t.p;
    assert_ne!(x.t.d.engine_id(), x.d2.engine_id());
    // A destination from d2 for room 1, which waits for d1 with its chunk queued.
    x.bound_to_d1(1);
    p.enqueue_chunk(1, &[1, 2], true, None).unwrap();
    x.decode_room(&x.d2, 1);
    x.d2.room_set_destination(1, &[3, 4], None).unwrap();
    x.assert_d2_refused(1);
    x.wait_refusals(1, 1);
    // An abort from d2 for room 2, which waits for d1.
    x.bound_to_d1(2);
    x.decode_room(&x.d2, 2);
    x.d2.room_abort(2, "d2 gives up").unwrap();
    x.wait_refusals(2, 2);
    // d1 then claims both rooms; nothing reached d2.
    x.d1_transfers(1, &[1, 2], &[5, 6], true);
    x.d1_transfers(2, &[7], &[8], false);
    assert!(x.d2_untouched());
    assert_eq!(x.refusals(), 2);
    let warned = x.t.plog.lines(Level::Warn, "bound to other decode engines");
    assert!(
        !warned.is_empty(),
        "the first refusal is logged at warn level"
    );
    assert!(p
        .metrics()
        .prometheus("prefill")
        .contains("kvxfer_binding_refusals_total{role=\"prefill\"} 2"));
}

#[test]
fn a_third_engines_destination_or_abort_sent_before_the_bound_room_exists_changes_nothing() {
    let x = trio();
    let p = &x.t.p;
    // d2's destination for room 3 and abort of room 4 reach p before p has the rooms.
    x.decode_room(&x.d2, 3);
    x.d2.room_set_destination(3, &[3, 4], None).unwrap();
    wait_until("the destination to be held", || p.metrics().held == 1);
    x.decode_room(&x.d2, 4);
    x.d2.room_abort(4, "d2 gives up").unwrap();
    wait_until("the abort to be kept", || {
        p.metrics().unknown_room_frames == 1
    });
    // Created bound to d1, the rooms adopt neither.
    x.bound_to_d1(3);
    x.bound_to_d1(4);
    assert_eq!(p.room_poll(3).unwrap(), State::Bootstrapping);
    assert_eq!(p.room_poll(4).unwrap(), State::Bootstrapping);
    assert_eq!(x.refusals(), 2);
    x.assert_d2_refused(3);
    x.d1_transfers(3, &[1, 2], &[5, 6], false);
    x.d1_transfers(4, &[7], &[8], false);
    assert!(x.d2_untouched());
    assert_eq!(x.refusals(), 2);
    // A fourth engine sends a destination for room 9 and stops before p has the room:
    // what it left (its destination, turned into a loss or an abort) does not fail the
    // room bound to d1 when it is created.
    let d3mem = poisoned(BUFS, PAGES, ITEM);
    let d3 = engine("decode", &d3mem, &[("auth_key", KEY)]);
    x.decode_room(&d3, 9);
    d3.room_set_destination(9, &[3, 4], None).unwrap();
    wait_until("the destination to be held", || p.metrics().held == 2);
    drop(d3);
    wait_until("d3 to be lost", || p.metrics().peers_lost == 1);
    x.bound_to_d1(9);
    assert_eq!(p.room_poll(9).unwrap(), State::Bootstrapping);
    assert!(x.refusals() > 2);
    x.d1_transfers(9, &[1], &[2], false);
}

#[test]
fn a_room_bound_to_two_engines_waits_for_both_and_an_unbound_room_takes_any() {
    let x = trio();
    let (p, d1, d2) = (&x.t.p, &x.t.d, &x.d2);
    // Bound to both: the room waits for two destinations.
    p.room_create(
        5,
        RoomPeers::DecodeEngines(vec![d2.engine_id(), d1.engine_id()]),
    )
    .unwrap();
    x.decode_room(d2, 5);
    d2.room_set_destination(5, &[9, 10], None).unwrap();
    x.decode_room(d1, 5);
    d1.room_set_destination(5, &[11, 12], None).unwrap();
    p.enqueue_chunk(5, &[1, 2], true, None).unwrap();
    assert_eq!(wait_terminal(p, 5), State::Success);
    assert_eq!(wait_terminal(d1, 5), State::Success);
    assert_eq!(wait_terminal(d2, 5), State::Success);
    x.t.assert_pages(&[1, 2], &[11, 12]);
    // Unbound (as before binding existed): d2's destination is taken.
    p.room_create(6, RoomPeers::Decoders(1)).unwrap();
    x.decode_room(d2, 6);
    d2.room_set_destination(6, &[13], None).unwrap();
    p.enqueue_chunk(6, &[3], true, None).unwrap();
    assert_eq!(wait_terminal(p, 6), State::Success);
    assert_eq!(wait_terminal(d2, 6), State::Success);
    assert!(!x.d2_untouched());
    assert_eq!(x.refusals(), 0);
}

#[test]
fn binding_takes_distinct_ids_on_a_prefill_engine_only() {
    let x = trio();
    let (p, d1) = (&x.t.p, &x.t.d);
    let id = d1.engine_id();
    for (ids, what) in [(vec![], "no id"), (vec![id, 7, id], "a duplicate")] {
        let e = p.room_create(1, RoomPeers::DecodeEngines(ids)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{what}: {e}");
    }
    let e = d1
        .room_create(1, RoomPeers::DecodeEngines(vec![p.engine_id()]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(p.room_count() + d1.room_count(), 0);
    assert_ne!(p.engine_id(), d1.engine_id());
}
