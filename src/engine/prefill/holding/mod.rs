//! The prefill side's early-arrival store: what decode engines said about a room id
//! that has no room here (yet, or any more), bounded in count, pages and time.
//!
//! Three kinds of record, each with its own bound, so that a burst of one never starves
//! another (a burst of failed-and-cleared rooms must not make legitimate early
//! destinations be refused):
//! - a **held destination**: a decode engine's destination that came before the local
//!   scheduler created the room; the room adopts it when created;
//! - a **tombstone**: the room will fail when created, with an Abort a decode engine
//!   sent before the room existed, or because the engine that sent its destination was
//!   lost meanwhile;
//! - a **cleared-use record**: what a cleared room leaves behind for a while, so that
//!   late messages about it are told apart from messages about a new use of its id.
//!
//! Generations. A decode engine's messages about one id reach us in order (one control
//! connection) and its generations only grow: a use of an id is cleared on the decode
//! side (and its last message sent) before the next use of the id is created there. So
//! a message from an engine supersedes that engine's records for the id with a lower
//! generation: a destination makes an older tombstone stale, an abort an older held
//! destination. An engine is known by its engine id where the peer gave one
//! ([`PeerRef::same_engine`]), so this holds across a lost connection and the new one:
//! its generations go on where they stopped (found by the simulator, issue 37: an old
//! connection's tombstone failed the next use of the id).
//!
//! Overflow is refused, never silent: each `hold`, `abort_early` and `clear_use` says
//! whether the record was kept, and the engine counts and answers what was not.

use std::collections::HashMap;

use crate::engine::bugs::{self, Bug};
// How a peer is known to the store: compared by identity (the engine's `Arc<Peer>`).
use crate::engine::peer_ref::PeerRef;

/// The store's bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Held destinations at once.
    pub dests: usize,
    /// Destination pages held at once across held destinations: a peer cannot make the
    /// store allocate more than this many page numbers.
    pub pages: usize,
    /// Tombstones at once.
    pub tombstones: usize,
    /// Cleared-use records at once.
    pub cleared: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            dests: 65_536,
            pages: 16 << 20,
            tombstones: 65_536,
            cleared: 65_536,
        }
    }
}

/// A destination that arrived before the local scheduler created its room.
pub(crate) struct Held<P> {
    pub peer: P,
    pub generation: u64,
    pub pages: Vec<u32>,
    pub aux: Option<u32>,
    expires_ms: u64,
}

/// Why a tombstone fails its room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Grave {
    /// The decode engine aborted its room before ours existed (its reason).
    Aborted(String),
    /// The decode engine that sent the destination was lost before the room existed.
    Lost(String),
}

/// A room that will fail when created, unless the record expires first.
pub(crate) struct Tombstone<P> {
    pub peer: P,
    pub generation: u64,
    pub grave: Grave,
    expires_ms: u64,
}

/// What a cleared prefill room leaves behind for a while.
///
/// Every decode use sends at least one message (its destination, or an abort when it
/// ends without success). So the first message from an engine about an id after a use
/// was cleared belongs to that use if the engine was one the use still waited for;
/// messages with a generation at most the one attributed to the old use are late ones
/// for it; higher generations belong to a new use.
struct Cleared<P> {
    /// Why the use failed, if it failed: the answer to its late destinations.
    reason: Option<String>,
    /// Decode generations attributed to the old use, per decode engine.
    gens: Vec<(P, u64)>,
    /// Whether the old use had every destination it expected (then an engine not in
    /// `gens` had nothing to do with it).
    complete: bool,
    expires_ms: u64,
}

/// A record that did not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

/// Early arrivals from decode engines (see the module documentation).
pub(crate) struct Holding<P> {
    limits: Limits,
    dests: HashMap<u64, Vec<Held<P>>>,
    tombs: HashMap<u64, Vec<Tombstone<P>>>,
    cleared: HashMap<u64, Cleared<P>>,
    n_dests: usize,
    n_pages: usize,
    n_tombs: usize,
}

impl<P: PeerRef> Default for Holding<P> {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

impl<P: PeerRef> Holding<P> {
    pub fn new(limits: Limits) -> Self {
        Holding {
            limits,
            dests: HashMap::new(),
            tombs: HashMap::new(),
            cleared: HashMap::new(),
            n_dests: 0,
            n_pages: 0,
            n_tombs: 0,
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Held destinations, their pages, tombstones and cleared-use records now.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize, usize, usize) {
        (self.n_dests, self.n_pages, self.n_tombs, self.cleared.len())
    }

    /// Nothing is held: no destination, no tombstone, no cleared-use record.
    pub fn is_empty(&self) -> bool {
        self.n_dests == 0 && self.n_tombs == 0 && self.cleared.is_empty()
    }

    /// How many records are held, of every kind.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.n_dests + self.n_tombs + self.cleared.len()
    }

