//! The room table: room id → room, sharded so that lookups from the scheduler, the
//! workers and the control thread rarely meet on one lock.
//!
//! The rooms' state bytes live packed together in the table's [`Slab`] (the room's
//! [`StateWord`](super::StateWord) runs over its byte there, see [`SlotByte`]), and each
//! table entry records its room's slot. A poll is then a hash lookup and one byte in an
//! array of one byte per live room (100 KB for 100,000 rooms), instead of a trip to the
//! room object, which sits somewhere in a heap of tens of MB.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};

use super::state::AtomicByte;
use super::{Room, State};
use crate::config::Role;
use crate::error::Result;

const SHARDS: usize = 64;

/// State bytes per slab chunk.
const CHUNK: usize = 4096;
/// Chunks a table's slab may grow to (4 Mi live rooms); a room created beyond keeps its
/// state byte to itself and is polled through the room.
const MAX_CHUNKS: usize = 1024;
/// A table entry whose room has no slot in the slab.
const NO_SLOT: u32 = u32::MAX;

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

#[derive(Default)]
struct FreeSlots {
    /// Slots given back, reused last-in first-out so that live rooms stay packed.
    free: Vec<u32>,
    /// Slots below this were handed out at least once.
    next: u32,
}

/// The state bytes of a table's rooms: slot `s` is byte `s % CHUNK` of chunk `s / CHUNK`.
/// A chunk is never freed while the table or a room holds it, so a byte never moves.
struct Slab {
    chunks: Box<[OnceLock<Arc<[AtomicU8]>>]>,
    free: Arc<Mutex<FreeSlots>>,
}

impl Slab {
    fn new(max_chunks: usize) -> Self {
        Slab {
            chunks: (0..max_chunks).map(|_| OnceLock::new()).collect(),
            free: Arc::default(),
        }
    }

    /// A free slot (its chunk created on first use), or `None` when the slab is full.
    fn alloc(&self) -> Option<SlotByte> {
        let mut f = self.free.lock();
        let slot = match f.free.pop() {
            Some(s) => s,
            None if (f.next as usize) < CHUNK * self.chunks.len() => {
                f.next += 1;
                f.next - 1
            }
            None => return None,
        };
        let chunk = self.chunks[slot as usize / CHUNK]
            .get_or_init(|| (0..CHUNK).map(|_| AtomicU8::new(0)).collect());
        Some(SlotByte {
            chunk: chunk.clone(),
            at: slot as usize % CHUNK,
            slot,
            free: Some(self.free.clone()),
        })
    }

    /// The byte of `slot`, if the slab has it.
    fn byte(&self, slot: u32) -> Option<&AtomicU8> {
        let chunk = self.chunks.get(slot as usize / CHUNK)?.get()?;
        Some(&chunk[slot as usize % CHUNK])
    }
}

thread_local! {
    /// The slot [`RoomTable::create`] reserved for the room it is constructing, taken by
    /// that room's [`SlotByte::new`]. (`StateWord` builds its atomic byte from a value
    /// only, so this is how the table hands the byte it chose to the room's word.)
    static RESERVED: Cell<Option<SlotByte>> = const { Cell::new(None) };
}

/// A room's state byte, in its table's slab (or, for a room built outside a table or
/// beyond the slab, in a chunk of its own). The room's [`StateWord`](super::StateWord)
/// runs over it, so the slab byte *is* the state: there is no copy to keep in step. The
/// slot goes back to the table when the room is dropped, that is once nothing can load
/// or change its state any more, so a slot never serves two rooms at once.
pub struct SlotByte {
    chunk: Arc<[AtomicU8]>,
    /// The byte's index in `chunk`.
    at: usize,
    /// The slot number in the table's slab.
    slot: u32,
    /// Where the slot goes back (`None` for a byte of the room's own).
    free: Option<Arc<Mutex<FreeSlots>>>,
}

impl SlotByte {
    fn own() -> Self {
        SlotByte {
            chunk: Arc::new([AtomicU8::new(0)]),
            at: 0,
            slot: NO_SLOT,
            free: None,
        }
    }

    fn byte(&self) -> &AtomicU8 {
        &self.chunk[self.at]
    }
}

impl Drop for SlotByte {
    fn drop(&mut self) {
        if let Some(free) = &self.free {
            free.lock().free.push(self.slot);
        }
    }
}

