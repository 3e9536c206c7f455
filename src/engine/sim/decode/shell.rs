//! A simulated decode engine as the library's routing sees it
//! ([`arrivals::Shell`](crate::engine::decode::arrivals::Shell)): the live engine's
//! `decode::arrivals` code runs on it unchanged.

use std::rc::Rc;

use super::*;
use crate::engine::decode::arrivals::Shell;
use crate::room::FailureReason;

/// Decode engine `d` of the world, lent to one routing call.
pub(crate) struct Sim<'a> {
    pub w: &'a mut World,
    pub d: usize,
}

/// One use of a room of a simulated decode engine, with its decisions.
pub(crate) struct Handle {
    pub id: u64,
    pub dgen: u64,
    core: Rc<DecodeRoom<SimPeer>>,
}

impl Sim<'_> {
    /// Whether `room` is still the engine's room of its id.
    fn current(&self, room: &Handle) -> bool {
        let rooms = &self.w.decodes[self.d].rooms;
        rooms.get(&room.id).is_some_and(|r| r.dgen == room.dgen)
    }
}

impl Shell for Sim<'_> {
    type Peer = SimPeer;
    type Room = Handle;

    fn room(&mut self, id: u64, dgen: u64) -> Option<Handle> {
        let room = self.w.decodes[self.d].rooms.get(&id)?;
        let core = room.core.clone();
        (room.dgen == dgen).then_some(Handle { id, dgen, core })
    }

    /// A room stays in the engine's table until it drained (the host gives its pages back
    /// then).
    fn find(&mut self, id: u64, dgen: u64) -> Option<Handle> {
        self.room(id, dgen)
    }

    fn id(&self, room: &Handle) -> u64 {
        room.id
    }

    fn core<'r>(&self, room: &'r Handle) -> &'r DecodeRoom<SimPeer> {
        &room.core
    }

    /// Each of the room's prefill engines owes its part of every page of every layer:
    /// `PAGE` bytes per page and layer, split between them (head slices).
    fn settle(&mut self, room: &Handle, idx: usize) -> Settle {
        let e = &self.w.decodes[self.d];
        let layers = e.rooms.get(&room.id).map_or(1, |r| r.layers);
        let facts = |p: &SimPeer| Facts {
            name: ["p0", "p1", "p2"][p.node],
            aux_count: 0,
        };
        let part = PAGE / room.core.peers.len() as u64 * u64::from(layers);
        let owed = |_: &SimPeer, sent: u32, want: u64| {
            if u64::from(sent) == want {
                Ok(want * part)
            } else {
                Err(format!("claims {sent} pages of {want}"))
            }
        };
        room.core.settle(idx, e.rdma, facts, owed)
    }

    fn fail_room(&mut self, room: &Handle, reason: FailureReason, origin: Option<&SimPeer>) {
        if self.current(room) {
            let reason = (reason.cause, reason.message);
            fail(self.w, self.d, room.id, reason, origin.copied());
        }
    }

    fn complete(&mut self, room: &Handle) {
        if self.current(room) && transit(self.w, self.d, room.id, Event::Complete) {
            check::success(self.w, self.d, room.id);
        }
    }

    fn send_abort(&mut self, peer: &SimPeer, id: u64, dgen: u64, why: &str) {
        let d = self.d;
        *self.w.decodes[d]
            .aborts
            .entry((id, dgen, *peer))
            .or_default() += 1;
        let reason = why.to_string();
        let msg = Msg::Abort { id, dgen, reason };
        self.w.send_to_prefill(d, peer.node, peer.inc, msg);
    }

    fn unknown_room(&mut self) {}

    fn abort_applies(&mut self, room: &Handle, peer: &SimPeer) {
        check::party(self.w, self.d, room.id, room.dgen, peer.node);
    }
}
