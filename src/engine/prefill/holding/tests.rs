//! Unit tests of the holding area: its bounds, generations, expiry and counts.
use super::*;
use crate::engine::peer_ref::TestPeer as P;

/// One engine (`.0`) over a connection (`.1`): a new connection is a new handle.
#[derive(Clone, Debug, PartialEq)]
struct C(u64, u32);

impl PeerRef for C {
    fn same(&self, other: &Self) -> bool {
        self == other
    }

    fn engine(&self) -> Option<u64> {
        Some(self.0)
    }
}

#[test]
fn an_engine_s_new_connection_supersedes_its_old_connection_s_records() {
    let mut h: Holding<C> = Holding::default();
    h.abort_early(&C(7, 1), 5, 3, "use 3 cancelled".into(), 100)
        .unwrap();
    // The same engine, reconnected, sends the next use's destination: the tombstone is
    // stale, and the room created next adopts only the destination.
    h.hold(&C(7, 2), 5, 4, vec![1], None, 100).unwrap();
    let (tombs, held) = h.adopt(5);
    assert!(tombs.is_empty());
    assert_eq!(held.len(), 1);
    // Another engine's tombstone is not touched by it.
    h.abort_early(&C(8, 1), 6, 3, "x".into(), 100).unwrap();
    h.hold(&C(7, 2), 6, 4, vec![1], None, 100).unwrap();
    assert_eq!(h.adopt(6).0.len(), 1);
    // A cleared use's record knows the engine across its connections too.
    h.clear_use(9, None, vec![(C(7, 1), 4)], true, 100).unwrap();
    assert_eq!(h.earlier_use(&C(7, 2), 9, 4), Some(None));
    assert_eq!(h.earlier_use(&C(7, 2), 9, 5), None);
    h.check();
}

fn small() -> Holding<P> {
    Holding::new(Limits {
        dests: 4,
        pages: 10,
        tombstones: 3,
        cleared: 2,
    })
}

#[test]
fn each_kind_of_record_has_its_own_bound() {
    let mut h = small();
    // Cleared records at their bound do not stop destinations or tombstones.
    h.clear_use(1, None, vec![], true, 100).unwrap();
    h.clear_use(2, None, vec![], true, 100).unwrap();
    assert_eq!(h.clear_use(3, None, vec![], true, 100), Err(Full));
    // Replacing a record of the same id is not an overflow.
    h.clear_use(2, Some("x".into()), vec![], false, 100)
        .unwrap();
    for id in 10..14 {
        h.hold(&P(1), id, 1, vec![0], None, 100).unwrap();
    }
    assert_eq!(h.hold(&P(1), 14, 1, vec![0], None, 100), Err(Full));
    for id in 20..23 {
        h.abort_early(&P(1), id, 1, "gone".into(), 100).unwrap();
    }
    assert_eq!(h.abort_early(&P(1), 23, 1, "gone".into(), 100), Err(Full));
    h.check();
    assert_eq!(h.counts(), (4, 4, 3, 2));
}

#[test]
fn destination_pages_are_bounded_across_destinations() {
    let mut h = small();
    h.hold(&P(1), 1, 1, vec![0; 6], None, 100).unwrap();
    assert_eq!(h.hold(&P(2), 2, 1, vec![0; 5], None, 100), Err(Full));
    h.hold(&P(2), 2, 1, vec![0; 4], None, 100).unwrap();
    h.check();
    assert_eq!(h.counts().1, 10);
}

#[test]
fn an_abort_supersedes_the_peer_s_held_destination_of_that_use() {
    let mut h = small();
    h.hold(&P(1), 7, 3, vec![1, 2], None, 100).unwrap();
    h.hold(&P(2), 7, 9, vec![4], None, 100).unwrap();
    h.abort_early(&P(1), 7, 3, "cancelled".into(), 100).unwrap();
    h.check();
    let (tombs, dests) = h.adopt(7);
    assert_eq!(tombs.len(), 1);
    assert_eq!(tombs[0].grave, Grave::Aborted("cancelled".into()));
    assert_eq!(dests.len(), 1, "the other engine's destination stays");
    assert!(dests[0].peer.same(&P(2)));
    h.check();
    assert_eq!(h.counts(), (0, 0, 0, 0));
}

/// A tombstone of an earlier use (a lower generation) must not fail the use whose
/// destination the same engine sent later.
#[test]
fn a_newer_destination_makes_an_older_tombstone_of_its_engine_stale() {
    let mut h = small();
    h.abort_early(&P(1), 7, 3, "first use".into(), 100).unwrap();
    h.abort_early(&P(2), 7, 5, "other engine".into(), 100)
        .unwrap();
    h.hold(&P(1), 7, 4, vec![1], None, 100).unwrap();
    h.check();
    let (tombs, dests) = h.adopt(7);
    assert_eq!(dests.len(), 1);
    assert_eq!(tombs.len(), 1, "only the other engine's tombstone remains");
    assert!(tombs[0].peer.same(&P(2)));
}

