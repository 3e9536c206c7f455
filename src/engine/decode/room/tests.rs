//! Unit tests of a decode room's decisions, with a fake peer: the destination bytes runs
//! take, what a Done claim comes to, sending the destination once, and the drain.

use super::*;

/// A peer for the room's tests: compared by its number, with the facts the engine would
/// read off a real peer.
#[derive(Clone, Debug, PartialEq)]
struct F {
    id: u32,
    name: &'static str,
    aux: usize,
}

impl PeerRef for F {
    fn same(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

fn peer(id: u32, aux: usize) -> F {
    const NAMES: [&str; 3] = ["p0", "p1", "p2"];
    F {
        id,
        name: NAMES[id as usize],
        aux,
    }
}

fn facts(p: &F) -> Facts<'_> {
    Facts {
        name: p.name,
        aux_count: p.aux,
    }
}

/// KV bytes every peer owes per destination page.
const PAGE: u64 = 100;

/// The engine's rule without slicing: one source page per destination page.
fn owed(_: &F, pages_sent: u32, dest_pages: u64) -> Result<u64, String> {
    if u64::from(pages_sent) == dest_pages {
        Ok(dest_pages * PAGE)
    } else {
        Err(format!(
            "sent {pages_sent} pages for a destination of {dest_pages}"
        ))
    }
}

fn room(peers: Vec<F>, pages: &[u32], aux: Option<u32>) -> DecodeRoom<F> {
    let r = DecodeRoom::new(peers);
    assert!(r.set_destination(pages, aux));
    r
}

fn settle(r: &DecodeRoom<F>, idx: usize, ordered: bool) -> Settle {
    r.settle(idx, ordered, facts, owed)
}

fn fail_text(s: Settle) -> String {
    match s {
        Settle::Fail(why) => why,
        other => panic!("expected a failure, got {other:?}"),
    }
}

fn kv_run(first_page: u32, n_pages: u32) -> DataHeader {
    DataHeader {
        room: 1,
        generation: 1,
        target: Target::Kv,
        buffer: 7,
        first_page,
        n_pages,
        byte_len: n_pages * PAGE as u32,
        page_off: 0,
        digest: 0,
    }
}

fn part_run(page: u32, off: u32, len: u32) -> DataHeader {
    DataHeader {
        byte_len: len,
        page_off: off,
        ..kv_run(page, 1)
    }
}

fn aux_run(slot: u32, n: u32) -> DataHeader {
    DataHeader {
        target: Target::Aux,
        buffer: 3,
        ..kv_run(slot, n)
    }
}

/// One run of peer `idx` into our buffer `local`.
fn take(
    r: &DecodeRoom<F>,
    idx: usize,
    h: DataHeader,
    local: u32,
    sliced: bool,
) -> Result<(), String> {
    r.take_grants(idx, std::iter::once((h, local, sliced)))
}

// ---- which peer ----

#[test]
fn a_peer_is_found_by_identity_and_a_stranger_is_not() {
    let r = DecodeRoom::new(vec![peer(0, 0), peer(1, 0)]);
    assert_eq!(r.index_of(&peer(1, 5)), Some(1));
    assert_eq!(r.index_of(&peer(2, 0)), None);
}

// ---- settle ----

#[test]
fn a_room_settles_nothing_before_a_claim_and_nothing_twice() {
    let r = room(vec![peer(0, 0)], &[4, 5], None);
    assert!(!r.count(0, &[(0, 2 * PAGE)], 0), "no claim yet");
    assert_eq!(settle(&r, 0, true), Settle::Nothing);
    r.claim(0, 2, false);
    assert_eq!(settle(&r, 0, true), Settle::Done { all: true });
    assert_eq!(settle(&r, 0, true), Settle::Nothing);
    assert_eq!(r.missing(facts), None);
}

#[test]
fn a_short_claim_waits_over_tcp_and_fails_at_once_when_ordered() {
    let r = room(vec![peer(0, 0)], &[4, 5], None);
    r.count(0, &[(0, PAGE)], 0);
    r.claim(0, 2, false);
    assert_eq!(settle(&r, 0, false), Settle::Wait);
    assert_eq!(
        fail_text(settle(&r, 0, true)),
        "p0 reported done after 100 of 200 KV bytes and 0 of 0 aux rows"
    );
    assert_eq!(
        r.missing(facts).as_deref(),
        Some("p0 reported done but only 100 KV bytes and 0 aux rows arrived")
    );
    // The rest lands on another connection: the count says the claim was waiting.
    assert!(r.count(0, &[(0, PAGE)], 0));
    assert_eq!(settle(&r, 0, false), Settle::Done { all: true });
    assert_eq!(r.missing(facts), None);
}

#[test]
fn more_bytes_or_rows_than_owed_fail_even_unordered() {
    let r = room(vec![peer(0, 0)], &[4, 5], None);
    r.count(0, &[(0, 3 * PAGE)], 0);
    r.claim(0, 2, false);
    assert_eq!(
        fail_text(settle(&r, 0, false)),
        "p0 wrote 300 KV bytes and 0 aux rows for 200 and 0"
    );
    // An aux row into a destination without an aux slot.
    let r = room(vec![peer(0, 1)], &[4], None);
    r.count(0, &[(0, PAGE)], 1);
    r.claim(0, 1, true);
    assert_eq!(
        fail_text(settle(&r, 0, false)),
        "p0 wrote 100 KV bytes and 1 aux rows for 100 and 0"
    );
}

#[test]
fn a_claim_the_peer_cannot_owe_fails_with_its_name() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[4, 5], None);
    r.claim(1, 3, false);
    assert_eq!(
        fail_text(settle(&r, 1, false)),
        "p1 sent 3 pages for a destination of 2"
    );
}

