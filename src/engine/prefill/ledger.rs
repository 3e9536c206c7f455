//! A prefill room's ledger of its decode engines: which engines may send it destinations
//! and aborts (the binding), the destinations that arrived, the decode generations heard
//! otherwise; and the decisions on each destination and abort, returned as outcomes.
//!
//! Pure: no lock, no clock, no I/O, generic over the peer handle. The engine
//! (`arrivals/`) reads the room's standing and asks the ledger under the room's lock,
//! then applies the outcome once it holds no lock: messages, the transition through the
//! lifecycle, counters and logs. The simulator (`src/engine/sim/`) drives the same ledger
//! with simulated peers.

use std::sync::Arc;

use crate::engine::bugs::{self, Bug};
use crate::engine::peer_ref::PeerRef;

/// Where one decode engine wants the room's pages.
#[derive(Clone)]
pub(crate) struct Dest<P> {
    pub peer: P,
    /// The decode room's generation: every message about the room carries it.
    pub generation: u64,
    pub pages: Arc<[u32]>,
    pub aux: Option<u32>,
}

/// What the room is when a message about it is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing<'a> {
    Live,
    Succeeded,
    /// With the failure's message.
    Failed(&'a str),
}

/// What a destination does to the room.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnDestination {
    /// The room is bound to other decode engines: the sender learns nothing of it and
    /// nothing changes.
    NotBound,
    /// The room already ended: the destination is refused, saying why.
    Ended(String),
    /// A second destination from one engine: the room fails as PROTOCOL with `why`.
    /// `known`: it names the generation the room already holds, whose writes may be in
    /// flight (the failure tells that destination); otherwise the new one is refused.
    Second { why: String, known: bool },
    /// Kept; `complete`: every destination the room waits for has arrived.
    Attached { complete: bool },
}

/// What a decode engine's abort does to the room.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnAbort {
    /// The room is bound to other decode engines: refused, nothing changes.
    NotBound,
    /// It concerns this use of the room, which fails with the engine's reason.
    Fails,
    /// It names another generation than the destination held from that engine, or no
    /// destination once the room has all it waits for: a late message about an earlier
    /// use of the id, dropped.
    Stale,
}

/// Whom a failure tells ([`Ledger::told`]): each decode engine with the generation of
/// its destination.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Told<P> {
    /// Get an Abort with the reason.
    pub aborts: Vec<(P, u64)>,
    /// Get, over RDMA, the acknowledgement of the Abort once our writes into their
    /// pages are done.
    pub acks: Vec<(P, u64)>,
}

/// The decode engines of one prefill room.
pub(crate) struct Ledger<P> {
    /// How many destinations the room waits for.
    expected: usize,
    /// The decode engines (by engine id) that may send this room a destination or an
    /// abort, if the room is bound to them; then `expected` is their number.
    bound: Option<Box<[u64]>>,
    dests: Vec<Dest<P>>,
    /// Decode generations heard from engines by messages that were not destinations
    /// (an abort that came before the destination), kept for the cleared-use record: at
    /// most one per engine and generation, and none once the room ended.
    known: Vec<(P, u64)>,
}

impl<P: PeerRef> Ledger<P> {
    pub fn new(expected: usize, bound: Option<Vec<u64>>) -> Self {
        Ledger {
            expected,
            bound: bound.map(Vec::into_boxed_slice),
            dests: Vec::new(),
            known: Vec::new(),
        }
    }

    /// Whether the engine with id `engine` (none if it did not authenticate as one) may
    /// send this room a destination or an abort: any engine unless the room is bound,
    /// else one it is bound to.
    pub fn admits(&self, engine: Option<u64>) -> bool {
        match &self.bound {
            None => true,
            Some(ids) => engine.is_some_and(|id| ids.contains(&id)),
        }
    }

    /// Every destination it waits for arrived.
    pub fn complete(&self) -> bool {
        self.dests.len() >= self.expected
    }

    /// The destinations that arrived, in order.
    pub fn dests(&self) -> &[Dest<P>] {
        &self.dests
    }

    /// Each destination's engine and generation: the parties a failure tells.
    pub fn parties(&self) -> Vec<(P, u64)> {
        self.dests
            .iter()
            .map(|d| (d.peer.clone(), d.generation))
            .collect()
    }

