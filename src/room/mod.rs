//! Rooms: one per request, identified by the router's 64-bit id plus a generation this
//! engine assigns at creation.
//!
//! Who may change a room's state: only [`Room::advance`], [`Room::fail`] and
//! [`Room::fail_in`], all of which go through [`StateWord`] and therefore through the one
//! rule in [`state::transition`].

pub mod state;
mod table;

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

pub use state::{Event, Refusal, State, StateWord};
pub use table::RoomTable;
use table::SlotByte;

use crate::config::Role;

/// The class of a failure, for metrics and for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// Aborted by a scheduler (this side's, or the peer's when `from_peer`).
    Aborted,
    /// The peer engine stopped answering or its connection broke.
    PeerLost,
    /// The bootstrap deadline passed.
    BootstrapTimeout,
    /// The waiting-for-input deadline passed.
    WaitingTimeout,
    /// No transfer progress within the transfer deadline.
    TransferTimeout,
    /// The peer sent something invalid.
    Protocol,
    /// The two sides disagree (page counts, buffer layout).
    Mismatch,
    /// Moving the bytes failed.
    Transfer,
    /// The engine was shut down with the room live.
    Shutdown,
    /// An internal error (a caught panic).
    Internal,
    /// A data run's digest did not match the bytes where it landed (`integrity=verify`).
    Integrity,
}

impl Cause {
    /// All causes, in their numeric order.
    pub const ALL: [Cause; 11] = [
        Cause::Aborted,
        Cause::PeerLost,
        Cause::BootstrapTimeout,
        Cause::WaitingTimeout,
        Cause::TransferTimeout,
        Cause::Protocol,
        Cause::Mismatch,
        Cause::Transfer,
        Cause::Shutdown,
        Cause::Internal,
        Cause::Integrity,
    ];

    /// A short snake_case name (used in metrics labels).
    pub fn name(self) -> &'static str {
        match self {
            Cause::Aborted => "aborted",
            Cause::PeerLost => "peer_lost",
            Cause::BootstrapTimeout => "bootstrap_timeout",
            Cause::WaitingTimeout => "waiting_timeout",
            Cause::TransferTimeout => "transfer_timeout",
            Cause::Protocol => "protocol",
            Cause::Mismatch => "mismatch",
            Cause::Transfer => "transfer",
            Cause::Shutdown => "shutdown",
            Cause::Internal => "internal",
            Cause::Integrity => "integrity",
        }
    }
}

/// Why a room failed: the first reason recorded wins and is never overwritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureReason {
    /// The class of failure.
    pub cause: Cause,
    /// Whether the reason came from the peer engine.
    pub from_peer: bool,
    /// Human-readable text naming the room, the peer or the deadline as applicable.
    pub message: String,
}

impl FailureReason {
    /// A reason raised on this side.
    pub fn local(cause: Cause, message: impl Into<String>) -> Self {
        FailureReason {
            cause,
            from_peer: false,
            message: message.into(),
        }
    }

    /// A reason reported by the peer. Its text is kept without the `"peer: "` prefixes
    /// it may have gathered on its way through other engines: a reason that crossed
    /// several engines reads with one.
    pub fn peer(cause: Cause, message: impl Into<String>) -> Self {
        let mut message = message.into();
        let bare = message.trim_start_matches(PEER_PREFIX);
        if bare.len() != message.len() {
            message = bare.to_string();
        }
        FailureReason {
            cause,
            from_peer: true,
            message,
        }
    }
}

/// What the text of a reason that came from a peer starts with.
const PEER_PREFIX: &str = "peer: ";

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.from_peer {
            write!(f, "{PEER_PREFIX}{}", self.message)
        } else {
            f.write_str(&self.message)
        }
    }
}

/// A transport operation on a room's memory; counted out when dropped.
#[derive(Debug)]
pub struct IoGuard<'a>(&'a AtomicU32);

impl Drop for IoGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A transport operation on a room's memory that outlives the call that began it (a
/// same-host copy answered later, on another thread); counted out when dropped.
#[derive(Debug)]
pub struct HeldIo<T>(Arc<Room<T>>);

impl<T> Drop for HeldIo<T> {
    fn drop(&mut self) {
        self.0.io.fetch_sub(1, Ordering::SeqCst);
    }
}

/// No deadline armed.
pub const NO_DEADLINE: u64 = u64::MAX;