#[test]
fn the_room_is_done_only_when_every_peer_is() {
    let r = room(vec![peer(0, 0), peer(1, 0), peer(2, 0)], &[4], None);
    for idx in [2, 0] {
        r.count(idx, &[(0, PAGE)], 0);
        r.claim(idx, 1, false);
        assert_eq!(settle(&r, idx, true), Settle::Done { all: false });
    }
    r.count(1, &[(0, PAGE)], 0);
    r.claim(1, 1, false);
    assert_eq!(settle(&r, 1, true), Settle::Done { all: true });
}

#[test]
fn an_aux_slot_needs_a_peer_with_aux_buffers() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[4], Some(9));
    r.count(0, &[(0, PAGE)], 0);
    r.claim(0, 1, false);
    assert_eq!(
        fail_text(settle(&r, 0, false)),
        "the destination has an aux slot but no prefill engine registered aux buffers"
    );
}

#[test]
fn each_peer_with_aux_buffers_owes_one_row_per_buffer() {
    // p0 has two aux buffers; p1 (a stage without aux buffers) owes no row.
    let r = room(vec![peer(0, 2), peer(1, 0)], &[4], Some(9));
    r.count(1, &[(0, PAGE)], 0);
    r.claim(1, 1, false);
    assert_eq!(settle(&r, 1, true), Settle::Done { all: false });
    r.count(0, &[(0, PAGE)], 1);
    r.claim(0, 1, true);
    assert_eq!(
        fail_text(settle(&r, 0, true)),
        "p0 reported done after 100 of 100 KV bytes and 1 of 2 aux rows"
    );
    assert_eq!(settle(&r, 0, false), Settle::Wait);
    r.count(0, &[], 1);
    assert_eq!(settle(&r, 0, false), Settle::Done { all: true });
}

#[test]
fn a_peer_with_aux_buffers_that_sent_no_rows_fails() {
    let r = room(vec![peer(0, 1)], &[4], Some(9));
    r.count(0, &[(0, PAGE)], 0);
    r.claim(0, 1, false);
    assert_eq!(
        fail_text(settle(&r, 0, false)),
        "p0 did not send the aux rows"
    );
}

// ---- take_grants ----

#[test]
fn no_run_is_granted_before_the_destination() {
    let r: DecodeRoom<F> = DecodeRoom::new(vec![peer(0, 0)]);
    assert_eq!(
        take(&r, 0, kv_run(4, 1), 0, false).unwrap_err(),
        "no destination was sent"
    );
}

