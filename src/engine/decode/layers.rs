//! How many of a decode room's layers have landed whole (`kvxfer_room_layers_landed`),
//! for a decode server that starts work on a layer as soon as its KV is in place.
//!
//! A layer is the layer id its kv buffers were registered with, or without ids a
//! buffer's position. A layer has landed when each of its buffers holds every byte the
//! room's prefill engines owe it for the whole destination: whole pages (a byte copy),
//! or the heads each sends of every token moved (head slices; with page sizes that
//! differ, the tokens moved are known once the peer's Done arrived). The count is of the
//! layers landed in order from the first: layers 0 .. n have all landed.

use super::room::Landed;
use super::{DRoom, DecodeEngine};
use crate::control::Peer;
use crate::error::Result;
use crate::room::State;
use std::sync::Arc;

impl DecodeEngine {
    /// The number of the room's first layers (in layer order) whose every byte landed.
    pub fn layers_landed(&self, id: u64) -> Result<u32> {
        let room = self.core.room(id)?;
        let Some(kv) = self.core.node.memory.kv.get() else {
            return Ok(0);
        };
        let n = kv.buffers().len();
        let mut layers: Vec<u32> = (0..n).map(|b| kv.layer(b).unwrap_or(b as u32)).collect();
        layers.sort_unstable();
        layers.dedup();
        if room.state() == State::Success {
            return Ok(layers.len() as u32);
        }
        let landed = room.ext.landed();
        let whole = |b: usize| buffer_landed(&room, &landed, b, kv.item_len(b).unwrap_or(0) as u64);
        let count = layers
            .iter()
            .take_while(|&&l| {
                (0..n)
                    .filter(|&b| kv.layer(b).unwrap_or(b as u32) == l)
                    .all(whole)
            })
            .count();
        Ok(count as u32)
    }
}

/// Whether our buffer `b` (pages of `item_len` bytes) holds every byte the room's peers
/// owe it.
fn buffer_landed(room: &Arc<DRoom>, landed: &Landed, b: usize, item_len: u64) -> bool {
    let Some(dest_pages) = landed.dest_pages else {
        return false;
    };
    let mut owed = 0u64;
    for (peer, claim) in room.ext.peers.iter().zip(&landed.claims) {
        let Some(per) = owed_per_buffer(peer, *claim, dest_pages, item_len) else {
            return false;
        };
        let times = peer
            .kv_map
            .get()
            .map_or(0, |m| m.iter().filter(|&&x| x as usize == b).count());
        owed += per * times as u64;
    }
    owed > 0 && landed.per_buffer.get(b).copied().unwrap_or(0) >= owed
}

/// The bytes `peer` owes each of our buffers it fills, or `None` while that is not known
/// (head slices between page sizes that differ, before the peer's Done).
fn owed_per_buffer(peer: &Peer, claim: Option<u32>, dest_pages: u64, item_len: u64) -> Option<u64> {
    match peer.slicing.get() {
        None => Some(dest_pages * item_len),
        Some(s) => {
            let tokens = match claim {
                Some(src_pages) => s.room_tokens(u64::from(src_pages), dest_pages).ok()?,
                None if s.prefill.page_tokens == s.decode.page_tokens => {
                    dest_pages * u64::from(s.decode.page_tokens)
                }
                None => return None,
            };
            Some(s.owed(tokens))
        }
    }
}
