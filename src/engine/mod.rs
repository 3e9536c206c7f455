//! The engine: one per process side (prefill or decode). Owns the room table, the
//! registered buffers, the listening socket and the watchdog thread.
//!
//! The scheduler-facing calls (`room_*`, `enqueue_chunk`) never block on the network.

mod decode;
mod metrics;
mod pairing;
mod peer;
mod prefill;
mod watchdog;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, RwLock};

pub use metrics::MetricsSnapshot;

use crate::config::{parse_host_port, Config, Role, TransportKind};
use crate::err;
use crate::error::Result;
use crate::log::Logger;
use crate::proto::{Limits, Message};
use crate::room::{Cause, FailureReason, Room, RoomTable, State};
use crate::transport::rdma::verbs::{Device, Region};
use crate::transport::Memory;
use decode::DecodeRoom;
use metrics::Metrics;
use peer::Peer;
use prefill::{Chunk, Holding, PrefillRoom};

/// The most buffers of one kind an engine may register.
pub const MAX_BUFFERS: usize = 4096;
/// The most decode engines one prefill room may wait for.
pub const MAX_ROOM_PEERS: usize = 1024;

/// One registered memory buffer, as addresses (the engine core never dereferences them
/// itself; [`Memory`] does, under the registration contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferDesc {
    /// First byte.
    pub base: usize,
    /// Bytes in the buffer.
    pub len: usize,
    /// Bytes of one page (KV) or one slot (aux).
    pub item_len: usize,
}

impl BufferDesc {
    /// Whole pages (or slots) the buffer holds.
    pub fn items(&self) -> usize {
        self.len / self.item_len
    }
}

/// Who a room exchanges data with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomPeers {
    /// Prefill room: how many decode engines will send a destination.
    Decoders(usize),
    /// Decode room: the prefill engine addresses it pulls from.
    Prefills(Vec<String>),
}

/// The engine's per-room data, by role.
pub(crate) enum RoomExt {
    Prefill(Mutex<PrefillRoom>),
    Decode(DecodeRoom),
}

pub(crate) type ERoom = Room<RoomExt>;

/// A unit of work for a prefill worker: one chunk of one room.
pub(crate) struct Job {
    room: Arc<ERoom>,
    chunk: Chunk,
}

/// An abort acknowledgement waiting for its room's writes: room id, room generation,
/// the peer to tell, and the generation it knows the room by.
type PendingAck = (u64, u64, Arc<Peer>, u64);

pub(crate) struct Shared {
    role: Role,
    config: Config,
    log: Logger,
    address: String,
    engine_id: u64,
    limits: Limits,
    rooms: RoomTable<RoomExt>,
    kv: OnceLock<Memory>,
    aux: OnceLock<Memory>,
    /// The RDMA device data moves through, or `None` over TCP.
    rdma: Option<Arc<Device>>,
    /// RDMA memory regions of the KV and aux buffers (RDMA only), deregistered when the
    /// engine is freed.
    kv_regions: OnceLock<Arc<Vec<Region>>>,
    aux_regions: OnceLock<Arc<Vec<Region>>>,
    /// Prefill over RDMA: abort acknowledgements waiting for their room's outstanding
    /// writes to complete (room id, room generation, peer, decode generation).
    pending_acks: Mutex<Vec<PendingAck>>,
    registering: Mutex<()>,
    clock: Instant,
    stopping: AtomicBool,
    wake: (Mutex<()>, Condvar),
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    handshaking: peer::Handshaking,
    holding: Mutex<Holding>,
    workers: RwLock<Vec<mpsc::Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    metrics: Metrics,
}

impl Shared {
    /// Milliseconds on the engine's monotonic clock.
    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    fn room(&self, id: u64) -> Result<Arc<ERoom>> {
        self.rooms
            .get(id)
            .ok_or_else(|| err!(NotFound, "room {id} not found"))
    }