#[test]
fn a_lost_engine_s_held_destinations_become_tombstones() {
    let mut h = small();
    h.hold(&P(1), 7, 3, vec![1, 2, 3], None, 100).unwrap();
    h.hold(&P(1), 8, 4, vec![1], None, 100).unwrap();
    h.hold(&P(2), 8, 9, vec![4], None, 100).unwrap();
    assert_eq!(h.peer_lost(&P(1), "connection closed", 100), 0);
    h.check();
    assert_eq!(
        h.counts(),
        (1, 1, 2, 0),
        "page lists of the lost engine freed"
    );
    let (tombs, dests) = h.adopt(8);
    assert_eq!(tombs.len(), 1);
    assert_eq!(tombs[0].grave, Grave::Lost("connection closed".into()));
    assert_eq!(dests.len(), 1);
    // Beyond the tombstone bound, the count of those that found no place.
    let mut h = small();
    for id in 0..4 {
        h.hold(&P(1), id, 1, vec![0], None, 100).unwrap();
    }
    assert_eq!(h.peer_lost(&P(1), "x", 100), 1);
    h.check();
}

#[test]
fn cleared_records_tell_late_messages_from_new_uses() {
    let mut h = small();
    // A use that had engine 1's destination (generation 5) and waited for no other.
    h.clear_use(7, Some("aborted".into()), vec![(P(1), 5)], true, 100)
        .unwrap();
    assert_eq!(h.earlier_use(&P(1), 7, 5), Some(Some("aborted".into())));
    assert_eq!(h.earlier_use(&P(1), 7, 6), None, "a newer use");
    assert_eq!(
        h.earlier_use(&P(2), 7, 1),
        None,
        "not an engine of that use"
    );
    // A use that still waited: an engine's first message belongs to it.
    h.clear_use(8, None, vec![], false, 100).unwrap();
    assert_eq!(h.earlier_use(&P(2), 8, 3), Some(None));
    assert_eq!(h.earlier_use(&P(2), 8, 3), Some(None), "the same late use");
    assert_eq!(h.earlier_use(&P(2), 8, 4), None);
}

#[test]
fn held_destinations_of_a_cleared_use_are_taken_out_with_its_reason() {
    let mut h = small();
    h.hold(&P(1), 7, 5, vec![1, 2], None, 100).unwrap();
    h.clear_use(7, Some("failed".into()), vec![], false, 100)
        .unwrap();
    let answered = h.take_cleared_dests(7);
    assert_eq!(answered.len(), 1);
    assert_eq!(answered[0].1, Some("failed".into()));
    h.check();
    assert_eq!(h.counts(), (0, 0, 0, 1));
}

#[test]
fn records_expire_and_expired_destinations_are_returned_to_answer() {
    let mut h = small();
    h.hold(&P(1), 7, 5, vec![1, 2], None, 50).unwrap();
    h.hold(&P(1), 8, 5, vec![1], None, 150).unwrap();
    h.abort_early(&P(1), 9, 5, "x".into(), 50).unwrap();
    h.clear_use(10, None, vec![], true, 50).unwrap();
    let gone = h.expire(100);
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].0, 7);
    h.check();
    assert_eq!(h.counts(), (1, 1, 0, 0));
    assert_eq!(h.expire(200).len(), 1);
    h.check();
    assert_eq!(h.counts(), (0, 0, 0, 0));
}

/// The counts match the records whatever the sequence of operations (a small
/// deterministic random walk over every operation).
#[test]
fn counts_stay_exact_under_any_sequence() {
    let mut h = small();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for step in 0..20_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let peer = P((x % 3) as u32);
        let id = (x >> 8) % 5;
        let generation = (x >> 16) % 6;
        let now = step / 10;
        match (x >> 24) % 8 {
            0 | 1 => {
                let pages = vec![0; ((x >> 32) % 4) as usize];
                let _ = h.hold(&peer, id, generation, pages, None, now + 30);
            }
            2 => {
                let _ = h.abort_early(&peer, id, generation, "a".into(), now + 30);
            }
            3 => {
                h.peer_lost(&peer, "l", now + 30);
            }
            4 => {
                h.adopt(id);
            }
            5 => {
                let _ = h.clear_use(id, None, vec![(peer.clone(), generation)], false, now + 30);
            }
            6 => {
                h.take_cleared_dests(id);
            }
            _ => {
                h.expire(now);
            }
        }
        h.check();
    }
}
