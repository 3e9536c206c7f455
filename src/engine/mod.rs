//! The engine: one per process side (prefill or decode). Its face is [`Engine`], the
//! calls a server's scheduler makes; behind it, one role's side ([`prefill`] or
//! [`decode`]) over the shared [`core`], which changes a room's state only through
//! [`lifecycle`], and the [`watchdog`] thread.
//!
//! The scheduler-facing calls (`room_*`, `enqueue_chunk`) never block on the network.

mod bugs;
mod changes;
mod core;
mod decode;
mod lifecycle;
mod peer_ref;
mod prefill;
#[cfg(test)]
mod sim;
mod watchdog;

use std::net::TcpListener;
use std::sync::Arc;

pub use crate::layout::{KvKind, KvLayout, PageOrder};
pub use crate::metrics::MetricsSnapshot;
pub use crate::node::MAX_BUFFERS;
pub use crate::transport::{BufferDesc, MemKind};
pub use prefill::MAX_ROOM_PEERS;

use crate::config::{Config, Role};
use crate::control::Control;
use crate::discovery::Discovery;
use crate::err;
use crate::error::Result;
use crate::log::Logger;
use crate::node::Node;
use crate::room::{FailureReason, Room, State};
use decode::DecodeEngine;
use prefill::PrefillEngine;

/// The path a room's data took with its peers (DESIGN inv. 11), as `kvxfer_room_path`
/// reports it: the path of every peer pairing of the room when they agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DataPath {
    /// No peer of the room is paired yet.
    Unknown = 0,
    /// Data frames over TCP.
    Tcp = 1,
    /// RDMA writes.
    Rdma = 2,
    /// A direct copy between the two processes on one host (`same_host`).
    SameHost = 3,
    /// Both engines on one host with device memory: the decode engine copies device
    /// pages device to device through CUDA IPC (host pages as `SameHost`).
    CudaIpc = 4,
    /// The room's peers took different paths.
    Mixed = 15,
}

impl DataPath {
    /// The path of a room whose peers' pairings took `paths` (`None`: not paired yet).
    pub fn of(paths: impl IntoIterator<Item = Option<DataPath>>) -> DataPath {
        let mut out = None;
        for p in paths {
            let p = p.unwrap_or(DataPath::Unknown);
            out = Some(match out {
                None => p,
                Some(q) if q == p => q,
                Some(_) => return DataPath::Mixed,
            });
        }
        out.unwrap_or(DataPath::Unknown)
    }

    /// The path's name, as logs and errors say it.
    pub fn name(self) -> &'static str {
        match self {
            DataPath::Unknown => "unknown",
            DataPath::Tcp => "tcp",
            DataPath::Rdma => "rdma",
            DataPath::SameHost => "same-host",
            DataPath::CudaIpc => "CUDA IPC",
            DataPath::Mixed => "mixed",
        }
    }
}

/// Who a room exchanges data with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomPeers {
    /// Prefill room: how many decode engines will send a destination.
    Decoders(usize),
    /// Prefill room bound to the decode engines with these ids ([`Engine::engine_id`]),
    /// one destination from each: destinations and aborts from any other engine are
    /// refused and counted (`binding_refusals`).
    DecodeEngines(Vec<u64>),
    /// Decode room: the prefill engine addresses it pulls from.
    Prefills(Vec<String>),
}

/// The role's side of a running engine.
enum Side {
    Prefill(Arc<PrefillEngine>),
    Decode(Arc<DecodeEngine>),
}

/// Runs `$body` with `$s` bound to the engine's side, whichever role it is.
macro_rules! with_side {
    ($engine:expr, $s:ident => $body:expr) => {
        match &$engine.side {
            Side::Prefill($s) => $body,
            Side::Decode($s) => $body,
        }
    };
}

/// A running engine. Dropping it fails every live room with "engine shut down", closes
/// every connection and joins every thread.
pub struct Engine {
    side: Side,
    node: Arc<Node>,
    control: Arc<Control>,
    /// The registry (config key `discovery`), if configured.
    discovery: Option<Arc<Discovery>>,
    /// A decode engine accepts no connections; holding the socket keeps its address.
    _listener: Option<TcpListener>,
}

