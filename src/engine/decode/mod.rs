//! The decode (receiving) side: rooms that pull from prefill engines, their destinations
//! sent once the engines are connected, data counted as it lands (TCP frames through
//! [`receive`], RDMA progress over the control connection), completion when every
//! prefill engine is done, and (over RDMA) the drain after a failure.

pub(crate) mod arrivals;
mod layers;
mod receive;
pub(crate) mod room;
mod verify;

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::core::{self, Core, Side};
use super::lifecycle;
use crate::config::parse_host_port;
use crate::control::{pairing, Control, Events, Path, Peer, Progress};
use crate::err;
use crate::error::Result;
use crate::node::Node;
use crate::proto::Message;
use crate::room::{Cause, FailureReason, Room, State};
use crate::transport::samehost;
use crate::transport::tcp::recv;
use arrivals::Live;
use room::{DecodeRoom, Facts};

pub(crate) type DRoom = Room<DecodeRoom>;

/// The most prefill engines one decode room may pull from.
pub const MAX_ROOM_PEERS: usize = super::prefill::MAX_ROOM_PEERS;

/// Checks the prefill engine addresses a decode room may pull from.
pub(crate) fn check_prefills(addrs: &[String]) -> Result<()> {
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
    Ok(())
}

/// A decode engine.
pub(crate) struct DecodeEngine {
    pub core: Core<DecodeRoom>,
    /// With `integrity=verify` over RDMA: the progress and Done messages the verifier
    /// thread handles ([`verify`]).
    verifier: verify::Verifier,
}

impl DecodeEngine {
    pub fn start(node: Arc<Node>, control: Arc<Control>) -> Arc<DecodeEngine> {
        let engine = Arc::new(DecodeEngine {
            core: Core::new(node, control.clone()),
            verifier: verify::Verifier::default(),
        });
        control.bind(Arc::downgrade(&(engine.clone() as Arc<dyn Events>)));
        engine
    }

    /// Creates room `id`, pulling from the prefill engines at `addrs` (checked by
    /// [`check_prefills`]).
    pub fn create(&self, id: u64, addrs: Vec<String>) -> Result<()> {
        let core = &self.core;
        let node = &core.node;
        let deadline = lifecycle::bootstrap_deadline(node);
        let peers: Vec<Arc<Peer>> = addrs.iter().map(|a| core.control.peer_for(a)).collect();
        let room = core
            .rooms
            .create(id, node.role, deadline, DecodeRoom::new(peers.clone()))?;
        lifecycle::created(self, &room, format_args!("from {addrs:?}"));
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("decode.attach", id);
        for p in &peers {
            p.rooms.lock().insert((id, room.generation()));
            if p.is_lost() {
                // Lost between peer_for and now: its loss pass may have missed us.
                lifecycle::fail(
                    self,
                    &room,
                    FailureReason::local(p.loss_cause(), p.loss()),
                    None,
                );
            }
        }
        self.try_ready(&room);
        Ok(())
    }