/// One request's state on this engine, with the engine's own per-room data `T`.
#[derive(Debug)]
pub struct Room<T = ()> {
    id: u64,
    generation: u64,
    role: Role,
    /// In the table's slab of state bytes (see [`SlotByte`]), where polls read it.
    state: StateWord<SlotByte>,
    /// Set once, by the `fail` call whose compare-and-swap made the room `Failed`, right
    /// after it; read only once the state is `Failed` (see [`Room::failure`]).
    reason: OnceLock<FailureReason>,
    /// Engine-clock milliseconds after which the watchdog fails the room; `NO_DEADLINE`
    /// when none. Relaxed: the watchdog re-checks the state before acting, and a stale
    /// value only delays or advances a check by one scan.
    deadline_ms: AtomicU64,
    /// Transport operations on the room's memory in progress (decode: writes into its
    /// pages; prefill: reads of its source pages). SeqCst, like the state word: an
    /// operation counts itself in and then re-checks the state, and "drained" makes the
    /// state terminal and then reads this, so drained is never true while an operation
    /// that saw the room live can still touch its memory.
    io: AtomicU32,
    /// The engine's per-room data (destinations, progress); never the state.
    pub ext: T,
}

/// The drain rule: a room in `state` with `io` transport operations on its memory in
/// flight is drained (its pages may be reused) once it is terminal and none is left.
/// [`Room::drained`] applies it; the simulator (`src/engine/sim/`) applies it to its rooms
/// and checks that no write reads a source page given back by it.
pub(crate) fn drained(state: State, io: u32) -> bool {
    state.is_terminal() && io == 0
}

impl<T> Room<T> {
    /// A new room in `Bootstrapping`.
    pub fn new(id: u64, generation: u64, role: Role, deadline_ms: u64, ext: T) -> Self {
        Room {
            id,
            generation,
            role,
            state: StateWord::with_atomic(State::Bootstrapping),
            reason: OnceLock::new(),
            deadline_ms: AtomicU64::new(deadline_ms),
            io: AtomicU32::new(0),
            ext,
        }
    }

    /// The router's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The generation this engine gave the room at creation (unique per engine).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The engine role the room belongs to.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The current state: one atomic load.
    pub fn state(&self) -> State {
        self.state.load()
    }

    /// Applies a non-failure event. Use [`Room::fail`] to fail.
    pub fn advance(&self, event: Event) -> Result<(State, State), Refusal> {
        debug_assert!(event != Event::Fail, "use Room::fail");
        self.state.apply(event)
    }

    /// Makes the room `Failed` with `reason` unless it is already terminal. Returns the
    /// state it left when this call did the transition, `None` when it was terminal.
    ///
    /// The reason recorded is the one of the call whose compare-and-swap won, so the
    /// reason the ABI reports, the cause counted and the message sent to the peers are
    /// always those of the same call.
    pub fn fail(&self, reason: FailureReason) -> Option<State> {
        self.fail_with(reason, None)
    }

    /// As [`Room::fail`], but only while the room is still in `state` (the state a
    /// deadline was read for): `None` once it has moved on or is terminal.
    pub fn fail_in(&self, state: State, reason: FailureReason) -> Option<State> {
        self.fail_with(reason, Some(state))
    }

    fn fail_with(&self, reason: FailureReason, only_in: Option<State>) -> Option<State> {
        let won = match only_in {
            Some(s) => self.state.apply_in(s, Event::Fail),
            None => self.state.apply(Event::Fail),
        };
        let (from, _) = won.ok()?;
        // Only the winner of the transition gets here, once.
        let recorded = self.reason.set(reason);
        debug_assert!(recorded.is_ok(), "a room failed twice");
        Some(from)
    }

    /// The recorded reason, only if the room is `Failed`.
    ///
    /// The winning `fail` records its reason right after its compare-and-swap, with no
    /// I/O or allocation between the two, so a reader that sees `Failed` first waits
    /// out those few instructions.
    pub fn failure(&self) -> Option<&FailureReason> {
        if self.state() != State::Failed {
            return None;
        }
        let mut spins = 0u32;
        loop {
            if let Some(r) = self.reason.get() {
                return Some(r);
            }
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            spins = spins.saturating_add(1);
        }
    }

