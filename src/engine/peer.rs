//! Peer engines: one control connection and several data connections per peer, shared
//! by every room to that peer; handshake and registration exchange once per peer;
//! heartbeats; loss of a peer fails every live room it served.

use std::collections::HashSet;
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::{pairing, Shared};
use crate::proto::WireTransport;
use crate::proto::{
    self, ConnKind, FrameHeader, Kind, Message, ReadError, Registration, Role as WireRole,
    PROTO_VERSION,
};
use crate::room::{Cause, FailureReason};
use crate::transport::rdma::link::{replacement, ControlSender, LinkSetup, RdmaLink, RemoteBuffer};
use crate::transport::rdma::verbs::{Endpoint, Region};
use crate::transport::tcp::{self, SendConn};
use crate::transport::DataLink;

fn transport_name(t: WireTransport) -> &'static str {
    match t {
        WireTransport::Tcp => "TCP",
        WireTransport::Rdma => "RDMA",
    }
}

/// A remote engine.
pub(crate) struct Peer {
    /// Key in the engine's peer map: the address (decode side) or the engine id
    /// (prefill side).
    pub key: String,
    /// How messages name the peer.
    pub name: String,
    ready: AtomicBool,
    lost: OnceLock<String>,
    /// Control frames to send. Created with the peer, so that messages queued before the
    /// connection is up (an abort right after room creation) go out once it is.
    ctrl: Mutex<Option<mpsc::Sender<Vec<u8>>>>,
    ctrl_rx: Mutex<Option<mpsc::Receiver<Vec<u8>>>>,
    /// Connections data frames are written to (prefill side).
    pub data: RwLock<Vec<Arc<dyn DataLink>>>,
    /// Decode side over RDMA: the queue pairs this peer writes into our memory through;
    /// shut (moved to the error state) when the peer is lost, so no write lands after.
    pub qps: Mutex<Vec<Endpoint>>,
    /// Prefill side over RDMA: the links of `data`, for answers to reconnections.
    pub rdma_links: RwLock<Vec<Arc<RdmaLink>>>,
    streams: Mutex<Vec<TcpStream>>,
    /// Decode side: for each of this prefill engine's kv buffers, our buffer it fills.
    pub kv_map: OnceLock<Vec<u32>>,
    /// Decode side: how many aux buffers this prefill engine registered (0 or ours).
    pub aux_count: OnceLock<usize>,
    /// Rooms (id, local generation) that depend on this peer.
    pub rooms: Mutex<HashSet<(u64, u64)>>,
    /// Engine-clock ms of the last frame received; Relaxed: read only by the watchdog
    /// to compare with a generous bound.
    pub last_recv_ms: AtomicU64,
    last_sent_ms: AtomicU64,
    hb_seq: AtomicU64,
}

impl Peer {
    pub fn new(key: String, name: String, now_ms: u64) -> Arc<Peer> {
        let (tx, rx) = mpsc::channel();
        Arc::new(Peer {
            key,
            name,
            ready: AtomicBool::new(false),
            lost: OnceLock::new(),
            ctrl: Mutex::new(Some(tx)),
            ctrl_rx: Mutex::new(Some(rx)),
            data: RwLock::new(Vec::new()),
            qps: Mutex::new(Vec::new()),
            rdma_links: RwLock::new(Vec::new()),
            streams: Mutex::new(Vec::new()),
            kv_map: OnceLock::new(),
            aux_count: OnceLock::new(),
            rooms: Mutex::new(HashSet::new()),
            last_recv_ms: AtomicU64::new(now_ms),
            last_sent_ms: AtomicU64::new(now_ms),
            hb_seq: AtomicU64::new(0),
        })
    }

