//! [`RdmaLink`]: the prefill side's [`DataLink`] over one RC queue pair to one decode
//! engine. Every run becomes one-sided RDMA WRITEs straight from registered prefill
//! memory into the decode engine's registered pages; the decode CPU copies nothing.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};

use super::verbs::{Access, Device, Endpoint, EndpointInfo, Region, WriteOp};
use crate::proto::{BufferInfo, DataHeader, Message, Target, WireTransport, MAX_RUNS};
use crate::transport::{DataLink, Sent, Watch};

/// Where one remote buffer lives: address, key and size.
#[derive(Debug, Clone, Copy)]
pub struct RemoteBuffer {
    /// First byte in the remote address space.
    pub addr: u64,
    /// Remote key of the region holding it.
    pub rkey: u32,
    /// Bytes in the buffer.
    pub len: u64,
    /// Bytes of one page (or aux slot).
    pub item_len: u64,
}

impl From<&BufferInfo> for RemoteBuffer {
    fn from(b: &BufferInfo) -> Self {
        RemoteBuffer {
            addr: b.addr,
            rkey: b.rkey,
            len: b.len,
            item_len: b.item_len,
        }
    }
}

/// Sends one encoded control frame to the link's peer (its control connection).
pub type ControlSender = Box<dyn Fn(Vec<u8>) -> io::Result<()> + Send + Sync>;

/// The Transport message that names queue pair `index` (and, in an answer, echoes the
/// requester's queue pair after it): a replacement for a broken one. Other entries are
/// placeholders (queue pair number 0, a valid MTU for the codec).
pub fn replacement(index: usize, info: EndpointInfo, echo: Option<EndpointInfo>) -> Message {
    let placeholder = EndpointInfo {
        mtu: 1,
        ..Default::default()
    };
    let mut qps = vec![placeholder; index + 1];
    qps[index] = info;
    qps.extend(echo);
    Message::Transport {
        transport: WireTransport::Rdma,
        qps,
    }
}

/// One RC queue pair to one decode engine, used by one prefill worker. A queue pair
/// broken by a completion error is replaced on the next use.
pub struct RdmaLink {
    ep: Mutex<Endpoint>,
    index: usize,
    device: Arc<Device>,
    depth: u32,
    /// The replacement announced to the peer and not yet connected.
    pending: Mutex<Option<Endpoint>>,
    /// The peer's answer to the reconnection request in flight: the queue pair number
    /// we announced (answers echo it; others are stale) and the answer once it came.
    answer: Mutex<Answer>,
    answered: Condvar,
    /// The peer is lost or the engine stops: no replacement will be answered. SeqCst,
    /// though the lock does the work: `close` sets it and then notifies under the
    /// `answer` lock, and `replace` reads it under that lock before each wait, so a
    /// waiter never misses it.
    closed: AtomicBool,

    /// Our regions, indexed like our registered KV and aux buffers.
    local_kv: Arc<Vec<Region>>,
    local_aux: Arc<Vec<Region>>,
    /// For each of our KV buffers, the remote buffer it fills.
    remote_kv: Vec<RemoteBuffer>,
    /// Remote aux buffers, indexed like ours.
    remote_aux: Vec<RemoteBuffer>,
    slice: usize,
    stall: Duration,
    control: ControlSender,
    /// `integrity=verify`: progress carries every run's header and digest.
    integrity: bool,
}

#[derive(Default)]
struct Answer {
    expect: Option<u32>,
    remote: Option<EndpointInfo>,
}

/// What a link needs besides its queue pair.
pub struct LinkSetup {
    /// Which of the peer's queue pairs this is (the prefill worker's index).
    pub index: usize,
    /// The device, for replacement queue pairs.
    pub device: Arc<Device>,
    /// Most writes outstanding.
    pub depth: u32,

