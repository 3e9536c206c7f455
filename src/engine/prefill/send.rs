//! The prefill's senders: a thread per link of a decode engine takes the batches (and
//! Done frames) of that engine's outbox and writes them ([`PrefillEngine::send_loop`]),
//! so one room's frames go out over every connection (or RDMA queue pair) at once.
//! Whoever ends the last batch of a room's last chunk claims the room's completion and
//! sends Done; a thread that only plans never writes on a data connection.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::outbox::{Batch, Item, Outbox};
use super::{ext, PRoom, PrefillEngine};
use crate::control::Peer;
use crate::engine::lifecycle;
use crate::proto::{DataHeader, Target};
use crate::room::{Cause, FailureReason};
use crate::transport::{DataLink, Pipelined, Sent, Watch};

impl PrefillEngine {
    /// A sender thread: writes the batches (and Done frames) of `peer`'s outbox over
    /// `link` until the outbox closes (the peer is lost or the engine stops), or the link
    /// breaks.
    pub(super) fn send_loop(
        self: &Arc<Self>,
        peer: &Arc<Peer>,
        link: &Arc<dyn DataLink>,
        outbox: &Outbox,
    ) {
        while let Some(item) = outbox.pop() {
            match item {
                Item::Batch(batch) => {
                    self.taken(&batch.room);
                    self.send_batch(link, batch)
                }
                Item::Done { room, frame } => self.write_done(&room, peer, link, &frame),
            }
            if link.is_broken() {
                // The others carry the outbox; a peer with no link left is lost.
                let left = {
                    let mut links = peer.data.write();
                    links.retain(|l| !Arc::ptr_eq(l, link));
                    links.len()
                };
                if left == 0 {
                    self.core
                        .control
                        .lose(peer, "every data connection to it broke".to_string());
                }
                return;
            }
        }
    }

