//! The control layer (DESIGN section 4): the peer engines this engine talks to, one
//! control connection and several data connections (or RDMA queue pairs) per peer,
//! shared by every room to that peer; the handshake (hello, authentication,
//! registration exchange, transport agreement) once per peer; the control reader and
//! writer; heartbeats; and the loss of a peer, once.
//!
//! Control never sees rooms. What arrives for a room (a destination, an abort, an
//! acknowledgement, progress, done) and what happens to a peer (connected, lost) it
//! hands to the engine through [`Events`]; what the engine sends it queues on the
//! [`Peer`].
//!
//! Files: [`peer`] (a peer and its loss), `handshake` (the messages of the setup and
//! their checks), `connect` (decode side) and `accept` (prefill side), `reader` (the
//! control connection's reader and writer, and dispatch), `heartbeat`, [`admission`]
//! (authentication of every connection) and [`pairing`] (which buffer fills which).

mod accept;
pub(crate) mod admission;
mod connect;
mod handshake;
mod heartbeat;
mod ipc;
pub(crate) mod pairing;
pub(crate) mod peer;
mod reader;

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;

pub(crate) use peer::{Path, Peer};

use crate::error::Result;
use crate::node::Node;
use crate::room::Cause;
use crate::transport::DataLink;

/// Decode over RDMA: what one `Progress` message says ([`crate::proto::Message::Progress`]).
pub(crate) struct Progress {
    pub room: u64,
    pub generation: u64,
    /// Aux rows the writes completed.
    pub aux_rows: u32,
    /// Bytes they carried, aux rows included.
    pub bytes: u64,
    /// KV bytes per KV buffer (the sender's index).
    pub kv: Vec<(u32, u64)>,
    /// With `integrity=verify`: every run they carried, with its digest.
    pub runs: Vec<crate::proto::DataHeader>,
}

/// What the control layer hands to the engine. The control reader calls each message's
/// method only on an engine of the role that message is for (it refuses the others as
/// protocol errors), so an engine leaves the other role's methods at their default.
pub(crate) trait Events: Send + Sync {
    /// Prefill: a decode engine's destination for its room `room` (decode generation
    /// `generation`): the pages and aux slot it wants the room's data in.
    fn destination(
        &self,
        _peer: &Arc<Peer>,
        _room: u64,
        _generation: u64,
        _pages: Vec<u32>,
        _aux: Option<u32>,
    ) {
    }

    /// Either role: the peer's room failed (its reason); ours must fail too.
    fn abort(&self, peer: &Arc<Peer>, room: u64, generation: u64, reason: String);

    /// Decode over RDMA: the prefill engine's writes into the room have all completed.
    fn abort_ack(&self, _peer: &Arc<Peer>, _room: u64, _generation: u64) {}

    /// Decode: the prefill engine sent every frame of the room (pages it sent, and
    /// whether it sent the aux rows).
    fn done(&self, _peer: &Arc<Peer>, _room: u64, _generation: u64, _pages: u32, _aux: bool) {}

    /// Decode over RDMA: one batch of the prefill's writes into the room completed.
    fn progress(&self, _peer: &Arc<Peer>, _progress: Progress) {}

    /// Decode: the peer's setup finished; its rooms may become ready.
    fn connected(&self, _peer: &Arc<Peer>) {}

    /// Prefill: a data link to the peer is up (a TCP data connection, or an RDMA queue
    /// pair); it is also in `peer.data`.
    fn link_up(self: Arc<Self>, _peer: &Arc<Peer>, _link: Arc<dyn DataLink>) {}

    /// Decode over TCP: serve data connection `stream` of `peer` (on a thread of its own,
    /// until the connection ends), opening its sealed payloads with `open` when
    /// `encrypt_data` is on; returns why it ended.
    fn serve_data(
        &self,
        _peer: &Arc<Peer>,
        _stream: TcpStream,
        _open: Option<crate::transport::tcp::seal::Opener>,
    ) -> String {
        "this engine receives no data".to_string()
    }

    /// The peer was lost (`why`, failing its rooms with `cause`): called once, after its
    /// connections and links are closed.
    fn lost(&self, peer: &Arc<Peer>, cause: Cause, why: &str);
}

/// Why a peer's setup failed: the cause its rooms fail with, and what went wrong. The
/// caller of a setup loses the peer with it, once.
#[derive(Debug)]
pub(crate) struct SetupError {
    pub cause: Cause,
    pub why: String,
}

impl SetupError {
    pub fn new(cause: Cause, why: impl Into<String>) -> Self {
        SetupError {
            cause,
            why: why.into(),
        }
    }
}

impl From<String> for SetupError {
    /// A setup step that failed on the network or the peer's side: the peer is lost.
    fn from(why: String) -> Self {
        SetupError::new(Cause::PeerLost, why)
    }
}

