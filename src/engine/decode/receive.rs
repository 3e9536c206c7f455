//! The decode side's answer to the TCP receiver ([`crate::transport::tcp::recv`]): where
//! each data frame may go. A frame is admitted only for a live room that pulls from the
//! peer that sent it, into pages granted to that room, within registered buffers, with
//! the right length (invariant 8); anything else is discarded (a room that ended) or
//! closes the connection (a broken peer).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{DRoom, DecodeEngine};
use crate::control::Peer;
use crate::engine::lifecycle;
use crate::proto::{DataHeader, Target};
use crate::room::{Cause, FailureReason, IoGuard};
use crate::transport::tcp::recv::{Admit, FrameSink, Grant};
use crate::transport::{MemKind, Memory};

/// One prefill engine's data connection, as the decode engine receives it.
pub(super) struct Receiver<'a> {
    pub engine: &'a DecodeEngine,
    pub peer: &'a Arc<Peer>,
}

/// One admitted run: its header, the memory it fills and our buffer in it.
pub(super) type Run<'m> = (DataHeader, &'m Memory, u32);

/// The granted pages of one data frame's runs.
pub(super) struct Pages<'a> {
    engine: &'a DecodeEngine,
    peer: &'a Arc<Peer>,
    room: Arc<DRoom>,
    /// The peer's position in the room.
    idx: usize,
    runs: Vec<Run<'a>>,
}

impl Grant for Pages<'_> {
    fn pages(&self, i: usize) -> &mut [u8] {
        // Checked in `admit`: the pages lie in a registered buffer and are granted to
        // this live room, the bytes lie within them, and no earlier run of the room took
        // any of them (`DecodeRoom::take_grants`).
        let (h, mem, buffer) = &self.runs[i];
        mem.bytes_mut(
            *buffer as usize,
            h.first_page,
            h.n_pages,
            h.page_off as usize,
            h.byte_len as usize,
        )
        .expect("admitted bytes lie inside a registered buffer")
    }

    fn device(&self, i: usize) -> Option<(u32, usize)> {
        let (h, mem, buffer) = &self.runs[i];
        match mem.kind(*buffer as usize)? {
            MemKind::Host => None,
            MemKind::Cuda { device } => Some((
                device,
                mem.device_run(
                    *buffer as usize,
                    h.first_page,
                    h.n_pages,
                    h.page_off as usize,
                    h.byte_len as usize,
                )
                .expect("admitted bytes lie inside a registered buffer"),
            )),
        }
    }

    fn enter(&self) -> Option<IoGuard<'_>> {
        // Counted in before the state is checked: once the room is terminal nothing more
        // lands, and `drained` is false while a write is in progress.
        let io = self.room.begin_io();
        (!self.room.state().is_terminal()).then_some(io)
    }

    fn finish(self, complete: &[bool]) {
        self.finish_staged(complete, &[])
    }

    fn finish_staged(self, complete: &[bool], received: &[Option<u32>]) {
        let node = &self.engine.core.node;
        if node.config.integrity && !self.verify(complete, received) {
            return;
        }
        let bytes: u64 = self
            .runs
            .iter()
            .map(|(h, _, _)| u64::from(h.byte_len))
            .sum();
        node.metrics
            .bytes_received
            .fetch_add(bytes, Ordering::Relaxed);
        // What landed whole, per our KV buffer, and the aux rows: counted once a frame.
        let mut kv: Vec<(u32, u64)> = Vec::new();
        let mut rows = 0;
        for ((h, _, buffer), _) in self.runs.iter().zip(complete).filter(|(_, &c)| c) {
            match h.target {
                Target::Kv => match kv.iter_mut().find(|(b, _)| b == buffer) {
                    Some((_, n)) => *n += u64::from(h.byte_len),
                    None => kv.push((*buffer, u64::from(h.byte_len))),
                },
                Target::Aux => rows += 1,
            }
        }
        if !kv.is_empty() || rows > 0 {
            self.engine.count(&self.room, self.idx, &kv, rows);
        }
    }
}

impl Pages<'_> {
    /// With `integrity=verify`: verifies every run that landed whole
    /// ([`DecodeEngine::verify_runs`]; just written, so still in cache; a run into device
    /// memory was digested in the staging slots, `received`); false if one did not match
    /// (the room failed, and nothing of the frame is counted).
    fn verify(&self, complete: &[bool], received: &[Option<u32>]) -> bool {
        let whole = self
            .runs
            .iter()
            .zip(complete)
            .enumerate()
            .filter(|(_, (_, &c))| c)
            .map(|(i, (r, _))| (r, received.get(i).copied().flatten()));
        self.engine.verify_runs(self.peer, &self.room, whole)
    }
}

