//! Prefill over RDMA: acknowledgements of decode engines' aborts, each sent once no
//! write into that destination can be outstanding (the decode side reuses the pages on
//! it, invariant 6). [`AckTable`] decides which are due (pure, driven by the simulator
//! too); [`Acks`] is the engine's, which sends them.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::PrefillRoom;
use crate::control::Peer;
use crate::engine::core::Core;
use crate::engine::peer_ref::PeerRef;
use crate::proto::Message;
use crate::room::Room;

/// (room id, room generation, the generation the peer knows the room by).
type AckKey = (u64, u64, u64);

/// Acknowledgements waiting for their room's writes: the peers to tell, per key. One
/// entry per destination of a room, however often a peer asks.
pub(crate) struct AckTable<P> {
    pending: HashMap<AckKey, Vec<P>>,
}

impl<P> Default for AckTable<P> {
    fn default() -> Self {
        AckTable {
            pending: HashMap::new(),
        }
    }
}

impl<P: PeerRef> AckTable<P> {
    /// Queues the acknowledgement to `peer` of its destination with `generation` in the
    /// use `room_gen` of room `id`.
    pub fn queue(&mut self, id: u64, room_gen: u64, peer: P, generation: u64) {
        let peers = self.pending.entry((id, room_gen, generation)).or_default();
        if !peers.iter().any(|p| p.same(&peer)) {
            peers.push(peer);
        }
    }

    /// Takes the acknowledgements whose room has no write outstanding (`busy(id,
    /// room_gen)` says whether it has): each as (peer, room id, generation).
    pub fn due(&mut self, busy: impl Fn(u64, u64) -> bool) -> Vec<(P, u64, u64)> {
        let mut due = Vec::new();
        self.pending.retain(|&(id, room_gen, generation), peers| {
            if busy(id, room_gen)
                && !crate::engine::bugs::on(crate::engine::bugs::Bug::AckWithWritesInFlight)
            {
                return true;
            }
            due.extend(peers.drain(..).map(|p| (p, id, generation)));
            false
        });
        due
    }

    /// How many acknowledgements wait.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.pending.values().map(Vec::len).sum()
    }
}

/// The engine's acknowledgements, sent as they come due.
#[derive(Default)]
pub(crate) struct Acks {
    table: Mutex<AckTable<Arc<Peer>>>,
}

impl Acks {
    /// Acknowledges the abort of `room` to `peer` (of its destination with generation
    /// `generation`) once no write of the room is outstanding (at once if none is).
    pub fn queue(
        &self,
        core: &Core<Mutex<PrefillRoom>>,
        room: &Room<Mutex<PrefillRoom>>,
        peer: Arc<Peer>,
        generation: u64,
    ) {
        self.table
            .lock()
            .queue(room.id(), room.generation(), peer, generation);
        self.send_due(core);
    }

    /// Sends every pending acknowledgement whose room has no write outstanding. Called
    /// after queueing one, by a worker after each chunk of a terminal room, and by the
    /// watchdog.
    pub fn send_due(&self, core: &Core<Mutex<PrefillRoom>>) {
        // A cleared room still draining is found too: its writes count.
        let due = self.table.lock().due(|id, room_gen| {
            core.find_room(id, room_gen)
                .is_some_and(|r| r.io_in_flight() > 0)
        });
        for (peer, room, generation) in due {
            peer.send(&Message::AbortAck { room, generation });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AckTable;
    use crate::engine::peer_ref::TestPeer as P;

    #[test]
    fn an_acknowledgement_waits_for_its_room_s_writes_and_goes_once() {
        let mut t = AckTable::default();
        t.queue(5, 1, P(1), 7);
        t.queue(5, 1, P(1), 7);
        t.queue(5, 1, P(2), 9);
        t.queue(6, 2, P(1), 3);
        assert_eq!(t.len(), 3);
        let busy_5 = |id: u64, _| id == 5;
        assert_eq!(t.due(busy_5), vec![(P(1), 6, 3)]);
        assert!(t.due(busy_5).is_empty());
        let mut due = t.due(|_, _| false);
        due.sort_by_key(|d| d.0 .0);
        assert_eq!(due, vec![(P(1), 5, 7), (P(2), 5, 9)]);
        assert_eq!(t.len(), 0);
    }
}
