//! The engine: one per process side (prefill or decode). Owns the room table, the
//! registered buffers, the listening socket and the watchdog thread.
//!
//! The scheduler-facing calls (`room_*`, `enqueue_chunk`) never block on the network.

mod watchdog;

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::config::{parse_host_port, Config, Role, TransportKind};
use crate::err;
use crate::error::Result;
use crate::log::Logger;
use crate::room::{Cause, FailureReason, Room, RoomTable, State};

/// The most buffers of one kind an engine may register.
pub const MAX_BUFFERS: usize = 4096;
/// The most decode engines one prefill room may wait for.
pub const MAX_ROOM_PEERS: usize = 1024;

/// One registered memory buffer, as addresses (the engine core never dereferences them
/// itself; the transport does, under the registration contract).
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

/// What a room was created with on the decode side: where it pulls from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomPeers {
    /// Prefill room: how many decode engines will send a destination.
    Decoders(usize),
    /// Decode room: the prefill engine addresses it pulls from.
    Prefills(Vec<String>),
}

struct Inner {
    role: Role,
    config: Config,
    log: Logger,
    address: String,
    _listener: TcpListener,
    rooms: RoomTable,
    kv: OnceLock<Vec<BufferDesc>>,
    aux: OnceLock<Vec<BufferDesc>>,
    clock: Instant,
    stopping: AtomicBool,
    wake: (Mutex<()>, Condvar),
}

impl Inner {
    /// Milliseconds on the engine's monotonic clock.
    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    fn room(&self, id: u64) -> Result<Arc<Room>> {
        self.rooms
            .get(id)
            .ok_or_else(|| err!(NotFound, "room {id} not found"))
    }

    /// Fails `room` with `reason` and logs it if this call made it terminal.
    fn fail_room(&self, room: &Room, reason: FailureReason) -> bool {
        let msg = reason.to_string();
        match room.fail(reason) {
            Some(from) => {
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
                true
            }
            None => false,
        }
    }
}

/// A running engine. Dropping it fails every live room with "engine shut down" and
/// joins every thread.
pub struct Engine {
    inner: Arc<Inner>,
    watchdog: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts an engine: validates the config, binds the listening socket and starts the
    /// watchdog.
    pub fn new(config: Config, log: Logger) -> Result<Engine> {
        let role = config.require_role()?;
        match config.transport {
            TransportKind::Rdma => {
                return Err(err!(
                    TransportUnavailable,
                    "transport 'rdma' is not available: this build has no RDMA transport yet \
                     (use 'tcp' or 'auto')"
                ))
            }
            TransportKind::Auto | TransportKind::Tcp => {}
        }
        let listener = bind(&config.listen)?;
        let local = listener
            .local_addr()
            .map_err(|e| err!(Io, "cannot read the listening address: {e}"))?;
        let address = local.to_string();
        crate::log!(
            log,
            Info,
            "{role} engine listening on {address}, transport tcp"
        );
        let inner = Arc::new(Inner {
            role,
            config,
            log,
            address,
            _listener: listener,
            rooms: RoomTable::new(),
            kv: OnceLock::new(),
            aux: OnceLock::new(),
            clock: Instant::now(),
            stopping: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
        });
        let w = inner.clone();
        let watchdog = std::thread::Builder::new()
            .name("kvxfer-watchdog".into())
            .spawn(move || watchdog::run(&w))
            .map_err(|e| err!(Io, "cannot start the watchdog thread: {e}"))?;
        Ok(Engine {
            inner,
            watchdog: Some(watchdog),
        })
    }

    /// This engine's role.
    pub fn role(&self) -> Role {
        self.inner.role
    }

    /// The `host:port` peers connect to.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// Registers the KV buffers (once per engine).
    pub fn register_kv(&self, bufs: Vec<BufferDesc>) -> Result<()> {
        register(&self.inner.kv, bufs, "kv")
    }

    /// Registers the aux buffers (once per engine).
    pub fn register_aux(&self, bufs: Vec<BufferDesc>) -> Result<()> {
        register(&self.inner.aux, bufs, "aux")
    }

