//! Sending device pages over TCP: each planned frame's bytes are copied out of device
//! memory into a slot of the sender thread's pinned staging ring
//! ([`crate::transport::staging`], with the CUDA copy engine), up to a slot per frame
//! ahead, and written from the slot once its copy completed, so the copies of the next
//! frames overlap the socket writes of this one. Frames in host memory (aux rows, usually)
//! go straight from their pages, after the device ones.
//!
//! The room's io count is held until every copy out of its pages completed (the ring
//! returns only then): `kvxfer_room_drained` on the prefill never says drained while a
//! copy still reads the room's pages. Once the room ends, no further copy is issued.

use std::cell::RefCell;
use std::sync::Arc;

use super::outbox::Batch;
use super::plan::Planned;
use super::PrefillEngine;
use crate::cuda::copy::Rings;
use crate::node::Registry;
use crate::proto::{DataHeader, Target};
use crate::room::{Cause, FailureReason, IoGuard};
use crate::transport::staging::Flow;
use crate::transport::{DataLink, MemKind, Memory, Sent, Watch};

thread_local! {
    /// The sender thread's staging rings, one per device, allocated on first use.
    static RINGS: RefCell<Rings> = RefCell::new(Rings::default());
}

fn memory_of<'m>(memory: &'m Registry, f: &Planned) -> &'m Memory {
    match f.hdr.target {
        Target::Kv => memory.kv.get(),
        Target::Aux => memory.aux.get(),
    }
    .expect("planned only for registered buffers")
}

/// Whether frame `f` reads device memory.
pub(super) fn on_device(memory: &Registry, f: &Planned) -> bool {
    memory_of(memory, f)
        .kind(f.hdr.buffer as usize)
        .is_some_and(|k| !k.is_host())
}

/// Whether any frame of `batch` reads device memory.
pub(super) fn any_on_device(memory: &Registry, batch: &Batch) -> bool {
    batch.frames.iter().any(|f| on_device(memory, f))
}

/// Consecutive frames grouped so that each group's bytes fit one slot of `slot_len`
/// (every frame alone does: the ring's slots hold the longest).
fn pack(frames: &[(DataHeader, usize)], slot_len: usize) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, (h, _)) in frames.iter().enumerate() {
        let len = h.byte_len as usize;
        match groups.last_mut() {
            Some(g) if bytes + len <= slot_len => {
                g.end = i + 1;
                bytes += len;
            }
            _ => {
                groups.push(i..i + 1);
                bytes = len;
            }
        }
    }
    groups
}

impl PrefillEngine {
    /// `write_batch` for a batch with frames in device memory; `io` is the room's io
    /// count, held until no copy reads its pages.
    pub(super) fn write_staged(
        &self,
        link: &Arc<dyn DataLink>,
        batch: &Batch,
        io: IoGuard<'_>,
    ) -> Result<bool, FailureReason> {
        let room = &batch.room;
        if room.state().is_terminal() {
            return Ok(false);
        }
        let memory = &self.core.node.memory;
        let internal = |e: crate::Error| FailureReason::local(Cause::Internal, e.to_string());
        let transfer = |what: &str, e: std::io::Error| {
            FailureReason::local(
                Cause::Transfer,
                format!(
                    "room {}: {what} to {} failed: {e}",
                    room.id(),
                    batch.peer.name
                ),
            )
        };
        // Device frames by device (one, in practice), then the host ones.
        let mut devices: Vec<(u32, Vec<(DataHeader, usize)>)> = Vec::new();
        let mut host: Vec<(DataHeader, &[u8])> = Vec::new();
        for f in &batch.frames {
            let mem = memory_of(memory, f);
            let (b, len) = (f.hdr.buffer as usize, f.hdr.byte_len as usize);
            let off = usize::try_from(f.src_off).unwrap_or(usize::MAX);
            match mem.kind(b) {
                Some(MemKind::Cuda { device }) => {
                    let addr = mem
                        .device_run(b, f.src, f.hdr.n_pages, off, len)
                        .map_err(internal)?;
                    match devices.iter_mut().find(|(d, _)| *d == device) {
                        Some((_, v)) => v.push((f.hdr, addr)),
                        None => devices.push((device, vec![(f.hdr, addr)])),
                    }
                }
                _ => {
                    let pages = mem.pages(b, f.src, f.hdr.n_pages).map_err(internal)?;
                    let bytes = pages.get(off..off.saturating_add(len)).ok_or_else(|| {
                        FailureReason::local(
                            Cause::Internal,
                            format!(
                                "planned bytes {}+{len} lie outside source page {}",
                                f.src_off, f.src
                            ),
                        )
                    })?;
                    let mut h = f.hdr;
                    if self.core.node.config.integrity {
                        h.digest = crate::integrity::digest(&h, bytes);
                    }
                    host.push((h, bytes));
                }
            }
        }
        let ended = || room.state().is_terminal();
        // The pages are read by the copies only: a write that waits on a slow link holds
        // nothing of the room (the slot is the ring's).
        let mut nothing = || {};
        let mut watch = Watch {
            ended: &ended,
            release: &mut nothing,
        };
        let integrity = self.core.node.config.integrity;
        for (device, frames) in &devices {
            let longest = frames.iter().map(|(h, _)| h.byte_len as usize).max();
            let mut link_err = None;
            let flow = RINGS.with(|r| {
                let mut rings = r.borrow_mut();
                let ring = rings.get(*device, longest.unwrap_or(0))?;
                // Consecutive frames share a slot while they fit: small pages then go out
                // several to a write (DataRuns frames), as from host memory.
                let groups = pack(frames, ring.slot_len());
                let pieces: Vec<Vec<(usize, usize)>> = groups
                    .iter()
                    .map(|g| {
                        frames[g.clone()]
                            .iter()
                            .map(|(h, a)| (*a, h.byte_len as usize))
                            .collect()
                    })
                    .collect();
                // SAFETY: every range lies in registered device memory (device_run),
                // valid until the engine is freed, which outlives this call.
                unsafe {
                    ring.send(&pieces, &|| !ended(), &mut |i, bytes| {
                        let mut runs = Vec::with_capacity(groups[i].len());
                        let mut at = 0;
                        for (h, _) in &frames[groups[i].clone()] {
                            let len = h.byte_len as usize;
                            let mut h = *h;
                            let b = &bytes[at..at + len];
                            if integrity {
                                h.digest = crate::integrity::digest(&h, b);
                            }
                            runs.push((h, b));
                            at += len;
                        }
                        match link.write_runs(&runs, &mut watch) {
                            Ok(Sent::All) => Ok(Flow::Go),
                            Ok(Sent::RoomEnded) => Ok(Flow::Stop),
                            Err(e) => {
                                let kind = e.kind();
                                link_err = Some(e);
                                Err(std::io::Error::from(kind))
                            }
                        }
                    })
                }
            });
            match (flow, link_err) {
                (_, Some(e)) => return Err(transfer("writing", e)),
                (Err(e), None) => return Err(transfer("staging device pages", e)),
                (Ok(Flow::Stop), None) => return Ok(false),
                (Ok(Flow::Go), None) => {}
            }
        }
        if !host.is_empty() {
            // Host pages as in `write_batch`: once the room ends while the link waits,
            // they are no longer read and the io count drops.
            let mut io = Some(io);
            let mut release = || drop(io.take());
            let mut watch = Watch {
                ended: &ended,
                release: &mut release,
            };
            let sent = if batch.last {
                link.write_last_runs(&host, &mut watch)
            } else {
                link.write_runs(&host, &mut watch)
            }
            .map_err(|e| transfer("writing", e))?;
            if sent == Sent::RoomEnded {
                return Ok(false);
            }
        }
        self.batch_sent(batch);
        Ok(true)
    }
}