    /// The destination pages and aux slot of room `id`, sent to every prefill engine of
    /// the room once they are connected.
    pub fn set_destination(&self, id: u64, pages: &[u32], aux: Option<u32>) -> Result<()> {
        let room = self.core.room(id)?;
        super::require_live(&room)?;
        let node = &self.core.node;
        super::check_pages(node, pages, "destination")?;
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(err!(
                InvalidArgument,
                "destination page {} is listed twice",
                w[0]
            ));
        }
        super::check_aux(node, aux)?;
        if !room.ext.set_destination(pages, aux) {
            return Err(err!(WrongState, "room {id} already has its destination"));
        }
        lifecycle::waiting_again(self, &room);
        self.send_destination(&room);
        // Nothing to receive (no pages, no aux slot) still completes only on every
        // prefill's Done.
        Ok(())
    }

    /// Moves a room whose peers are all connected to WAITING_FOR_INPUT, and sends its
    /// destination if the scheduler already gave it.
    fn try_ready(&self, room: &Arc<DRoom>) {
        let d = &room.ext;
        if !d.peers.iter().all(|p| p.is_ready()) {
            return;
        }
        let n_kv = self
            .core
            .node
            .memory
            .kv
            .get()
            .map_or(0, |m| m.buffers().len());
        let peers: Vec<pairing::Delivery<'_>> = d
            .peers
            .iter()
            .map(|p| pairing::Delivery {
                map: p.kv_map.get().map_or(&[][..], |m| &m[..]),
                heads: p.slicing.get().map(|s| s.heads()),
            })
            .collect();
        let heads = self
            .core
            .node
            .memory
            .kv_layout
            .get()
            .map_or(0..0, |l| l.heads());
        if let Err(why) = pairing::check_coverage(n_kv, heads, &peers) {
            lifecycle::fail(
                self,
                room,
                FailureReason::local(Cause::Mismatch, format!("room {}: {why}", room.id())),
                None,
            );
            return;
        }
        if room.state() == State::Bootstrapping {
            lifecycle::ready(self, room);
        }
        self.send_destination(room);
    }

    /// Sends the destination to every peer, once, when both it and the peers are ready.
    ///
    /// Whether the room is live and whether its destination went out are decided in one
    /// step, under the room's lock, and the messages are queued on the peers' control
    /// connections under it too (the room decides, `Peer::send` is applied there):
    /// `room_drained` reads `sent` under it after the room is terminal, and an Abort is
    /// queued under it after the room failed (`tell_failed`). So either the destination
    /// went out ahead of the Abort (and over RDMA the room drains only on the peers'
    /// acknowledgements), or it never goes out. The check here is a shortcut; the
    /// decision is the room's, on the state read under its lock (a room that fails
    /// after this check: the simulator's scenarios, `engine::sim::scenarios`).
    fn send_destination(&self, room: &Arc<DRoom>) {
        if room.state() != State::WaitingForInput {
            return;
        }
        room.ext.send_destination(
            || room.state() == State::WaitingForInput,
            |pages, aux| Message::Destination {
                room: room.id(),
                generation: room.generation(),
                pages: pages.to_vec(),
                aux_slot: aux,
            },
            |peer, m| peer.send(m),
        );
    }

    /// Counts KV bytes (per our buffer) and aux rows of peer `idx` that landed in the
    /// room's pages (a TCP frame read, or an RDMA batch completed), re-arms the room's
    /// no-progress deadline, and completes the room if the peer's Done was only waiting
    /// for them.
    fn count(&self, room: &Arc<DRoom>, idx: usize, kv: &[(u32, u64)], aux_rows: u64) {
        let claimed = room.ext.count(idx, kv, aux_rows);
        lifecycle::progressed(self, room);
        if claimed {
            arrivals::settle(&mut Live(self), room, idx);
        }
    }

    /// A prefill engine's Done ([`arrivals::on_done`]).
    fn on_done(&self, peer: &Arc<Peer>, id: u64, generation: u64, pages_sent: u32, aux_sent: bool) {
        arrivals::on_done(&mut Live(self), peer, id, generation, pages_sent, aux_sent);
    }

    /// Whether nothing more of `peer` will be verified: it was lost (which failed its
    /// rooms), or the engine stops.
    fn gone(&self, peer: &Peer) -> bool {
        peer.is_lost() || self.core.node.is_stopping()
    }

    /// Whether RDMA progress is verified (`integrity=verify` over RDMA).
    fn verifies(&self) -> bool {
        self.core.node.config.integrity && self.core.node.rdma.is_some()
    }

    /// A prefill engine's `Progress`: counts what its writes carried (verified first
    /// where `integrity=verify`).
    fn on_progress(&self, peer: &Arc<Peer>, p: Progress) {
        let Some((room, idx)) = arrivals::room_of(&mut Live(self), peer, p.room, p.generation)
        else {
            return;
        };
        if room.state().is_terminal() {
            return;
        }
        if !room.ext.sent() {
            lifecycle::fail(
                self,
                &room,
                FailureReason::local(
                    Cause::Mismatch,
                    format!(
                        "room {}: {} wrote before it had the destination",
                        p.room, peer.name
                    ),
                ),
                None,
            );
            return;
        }
        if self.core.node.config.integrity && !self.verify_progress(peer, &room, &p) {
            return;
        }
        self.core
            .node
            .metrics
            .bytes_received
            .fetch_add(p.bytes, Ordering::Relaxed);
        // The peer's buffers, as ours.
        let map = peer.kv_map.get().map_or(&[][..], |m| &m[..]);
        let ours: Vec<(u32, u64)> =
            p.kv.iter()
                .map(|&(b, n)| (map.get(b as usize).copied().unwrap_or(u32::MAX), n))
                .collect();
        self.count(&room, idx, &ours, p.aux_rows as u64);
        let _ = lifecycle::start(self, &room);
    }
}

impl Side for DecodeEngine {
    type Ext = DecodeRoom;

    fn core(&self) -> &Core<DecodeRoom> {
        &self.core
    }

    fn parties(&self, room: &DRoom) -> Vec<(Arc<Peer>, u64)> {
        room.ext
            .peers
            .iter()
            .map(|p| (p.clone(), room.generation()))
            .collect()
    }

