//! The room table: room id → room, sharded so that lookups from the scheduler, the
//! workers and the control thread rarely meet on one lock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use super::{Room, State};
use crate::config::Role;
use crate::error::Result;

const SHARDS: usize = 64;

/// A multiplicative hash for router-chosen u64 ids. Rooms are created only by the local
/// scheduler, so ids are not attacker-controlled.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        let h = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
}

type Shard<T> = RwLock<HashMap<u64, Arc<Room<T>>, BuildHasherDefault<IdHasher>>>;

/// Every room of one engine, by id.
pub struct RoomTable<T = ()> {
    shards: Box<[Shard<T>]>,
    /// The next generation to hand out. Relaxed: uniqueness needs only atomicity.
    next_generation: AtomicU64,
}

impl<T> Default for RoomTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> RoomTable<T> {
    /// An empty table.
    pub fn new() -> Self {
        RoomTable {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            next_generation: AtomicU64::new(1),
        }
    }

    fn shard(&self, id: u64) -> &Shard<T> {
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        &self.shards[(h >> 58) as usize % SHARDS]
    }

    /// Creates room `id` in `Bootstrapping` with a fresh generation. An id that is
    /// present (live, or terminal and not yet cleared) is refused.
    pub fn create(&self, id: u64, role: Role, deadline_ms: u64, ext: T) -> Result<Arc<Room<T>>> {
        let mut shard = self.shard(id).write();
        if let Some(existing) = shard.get(&id) {
            let state = existing.state();
            return Err(if state.is_terminal() {
                crate::err!(
                    AlreadyExists,
                    "room {id} already exists ({state}); clear it before reusing the id"
                )
            } else {
                crate::err!(AlreadyExists, "room {id} is already live ({state})")
            });
        }
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let room = Arc::new(Room::new(id, generation, role, deadline_ms, ext));
        shard.insert(id, room.clone());
        Ok(room)
    }

    /// The room with `id`, if present.
    pub fn get(&self, id: u64) -> Option<Arc<Room<T>>> {
        self.shard(id).read().get(&id).cloned()
    }

    /// The room with `id` only if it still has `generation` (a message for an earlier
    /// use of the id gets `None`).
    pub fn get_generation(&self, id: u64, generation: u64) -> Option<Arc<Room<T>>> {
        self.get(id).filter(|r| r.generation() == generation)
    }

    /// The state of room `id`, without cloning anything: a shard read lock and one
    /// atomic load.
    pub fn state(&self, id: u64) -> Option<State> {
        self.shard(id).read().get(&id).map(|r| r.state())
    }

    /// Removes room `id`, returning it.
    pub fn remove(&self, id: u64) -> Option<Arc<Room<T>>> {
        self.shard(id).write().remove(&id)
    }

    /// Removes room `id` only if it still has `generation`.
    pub fn remove_generation(&self, id: u64, generation: u64) -> Option<Arc<Room<T>>> {
        let mut shard = self.shard(id).write();
        if shard.get(&id).map(|r| r.generation()) == Some(generation) {
            shard.remove(&id)
        } else {
            None
        }
    }

    /// A snapshot of every room (for the watchdog, metrics and shutdown).
    pub fn snapshot(&self) -> Vec<Arc<Room<T>>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            out.extend(shard.read().values().cloned());
        }
        out
    }

    /// How many rooms the table holds.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// Whether the table holds no room.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use crate::room::{Cause, Event, FailureReason, NO_DEADLINE};

    #[test]
    fn a_present_id_cannot_be_created_again() {
        let t = RoomTable::<()>::new();
        t.create(5, Role::Prefill, NO_DEADLINE, ()).unwrap();
        let e = t.create(5, Role::Prefill, NO_DEADLINE, ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        assert!(e.message().contains("room 5"), "{}", e.message());
        // Still refused once terminal, until cleared.
        t.get(5)
            .unwrap()
            .fail(FailureReason::local(Cause::Aborted, "x"));
        assert_eq!(
            t.create(5, Role::Prefill, NO_DEADLINE, ())
                .unwrap_err()
                .kind(),
            ErrorKind::AlreadyExists
        );
        t.remove(5).unwrap();
        t.create(5, Role::Prefill, NO_DEADLINE, ()).unwrap();
    }

    #[test]
    fn generations_distinguish_uses_of_one_id() {
        let t = RoomTable::<()>::new();
        let g1 = t
            .create(9, Role::Decode, NO_DEADLINE, ())
            .unwrap()
            .generation();
        t.remove(9);
        let g2 = t
            .create(9, Role::Decode, NO_DEADLINE, ())
            .unwrap()
            .generation();
        assert_ne!(g1, g2);
        assert!(t.get_generation(9, g1).is_none());
        assert!(t.get_generation(9, g2).is_some());
        assert!(t.remove_generation(9, g1).is_none());
        assert!(t.remove_generation(9, g2).is_some());
        assert!(t.is_empty());
    }

    #[test]
    fn state_lookup_and_snapshot_see_every_room() {
        let t = RoomTable::<()>::new();
        for id in 0..1000u64 {
            t.create(id * 7919, Role::Decode, NO_DEADLINE, ()).unwrap();
        }
        assert_eq!(t.len(), 1000);
        assert_eq!(t.snapshot().len(), 1000);
        t.get(7919).unwrap().advance(Event::Ready).unwrap();
        assert_eq!(t.state(7919), Some(State::WaitingForInput));
        assert_eq!(t.state(1), None);
        for id in 0..1000u64 {
            assert!(t.remove(id * 7919).is_some());
        }
        assert!(t.is_empty());
    }
}
