//! A decode room's data: the prefill engines it pulls from, its destination, what each
//! engine has delivered and claimed, and (over RDMA) which engines can no longer write
//! into it. The checks on that data are here too; what they lead to (a transition, a
//! message) is the engine's.
//!
//! No I/O and no clock: the room is generic over the peer handle ([`PeerRef`]), takes
//! what it needs to know of a peer as arguments ([`Facts`], `owed`) and the time as a
//! number, and hands what must go out to a closure the engine gives (see
//! [`DecodeRoom::send_destination`]). Unit tests (`room/tests.rs`) drive it with a fake
//! peer.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::control::Peer;
use crate::engine::bugs::{self, Bug};
use crate::engine::peer_ref::PeerRef;
use crate::proto::{DataHeader, Message, Target};

pub(crate) struct DecodeRoom<P: PeerRef = Arc<Peer>> {
    /// The prefill engines the room pulls from.
    pub peers: Vec<P>,
    /// Under this lock: whether the room's destination went out, and the Aborts sent
    /// when it fails (see `DecodeEngine::send_destination`).
    inner: Mutex<DecodeState>,
}

#[derive(Default)]
struct DecodeState {
    dest: Option<Destination>,
    /// The destination went out to the peers.
    sent: bool,
    /// Per peer (same order as `peers`).
    progress: Vec<Progress>,
    /// RDMA, per peer: it can write into the room no more (it acknowledged the abort, or
    /// its queue pairs are shut).
    quiet: Vec<bool>,
    /// RDMA: engine-clock ms after which a failed room's silent peers are cut off.
    drain_deadline_ms: Option<u64>,
    /// KV bytes landed per our kv buffer, from every peer.
    landed: Vec<u64>,
    /// The destination bytes admitted runs took.
    taken: Taken,
}

/// Which of a room's destination bytes admitted data runs took (TCP), so that no byte is
/// written twice: a peer that repeats a run and skips another cannot make the byte
/// counts of its Done add up, and no two receiver threads ever hold the same KV bytes.
#[derive(Default)]
struct Taken {
    /// Whole pages, per our kv buffer: one bit per position in the destination.
    pages: HashMap<u32, Vec<u64>>,
    /// Parts of pages (head slices, a smaller prefill page inside a decode page): per
    /// (our kv buffer, position in the destination), the byte ranges taken, sorted,
    /// disjoint and merged when adjacent.
    parts: HashMap<(u32, u32), Vec<(u32, u32)>>,
    /// Aux rows, per (peer, aux buffer): every prefill engine of a room (pipeline
    /// stages, tensor-parallel ranks) sends the request's row, each once.
    aux: HashSet<(usize, u32)>,
}

/// The most separate byte ranges one destination page may be filled in (a page of 64
/// tokens sliced by heads for 8 prefill ranks, in token-major order, takes 512).
const MAX_PARTS_PER_PAGE: usize = 4096;

impl Taken {
    /// Takes destination positions `pos..pos + n` of kv buffer `buffer` whole.
    fn whole(&mut self, buffer: u32, pos: u32, n: u32) -> Result<(), String> {
        let end = pos + n;
        let bits = self.pages.entry(buffer).or_default();
        let words = (end as usize).div_ceil(64);
        if bits.len() < words {
            bits.resize(words, 0);
        }
        let taken = |i: u32| bits[(i / 64) as usize] & (1 << (i % 64)) != 0;
        let again =
            |i: u32| taken(i) || (!self.parts.is_empty() && self.parts.contains_key(&(buffer, i)));
        if let Some(i) = (pos..end).find(|&i| again(i) && !bugs::on(Bug::CountsBytes)) {
            return Err(format!("position {i}"));
        }
        for i in pos..end {
            bits[(i / 64) as usize] |= 1 << (i % 64);
        }
        Ok(())
    }

