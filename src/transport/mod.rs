//! Transports move page bytes between registered memory of two engines.
//!
//! [`Memory`] is the one place that turns registered addresses into byte slices. The
//! registration contract (`kvxfer_register_kv`: the memory stays valid until the engine
//! is freed) plus the range checks here make those slices sound.

pub mod copy_link;
pub mod fdpass;
pub mod rdma;
pub mod samehost;
pub mod staging;
pub mod tcp;

use std::io;

use crate::proto::DataHeader;

/// Where a registered buffer lives. Only host memory may be read or written by the CPU:
/// [`Memory`] refuses host slices of device memory, so no host code path can touch a
/// device address (a host `memcpy` of one would crash the process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MemKind {
    /// Host memory (the process's own address space).
    #[default]
    Host,
    /// CUDA device memory of device `device` (an ordinal as the CUDA driver counts).
    Cuda {
        /// The CUDA device ordinal.
        device: u32,
    },
}

impl MemKind {
    /// Whether the CPU may read and write it.
    pub fn is_host(self) -> bool {
        self == MemKind::Host
    }
}

impl std::fmt::Display for MemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemKind::Host => f.write_str("host memory"),
            MemKind::Cuda { device } => write!(f, "CUDA device memory of device {device}"),
        }
    }
}

/// One registered memory buffer, as addresses (the engine never dereferences them
/// itself; [`Memory`] does, under the registration contract, and only for host memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferDesc {
    /// First byte.
    pub base: usize,
    /// Bytes in the buffer.
    pub len: usize,
    /// Bytes of one page (KV) or one slot (aux).
    pub item_len: usize,
    /// Where the bytes live.
    pub kind: MemKind,
}

impl BufferDesc {
    /// A buffer of host memory.
    pub fn host(base: usize, len: usize, item_len: usize) -> Self {
        BufferDesc {
            base,
            len,
            item_len,
            kind: MemKind::Host,
        }
    }

    /// Whole pages (or slots) the buffer holds.
    pub fn items(&self) -> usize {
        self.len / self.item_len
    }
}

/// What a batch write asks of its room while a slow link holds it up: `ended` (is the
/// room terminal?) is asked whenever a write had to wait; once it says yes, the link
/// stops reading the room's pages, calls `release` (the room's memory is no longer
/// touched), ends the frame in progress with zeros so that the stream stays whole, sends
/// none of the batch's other frames, and returns [`Sent::RoomEnded`].
pub struct Watch<'a> {
    pub ended: &'a dyn Fn() -> bool,
    pub release: &'a mut dyn FnMut(),
}

/// How a batch write that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Sent {
    /// Every run of the batch went out.
    All,
    /// The room ended while the batch waited (see [`Watch`]): part of it went out.
    RoomEnded,
}