    /// Whom a failure tells: every destination but `origin`'s gets an Abort and, over
    /// RDMA, its acknowledgement once our writes into its pages are done. `origin` told
    /// us: a lost engine needs nothing, and an engine's abort is acknowledged where it
    /// arrives, once.
    pub fn told(&self, origin: Option<&P>) -> Told<P> {
        let is_origin = |p: &P| origin.is_some_and(|o| o.same(p));
        let parties = |also_origin: bool| {
            let dests = self.dests.iter();
            dests
                .filter(|d| also_origin || !is_origin(&d.peer))
                .map(|d| (d.peer.clone(), d.generation))
                .collect()
        };
        Told {
            aborts: parties(false),
            acks: parties(bugs::on(Bug::AckTheOrigin)),
        }
    }

    /// Whether the room holds `peer`'s destination of generation `generation`.
    pub fn holds(&self, peer: &P, generation: u64) -> bool {
        self.dests
            .iter()
            .any(|d| d.peer.same(peer) && d.generation == generation)
    }

    /// Every decode generation the room heard of, by destination or otherwise: what a
    /// cleared use of the id leaves behind.
    pub fn generations(&self) -> Vec<(P, u64)> {
        let mut gens = self.parties();
        gens.extend(self.known.iter().cloned());
        gens
    }

    /// Records that `peer` knows the room as `generation` by a message that was not a
    /// destination (an abort held before the room was created).
    pub fn remember(&mut self, peer: &P, generation: u64) {
        if !self.known_as(peer, generation) {
            self.known.push((peer.clone(), generation));
        }
    }

    fn known_as(&self, peer: &P, generation: u64) -> bool {
        self.known
            .iter()
            .any(|(k, g)| k.same(peer) && *g == generation)
    }

    /// A destination from `peer` (engine id `engine`) for decode generation `generation`,
    /// with the room `standing` as read under the room's lock.
    pub fn destination(
        &mut self,
        engine: Option<u64>,
        standing: Standing<'_>,
        dest: Dest<P>,
        name: &str,
        id: u64,
    ) -> OnDestination {
        if !self.admits(engine) {
            return OnDestination::NotBound;
        }
        match standing {
            Standing::Failed(why) => {
                return OnDestination::Ended(format!("prefill room {id} already failed: {why}"))
            }
            Standing::Succeeded => {
                return OnDestination::Ended(format!("prefill room {id} already finished"))
            }
            Standing::Live => {}
        }
        if self.dests.iter().any(|d| d.peer.same(&dest.peer)) || self.complete() {
            return OnDestination::Second {
                why: format!("prefill room {id} got a second destination from {name}"),
                known: self.holds(&dest.peer, dest.generation),
            };
        }
        self.dests.push(dest);
        OnDestination::Attached {
            complete: self.complete(),
        }
    }

