//! The prefill (sending) side: rooms that wait for the destinations of their decode
//! engines, the holding area for what arrives before its room ([`holding`]), who plans
//! a room's chunks ([`planning`]), the planners and the senders that write pages to the
//! decode engines ([`sender`]), and the acknowledgements of aborts over RDMA ([`acks`]).

pub(crate) mod acks;
pub(crate) mod arrivals;
pub(crate) mod completion;
pub(crate) mod holding;
pub(crate) mod layers;
pub(crate) mod ledger;
mod outbox;
mod plan;
pub(crate) mod planning;
mod send;
mod sender;
mod staged;

use arrivals::Live;
use sender::Handed;

use std::collections::{HashMap, VecDeque};
use std::net::TcpListener;
use std::sync::{mpsc, Arc};

use parking_lot::{Mutex, RwLock};

use super::core::{self, Core, Side};
use super::lifecycle;
use crate::control::{Control, Events, Peer};
use crate::err;
use crate::error::Result;
use crate::node::Node;
use crate::proto::Message;
use crate::room::{Cause, FailureReason, Room, State};
use crate::transport::DataLink;
use acks::Acks;
use completion::Completion;
use holding::Holding;
use layers::Chunks;
use ledger::Ledger;
use outbox::Outbox;
use planning::Planning;

/// One chunk of source pages, or some layers of one (`kvxfer_enqueue_layers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub pages: Vec<u32>,
    /// The call closes the room: nothing is enqueued after it.
    pub is_last: bool,
    pub aux: Option<u32>,
    /// The chunk's first position in the room's source pages (and so in each
    /// destination's pages, for a byte copy).
    pub start: usize,
    /// The kv buffers to send (those of the layers enqueued); `None`: all of them.
    pub buffers: Option<Arc<[bool]>>,
    /// With `is_last`: the source pages of the whole room.
    pub total: Option<usize>,
}

/// Where one decode engine wants the room's pages.
pub(crate) type Dest = ledger::Dest<Arc<Peer>>;

/// A prefill room's data.
pub(crate) struct PrefillRoom {
    /// Its decode engines: the binding, the destinations, the generations heard.
    ledger: Ledger<Arc<Peer>>,
    /// The room was made WAITING_FOR_INPUT (every destination arrived and the Ready
    /// transition was applied): chunks are planned from now on, not before.
    ready: bool,
    /// Who plans the room's chunks (a thread that handed one on, a sender that took one
    /// of its batches, or its worker), the chunks handed on and not planned yet, and its
    /// batches queued for a sender ([`PrefillEngine::hand_on`]).
    planning: Planning,
    /// Chunks enqueued before every destination arrived (layers of one chunk joined).
    held: VecDeque<Chunk>,
    /// The last chunk was enqueued.
    closed: bool,
    /// The chunks enqueued so far, and those still missing layers.
    chunks: Chunks,
    /// Its batches planned and ended, and the Done frame of each destination.
    completion: Completion<(Arc<Peer>, Vec<u8>)>,
}

impl PrefillRoom {
    fn new(expected: usize, bound: Option<Vec<u64>>) -> Self {
        PrefillRoom {
            ledger: Ledger::new(expected, bound),
            ready: false,
            planning: Planning::default(),
            held: VecDeque::new(),
            closed: false,
            chunks: Chunks::default(),
            completion: Completion::default(),
        }
    }
}

pub(crate) type PRoom = Room<Mutex<PrefillRoom>>;

fn ext(room: &PRoom) -> &Mutex<PrefillRoom> {
    &room.ext
}

/// One chunk of one room, handed on to be planned.
pub(crate) struct Job {
    room: Arc<PRoom>,
    chunk: Chunk,
}

/// The most decode engines one prefill room may wait for.
pub const MAX_ROOM_PEERS: usize = 1024;

/// Checks how many decode engines a prefill room may wait for.
pub(crate) fn check_decoders(n: usize) -> Result<()> {
    if n == 0 || n > MAX_ROOM_PEERS {
        return Err(err!(
            InvalidArgument,
            "a prefill room waits for 1 to {MAX_ROOM_PEERS} decode engines, not {n}"
        ));
    }
    Ok(())
}