#[test]
fn a_run_outside_the_destination_is_refused() {
    let r = room(vec![peer(0, 0)], &[10, 11, 12, 20], Some(5));
    assert_eq!(
        take(&r, 0, kv_run(13, 1), 0, false).unwrap_err(),
        "page 13 was not granted"
    );
    // 12 and 13 are consecutive pages, but 12 is followed by 20 in the destination.
    assert_eq!(
        take(&r, 0, kv_run(12, 2), 0, false).unwrap_err(),
        "pages 12..14 were not granted"
    );
    // Past the destination's end.
    assert_eq!(
        take(&r, 0, kv_run(20, 2), 0, false).unwrap_err(),
        "pages 20..22 were not granted"
    );
    take(&r, 0, kv_run(10, 3), 0, false).unwrap();
    take(&r, 0, kv_run(20, 1), 0, false).unwrap();
}

#[test]
fn a_run_again_is_refused_per_buffer() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[10, 11, 12], None);
    take(&r, 0, kv_run(10, 3), 0, false).unwrap();
    // Another peer repeating a page of our buffer 0: refused, whoever sends it.
    assert_eq!(
        take(&r, 1, kv_run(11, 1), 0, false).unwrap_err(),
        "pages 11..12 of kv buffer 7 again (position 1 of the destination was already written)"
    );
    take(&r, 1, kv_run(11, 1), 1, false).unwrap(); // our buffer 1
                                                   // Parts of one page: disjoint ones pass, an overlap and the whole page do not.
    take(&r, 0, part_run(12, 0, 40), 2, true).unwrap();
    take(&r, 1, part_run(12, 40, 40), 2, true).unwrap();
    assert!(take(&r, 1, part_run(12, 60, 40), 2, true)
        .unwrap_err()
        .contains("again (bytes 60..100 of position 2"));
    assert!(take(&r, 0, kv_run(12, 1), 2, false).is_err());
}

#[test]
fn the_aux_slot_takes_one_row_per_peer_and_buffer() {
    let r = room(vec![peer(0, 1), peer(1, 1)], &[10], Some(5));
    assert_eq!(
        take(&r, 0, aux_run(6, 1), 0, false).unwrap_err(),
        "aux slot 6 was not granted"
    );
    assert_eq!(
        take(&r, 0, aux_run(5, 2), 0, false).unwrap_err(),
        "aux slot 5 was not granted"
    );
    take(&r, 0, aux_run(5, 1), 0, false).unwrap();
    assert_eq!(
        take(&r, 0, aux_run(5, 1), 0, false).unwrap_err(),
        "the row of aux buffer 3 again (it was already written)"
    );
    take(&r, 1, aux_run(5, 1), 0, false).unwrap(); // another peer's row
    take(&r, 0, aux_run(5, 1), 1, false).unwrap(); // another aux buffer of ours
    let no_aux = room(vec![peer(0, 1)], &[10], None);
    assert!(take(&no_aux, 0, aux_run(5, 1), 0, false).is_err());
}

// ---- send_destination ----

/// Sends the room's destination, recording what `send` was given and checking that it
/// is called under the room's lock (what keeps an Abort from being overtaken).
fn send(r: &DecodeRoom<F>, live: bool) -> (bool, Vec<(u32, Message)>) {
    let mut out = Vec::new();
    let went = r.send_destination(
        || live,
        |pages, aux| Message::Destination {
            room: 1,
            generation: 2,
            pages: pages.to_vec(),
            aux_slot: aux,
        },
        |p, m| {
            assert!(r.inner.try_lock().is_none(), "sent outside the room's lock");
            out.push((p.id, m.clone()));
        },
    );
    (went, out)
}

#[test]
fn the_destination_goes_out_once_to_every_peer() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[3, 1], Some(2));
    assert!(!r.sent());
    let (went, out) = send(&r, true);
    assert!(went && r.sent());
    let m = Message::Destination {
        room: 1,
        generation: 2,
        pages: vec![3, 1],
        aux_slot: Some(2),
    };
    assert_eq!(out, vec![(0, m.clone()), (1, m)]);
    assert_eq!(send(&r, true), (false, vec![]));
    assert!(!r.set_destination(&[4], None), "a second destination");
}

#[test]
fn no_destination_goes_out_when_the_room_is_not_live() {
    let r = room(vec![peer(0, 0)], &[3], None);
    assert_eq!(send(&r, false), (false, vec![]));
    assert!(!r.sent());
    // The refusal did not mark it sent: a later ask while live sends it.
    let (went, out) = send(&r, true);
    assert!(went && out.len() == 1);
}