impl DecodeEngine {
    /// Recomputes the digest of each of `runs` of `peer` over the bytes where it landed
    /// (or takes the one computed as it landed, where given) and compares it with the one
    /// its header carries ([`crate::integrity`]), counting the bytes verified. A mismatch
    /// fails the room as INTEGRITY, naming the engine, the buffer, the page and the byte
    /// range; false then. The runs were admitted to the room
    /// ([`DecodeEngine::check_data`]), and the caller holds the room's io count.
    pub(super) fn verify_runs<'r, 'm: 'r>(
        &self,
        peer: &Peer,
        room: &Arc<DRoom>,
        runs: impl Iterator<Item = (&'r Run<'m>, Option<u32>)>,
    ) -> bool {
        let node = &self.core.node;
        let mut verified = 0u64;
        for ((h, mem, buffer), digested) in runs {
            let got = match digested {
                Some(crc) => crc,
                None => crate::integrity::digest(
                    h,
                    mem.bytes(
                        *buffer as usize,
                        h.first_page,
                        h.n_pages,
                        h.page_off as usize,
                        h.byte_len as usize,
                    )
                    .expect("admitted bytes lie inside a registered buffer"),
                ),
            };
            if got == h.digest {
                verified += u64::from(h.byte_len);
                continue;
            }
            node.metrics
                .integrity_failures
                .fetch_add(1, Ordering::Relaxed);
            let what = match h.target {
                Target::Kv => format!("page {} of kv buffer {buffer}", h.first_page),
                Target::Aux => format!("aux slot {} of aux buffer {buffer}", h.first_page),
            };
            let why = format!(
                "{}room {}: the bytes {}..{} of {what}{} from {} do not match their digest \
                 ({:08x} sent, {got:08x} landed)",
                crate::integrity::REASON_PREFIX,
                h.room,
                h.page_off,
                u64::from(h.page_off) + u64::from(h.byte_len),
                if h.n_pages > 1 {
                    format!(" and the {} pages after it", h.n_pages - 1)
                } else {
                    String::new()
                },
                peer.name,
                h.digest
            );
            lifecycle::fail(
                self,
                room,
                FailureReason::local(Cause::Integrity, why),
                None,
            );
            return false;
        }
        node.metrics
            .bytes_verified
            .fetch_add(verified, Ordering::Relaxed);
        true
    }
}

impl<'a> FrameSink for Receiver<'a> {
    type Grant<'g>
        = Pages<'g>
    where
        Self: 'g;

    fn heard(&self) {
        self.peer
            .last_recv_ms
            .store(self.engine.core.node.now_ms(), Ordering::Relaxed);
    }

    fn admit(&self, runs: &[DataHeader]) -> Admit<Pages<'_>> {
        self.admit_runs(runs, true)
    }

    fn admit_unverified(&self, runs: &[DataHeader]) -> Admit<Pages<'_>> {
        self.admit_runs(runs, false)
    }

    fn done(&self, room: u64, generation: u64, pages_sent: u32, aux_sent: bool) {
        self.engine
            .on_done(self.peer, room, generation, pages_sent, aux_sent);
    }

    fn protocol_error(&self) {
        self.engine
            .core
            .node
            .metrics
            .protocol_errors
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl Receiver<'_> {
    /// [`FrameSink::admit`]; a protocol refusal fails the frame's room with the
    /// reason only if `verified` (the header is known to be the peer's).
    fn admit_runs(&self, runs: &[DataHeader], verified: bool) -> Admit<Pages<'_>> {
        // The codec gives at least one run, all of one room and generation.
        let h = &runs[0];
        #[cfg(feature = "test-hooks")]
        if crate::testing::take_fault("recv.panic", h.room) {
            panic!("injected fault recv.panic");
        }
        let engine = self.engine;
        let Some(room) = engine.core.rooms.get_generation(h.room, h.generation) else {
            return self.discard(runs.len());
        };
        match engine.check_data(self.peer, &room, runs) {
            Ok((idx, runs)) => Admit::Write(Pages {
                engine,
                peer: self.peer,
                room,
                idx,
                runs,
            }),
            Err(Refuse::Discard) => self.discard(runs.len()),
            // Not this engine's room to write: the connection closes (the peer is
            // broken or hostile), and the room, which is another engine's, goes on.
            Err(Refuse::NotOurs(why)) => {
                engine.core.unknown_room();
                Admit::Refuse(why)
            }
            Err(Refuse::Protocol(why)) => {
                if verified {
                    lifecycle::fail(
                        engine,
                        &room,
                        FailureReason::local(
                            Cause::Protocol,
                            format!("{} sent {why}", self.peer.name),
                        ),
                        None,
                    );
                }
                Admit::Refuse(why)
            }
        }
    }

    /// Drops the `n` runs of a frame (counted as frames dropped, one per run).
    fn discard(&self, n: usize) -> Admit<Pages<'_>> {
        self.engine
            .core
            .node
            .metrics
            .dropped_frames
            .fetch_add(n as u64, Ordering::Relaxed);
        Admit::Discard
    }
}