/// One way of moving a room's page runs to one peer engine, used by the prefill workers.
///
/// Implementations: [`tcp::SendConn`] (a data frame per run on a socket; the receiver
/// validates and reads it into the granted pages) and [`rdma::link::RdmaLink`]
/// (one-sided writes into the peer's registered memory; `finish` goes over the control
/// connection).
pub trait DataLink: Send + Sync {
    /// Moves each `(hdr, bytes)` run (whole pages of one registered buffer) to where its
    /// header says. Returns once the transport no longer reads `bytes` (TCP: handed to
    /// the socket; RDMA: every write completed). An error means the link is broken, and
    /// nothing more of the batch may be assumed delivered.
    /// A link may watch the room through `watch` while it waits (TCP does; an RDMA batch
    /// ends with its completions).
    fn write_runs(&self, runs: &[(DataHeader, &[u8])], watch: &mut Watch<'_>) -> io::Result<Sent>;

    /// As [`write_runs`](Self::write_runs) for a room's last batch: the transport may
    /// hold the batch's tail back so that the Done behind it travels in the same packet
    /// (TCP: `MSG_MORE`). The caller calls [`flush`](Self::flush) once it has sent Done,
    /// or decided not to.
    fn write_last_runs(
        &self,
        runs: &[(DataHeader, &[u8])],
        watch: &mut Watch<'_>,
    ) -> io::Result<Sent> {
        self.write_runs(runs, watch)
    }

    /// Sends at once whatever [`write_last_runs`](Self::write_last_runs) held back.
    fn flush(&self) {}

    /// Whether the link can carry nothing more (a TCP connection whose write failed:
    /// its stream is shut). A broken RDMA queue pair is replaced on the next use, so an
    /// RDMA link never says so.
    fn is_broken(&self) -> bool {
        false
    }

    /// A link whose batches end after the call that starts them returns (see
    /// [`Pipelined`]); `None` (the default) for a link whose `write_runs` returns once
    /// the batch ended.
    fn as_pipelined(&self) -> Option<&dyn Pipelined> {
        None
    }

    /// Sends an encoded `Done` frame once every `write_runs` of the room has returned.
    /// The room's frames may have gone over other links of the same peer: the receiver
    /// completes the room when both Done and every page it counts have arrived.
    fn finish(&self, done_frame: &[u8]) -> io::Result<()>;
}

/// What a pipelined batch's end is given: what [`DataLink::write_runs`] would have
/// returned. Called exactly once, on whichever thread learns of the end.
pub type BatchEnd = Box<dyn FnOnce(io::Result<Sent>) + Send>;

/// A link that keeps several batches in flight ([`copy_link::CopyLink`]: the same-host
/// path, whose batches end when the decode engine answers that it copied them): `start`
/// sends the batch and returns; `end` is called once the transport no longer reads the
/// batch's bytes (or the link broke: an error), so the caller holds the room's io count
/// in `end` until then.
pub trait Pipelined {
    /// Starts a batch of `runs`, each with the address of its bytes in this process
    /// (host memory, or device memory on the CUDA IPC path: never dereferenced here).
    fn start(&self, runs: &[(DataHeader, u64)], end: BatchEnd);
}

use crate::err;
use crate::error::Result;

/// A list of registered buffers (the KV buffers or the aux buffers of one engine).
#[derive(Debug, Clone)]
pub struct Memory {
    bufs: Vec<BufferDesc>,
    layers: Vec<Option<u32>>,
}

impl Memory {
    /// Wraps validated buffer descriptors without layer ids.
    pub fn new(bufs: Vec<BufferDesc>) -> Self {
        let layers = vec![None; bufs.len()];
        Memory { bufs, layers }
    }

    /// Wraps validated buffer descriptors with one layer id per buffer.
    pub fn with_layers(bufs: Vec<BufferDesc>, layers: Vec<u32>) -> Self {
        debug_assert_eq!(bufs.len(), layers.len());
        Memory {
            bufs,
            layers: layers.into_iter().map(Some).collect(),
        }
    }

    /// The layer id of `buffer`, if layer ids were registered.
    pub fn layer(&self, buffer: usize) -> Option<u32> {
        self.layers.get(buffer).copied().flatten()
    }

    /// The buffers.
    pub fn buffers(&self) -> &[BufferDesc] {
        &self.bufs
    }

    /// Pages (or slots) every buffer holds: the smallest `len / item_len`.
    pub fn capacity(&self) -> usize {
        self.bufs.iter().map(BufferDesc::items).min().unwrap_or(0)
    }

    /// Where `buffer` lives (`None`: not registered).
    pub fn kind(&self, buffer: usize) -> Option<MemKind> {
        self.bufs.get(buffer).map(|b| b.kind)
    }

    /// Whether any buffer is device memory.
    pub fn has_device(&self) -> bool {
        self.bufs.iter().any(|b| !b.kind.is_host())
    }

    /// The device address and length of pages `first..first+n` of `buffer`, which must
    /// be device memory: for a copy engine, never for the CPU to dereference.
    pub fn device_range(&self, buffer: usize, first: u32, n: u32) -> Result<(usize, usize)> {
        let (addr, len) = self.range_any(buffer, first, n)?;
        match self.bufs[buffer].kind {
            MemKind::Host => Err(err!(
                InvalidArgument,
                "buffer {buffer} is host memory, not device memory"
            )),
            MemKind::Cuda { .. } => Ok((addr, len)),
        }
    }

    /// As [`device_range`](Self::device_range), for bytes `off..off + len` of the pages.
    pub fn device_run(
        &self,
        buffer: usize,
        first: u32,
        n: u32,
        off: usize,
        len: usize,
    ) -> Result<usize> {
        self.device_range(buffer, first, n)?;
        self.run_addr_any(buffer, first, n, off, len)
    }