    /// The armed deadline in engine-clock ms, or [`NO_DEADLINE`].
    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms.load(Ordering::Relaxed)
    }

    /// Counts a transport operation on the room's memory in until the guard drops. The
    /// caller must check the room is live after this and before touching the memory.
    pub fn begin_io(&self) -> IoGuard<'_> {
        self.io.fetch_add(1, Ordering::SeqCst);
        IoGuard(&self.io)
    }

    /// As [`begin_io`](Self::begin_io), with a guard that owns a reference to the room.
    pub fn hold_io(self: &Arc<Self>) -> HeldIo<T> {
        self.io.fetch_add(1, Ordering::SeqCst);
        HeldIo(self.clone())
    }

    /// Whether the room is terminal and no transport operation can still touch its
    /// memory: its pages may be reused.
    pub fn drained(&self) -> bool {
        drained(self.state(), self.io.load(Ordering::SeqCst))
    }

    /// Transport operations on the room's memory in progress.
    pub fn io_in_flight(&self) -> u32 {
        self.io.load(Ordering::SeqCst)
    }

    /// Arms (or re-arms, on progress) the deadline.
    pub fn set_deadline_ms(&self, at: u64) {
        self.deadline_ms.store(at, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room() -> Room {
        Room::new(7, 1, Role::Decode, NO_DEADLINE, ())
    }

    #[test]
    fn the_first_failure_reason_is_kept() {
        let r = room();
        assert_eq!(
            r.fail(FailureReason::local(Cause::Aborted, "first")),
            Some(State::Bootstrapping)
        );
        assert_eq!(r.fail(FailureReason::peer(Cause::PeerLost, "second")), None);
        let why = r.failure().unwrap();
        assert_eq!(why.message, "first");
        assert_eq!(why.cause, Cause::Aborted);
        assert!(!why.from_peer);
    }

    #[test]
    fn a_succeeded_room_has_no_failure_and_cannot_fail() {
        let r = room();
        r.advance(Event::Ready).unwrap();
        r.advance(Event::Complete).unwrap();
        assert_eq!(r.fail(FailureReason::local(Cause::Aborted, "late")), None);
        assert_eq!(r.state(), State::Success);
        assert!(r.failure().is_none());
    }

    #[test]
    fn the_peer_flag_is_reported() {
        let r = room();
        r.fail(FailureReason::peer(Cause::Aborted, "client went away"));
        let why = r.failure().unwrap();
        assert!(why.from_peer);
        assert_eq!(why.to_string(), "peer: client went away");
    }

    /// A reason relayed through several engines (a decode room aborted by one prefill
    /// rank tells the others, which tell theirs) reads with one origin prefix.
    #[test]
    fn a_relayed_reason_reads_with_one_peer_prefix() {
        let why = FailureReason::peer(Cause::Aborted, "peer: peer: room 8000 aborted: gone");
        assert_eq!(why.message, "room 8000 aborted: gone");
        assert_eq!(why.to_string(), "peer: room 8000 aborted: gone");
        let again = FailureReason::peer(Cause::Aborted, why.to_string());
        assert_eq!(again.to_string(), why.to_string());
        // Only a leading prefix is the relay's.
        let inner = FailureReason::peer(Cause::Aborted, "prefill room 3 failed: peer: x");
        assert_eq!(inner.message, "prefill room 3 failed: peer: x");
    }

    /// The reason kept is the one of the `fail` call that won the transition, not of a
    /// call that lost it (that would report one cause through the ABI while the engine
    /// counted, logged and told the peer another).
    #[test]
    fn the_reason_kept_is_the_one_of_the_call_that_failed_the_room() {
        use std::sync::Arc;
        for _ in 0..2000 {
            let r = Arc::new(room());
            let hs: Vec<_> = (0..4)
                .map(|i| {
                    let r = r.clone();
                    std::thread::spawn(move || {
                        let won = r
                            .fail(FailureReason::local(Cause::Aborted, format!("t{i}")))
                            .is_some();
                        (i, won)
                    })
                })
                .collect();
            let winners: Vec<usize> = hs
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&(_, won)| won)
                .map(|(i, _)| i)
                .collect();
            assert_eq!(winners.len(), 1, "exactly one call fails the room");
            assert_eq!(r.failure().unwrap().message, format!("t{}", winners[0]));
        }
    }

    #[test]
    fn a_failed_room_always_has_its_reason_under_races() {
        use std::sync::Arc;
        for _ in 0..500 {
            let r = Arc::new(room());
            r.advance(Event::Ready).unwrap();
            let hs: Vec<_> = (0..4)
                .map(|i| {
                    let r = r.clone();
                    std::thread::spawn(move || {
                        if i == 0 {
                            let _ = r.advance(Event::Complete);
                        } else {
                            r.fail(FailureReason::local(Cause::Aborted, format!("t{i}")));
                        }
                        if r.state() == State::Failed {
                            assert!(r.failure().is_some());
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            match r.state() {
                State::Failed => assert!(r.failure().unwrap().message.starts_with('t')),
                State::Success => assert!(r.failure().is_none()),
                s => panic!("not terminal: {s}"),
            }
        }
    }
}