    /// Handshake and registration done, and not lost.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.is_lost()
    }

    pub fn is_lost(&self) -> bool {
        self.lost.get().is_some()
    }

    /// Queues a control message for the writer thread. Never blocks; a lost peer drops it.
    pub fn send(&self, shared: &Shared, msg: &Message) {
        let mut frame = Vec::with_capacity(64);
        if let Err(e) = msg.encode(&mut frame) {
            crate::log!(
                shared.log,
                Error,
                "cannot encode {:?} for {}: {e}",
                msg.kind(),
                self.name
            );
            return;
        }
        if let Some(tx) = self.ctrl.lock().as_ref() {
            let _ = tx.send(frame);
        }
    }

    /// Queues an encoded control frame; false if the peer is lost.
    pub fn send_frame(&self, frame: Vec<u8>) -> bool {
        self.ctrl
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(frame).is_ok())
    }

    /// Keeps a handle on `s` so that losing the peer closes it (and unblocks its reader).
    /// A stream tracked after the loss is closed at once.
    fn track(&self, s: &TcpStream) {
        if let Ok(c) = s.try_clone() {
            self.streams.lock().push(c);
        }
        if self.is_lost() {
            for s in self.streams.lock().drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// Accepted connections still in their handshake, so that stopping the engine can close
/// them instead of waiting for a silent client's read timeout.
#[derive(Default)]
pub(crate) struct Handshaking {
    next: AtomicU64,
    streams: Mutex<std::collections::HashMap<u64, TcpStream>>,
}

impl Handshaking {
    fn track(&self, s: &TcpStream) -> u64 {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(c) = s.try_clone() {
            self.streams.lock().insert(token, c);
        }
        token
    }

    fn untrack(&self, token: u64) {
        self.streams.lock().remove(&token);
    }

    /// Closes every connection still in its handshake.
    pub fn close_all(&self) {
        for (_, s) in self.streams.lock().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Shared {
    /// Marks `peer` lost (once): closes its connections, forgets it, and fails every
    /// live room that depends on it with a reason naming the peer.
    pub(crate) fn lose_peer(&self, peer: &Arc<Peer>, why: String) {
        self.lose_peer_with(peer, Cause::PeerLost, why)
    }

    /// As [`Shared::lose_peer`], with the cause its rooms fail with.
    pub(crate) fn lose_peer_with(&self, peer: &Arc<Peer>, cause: Cause, why: String) {
        if peer.lost.set(why.clone()).is_err() {
            return;
        }
        {
            let mut peers = self.peers.lock();
            if peers.get(&peer.key).is_some_and(|p| Arc::ptr_eq(p, peer)) {
                peers.remove(&peer.key);
            }
        }
        // First of all: no RDMA write of this peer may land in our memory from here on.
        for qp in peer.qps.lock().iter_mut() {
            qp.shut();
        }
        peer.ctrl.lock().take();
        peer.ctrl_rx.lock().take();
        for s in peer.streams.lock().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        peer.data.write().clear();
        for link in peer.rdma_links.write().drain(..) {
            link.close();
        }
        self.metrics.peers_lost.fetch_add(1, Ordering::Relaxed);
        let rooms: Vec<(u64, u64)> = peer.rooms.lock().drain().collect();
        if !self.stopping.load(Ordering::Acquire) {
            crate::log!(
                self.log,
                Warn,
                "lost {}: {why}; failing {} room(s)",
                peer.name,
                rooms.len()
            );
        }
        for (id, generation) in rooms {
            if let Some(room) = self.rooms.get_generation(id, generation) {
                self.fail_room(
                    &room,
                    FailureReason::local(cause, format!("lost {}: {why}", peer.name)),
                    Some(peer),
                );
                // Its queue pairs are shut: it can write into this room no more.
                self.decode_peer_quiet(&room, peer);
            }
        }
    }

    fn hello(&self, conn: ConnKind, conn_index: u16) -> Message {
        Message::Hello {
            proto_version: PROTO_VERSION,
            role: match self.role {
                crate::Role::Prefill => WireRole::Prefill,
                crate::Role::Decode => WireRole::Decode,
            },
            engine_id: self.engine_id,
            conn,
            conn_index,
        }
    }

    fn registration(&self) -> Registration {
        // Only a decode engine is written into, so only it tells its peers where.
        let remote = self.role == crate::Role::Decode;
        let info = |m: Option<&crate::transport::Memory>, regions: Option<&Arc<Vec<Region>>>| {
            m.map(|m| {
                m.buffers()
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let region = regions.filter(|_| remote).and_then(|r| r.get(i));
                        proto::BufferInfo {
                            len: b.len as u64,
                            item_len: b.item_len as u64,
                            layer_id: m.layer(i).map_or(proto::BufferInfo::NO_LAYER, |l| l as i32),
                            addr: region.map_or(0, |_| b.base as u64),
                            rkey: region.map_or(0, Region::rkey),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
        };
        Registration {
            kv: info(self.kv.get(), self.kv_regions.get()),
            aux: info(self.aux.get(), self.aux_regions.get()),
            layout: proto::Layout::default(),
        }
    }

    /// Checks the peer's registration against ours and returns, for each of the prefill
    /// engine's kv buffers, the decode buffer it fills. A mismatch names the buffer.
    fn check_registration(&self, peer: &str, theirs: &Registration) -> Result<Vec<u32>, String> {
        let ours = self.registration();
        let (decode, prefill) = match self.role {
            crate::Role::Decode => (&ours, theirs),
            crate::Role::Prefill => (theirs, &ours),
        };
        pairing::pair_kv(&decode.kv, &prefill.kv)
            .and_then(|map| pairing::check_aux(&decode.aux, &prefill.aux).map(|()| map))
            .map_err(|why| format!("registration mismatch with {peer}: {why}"))
    }

    fn write_msg(&self, s: &mut TcpStream, msg: &Message) -> Result<(), String> {
        let mut frame = Vec::new();
        msg.encode(&mut frame).map_err(|e| e.to_string())?;
        s.write_all(&frame).map_err(|e| e.to_string())
    }

    fn read_msg(&self, s: &mut TcpStream) -> Result<Message, String> {
        let hdr = proto::read_frame_header(s, &self.limits).map_err(|e| e.to_string())?;
        if !hdr.kind.is_control() {
            return Err(format!("expected a control frame, got {}", hdr.kind.name()));
        }
        proto::read_control(s, &hdr, &self.limits).map_err(|e| e.to_string())
    }

    fn expect_hello(
        &self,
        s: &mut TcpStream,
        role: WireRole,
    ) -> Result<(u64, ConnKind, u16), String> {
        match self.read_msg(s)? {
            Message::Hello {
                proto_version,
                role: r,
                engine_id,
                conn,
                conn_index,
            } => {
                if proto_version != PROTO_VERSION {
                    return Err(format!(
                        "peer speaks protocol {proto_version}, this build {PROTO_VERSION}"
                    ));
                }
                if r != role {
                    return Err(format!("peer is a {r:?} engine, expected {role:?}"));
                }
                Ok((engine_id, conn, conn_index))
            }
            other => Err(format!("expected Hello, got {}", other.kind().name())),
        }
    }

    fn expect_registration(&self, s: &mut TcpStream) -> Result<Registration, String> {
        match self.read_msg(s)? {
            Message::Registration(r) => Ok(r),
            other => Err(format!(
                "expected Registration, got {}",
                other.kind().name()
            )),
        }
    }

    fn bootstrap_timeout(&self) -> Duration {
        Duration::from_millis(self.config.bootstrap_timeout_ms)
    }

    /// Decode side: the peer for prefill `addr`, connecting in the background if there is
    /// none (or the last one was lost).
    fn wire_transport(&self) -> WireTransport {
        if self.rdma.is_some() {
            WireTransport::Rdma
        } else {
            WireTransport::Tcp
        }
    }

    fn expect_transport(
        &self,
        s: &mut TcpStream,
        peer: &Arc<Peer>,
    ) -> Result<Vec<proto::QpInfo>, String> {
        let (transport, qps) = match self.read_msg(s)? {
            Message::Transport { transport, qps } => (transport, qps),
            other => return Err(format!("expected Transport, got {}", other.kind().name())),
        };
        self.agree_transport(peer, transport)?;
        Ok(qps)
    }

    /// Both engines must move data the same way: a mismatch fails the peer as MISMATCH.
    fn agree_transport(&self, peer: &Arc<Peer>, theirs: WireTransport) -> Result<(), String> {
        let ours = self.wire_transport();
        if theirs == ours {
            return Ok(());
        }
        let why = format!(
            "transport mismatch: this {} engine moves data over {}, {} over {}",
            self.role,
            transport_name(ours),
            peer.name,
            transport_name(theirs)
        );
        self.lose_peer_with(peer, Cause::Mismatch, why.clone());
        Err(why)
    }

    /// Decode side, after the registration exchange: agree on the transport and, over
    /// RDMA, connect one queue pair to each of the prefill engine's (one per worker).
    /// Returns whether the peer writes over RDMA.
    fn decode_transport(&self, peer: &Arc<Peer>, ctrl: &mut TcpStream) -> Result<bool, String> {
        let ours = self.wire_transport();
        self.write_msg(
            ctrl,
            &Message::Transport {
                transport: ours,
                qps: Vec::new(),
            },
        )?;
        let theirs = self.expect_transport(ctrl, peer)?;
        let Some(dev) = self.rdma.as_ref() else {
            return Ok(false);
        };
        if theirs.is_empty() {
            return Err(format!("{} offered no RDMA queue pairs", peer.name));
        }
        let mut eps = Vec::with_capacity(theirs.len());
        for remote in &theirs {
            let mut ep = dev
                .endpoint(1)
                .map_err(|e| format!("cannot create an RDMA queue pair: {e}"))?;
            ep.connect(remote)
                .map_err(|e| format!("cannot connect an RDMA queue pair to {}: {e}", peer.name))?;
            eps.push(ep);
        }
        let infos = eps.iter().map(|e| e.info()).collect();
        peer.qps.lock().extend(eps);
        if peer.is_lost() {
            // Lost meanwhile: its loss pass may have missed these.
            for qp in peer.qps.lock().iter_mut() {
                qp.shut();
            }
            return Err("lost during setup".into());
        }
        self.write_msg(
            ctrl,
            &Message::Transport {
                transport: ours,
                qps: infos,
            },
        )?;
        Ok(true)
    }

    /// Prefill side, after the registration exchange: agree on the transport and, over
    /// RDMA, open one queue pair per worker to the decode engine, each a data link.
    fn prefill_transport(
        &self,
        peer: &Arc<Peer>,
        s: &mut TcpStream,
        theirs: &Registration,
        map: &[u32],
    ) -> Result<(), String> {
        let ours = self.wire_transport();
        let reply = |s: &mut TcpStream, qps: Vec<proto::QpInfo>| {
            self.write_msg(
                s,
                &Message::Transport {
                    transport: ours,
                    qps,
                },
            )
        };
        let asked = match self.read_msg(s)? {
            Message::Transport { transport, .. } => transport,
            other => return Err(format!("expected Transport, got {}", other.kind().name())),
        };
        let Some(dev) = self.rdma.as_ref().filter(|_| asked == ours) else {
            // TCP, or a mismatch: our answer tells the peer which, then agree or fail.
            reply(s, Vec::new())?;
            return self.agree_transport(peer, asked);
        };
        let depth = self.config.rdma_queue_depth;
        let mut eps = Vec::with_capacity(self.config.workers);
        for _ in 0..self.config.workers {
            eps.push(
                dev.endpoint(depth)
                    .map_err(|e| format!("cannot create an RDMA queue pair: {e}"))?,
            );
        }
        reply(s, eps.iter().map(|e| e.info()).collect())?;
        let remotes = self.expect_transport(s, peer)?;
        if remotes.len() != eps.len() {
            return Err(format!(
                "{} answered {} queue pairs for our {}",
                peer.name,
                remotes.len(),
                eps.len()
            ));
        }
        let remote_kv: Vec<RemoteBuffer> = map
            .iter()
            .map(|&j| RemoteBuffer::from(&theirs.kv[j as usize]))
            .collect();
        let remote_aux: Vec<RemoteBuffer> = theirs.aux.iter().map(RemoteBuffer::from).collect();
        let (local_kv, local_aux) = (
            self.kv_regions.get().cloned().unwrap_or_default(),
            self.aux_regions.get().cloned().unwrap_or_default(),
        );
        let mut links: Vec<Arc<RdmaLink>> = Vec::with_capacity(eps.len());
        for (index, (mut ep, remote)) in eps.into_iter().zip(&remotes).enumerate() {
            ep.connect(remote)
                .map_err(|e| format!("cannot connect an RDMA queue pair to {}: {e}", peer.name))?;
            let weak = Arc::downgrade(peer);
            let control: ControlSender = Box::new(move |frame| match weak.upgrade() {
                Some(p) if p.send_frame(frame) => Ok(()),
                _ => Err(std::io::Error::other("the control connection is gone")),
            });
            links.push(Arc::new(RdmaLink::new(
                ep,
                LinkSetup {
                    index,
                    device: dev.clone(),
                    depth,
                    local_kv: local_kv.clone(),
                    local_aux: local_aux.clone(),
                    remote_kv: remote_kv.clone(),
                    remote_aux: remote_aux.clone(),
                    slice: self.config.rdma_slice_bytes,
                    stall: Duration::from_millis(self.config.transfer_timeout_ms),
                    control,
                },
            )));
        }
        *peer.data.write() = links
            .iter()
            .map(|l| l.clone() as Arc<dyn DataLink>)
            .collect();
        *peer.rdma_links.write() = links;
        if peer.is_lost() {
            peer.data.write().clear();
            peer.rdma_links.write().clear();
        }
        Ok(())
    }

    /// A replacement queue pair after a broken one. On the decode side: the prefill
    /// engine's new queue pair `i` (the first entry with a queue pair number); shut the
    /// old one, connect a new one of ours to it and answer, echoing the request's queue
    /// pair in entry `i + 1`. On the prefill side: that answer.
    fn on_reconnect(
        &self,
        peer: &Arc<Peer>,
        role: crate::Role,
        qps: &[proto::QpInfo],
    ) -> Result<(), String> {
        let Some((i, q)) = qps.iter().enumerate().find(|(_, q)| q.qpn != 0) else {
            return Err("a queue pair request names no queue pair".into());
        };
        match role {
            crate::Role::Prefill => {
                let link = peer.rdma_links.read().get(i).cloned();
                // The entry after the answer echoes the queue pair it answers.
                let echo = qps.get(i + 1).map_or(0, |e| e.qpn);
                match link {
                    Some(l) => {
                        l.answer(*q, echo);
                        Ok(())
                    }
                    None => Err(format!(
                        "an answer for queue pair {i}, which we never asked for"
                    )),
                }
            }
            crate::Role::Decode => {
                let dev = self.rdma.as_ref().expect("checked by the caller");
                let mut qps_now = peer.qps.lock();
                if peer.is_lost() {
                    // Its queue pairs were shut (or are being shut): none may reopen.
                    return Ok(());
                }
                if i >= qps_now.len() {
                    return Err(format!(
                        "a request to replace queue pair {i} of {}",
                        qps_now.len()
                    ));
                }
                // First of all: nothing more lands through the old one (the prefill
                // engine sends this before it acknowledges anything written through it).
                qps_now[i].shut();
                let mut ep = dev
                    .endpoint(1)
                    .map_err(|e| format!("cannot create an RDMA queue pair: {e}"))?;
                ep.connect(q)
                    .map_err(|e| format!("cannot connect a replacement queue pair: {e}"))?;
                let info = ep.info();
                qps_now[i] = ep;
                drop(qps_now);
                crate::log!(
                    self.log,
                    Info,
                    "replaced RDMA queue pair {i} of {}",
                    peer.name
                );
                peer.send(self, &replacement(i, info, Some(*q)));
                Ok(())
            }
        }
    }

    pub(crate) fn peer_for(self: &Arc<Self>, addr: &str) -> Arc<Peer> {
        let mut peers = self.peers.lock();
        if let Some(p) = peers.get(addr) {
            if !p.is_lost() {
                return p.clone();
            }
        }
        let peer = Peer::new(addr.to_string(), format!("prefill {addr}"), self.now_ms());
        peers.insert(addr.to_string(), peer.clone());
        drop(peers);
        let (shared, p) = (self.clone(), peer.clone());
        self.spawn("kvxfer-connect", move || {
            if let Err(why) = shared.connect(&p) {
                shared.lose_peer(&p, why);
            }
        });
        peer
    }

    /// Decode side: handshake, registration and data connections to a prefill engine.
    fn connect(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<(), String> {
        let timeout = self.bootstrap_timeout();
        let addr = peer.key.clone();
        let mut ctrl = tcp::connect(&addr, timeout).map_err(|e| format!("cannot connect: {e}"))?;
        peer.track(&ctrl);
        ctrl.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        self.write_msg(&mut ctrl, &self.hello(ConnKind::Control, 0))?;
        self.expect_hello(&mut ctrl, WireRole::Prefill)?;
        self.write_msg(&mut ctrl, &Message::Registration(self.registration()))?;
        let theirs = self.expect_registration(&mut ctrl)?;
        let map = self
            .check_registration(&peer.name, &theirs)
            .inspect_err(|why| self.lose_peer_with(peer, Cause::Mismatch, why.clone()))?;
        let _ = peer.kv_map.set(map);
        let _ = peer.aux_count.set(theirs.aux.len());
        let rdma = self.decode_transport(peer, &mut ctrl)?;
        let data_conns = if rdma {
            0
        } else {
            self.config.connections_per_peer
        };
        for i in 0..data_conns {
            let mut d = tcp::connect(&addr, timeout).map_err(|e| format!("cannot connect: {e}"))?;
            peer.track(&d);
            d.set_read_timeout(Some(timeout))
                .map_err(|e| e.to_string())?;
            self.write_msg(&mut d, &self.hello(ConnKind::Data, i as u16))?;
            self.expect_hello(&mut d, WireRole::Prefill)?;
            d.set_read_timeout(None).map_err(|e| e.to_string())?;
            let (shared, p) = (self.clone(), peer.clone());
            self.spawn("kvxfer-recv", move || shared.data_reader(&p, d));
        }
        ctrl.set_read_timeout(None).map_err(|e| e.to_string())?;
        self.start_control(peer, ctrl)?;
        // Silence is measured from here: a slow setup is not a missed heartbeat.
        peer.last_recv_ms.store(self.now_ms(), Ordering::Relaxed);
        peer.ready.store(true, Ordering::Release);
        crate::log!(self.log, Info, "connected to {}", peer.name);
        let rooms: Vec<(u64, u64)> = peer.rooms.lock().iter().copied().collect();
        for (id, generation) in rooms {
            if let Some(room) = self.rooms.get_generation(id, generation) {
                self.decode_try_ready(&room);
            }
        }
        Ok(())
    }

    /// Starts the control writer thread and the control reader thread of `peer`.
    fn start_control(self: &Arc<Self>, peer: &Arc<Peer>, ctrl: TcpStream) -> Result<(), String> {
        let writer = ctrl.try_clone().map_err(|e| e.to_string())?;
        let rx = peer
            .ctrl_rx
            .lock()
            .take()
            .ok_or_else(|| "lost during setup".to_string())?;
        let (shared, p) = (self.clone(), peer.clone());
        self.spawn("kvxfer-ctrl-tx", move || {
            let conn = SendConn::new(writer);
            for frame in rx {
                if let Err(e) = conn.send_frame(&frame) {
                    shared.lose_peer(&p, format!("control write failed: {e}"));
                    break;
                }
                p.last_sent_ms.store(shared.now_ms(), Ordering::Relaxed);
            }
        });
        let (shared, p) = (self.clone(), peer.clone());
        self.spawn("kvxfer-ctrl-rx", move || shared.control_reader(&p, ctrl));
        Ok(())
    }

    fn control_reader(self: &Arc<Self>, peer: &Arc<Peer>, mut s: TcpStream) {
        loop {
            let r = proto::read_frame_header(&mut s, &self.limits).and_then(|hdr: FrameHeader| {
                if hdr.kind == Kind::Data {
                    return Err(ReadError::Io(std::io::Error::other(
                        "data frame on the control connection",
                    )));
                }
                proto::read_control(&mut s, &hdr, &self.limits)
            });
            match r {
                Ok(msg) => {
                    peer.last_recv_ms.store(self.now_ms(), Ordering::Relaxed);
                    let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.on_control(peer, msg)
                    }));
                    match handled {
                        Ok(Ok(())) => {}
                        Ok(Err(why)) => {
                            self.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                            return self.lose_peer(peer, format!("protocol error: {why}"));
                        }
                        Err(_) => {
                            return self
                                .lose_peer(peer, "internal error handling a control frame".into())
                        }
                    }
                }
                Err(ReadError::Closed) => return self.lose_peer(peer, "connection closed".into()),
                Err(ReadError::Proto(e)) => {
                    self.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    return self.lose_peer(peer, format!("malformed frame: {e}"));
                }
                Err(e) => return self.lose_peer(peer, format!("control read failed: {e}")),
            }
        }
    }

    fn on_control(self: &Arc<Self>, peer: &Arc<Peer>, msg: Message) -> Result<(), String> {
        match (msg, self.role) {
            (Message::Heartbeat { .. }, _) => Ok(()),
            (
                Message::Destination {
                    room,
                    generation,
                    pages,
                    aux_slot,
                },
                crate::Role::Prefill,
            ) => {
                self.prefill_on_destination(peer, room, generation, pages, aux_slot);
                Ok(())
            }
            (
                Message::Abort {
                    room,
                    generation,
                    reason,
                },
                _,
            ) => {
                self.on_peer_abort(peer, room, generation, reason);
                Ok(())
            }
            (Message::AbortAck { room, generation }, crate::Role::Decode) => {
                crate::log!(
                    self.log,
                    Debug,
                    "{} acknowledged the abort of room {room} (gen {generation})",
                    peer.name
                );
                self.decode_on_abort_ack(peer, room, generation);
                Ok(())
            }
            (
                Message::Transport {
                    transport: WireTransport::Rdma,
                    qps,
                },
                role,
            ) if self.rdma.is_some() => self.on_reconnect(peer, role, &qps),
            (
                Message::Progress {
                    room,
                    generation,
                    pages,
                    aux_rows,
                    bytes,
                },
                crate::Role::Decode,
            ) if self.rdma.is_some() => {
                self.decode_on_progress(peer, room, generation, (pages, aux_rows, bytes));
                Ok(())
            }
            (
                Message::Done {
                    room,
                    generation,
                    pages_sent,
                    aux_sent,
                },
                crate::Role::Decode,
            ) if self.rdma.is_some() => {
                self.on_done(peer, room, generation, pages_sent, aux_sent);
                Ok(())
            }
            (m, role) => Err(format!(
                "unexpected {} message on a {role} engine's control connection",
                m.kind().name()
            )),
        }
    }

    /// Prefill side: accepts connections until the engine stops.
    pub(crate) fn accept_loop(self: &Arc<Self>, listener: std::net::TcpListener) {
        if let Err(e) = listener.set_nonblocking(true) {
            crate::log!(self.log, Error, "listener: {e}");
            return;
        }
        while !self.stopping.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((s, from)) => {
                    let shared = self.clone();
                    let token = self.handshaking.track(&s);
                    self.spawn("kvxfer-accept", move || {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_nodelay(true);
                        let r = shared.incoming(s);
                        shared.handshaking.untrack(token);
                        if let Err(why) = r {
                            shared
                                .metrics
                                .protocol_errors
                                .fetch_add(1, Ordering::Relaxed);
                            crate::log!(shared.log, Warn, "rejected connection from {from}: {why}");
                        }
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => {
                    crate::log!(self.log, Warn, "accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50))
                }
            }
        }
    }

    /// An accepted connection: handshake, then control (registration, reader) or data.
    fn incoming(self: &Arc<Self>, mut s: TcpStream) -> Result<(), String> {
        if self.role != crate::Role::Prefill {
            return Err("decode engines accept no connections".into());
        }
        let from = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        s.set_read_timeout(Some(self.bootstrap_timeout()))
            .map_err(|e| e.to_string())?;
        let (engine_id, conn, index) = self.expect_hello(&mut s, WireRole::Decode)?;
        let key = format!("{engine_id:016x}");
        match conn {
            ConnKind::Control => {
                if self.kv.get().is_none() {
                    return Err("this prefill engine has not registered its KV buffers yet".into());
                }
                let peer = Peer::new(
                    key.clone(),
                    format!("decode engine {key} at {from}"),
                    self.now_ms(),
                );
                peer.track(&s);
                // Known before our Registration goes out: the decode engine opens its data
                // connections as soon as it has read it, and they must find this peer.
                let old = self.peers.lock().insert(key, peer.clone());
                if let Some(old) = old {
                    self.lose_peer(
                        &old,
                        "replaced by a new connection from the same engine".into(),
                    );
                }
                let setup = (|| {
                    self.write_msg(&mut s, &self.hello(ConnKind::Control, 0))?;
                    self.write_msg(&mut s, &Message::Registration(self.registration()))?;
                    let theirs = self.expect_registration(&mut s)?;
                    let map = self
                        .check_registration(&peer.name, &theirs)
                        .inspect_err(|why| {
                            self.lose_peer_with(&peer, Cause::Mismatch, why.clone())
                        })?;
                    self.prefill_transport(&peer, &mut s, &theirs, &map)?;
                    s.set_read_timeout(None).map_err(|e| e.to_string())?;
                    self.start_control(&peer, s)
                })();
                if let Err(why) = setup {
                    self.lose_peer(&peer, why.clone());
                    return Err(why);
                }
                // Silence is measured from here: a slow setup is not a missed heartbeat.
                peer.last_recv_ms.store(self.now_ms(), Ordering::Relaxed);
                peer.ready.store(true, Ordering::Release);
                crate::log!(self.log, Info, "accepted {}", peer.name);
                Ok(())
            }
            ConnKind::Data => {
                let peer =
                    self.peers.lock().get(&key).cloned().ok_or_else(|| {
                        format!("data connection {index} from unknown engine {key}")
                    })?;
                if self.rdma.is_some() {
                    return Err(format!(
                        "data connection {index} from {key}: this engine moves data over RDMA"
                    ));
                }
                peer.track(&s);
                self.write_msg(&mut s, &self.hello(ConnKind::Data, index))?;
                let w = s.try_clone().map_err(|e| e.to_string())?;
                let conn = SendConn::data(w, self.peer_deadline()).map_err(|e| e.to_string())?;
                peer.data.write().push(Arc::new(conn));
                if peer.is_lost() {
                    peer.data.write().clear();
                }
                Ok(())
            }
        }
    }

    /// How long a peer may stay silent before it counts as lost.
    pub(crate) fn peer_deadline(&self) -> Duration {
        Duration::from_millis(
            self.config.heartbeat_interval_ms * self.config.heartbeat_misses as u64,
        )
    }

    /// Watchdog duty: send heartbeats that are due and lose silent peers.
    pub(crate) fn heartbeat(&self) {
        let now = self.now_ms();
        let peers: Vec<Arc<Peer>> = self.peers.lock().values().cloned().collect();
        let limit = self.config.heartbeat_interval_ms * self.config.heartbeat_misses as u64;
        for p in peers {
            if !p.is_ready() {
                continue;
            }
            let silent = now.saturating_sub(p.last_recv_ms.load(Ordering::Relaxed));
            if silent > limit {
                self.lose_peer(
                    &p,
                    format!(
                        "no frame for {silent} ms (heartbeat_interval_ms={} x heartbeat_misses={})",
                        self.config.heartbeat_interval_ms, self.config.heartbeat_misses
                    ),
                );
                continue;
            }
            if now.saturating_sub(p.last_sent_ms.load(Ordering::Relaxed))
                >= self.config.heartbeat_interval_ms
            {
                let seq = p.hb_seq.fetch_add(1, Ordering::Relaxed);
                p.send(self, &Message::Heartbeat { seq });
            }
        }
    }
}