    /// An abort from `peer` (engine id `engine`) naming decode generation `generation`,
    /// with the room `standing` as read under the room's lock.
    ///
    /// It fails the room when the room has that destination, or has none from that
    /// engine while still waiting for destinations (the decode side gave up before its
    /// destination went out; the generation is remembered for the cleared-use record).
    pub fn abort(
        &mut self,
        engine: Option<u64>,
        standing: Standing<'_>,
        peer: &P,
        generation: u64,
    ) -> OnAbort {
        if !self.admits(engine) {
            return OnAbort::NotBound;
        }
        match self.dests.iter().find(|d| d.peer.same(peer)) {
            Some(d) if d.generation == generation => OnAbort::Fails,
            Some(_) => OnAbort::Stale,
            None if !self.complete() => {
                if standing == Standing::Live {
                    self.remember(peer, generation);
                }
                OnAbort::Fails
            }
            None => OnAbort::Stale,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::peer_ref::TestPeer as P;

    fn dest(peer: u32, generation: u64) -> Dest<P> {
        Dest {
            peer: P(peer),
            generation,
            pages: vec![1, 2].into(),
            aux: None,
        }
    }

    #[test]
    fn destinations_attach_until_the_room_has_all_it_waits_for() {
        let mut l = Ledger::new(2, None);
        let live = Standing::Live;
        assert_eq!(
            l.destination(None, live, dest(1, 7), "d1", 5),
            OnDestination::Attached { complete: false }
        );
        assert_eq!(
            l.destination(None, live, dest(2, 9), "d2", 5),
            OnDestination::Attached { complete: true }
        );
        assert_eq!(l.parties(), vec![(P(1), 7), (P(2), 9)]);
        assert!(l.holds(&P(2), 9) && !l.holds(&P(2), 7));
    }

    #[test]
    fn a_second_destination_fails_the_room_and_says_whether_it_was_the_known_one() {
        let mut l = Ledger::new(2, None);
        l.destination(None, Standing::Live, dest(1, 7), "d1", 5);
        match l.destination(None, Standing::Live, dest(1, 7), "d1", 5) {
            OnDestination::Second { why, known } => {
                assert!(known);
                assert_eq!(why, "prefill room 5 got a second destination from d1");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            l.destination(None, Standing::Live, dest(1, 8), "d1", 5),
            OnDestination::Second {
                why: "prefill room 5 got a second destination from d1".into(),
                known: false
            }
        );
        // One more than it waits for, from another engine, is a second one too.
        let mut full = Ledger::new(1, None);
        full.destination(None, Standing::Live, dest(1, 7), "d1", 5);
        assert!(matches!(
            full.destination(None, Standing::Live, dest(2, 3), "d2", 5),
            OnDestination::Second { known: false, .. }
        ));
        assert_eq!(l.dests().len(), 1);
    }

    #[test]
    fn a_failure_tells_every_party_but_the_engine_that_told_us() {
        let mut l = Ledger::new(2, None);
        l.destination(None, Standing::Live, dest(1, 7), "d1", 5);
        l.destination(None, Standing::Live, dest(2, 9), "d2", 5);
        let both = vec![(P(1), 7), (P(2), 9)];
        let told = |aborts: &[(P, u64)]| Told {
            aborts: aborts.to_vec(),
            acks: aborts.to_vec(),
        };
        assert_eq!(l.told(None), told(&both));
        assert_eq!(l.told(Some(&P(1))), told(&both[1..]));
        assert_eq!(l.told(Some(&P(3))), told(&both));
    }

    #[test]
    fn an_ended_room_refuses_destinations_with_its_reason() {
        let mut l = Ledger::new(1, None);
        assert_eq!(
            l.destination(None, Standing::Failed("aborted"), dest(1, 7), "d1", 5),
            OnDestination::Ended("prefill room 5 already failed: aborted".into())
        );
        assert_eq!(
            l.destination(None, Standing::Succeeded, dest(1, 7), "d1", 5),
            OnDestination::Ended("prefill room 5 already finished".into())
        );
        assert!(l.dests().is_empty());
    }

    #[test]
    fn a_bound_room_hears_only_its_engines() {
        let mut l = Ledger::new(1, Some(vec![42]));
        assert_eq!(
            l.destination(Some(41), Standing::Live, dest(1, 7), "d1", 5),
            OnDestination::NotBound
        );
        assert_eq!(
            l.destination(None, Standing::Live, dest(1, 7), "d1", 5),
            OnDestination::NotBound
        );
        assert_eq!(
            l.abort(Some(41), Standing::Live, &P(1), 7),
            OnAbort::NotBound
        );
        assert!(l.generations().is_empty());
        assert_eq!(
            l.destination(Some(42), Standing::Live, dest(2, 7), "d2", 5),
            OnDestination::Attached { complete: true }
        );
        // Even a room that ended tells a stranger nothing.
        assert_eq!(
            l.destination(Some(41), Standing::Failed("x"), dest(1, 7), "d1", 5),
            OnDestination::NotBound
        );
    }

    #[test]
    fn an_abort_fails_the_room_only_for_its_own_use() {
        let mut l = Ledger::new(2, None);
        l.destination(None, Standing::Live, dest(1, 7), "d1", 5);
        assert_eq!(l.abort(None, Standing::Live, &P(1), 6), OnAbort::Stale);
        assert_eq!(l.abort(None, Standing::Live, &P(1), 7), OnAbort::Fails);
        // No destination from engine 2 yet, and the room still waits: it gave up first.
        assert_eq!(l.abort(None, Standing::Live, &P(2), 3), OnAbort::Fails);
        assert_eq!(l.abort(None, Standing::Live, &P(2), 3), OnAbort::Fails);
        assert_eq!(l.generations(), vec![(P(1), 7), (P(2), 3)]);
        // Once the room ended, nothing more is remembered.
        assert_eq!(
            l.abort(None, Standing::Failed("x"), &P(3), 1),
            OnAbort::Fails
        );
        assert_eq!(l.generations().len(), 2);
        // A complete room drops an abort from an engine it has no destination from.
        let mut full = Ledger::new(1, None);
        full.destination(None, Standing::Live, dest(1, 7), "d1", 5);
        assert_eq!(full.abort(None, Standing::Live, &P(2), 7), OnAbort::Stale);
    }
}
