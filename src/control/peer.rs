//! A peer engine as the control layer keeps it: its identity, its outgoing control
//! queue, the connections and links set up for it, and its loss (once).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::{Mutex, RwLock};

use super::pairing::{Layouts, Pairing};
use crate::log::Logger;
use crate::proto::Message;
use crate::room::Cause;
use crate::transport::rdma::link::RdmaLink;
use crate::transport::rdma::peer::Inbound;
use crate::transport::tcp::SendConn;
use crate::transport::DataLink;

/// A remote engine.
pub(crate) struct Peer {
    /// Key in the control layer's peer map: the address (decode side) or the engine id
    /// (prefill side).
    pub key: String,
    /// How messages name the peer.
    pub name: String,
    /// Prefill side: the engine id the decode engine claimed in its `Hello` (proven to
    /// be a cluster member's when authentication is on, not proven to be its own). None
    /// on the decode side, where a prefill engine is known by its address.
    pub engine_id: Option<u64>,
    /// Decode side: the engine id the prefill engine gave in its `Hello`, once its setup
    /// got that far (discovery tells a new engine at the same address apart by it).
    pub remote_id: OnceLock<u64>,
    /// Handshake, registration and transport are done. Release (when set, after the
    /// setup) / Acquire (in `is_ready`): whoever sees it set sees what the setup
    /// published before it (`kv_map`, `kv_layouts`, `aux_count`, the links).
    ready: AtomicBool,
    /// Why it was lost and the cause its rooms fail with, set once: the first loss
    /// wins.
    lost: OnceLock<(Cause, String)>,
    /// Control frames to send. Created with the peer, so that messages queued before the
    /// connection is up (an abort right after room creation) go out once it is.
    pub(super) ctrl: CtrlQueue,
    log: Logger,
    /// Connections data frames are written to (prefill side).
    pub data: RwLock<Vec<Arc<dyn DataLink>>>,
    /// Prefill side over TCP: the link of each data connection index. An index is live
    /// while its link is (a sender thread or `data` holds it) and not broken; a data
    /// connection with a live index is refused.
    pub(super) data_index: Mutex<HashMap<u16, Weak<dyn DataLink>>>,
    /// Prefill side over RDMA: the links of `data`, for answers to reconnections.
    pub rdma_links: RwLock<Vec<Arc<RdmaLink>>>,
    /// Decode side over RDMA: the domain, regions and queue pairs this peer writes into
    /// our memory through; shut when it is lost, so no write lands after.
    pub inbound: OnceLock<Inbound>,
    streams: Mutex<Vec<TcpStream>>,
    /// For each of the prefill engine's kv buffers, the decode engine's buffer it fills
    /// (both sides: `Pairing::map` of the registration exchange).
    pub kv_map: OnceLock<Vec<u32>>,
    /// Both engines' kv layouts, as the registration exchange agreed them (both sides).
    pub kv_layouts: OnceLock<Layouts>,
    /// Decode side: how many aux buffers this prefill engine registered (0 or ours).
    pub aux_count: OnceLock<usize>,
    /// Both sides: how this prefill engine's pages map into this decode engine's, when
    /// their layouts differ (head slices, other page sizes); unset for a byte copy of
    /// whole pages. Set with `kv_map`, before the peer is published.
    pub slicing: OnceLock<crate::slice::Slicing>,
    /// The path the pairing's data takes, once chosen (by the setup, before the first
    /// data link).
    pub path: OnceLock<Path>,
    /// Decode side, on the CUDA IPC path: the prefill's device memory, imported once per
    /// pairing (given back when the peer is dropped, after its data connections ended).
    pub ipc: OnceLock<Arc<crate::cuda::ipc::Imports>>,
    /// Prefill side: whether an `IpcOffer` went out to this peer, and offered the path
    /// (true) or said why not (false).
    pub ipc_offered: OnceLock<bool>,
    /// Rooms (id, local generation) that depend on this peer: the engine's record, which
    /// the peer's loss hands back to it.
    pub rooms: Mutex<HashSet<(u64, u64)>>,
    /// Engine-clock ms of the last frame received. Relaxed: read only by the watchdog to
    /// compare with a generous bound.
    pub last_recv_ms: AtomicU64,
    /// Engine-clock ms of the last control frame the writer thread wrote (frames a
    /// pushing thread writes itself do not count: a heartbeat may go out beside them).
    /// Relaxed, as `last_recv_ms`.
    pub(super) last_sent_ms: AtomicU64,
    /// The next heartbeat's sequence number. Relaxed: only its uniqueness matters (one
    /// thread, the watchdog, sends heartbeats).
    pub(super) hb_seq: AtomicU64,
    /// Engine-clock ms when the peer was created: its setup (handshake, registration,
    /// transport, data connections) must finish within `bootstrap_timeout_ms` of it.
    pub(super) since_ms: u64,
}