impl Engine {
    /// Starts an engine: validates the config, binds the listening socket and starts the
    /// acceptor (prefill), the workers (prefill) and the watchdog.
    pub fn new(config: Config, log: Logger) -> Result<Engine> {
        let (node, listener) = Node::new(config, log)?;
        let control = Control::new(node.clone())?;
        let (side, listener) = match node.role {
            Role::Prefill => (
                Side::Prefill(PrefillEngine::start(
                    node.clone(),
                    control.clone(),
                    listener,
                )?),
                None,
            ),
            // A decode engine opens connections; its listener only reserves the address.
            Role::Decode => (
                Side::Decode(DecodeEngine::start(node.clone(), control.clone())),
                Some(listener),
            ),
        };
        // Built before the watchdog starts, so that if it cannot, dropping the engine
        // stops (and joins) what started before it.
        let mut engine = Engine {
            side,
            node,
            control,
            discovery: None,
            _listener: listener,
        };
        with_side!(engine, s => watchdog::start(s))?;
        if let Side::Decode(d) = &engine.side {
            d.start_verifier()?;
        }
        engine.discovery = crate::discovery::start(&engine.node, &engine.control)?;
        Ok(engine)
    }

    /// This engine's role.
    pub fn role(&self) -> Role {
        self.node.role
    }

    /// This engine's id, which it claims in the `Hello` of every connection it opens: a
    /// router gives a decode engine's id to the prefill side to bind a room to it
    /// ([`RoomPeers::DecodeEngines`]). Chosen at random when the engine starts.
    pub fn engine_id(&self) -> u64 {
        self.node.engine_id
    }

    /// The `host:port` peers connect to.
    pub fn address(&self) -> &str {
        &self.node.address
    }

    /// Registers the KV buffers (once per engine, before the first room).
    pub fn register_kv(&self, bufs: Vec<BufferDesc>) -> Result<()> {
        self.node.register(bufs, None, None, false)?;
        self.registered();
        Ok(())
    }

    /// Registers the KV buffers with a layer id each (once per engine): buffers then pair
    /// with the peer's by layer id, and a pipeline stage may register only its layers.
    pub fn register_kv_layers(&self, bufs: Vec<BufferDesc>, layers: Vec<u32>) -> Result<()> {
        check_layers(&bufs, &layers)?;
        self.node.register(bufs, Some(layers), None, false)?;
        self.registered();
        Ok(())
    }

    /// Registers the KV buffers with the layout of their pages (once per engine), and
    /// optionally a layer id each (as [`Engine::register_kv_layers`]). The layout must
    /// pass [`KvLayout::check`] and every buffer's `item_len` must be its
    /// [`KvLayout::page_bytes`]. Peers learn it at the registration exchange, which
    /// refuses a peer whose layout cannot meet this one (or that registered none).
    pub fn register_kv_layout(
        &self,
        bufs: Vec<BufferDesc>,
        layers: Option<Vec<u32>>,
        layout: KvLayout,
    ) -> Result<()> {
        if let Some(layers) = &layers {
            check_layers(&bufs, layers)?;
        }
        self.node.register(bufs, layers, Some(layout), false)?;
        self.registered();
        Ok(())
    }

    /// Registers the aux buffers (once per engine, before the first room).
    pub fn register_aux(&self, bufs: Vec<BufferDesc>) -> Result<()> {
        self.node.register(bufs, None, None, true)?;
        self.registered();
        Ok(())
    }

    /// A registration changed: discovery publishes it (it waits for the KV buffers).
    fn registered(&self) {
        if let Some(d) = &self.discovery {
            d.wake();
        }
    }

    /// The registry, or why there is none.
    fn registry(&self) -> Result<&Discovery> {
        self.discovery.as_deref().ok_or_else(|| {
            err!(
                WrongState,
                "this engine has no registry: set config key 'discovery' \
                 (etcd://host:port) to find engines by instance"
            )
        })
    }

    /// The addresses of every rank of prefill instance `instance` in the registry's
    /// cache, in rank order, each checked to pair with this engine's KV registration.
    /// Never waits for etcd. `NotFound` for an instance not (or not wholly) registered.
    pub fn lookup(&self, instance: &str) -> Result<Vec<String>> {
        self.registry()?.resolve(instance)
    }

