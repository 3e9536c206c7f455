//! How the engine's pure decision code (the prefill's holding area, the decode room)
//! knows a peer: a handle compared by identity. The engine's handle is `Arc<Peer>`;
//! unit tests and the simulator use their own.

use std::sync::Arc;

use crate::control::Peer;

/// A peer handle, compared by identity (the engine's `Arc<Peer>`: the same allocation).
pub(crate) trait PeerRef: Clone {
    fn same(&self, other: &Self) -> bool;
}

impl PeerRef for Arc<Peer> {
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }
}