impl PrefillEngine {
    /// The runs of a batch for a pipelined (same-host) link, each with the address of
    /// its bytes here: host pages as [`PrefillEngine::runs`] gives them (digested with
    /// `integrity=verify`); device pages, on the CUDA IPC path, by their device address,
    /// which the decode engine translates through its import table (never dereferenced
    /// here). A pairing with device memory never takes this path with integrity on (the
    /// bytes could not be digested without a copy back), so a device run then is a bug.
    pub(super) fn copy_runs(&self, batch: &Batch) -> Result<Vec<(DataHeader, u64)>, FailureReason> {
        let memory = &self.core.node.memory;
        if !any_on_device(memory, batch) {
            let runs = self.runs(batch)?;
            return Ok(runs.iter().map(|(h, b)| (*h, b.as_ptr() as u64)).collect());
        }
        if self.core.node.config.integrity {
            return Err(FailureReason::local(
                Cause::Internal,
                "device pages on a same-host link with integrity=verify".to_string(),
            ));
        }
        let internal = |e: crate::Error| FailureReason::local(Cause::Internal, e.to_string());
        let mut out = Vec::with_capacity(batch.frames.len());
        for f in &batch.frames {
            let mem = memory_of(memory, f);
            let h = f.hdr;
            let addr = if on_device(memory, f) {
                let off = usize::try_from(f.src_off).map_err(|_| {
                    FailureReason::local(Cause::Internal, "a run offset past usize".to_string())
                })?;
                mem.device_run(
                    h.buffer as usize,
                    f.src,
                    h.n_pages,
                    off,
                    h.byte_len as usize,
                )
                .map_err(internal)?
            } else {
                let pages = mem
                    .pages(h.buffer as usize, f.src, h.n_pages)
                    .map_err(internal)?;
                let off = usize::try_from(f.src_off).unwrap_or(usize::MAX);
                pages
                    .get(off..off.saturating_add(h.byte_len as usize))
                    .ok_or_else(|| {
                        FailureReason::local(
                            Cause::Internal,
                            format!(
                                "planned bytes {off}+{} lie outside source page {}",
                                h.byte_len, f.src
                            ),
                        )
                    })?
                    .as_ptr() as usize
            };
            #[cfg(feature = "test-hooks")]
            let addr = if on_device(memory, f) && crate::testing::take_fault("ipc.outside", h.room)
            {
                // A source the decode engine was never given: past this buffer's
                // allocation by a page-aligned distance it cannot have exported.
                addr.wrapping_add(1 << 40)
            } else {
                addr
            };
            out.push((h, addr as u64));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Target;

    fn frame(len: u32) -> (DataHeader, usize) {
        let h = DataHeader {
            room: 1,
            generation: 1,
            target: Target::Kv,
            buffer: 0,
            first_page: 0,
            n_pages: 1,
            byte_len: len,
            page_off: 0,
            digest: 0,
        };
        (h, 0)
    }

    #[test]
    fn consecutive_frames_share_a_slot_while_they_fit_and_a_long_one_has_its_own() {
        let frames: Vec<_> = [300, 300, 400, 100, 1000, 1, 999].map(frame).into();
        assert_eq!(pack(&frames, 1000), vec![0..3, 3..4, 4..5, 5..7]);
        assert_eq!(pack(&frames[..1], 1000), vec![0..1]);
        assert!(pack(&[], 1000).is_empty());
    }
}