/// The path a pairing's data takes (DESIGN inv. 11: chosen, reported, never silently
/// degraded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Data frames over TCP data connections.
    Tcp,
    /// RDMA writes.
    Rdma,
    /// The decode engine copies from prefill process `pid` (`transport::samehost`).
    SameHost { pid: u32 },
    /// The decode engine copies device pages from prefill process `pid` through CUDA IPC
    /// (`cuda::ipc`), and host pages (aux rows) as over the same-host path.
    CudaIpc { pid: u32 },
}

impl Path {
    /// The path's wire-independent number, as `kvxfer_room_path` reports it.
    pub fn data_path(self) -> crate::DataPath {
        match self {
            Path::Tcp => crate::DataPath::Tcp,
            Path::Rdma => crate::DataPath::Rdma,
            Path::SameHost { .. } => crate::DataPath::SameHost,
            Path::CudaIpc { .. } => crate::DataPath::CudaIpc,
        }
    }
}

impl Peer {
    pub fn new(key: String, name: String, now_ms: u64, log: Logger) -> Arc<Peer> {
        Self::build(key, name, None, now_ms, log)
    }

    /// Prefill side: decode engine `engine_id`, keyed by its id in hexadecimal.
    pub fn of_engine(engine_id: u64, name: String, now_ms: u64, log: Logger) -> Arc<Peer> {
        Self::build(
            format!("{engine_id:016x}"),
            name,
            Some(engine_id),
            now_ms,
            log,
        )
    }

    fn build(
        key: String,
        name: String,
        engine_id: Option<u64>,
        now_ms: u64,
        log: Logger,
    ) -> Arc<Peer> {
        Arc::new(Peer {
            key,
            name,
            engine_id,
            remote_id: OnceLock::new(),
            ready: AtomicBool::new(false),
            lost: OnceLock::new(),
            ctrl: CtrlQueue::default(),
            log,
            data: RwLock::new(Vec::new()),
            data_index: Mutex::new(HashMap::new()),
            rdma_links: RwLock::new(Vec::new()),
            inbound: OnceLock::new(),
            streams: Mutex::new(Vec::new()),
            kv_map: OnceLock::new(),
            kv_layouts: OnceLock::new(),
            aux_count: OnceLock::new(),
            slicing: OnceLock::new(),
            path: OnceLock::new(),
            ipc: OnceLock::new(),
            ipc_offered: OnceLock::new(),
            rooms: Mutex::new(HashSet::new()),
            last_recv_ms: AtomicU64::new(now_ms),
            last_sent_ms: AtomicU64::new(now_ms),
            hb_seq: AtomicU64::new(0),
            since_ms: now_ms,
        })
    }

    /// Keeps what the registration exchange agreed: the buffer map and both layouts
    /// (once, by the setup, before the peer is ready).
    pub(super) fn set_pairing(&self, pairing: Pairing) {
        if let Some(s) = pairing.slicing() {
            let _ = self.slicing.set(s);
        }
        let _ = self.kv_map.set(pairing.map);
        let _ = self.kv_layouts.set(pairing.layouts);
    }