/// Why a data frame was refused: the peer broke the protocol (close the connection and
/// fail the room), named a room that does not pull from it (close the connection, leave
/// the room alone), or the room simply cannot take it any more (discard the bytes).
pub(super) enum Refuse {
    Protocol(String),
    NotOurs(String),
    Discard,
}

impl DecodeEngine {
    /// Checks a data frame's runs: the room pulls from this peer, is live, has a
    /// destination, and each run's pages are granted to it, in registered buffers, with
    /// the right length (the grants under one lock for the whole frame). Returns the
    /// peer's position and, for each run, the memory and our buffer it fills.
    pub(super) fn check_data<'m>(
        &'m self,
        peer: &Arc<Peer>,
        room: &Arc<DRoom>,
        runs: &[DataHeader],
    ) -> Result<(usize, Vec<Run<'m>>), Refuse> {
        let id = runs[0].room;
        let proto_err =
            |why: String| Refuse::Protocol(format!("a bad data frame for room {id}: {why}"));
        let d = &room.ext;
        let Some(idx) = d.index_of(peer) else {
            return Err(Refuse::NotOurs(format!(
                "a data frame for room {id}, which does not pull from this engine"
            )));
        };
        if room.state().is_terminal() {
            return Err(Refuse::Discard);
        }
        let memory = &self.core.node.memory;
        let mut out = Vec::with_capacity(runs.len());
        for h in runs {
            let (mem, what, local) = match h.target {
                Target::Kv => (
                    memory.kv.get(),
                    "kv",
                    peer.kv_map
                        .get()
                        .and_then(|m| m.get(h.buffer as usize).copied()),
                ),
                Target::Aux => (memory.aux.get(), "aux", Some(h.buffer)),
            };
            let (mem, local, item_len) = local
                .and_then(|b| mem.and_then(|m| m.item_len(b as usize).map(|len| (m, b, len))))
                .ok_or_else(|| {
                    proto_err(format!("{what} buffer {} is not registered", h.buffer))
                })?;
            let slicing = match h.target {
                Target::Kv => peer.slicing.get(),
                Target::Aux => None,
            };
            match slicing {
                None if h.page_off != 0
                    || h.byte_len as u64 != h.n_pages as u64 * item_len as u64 =>
                {
                    return Err(proto_err(format!(
                        "{} bytes at offset {} for {} pages of {item_len}",
                        h.byte_len, h.page_off, h.n_pages
                    )));
                }
                None => {}
                Some(s) => {
                    let (off, len) = (u64::from(h.page_off), u64::from(h.byte_len));
                    if h.n_pages != 1 || off + len > item_len as u64 || !s.allows(off, len) {
                        return Err(proto_err(format!(
                            "bytes {off}..{} of page {} (of {item_len} bytes; {} pages), which \
                             are not among the heads {:?} it sends",
                            off + len,
                            h.first_page,
                            h.n_pages,
                            s.heads()
                        )));
                    }
                }
            }
            out.push((*h, mem, local));
        }
        // A peer's KV runs are all parts of pages or all whole pages: it sends head
        // slices (or remaps page sizes) or it does not.
        let sliced = peer.slicing.get().is_some();
        d.take_grants(
            idx,
            out.iter()
                .map(|(h, _, local)| (*h, *local, sliced && h.target == Target::Kv)),
        )
        .map_err(proto_err)?;
        for (h, mem, local) in &out {
            if mem
                .check_range(*local as usize, h.first_page, h.n_pages)
                .is_err()
            {
                let what = match h.target {
                    Target::Kv => "kv",
                    Target::Aux => "aux",
                };
                return Err(proto_err(format!(
                    "pages {}..{} are outside {what} buffer {local}",
                    h.first_page,
                    h.first_page as u64 + h.n_pages as u64
                )));
            }
        }
        // Progress: TRANSFERRING (or staying in it), with a fresh deadline.
        let _ = lifecycle::start(self, room);
        Ok((idx, out))
    }
}