/// The control layer of one engine.
pub(crate) struct Control {
    pub node: Arc<Node>,
    /// Key: the address (decode side) or the engine id (prefill side).
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    handshaking: peer::Handshaking,
    gate: admission::Gate,
    /// The engine; a weak reference, since the engine holds this.
    events: OnceLock<Weak<dyn Events>>,
    /// The last registration exchange refused: engine-clock ms and why.
    last_mismatch: Mutex<Option<(u64, String)>>,
}

impl Control {
    pub fn new(node: Arc<Node>) -> Result<Arc<Control>> {
        let gate = admission::Gate::new(&node.config)?;
        Ok(Arc::new(Control {
            node,
            peers: Mutex::new(HashMap::new()),
            handshaking: Default::default(),
            gate,
            events: OnceLock::new(),
            last_mismatch: Mutex::new(None),
        }))
    }

    /// Tells the control layer which engine its events go to (once, at start).
    pub fn bind(&self, events: Weak<dyn Events>) {
        let _ = self.events.set(events);
    }

    fn events(&self) -> Option<Arc<dyn Events>> {
        self.events.get().and_then(Weak::upgrade)
    }

    /// Every peer known now.
    pub fn peers(&self) -> Vec<Arc<Peer>> {
        self.peers.lock().values().cloned().collect()
    }

    /// Loses `peer` (once): closes its connections and links, forgets it, and has the
    /// engine fail every live room that depends on it with a reason naming the peer.
    pub fn lose(&self, peer: &Arc<Peer>, why: String) {
        self.lose_with(peer, Cause::PeerLost, why)
    }

    /// As [`Control::lose`], with the cause its rooms fail with.
    pub fn lose_with(&self, peer: &Arc<Peer>, cause: Cause, why: String) {
        if !peer.mark_lost(cause, &why) {
            return;
        }
        self.node.metrics.peers_lost.fetch_add(1, Ordering::Relaxed);
        {
            let mut peers = self.peers.lock();
            if peers.get(&peer.key).is_some_and(|p| Arc::ptr_eq(p, peer)) {
                peers.remove(&peer.key);
            }
        }
        // First of all (inside close): no RDMA write of this peer may land in our
        // memory from here on.
        peer.close();
        if !self.node.is_stopping() {
            crate::log!(
                self.node.log,
                Warn,
                "lost {}: {why}; failing {} room(s)",
                peer.name,
                peer.rooms.lock().len()
            );
        }
        if let Some(events) = self.events() {
            events.lost(peer, cause, &why);
        }
    }

    /// Starts a thread that serves `peer` (its connector, control writer and reader,
    /// data receivers). A panic in it, or a failure to start it, loses the peer with the
    /// reason, so every room it serves fails at once and a new room connects afresh:
    /// no peer is ever left neither ready nor lost by a thread that died.
    pub(crate) fn spawn_for_peer(
        self: &Arc<Self>,
        name: &str,
        peer: &Arc<Peer>,
        body: impl FnOnce() + Send + 'static,
    ) {
        let (control, p, thread) = (self.clone(), peer.clone(), name.to_string());
        #[cfg(feature = "test-hooks")]
        if crate::testing::take_fault(&format!("spawn:{name}"), peer.fault_key()) {
            return self.lose(peer, format!("cannot start thread {name}: injected fault"));
        }
        let started = self.node.spawn(name, move || {
            if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
                control.lose(
                    &p,
                    format!(
                        "internal error: thread {thread} panicked: {}",
                        panic_message(&*e)
                    ),
                );
            }
        });
        if let Err(e) = started {
            self.lose(peer, e.to_string());
        }
    }

    /// Stopping: loses every peer ("engine shut down") and closes connections still in
    /// their handshake. Called again while threads are joined, since a connector may
    /// have added a peer meanwhile.
    pub fn shutdown(&self) {
        self.handshaking.close_all();
        for p in self.peers() {
            self.lose(&p, "engine shut down".into());
        }
    }

    /// This engine's registration as the exchange sends it, without RDMA keys (what
    /// discovery publishes, and checks a registry entry against).
    #[cfg(feature = "discovery")]
    pub fn own_registration(&self) -> crate::proto::Registration {
        self.registration(None)
    }

    /// The last refusal at authentication: when (engine-clock ms) and what.
    pub fn last_refusal(&self) -> Option<(u64, String)> {
        self.gate.last_refusal()
    }

    /// The last registration exchange refused (buffers or layouts that do not pair):
    /// when (engine-clock ms) and why. A prefill room cannot know which decode engine
    /// would have claimed it, so its bootstrap deadline names this.
    pub fn last_mismatch(&self) -> Option<(u64, String)> {
        self.last_mismatch.lock().clone()
    }
}

/// The message of a caught panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}
