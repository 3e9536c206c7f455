//! The prefill's data path. Workers take the chunks of the rooms hashed to them, in
//! order, and plan each chunk's data frames for each destination ([`plan`]), in batches
//! queued in the destination engine's outbox; a sender thread per link of that engine
//! writes them ([`PrefillEngine::send_loop`]), so one room's frames go out over every
//! connection (or RDMA queue pair) at once. Whoever ends the last batch of a room's last
//! chunk claims the room's completion and sends Done.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use super::outbox::{Batch, Outbox, Ticket};
use super::{ext, Chunk, Dest, Job, PRoom, PrefillEngine};
use crate::control::Peer;
use crate::engine::lifecycle;
use crate::proto::{DataHeader, Message, Target};
use crate::room::{Cause, FailureReason, Refusal};
use crate::transport::tcp::MAX_FRAME_BYTES;
use crate::transport::{coalesce, DataLink, Memory, Sent, Watch};

/// The most frames written in one batch (two iovecs each on TCP, within IOV_MAX).
const BATCH_FRAMES: usize = 64;

/// One data frame to send: its header and the source page (or aux slot) it starts at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Planned {
    pub hdr: DataHeader,
    pub src: u32,
}

/// The data frames of chunk `chunk` for destination `dest`, whose pages from `start` on
/// the chunk fills, in the order they are sent: for each run of pages consecutive on
/// both sides, for each KV buffer, frames of at most `MAX_FRAME_BYTES`; then, for the
/// last chunk, one aux row per aux buffer (when both sides give an aux slot).
pub(crate) fn plan(
    room: u64,
    chunk: &Chunk,
    dest: &Dest,
    start: usize,
    kv: &Memory,
    aux: Option<&Memory>,
) -> Vec<Planned> {
    let n = chunk.pages.len();
    let mut out = Vec::new();
    for run in coalesce(&chunk.pages, &dest.pages[start..start + n]) {
        for (b, desc) in kv.buffers().iter().enumerate() {
            let per = (MAX_FRAME_BYTES / desc.item_len).max(1) as u32;
            let mut off = 0;
            while off < run.len {
                let k = per.min(run.len - off);
                out.push(Planned {
                    hdr: DataHeader {
                        room,
                        generation: dest.generation,
                        target: Target::Kv,
                        buffer: b as u32,
                        first_page: run.dst + off,
                        n_pages: k,
                        byte_len: (k as usize * desc.item_len) as u32,
                    },
                    src: run.src + off,
                });
                off += k;
            }
        }
    }
    if let (true, Some(src), Some(dst), Some(aux)) = (chunk.is_last, chunk.aux, dest.aux, aux) {
        for (b, desc) in aux.buffers().iter().enumerate() {
            out.push(Planned {
                hdr: DataHeader {
                    room,
                    generation: dest.generation,
                    target: Target::Aux,
                    buffer: b as u32,
                    first_page: dst,
                    n_pages: 1,
                    byte_len: desc.item_len as u32,
                },
                src,
            });
        }
    }
    out
}

/// The frames of one batch and their payload bytes.
type Grouped = (Vec<Planned>, usize);

/// Groups a destination's planned frames into batches: at most `BATCH_FRAMES` frames or
/// `MAX_FRAME_BYTES` of payload each.
fn batches(frames: Vec<Planned>, room: u64) -> Vec<Grouped> {
    #[allow(unused_mut)]
    let mut per = BATCH_FRAMES;
    #[cfg(feature = "test-hooks")]
    if crate::testing::is_armed("worker.mid_chunk", room) {
        // While armed, one frame per batch, so the pause falls between two frames.
        per = 1;
    }
    let _ = room;
    let mut out: Vec<Grouped> = Vec::new();
    for f in frames {
        let len = f.hdr.byte_len as usize;
        match out.last_mut() {
            Some((b, bytes)) if b.len() < per && *bytes < MAX_FRAME_BYTES => {
                b.push(f);
                *bytes += len;
            }
            _ => out.push((vec![f], len)),
        }
    }
    out
}