    /// The range of pages `first..first+n` of `buffer`, which must be host memory: the
    /// one gate every host slice passes.
    fn range(&self, buffer: usize, first: u32, n: u32) -> Result<(usize, usize)> {
        let (addr, len) = self.range_any(buffer, first, n)?;
        match self.bufs[buffer].kind {
            MemKind::Host => Ok((addr, len)),
            kind => Err(err!(
                InvalidArgument,
                "buffer {buffer} is {kind}: the CPU may not read or write it"
            )),
        }
    }

    fn range_any(&self, buffer: usize, first: u32, n: u32) -> Result<(usize, usize)> {
        let b = self
            .bufs
            .get(buffer)
            .ok_or_else(|| err!(InvalidArgument, "buffer {buffer} is not registered"))?;
        let end = first as usize + n as usize;
        if n == 0 || end > b.items() {
            return Err(err!(
                InvalidArgument,
                "pages {first}..{end} are outside buffer {buffer} ({} pages)",
                b.items()
            ));
        }
        Ok((
            b.base + first as usize * b.item_len,
            n as usize * b.item_len,
        ))
    }

    /// Whether pages `first..first+n` lie inside `buffer`; the error says why not.
    pub fn check_range(&self, buffer: usize, first: u32, n: u32) -> Result<()> {
        self.range_any(buffer, first, n).map(|_| ())
    }

    /// The bytes of pages `first..first+n` of `buffer`, for sending.
    pub fn pages(&self, buffer: usize, first: u32, n: u32) -> Result<&[u8]> {
        let (addr, len) = self.range(buffer, first, n)?;
        // SAFETY: `addr..addr+len` lies inside a buffer the host registered and promised
        // to keep valid until the engine is freed (which outlives `self`'s users). The
        // host owns the contents; reading bytes it may be writing concurrently yields
        // arbitrary bytes, never undefined behaviour for u8.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    }

    /// Bytes `off..off + len` of pages `first..first+n` of `buffer`, for reading what a
    /// data run wrote (its digest): exactly the run's bytes, no more.
    pub fn bytes(
        &self,
        buffer: usize,
        first: u32,
        n: u32,
        off: usize,
        len: usize,
    ) -> Result<&[u8]> {
        let addr = self.run_addr(buffer, first, n, off, len)?;
        // SAFETY: inside registered memory as in `pages`, `off + len` checked by
        // `run_addr`. The bytes are the ones one run of a room took
        // (`DecodeRoom::take_grants`), which no other receiver writes; over RDMA the
        // writes that filled them completed before the progress that names them was
        // sent. A peer that still wrote into them could only change what is read
        // (arbitrary bytes, never undefined behaviour for u8), failing the digest.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    }

    /// Bytes `off..off + len` of pages `first..first+n` of `buffer`, for receiving into:
    /// exactly the bytes one data run fills, no more.
    ///
    /// Callers must only ask for bytes granted to a live room and taken by one run of
    /// it (`DecodeRoom::take_grants`), so that no two receivers hold the same KV bytes.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(
        &self,
        buffer: usize,
        first: u32,
        n: u32,
        off: usize,
        len: usize,
    ) -> Result<&mut [u8]> {
        let addr = self.run_addr(buffer, first, n, off, len)?;
        // SAFETY: inside registered memory as in `pages` (`off + len` is checked against
        // the pages' extent by `run_addr`). Exclusive use of KV bytes: destination pages
        // belong to exactly one live room, and the room admits each of its bytes to one
        // run only (`DecodeRoom::take_grants` refuses a run that repeats taken bytes), so
        // the receiver threads of the room's peers (several links, several prefill ranks
        // writing head slices of one page) hold disjoint ranges. The one exception is an
        // aux row, which every prefill engine of a room sends (pipeline stages, ranks):
        // two of them may write the same row at once, plain bytes of the request's own
        // metadata that the host reads only after SUCCESS.
        Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) })
    }

    /// The address of byte `off` of pages `first..first+n` of `buffer`, once `off + len`
    /// is checked to lie inside those pages.
    fn run_addr(&self, buffer: usize, first: u32, n: u32, off: usize, len: usize) -> Result<usize> {
        self.range(buffer, first, n)?;
        self.run_addr_any(buffer, first, n, off, len)
    }

    /// `run_addr` for memory of any kind.
    fn run_addr_any(
        &self,
        buffer: usize,
        first: u32,
        n: u32,
        off: usize,
        len: usize,
    ) -> Result<usize> {
        let (addr, pages_len) = self.range_any(buffer, first, n)?;
        if off.checked_add(len).is_none_or(|end| end > pages_len) {
            return Err(err!(
                InvalidArgument,
                "bytes {off}+{len} lie outside pages {first}..{} of buffer {buffer}",
                first as u64 + n as u64
            ));
        }
        Ok(addr + off)
    }

    /// The item length of `buffer`.
    pub fn item_len(&self, buffer: usize) -> Option<usize> {
        self.bufs.get(buffer).map(|b| b.item_len)
    }
}

