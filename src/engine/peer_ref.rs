//! How the engine's pure decision code (the prefill's holding area, the decode room)
//! knows a peer: a handle compared by identity. The engine's handle is `Arc<Peer>`;
//! unit tests and the simulator use their own.

use std::sync::Arc;

use crate::control::Peer;

/// A peer handle, compared by identity (the engine's `Arc<Peer>`: the same allocation).
pub(crate) trait PeerRef: Clone {
    fn same(&self, other: &Self) -> bool;

    /// The engine behind the handle, where known (a decode engine's id from its
    /// `Hello`): the same engine over a new connection is a new handle, and its
    /// generations go on from where the old connection's stopped.
    fn engine(&self) -> Option<u64> {
        None
    }

    /// Whether the two handles are the same engine: by engine id where both know one,
    /// else by identity.
    fn same_engine(&self, other: &Self) -> bool {
        match (self.engine(), other.engine()) {
            (Some(a), Some(b)) => a == b,
            _ => self.same(other),
        }
    }
}

impl PeerRef for Arc<Peer> {
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }

    fn engine(&self) -> Option<u64> {
        self.engine_id
    }
}

/// A peer for unit tests: compared by its number.
#[cfg(test)]
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TestPeer(pub u32);

#[cfg(test)]
impl PeerRef for TestPeer {
    fn same(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