    /// Removes `peer`'s held destinations for `id` with a generation at most `upto`.
    fn drop_dests(&mut self, id: u64, peer: &P, upto: u64) {
        let Some(list) = self.dests.get_mut(&id) else {
            return;
        };
        let (mut n, mut pages) = (0, 0);
        list.retain(|d| {
            let stale = d.peer.same_engine(peer) && d.generation <= upto;
            if stale {
                n += 1;
                pages += d.pages.len();
            }
            !stale
        });
        if list.is_empty() {
            self.dests.remove(&id);
        }
        self.n_dests -= n;
        self.n_pages -= pages;
    }

    /// Removes `peer`'s tombstones for `id` with a generation below `below`.
    fn drop_tombs(&mut self, id: u64, peer: &P, below: u64) {
        let Some(list) = self.tombs.get_mut(&id) else {
            return;
        };
        let before = list.len();
        list.retain(|t| !(t.peer.same_engine(peer) && t.generation < below));
        self.n_tombs -= before - list.len();
        if list.is_empty() {
            self.tombs.remove(&id);
        }
    }

    /// Holds a destination for room `id`, which does not exist yet. It makes `peer`'s
    /// tombstones for the id with a lower generation stale (they were for an earlier
    /// use). Refused when the destinations or their pages are at their bound.
    pub fn hold(
        &mut self,
        peer: &P,
        id: u64,
        generation: u64,
        pages: Vec<u32>,
        aux: Option<u32>,
        expires_ms: u64,
    ) -> Result<(), Full> {
        // An older abort from the same engine was for an earlier use of the id.
        if !bugs::on(Bug::TombstoneAnyGeneration) {
            self.drop_tombs(id, peer, generation);
        }
        if self.n_dests >= self.limits.dests || self.n_pages + pages.len() > self.limits.pages {
            return Err(Full);
        }
        self.n_dests += 1;
        self.n_pages += pages.len();
        self.dests.entry(id).or_default().push(Held {
            peer: peer.clone(),
            generation,
            pages,
            aux,
            expires_ms,
        });
        Ok(())
    }

    /// Records `peer`'s Abort of decode use `generation` of room `id`, which does not
    /// exist yet: the room fails with it when created. The Abort supersedes the peer's
    /// held destinations for the id up to that generation. Refused (the Abort is then
    /// only counted) when the tombstones are at their bound.
    pub fn abort_early(
        &mut self,
        peer: &P,
        id: u64,
        generation: u64,
        reason: String,
        expires_ms: u64,
    ) -> Result<(), Full> {
        self.drop_dests(id, peer, generation);
        self.bury(peer, id, generation, Grave::Aborted(reason), expires_ms)
    }

    fn bury(
        &mut self,
        peer: &P,
        id: u64,
        generation: u64,
        grave: Grave,
        expires_ms: u64,
    ) -> Result<(), Full> {
        let list = self.tombs.entry(id).or_default();
        if let Some(t) = list.iter_mut().find(|t| t.peer.same_engine(peer)) {
            if t.generation <= generation {
                t.peer = peer.clone();
                t.generation = generation;
                t.grave = grave;
                t.expires_ms = expires_ms;
            }
            return Ok(());
        }
        if self.n_tombs >= self.limits.tombstones {
            if list.is_empty() {
                self.tombs.remove(&id);
            }
            return Err(Full);
        }
        list.push(Tombstone {
            peer: peer.clone(),
            generation,
            grave,
            expires_ms,
        });
        self.n_tombs += 1;
        Ok(())
    }

    /// `peer` was lost: each destination it left here becomes a tombstone, so that its
    /// room fails at once when created (the decode room it belonged to has failed with
    /// the loss) instead of waiting for its bootstrap deadline. Returns how many held
    /// destinations found no place as a tombstone.
    pub fn peer_lost(&mut self, peer: &P, why: &str, expires_ms: u64) -> usize {
        let mut lost = Vec::new();
        for (&id, list) in self.dests.iter() {
            for d in list.iter().filter(|d| d.peer.same(peer)) {
                lost.push((id, d.generation));
            }
        }
        let mut overflow = 0;
        for (id, generation) in lost {
            self.drop_dests(id, peer, generation);
            if self
                .bury(
                    peer,
                    id,
                    generation,
                    Grave::Lost(why.to_string()),
                    expires_ms,
                )
                .is_err()
            {
                overflow += 1;
            }
        }
        overflow
    }