    /// Handshake and registration done, and not lost.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.is_lost()
    }

    /// The setup is done: rooms may use the peer.
    pub(super) fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    pub fn is_lost(&self) -> bool {
        self.lost.get().is_some()
    }

    /// "lost NAME: WHY", the reason a room fails with when this peer is lost.
    pub fn loss(&self) -> String {
        match self.lost.get() {
            Some((_, why)) => format!("lost {}: {why}", self.name),
            None => format!("lost {}", self.name),
        }
    }

    /// Test faults aimed at one peer are keyed by the port of its address (decode side).
    #[cfg(feature = "test-hooks")]
    pub fn fault_key(&self) -> u64 {
        crate::testing::port_key(&self.key)
    }

    /// Queues a control message for the writer thread. Never blocks; a lost peer drops it.
    pub fn send(&self, msg: &Message) {
        let mut frame = Vec::with_capacity(64);
        if let Err(e) = msg.encode(&mut frame) {
            crate::log!(
                self.log,
                Error,
                "cannot encode {:?} for {}: {e}",
                msg.kind(),
                self.name
            );
            return;
        }
        self.send_frame(frame);
    }

    /// Queues an encoded control frame; false if the peer is lost (or doomed: its queue
    /// overflowed, and the watchdog loses it).
    pub fn send_frame(&self, frame: Vec<u8>) -> bool {
        self.ctrl.push(frame)
    }

    /// Why the peer must be lost although no thread of it failed (its control queue
    /// overflowed: it does not read what we send), if so.
    pub fn doomed(&self) -> Option<String> {
        self.ctrl.overflowed()
    }

    /// Keeps a handle on `s` so that losing the peer closes it (and unblocks its reader).
    /// A stream tracked after the loss is closed at once.
    pub(super) fn track(&self, s: &TcpStream) {
        if let Ok(c) = s.try_clone() {
            self.streams.lock().push(c);
        }
        if self.is_lost() {
            for s in self.streams.lock().drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// The cause a room fails with when this peer is lost: the loss's own (a refused
    /// setup is a `Mismatch`, a broken one `PeerLost`), so that a room that attaches
    /// after the loss fails as the rooms failed by it did.
    pub fn loss_cause(&self) -> Cause {
        self.lost.get().map_or(Cause::PeerLost, |(c, _)| *c)
    }

    /// Marks the peer lost with `cause` and `why`; false if it was lost before (the
    /// first loss wins, and only it tears the peer down).
    pub(super) fn mark_lost(&self, cause: Cause, why: &str) -> bool {
        self.lost.set((cause, why.to_string())).is_ok()
    }

    /// Tears down everything set up for the peer, RDMA writes into our memory first:
    /// its queue pairs shut and keys revoked, then its control queue, connections and
    /// links. Called once, by the loss.
    pub(super) fn close(&self) {
        if let Some(inbound) = self.inbound.get() {
            inbound.shut();
        }
        self.ctrl.close();
        for s in self.streams.lock().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.data.write().clear();
        for link in self.rdma_links.write().drain(..) {
            link.close();
        }
    }
}

/// The most bytes of control frames queued for one peer (64 MiB; a Destination of a
/// million pages is 4 MiB).
const CTRL_QUEUE_BYTES: usize = 64 << 20;

/// A peer's outgoing control frames: pushed from any thread without blocking, popped by
/// its writer thread. Bounded in bytes: a peer that does not read what we send cannot
/// make us hold more; the push that would pass the bound dooms the peer instead (its
/// frames are dropped from then on, and the watchdog loses it with the reason), since a
/// control frame is never dropped for a peer that is kept.
///
/// Once the connection is up (plain TCP), a frame pushed while nothing is queued or
/// being written goes out from the pushing thread, as far as the socket takes it without
/// waiting; only the rest, if any, is left to the writer. A room's turnaround then costs
/// no wakeup of the writer thread (and no core switch) for its Destination.
#[derive(Default)]
pub(super) struct CtrlQueue {
    inner: Mutex<CtrlInner>,
    ready: parking_lot::Condvar,
    /// The connection's writing half, for frames written by the pushing thread.
    direct: OnceLock<Arc<SendConn>>,
}

#[derive(Default)]
struct CtrlInner {
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
    /// A frame is being written (by the writer, or by a pushing thread): the next one
    /// waits for it, so that frames go out whole and in order.
    writing: bool,
    closed: bool,
    overflow: Option<String>,
}

impl CtrlQueue {
    /// Queues `frame`; false if the queue is closed or overflowed.
    fn push(&self, frame: Vec<u8>) -> bool {
        self.push_within(frame, CTRL_QUEUE_BYTES)
    }

    fn push_within(&self, frame: Vec<u8>, limit: usize) -> bool {
        let mut q = self.inner.lock();
        if q.closed || q.overflow.is_some() {
            return false;
        }
        if q.bytes + frame.len() > limit {
            q.overflow = Some(format!(
                "it does not read its control connection: {} frames ({} bytes) are waiting \
                 to be sent, the most a peer may hold is {limit} bytes",
                q.frames.len(),
                q.bytes
            ));
            q.frames.clear();
            q.bytes = 0;
            self.ready.notify_all();
            return false;
        }
        let direct = match self.direct.get() {
            Some(conn) if q.frames.is_empty() && !q.writing => conn,
            _ => {
                q.bytes += frame.len();
                q.frames.push_back(frame);
                self.ready.notify_one();
                return true;
            }
        };
        q.writing = true;
        drop(q);
        let sent = direct.try_send_frame(&frame);
        let mut q = self.inner.lock();
        q.writing = false;
        if sent < frame.len() && !q.closed && q.overflow.is_none() {
            // The rest goes first: frames pushed meanwhile were queued behind it.
            let rest = frame[sent..].to_vec();
            q.bytes += rest.len();
            q.frames.push_front(rest);
        }
        if !q.frames.is_empty() {
            self.ready.notify_one();
        }
        true
    }

    /// From now on a frame pushed while nothing is queued or being written is written
    /// by the pushing thread on `conn` (see the type).
    pub(super) fn write_directly(&self, conn: Arc<SendConn>) {
        let _ = self.direct.set(conn);
    }

    /// The next frame to write, waiting for one; `None` once closed or overflowed. The
    /// writer calls [`CtrlQueue::written`] once it has written it.
    pub(super) fn pop(&self) -> Option<Vec<u8>> {
        let mut q = self.inner.lock();
        loop {
            if q.closed || q.overflow.is_some() {
                return None;
            }
            if !q.writing {
                if let Some(f) = q.frames.pop_front() {
                    q.bytes -= f.len();
                    q.writing = true;
                    return Some(f);
                }
            }
            self.ready.wait(&mut q);
        }
    }

    /// The frame [`CtrlQueue::pop`] returned is written.
    pub(super) fn written(&self) {
        self.inner.lock().writing = false;
    }

    /// No more frames: the writer ends and pushes are refused.
    pub(super) fn close(&self) {
        let mut q = self.inner.lock();
        q.closed = true;
        q.frames.clear();
        q.bytes = 0;
        self.ready.notify_all();
    }

    fn overflowed(&self) -> Option<String> {
        self.inner.lock().overflow.clone()
    }
}

/// Accepted connections still in their handshake, so that stopping the engine can close
/// them instead of waiting for a silent client's read timeout.
#[derive(Default)]
pub(crate) struct Handshaking {
    /// The next connection's token. Relaxed: tokens need only be unique.
    next: AtomicU64,
    streams: Mutex<std::collections::HashMap<u64, TcpStream>>,
}

impl Handshaking {
    pub(super) fn track(&self, s: &TcpStream) -> u64 {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(c) = s.try_clone() {
            self.streams.lock().insert(token, c);
        }
        token
    }

    pub(super) fn untrack(&self, token: u64) {
        self.streams.lock().remove(&token);
    }

    /// Closes every connection still in its handshake.
    pub fn close_all(&self) {
        for (_, s) in self.streams.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_control_queue_keeps_order_and_refuses_after_close() {
        let q = CtrlQueue::default();
        assert!(q.push(vec![1]));
        assert!(q.push(vec![2, 2]));
        assert_eq!(q.pop(), Some(vec![1]));
        q.written();
        assert_eq!(q.pop(), Some(vec![2, 2]));
        q.written();
        q.close();
        assert!(!q.push(vec![3]));
        assert_eq!(q.pop(), None);
        assert_eq!(q.overflowed(), None);
    }

    /// Past its bound the queue holds nothing more and says why the peer must go.
    #[test]
    fn a_control_queue_past_its_bound_dooms_its_peer() {
        let q = CtrlQueue::default();
        assert!(q.push_within(vec![0; 60], 100));
        assert!(q.push_within(vec![0; 40], 100));
        assert!(!q.push_within(vec![0; 1], 100));
        let why = q.overflowed().expect("overflowed");
        assert!(
            why.contains("does not read its control connection"),
            "{why}"
        );
        assert!(why.contains("2 frames (100 bytes)"), "{why}");
        assert!(!q.push_within(vec![0; 1], 100), "nothing more is queued");
        assert_eq!(q.pop(), None, "the writer ends");
    }

    /// A connected pair over loopback: our writing half (with a small send buffer, so
    /// that a large frame does not fit at once) and the peer's reading end.
    fn direct_pair() -> (Arc<SendConn>, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        let small: libc::c_int = 4096;
        use std::os::fd::AsRawFd;
        crate::transport::tcp::set_int_option(
            ours.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            small,
        )
        .unwrap();
        let conn = SendConn::with_stall(ours, Duration::from_secs(5)).unwrap();
        (Arc::new(conn), theirs)
    }

    fn read_exactly(s: &mut TcpStream, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut b = vec![0; n];
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.read_exact(&mut b).unwrap();
        b
    }

    /// With the connection up, a frame pushed onto an idle queue is on the wire when
    /// the push returns: no writer thread runs here, and none is woken.
    #[test]
    fn a_frame_pushed_on_an_idle_queue_is_written_by_the_pushing_thread() {
        let (conn, mut theirs) = direct_pair();
        let q = CtrlQueue::default();
        q.write_directly(conn);
        assert!(q.push(vec![1, 2, 3]));
        assert!(q.push(vec![4]));
        assert_eq!(
            q.inner.lock().frames.len(),
            0,
            "nothing left for the writer"
        );
        assert_eq!(read_exactly(&mut theirs, 4), vec![1, 2, 3, 4]);
    }

    /// While the writer has a frame in hand, pushes queue behind it (never overtake it),
    /// and the writer takes them in order once it is done.
    #[test]
    fn frames_pushed_while_the_writer_writes_wait_their_turn() {
        let (conn, mut theirs) = direct_pair();
        let q = CtrlQueue::default();
        q.write_directly(conn.clone());
        q.push_within(vec![9; 8], usize::MAX);
        // Queue one frame behind a frame the writer holds (as if it were mid-write).
        q.inner.lock().writing = true;
        assert!(q.push(vec![1]));
        q.inner.lock().writing = false;
        assert!(q.push(vec![2]), "queued: frames are waiting");
        assert_eq!(q.inner.lock().frames.len(), 2);
        for want in [vec![1], vec![2]] {
            let f = q.pop().unwrap();
            assert_eq!(f, want);
            conn.send_frame(&f).unwrap();
            q.written();
        }
        assert_eq!(
            read_exactly(&mut theirs, 10),
            vec![9, 9, 9, 9, 9, 9, 9, 9, 1, 2]
        );
    }

    /// A frame larger than the socket takes at once goes out partly from the pushing
    /// thread; its rest is queued first, ahead of frames pushed after it, so the peer
    /// reads both whole and in order.
    #[test]
    fn the_rest_of_a_frame_the_socket_did_not_take_goes_first() {
        let (conn, mut theirs) = direct_pair();
        let q = Arc::new(CtrlQueue::default());
        q.write_directly(conn.clone());
        let big: Vec<u8> = (0..2u32 << 20).map(|i| (i % 251) as u8).collect();
        assert!(q.push(big.clone()));
        let rest = q.inner.lock().frames.front().map(Vec::len).expect("a rest");
        assert!(rest > 0 && rest < big.len(), "written partly: {rest} left");
        assert!(q.push(vec![7, 7]));
        let writer = {
            let q = q.clone();
            std::thread::spawn(move || {
                while let Some(f) = q.pop() {
                    conn.send_frame(&f).unwrap();
                    q.written();
                }
            })
        };
        let got = read_exactly(&mut theirs, big.len() + 2);
        assert!(got[..big.len()] == big[..], "the large frame arrives whole");
        assert_eq!(&got[big.len()..], &[7, 7]);
        q.close();
        writer.join().unwrap();
    }

    #[test]
    fn a_writer_waiting_on_an_empty_queue_wakes_for_a_frame_and_for_close() {
        let q = Arc::new(CtrlQueue::default());
        let w = {
            let q = q.clone();
            std::thread::spawn(move || (q.pop(), q.pop()))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(q.push(vec![7]));
        std::thread::sleep(Duration::from_millis(20));
        q.close();
        assert_eq!(w.join().unwrap(), (Some(vec![7]), None));
    }
}