    /// Creates room `id` in `Bootstrapping`.
    pub fn room_create(&self, id: u64, peers: RoomPeers) -> Result<()> {
        let inner = &self.inner;
        match (&peers, inner.role) {
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
        if inner.kv.get().is_none() {
            return Err(err!(
                WrongState,
                "register the KV buffers (kvxfer_register_kv) before creating rooms"
            ));
        }
        if inner.stopping.load(Ordering::Acquire) {
            return Err(err!(WrongState, "the engine is shutting down"));
        }
        let deadline = inner.now_ms() + inner.config.bootstrap_timeout_ms;
        let room = inner.rooms.create(id, inner.role, deadline)?;
        crate::log!(
            inner.log,
            Debug,
            "room {id} created (gen {}, {:?})",
            room.generation(),
            peers
        );
        Ok(())
    }

    /// Decode only: the destination pages and aux slot of room `id`.
    pub fn room_set_destination(
        &self,
        id: u64,
        pages: &[u32],
        aux_slot: Option<u32>,
    ) -> Result<()> {
        self.require_role(Role::Decode, "kvxfer_room_set_destination")?;
        let room = self.inner.room(id)?;
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
        Err(err!(
            Unsupported,
            "room {id}: destination is valid, but this build has no transfer engine yet"
        ))
    }

    /// Prefill only: queue the next chunk of room `id`.
    pub fn enqueue_chunk(
        &self,
        id: u64,
        pages: &[u32],
        is_last: bool,
        aux_slot: Option<u32>,
    ) -> Result<()> {
        self.require_role(Role::Prefill, "kvxfer_enqueue_chunk")?;
        let room = self.inner.room(id)?;
        require_live(&room)?;
        self.check_pages(pages, "source")?;
        if aux_slot.is_some() && !is_last {
            return Err(err!(
                InvalidArgument,
                "an aux slot may only come with the last chunk (is_last)"
            ));
        }
        self.check_aux(aux_slot)?;
        Err(err!(
            Unsupported,
            "room {id}: chunk is valid, but this build has no transfer engine yet"
        ))
    }

    /// The state of room `id`: one shard read and one atomic load.
    pub fn room_poll(&self, id: u64) -> Result<State> {
        self.inner
            .rooms
            .state(id)
            .ok_or_else(|| err!(NotFound, "room {id} not found"))
    }

    /// Fails room `id` with `reason` unless it is terminal. Idempotent.
    pub fn room_abort(&self, id: u64, reason: &str) -> Result<()> {
        let room = self.inner.room(id)?;
        let message = if reason.is_empty() {
            format!("room {id} aborted by the local scheduler")
        } else {
            format!("room {id} aborted: {reason}")
        };
        self.inner
            .fail_room(&room, FailureReason::local(Cause::Aborted, message));
        Ok(())
    }

    /// The failure reason of room `id`, which must be `Failed`.
    pub fn room_failure(&self, id: u64) -> Result<FailureReason> {
        let room = self.inner.room(id)?;
        room.failure().cloned().ok_or_else(|| {
            err!(
                WrongState,
                "room {id} is {}, not failed: it has no failure reason",
                room.state()
            )
        })
    }

    /// Decode only: whether no write into room `id`'s pages can still land.
    pub fn room_drained(&self, id: u64) -> Result<bool> {
        self.require_role(Role::Decode, "kvxfer_room_drained")?;
        let room = self.inner.room(id)?;
        // Without a transfer engine no write is ever started, so a terminal room is
        // drained; a live one may still receive data.
        Ok(room.state().is_terminal())
    }

    /// Releases room `id` (aborting it first if live). A second clear finds no room.
    pub fn room_clear(&self, id: u64) -> Result<()> {
        let room = self.inner.room(id)?;
        self.inner.fail_room(
            &room,
            FailureReason::local(Cause::Aborted, format!("room {id} cleared while live")),
        );
        self.inner.rooms.remove_generation(id, room.generation());
        Ok(())
    }

    /// How many rooms the engine holds (live or terminal, not yet cleared).
    pub fn room_count(&self) -> usize {
        self.inner.rooms.len()
    }

    fn require_role(&self, role: Role, call: &str) -> Result<()> {
        if self.inner.role == role {
            Ok(())
        } else {
            Err(err!(
                WrongRole,
                "{call} is for {role} engines; this engine is {}",
                self.inner.role
            ))
        }
    }

    fn check_pages(&self, pages: &[u32], what: &str) -> Result<()> {
        let capacity = self
            .inner
            .kv
            .get()
            .map(|b| b.iter().map(BufferDesc::items).min().unwrap_or(0))
            .unwrap_or(0);
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
        let slots = self
            .inner
            .aux
            .get()
            .map(|b| b.iter().map(BufferDesc::items).min().unwrap_or(0))
            .unwrap_or(0);
        if slot as usize >= slots {
            return Err(err!(
                InvalidArgument,
                "aux slot {slot} is out of range: the aux buffers hold {slots} slots"
            ));
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.stopping.store(true, Ordering::Release);
        {
            let _g = inner.wake.0.lock();
            inner.wake.1.notify_all();
        }
        if let Some(h) = self.watchdog.take() {
            let _ = h.join();
        }
        for room in inner.rooms.snapshot() {
            inner.fail_room(
                &room,
                FailureReason::local(Cause::Shutdown, "engine shut down"),
            );
        }
        crate::log!(
            inner.log,
            Info,
            "{} engine on {} stopped",
            inner.role,
            inner.address
        );
    }
}

fn require_live(room: &Room) -> Result<()> {
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

fn register(slot: &OnceLock<Vec<BufferDesc>>, bufs: Vec<BufferDesc>, what: &str) -> Result<()> {
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
    }
    slot.set(bufs)
        .map_err(|_| err!(WrongState, "{what} buffers are already registered"))
}