/// A maximal run of page pairs consecutive on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First source page.
    pub src: u32,
    /// First destination page.
    pub dst: u32,
    /// Pages in the run.
    pub len: u32,
}

/// Coalesces `(src[i], dst[i])` pairs into runs where both sides are consecutive.
pub fn coalesce(src: &[u32], dst: &[u32]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        match runs.last_mut() {
            Some(r)
                if r.src.checked_add(r.len) == Some(s) && r.dst.checked_add(r.len) == Some(d) =>
            {
                r.len += 1
            }
            _ => runs.push(Run {
                src: s,
                dst: d,
                len: 1,
            }),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_pairs_become_one_run_and_breaks_start_new_ones() {
        let runs = coalesce(&[0, 1, 2, 7, 8, 3], &[10, 11, 12, 13, 14, 20]);
        assert_eq!(
            runs,
            vec![
                Run {
                    src: 0,
                    dst: 10,
                    len: 3
                },
                Run {
                    src: 7,
                    dst: 13,
                    len: 2
                },
                Run {
                    src: 3,
                    dst: 20,
                    len: 1
                },
            ]
        );
        assert!(coalesce(&[], &[]).is_empty());
    }

    #[test]
    fn page_ranges_outside_a_buffer_are_refused() {
        let mut backing = vec![0u8; 4 * 16];
        let m = Memory::new(vec![BufferDesc::host(
            backing.as_mut_ptr() as usize,
            backing.len(),
            16,
        )]);
        assert_eq!(m.pages(0, 1, 3).unwrap().len(), 48);
        assert!(m.pages(0, 2, 3).is_err());
        assert!(m.pages(0, 0, 0).is_err());
        assert!(m.pages(1, 0, 1).is_err());
        assert!(m.pages(0, u32::MAX, 1).is_err());
    }

    #[test]
    fn device_buffers_give_no_host_slices_only_device_ranges() {
        // An address no CPU code may touch: if a host slice of it were made and read,
        // the test would crash, not fail.
        let m = Memory::new(vec![
            BufferDesc {
                kind: MemKind::Cuda { device: 1 },
                ..BufferDesc::host(0x7f00_0000_0000, 4 * 64, 64)
            },
            BufferDesc::host(0x1000, 64, 64),
        ]);
        let e = m.pages(0, 0, 1).unwrap_err();
        assert!(
            e.message().contains("CUDA device memory of device 1"),
            "{e}"
        );
        assert!(m.bytes(0, 0, 1, 0, 8).is_err());
        assert!(m.bytes_mut(0, 1, 2, 4, 8).is_err());
        assert!(m.check_range(0, 1, 3).is_ok());
        assert_eq!(
            m.device_range(0, 1, 2).unwrap(),
            (0x7f00_0000_0000 + 64, 128)
        );
        assert_eq!(m.device_run(0, 1, 2, 8, 16).unwrap(), 0x7f00_0000_0000 + 72);
        assert!(m.device_run(0, 1, 2, 120, 16).is_err());
        assert!(m.device_range(0, 3, 2).is_err());
        assert!(
            m.device_range(1, 0, 1).is_err(),
            "host memory is no device range"
        );
        assert!(m.has_device());
        assert_eq!(m.kind(0), Some(MemKind::Cuda { device: 1 }));
    }
}