    /// Takes bytes `off..off + len` of destination position `pos` of kv buffer `buffer`.
    fn part(&mut self, buffer: u32, pos: u32, off: u32, len: u32) -> Result<(), String> {
        let whole = self
            .pages
            .get(&buffer)
            .and_then(|b| b.get((pos / 64) as usize))
            .is_some_and(|w| w & (1 << (pos % 64)) != 0);
        let (a, b) = (off, off + len);
        let ranges = self.parts.entry((buffer, pos)).or_default();
        // The first range that ends after `a`: it must also start at or after `b`.
        let i = ranges.partition_point(|&(_, e)| e <= a);
        let again = whole || ranges.get(i).is_some_and(|&(s, _)| s < b);
        if again && !bugs::on(Bug::CountsBytes) {
            return Err(format!("bytes {a}..{b} of position {pos}"));
        }
        if ranges.len() >= MAX_PARTS_PER_PAGE {
            return Err(format!(
                "more than {MAX_PARTS_PER_PAGE} separate byte ranges of position {pos}"
            ));
        }
        let joins_prev = i > 0 && ranges[i - 1].1 == a;
        let joins_next = ranges.get(i).is_some_and(|&(s, _)| s == b);
        match (joins_prev, joins_next) {
            (true, true) => {
                ranges[i - 1].1 = ranges[i].1;
                ranges.remove(i);
            }
            (true, false) => ranges[i - 1].1 = b,
            (false, true) => ranges[i].0 = a,
            (false, false) => ranges.insert(i, (a, b)),
        }
        Ok(())
    }
}

#[derive(Default, Clone, Copy)]
struct Progress {
    /// KV bytes and aux rows of the peer that landed.
    kv_bytes: u64,
    aux_rows: u64,
    /// The peer's Done arrived: the pages it says it sent and whether it sent aux rows.
    /// Over TCP the room's last frames may still be on another data connection.
    claim: Option<(u32, bool)>,
    done: bool,
}

struct Destination {
    pages: Arc<[u32]>,
    /// page → position in `pages`.
    pos: HashMap<u32, u32>,
    aux: Option<u32>,
}

/// The most kv buffers whose landed bytes a room tracks (more than any registration
/// holds: `Limits::max_buffers`).
const MAX_TRACKED_BUFFERS: usize = 1 << 16;

/// What has landed in a room so far, for counting its layers: the destination's pages,
/// each peer's Done claim (source pages sent), and the KV bytes landed per our buffer.
pub(crate) struct Landed {
    pub dest_pages: Option<u64>,
    pub claims: Vec<Option<u32>>,
    pub per_buffer: Vec<u64>,
}

/// What the room needs to know of one of its peers that the handle need not hold: its
/// name (for failure messages) and how many aux buffers it registered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Facts<'a> {
    pub name: &'a str,
    pub aux_count: usize,
}

impl<'a> Facts<'a> {
    /// The engine's peer: its name, and its registered aux buffers (none before setup).
    pub fn of(peer: &'a Arc<Peer>) -> Facts<'a> {
        Facts {
            name: &peer.name,
            aux_count: peer.aux_count.get().copied().unwrap_or(0),
        }
    }
}

/// What a peer's Done claim comes to, given what has arrived so far.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Not yet (no claim, or already settled).
    Nothing,
    Fail(String),
    /// Frames the claim counts are still on their way (another data connection).
    Wait,
    /// The peer is done; with whether every peer of the room is.
    Done {
        all: bool,
    },
}

impl<P: PeerRef> DecodeRoom<P> {
    pub fn new(peers: Vec<P>) -> Self {
        let n = peers.len();
        DecodeRoom {
            peers,
            inner: Mutex::new(DecodeState {
                progress: vec![Progress::default(); n],
                quiet: vec![false; n],
                ..Default::default()
            }),
        }
    }

    /// The position of `peer` among the room's prefill engines.
    pub fn index_of(&self, peer: &P) -> Option<usize> {
        self.peers.iter().position(|p| p.same(peer))
    }

    /// Whether an Abort from `peer` applies to the room: only from an engine the room
    /// pulls from (another member of the cluster must not cancel its rooms).
    pub fn abort_from(&self, peer: &P) -> bool {
        self.index_of(peer).is_some() || bugs::on(Bug::AnyPrefillAborts)
    }

    /// Records the destination; false if the room already has one.
    pub fn set_destination(&self, pages: &[u32], aux: Option<u32>) -> bool {
        let mut st = self.inner.lock();
        if st.dest.is_some() {
            return false;
        }
        st.dest = Some(Destination {
            pages: pages.into(),
            pos: pages
                .iter()
                .enumerate()
                .map(|(i, &p)| (p, i as u32))
                .collect(),
            aux,
        });
        true
    }

