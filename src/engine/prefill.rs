//! The prefill (sending) side: destinations from decode engines, the holding area for
//! destinations that arrive before their room, chunk queues and the workers that write
//! pages to the decode engines.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use super::peer::Peer;
use super::{ERoom, Job, RoomExt, Shared};
use crate::err;
use crate::error::Result;
use crate::proto::{DataHeader, Message, Target};
use crate::room::{Cause, Event, FailureReason, Refusal, State};
use crate::transport::tcp::MAX_FRAME_BYTES;
use crate::transport::{coalesce, Memory, RoomEnded, Watch};

/// The most early destinations held at once.
pub const MAX_HELD: usize = 65_536;
/// The most destination pages held at once across early destinations (64 MiB of page
/// lists): a peer cannot make the holding area allocate more than this.
pub const MAX_HELD_PAGES: usize = 16 << 20;

/// One chunk of source pages.
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub pages: Vec<u32>,
    pub is_last: bool,
    pub aux: Option<u32>,
}

/// Adds one data frame of a room to its batch (writing the batch when full), or says why
/// the room must fail. (frame header, memory to read, first source page).
type PushFn<'a, 'm> =
    dyn FnMut(DataHeader, &'m Memory, u32) -> std::result::Result<(), FailureReason> + 'a;

/// The most frames written in one batch (two iovecs each on TCP, within IOV_MAX).
const BATCH_FRAMES: usize = 64;

/// Frames of one room gathered for one transport call.
#[derive(Default)]
struct Batch<'m> {
    frames: Vec<(DataHeader, &'m [u8])>,
    bytes: usize,
}

impl<'m> Batch<'m> {
    /// Adds a frame; returns whether the batch is full and must be written now.
    fn push(&mut self, hdr: DataHeader, bytes: &'m [u8]) -> bool {
        self.bytes += bytes.len();
        self.frames.push((hdr, bytes));
        self.frames.len() >= BATCH_FRAMES || self.bytes >= MAX_FRAME_BYTES
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.bytes = 0;
    }
}

/// Where one decode engine wants the room's pages.
#[derive(Clone)]
pub(crate) struct Dest {
    pub peer: Arc<Peer>,
    /// The decode room's generation: every message about the room carries it.
    pub generation: u64,
    pub pages: Arc<[u32]>,
    pub aux: Option<u32>,
}

pub(crate) struct PrefillRoom {
    expected: usize,
    pub dests: Vec<Dest>,
    /// Chunks enqueued before every destination arrived.
    held: VecDeque<Chunk>,
    /// The last chunk was enqueued.
    closed: bool,
    /// Destination pages filled so far (the same for every destination).
    cursor: usize,
    /// Decode generations heard from engines by messages that were not destinations
    /// (an abort that came before the destination), kept for the cleared-use record.
    known: Vec<(Arc<Peer>, u64)>,
}

impl PrefillRoom {
    pub fn new(expected: usize) -> Self {
        PrefillRoom {
            expected,
            dests: Vec::new(),
            held: VecDeque::new(),
            closed: false,
            cursor: 0,
            known: Vec::new(),
        }
    }

    fn ready(&self) -> bool {
        self.dests.len() >= self.expected
    }
}

/// A destination that arrived before the local scheduler created its room.
pub(crate) struct Held {
    peer: Arc<Peer>,
    generation: u64,
    pages: Vec<u32>,
    aux: Option<u32>,
    expires_ms: u64,
}

/// An abort from a decode engine for a room this engine has not created yet: the room is
/// failed with it when created (like an early destination, it is adopted), unless it
/// expires first.
pub(crate) struct Tombstone {
    peer: Arc<Peer>,
    generation: u64,
    reason: String,
    expires_ms: u64,
}

/// Early arrivals from decode engines, bounded in count (`MAX_HELD` in all) and time
/// (`bootstrap_timeout_ms`).
#[derive(Default)]
pub(crate) struct Holding {
    by_room: HashMap<u64, Vec<Held>>,
    aborted: HashMap<u64, Tombstone>,
    /// Earlier uses of room ids, kept after their clear so that late messages about them
    /// are told apart from messages about a new use of the same id.
    cleared: HashMap<u64, Cleared>,
    count: usize,
    /// Pages in the held destinations' lists.
    pages: usize,
}

/// What a cleared prefill room leaves behind for a while.
///
/// A decode engine's messages about one id reach us in order (one control connection),
/// and its generations only grow; every decode use sends at least one message (its
/// destination, or an abort when it ends without success). So the first message from an
/// engine about an id after a use was cleared belongs to that use if the engine was one
/// the use still waited for; messages with a generation at most the one attributed to
/// the old use are late ones for it; higher generations belong to the new use.
pub(crate) struct Cleared {
    /// Why the use failed, if it failed: the answer to its late destinations.
    reason: Option<String>,
    /// Decode generations attributed to the old use, per decode engine.
    gens: Vec<(Arc<Peer>, u64)>,
    /// Whether the old use had every destination it expected (then an engine not in
    /// `gens` had nothing to do with it).
    complete: bool,
    expires_ms: u64,
}

/// Whether a message from `peer` about `id` with decode generation `generation` belongs
/// to an earlier, cleared use of the id (see [`Cleared`]); if so, with that use's failure
/// reason.
fn attribute(
    h: &mut Holding,
    peer: &Arc<Peer>,
    id: u64,
    generation: u64,
) -> Option<Option<String>> {
    let c = h.cleared.get_mut(&id)?;
    if let Some((_, g)) = c.gens.iter().find(|(p, _)| Arc::ptr_eq(p, peer)) {
        return (generation <= *g).then(|| c.reason.clone());
    }
    if c.complete {
        return None;
    }
    c.gens.push((peer.clone(), generation));
    Some(c.reason.clone())
}

fn ext(room: &ERoom) -> &parking_lot::Mutex<PrefillRoom> {
    match &room.ext {
        RoomExt::Prefill(p) => p,
        RoomExt::Decode(_) => unreachable!("prefill code on a decode room"),
    }
}

impl Shared {
    pub(crate) fn prefill_enqueue(&self, room: &Arc<ERoom>, chunk: Chunk) -> Result<()> {
        let mut p = ext(room).lock();
        if p.closed {
            return Err(err!(
                WrongState,
                "room {} already has its last chunk",
                room.id()
            ));
        }
        p.closed = chunk.is_last;
        if !p.ready() {
            p.held.push_back(chunk);
            return Ok(());
        }
        // Dispatched under the lock, so that chunks keep their order with held ones.
        let sent = self.dispatch(Job {
            room: room.clone(),
            chunk,
        });
        drop(p);
        if !sent {
            self.fail_undispatched(room);
        }
        Ok(())
    }

    /// A decode engine's destination for room `id`.
    pub(crate) fn prefill_on_destination(
        &self,
        peer: &Arc<Peer>,
        id: u64,
        generation: u64,
        pages: Vec<u32>,
        aux: Option<u32>,
    ) {
        if let Some(old) = self.earlier_use(peer, id, generation) {
            let why = match old {
                Some(reason) => {
                    format!("prefill room {id} already failed and was cleared: {reason}")
                }
                None => format!("prefill room {id} already finished and was cleared"),
            };
            self.refuse(peer, id, generation, &why);
            return;
        }
        let Some(room) = self.rooms.get(id) else {
            return self.hold(peer, id, generation, pages, aux);
        };
        self.attach(&room, peer, generation, pages, aux);
    }

    /// Whether a message from `peer` about `id` with decode generation `generation`
    /// belongs to an earlier, cleared use of the id (see [`Cleared`]); if so, with the
    /// old use's failure reason.
    fn earlier_use(&self, peer: &Arc<Peer>, id: u64, generation: u64) -> Option<Option<String>> {
        attribute(&mut self.holding.lock(), peer, id, generation)
    }

    /// Answers, and stops holding, the held destinations for `id` that belong to a
    /// cleared use of it. Called after a clear records the use and after a destination is
    /// held, so that whichever of the two comes second sees the other.
    fn answer_held_for_cleared(&self, id: u64) {
        let answered = {
            let mut h = self.holding.lock();
            if !h.cleared.contains_key(&id) {
                return;
            }
            let Some(list) = h.by_room.remove(&id) else {
                return;
            };
            let mut keep = Vec::new();
            let mut answered = Vec::new();
            for d in list {
                match attribute(&mut h, &d.peer, id, d.generation) {
                    Some(reason) => answered.push((d, reason)),
                    None => keep.push(d),
                }
            }
            h.count -= answered.len();
            h.pages -= answered.iter().map(|(d, _)| d.pages.len()).sum::<usize>();
            if !keep.is_empty() {
                h.by_room.insert(id, keep);
            }
            answered
        };
        for (d, reason) in answered {
            let why = match reason {
                Some(r) => format!("prefill room {id} already failed and was cleared: {r}"),
                None => format!("prefill room {id} already finished and was cleared"),
            };
            self.refuse(&d.peer, id, d.generation, &why);
        }
    }

    /// A prefill room is being cleared: remember, for a while, which decode generations
    /// it knew and why it failed, so late messages about it neither touch a new use of
    /// the id nor wait for a deadline to be answered.
    pub(crate) fn prefill_on_clear(&self, room: &ERoom) {
        let (gens, complete) = {
            let p = ext(room).lock();
            let gens = p
                .dests
                .iter()
                .map(|d| (d.peer.clone(), d.generation))
                .chain(p.known.iter().cloned())
                .collect();
            (gens, p.ready())
        };
        let reason = room.failure().map(|f| f.to_string());
        let mut h = self.holding.lock();
        // Records that answer waiting engines (failed before complete) may use the whole
        // bound; the others, which only guard against id reuse, half of it.
        let limit = if complete { MAX_HELD / 2 } else { MAX_HELD };
        if h.count >= limit {
            return;
        }
        let expires_ms =
            self.now_ms() + self.config.bootstrap_timeout_ms + self.config.waiting_timeout_ms;
        let old = h.cleared.insert(
            room.id(),
            Cleared {
                reason,
                gens,
                complete,
                expires_ms,
            },
        );
        if old.is_none() {
            h.count += 1;
        }
        drop(h);
        self.answer_held_for_cleared(room.id());
    }

    fn attach(
        &self,
        room: &Arc<ERoom>,
        peer: &Arc<Peer>,
        generation: u64,
        pages: Vec<u32>,
        aux: Option<u32>,
    ) {
        let id = room.id();
        if room.state().is_terminal() {
            let why = match room.failure() {
                Some(f) => format!("prefill room {id} already failed: {f}"),
                None => format!("prefill room {id} already finished"),
            };
            self.refuse(peer, id, generation, &why);
            return;
        }
        let mut p = ext(room).lock();
        if p.dests.iter().any(|d| Arc::ptr_eq(&d.peer, peer)) || p.ready() {
            // The same destination again may have writes in flight: its acknowledgement
            // is the one fail_room queues below, not an immediate one.
            let known = p
                .dests
                .iter()
                .any(|d| Arc::ptr_eq(&d.peer, peer) && d.generation == generation);
            drop(p);
            let why = format!(
                "prefill room {id} got a second destination from {}",
                peer.name
            );
            if known {
                peer.send(self, &Message::abort(id, generation, &why, &self.limits));
            } else {
                self.refuse(peer, id, generation, &why);
            }
            self.fail_room(room, FailureReason::local(Cause::Protocol, why), Some(peer));
            return;
        }
        peer.rooms.lock().insert((id, room.generation()));
        p.dests.push(Dest {
            peer: peer.clone(),
            generation,
            pages: pages.into(),
            aux,
        });
        // An abort that raced us failed the room after our first check: if it read the
        // destinations before our push, it told nobody about this one. Checking again
        // under the lock, after the push, closes that gap (fail_room makes the room
        // terminal before it takes this lock to read the destinations).
        if let Some(f) = room.failure() {
            let why = format!("prefill room {id} already failed: {f}");
            drop(p);
            self.refuse(peer, id, generation, &why);
            return;
        }
        if peer.is_lost() {
            drop(p);
            self.fail_room(
                room,
                FailureReason::local(Cause::PeerLost, format!("lost {}", peer.name)),
                None,
            );
            return;
        }
        if p.ready() {
            self.arm(room, State::WaitingForInput);
            if room.advance(Event::Ready).is_ok() {
                let mut sent = true;
                while let Some(chunk) = p.held.pop_front() {
                    sent &= self.dispatch(Job {
                        room: room.clone(),
                        chunk,
                    });
                }
                drop(p);
                if !sent {
                    self.fail_undispatched(room);
                }
            }
        }
    }

    fn hold(&self, peer: &Arc<Peer>, id: u64, generation: u64, pages: Vec<u32>, aux: Option<u32>) {
        let mut h = self.holding.lock();
        if h.count >= MAX_HELD || h.pages + pages.len() > MAX_HELD_PAGES {
            drop(h);
            self.metrics.held_overflow.fetch_add(1, Ordering::Relaxed);
            let why = format!(
                "prefill has no room {id} and its holding area is full ({MAX_HELD} \
                 destinations, {MAX_HELD_PAGES} pages)"
            );
            self.refuse(peer, id, generation, &why);
            return;
        }
        h.count += 1;
        h.pages += pages.len();
        h.by_room.entry(id).or_default().push(Held {
            peer: peer.clone(),
            generation,
            pages,
            aux,
            expires_ms: self.now_ms() + self.config.bootstrap_timeout_ms,
        });
        self.metrics.held.fetch_add(1, Ordering::Relaxed);
        drop(h);
        // A use of the id may have been created, failed and cleared between our lookup
        // and the insert: then this destination is its late one and is answered now.
        self.answer_held_for_cleared(id);
        // The room may have been created between our lookup and the insert.
        if let Some(room) = self.rooms.get(id) {
            self.prefill_adopt_held(&room);
        }
    }

    /// A new room takes the destinations (and aborts) that were waiting for it.
    pub(crate) fn prefill_adopt_held(&self, room: &Arc<ERoom>) {
        let (held, tomb) = {
            let mut h = self.holding.lock();
            let held = h.by_room.remove(&room.id()).unwrap_or_default();
            let tomb = h.aborted.remove(&room.id());
            h.count -= held.len() + tomb.is_some() as usize;
            h.pages -= held.iter().map(|d| d.pages.len()).sum::<usize>();
            (held, tomb)
        };
        if let Some(t) = tomb {
            ext(room).lock().known.push((t.peer.clone(), t.generation));
            self.fail_room(
                room,
                FailureReason::peer(Cause::Aborted, t.reason),
                Some(&t.peer),
            );
        }
        for d in held {
            if !d.peer.is_lost() {
                self.attach(room, &d.peer, d.generation, d.pages, d.aux);
            }
        }
    }

    /// Answers a destination that will never be written to with an Abort, and over
    /// RDMA with its AbortAck too: nothing of it can be outstanding, so the decode side
    /// may reuse the pages at once.
    fn refuse(&self, peer: &Arc<Peer>, id: u64, generation: u64, why: &str) {
        peer.send(self, &Message::abort(id, generation, why, &self.limits));
        if self.rdma.is_some() {
            peer.send(
                self,
                &Message::AbortAck {
                    room: id,
                    generation,
                },
            );
        }
    }

    /// A decode engine's Abort for room `id`.
    ///
    /// It fails the prefill room when the room has that decode room's destination, or
    /// has none from that engine yet while still waiting for destinations (the decode
    /// side gave up before its destination went out). An Abort for a room not created yet
    /// is held like an early destination and fails the room when it is created. Anything
    /// else (another generation of a destination we hold) is a late message for an
    /// earlier use of the id and is dropped.
    pub(crate) fn prefill_on_abort(
        &self,
        peer: &Arc<Peer>,
        id: u64,
        generation: u64,
        reason: String,
    ) {
        if self.earlier_use(peer, id, generation).is_some() {
            // A late abort for an earlier use of the id: it must not touch this one.
            self.metrics
                .unknown_room_frames
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Some(room) = self.rooms.get(id) {
            let applies = {
                let mut p = ext(&room).lock();
                let from_peer = p.dests.iter().find(|d| Arc::ptr_eq(&d.peer, peer));
                match from_peer {
                    Some(d) => d.generation == generation,
                    None if !p.ready() => {
                        let seen = p
                            .known
                            .iter()
                            .any(|(k, g)| Arc::ptr_eq(k, peer) && *g == generation);
                        if !seen {
                            p.known.push((peer.clone(), generation));
                        }
                        true
                    }
                    None => false,
                }
            };
            if applies {
                self.fail_room(
                    &room,
                    FailureReason::peer(Cause::Aborted, reason),
                    Some(peer),
                );
            } else {
                self.metrics
                    .unknown_room_frames
                    .fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        self.metrics
            .unknown_room_frames
            .fetch_add(1, Ordering::Relaxed);
        let mut h = self.holding.lock();
        if let Some(list) = h.by_room.get_mut(&id) {
            let (before, before_pages) = (
                list.len(),
                list.iter().map(|d| d.pages.len()).sum::<usize>(),
            );
            list.retain(|d| !(Arc::ptr_eq(&d.peer, peer) && d.generation == generation));
            let removed = before - list.len();
            let removed_pages = before_pages - list.iter().map(|d| d.pages.len()).sum::<usize>();
            if list.is_empty() {
                h.by_room.remove(&id);
            }
            h.count -= removed;
            h.pages -= removed_pages;
        }
        if h.count < MAX_HELD && !h.aborted.contains_key(&id) {
            h.count += 1;
            h.aborted.insert(
                id,
                Tombstone {
                    peer: peer.clone(),
                    generation,
                    reason,
                    expires_ms: self.now_ms() + self.config.bootstrap_timeout_ms,
                },
            );
        }
        drop(h);
        // The room may have been created between our lookup and the insert.
        if let Some(room) = self.rooms.get(id) {
            self.prefill_adopt_held(&room);
        }
    }

    /// Watchdog duty: held destinations whose room never came are answered with a
    /// failure.
    pub(crate) fn expire_held(&self) {
        let now = self.now_ms();
        let mut expired = Vec::new();
        {
            let mut h = self.holding.lock();
            if h.count == 0 {
                return;
            }
            for (&id, list) in h.by_room.iter_mut() {
                let (gone, keep): (Vec<Held>, Vec<Held>) =
                    list.drain(..).partition(|d| d.expires_ms <= now);
                *list = keep;
                expired.extend(gone.into_iter().map(|d| (id, d)));
            }
            h.by_room.retain(|_, l| !l.is_empty());
            let tombs = h.aborted.len() + h.cleared.len();
            h.aborted.retain(|_, t| t.expires_ms > now);
            h.cleared.retain(|_, c| c.expires_ms > now);
            let gone_tombs = tombs - h.aborted.len() - h.cleared.len();
            h.count -= expired.len() + gone_tombs;
            h.pages -= expired.iter().map(|(_, d)| d.pages.len()).sum::<usize>();
        }
        for (id, d) in expired {
            self.metrics.held_expired.fetch_add(1, Ordering::Relaxed);
            let why = format!(
                "prefill created no room {id} within bootstrap_timeout_ms={}",
                self.config.bootstrap_timeout_ms
            );
            self.refuse(&d.peer, id, d.generation, &why);
        }
    }

    /// A worker thread: processes chunks in order until the engine stops.
    pub(crate) fn worker(&self, index: usize, jobs: mpsc::Receiver<Job>) {
        for job in jobs {
            let room = job.room.clone();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.send_chunk(index, &job.room, &job.chunk)
            }));
            let failure = match r {
                Ok(Ok(())) => None,
                Ok(Err(reason)) => Some(reason),
                Err(_) => Some(FailureReason::local(
                    Cause::Internal,
                    format!(
                        "internal error (panic) while sending a chunk of room {}",
                        room.id()
                    ),
                )),
            };
            if let Some(reason) = failure {
                self.fail_room(&room, reason, None);
            }
            if self.rdma.is_some() && room.state().is_terminal() {
                // The chunk's writes are complete: acknowledgements waiting for them go.
                self.send_due_acks();
            }
        }
    }

    /// Writes one chunk to every destination; on the last chunk, the aux rows and Done,
    /// then SUCCESS. Returns the reason to fail the room with, if any.
    fn send_chunk<'m>(
        &'m self,
        worker: usize,
        room: &Arc<ERoom>,
        chunk: &Chunk,
    ) -> std::result::Result<(), FailureReason> {
        if room.state().is_terminal() {
            // Skipped: the room is already terminal (aborted, failed or done).
            return Ok(());
        }
        let (dests, start) = {
            let p = ext(room).lock();
            (p.dests.clone(), p.cursor)
        };
        let n = chunk.pages.len();
        self.arm(room, State::Transferring);
        match room.advance(Event::Start) {
            Ok(_) => {}
            // Skipped: the room is already terminal.
            Err(Refusal::Terminal(_)) => return Ok(()),
            // Never expected (chunks are dispatched only once the room is ready), but a
            // chunk is never dropped for a live room: fail it with the reason.
            Err(r) => {
                return Err(FailureReason::local(
                    Cause::Internal,
                    format!("room {}: cannot start a chunk: {r}", room.id()),
                ))
            }
        }
        let kv = self
            .kv
            .get()
            .expect("rooms exist only after KV registration");
        let mut finishes = Vec::new();
        for Dest {
            peer,
            generation,
            pages,
            aux,
        } in &dests
        {
            if start + n > pages.len() {
                return Err(FailureReason::local(
                    Cause::Mismatch,
                    format!(
                        "room {}: chunk of {n} pages overflows the destination of {} pages \
                         from {} ({start} already filled)",
                        room.id(),
                        pages.len(),
                        peer.name
                    ),
                ));
            }
            if chunk.is_last && start + n != pages.len() {
                return Err(FailureReason::local(
                    Cause::Mismatch,
                    format!(
                        "room {}: the last chunk leaves {} of {} destination pages from {} unfilled",
                        room.id(),
                        pages.len() - start - n,
                        pages.len(),
                        peer.name
                    ),
                ));
            }
            let links = peer.data.read().clone();
            if links.is_empty() {
                return Err(FailureReason::local(
                    Cause::PeerLost,
                    format!("no data connection to {}", peer.name),
                ));
            }
            // The worker's own link first; over TCP, where workers share connections, a
            // batch takes any connection no other worker is writing on before waiting
            // for its own, so that a few large rooms keep every connection busy.
            let home = worker % links.len();
            let write = |frames: &[(DataHeader, &[u8])], watch: &mut Watch<'_>| {
                (0..links.len())
                    .find_map(|i| links[(home + i) % links.len()].try_write_runs(frames, watch))
                    .unwrap_or_else(|| links[home].write_runs(frames, watch))
            };
            // Frames go out in batches (one vectored write on TCP, one chain of RDMA
            // writes). Each batch is counted on the room (begin_io) before the state
            // check and until the link is done reading it, so a scheduler that waits for
            // kvxfer_room_drained never reuses pages a transport still reads.
            let mut batch = Batch::default();
            let flush = |batch: &mut Batch<'_>| -> std::result::Result<(), FailureReason> {
                if batch.frames.is_empty() {
                    return Ok(());
                }
                let mut io = Some(room.begin_io());
                let ended = || room.state().is_terminal();
                let room_ended =
                    || FailureReason::local(Cause::Aborted, "room ended while sending");
                if ended() {
                    return Err(room_ended());
                }
                // A slow link: once the room ends, its pages are no longer read, and the
                // io count drops before the frame in progress is ended with zeros.
                let mut release = || drop(io.take());
                let mut watch = Watch {
                    ended: &ended,
                    release: &mut release,
                };
                write(&batch.frames, &mut watch).map_err(|e| {
                    if e.get_ref().is_some_and(|e| e.is::<RoomEnded>()) {
                        return room_ended();
                    }
                    FailureReason::local(
                        Cause::Transfer,
                        format!("room {}: writing to {} failed: {e}", room.id(), peer.name),
                    )
                })?;
                self.metrics
                    .bytes_sent
                    .fetch_add(batch.bytes as u64, Ordering::Relaxed);
                room.set_deadline_ms(self.now_ms() + self.config.transfer_timeout_ms);
                batch.clear();
                #[cfg(feature = "test-hooks")]
                crate::testing::pause_point("worker.mid_chunk", room.id());
                Ok(())
            };
            let mut push = |hdr: DataHeader,
                            mem: &'m Memory,
                            src: u32|
             -> std::result::Result<(), FailureReason> {
                let bytes = mem
                    .pages(hdr.buffer as usize, src, hdr.n_pages)
                    .map_err(|e| FailureReason::local(Cause::Internal, e.to_string()))?;
                #[allow(unused_mut)]
                let mut full = batch.push(hdr, bytes);
                #[cfg(feature = "test-hooks")]
                {
                    full |= crate::testing::is_armed("worker.mid_chunk", room.id());
                }
                if full {
                    flush(&mut batch)?;
                }
                Ok(())
            };
            for run in coalesce(&chunk.pages, &pages[start..start + n]) {
                for (b, desc) in kv.buffers().iter().enumerate() {
                    let per = (MAX_FRAME_BYTES / desc.item_len).max(1) as u32;
                    let mut off = 0;
                    while off < run.len {
                        let k = per.min(run.len - off);
                        let hdr = DataHeader {
                            room: room.id(),
                            generation: *generation,
                            target: Target::Kv,
                            buffer: b as u32,
                            first_page: run.dst + off,
                            n_pages: k,
                            byte_len: (k as usize * desc.item_len) as u32,
                        };
                        push(hdr, kv, run.src + off)?;
                        off += k;
                    }
                }
            }
            if chunk.is_last {
                let aux_sent = self.send_aux(room.id(), *generation, chunk.aux, *aux, &mut push)?;
                flush(&mut batch)?;
                let mut frame = Vec::with_capacity(64);
                Message::Done {
                    room: room.id(),
                    generation: *generation,
                    pages_sent: pages.len() as u32,
                    aux_sent,
                }
                .encode(&mut frame)
                .map_err(|e| FailureReason::local(Cause::Internal, e.to_string()))?;
                finishes.push((links[home].clone(), frame, peer.clone()));
            } else {
                flush(&mut batch)?;
            }
        }
        ext(room).lock().cursor = start + n;
        self.metrics.chunks.fetch_add(1, Ordering::Relaxed);
        if !chunk.is_last {
            return Ok(());
        }
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("worker.before_complete", room.id());
        // Every byte is with the transport. Claim completion before telling the decode
        // engines: an abort that comes after the claim finds the room SUCCESS and changes
        // nothing, and one that came before it means no Done is sent, so the two sides
        // never disagree about a prefill-side abort racing the last chunk.
        if room.advance(Event::Complete).is_err() {
            return Ok(()); // aborted meanwhile: already FAILED, and no Done goes out
        }
        self.metrics.succeeded();
        crate::log!(self.log, Debug, "room {} sent", room.id());
        for (link, frame, peer) in finishes {
            if let Err(e) = link.finish(&frame) {
                // The room is SUCCESS here (every byte was handed over); the decode side
                // learns of the broken link as a lost peer.
                self.lose_peer(
                    &peer,
                    format!("writing Done of room {} failed: {e}", room.id()),
                );
            }
        }
        Ok(())
    }

    /// Sends the aux rows of source slot `src` to destination slot `dst`, one frame per
    /// aux buffer. Returns whether anything was sent.
    fn send_aux<'m>(
        &'m self,
        id: u64,
        generation: u64,
        src: Option<u32>,
        dst: Option<u32>,
        push: &mut PushFn<'_, 'm>,
    ) -> std::result::Result<bool, FailureReason> {
        let (Some(src), Some(dst), Some(aux)) = (src, dst, self.aux.get()) else {
            return Ok(false);
        };
        for (b, desc) in aux.buffers().iter().enumerate() {
            let hdr = DataHeader {
                room: id,
                generation,
                target: Target::Aux,
                buffer: b as u32,
                first_page: dst,
                n_pages: 1,
                byte_len: desc.item_len as u32,
            };
            push(hdr, aux, src)?;
        }
        Ok(true)
    }
}
