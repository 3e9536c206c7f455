//! A simulated prefill engine as the library's routing sees it
//! ([`arrivals::Shell`](crate::engine::prefill::arrivals::Shell)): the live engine's
//! `arrivals` code runs on it unchanged.

use super::*;
use crate::engine::prefill::arrivals::{Counted, Shell};
use crate::engine::prefill::ledger::OnDestination;
use crate::room::FailureReason;

/// Prefill engine `p` of the world, lent to one routing call.
pub(crate) struct Sim<'a> {
    pub w: &'a mut World,
    pub p: usize,
}

impl Sim<'_> {
    fn engine(&mut self) -> &mut PEngine {
        &mut self.w.prefills[self.p]
    }

    /// The room `room` names (its id and use): live, or cleared and draining.
    fn find(&mut self, room: (u64, u64)) -> &mut PRoom {
        let e = &mut self.w.prefills[self.p];
        let (id, rgen) = room;
        match e.rooms.get_mut(&id).filter(|r| r.rgen == rgen) {
            Some(r) => r,
            None => e
                .draining
                .iter_mut()
                .find(|(i, r)| *i == id && r.rgen == rgen)
                .map(|(_, r)| r)
                .expect("a room the routing looked up"),
        }
    }

    fn send(&mut self, peer: &SimPeer, msg: Msg) {
        let p = self.p;
        self.w.send_to_decode(p, peer.node, peer.inc, msg);
    }
}

impl Shell for Sim<'_> {
    type Peer = SimPeer;
    /// A room's id and use (its prefill generation).
    type Room = (u64, u64);

    fn room(&mut self, id: u64) -> Option<(u64, u64)> {
        self.engine().rooms.get(&id).map(|r| (id, r.rgen))
    }

    fn draining(&mut self, id: u64) -> Vec<(u64, u64)> {
        let e = self.engine();
        let of_id = e.draining.iter().filter(|(i, _)| *i == id);
        of_id.map(|(i, r)| (*i, r.rgen)).collect()
    }

    fn id(&self, room: &(u64, u64)) -> u64 {
        room.0
    }

    fn ledger<R>(
        &mut self,
        room: &(u64, u64),
        f: impl FnOnce(&mut Ledger<SimPeer>, Standing) -> R,
    ) -> R {
        let r = self.find(*room);
        let failure = r.reason.as_ref().map(|r| r.1.clone());
        f(&mut r.ledger, standing(r.state, failure.as_deref()))
    }

    /// The engine's index of the rooms that depend on each link, read when the link
    /// is lost ([`lost`]); the simulator checks it against the ledgers.
    fn attach(
        &mut self,
        room: &(u64, u64),
        peer: &SimPeer,
        decide: impl FnOnce(&mut Ledger<SimPeer>, Standing) -> OnDestination,
    ) -> OnDestination {
        let outcome = self.ledger(room, decide);
        if matches!(outcome, OnDestination::Attached { .. }) {
            let deps = self.engine().deps.entry((peer.node, peer.inc));
            deps.or_default().push(*room);
        }
        outcome
    }

    fn holding<R>(&mut self, f: impl FnOnce(&mut Holding<SimPeer>) -> R) -> R {
        f(&mut self.engine().holding)
    }

    fn held_until(&self) -> u64 {
        self.w.now + BOOTSTRAP_US
    }

    fn cleared_until(&self) -> u64 {
        self.w.now + BOOTSTRAP_US + WAITING_US
    }

    fn name(&self, peer: &SimPeer) -> String {
        format!("d{} (link {})", peer.node, peer.inc)
    }

    fn rdma(&self) -> bool {
        self.w.prefills[self.p].rdma
    }

    fn held_for(&self) -> String {
        format!("{BOOTSTRAP_US} µs")
    }

    fn send_abort(&mut self, peer: &SimPeer, id: u64, dgen: u64, why: &str) {
        let p = self.p;
        self.w
            .note(|| format!("p{p} aborts d{}'s room {id}: {why}", peer.node));
        let reason = why.to_string();
        self.send(peer, Msg::Abort { id, dgen, reason });
    }

    fn send_ack(&mut self, peer: &SimPeer, id: u64, dgen: u64) {
        self.send(peer, Msg::AbortAck { id, dgen });
    }

    fn queue_ack(&mut self, room: &(u64, u64), peer: &SimPeer, dgen: u64) {
        let (id, rgen) = *room;
        self.engine().acks.queue(id, rgen, *peer, dgen);
        send_due(self.w, self.p);
    }

    fn fail_room(&mut self, room: &(u64, u64), reason: FailureReason, origin: Option<&SimPeer>) {
        if self.room(room.0) == Some(*room) {
            let reason = (reason.cause, reason.message);
            fail(self.w, self.p, room.0, reason, origin.copied());
        }
    }

    fn loss(&self, peer: &SimPeer) -> Option<(Cause, String)> {
        let lost = self.w.prefills[self.p]
            .lost
            .contains(&(peer.node, peer.inc));
        lost.then(|| {
            (
                Cause::PeerLost,
                format!("lost d{} (link {})", peer.node, peer.inc),
            )
        })
    }

    fn ready(&mut self, room: &(u64, u64)) {
        if self.room(room.0) == Some(*room) {
            ready(self.w, self.p, room.0);
        }
    }

    fn count(&mut self, _what: Counted<'_>) {}

    fn abort_applies(&mut self, room: &(u64, u64), peer: &SimPeer, dgen: u64) {
        check::not_superseded(self.w, self.p, *peer, room.0, dgen);
        check::bound(self.w, self.p, *peer, room.0);
    }
}