impl PrefillEngine {
    /// A worker thread: plans chunks in order until the engine stops.
    pub(super) fn worker(&self, _index: usize, jobs: mpsc::Receiver<Job>) {
        for job in jobs {
            let room = job.room.clone();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.plan_chunk(&job.room, &job.chunk)
            }));
            let failure = match r {
                Ok(Ok(())) => None,
                Ok(Err(reason)) => Some(reason),
                Err(_) => Some(FailureReason::local(
                    Cause::Internal,
                    format!(
                        "internal error (panic) while planning a chunk of room {}",
                        room.id()
                    ),
                )),
            };
            if let Some(reason) = failure {
                lifecycle::fail(self, &room, reason, None);
            }
        }
    }

    /// Plans one chunk for every destination and queues its batches in the destinations'
    /// outboxes; for the last chunk, the Done frames too. Returns the reason to fail the
    /// room with, if any.
    fn plan_chunk(&self, room: &Arc<PRoom>, chunk: &Chunk) -> Result<(), FailureReason> {
        if room.state().is_terminal() {
            // Skipped: the room is already terminal (aborted, failed or done).
            return Ok(());
        }
        let (dests, start) = {
            let p = ext(room).lock();
            (p.dests.clone(), p.cursor)
        };
        let n = chunk.pages.len();
        match lifecycle::start(self, room) {
            Ok(()) => {}
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
        let memory = &self.core.node.memory;
        let kv = memory
            .kv
            .get()
            .expect("rooms exist only after KV registration");
        let aux = memory.aux.get();
        let mut queued: Vec<(Arc<Outbox>, Arc<Peer>, Vec<Grouped>)> = Vec::new();
        let mut finishes = Vec::new();
        for dest in &dests {
            let pages = &dest.pages;
            let peer = &dest.peer;
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
            let Some(outbox) = self.outbox(peer) else {
                return Err(FailureReason::local(
                    Cause::PeerLost,
                    format!("no data connection to {}", peer.name),
                ));
            };
            let frames = plan(room.id(), chunk, dest, start, kv, aux);
            let aux_sent = frames.iter().any(|f| f.hdr.target == Target::Aux);
            if chunk.is_last {
                let mut frame = Vec::with_capacity(64);
                Message::Done {
                    room: room.id(),
                    generation: dest.generation,
                    pages_sent: pages.len() as u32,
                    aux_sent,
                }
                .encode(&mut frame)
                .map_err(|e| FailureReason::local(Cause::Internal, e.to_string()))?;
                finishes.push((peer.clone(), frame));
            }
            queued.push((outbox, peer.clone(), batches(frames, room.id())));
        }
        let total: usize = queued.iter().map(|(_, _, b)| b.len()).sum();
        let ticket = Ticket::new(total);
        {
            let mut p = ext(room).lock();
            p.cursor = start + n;
            p.outstanding += total;
            if chunk.is_last {
                p.sealed = true;
                p.finishes = finishes;
            }
        }
        if total == 0 {
            self.chunk_sent();
        }
        for (outbox, peer, batches) in queued {
            let n = batches.len();
            for (i, (frames, bytes)) in batches.into_iter().enumerate() {
                let batch = Batch {
                    room: room.clone(),
                    peer: peer.clone(),
                    frames,
                    bytes,
                    chunk: ticket.clone(),
                    last: chunk.is_last && i + 1 == n,
                };
                if let Err(batch) = outbox.push(batch) {
                    // The engine was lost meanwhile (its loss fails the room).
                    self.batch_ended(&batch, false, None);
                }
            }
        }
        if chunk.is_last {
            // An empty last chunk (or one whose batches all ended already) completes here.
            self.try_complete(room, None);
        }
        Ok(())
    }

    fn chunk_sent(&self) {
        self.core
            .node
            .metrics
            .chunks
            .fetch_add(1, Ordering::Relaxed);
    }

    /// A sender thread: writes the batches of `peer`'s outbox over `link` until the
    /// outbox closes (the peer is lost or the engine stops), or the link breaks.
    pub(super) fn send_loop(&self, peer: &Arc<Peer>, link: &Arc<dyn DataLink>, outbox: &Outbox) {
        while let Some(batch) = outbox.pop() {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.write_batch(link, &batch)
            }));
            let written = match r {
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
            };
            self.batch_ended(&batch, written, Some(link));
            if batch.last {
                // Done went out behind it on this link, or will not: either way nothing
                // may wait in the socket now.
                link.flush();
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
        let memory = &self.core.node.memory;
        let mut runs = Vec::with_capacity(batch.frames.len());
        for f in &batch.frames {
            let mem = match f.hdr.target {
                Target::Kv => memory.kv.get(),
                Target::Aux => memory.aux.get(),
            }
            .expect("planned only for registered buffers");
            let bytes = mem
                .pages(f.hdr.buffer as usize, f.src, f.hdr.n_pages)
                .map_err(|e| FailureReason::local(Cause::Internal, e.to_string()))?;
            runs.push((f.hdr, bytes));
        }
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
        drop(io);
        if sent == Sent::RoomEnded {
            return Ok(false);
        }
        self.core
            .node
            .metrics
            .bytes_sent
            .fetch_add(batch.bytes as u64, Ordering::Relaxed);
        lifecycle::progressed(self, room);
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("worker.mid_chunk", room.id());
        Ok(true)
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
            p.outstanding -= 1;
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
    /// else on the engine's first link.
    fn try_complete(&self, room: &Arc<PRoom>, free: Option<(&Arc<Peer>, &Arc<dyn DataLink>)>) {
        let finishes = {
            let mut p = ext(room).lock();
            if !p.sealed || p.outstanding > 0 || p.finishes.is_empty() {
                return;
            }
            std::mem::take(&mut p.finishes)
        };
        if room.state().is_terminal() {
            return; // a batch did not go out: the room failed, and no Done goes out
        }
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("worker.before_complete", room.id());
        // Every byte is with the transport. Claim completion before telling the decode
        // engines: an abort that comes after the claim finds the room SUCCESS and changes
        // nothing, and one that came before it means no Done is sent, so the two sides
        // never disagree about a prefill-side abort racing the last chunk.
        if !lifecycle::complete(self, room) {
            return; // aborted meanwhile: already FAILED, and no Done goes out
        }
        for (peer, frame) in finishes {
            let link = match free {
                Some((p, l)) if Arc::ptr_eq(p, &peer) && !l.is_broken() => Some(l.clone()),
                _ => peer.data.read().first().cloned(),
            };
            let r = match link {
                Some(l) => l.finish(&frame),
                None => Err(std::io::Error::other("no data connection left")),
            };
            if let Err(e) = r {
                // The room is SUCCESS here (every byte was handed over); the decode side
                // learns of the broken link as a lost peer.
                self.core.control.lose(
                    &peer,
                    format!("writing Done of room {} failed: {e}", room.id()),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::BufferDesc;

    fn memory(bufs: usize, pages: usize, item: usize, backing: &mut Vec<Vec<u8>>) -> Memory {
        *backing = (0..bufs).map(|_| vec![0u8; pages * item]).collect();
        Memory::new(
            backing
                .iter_mut()
                .map(|b| BufferDesc {
                    base: b.as_mut_ptr() as usize,
                    len: b.len(),
                    item_len: item,
                })
                .collect(),
        )
    }

    fn dest(pages: &[u32], aux: Option<u32>) -> Dest {
        Dest {
            peer: crate::control::Peer::new(
                "k".into(),
                "peer".into(),
                0,
                crate::log::Logger::new(crate::log::Level::Error, None),
            ),
            generation: 9,
            pages: pages.into(),
            aux,
        }
    }

    /// Runs consecutive on both sides become one frame per buffer; breaks start new
    /// frames; every frame of a buffer comes in page order, then the aux rows.
    #[test]
    fn a_chunk_plans_one_frame_per_run_per_buffer_then_the_aux_rows() {
        let (mut kvb, mut auxb) = (Vec::new(), Vec::new());
        let kv = memory(2, 64, 1024, &mut kvb);
        let aux = memory(3, 4, 32, &mut auxb);
        let d = dest(&[10, 11, 12, 20, 21], Some(2));
        let chunk = Chunk {
            pages: vec![0, 1, 2, 7, 8],
            is_last: true,
            aux: Some(1),
        };
        let p = plan(5, &chunk, &d, 0, &kv, Some(&aux));
        let kv_frames: Vec<(u32, u32, u32, u32)> = p
            .iter()
            .filter(|f| f.hdr.target == Target::Kv)
            .map(|f| (f.hdr.buffer, f.hdr.first_page, f.hdr.n_pages, f.src))
            .collect();
        assert_eq!(
            kv_frames,
            vec![(0, 10, 3, 0), (1, 10, 3, 0), (0, 20, 2, 7), (1, 20, 2, 7)]
        );
        let aux_frames: Vec<(u32, u32, u32)> = p
            .iter()
            .filter(|f| f.hdr.target == Target::Aux)
            .map(|f| (f.hdr.buffer, f.hdr.first_page, f.src))
            .collect();
        assert_eq!(aux_frames, vec![(0, 2, 1), (1, 2, 1), (2, 2, 1)]);
        assert!(p.iter().all(|f| f.hdr.room == 5 && f.hdr.generation == 9));
        assert!(p.iter().all(|f| f.hdr.byte_len as usize
            == f.hdr.n_pages as usize * if f.hdr.target == Target::Kv { 1024 } else { 32 }));
    }

    /// A run longer than a frame is split into frames of at most MAX_FRAME_BYTES; a
    /// non-last chunk (or one without an aux slot on either side) plans no aux row.
    #[test]
    fn long_runs_split_at_the_frame_limit_and_only_the_last_chunk_carries_aux() {
        let (mut kvb, mut auxb) = (Vec::new(), Vec::new());
        let item = 1 << 20;
        let kv = memory(1, 10, item, &mut kvb);
        let aux = memory(1, 4, 32, &mut auxb);
        let d = dest(&(0..10).collect::<Vec<u32>>(), Some(0));
        let chunk = Chunk {
            pages: (0..10).collect(),
            is_last: false,
            aux: None,
        };
        let p = plan(1, &chunk, &d, 0, &kv, Some(&aux));
        let per = (MAX_FRAME_BYTES / item) as u32;
        assert!(p.iter().all(|f| f.hdr.n_pages <= per));
        assert_eq!(p.iter().map(|f| f.hdr.n_pages).sum::<u32>(), 10);
        assert!(p.iter().all(|f| f.hdr.target == Target::Kv));
        let last = Chunk {
            pages: vec![],
            is_last: true,
            aux: None,
        };
        assert!(plan(1, &last, &dest(&[], Some(0)), 0, &kv, Some(&aux)).is_empty());
    }
}