    /// Every peer but `origin` gets an Abort, under the room's lock
    /// ([`arrivals::tell_failed`]).
    fn tell_failed(&self, room: &DRoom, msg: &str, origin: Option<&Arc<Peer>>) {
        let room_use = (room.id(), room.generation());
        arrivals::tell_failed(&mut Live(self), &room.ext, room_use, msg, origin);
    }

    /// Over RDMA, no peer can still write into the room: it succeeded (every write
    /// completed before Done), its destination never went out, or every peer
    /// acknowledged the abort or was cut off. Over TCP the receiver itself refuses late
    /// bytes, and the io count covers the rest.
    fn quiet(&self, room: &DRoom) -> bool {
        self.core.node.rdma.is_none() || room.state() == State::Success || room.ext.quiet()
    }

    fn deadline_note(&self, room: &DRoom) -> Option<String> {
        room.ext.missing(Facts::of).map(|m| format!(": {m}"))
    }

    /// Over RDMA, a failed room whose peers have not all acknowledged within
    /// `drain_timeout_ms` has those peers cut off (their queue pairs shut), so that it
    /// drains and no late write can land in its pages.
    fn watch(&self, room: &DRoom, now: u64) {
        if room.state() != State::Failed || self.quiet(room) {
            return;
        }
        let drain_ms = self.core.node.config.drain_timeout_ms;
        for p in room.ext.silent_past_drain(now, drain_ms) {
            self.core.control.lose(
                &p,
                format!(
                    "no acknowledgement of the abort of room {} within drain_timeout_ms={drain_ms}",
                    room.id()
                ),
            );
            room.ext.peer_quiet(&p);
        }
    }
}

impl Events for DecodeEngine {
    /// Only an engine the room pulls from may abort it ([`arrivals::on_abort`]).
    fn abort(&self, peer: &Arc<Peer>, id: u64, generation: u64, reason: String) {
        arrivals::on_abort(&mut Live(self), peer, id, generation, reason);
    }

    /// The prefill engine's writes into the room have all completed.
    fn abort_ack(&self, peer: &Arc<Peer>, id: u64, generation: u64) {
        arrivals::on_abort_ack(&mut Live(self), peer, id, generation);
    }

    fn done(&self, peer: &Arc<Peer>, room: u64, generation: u64, pages: u32, aux: bool) {
        if self.verifies() {
            // Behind the progress it counts.
            let job = verify::Job::Done(peer.clone(), room, generation, pages, aux);
            self.verifier.push(job, || self.gone(peer));
        } else {
            self.on_done(peer, room, generation, pages, aux)
        }
    }

    /// RDMA: a prefill engine's writes of one batch of the room completed. Counted as
    /// TCP data frames are, once verified where `integrity=verify` (on the verifier
    /// thread, in order with the peer's Done).
    fn progress(&self, peer: &Arc<Peer>, p: Progress) {
        if self.verifies() {
            let job = verify::Job::Progress(peer.clone(), p);
            self.verifier.push(job, || self.gone(peer));
        } else {
            self.on_progress(peer, p)
        }
    }

    fn connected(&self, peer: &Arc<Peer>) {
        let rooms: Vec<(u64, u64)> = peer.rooms.lock().iter().copied().collect();
        for (id, generation) in rooms {
            if let Some(room) = self.core.rooms.get_generation(id, generation) {
                self.try_ready(&room);
            }
        }
    }

    fn serve_data(
        &self,
        peer: &Arc<Peer>,
        stream: TcpStream,
        open: Option<crate::transport::tcp::seal::Opener>,
    ) -> String {
        let sink = receive::Receiver { engine: self, peer };
        let limits = &self.core.node.limits;
        match (peer.path.get(), open) {
            // Nothing travels on the connection but run headers: no payload to seal.
            (Some(&Path::SameHost { pid }), _) => samehost::serve(stream, &sink, pid, limits, None),
            (Some(&Path::CudaIpc { pid }), _) => {
                samehost::serve(stream, &sink, pid, limits, peer.ipc.get().map(|t| &**t))
            }
            (_, Some(open)) => crate::transport::tcp::seal::serve(stream, &sink, limits, open),
            (_, None) => recv::serve(stream, &sink, limits),
        }
    }

    /// Its rooms fail; its queue pairs are shut, so it can write into them no more.
    fn lost(&self, peer: &Arc<Peer>, cause: Cause, _why: &str) {
        for room in core::fail_rooms_of(self, peer, cause) {
            room.ext.peer_quiet(peer);
        }
    }
}