#[test]
fn nothing_goes_out_before_the_destination() {
    let r: DecodeRoom<F> = DecodeRoom::new(vec![peer(0, 0)]);
    assert_eq!(send(&r, true), (false, vec![]));
    assert!(!r.sent());
    assert!(r.set_destination(&[3], None));
    assert!(send(&r, true).0);
}

// ---- quiet and the drain ----

#[test]
fn a_room_whose_destination_never_went_out_is_quiet() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[3], None);
    assert!(r.quiet());
    assert!(send(&r, true).0);
    assert!(!r.quiet());
    r.peer_quiet(&peer(0, 0));
    r.peer_quiet(&peer(2, 0)); // a stranger changes nothing
    assert!(!r.quiet());
    r.peer_quiet(&peer(1, 0));
    assert!(r.quiet());
}

#[test]
fn the_drain_deadline_is_armed_once_and_silent_peers_listed_until_quiet() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[3], None);
    send(&r, true);
    assert_eq!(r.silent_past_drain(1000, 500), vec![]); // armed at 1500
                                                        // Not re-armed by a later ask (with a shorter drain, it would be past at once).
    assert_eq!(r.silent_past_drain(1499, 0), vec![]);
    assert_eq!(r.silent_past_drain(1500, 500), vec![peer(0, 0), peer(1, 0)]);
    r.peer_quiet(&peer(0, 0));
    assert_eq!(r.silent_past_drain(1600, 500), vec![peer(1, 0)]);
    r.peer_quiet(&peer(1, 0));
    assert_eq!(r.silent_past_drain(1700, 500), vec![]);
    assert!(r.quiet());
}

// ---- what landed ----

#[test]
fn landed_bytes_are_counted_per_buffer_and_claims_per_peer() {
    let r = room(vec![peer(0, 0), peer(1, 0)], &[3, 4], None);
    r.count(0, &[(0, 10), (2, 5)], 0);
    r.count(1, &[(2, 1), (MAX_TRACKED_BUFFERS as u32, 7)], 0);
    r.claim(1, 2, false);
    let l = r.landed();
    assert_eq!(l.dest_pages, Some(2));
    assert_eq!(l.claims, vec![None, Some(2)]);
    assert_eq!(l.per_buffer, vec![10, 0, 6]);
}

// ---- the admission ledger ----

#[test]
fn whole_pages_are_taken_once() {
    let mut t = Taken::default();
    t.whole(0, 0, 3).unwrap();
    t.whole(1, 0, 3).unwrap(); // another buffer
    t.whole(0, 70, 2).unwrap(); // past the first word
    assert_eq!(t.whole(0, 2, 2).unwrap_err(), "position 2");
    assert_eq!(t.whole(0, 71, 1).unwrap_err(), "position 71");
    t.whole(0, 3, 1).unwrap();
}

#[test]
fn parts_of_a_page_are_disjoint_and_merge_when_adjacent() {
    let mut t = Taken::default();
    t.part(0, 5, 100, 50).unwrap();
    t.part(0, 5, 0, 50).unwrap();
    t.part(0, 5, 50, 50).unwrap(); // joins both neighbours
    assert_eq!(t.parts[&(0, 5)], vec![(0, 150)]);
    assert!(t.part(0, 5, 149, 2).is_err());
    assert!(t.part(0, 5, 0, 1).is_err());
    t.part(0, 5, 200, 10).unwrap();
    t.part(0, 5, 150, 10).unwrap(); // joins the first only
    assert_eq!(t.parts[&(0, 5)], vec![(0, 160), (200, 210)]);
    assert!(t.part(0, 5, 190, 20).is_err());
    t.part(0, 5, 190, 10).unwrap();
    assert_eq!(t.parts[&(0, 5)], vec![(0, 160), (190, 210)]);
    t.part(0, 6, 0, 10).unwrap(); // another position
}

#[test]
fn a_whole_page_and_a_part_of_it_exclude_each_other() {
    let mut t = Taken::default();
    t.whole(0, 1, 1).unwrap();
    assert!(t.part(0, 1, 0, 8).is_err());
    t.part(0, 2, 0, 8).unwrap();
    assert!(t.whole(0, 2, 1).is_err());
    assert!(t.whole(0, 0, 3).is_err());
}
