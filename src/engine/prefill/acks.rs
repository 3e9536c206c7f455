//! Prefill over RDMA: acknowledgements of decode engines' aborts, each sent once no
//! write into that destination can be outstanding (the decode side reuses the pages on
//! it, invariant 6).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::PrefillRoom;
use crate::control::Peer;
use crate::engine::core::Core;
use crate::proto::Message;
use crate::room::Room;

/// Acknowledgements waiting for their room's writes, by (room id, room generation, peer,
/// the generation the peer knows the room by); the peer to tell. One entry per
/// destination of a room, whatever a peer sends (an abort naming no destination of ours
/// is acknowledged at once).
#[derive(Default)]
pub(crate) struct Acks {
    pending: Mutex<HashMap<AckKey, Arc<Peer>>>,
}

/// (room id, room generation, the peer's address in memory, its generation).
type AckKey = (u64, u64, usize, u64);

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
        let key = (
            room.id(),
            room.generation(),
            Arc::as_ptr(&peer) as usize,
            generation,
        );
        self.pending.lock().insert(key, peer);
        self.send_due(core);
    }

    /// Sends every pending acknowledgement whose room has no write outstanding. Called
    /// after queueing one, by a worker after each chunk of a terminal room, and by the
    /// watchdog.
    pub fn send_due(&self, core: &Core<Mutex<PrefillRoom>>) {
        let mut due = Vec::new();
        self.pending
            .lock()
            .retain(|&(id, room_gen, _, generation), peer| {
                // A cleared room still draining is found too: its writes count.
                let busy = core
                    .find_room(id, room_gen)
                    .is_some_and(|r| r.io_in_flight() > 0);
                if !busy {
                    due.push((peer.clone(), id, generation));
                }
                busy
            });
        for (peer, room, generation) in due {
            peer.send(&Message::AbortAck { room, generation });
        }
    }
}