    /// Decides whether the destination goes out now: once, if the room has one and
    /// `live()` still holds; then makes its message with `msg` and hands it for every
    /// peer to `send`; whether it went out.
    ///
    /// The decision, the `sent` flag and the calls of `send` happen under the room's
    /// lock, and the engine's `send` queues the message on the peer's control
    /// connection there. A thread that fails the room queues its Abort under the same
    /// lock ([`DecodeRoom::with_lock`]) after the room is terminal, so `live()` is false
    /// for any later decision: either every peer's destination is queued ahead of the
    /// Abort, or no destination goes out at all. The room itself does no I/O: `send` is
    /// the caller's (the engine's queues on the control connection; a simulator's would
    /// push onto its modelled one).
    pub fn send_destination(
        &self,
        live: impl FnOnce() -> bool,
        msg: impl FnOnce(&[u32], Option<u32>) -> Message,
        mut send: impl FnMut(&P, &Message),
    ) -> bool {
        let mut st = self.inner.lock();
        if st.sent || (!live() && !bugs::on(Bug::DestinationAfterFailure)) {
            return false;
        }
        let Some(dest) = st.dest.as_ref() else {
            return false;
        };
        let m = msg(&dest.pages, dest.aux);
        st.sent = true;
        for p in &self.peers {
            send(p, &m);
        }
        true
    }

    /// Runs `f` under the room's lock (what a destination is sent under): a failing
    /// room's Aborts are queued in `f`, so that no destination can overtake them.
    pub fn with_lock<R>(&self, f: impl FnOnce() -> R) -> R {
        let _st = self.inner.lock();
        f()
    }

    /// Whether the destination went out.
    pub fn sent(&self) -> bool {
        self.inner.lock().sent
    }