    /// Decode only: creates room `id` pulling from every rank of prefill instance
    /// `instance`, found in the registry's cache (see [`Engine::lookup`]): as
    /// [`Engine::room_create`] with their addresses, in rank order. Never waits for
    /// etcd.
    pub fn room_create_from(&self, id: u64, instance: &str) -> Result<()> {
        if let Side::Prefill(_) = &self.side {
            return Err(wrong_role(Role::Decode, "kvxfer_room_create_from"));
        }
        let registry = self.registry()?;
        if self.node.memory.kv.get().is_none() {
            return Err(err!(
                WrongState,
                "register the KV buffers (kvxfer_register_kv) before creating rooms"
            ));
        }
        let addrs = registry.resolve(instance)?;
        self.room_create(id, RoomPeers::Prefills(addrs))
    }

    /// Creates room `id` in `Bootstrapping`.
    pub fn room_create(&self, id: u64, peers: RoomPeers) -> Result<()> {
        match (&self.side, &peers) {
            (Side::Prefill(_), RoomPeers::Decoders(n)) => prefill::check_decoders(*n)?,
            (Side::Prefill(_), RoomPeers::DecodeEngines(ids)) => prefill::check_bound(ids)?,
            (Side::Decode(_), RoomPeers::Prefills(addrs)) => decode::check_prefills(addrs)?,
            (Side::Decode(_), RoomPeers::DecodeEngines(_)) => {
                return Err(err!(
                    InvalidArgument,
                    "only a prefill room may be bound to decode engines; a decode room \
                     needs the addresses of the prefill engines it pulls from"
                ))
            }
            (Side::Decode(_), RoomPeers::Decoders(_)) => {
                return Err(err!(
                    InvalidArgument,
                    "a decode room needs the addresses of the prefill engines it pulls from"
                ))
            }
            (Side::Prefill(_), RoomPeers::Prefills(_)) => {
                return Err(err!(
                    InvalidArgument,
                    "a prefill room takes no peer addresses (peers must be NULL), only a count"
                ))
            }
        }
        if self.node.memory.kv.get().is_none() {
            return Err(err!(
                WrongState,
                "register the KV buffers (kvxfer_register_kv) before creating rooms"
            ));
        }
        if self.node.is_stopping() {
            return Err(err!(WrongState, "the engine is shutting down"));
        }
        self.node.memory.seal();
        match (&self.side, peers) {
            (Side::Prefill(p), RoomPeers::Decoders(n)) => p.create(id, n, None),
            (Side::Prefill(p), RoomPeers::DecodeEngines(ids)) => p.create(id, ids.len(), Some(ids)),
            (Side::Decode(d), RoomPeers::Prefills(addrs)) => d.create(id, addrs),
            _ => unreachable!("checked above"),
        }
    }

    /// Creates room `id` from `kvxfer_room_create`'s `peers` and `n_peers`, which C
    /// passes alike for both roles: `addrs` is `None` for a NULL `peers`, else it reads
    /// the `n_peers` addresses (called only when this role takes addresses). A prefill
    /// room takes no list and `n_peers` decode engines, 0 meaning 1; a decode room takes
    /// the list. [`Engine::room_create`] checks the rest, for the role's side.
    pub(crate) fn room_create_c(
        &self,
        id: u64,
        addrs: Option<impl FnOnce() -> Result<Vec<String>>>,
        n_peers: usize,
    ) -> Result<()> {
        let peers = match (&self.side, addrs) {
            (Side::Prefill(_), None) => RoomPeers::Decoders(n_peers.max(1)),
            // A list on a prefill engine is the mistake, whatever it holds.
            (Side::Prefill(_), Some(_)) => RoomPeers::Prefills(Vec::new()),
            (Side::Decode(_), None) if n_peers > 0 => {
                return Err(err!(
                    NullPointer,
                    "argument 'peers' is NULL but its count is {n_peers}: a decode room \
                     needs the addresses of the prefill engines it pulls from"
                ))
            }
            (Side::Decode(_), None) => RoomPeers::Prefills(Vec::new()),
            (Side::Decode(_), Some(read)) => RoomPeers::Prefills(read()?),
        };
        self.room_create(id, peers)
    }