    /// Starts a library thread that is joined when the engine stops.
    fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) {
        match std::thread::Builder::new().name(name.into()).spawn(f) {
            Ok(h) => {
                let mut threads = self.threads.lock();
                threads.retain(|t| !t.is_finished());
                threads.push(h);
            }
            Err(e) => crate::log!(self.log, Error, "cannot start thread {name}: {e}"),
        }
    }

    /// Arms the deadline of the state a room is about to enter.
    fn arm(&self, room: &ERoom, state: State) {
        let c = &self.config;
        let ms = match state {
            State::Bootstrapping => c.bootstrap_timeout_ms,
            State::WaitingForInput => c.waiting_timeout_ms,
            State::Transferring => c.transfer_timeout_ms,
            State::Success | State::Failed => return,
        };
        room.set_deadline_ms(self.now_ms() + ms);
    }

    /// Fails `room` with `reason` unless it is terminal; when this call made it FAILED,
    /// counts and logs it and tells the room's peers (except `origin`). Returns whether
    /// this call failed it.
    fn fail_room(&self, room: &ERoom, reason: FailureReason, origin: Option<&Arc<Peer>>) -> bool {
        let msg = reason.to_string();
        let cause = reason.cause;
        let Some(from) = room.fail(reason) else {
            return false;
        };
        self.metrics.failed(cause);
        crate::log!(
            self.log,
            Warn,
            "room {} ({}, gen {}) failed while {}: {}",
            room.id(),
            self.role,
            room.generation(),
            from,
            msg
        );
        let rdma_prefill = self.rdma.is_some() && self.role == Role::Prefill;
        for (peer, generation) in self.room_peers(room) {
            if !origin.is_some_and(|o| Arc::ptr_eq(o, &peer)) {
                peer.send(
                    self,
                    &Message::abort(room.id(), generation, &msg, &self.limits),
                );
            }
            if rdma_prefill {
                // The decode side may reuse the pages only once our writes are done.
                self.queue_ack(room, peer, generation);
            }
        }
        true
    }

    /// Prefill over RDMA: acknowledges the abort of `room` to `peer` once no write of
    /// the room is outstanding (at once if none is).
    fn queue_ack(&self, room: &ERoom, peer: Arc<Peer>, generation: u64) {
        {
            let mut pending = self.pending_acks.lock();
            // One entry per (room, peer, generation): repeated aborts from a peer do not
            // grow the list while a batch is in flight.
            let known = pending.iter().any(|(id, room_gen, p, g)| {
                *id == room.id()
                    && *room_gen == room.generation()
                    && Arc::ptr_eq(p, &peer)
                    && *g == generation
            });
            if !known {
                pending.push((room.id(), room.generation(), peer, generation));
            }
        }
        self.send_due_acks();
    }

    /// Sends every pending acknowledgement whose room has no write outstanding. Called
    /// after queueing one, by a worker after each batch of a terminal room, and by the
    /// watchdog.
    fn send_due_acks(&self) {
        let mut due = Vec::new();
        self.pending_acks
            .lock()
            .retain(|(id, room_gen, peer, generation)| {
                let busy = self
                    .rooms
                    .get_generation(*id, *room_gen)
                    .is_some_and(|r| r.io_in_flight() > 0);
                if !busy {
                    due.push((peer.clone(), *id, *generation));
                }
                busy
            });
        for (peer, room, generation) in due {
            peer.send(self, &Message::AbortAck { room, generation });
        }
    }

    /// The peers a room talks to, with the generation messages about it carry (always
    /// the decode side's generation).
    fn room_peers(&self, room: &ERoom) -> Vec<(Arc<Peer>, u64)> {
        match &room.ext {
            RoomExt::Prefill(p) => p
                .lock()
                .dests
                .iter()
                .map(|d| (d.peer.clone(), d.generation))
                .collect(),
            RoomExt::Decode(d) => d
                .peers
                .iter()
                .map(|p| (p.clone(), room.generation()))
                .collect(),
        }
    }

    /// A peer's Abort: fail the room it names and, on the prefill side, acknowledge.
    fn on_peer_abort(&self, peer: &Arc<Peer>, id: u64, generation: u64, reason: String) {
        if self.role == Role::Prefill {
            self.prefill_on_abort(peer, id, generation, reason);
            // Over TCP nothing is outstanding once the worker sees the room terminal: the
            // decode side refuses every later byte itself, so acknowledge at once. Over
            // RDMA, only once the room's posted writes have completed.
            match self.rooms.get(id).filter(|_| self.rdma.is_some()) {
                // Failed with this destination: fail_room queued its acknowledgement.
                Some(room)
                    if room.state() == State::Failed
                        && self
                            .room_peers(&room)
                            .iter()
                            .any(|(p, g)| Arc::ptr_eq(p, peer) && *g == generation) => {}
                Some(room) => self.queue_ack(&room, peer.clone(), generation),
                None => peer.send(
                    self,
                    &Message::AbortAck {
                        room: id,
                        generation,
                    },
                ),
            }
            return;
        }
        match self.rooms.get_generation(id, generation) {
            Some(room) => {
                self.fail_room(
                    &room,
                    FailureReason::peer(Cause::Aborted, reason),
                    Some(peer),
                );
            }
            None => {
                self.metrics
                    .unknown_room_frames
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Sends `job` to the worker that owns its room (rooms spread over all workers; one
    /// room's chunks always go to the same worker, in order). Returns false when the
    /// engine is shutting down: the caller fails the room, once it holds no room lock
    /// (failing reads the room's destinations under that lock).
    #[must_use]
    fn dispatch(&self, job: Job) -> bool {
        let workers = self.workers.read();
        if workers.is_empty() {
            return false;
        }
        let h = job.room.generation().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let w = (h as usize) % workers.len();
        workers[w].send(job).is_ok()
    }

    /// Fails a room whose chunk could not be dispatched.
    fn fail_undispatched(&self, room: &ERoom) {
        self.fail_room(
            room,
            FailureReason::local(Cause::Shutdown, "engine shut down"),
            None,
        );
    }
}

/// A running engine. Dropping it fails every live room with "engine shut down", closes
/// every connection and joins every thread.
pub struct Engine {
    shared: Arc<Shared>,
    /// A decode engine accepts no connections; holding the socket keeps its address.
    _listener: Option<TcpListener>,
}

fn engine_id(address: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(address.as_bytes());
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl Engine {
    /// Starts an engine: validates the config, binds the listening socket and starts the
    /// acceptor, the workers and the watchdog.
    pub fn new(config: Config, log: Logger) -> Result<Engine> {
        let role = config.require_role()?;
        let (rdma, why_tcp) = choose_transport(&config, &log)?;
        let listener = bind(&config.listen)?;
        let local = listener
            .local_addr()
            .map_err(|e| err!(Io, "cannot read the listening address: {e}"))?;
        let address = advertised(local);
        match &rdma {
            Some(dev) => crate::log!(
                log,
                Info,
                "{role} engine listening on {address}, transport rdma ({})",
                dev.describe()
            ),
            None => crate::log!(
                log,
                Info,
                "{role} engine listening on {address}, transport tcp{why_tcp}"
            ),
        }
        let workers = config.workers;
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..workers).map(|_| mpsc::channel::<Job>()).unzip();
        let shared = Arc::new(Shared {
            role,
            engine_id: engine_id(&address),
            config,
            log,
            address,
            limits: Limits::default(),
            rooms: RoomTable::new(),
            kv: OnceLock::new(),
            aux: OnceLock::new(),
            rdma,
            kv_regions: OnceLock::new(),
            aux_regions: OnceLock::new(),
            pending_acks: Mutex::new(Vec::new()),
            registering: Mutex::new(()),
            clock: Instant::now(),
            stopping: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            peers: Mutex::new(HashMap::new()),
            handshaking: Default::default(),
            holding: Mutex::new(Holding::default()),
            workers: RwLock::new(senders),
            threads: Mutex::new(Vec::new()),
            metrics: Metrics::default(),
        });
        let mut keep = None;
        if role == Role::Prefill {
            for (i, rx) in receivers.into_iter().enumerate() {
                let s = shared.clone();
                shared.spawn(&format!("kvxfer-worker-{i}"), move || s.worker(i, rx));
            }
            let s = shared.clone();
            shared.spawn("kvxfer-accept", move || s.accept_loop(listener));
        } else {
            // A decode engine opens connections; its listener only reserves the address.
            drop(receivers);
            keep = Some(listener);
        }
        let s = shared.clone();
        shared.spawn("kvxfer-watchdog", move || watchdog::run(&s));
        Ok(Engine {
            shared,
            _listener: keep,
        })
    }

    /// This engine's role.
    pub fn role(&self) -> Role {
        self.shared.role
    }

    /// The `host:port` peers connect to.
    pub fn address(&self) -> &str {
        &self.shared.address
    }

    /// Registers the KV buffers (once per engine).
    pub fn register_kv(&self, bufs: Vec<BufferDesc>) -> Result<()> {
        self.shared.register(bufs, None, false)
    }

    /// Registers the KV buffers with a layer id each (once per engine): buffers then pair
    /// with the peer's by layer id, and a pipeline stage may register only its layers.
    pub fn register_kv_layers(&self, bufs: Vec<BufferDesc>, layers: Vec<u32>) -> Result<()> {
        if layers.len() != bufs.len() {
            return Err(err!(
                InvalidArgument,
                "{} layer ids for {} kv buffers",
                layers.len(),
                bufs.len()
            ));
        }
        if let Some((i, l)) = layers
            .iter()
            .enumerate()
            .find(|(_, &l)| l > i32::MAX as u32)
        {
            return Err(err!(
                InvalidArgument,
                "kv buffer {i}: layer id {l} is too large"
            ));
        }
        self.shared.register(bufs, Some(layers), false)
    }

    /// Registers the aux buffers (once per engine).
    pub fn register_aux(&self, bufs: Vec<BufferDesc>) -> Result<()> {
        self.shared.register(bufs, None, true)
    }

    /// Creates room `id` in `Bootstrapping`.
    pub fn room_create(&self, id: u64, peers: RoomPeers) -> Result<()> {
        let shared = &self.shared;
        match (&peers, shared.role) {
            (RoomPeers::Decoders(n), Role::Prefill) => {
                if *n == 0 || *n > MAX_ROOM_PEERS {
                    return Err(err!(
                        InvalidArgument,
                        "a prefill room waits for 1 to {MAX_ROOM_PEERS} decode engines, not {n}"
                    ));
                }
            }
            (RoomPeers::Prefills(addrs), Role::Decode) => {
                if addrs.is_empty() || addrs.len() > MAX_ROOM_PEERS {
                    return Err(err!(
                        InvalidArgument,
                        "a decode room pulls from 1 to {MAX_ROOM_PEERS} prefill engines, not {}",
                        addrs.len()
                    ));
                }
                for (i, a) in addrs.iter().enumerate() {
                    parse_host_port(a).map_err(|why| {
                        err!(
                            InvalidArgument,
                            "peer {i} address '{a}' is not host:port: {why}"
                        )
                    })?;
                    if addrs[..i].contains(a) {
                        return Err(err!(InvalidArgument, "peer address '{a}' is listed twice"));
                    }
                }
            }
            (RoomPeers::Decoders(_), Role::Decode) => {
                return Err(err!(
                    InvalidArgument,
                    "a decode room needs the addresses of the prefill engines it pulls from"
                ))
            }
            (RoomPeers::Prefills(_), Role::Prefill) => {
                return Err(err!(
                    InvalidArgument,
                    "a prefill room takes no peer addresses (peers must be NULL), only a count"
                ))
            }
        }
        if shared.kv.get().is_none() {
            return Err(err!(
                WrongState,
                "register the KV buffers (kvxfer_register_kv) before creating rooms"
            ));
        }
        if shared.stopping.load(Ordering::Acquire) {
            return Err(err!(WrongState, "the engine is shutting down"));
        }
        let deadline = shared.now_ms() + shared.config.bootstrap_timeout_ms;
        match peers {
            RoomPeers::Decoders(n) => {
                let ext = RoomExt::Prefill(Mutex::new(PrefillRoom::new(n)));
                let room = shared.rooms.create(id, shared.role, deadline, ext)?;
                shared.metrics.created();
                crate::log!(
                    shared.log,
                    Debug,
                    "room {id} created (gen {}, {n} decode engine(s))",
                    room.generation()
                );
                shared.prefill_adopt_held(&room);
            }
            RoomPeers::Prefills(addrs) => {
                let peers: Vec<Arc<Peer>> = addrs.iter().map(|a| shared.peer_for(a)).collect();
                let ext = RoomExt::Decode(DecodeRoom::new(peers.clone()));
                let room = shared.rooms.create(id, shared.role, deadline, ext)?;
                shared.metrics.created();
                crate::log!(
                    shared.log,
                    Debug,
                    "room {id} created (gen {}, from {addrs:?})",
                    room.generation()
                );
                for p in &peers {
                    p.rooms.lock().insert((id, room.generation()));
                    if p.is_lost() {
                        // Lost between peer_for and now: its loss pass may have missed us.
                        shared.fail_room(
                            &room,
                            FailureReason::local(Cause::PeerLost, format!("lost {}", p.name)),
                            None,
                        );
                    }
                }
                shared.decode_try_ready(&room);
            }
        }
        Ok(())
    }

    /// Decode only: the destination pages and aux slot of room `id`, sent to every
    /// prefill engine of the room once they are connected.
    pub fn room_set_destination(
        &self,
        id: u64,
        pages: &[u32],
        aux_slot: Option<u32>,
    ) -> Result<()> {
        self.require_role(Role::Decode, "kvxfer_room_set_destination")?;
        let room = self.shared.room(id)?;
        require_live(&room)?;
        self.check_pages(pages, "destination")?;
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(err!(
                InvalidArgument,
                "destination page {} is listed twice",
                w[0]
            ));
        }
        self.check_aux(aux_slot)?;
        self.shared.decode_set_destination(&room, pages, aux_slot)
    }

    /// Prefill only: queue the next chunk of room `id`. Never blocks on the network.
    pub fn enqueue_chunk(
        &self,
        id: u64,
        pages: &[u32],
        is_last: bool,
        aux_slot: Option<u32>,
    ) -> Result<()> {
        self.require_role(Role::Prefill, "kvxfer_enqueue_chunk")?;
        let room = self.shared.room(id)?;
        require_live(&room)?;
        self.check_pages(pages, "source")?;
        if aux_slot.is_some() && !is_last {
            return Err(err!(
                InvalidArgument,
                "an aux slot may only come with the last chunk (is_last)"
            ));
        }
        self.check_aux(aux_slot)?;
        self.shared.prefill_enqueue(
            &room,
            Chunk {
                pages: pages.to_vec(),
                is_last,
                aux: aux_slot,
            },
        )
    }

    /// The state of room `id`: one shard read and one atomic load.
    pub fn room_poll(&self, id: u64) -> Result<State> {
        self.shared
            .rooms
            .state(id)
            .ok_or_else(|| err!(NotFound, "room {id} not found"))
    }

    /// Fails room `id` with `reason` unless it is terminal, and tells its peers.
    /// Idempotent.
    pub fn room_abort(&self, id: u64, reason: &str) -> Result<()> {
        let room = self.shared.room(id)?;
        let message = if reason.is_empty() {
            format!("room {id} aborted by the local scheduler")
        } else {
            format!("room {id} aborted: {reason}")
        };
        self.shared
            .fail_room(&room, FailureReason::local(Cause::Aborted, message), None);
        Ok(())
    }

    /// The failure reason of room `id`, which must be `Failed`.
    pub fn room_failure(&self, id: u64) -> Result<FailureReason> {
        let room = self.shared.room(id)?;
        room.failure().cloned().ok_or_else(|| {
            err!(
                WrongState,
                "room {id} is {}, not failed: it has no failure reason",
                room.state()
            )
        })
    }

    /// Whether room `id`'s memory may be reused: the room is terminal and no transport
    /// operation can still touch it (decode: no write into its pages can still land;
    /// prefill: no read of its source pages is still in progress).
    pub fn room_drained(&self, id: u64) -> Result<bool> {
        let room = self.shared.room(id)?;
        Ok(room.drained() && self.shared.decode_quiet(&room))
    }

    /// Releases room `id` (aborting it first if live). A second clear finds no room.
    pub fn room_clear(&self, id: u64) -> Result<()> {
        let room = self.shared.room(id)?;
        self.shared.fail_room(
            &room,
            FailureReason::local(Cause::Aborted, format!("room {id} cleared while live")),
            None,
        );
        self.shared.wait_io_drained(&room);
        self.shared.forget_room(&room);
        if self.shared.role == Role::Prefill {
            self.shared.prefill_on_clear(&room);
        }
        self.shared.rooms.remove_generation(id, room.generation());
        Ok(())
    }

    /// How many rooms the engine holds (live or terminal, not yet cleared).
    pub fn room_count(&self) -> usize {
        self.shared.rooms.len()
    }

    /// Counters and gauges.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics_snapshot()
    }

    fn require_role(&self, role: Role, call: &str) -> Result<()> {
        if self.shared.role == role {
            Ok(())
        } else {
            Err(err!(
                WrongRole,
                "{call} is for {role} engines; this engine is {}",
                self.shared.role
            ))
        }
    }

    fn check_pages(&self, pages: &[u32], what: &str) -> Result<()> {
        let capacity = self.shared.kv.get().map(Memory::capacity).unwrap_or(0);
        if let Some((i, p)) = pages
            .iter()
            .enumerate()
            .find(|(_, &p)| p as usize >= capacity)
        {
            return Err(err!(
                InvalidArgument,
                "{what} page {p} (index {i}) is out of range: the KV buffers hold {capacity} pages"
            ));
        }
        Ok(())
    }

    fn check_aux(&self, slot: Option<u32>) -> Result<()> {
        let Some(slot) = slot else { return Ok(()) };
        let slots = self.shared.aux.get().map(Memory::capacity).unwrap_or(0);
        if slot as usize >= slots {
            return Err(err!(
                InvalidArgument,
                "aux slot {slot} is out of range: the aux buffers hold {slots} slots"
            ));
        }
        Ok(())
    }
}

/// The RDMA device to use, or `None` for TCP with the reason (for the log).
fn choose_transport(config: &Config, log: &Logger) -> Result<(Option<Arc<Device>>, String)> {
    let names = if config.rdma_devices.is_empty() {
        "any device with an active port".to_string()
    } else {
        format!("rdma_devices={}", config.rdma_devices.join(","))
    };
    match config.transport {
        TransportKind::Tcp => Ok((None, String::new())),
        TransportKind::Rdma => match Device::open(&config.rdma_devices) {
            Ok(Some(dev)) => Ok((Some(dev), String::new())),
            Ok(None) => Err(err!(
                TransportUnavailable,
                "transport 'rdma': no usable RDMA device ({names}; is libibverbs installed and \
                 a port ACTIVE?); use transport 'tcp' or 'auto'"
            )),
            Err(why) => Err(err!(TransportUnavailable, "transport 'rdma': {why}")),
        },
        TransportKind::Auto => match Device::open(&config.rdma_devices) {
            Ok(Some(dev)) => Ok((Some(dev), String::new())),
            Ok(None) => Ok((None, format!(" (auto: no usable RDMA device, {names})"))),
            Err(why) => {
                crate::log!(log, Warn, "transport auto: RDMA unusable, using TCP: {why}");
                Ok((None, format!(" (auto: RDMA unusable: {why})")))
            }
        },
    }
}

impl Shared {
    /// Registers the KV (or aux) buffers, and over RDMA their memory regions.
    fn register(&self, bufs: Vec<BufferDesc>, layers: Option<Vec<u32>>, aux: bool) -> Result<()> {
        let (slot, regions_slot, what) = if aux {
            (&self.aux, &self.aux_regions, "aux")
        } else {
            (&self.kv, &self.kv_regions, "kv")
        };
        // One registration at a time: the regions and the memory are published together.
        let _one = self.registering.lock();
        check_buffers(&bufs, what)?;
        if slot.get().is_some() {
            return Err(err!(WrongState, "{what} buffers are already registered"));
        }
        let mut regions = Vec::new();
        if let Some(dev) = &self.rdma {
            for (i, b) in bufs.iter().enumerate() {
                // SAFETY: the host promises the buffer stays valid until the engine is
                // freed; regions live in the engine and are dropped with it.
                let r = unsafe { dev.register(b.base, b.len) }.map_err(|e| {
                    err!(
                        TransportUnavailable,
                        "{what} buffer {i}: cannot register {} bytes with {}: {e}",
                        b.len,
                        dev.name()
                    )
                })?;
                regions.push(r);
            }
        }
        // Regions first: a peer that sees the memory registered finds its regions too.
        if self.rdma.is_some() {
            let _ = regions_slot.set(Arc::new(regions));
        }
        register(slot, bufs, layers, what)
    }

    /// Clear gives the room's memory back, so no transport operation may still touch it
    /// when clear returns. An operation in progress normally ends within milliseconds (a
    /// TCP receiver re-checks the state after every `recv`, which returns as soon as any
    /// bytes arrive; a TCP sender looks after every write that waited 10 ms, and ends
    /// the frame in progress with zeros); one that does not is stuck on a peer that
    /// stopped sending mid-frame, whose connections are then closed, which ends it.
    fn wait_io_drained(&self, room: &ERoom) {
        self.wait_decode_quiet(room);
        let start = Instant::now();
        let mut closed = false;
        // Over RDMA a batch in flight ends with its completions (a whole batch may take
        // a while on a slow device); over TCP a stalled frame ends when its peer is cut.
        let patience = if self.rdma.is_some() {
            std::time::Duration::from_millis(self.config.drain_timeout_ms)
        } else {
            std::time::Duration::from_millis(100)
        };
        while room.io_in_flight() > 0 {
            if !closed && start.elapsed() > patience {
                for (peer, _) in self.room_peers(room) {
                    self.lose_peer(
                        &peer,
                        format!(
                            "stalled in the middle of a frame of room {}, which was cleared",
                            room.id()
                        ),
                    );
                }
                closed = true;
            }
            if start.elapsed() > patience + std::time::Duration::from_secs(5) {
                crate::log!(
                    self.log,
                    Error,
                    "room {} cleared with a transport operation still in flight",
                    room.id()
                );
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }

    /// RDMA decode side: clear waits for every peer's acknowledgement of the abort
    /// (normally one round trip plus the batch in flight), at most `drain_timeout_ms`;
    /// peers still silent then are cut off (their queue pairs shut), which ends it.
    fn wait_decode_quiet(&self, room: &ERoom) {
        if self.rdma.is_none() || self.role != Role::Decode {
            return;
        }
        let start = Instant::now();
        let limit = std::time::Duration::from_millis(self.config.drain_timeout_ms);
        while !self.decode_quiet(room) {
            if start.elapsed() > limit {
                self.decode_drain_deadline(room, u64::MAX);
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Drops a cleared room from its peers' room sets.
    fn forget_room(&self, room: &ERoom) {
        for (peer, _) in self.room_peers(room) {
            peer.rooms.lock().remove(&(room.id(), room.generation()));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let shared = &self.shared;
        shared.stopping.store(true, Ordering::Release);
        {
            let _g = shared.wake.0.lock();
            shared.wake.1.notify_all();
        }
        for room in shared.rooms.snapshot() {
            shared.fail_room(
                &room,
                FailureReason::local(Cause::Shutdown, "engine shut down"),
                None,
            );
        }
        shared.workers.write().clear();
        let peers: Vec<Arc<Peer>> = shared.peers.lock().values().cloned().collect();
        for p in peers {
            shared.lose_peer(&p, "engine shut down".into());
        }
        // Threads may start threads (the acceptor, connectors): join until none is left.
        loop {
            shared.handshaking.close_all();
            let threads: Vec<JoinHandle<()>> = shared.threads.lock().drain(..).collect();
            if threads.is_empty() {
                break;
            }
            for t in threads {
                let _ = t.join();
            }
            let peers: Vec<Arc<Peer>> = shared.peers.lock().values().cloned().collect();
            for p in peers {
                shared.lose_peer(&p, "engine shut down".into());
            }
        }
        crate::log!(
            shared.log,
            Info,
            "{} engine on {} stopped",
            shared.role,
            shared.address
        );
    }
}

/// The address peers should connect to: the bound one, except that a wildcard host
/// (`0.0.0.0`, `[::]`) is replaced by this machine's host name, which peers can resolve,
/// when it resolves here.
fn advertised(local: SocketAddr) -> String {
    if !local.ip().is_unspecified() {
        return local.to_string();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    let resolves = !host.is_empty()
        && (host, local.port())
            .to_socket_addrs()
            .is_ok_and(|mut a| a.next().is_some());
    if resolves {
        format!("{host}:{}", local.port())
    } else {
        local.to_string()
    }
}

fn require_live<T>(room: &Room<T>) -> Result<()> {
    let s = room.state();
    if s.is_terminal() {
        Err(err!(WrongState, "room {} is already {s}", room.id()))
    } else {
        Ok(())
    }
}

fn bind(listen: &str) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = listen
        .to_socket_addrs()
        .map_err(|e| {
            err!(
                BadValue,
                "config key 'listen': cannot resolve '{listen}': {e}"
            )
        })?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(err!(
        Io,
        "cannot listen on '{listen}': {}",
        last.map(|e| e.to_string())
            .unwrap_or_else(|| "no address".into())
    ))
}

/// Publishes checked buffer descriptors (see `check_buffers`).
fn register(
    slot: &OnceLock<Memory>,
    bufs: Vec<BufferDesc>,
    layers: Option<Vec<u32>>,
    what: &str,
) -> Result<()> {
    let memory = match layers {
        Some(l) => Memory::with_layers(bufs, l),
        None => Memory::new(bufs),
    };
    slot.set(memory)
        .map_err(|_| err!(WrongState, "{what} buffers are already registered"))
}

/// Checks buffer descriptors before anything is registered.
fn check_buffers(bufs: &[BufferDesc], what: &str) -> Result<()> {
    if bufs.is_empty() || bufs.len() > MAX_BUFFERS {
        return Err(err!(
            InvalidArgument,
            "{what} buffer count must be 1 to {MAX_BUFFERS}, not {}",
            bufs.len()
        ));
    }
    for (i, b) in bufs.iter().enumerate() {
        if b.base == 0 {
            return Err(err!(InvalidArgument, "{what} buffer {i}: base is NULL"));
        }
        if b.item_len == 0 {
            return Err(err!(InvalidArgument, "{what} buffer {i}: item_len is 0"));
        }
        if b.len < b.item_len {
            return Err(err!(
                InvalidArgument,
                "{what} buffer {i}: len {} is smaller than item_len {}",
                b.len,
                b.item_len
            ));
        }
        if b.base.checked_add(b.len).is_none() {
            return Err(err!(
                InvalidArgument,
                "{what} buffer {i}: base + len overflows the address space"
            ));
        }
        if b.item_len > u32::MAX as usize / 2 {
            return Err(err!(
                InvalidArgument,
                "{what} buffer {i}: item_len {} is larger than a data frame",
                b.item_len
            ));
        }
    }
    Ok(())
}