    /// Checks that the pages (or aux slot) of every run of a frame from peer `idx` were
    /// granted to the room and that none of their bytes was taken by an earlier run, and
    /// takes them, under one lock; why not, for the first that fails. Each run comes with
    /// our buffer and whether it fills a part of one page (`sliced`) or whole pages.
    pub fn take_grants(
        &self,
        idx: usize,
        runs: impl Iterator<Item = (DataHeader, u32, bool)>,
    ) -> Result<(), String> {
        let mut st = self.inner.lock();
        let st = &mut *st;
        let dest = st
            .dest
            .as_ref()
            .ok_or_else(|| "no destination was sent".to_string())?;
        for (h, local, sliced) in runs {
            match h.target {
                Target::Kv => {
                    let pos = *dest
                        .pos
                        .get(&h.first_page)
                        .ok_or_else(|| format!("page {} was not granted", h.first_page))?;
                    let end = pos as usize + h.n_pages as usize;
                    let granted = end <= dest.pages.len()
                        && dest.pages[pos as usize..end]
                            .iter()
                            .enumerate()
                            .all(|(i, &p)| p as u64 == h.first_page as u64 + i as u64);
                    if !granted {
                        return Err(format!(
                            "pages {}..{} were not granted",
                            h.first_page,
                            h.first_page as u64 + h.n_pages as u64
                        ));
                    }
                    let taken = if sliced {
                        st.taken.part(local, pos, h.page_off, h.byte_len)
                    } else {
                        st.taken.whole(local, pos, h.n_pages)
                    };
                    taken.map_err(|at| {
                        format!(
                            "pages {}..{} of kv buffer {} again ({at} of the destination \
                             was already written)",
                            h.first_page,
                            h.first_page as u64 + h.n_pages as u64,
                            h.buffer
                        )
                    })?;
                }
                Target::Aux => {
                    if dest.aux != Some(h.first_page) || h.n_pages != 1 {
                        return Err(format!("aux slot {} was not granted", h.first_page));
                    }
                    if !st.taken.aux.insert((idx, local)) {
                        return Err(format!(
                            "the row of aux buffer {} again (it was already written)",
                            h.buffer
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts KV bytes (per our buffer) and aux rows of peer `idx` that landed; whether
    /// its Done claim was waiting for them.
    pub fn count(&self, idx: usize, kv: &[(u32, u64)], aux_rows: u64) -> bool {
        let mut st = self.inner.lock();
        for &(b, n) in kv {
            if let Some(l) = st.landed.get_mut(b as usize) {
                *l += n;
            } else if (b as usize) < MAX_TRACKED_BUFFERS {
                st.landed.resize(b as usize + 1, 0);
                st.landed[b as usize] = n;
            }
        }
        let pr = &mut st.progress[idx];
        pr.kv_bytes += kv.iter().map(|&(_, n)| n).sum::<u64>();
        pr.aux_rows += aux_rows;
        pr.claim.is_some()
    }

    /// Records peer `idx`'s Done claim.
    pub fn claim(&self, idx: usize, pages_sent: u32, aux_sent: bool) {
        self.inner.lock().progress[idx].claim = Some((pages_sent, aux_sent));
    }

    /// What peer `idx`'s Done claim comes to now. `ordered`: over RDMA, progress and
    /// Done come in order on the control connection, so a claim short of what arrived
    /// is a broken promise at once; over TCP the missing frames may still be on another
    /// data connection, and the room's transfer deadline bounds the wait. `facts` tells
    /// a peer's name and aux buffer count; `owed` gives the KV bytes the peer owes for
    /// `pages_sent` source pages into a destination of so many pages, or why that claim
    /// is wrong.
    pub fn settle<'p>(
        &'p self,
        idx: usize,
        ordered: bool,
        facts: impl Fn(&'p P) -> Facts<'p>,
        owed: impl Fn(&P, u32, u64) -> Result<u64, String>,
    ) -> Settle {
        let peer = &self.peers[idx];
        let Facts { name, aux_count } = facts(peer);
        let n_aux = aux_count as u64;
        let any_aux = self.peers.iter().any(|p| facts(p).aux_count > 0);
        let mut st = self.inner.lock();
        let pr = st.progress[idx];
        let Some((pages_sent, aux_sent)) = pr.claim else {
            return Settle::Nothing;
        };
        if pr.done {
            return Settle::Nothing;
        }
        let (want_pages, want_aux) = match &st.dest {
            Some(dest) => (dest.pages.len() as u64, dest.aux.is_some()),
            None => (0, false),
        };
        let want_rows = if want_aux { n_aux } else { 0 };
        let want_bytes = match owed(peer, pages_sent, want_pages) {
            Ok(b) => b,
            Err(why) => return Settle::Fail(format!("{name} {why}")),
        };
        if want_aux && !any_aux {
            Settle::Fail(
                "the destination has an aux slot but no prefill engine registered aux buffers"
                    .to_string(),
            )
        } else if want_aux && n_aux > 0 && !aux_sent {
            Settle::Fail(format!("{name} did not send the aux rows"))
        } else if pr.kv_bytes > want_bytes || pr.aux_rows > want_rows {
            Settle::Fail(format!(
                "{name} wrote {} KV bytes and {} aux rows for {want_bytes} and {want_rows}",
                pr.kv_bytes, pr.aux_rows
            ))
        } else if pr.kv_bytes < want_bytes || pr.aux_rows < want_rows {
            if ordered {
                Settle::Fail(format!(
                    "{name} reported done after {} of {want_bytes} KV bytes and {} of \
                     {want_rows} aux rows",
                    pr.kv_bytes, pr.aux_rows
                ))
            } else {
                Settle::Wait
            }
        } else {
            st.progress[idx].done = true;
            Settle::Done {
                all: st.progress.iter().all(|p| p.done),
            }
        }
    }

    /// What has landed so far (see [`Landed`]).
    pub fn landed(&self) -> Landed {
        let st = self.inner.lock();
        Landed {
            dest_pages: st.dest.as_ref().map(|d| d.pages.len() as u64),
            claims: st.progress.iter().map(|p| p.claim.map(|c| c.0)).collect(),
            per_buffer: st.landed.clone(),
        }
    }

    /// For a transfer timeout's message: the peers whose Done arrived while frames it
    /// counts never did (named by `facts`).
    pub fn missing<'p>(&'p self, facts: impl Fn(&'p P) -> Facts<'p>) -> Option<String> {
        let st = self.inner.lock();
        let missing: Vec<String> = self
            .peers
            .iter()
            .zip(&st.progress)
            .filter(|(_, pr)| pr.claim.is_some() && !pr.done)
            .map(|(p, pr)| {
                format!(
                    "{} reported done but only {} KV bytes and {} aux rows arrived",
                    facts(p).name,
                    pr.kv_bytes,
                    pr.aux_rows
                )
            })
            .collect();
        (!missing.is_empty()).then(|| missing.join("; "))
    }

    /// Over RDMA: whether no peer can still write into the room: its destination never
    /// went out, or every peer acknowledged the abort or was cut off.
    pub fn quiet(&self) -> bool {
        let st = self.inner.lock();
        !st.sent || st.quiet.iter().all(|&q| q)
    }

    /// `peer` can no longer write into the room.
    pub fn peer_quiet(&self, peer: &P) {
        if let Some(i) = self.index_of(peer) {
            self.inner.lock().quiet[i] = true;
        }
    }

    /// The peers not yet quiet once `now` passed the room's drain deadline (armed at
    /// `now + drain_ms` the first time this is asked).
    pub fn silent_past_drain(&self, now: u64, drain_ms: u64) -> Vec<P> {
        let mut st = self.inner.lock();
        let deadline = *st
            .drain_deadline_ms
            .get_or_insert(now.saturating_add(drain_ms));
        if now < deadline {
            return Vec::new();
        }
        self.peers
            .iter()
            .zip(&st.quiet)
            .filter(|(_, &q)| !q)
            .map(|(p, _)| p.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests;