    /// Decode only: the destination pages and aux slot of room `id`, sent to every
    /// prefill engine of the room once they are connected.
    pub fn room_set_destination(
        &self,
        id: u64,
        pages: &[u32],
        aux_slot: Option<u32>,
    ) -> Result<()> {
        match &self.side {
            Side::Decode(d) => d.set_destination(id, pages, aux_slot),
            Side::Prefill(_) => Err(wrong_role(Role::Decode, "kvxfer_room_set_destination")),
        }
    }

    /// Prefill only: queue the next chunk of room `id`. Never blocks on the network.
    pub fn enqueue_chunk(
        &self,
        id: u64,
        pages: &[u32],
        is_last: bool,
        aux_slot: Option<u32>,
    ) -> Result<()> {
        match &self.side {
            Side::Prefill(p) => p.enqueue(id, pages, None, is_last, aux_slot),
            Side::Decode(_) => Err(wrong_role(Role::Prefill, "kvxfer_enqueue_chunk")),
        }
    }

    /// Prefill only: queue layers `layer_first .. layer_first + layer_count` of the
    /// chunk of source `pages` of room `id`, as soon as those layers are computed. Layers
    /// are the layer ids the kv buffers were registered with, or without layer ids the
    /// buffers' positions. The first call with a page list opens the chunk (it takes the
    /// next destination pages, as `enqueue_chunk` does); later calls with the same list
    /// add layers to it. `is_last` closes the room: every chunk must then have every
    /// layer. A layer enqueued twice for a chunk, a page list overlapping an open chunk's,
    /// or a room closed while a chunk misses a layer fails the room, naming the chunk and
    /// the layer. Never blocks on the network.
    pub fn enqueue_layers(
        &self,
        id: u64,
        pages: &[u32],
        layer_first: u32,
        layer_count: u32,
        is_last: bool,
        aux_slot: Option<u32>,
    ) -> Result<()> {
        match &self.side {
            Side::Prefill(p) => p.enqueue(
                id,
                pages,
                Some((layer_first, layer_count)),
                is_last,
                aux_slot,
            ),
            Side::Decode(_) => Err(wrong_role(Role::Prefill, "kvxfer_enqueue_layers")),
        }
    }

    /// The state of room `id`: one shard read and one atomic load.
    pub fn room_poll(&self, id: u64) -> Result<State> {
        with_side!(self, s => core::poll(&**s, id))
    }

    /// Fails room `id` with `reason` unless it is terminal, and tells its peers.
    /// Idempotent.
    pub fn room_abort(&self, id: u64, reason: &str) -> Result<()> {
        with_side!(self, s => core::abort(&**s, id, reason))
    }

    /// The failure reason of room `id`, which must be `Failed`.
    pub fn room_failure(&self, id: u64) -> Result<FailureReason> {
        with_side!(self, s => core::failure(&**s, id))
    }

    /// Whether room `id`'s memory may be reused: the room is terminal and no transport
    /// operation can still touch it (decode: no write into its pages can still land;
    /// prefill: no read of its source pages is still in progress).
    pub fn room_drained(&self, id: u64) -> Result<bool> {
        with_side!(self, s => core::drained(&**s, id))
    }

    /// The path room `id`'s data takes with its peer engines (DESIGN inv. 11): TCP,
    /// RDMA or the same-host copy when every peer pairing of the room agrees,
    /// [`DataPath::Mixed`] when they differ, [`DataPath::Unknown`] before any is paired
    /// (a prefill room before its destinations arrived).
    pub fn room_path(&self, id: u64) -> Result<DataPath> {
        with_side!(self, s => core::path(&**s, id))
    }

    /// Decode only: whether room `id` reached SUCCESS with every byte verified: with
    /// `integrity=verify` (which both engines of each pairing then have), every data run
    /// carried a digest (in its data header over TCP and the same-host path, in the
    /// progress of its writes over RDMA) and each matched where it landed. False for a
    /// live or failed room, or with `integrity=off`.
    pub fn room_verified(&self, id: u64) -> Result<bool> {
        let Side::Decode(d) = &self.side else {
            return Err(wrong_role(Role::Decode, "kvxfer_room_verified"));
        };
        let state = core::poll(&**d, id)?;
        let path = core::path(&**d, id)?;
        Ok(state == State::Success
            && self.node.config.integrity
            && matches!(path, DataPath::Tcp | DataPath::SameHost | DataPath::Rdma))
    }