    /// Our KV regions.
    pub local_kv: Arc<Vec<Region>>,
    /// Our aux regions.
    pub local_aux: Arc<Vec<Region>>,
    /// For each of our KV buffers, the remote buffer it fills.
    pub remote_kv: Vec<RemoteBuffer>,
    /// The remote aux buffers, indexed like ours.
    pub remote_aux: Vec<RemoteBuffer>,
    /// Longest single RDMA WRITE.
    pub slice: usize,
    /// Longest wait for a completion before the queue pair is declared broken.
    pub stall: Duration,
    /// Sends control frames to the peer.
    pub control: ControlSender,
    /// `integrity=verify`: progress carries every run's header and digest.
    pub integrity: bool,
}

impl RdmaLink {
    /// A link over the connected endpoint `ep`.
    pub fn new(ep: Endpoint, setup: LinkSetup) -> Self {
        RdmaLink {
            ep: Mutex::new(ep),
            index: setup.index,
            device: setup.device,
            depth: setup.depth,
            pending: Mutex::new(None),
            answer: Mutex::new(Answer::default()),
            answered: Condvar::new(),
            closed: AtomicBool::new(false),

            local_kv: setup.local_kv,
            local_aux: setup.local_aux,
            remote_kv: setup.remote_kv,
            remote_aux: setup.remote_aux,
            slice: setup.slice,
            stall: setup.stall,
            control: setup.control,
            integrity: setup.integrity,
        }
    }

    /// Sends a control message to the peer.
    fn send(&self, msg: &Message) -> io::Result<()> {
        let mut frame = Vec::with_capacity(64);
        msg.encode(&mut frame)
            .map_err(|e| io::Error::other(e.to_string()))?;
        (self.control)(frame)
    }

    /// The peer's queue pair for our replacement request.
    /// `echo` is our queue pair the answer is for; an answer to an earlier request (one
    /// that timed out) is dropped.
    pub fn answer(&self, remote: EndpointInfo, echo: u32) {
        let mut a = self.answer.lock();
        if a.expect == Some(echo) {
            a.remote = Some(remote);
            self.answered.notify_all();
        }
    }

    /// The peer is gone: a wait for an answer ends now.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _guard = self.answer.lock();
        self.answered.notify_all();
    }

    /// Announces a replacement queue pair to the peer. Sent as soon as a write fails,
    /// before the failed batch releases its room: the peer shuts its side of queue pair
    /// `index` when it reads this, which is before any acknowledgement we send after it
    /// on the same ordered control connection, so no packet still on its way can land
    /// once the peer considers the room drained.
    fn request_replacement(&self) -> io::Result<()> {
        let fresh = self.device.endpoint(self.depth, Access::Local)?;
        *self.answer.lock() = Answer {
            expect: Some(fresh.info().qpn),
            remote: None,
        };
        self.send(&replacement(self.index, fresh.info(), None))?;
        *self.pending.lock() = Some(fresh);
        Ok(())
    }

    /// Replaces the broken queue pair with the announced one once the peer answers
    /// (announcing one first if that failed before), within `stall`.
    fn replace(&self, ep: &mut Endpoint) -> io::Result<()> {
        if self.pending.lock().is_none() {
            self.request_replacement()?;
        }
        let mut answer = self.answer.lock();
        let deadline = std::time::Instant::now() + self.stall;
        while answer.remote.is_none() {
            if self.closed.load(Ordering::SeqCst) {
                return Err(io::Error::other("the peer is gone"));
            }
            if self.answered.wait_until(&mut answer, deadline).timed_out() {
                // Ask again on the next use, with a new queue pair.
                self.pending.lock().take();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not answer the request for a new queue pair",
                ));
            }
        }
        let remote = answer.remote.take().expect("checked above");
        answer.expect = None;
        drop(answer);
        let mut fresh = self.pending.lock().take().expect("announced above");
        fresh.connect(&remote)?;
        *ep = fresh;
        Ok(())
    }

    /// The write of one run, checked against both sides' registered buffers.
    fn op(&self, hdr: &DataHeader, bytes: &[u8]) -> io::Result<WriteOp> {
        let (locals, remotes) = match hdr.target {
            Target::Kv => (&self.local_kv, &self.remote_kv),
            Target::Aux => (&self.local_aux, &self.remote_aux),
        };
        let b = hdr.buffer as usize;
        let (local, remote) = match (locals.get(b), remotes.get(b)) {
            (Some(l), Some(r)) => (l, r),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{:?} buffer {b} has no registered region on both sides",
                        hdr.target
                    ),
                ))
            }
        };
        let addr = bytes.as_ptr() as usize;
        if addr < local.base() || addr + bytes.len() > local.base() + local.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("run of buffer {b} is outside its local region"),
            ));
        }
        // A head slice (layouts that differ) starts at `page_off` inside its one page.
        let offset = hdr.first_page as u64 * remote.item_len + u64::from(hdr.page_off);
        let remote_addr = remote.addr.checked_add(offset);
        let in_page =
            hdr.page_off == 0 || u64::from(hdr.page_off) + bytes.len() as u64 <= remote.item_len;
        if remote_addr.is_none() || offset + bytes.len() as u64 > remote.len || !in_page {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "pages {}..{} are outside remote buffer {b} ({} bytes)",
                    hdr.first_page,
                    hdr.first_page as u64 + hdr.n_pages as u64,
                    remote.len
                ),
            ));
        }
        let rkey = remote.rkey;
        #[cfg(feature = "test-hooks")]
        let rkey = if crate::testing::take_fault("rdma.bad_rkey", hdr.room) {
            rkey ^ 0x00ff_ff00
        } else {
            rkey
        };
        Ok(WriteOp {
            addr,
            len: bytes.len(),
            lkey: local.lkey(),
            remote_addr: remote_addr.expect("checked above"),
            rkey,
        })
    }
}