/// Checks the decode engines a prefill room is bound to: 1 to [`MAX_ROOM_PEERS`]
/// distinct ids.
pub(crate) fn check_bound(ids: &[u64]) -> Result<()> {
    if ids.is_empty() || ids.len() > MAX_ROOM_PEERS {
        return Err(err!(
            InvalidArgument,
            "a prefill room is bound to 1 to {MAX_ROOM_PEERS} decode engines, not {}",
            ids.len()
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    if let Some(dup) = ids.iter().find(|id| !seen.insert(**id)) {
        return Err(err!(
            InvalidArgument,
            "decode engine {dup:016x} is listed twice for one prefill room"
        ));
    }
    Ok(())
}

/// A prefill engine.
pub(crate) struct PrefillEngine {
    pub core: Core<Mutex<PrefillRoom>>,
    /// Each decode engine's outbox, by the address of its peer (made when its first link
    /// comes up, closed when it is lost).
    outboxes: Mutex<HashMap<usize, Arc<Outbox>>>,
    holding: Mutex<Holding<Arc<Peer>>>,
    /// Each worker's queue of rooms whose waiting chunks it plans.
    workers: RwLock<Vec<mpsc::Sender<Arc<PRoom>>>>,
    acks: Acks,
}

impl PrefillEngine {
    /// Starts a prefill engine on `node`: its workers and its acceptor on `listener`.
    pub fn start(
        node: Arc<Node>,
        control: Arc<Control>,
        listener: TcpListener,
    ) -> Result<Arc<PrefillEngine>> {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..node.config.workers)
            .map(|_| mpsc::channel::<Arc<PRoom>>())
            .unzip();
        let engine = Arc::new(PrefillEngine {
            core: Core::new(node.clone(), control.clone()),
            outboxes: Mutex::new(HashMap::new()),
            holding: Mutex::new(Holding::default()),
            workers: RwLock::new(senders),
            acks: Acks::default(),
        });
        control.bind(Arc::downgrade(&(engine.clone() as Arc<dyn Events>)));
        for (i, rx) in receivers.into_iter().enumerate() {
            let e = engine.clone();
            node.spawn(&format!("kvxfer-worker-{i}"), move || e.worker(i, rx))?;
        }
        node.spawn("kvxfer-accept", move || control.accept_loop(listener))?;
        Ok(engine)
    }

    /// The outbox of decode engine `peer`, if a link to it is up.
    fn outbox(&self, peer: &Arc<Peer>) -> Option<Arc<Outbox>> {
        self.outboxes
            .lock()
            .get(&(Arc::as_ptr(peer) as usize))
            .cloned()
    }

    /// Stopping: no chunk is dispatched any more, and the workers end.
    pub fn stop_workers(&self) {
        self.workers.write().clear();
    }

    /// Creates room `id`, waiting for `decoders` decode engines' destinations (checked
    /// by [`check_decoders`]), from the engines `bound` names if given (checked by
    /// [`check_bound`], as many as `decoders`).
    pub fn create(&self, id: u64, decoders: usize, bound: Option<Vec<u64>>) -> Result<()> {
        let node = &self.core.node;
        let deadline = lifecycle::bootstrap_deadline(node);
        let bound_to = bound.as_ref().map(|ids| {
            let ids: Vec<String> = ids.iter().map(|i| format!("{i:016x}")).collect();
            ids.join(", ")
        });
        let room = self.core.rooms.create(
            id,
            node.role,
            deadline,
            Mutex::new(PrefillRoom::new(decoders, bound)),
        )?;
        match bound_to {
            None => lifecycle::created(self, &room, format_args!("{decoders} decode engine(s)")),
            Some(ids) => lifecycle::created(self, &room, format_args!("bound to {ids}")),
        }
        arrivals::adopt_held(&mut Live(self), &room);
        Ok(())
    }

    /// Queues the next chunk of room `id`, or layers `(first, count)` of one: source
    /// `pages`, whether the call closes the room, and the aux slot that goes with the
    /// last call. Never blocks on the network. A layer enqueued twice for a chunk, or a
    /// room closed while a chunk misses a layer, fails the room (see [`layers`]).
    pub fn enqueue(
        &self,
        id: u64,
        pages: &[u32],
        layers: Option<(u32, u32)>,
        is_last: bool,
        aux: Option<u32>,
    ) -> Result<()> {
        let room = self.core.room(id)?;
        super::require_live(&room)?;
        let node = &self.core.node;
        super::check_pages(node, pages, "source")?;
        if aux.is_some() && !is_last {
            return Err(err!(
                InvalidArgument,
                "an aux slot may only come with the last chunk (is_last)"
            ));
        }
        super::check_aux(node, aux)?;
        let kv = node
            .memory
            .kv
            .get()
            .expect("rooms exist only after KV registration");
        let buffers: Option<Arc<[bool]>> = match layers {
            None => None,
            Some((first, count)) => Some(
                layers::buffers_of(kv, first, count)
                    .map_err(|why| err!(InvalidArgument, "{why}"))?
                    .into(),
            ),
        };
        let mut p = ext(&room).lock();
        if p.closed {
            return Err(err!(WrongState, "room {id} already has its last chunk"));
        }
        let placed = match p.chunks.admit(pages, buffers.as_deref(), is_last, |b| {
            layers::layer_of(kv, b)
        }) {
            Ok(placed) => placed,
            Err(why) => {
                drop(p);
                let why = format!("room {id}: {why}");
                lifecycle::fail(
                    self,
                    &room,
                    FailureReason::local(Cause::Mismatch, why.clone()),
                    None,
                );
                return Err(err!(InvalidArgument, "{why}"));
            }
        };
        let chunk = Chunk {
            pages: pages.to_vec(),
            is_last,
            aux,
            start: placed.start,
            buffers,
            total: placed.total,
        };
        p.closed = chunk.is_last;
        if !p.ready {
            layers::join(&mut p.held, chunk);
            return Ok(());
        }
        // Handed on under the lock, so that chunks keep their order with held ones.
        let handed = self.hand_on(
            &mut p,
            Job {
                room: room.clone(),
                chunk,
            },
        );
        drop(p);
        match handed {
            Handed::Queued(true) => {}
            Handed::Queued(false) => self.fail_undispatched(&room),
            Handed::Here(job) => self.plan_here(job),
        }
        Ok(())
    }

    /// Hands `room` to the worker that owns it, to plan its waiting chunks (rooms spread
    /// over all workers; one room always goes to the same worker). Returns false when the
    /// engine is shutting down: the caller fails the room, once it holds no room lock
    /// (failing reads the room's destinations under that lock).
    #[must_use]
    fn dispatch(&self, room: &Arc<PRoom>) -> bool {
        let workers = self.workers.read();
        if workers.is_empty() {
            return false;
        }
        let h = room.generation().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let w = (h as usize) % workers.len();
        workers[w].send(room.clone()).is_ok()
    }

    /// Fails a room whose chunk could not be dispatched.
    fn fail_undispatched(&self, room: &PRoom) {
        lifecycle::fail(
            self,
            room,
            FailureReason::local(Cause::Shutdown, "engine shut down"),
            None,
        );
    }
}

impl Side for PrefillEngine {
    type Ext = Mutex<PrefillRoom>;

    fn core(&self) -> &Core<Self::Ext> {
        &self.core
    }

    fn parties(&self, room: &PRoom) -> Vec<(Arc<Peer>, u64)> {
        ext(room).lock().ledger.parties()
    }

    /// The parties but `origin` ([`Ledger::told`]) get an Abort and, over RDMA, its
    /// acknowledgement once our writes into their pages are done; an engine's own abort
    /// is acknowledged where it arrives ([`arrivals::ack_abort`]).
    fn tell_failed(&self, room: &PRoom, msg: &str, origin: Option<&Arc<Peer>>) {
        let node = &self.core.node;
        let told = ext(room).lock().ledger.told(origin);
        for (peer, generation) in told.aborts {
            peer.send(&Message::abort(room.id(), generation, msg, &node.limits));
        }
        if node.rdma.is_some() {
            for (peer, generation) in told.acks {
                self.acks.queue(&self.core, room, peer, generation);
            }
        }
    }

    /// A room failing its bootstrap deadline: the last refusal at authentication and the
    /// last refused registration exchange since it was created, if any (the decode
    /// engine that would have claimed it may be the one refused: no destination names
    /// the room before the exchange).
    fn deadline_note(&self, room: &PRoom) -> Option<String> {
        if room.state() != State::Bootstrapping {
            return None;
        }
        let node = &self.core.node;
        let control = &self.core.control;
        // The room entered bootstrapping one bootstrap timeout before its deadline.
        let since = room
            .deadline_ms()
            .saturating_sub(node.config.bootstrap_timeout_ms);
        let now = node.now_ms();
        let mut note = String::new();
        if let Some((at, text)) = control.last_refusal().filter(|(at, _)| *at >= since) {
            note.push_str(&format!(
                "; meanwhile a connection failed authentication ({} ms ago: {text}; \
                 auth_failures counts every refusal)",
                now.saturating_sub(at)
            ));
        }
        if let Some((at, text)) = control.last_mismatch().filter(|(at, _)| *at >= since) {
            note.push_str(&format!(
                "; meanwhile a decode engine's registration was refused ({} ms ago: {text})",
                now.saturating_sub(at)
            ));
        }
        (!note.is_empty()).then_some(note)
    }

    /// Held destinations whose room never came are answered with a failure, and
    /// acknowledgements whose writes completed go.
    fn tick(&self, now: u64) {
        arrivals::expire(&mut Live(self), now);
        self.acks.send_due(&self.core);
    }

    /// Remembers, for a while, which decode generations the room knew and why it failed,
    /// so late messages about it neither touch a new use of the id nor wait for a
    /// deadline to be answered.
    fn on_clear(&self, room: &PRoom) {
        let (gens, complete) = {
            let p = ext(room).lock();
            (p.ledger.generations(), p.ledger.complete())
        };
        let reason = room.failure().map(|f| f.message.clone());
        arrivals::cleared(&mut Live(self), room.id(), reason, gens, complete);
    }
}

impl Events for PrefillEngine {
    /// A sender thread for the link, taking batches from the peer's outbox; none once
    /// the peer is lost or the engine stops.
    ///
    /// Decided under the outboxes' lock, which [`Events::lost`] takes to close the
    /// peer's outbox only after the peer was marked lost: either the outbox is made
    /// here first and the loss closes it (its sender ends), or the loss is seen here.
    /// Made after the loss, an outbox would never close, and its sender would sleep
    /// forever and hang the engine's free.
    fn link_up(self: Arc<Self>, peer: &Arc<Peer>, link: Arc<dyn DataLink>) {
        let outbox = {
            let mut outboxes = self.outboxes.lock();
            if peer.is_lost() || self.core.node.is_stopping() {
                return;
            }
            outboxes
                .entry(Arc::as_ptr(peer) as usize)
                .or_default()
                .clone()
        };
        let (engine, p) = (self.clone(), peer.clone());
        self.core
            .control
            .spawn_for_peer("kvxfer-send", peer, move || {
                engine.send_loop(&p, &link, &outbox)
            });
    }

    fn destination(
        &self,
        peer: &Arc<Peer>,
        room: u64,
        generation: u64,
        pages: Vec<u32>,
        aux: Option<u32>,
    ) {
        arrivals::on_destination(&mut Live(self), peer, room, generation, pages, aux)
    }

    /// Over TCP nothing is outstanding once the worker sees the room terminal (the
    /// decode side refuses every later byte itself); over RDMA the abort is acknowledged
    /// once the room's posted writes have completed.
    fn abort(&self, peer: &Arc<Peer>, room: u64, generation: u64, reason: String) {
        let mut live = Live(self);
        arrivals::on_abort(&mut live, peer, room, generation, reason);
        if self.core.node.rdma.is_some() {
            arrivals::ack_abort(&mut live, peer, room, generation);
        }
    }

    /// The destinations the engine left in the holding area become tombstones (their
    /// rooms fail at once when created), and its rooms fail.
    fn lost(&self, peer: &Arc<Peer>, cause: Cause, why: &str) {
        arrivals::lost(&mut Live(self), peer, why);
        core::fail_rooms_of(self, peer, cause);
        // Its senders end; what they had not taken is dropped (its rooms just failed).
        let outbox = self.outboxes.lock().remove(&(Arc::as_ptr(peer) as usize));
        if let Some(outbox) = outbox {
            for item in outbox.close() {
                if let outbox::Item::Batch(batch) = item {
                    self.batch_ended(&batch, false, None);
                }
            }
        }
    }
}