    /// Decode only: how many of room `id`'s first layers (in layer order: the layer ids
    /// the kv buffers were registered with, or their positions) have landed whole, every
    /// byte every prefill engine owes them for the whole destination. For a decode server
    /// that starts work per layer; SUCCESS still means what it means (every layer).
    pub fn room_layers_landed(&self, id: u64) -> Result<u32> {
        match &self.side {
            Side::Decode(d) => d.layers_landed(id),
            Side::Prefill(_) => Err(wrong_role(Role::Decode, "kvxfer_room_layers_landed")),
        }
    }

    /// Releases room `id` (aborting it first if live); the id may be created again at
    /// once. Never waits: a room that has not drained yet (see [`Engine::room_drained`])
    /// drains in the background. A second clear finds no room.
    pub fn room_clear(&self, id: u64) -> Result<()> {
        with_side!(self, s => core::clear(&**s, id))
    }

    /// Waits until a room of this engine changes state (or [`Engine::wake`] is called)
    /// after the count `seen`, or `timeout` passes; returns the count of changes. With
    /// a zero timeout it returns the count at once: read it, poll the rooms, then wait
    /// with what was read, and no change in between is missed. Lets a scheduler thread
    /// sleep until there is something to poll instead of polling on a timer.
    pub fn wait(&self, seen: u64, timeout: std::time::Duration) -> u64 {
        with_side!(self, s => s.core.changes.wait(seen, timeout))
    }

    /// The count of changes [`Engine::wait`] waits past (a wait with a zero timeout).
    pub fn changes(&self) -> u64 {
        self.wait(0, std::time::Duration::ZERO)
    }

    /// Counts a change as a room's would, waking [`Engine::wait`]: for the host's own
    /// events (work arriving from another thread) on the same wait.
    pub fn wake(&self) {
        with_side!(self, s => s.core.changes.bump())
    }

    /// How many rooms the engine holds (live or terminal, not yet cleared).
    pub fn room_count(&self) -> usize {
        with_side!(self, s => s.core.rooms.len())
    }

    /// Counters and gauges.
    pub fn metrics(&self) -> MetricsSnapshot {
        with_side!(self, s => core::metrics(&**s))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.node.stop();
        if let Some(d) = &self.discovery {
            d.wake();
        }
        with_side!(self, s => core::fail_all(&**s));
        if let Side::Prefill(p) = &self.side {
            p.stop_workers();
        }
        self.control.shutdown();
        // Threads may start threads (the acceptor, connectors): join until none is left,
        // losing any peer a connector added meanwhile.
        self.node.join_all(|| self.control.shutdown());
        crate::log!(
            self.node.log,
            Info,
            "{} engine on {} stopped",
            self.node.role,
            self.node.address
        );
    }
}

fn wrong_role(role: Role, call: &str) -> crate::Error {
    let other = match role {
        Role::Prefill => Role::Decode,
        Role::Decode => Role::Prefill,
    };
    err!(
        WrongRole,
        "{call} is for {role} engines; this engine is {other}"
    )
}

fn require_live<T>(room: &Room<T>) -> Result<()> {
    let s = room.state();
    match room.failure() {
        _ if !s.is_terminal() => Ok(()),
        Some(why) => Err(err!(WrongState, "room {} is already {s}: {why}", room.id())),
        None => Err(err!(WrongState, "room {} is already {s}", room.id())),
    }
}

/// Checks that every page of `pages` lies in the registered KV buffers.
fn check_pages(node: &Node, pages: &[u32], what: &str) -> Result<()> {
    let capacity = node.memory.kv_pages();
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

/// Checks that an aux slot, if given, lies in the registered aux buffers.
fn check_aux(node: &Node, slot: Option<u32>) -> Result<()> {
    let Some(slot) = slot else { return Ok(()) };
    let slots = node.memory.aux_slots();
    if slot as usize >= slots {
        return Err(err!(
            InvalidArgument,
            "aux slot {slot} is out of range: the aux buffers hold {slots} slots"
        ));
    }
    Ok(())
}

/// Checks a layer id list against its buffers: one id each, each at most `i32::MAX`.
fn check_layers(bufs: &[BufferDesc], layers: &[u32]) -> Result<()> {
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
    Ok(())
}