    /// Writes one batch on `link` and ends it; a failure (or a panic) fails its room. On
    /// a pipelined link the batch ends later, on the thread that learns of its end,
    /// unless it is small and of host memory: then it goes inline, as over TCP.
    fn send_batch(self: &Arc<Self>, link: &Arc<dyn DataLink>, batch: Batch) {
        if let Some(p) = link.as_pipelined() {
            let inline = batch.bytes <= crate::transport::copy_link::INLINE_MAX_BYTES
                && !super::staged::any_on_device(&self.core.node.memory, &batch);
            if !inline {
                return self.start_batch(p, link, batch);
            }
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.write_batch(link, &batch)
        }));
        let written = self.settle(&batch, r);
        self.end_batch(&batch, written, link);
    }

    /// Starts one batch on pipelined link `p` (`link`): the room's io count is held
    /// until the batch ends.
    fn start_batch(self: &Arc<Self>, p: &dyn Pipelined, link: &Arc<dyn DataLink>, batch: Batch) {
        let io = batch.room.hold_io();
        if batch.room.state().is_terminal() {
            drop(io);
            return self.end_batch(&batch, false, link);
        }
        let runs =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.copy_runs(&batch)));
        let runs = match runs {
            Ok(Ok(runs)) => runs,
            Ok(Err(reason)) => {
                drop(io);
                let written = self.settle(&batch, Ok(Err(reason)));
                return self.end_batch(&batch, written, link);
            }
            Err(panic) => {
                drop(io);
                let written = self.settle(&batch, Err(panic));
                return self.end_batch(&batch, written, link);
            }
        };
        let (engine, l) = (self.clone(), link.clone());
        p.start(
            &runs,
            Box::new(move |sent| {
                drop(io);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    engine.sent(&batch, sent)
                }));
                let written = engine.settle(&batch, r);
                engine.end_batch(&batch, written, &l);
            }),
        );
    }

    /// What a batch's write came to: whether it was written whole; a failure (or a
    /// panic) fails its room.
    fn settle(&self, batch: &Batch, r: std::thread::Result<Result<bool, FailureReason>>) -> bool {
        match r {
            Ok(Ok(written)) => written,
            Ok(Err(reason)) => {
                lifecycle::fail(self, &batch.room, reason, None);
                false
            }
            Err(_) => {
                let why = format!(
                    "internal error (panic) while sending a batch of room {}",
                    batch.room.id()
                );
                lifecycle::fail(
                    self,
                    &batch.room,
                    FailureReason::local(Cause::Internal, why),
                    None,
                );
                false
            }
        }
    }

    /// Ends a batch that was written (`written` whole, or not) on `link`.
    fn end_batch(&self, batch: &Batch, written: bool, link: &Arc<dyn DataLink>) {
        self.batch_ended(batch, written, Some(link));
        if batch.last {
            // Done went out behind it on this link, or will not: either way nothing
            // may wait in the socket now.
            link.flush();
        }
    }

    /// Writes room `room`'s Done `frame` to `peer` on `link` (a sender thread's own). The
    /// room is SUCCESS already (every byte was handed over): if the write fails, the
    /// decode side learns of the broken link as a lost peer.
    fn write_done(&self, room: &PRoom, peer: &Arc<Peer>, link: &Arc<dyn DataLink>, frame: &[u8]) {
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("prefill.write_done", room.id());
        if let Err(e) = link.finish(frame) {
            self.core.control.lose(
                peer,
                format!("writing Done of room {} failed: {e}", room.id()),
            );
        }
    }

    /// Writes one batch. `Ok(false)`: skipped or cut short, its room having ended.
    ///
    /// The batch is counted on the room (`begin_io`) before the state check and until the
    /// link is done reading it, so a scheduler that waits for `kvxfer_room_drained`
    /// never reuses pages a transport still reads.
    fn write_batch(&self, link: &Arc<dyn DataLink>, batch: &Batch) -> Result<bool, FailureReason> {
        let room = &batch.room;
        let mut io = Some(room.begin_io());
        let ended = || room.state().is_terminal();
        if ended() {
            return Ok(false);
        }
        if super::staged::any_on_device(&self.core.node.memory, batch) {
            // Device pages go through the pinned staging ring; the io count goes with
            // them, held until every copy out of the room's pages completed.
            let io = io.take().expect("held until here");
            return self.write_staged(link, batch, io);
        }
        let runs = self.runs(batch)?;
        // A slow link: once the room ends, its pages are no longer read, and the io count
        // drops before the frame in progress is ended with zeros.
        let mut release = || drop(io.take());
        let mut watch = Watch {
            ended: &ended,
            release: &mut release,
        };
        let sent = if batch.last {
            link.write_last_runs(&runs, &mut watch)
        } else {
            link.write_runs(&runs, &mut watch)
        };
        drop(io);
        self.sent(batch, sent)
    }

    /// The batch's runs: each frame's header (with its digest, under `integrity`) and
    /// source bytes.
    pub(super) fn runs<'a>(
        &'a self,
        batch: &Batch,
    ) -> Result<Vec<(DataHeader, &'a [u8])>, FailureReason> {
        let memory = &self.core.node.memory;
        let mut runs = Vec::with_capacity(batch.frames.len());
        for f in &batch.frames {
            let mem = match f.hdr.target {
                Target::Kv => memory.kv.get(),
                Target::Aux => memory.aux.get(),
            }
            .expect("planned only for registered buffers");
            let pages = mem
                .pages(f.hdr.buffer as usize, f.src, f.hdr.n_pages)
                .map_err(|e| FailureReason::local(Cause::Internal, e.to_string()))?;
            let bytes = usize::try_from(f.src_off)
                .ok()
                .and_then(|off| pages.get(off..off.checked_add(f.hdr.byte_len as usize)?))
                .ok_or_else(|| {
                    FailureReason::local(
                        Cause::Internal,
                        format!(
                            "planned bytes {}+{} lie outside source page {}",
                            f.src_off, f.hdr.byte_len, f.src
                        ),
                    )
                })?;
            let mut h = f.hdr;
            #[cfg_attr(not(feature = "test-hooks"), allow(unused_mut))]
            let mut bytes = bytes;
            if self.core.node.config.integrity {
                h.digest = crate::integrity::digest(&h, bytes);
                #[cfg(feature = "test-hooks")]
                integrity_faults(&mut h, &mut bytes);
            }
            runs.push((h, bytes));
        }
        Ok(runs)
    }

    /// What a batch's write (`sent`) came to: `Ok(false)` if it was cut short, its room
    /// having ended; counts what went out.
    fn sent(&self, batch: &Batch, sent: std::io::Result<Sent>) -> Result<bool, FailureReason> {
        let room = &batch.room;
        let sent = sent.map_err(|e| {
            FailureReason::local(
                Cause::Transfer,
                format!(
                    "room {}: writing to {} failed: {e}",
                    room.id(),
                    batch.peer.name
                ),
            )
        })?;
        if sent == Sent::RoomEnded {
            return Ok(false);
        }
        self.batch_sent(batch);
        Ok(true)
    }

    /// A batch went out whole: counted, and its room's deadline renewed.
    pub(super) fn batch_sent(&self, batch: &Batch) {
        let room = &batch.room;
        self.core
            .node
            .metrics
            .bytes_sent
            .fetch_add(batch.bytes as u64, Ordering::Relaxed);
        self.core
            .node
            .metrics
            .data_runs_sent
            .fetch_add(batch.frames.len() as u64, Ordering::Relaxed);
        lifecycle::progressed(self, room);
    }

    /// One batch ended (`written` whole, or not, on `link`): counts its chunk once every
    /// batch of it was written, sends acknowledgements its writes were holding, and
    /// completes the room if this was the last batch of its last chunk.
    pub(super) fn batch_ended(
        &self,
        batch: &Batch,
        written: bool,
        link: Option<&Arc<dyn DataLink>>,
    ) {
        if batch.chunk.end(written) {
            self.chunk_sent();
        }
        {
            let mut p = ext(&batch.room).lock();
            p.completion.ended();
            if link.is_none() {
                // Dropped from its outbox, never taken.
                p.planning.dropped();
            }
        }
        if batch.room.state().is_terminal() {
            // Its writes are complete: acknowledgements waiting for them go.
            self.acks.send_due(&self.core);
        }
        self.try_complete(&batch.room, link.map(|l| (&batch.peer, l)));
    }

    /// Completes the room once its last chunk was planned and every batch of it ended:
    /// claims SUCCESS (if the room is still live), then sends Done to every destination:
    /// on `free`'s link to its engine (the link whose sender just ended the room's last
    /// batch, so free at once; Done and the room's frames may go over different links),
    /// else through the engine's outbox, for one of its senders (never on this thread,
    /// which may be the scheduler's or a control reader's: a write can wait on the
    /// network).
    pub(super) fn try_complete(
        &self,
        room: &Arc<PRoom>,
        free: Option<(&Arc<Peer>, &Arc<dyn DataLink>)>,
    ) {
        let finishes = {
            let mut p = ext(room).lock();
            let Some(finishes) = p.completion.due() else {
                return;
            };
            finishes
        };
        if room.state().is_terminal() {
            return; // a batch did not go out: the room failed, and no Done goes out
        }
        // Every byte is with the transport. Claim completion before telling the decode
        // engines: an abort that comes after the claim finds the room SUCCESS and changes
        // nothing, and one that came before it means no Done is sent, so the two sides
        // never disagree about a prefill-side abort racing the last chunk (both orders:
        // the simulator's scenarios, `engine::sim::scenarios`).
        if !lifecycle::complete(self, room) {
            return; // aborted meanwhile: already FAILED, and no Done goes out
        }
        for (peer, frame) in finishes {
            match free {
                Some((p, l)) if Arc::ptr_eq(p, &peer) && !l.is_broken() => {
                    self.write_done(room, &peer, l, &frame)
                }
                _ => match self.outbox(&peer) {
                    // Closed meanwhile: the engine is lost, and the decode side with it.
                    Some(outbox) => drop(outbox.push_all(
                        room.generation(),
                        vec![Item::Done {
                            room: room.clone(),
                            frame,
                        }],
                    )),
                    None => self.core.control.lose(
                        &peer,
                        format!("no data connection left to send Done of room {}", room.id()),
                    ),
                },
            }
        }
    }
}

/// Test-only faults of a run whose digest was just made, each taken once per room
/// (src/testing.rs): `"integrity.wrong_page"` sends it to the next page,
/// `"integrity.wrong_offset"` (a part of a page of at least 16 bytes) writes its first
/// bytes 8 bytes further into its page, within its own range, and
/// `"integrity.earlier_use"` carries the digest of the room id's previous generation.
#[cfg(feature = "test-hooks")]
fn integrity_faults(h: &mut crate::proto::DataHeader, bytes: &mut &[u8]) {
    use crate::testing::take_fault;
    if take_fault("integrity.wrong_page", h.room) {
        h.first_page += 1;
    } else if h.n_pages == 1 && h.byte_len >= 16 && take_fault("integrity.wrong_offset", h.room) {
        h.page_off += 8;
        h.byte_len -= 8;
        *bytes = &bytes[..bytes.len() - 8];
    } else if take_fault("integrity.earlier_use", h.room) {
        let earlier = crate::proto::DataHeader {
            generation: h.generation - 1,
            ..*h
        };
        h.digest = crate::integrity::digest(&earlier, bytes);
    }
}