    /// Everything waiting for room `id`, which was just created: its tombstones and its
    /// held destinations.
    pub fn adopt(&mut self, id: u64) -> (Vec<Tombstone<P>>, Vec<Held<P>>) {
        let tombs = self.tombs.remove(&id).unwrap_or_default();
        let dests = self.dests.remove(&id).unwrap_or_default();
        self.n_tombs -= tombs.len();
        self.n_dests -= dests.len();
        self.n_pages -= dests.iter().map(|d| d.pages.len()).sum::<usize>();
        (tombs, dests)
    }

    /// Records a cleared use of room `id`: the decode generations it knew, whether it
    /// had every destination it expected, and why it failed. Refused when the records
    /// are at their bound.
    pub fn clear_use(
        &mut self,
        id: u64,
        reason: Option<String>,
        gens: Vec<(P, u64)>,
        complete: bool,
        expires_ms: u64,
    ) -> Result<(), Full> {
        if !self.cleared.contains_key(&id) && self.cleared.len() >= self.limits.cleared {
            return Err(Full);
        }
        self.cleared.insert(
            id,
            Cleared {
                reason,
                gens,
                complete,
                expires_ms,
            },
        );
        Ok(())
    }

    /// Whether a message from `peer` about `id` with decode generation `generation`
    /// belongs to an earlier, cleared use of the id (see [`Cleared`]); if so, with that
    /// use's failure reason.
    pub fn earlier_use(&mut self, peer: &P, id: u64, generation: u64) -> Option<Option<String>> {
        let c = self.cleared.get_mut(&id)?;
        if let Some((_, g)) = c.gens.iter().find(|(p, _)| p.same_engine(peer)) {
            return (generation <= *g).then(|| c.reason.clone());
        }
        if c.complete {
            return None;
        }
        c.gens.push((peer.clone(), generation));
        Some(c.reason.clone())
    }

    /// The held destinations for `id` that belong to a cleared use of it, taken out of
    /// the store, each with that use's failure reason.
    pub fn take_cleared_dests(&mut self, id: u64) -> Vec<(Held<P>, Option<String>)> {
        if !self.cleared.contains_key(&id) {
            return Vec::new();
        }
        let Some(list) = self.dests.remove(&id) else {
            return Vec::new();
        };
        let mut keep = Vec::new();
        let mut answered = Vec::new();
        for d in list {
            match self.earlier_use(&d.peer, id, d.generation) {
                Some(reason) => answered.push((d, reason)),
                None => keep.push(d),
            }
        }
        self.n_dests -= answered.len();
        self.n_pages -= answered.iter().map(|(d, _)| d.pages.len()).sum::<usize>();
        if !keep.is_empty() {
            self.dests.insert(id, keep);
        }
        answered
    }

    /// Drops every record that expired by `now`; returns the held destinations among
    /// them (with their room ids), which the engine answers.
    pub fn expire(&mut self, now: u64) -> Vec<(u64, Held<P>)> {
        if self.is_empty() {
            return Vec::new();
        }
        let mut expired = Vec::new();
        for (&id, list) in self.dests.iter_mut() {
            let (gone, keep): (Vec<Held<P>>, Vec<Held<P>>) =
                list.drain(..).partition(|d| d.expires_ms <= now);
            *list = keep;
            expired.extend(gone.into_iter().map(|d| (id, d)));
        }
        self.dests.retain(|_, l| !l.is_empty());
        self.n_dests -= expired.len();
        self.n_pages -= expired.iter().map(|(_, d)| d.pages.len()).sum::<usize>();
        let mut n_tombs = 0;
        for list in self.tombs.values_mut() {
            list.retain(|t| t.expires_ms > now);
            n_tombs += list.len();
        }
        self.tombs.retain(|_, l| !l.is_empty());
        self.n_tombs = n_tombs;
        self.cleared.retain(|_, c| c.expires_ms > now);
        expired
    }

    /// Checks the counts against the records and the bounds (tests).
    #[cfg(test)]
    fn check(&self) {
        let dests: usize = self.dests.values().map(Vec::len).sum();
        let pages: usize = self.dests.values().flatten().map(|d| d.pages.len()).sum();
        let tombs: usize = self.tombs.values().map(Vec::len).sum();
        assert_eq!(self.n_dests, dests, "held destination count");
        assert_eq!(self.n_pages, pages, "held page count");
        assert_eq!(self.n_tombs, tombs, "tombstone count");
        assert!(self.dests.values().all(|l| !l.is_empty()));
        assert!(self.tombs.values().all(|l| !l.is_empty()));
        assert!(self.n_dests <= self.limits.dests);
        assert!(self.n_pages <= self.limits.pages);
        assert!(self.n_tombs <= self.limits.tombstones);
        assert!(self.cleared.len() <= self.limits.cleared);
    }
}

#[cfg(test)]
mod tests;