impl DataLink for RdmaLink {
    fn write_runs(&self, runs: &[(DataHeader, &[u8])], _: &mut Watch<'_>) -> io::Result<Sent> {
        let ops = runs
            .iter()
            .map(|(hdr, bytes)| self.op(hdr, bytes))
            .collect::<io::Result<Vec<WriteOp>>>()?;
        {
            let mut ep = self.ep.lock();
            if ep.is_broken() {
                self.replace(&mut ep).map_err(|e| {
                    io::Error::new(e.kind(), format!("replacing a broken queue pair: {e}"))
                })?;
            }
            if let Err(e) = ep.write(&ops, self.slice, self.stall) {
                // Nothing of the batch is outstanding on our side now; have the peer
                // shut its side before anything is acknowledged.
                if let Err(r) = self.request_replacement() {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("{e} (and announcing a new queue pair failed: {r})"),
                    ));
                }
                return Err(e);
            }
        }
        // Every write of the batch completed: tell the decode side how far the room got
        // (it re-arms its deadline and counts pages, as it would from TCP data frames).
        let Some((first, _)) = runs.first() else {
            return Ok(Sent::All);
        };
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("rdma.batch_done", first.room);
        // With integrity=verify the runs themselves go too, digests included (at most
        // MAX_RUNS a message), for the decode side to check where they landed.
        let per_message = if self.integrity {
            MAX_RUNS as usize
        } else {
            runs.len()
        };
        for part in runs.chunks(per_message.max(1)) {
            let (mut kv, mut aux, mut bytes) = (Vec::<(u32, u64)>::new(), 0u32, 0u64);
            for (hdr, b) in part {
                match hdr.target {
                    Target::Kv => match kv.iter_mut().find(|(buf, _)| *buf == hdr.buffer) {
                        Some((_, n)) => *n += b.len() as u64,
                        None => kv.push((hdr.buffer, b.len() as u64)),
                    },
                    Target::Aux => aux += 1,
                }
                bytes += b.len() as u64;
            }
            let digested = if self.integrity {
                part.iter().map(|(h, _)| *h).collect()
            } else {
                Vec::new()
            };
            self.send(&Message::Progress {
                room: first.room,
                generation: first.generation,
                kv,
                aux_rows: aux,
                bytes,
                runs: digested,
            })?;
        }
        Ok(Sent::All)
    }

    fn finish(&self, done_frame: &[u8]) -> io::Result<()> {
        // Every write_runs before this returned only once its writes completed, so the
        // Done behind them on the control connection finds every byte in place.
        (self.control)(done_frame.to_vec())
    }
}
