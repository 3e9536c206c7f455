//! The live engine's [`Shell`]: its room table, the lifecycle's transitions, the peers'
//! control connections, the registered memory (what a peer owes) and the metrics.

use std::sync::Arc;

use super::Shell;
use crate::control::Peer;
use crate::engine::decode::room::{DecodeRoom, Facts, Settle};
use crate::engine::decode::{DRoom, DecodeEngine};
use crate::engine::lifecycle;
use crate::proto::Message;
use crate::room::FailureReason;

/// The engine, lent to one routing call.
pub(in crate::engine::decode) struct Live<'a>(pub &'a DecodeEngine);

impl Shell for Live<'_> {
    type Peer = Arc<Peer>;
    type Room = Arc<DRoom>;

    fn room(&mut self, id: u64, generation: u64) -> Option<Arc<DRoom>> {
        self.0.core.rooms.get_generation(id, generation)
    }

    fn find(&mut self, id: u64, generation: u64) -> Option<Arc<DRoom>> {
        self.0.core.find_room(id, generation)
    }

    fn id(&self, room: &Arc<DRoom>) -> u64 {
        room.id()
    }

    fn core<'r>(&self, room: &'r Arc<DRoom>) -> &'r DecodeRoom<Arc<Peer>> {
        &room.ext
    }

    /// A peer owes, for `pages_sent` source pages into a destination of `dest_pages`: its
    /// heads of the tokens they hold where it sends a slice, else every byte of those
    /// pages in each of its buffers (a byte copy needs as many pages on both sides).
    fn settle(&mut self, room: &Arc<DRoom>, idx: usize) -> Settle {
        let node = &self.0.core.node;
        let ordered = node.rdma.is_some();
        let kv = node.memory.kv.get();
        let owed = |peer: &Arc<Peer>, pages_sent: u32, dest_pages: u64| {
            let map = peer.kv_map.get().map_or(&[][..], |m| &m[..]);
            match peer.slicing.get() {
                Some(s) => s
                    .room_tokens(u64::from(pages_sent), dest_pages)
                    .map(|tokens| s.owed(tokens) * map.len() as u64),
                None if u64::from(pages_sent) != dest_pages => Err(format!(
                    "sent {pages_sent} pages for a destination of {dest_pages}"
                )),
                None => Ok(map
                    .iter()
                    .map(|&b| kv.and_then(|m| m.item_len(b as usize)).unwrap_or(0) as u64)
                    .sum::<u64>()
                    * dest_pages),
            }
        };
        room.ext.settle(idx, ordered, Facts::of, owed)
    }

    fn fail_room(&mut self, room: &Arc<DRoom>, reason: FailureReason, origin: Option<&Arc<Peer>>) {
        lifecycle::fail(self.0, room, reason, origin);
    }

    fn complete(&mut self, room: &Arc<DRoom>) {
        lifecycle::complete(self.0, room);
    }

    fn send_abort(&mut self, peer: &Arc<Peer>, id: u64, generation: u64, why: &str) {
        let limits = &self.0.core.node.limits;
        peer.send(&Message::abort(id, generation, why, limits));
    }

    fn unknown_room(&mut self) {
        self.0.core.unknown_room();
    }
}