impl fmt::Debug for SlotByte {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotByte")
            .field("slot", &self.slot)
            .field("value", &self.byte().load(Ordering::Relaxed))
            .finish()
    }
}

impl AtomicByte for SlotByte {
    /// The slot the table reserved on this thread for the room being built, else a byte
    /// of the room's own; holding `v`. Relaxed: the room reaches other threads only
    /// through the table's lock or an `Arc`, which publish this store.
    fn new(v: u8) -> Self {
        let s = RESERVED.with(Cell::take).unwrap_or_else(SlotByte::own);
        s.byte().store(v, Ordering::Relaxed);
        s
    }
    fn load(&self, order: Ordering) -> u8 {
        self.byte().load(order)
    }
    fn compare_exchange_weak(
        &self,
        current: u8,
        new: u8,
        success: Ordering,
        failure: Ordering,
    ) -> std::result::Result<u8, u8> {
        self.byte()
            .compare_exchange_weak(current, new, success, failure)
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// One shard's rooms, and apart from them each room's slot (or [`NO_SLOT`]): a poll reads
/// only `slots`, whose 16-byte entries keep the part of the table it touches small.
struct Maps<T> {
    rooms: IdMap<Arc<Room<T>>>,
    slots: IdMap<u32>,
}

impl<T> Default for Maps<T> {
    fn default() -> Self {
        Maps {
            rooms: IdMap::default(),
            slots: IdMap::default(),
        }
    }
}

type Shard<T> = RwLock<Maps<T>>;

/// Every room of one engine, by id.
pub struct RoomTable<T = ()> {
    shards: Box<[Shard<T>]>,
    /// The rooms' state bytes.
    slab: Slab,
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
        Self::with_slab_chunks(MAX_CHUNKS)
    }

    fn with_slab_chunks(max_chunks: usize) -> Self {
        RoomTable {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            slab: Slab::new(max_chunks),
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
        if let Some(existing) = shard.rooms.get(&id) {
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
        let reserved = self.slab.alloc();
        let slot = reserved.as_ref().map_or(NO_SLOT, |s| s.slot);
        RESERVED.with(|r| r.set(reserved));
        let room = Arc::new(Room::new(id, generation, role, deadline_ms, ext));
        // `Room::new` took the slot; should it not have, the slot goes back here.
        let left = RESERVED.with(Cell::take);
        debug_assert!(left.is_none(), "the room did not take its reserved slot");
        let slot = if left.is_some() { NO_SLOT } else { slot };
        shard.rooms.insert(id, room.clone());
        shard.slots.insert(id, slot);
        Ok(room)
    }

    /// The room with `id`, if present.
    pub fn get(&self, id: u64) -> Option<Arc<Room<T>>> {
        self.shard(id).read().rooms.get(&id).cloned()
    }

    /// The room with `id` only if it still has `generation` (a message for an earlier
    /// use of the id gets `None`).
    pub fn get_generation(&self, id: u64, generation: u64) -> Option<Arc<Room<T>>> {
        self.get(id).filter(|r| r.generation() == generation)
    }

    /// The state of room `id`, without cloning anything or touching the room: a shard
    /// read lock, the entry, and its byte in the slab (the same atomic load as
    /// [`Room::state`], on the same byte).
    pub fn state(&self, id: u64) -> Option<State> {
        let shard = self.shard(id).read();
        let slot = *shard.slots.get(&id)?;
        Some(match self.slab.byte(slot) {
            // SeqCst as in `StateWord::load` (a plain load on x86).
            Some(b) => State::from_u8(b.load(Ordering::SeqCst))
                .expect("a state byte holds only what StateWord wrote"),
            None => shard.rooms.get(&id)?.state(),
        })
    }

    /// Removes room `id`, returning it.
    pub fn remove(&self, id: u64) -> Option<Arc<Room<T>>> {
        let mut shard = self.shard(id).write();
        shard.slots.remove(&id);
        shard.rooms.remove(&id)
    }

    /// Removes room `id` only if it still has `generation`.
    pub fn remove_generation(&self, id: u64, generation: u64) -> Option<Arc<Room<T>>> {
        let mut shard = self.shard(id).write();
        if shard.rooms.get(&id).map(|r| r.generation()) == Some(generation) {
            shard.slots.remove(&id);
            shard.rooms.remove(&id)
        } else {
            None
        }
    }

    /// A snapshot of every room (for the watchdog, metrics and shutdown).
    pub fn snapshot(&self) -> Vec<Arc<Room<T>>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            out.extend(shard.read().rooms.values().cloned());
        }
        out
    }

    /// How many rooms the table holds.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().rooms.len()).sum()
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

    fn slot_of(t: &RoomTable<()>, id: u64) -> u32 {
        *t.shard(id).read().slots.get(&id).unwrap()
    }

    #[test]
    fn a_poll_reads_the_very_byte_the_room_changes() {
        let t = RoomTable::<()>::new();
        let r = t.create(3, Role::Decode, NO_DEADLINE, ()).unwrap();
        assert_ne!(slot_of(&t, 3), NO_SLOT);
        assert_eq!(t.state(3), Some(State::Bootstrapping));
        r.advance(Event::Ready).unwrap();
        assert_eq!(t.state(3), Some(State::WaitingForInput));
        r.fail(FailureReason::local(Cause::Aborted, "x"));
        assert_eq!(t.state(3), Some(State::Failed));
        // Sticky through the slab too.
        assert!(r.advance(Event::Start).is_err());
        assert_eq!(t.state(3), Some(State::Failed));
    }

    #[test]
    fn a_slot_serves_a_new_room_only_once_the_old_room_is_gone() {
        let t = RoomTable::<()>::new();
        let a = t.create(1, Role::Decode, NO_DEADLINE, ()).unwrap();
        let slot_a = slot_of(&t, 1);
        t.remove(1).unwrap();
        // `a` is still held (as a worker would): its slot is not handed out again.
        let b = t.create(2, Role::Decode, NO_DEADLINE, ()).unwrap();
        assert_ne!(slot_of(&t, 2), slot_a);
        b.advance(Event::Ready).unwrap();
        a.fail(FailureReason::local(Cause::Aborted, "late"));
        assert_eq!(t.state(2), Some(State::WaitingForInput));
        assert_eq!(b.state(), State::WaitingForInput);
        drop(a);
        // Now it is, to the next room, which starts from its own initial state.
        let c = t.create(3, Role::Decode, NO_DEADLINE, ()).unwrap();
        assert_eq!(slot_of(&t, 3), slot_a);
        assert_eq!(c.state(), State::Bootstrapping);
        assert_eq!(t.state(3), Some(State::Bootstrapping));
        assert_eq!(t.state(2), Some(State::WaitingForInput));
    }

    #[test]
    fn rooms_beyond_a_full_slab_keep_their_own_byte() {
        let t = RoomTable::<()>::with_slab_chunks(1);
        let n = CHUNK as u64 + 3;
        let rooms: Vec<_> = (0..n)
            .map(|id| t.create(id, Role::Decode, NO_DEADLINE, ()).unwrap())
            .collect();
        assert_eq!(slot_of(&t, n - 1), NO_SLOT);
        rooms[n as usize - 1].advance(Event::Ready).unwrap();
        assert_eq!(t.state(n - 1), Some(State::WaitingForInput));
        assert_eq!(t.state(n - 2), Some(State::Bootstrapping));
        // A slot given back goes to the next room.
        t.remove(0);
        drop(rooms);
        t.create(n, Role::Decode, NO_DEADLINE, ()).unwrap();
        assert_ne!(slot_of(&t, n), NO_SLOT);
        assert_eq!(t.state(n), Some(State::Bootstrapping));
    }

    #[test]
    fn rooms_fill_the_slab_densely_and_outlive_their_table() {
        let t = RoomTable::<()>::new();
        let n = 3 * CHUNK as u64 + 5;
        let rooms: Vec<_> = (0..n)
            .map(|id| t.create(id, Role::Prefill, NO_DEADLINE, ()).unwrap())
            .collect();
        let mut slots: Vec<u32> = (0..n).map(|id| slot_of(&t, id)).collect();
        slots.sort_unstable();
        assert_eq!(slots, (0..n as u32).collect::<Vec<_>>());
        for (i, r) in rooms.iter().enumerate() {
            if i % 3 == 0 {
                r.advance(Event::Ready).unwrap();
            }
        }
        for id in 0..n {
            let want = if id % 3 == 0 {
                State::WaitingForInput
            } else {
                State::Bootstrapping
            };
            assert_eq!(t.state(id), Some(want));
        }
        drop(t);
        rooms[1].advance(Event::Ready).unwrap();
        assert_eq!(rooms[1].state(), State::WaitingForInput);
        assert_eq!(rooms[0].state(), State::WaitingForInput);
    }
}
