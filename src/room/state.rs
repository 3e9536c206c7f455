//! The room state machine: states, events, the one pure transition rule, and the atomic
//! state word that applies it.
//!
//! This file is the answer to "who may change a room's state": nothing writes a room's
//! state except [`StateWord::apply`], and `apply` only ever installs what [`transition`]
//! returns, in one compare-and-swap that re-checks the state it read. A terminal state is
//! never left because `transition` refuses every event on one.
//!
//! The word's atomic byte is a type parameter ([`AtomicByte`], `std`'s [`AtomicU8`] by
//! default) so that the model checker in `loom/tests/loom_room.rs` runs this very `apply`
//! over loom's atomics. (A `cfg(loom)` switch inside the library cannot do that: loom is
//! a dev-dependency, which the library is not compiled against for integration tests.)
//! That checker's crate compiles this file alone (`#[path]`), so the file uses nothing
//! of the library but `std`.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

/// A room's state. The numeric values are kept from the reference design so that hosts
/// can MIN-reduce a poll across tensor-parallel ranks (`FAILED` is the smallest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum State {
    /// Terminal: the transfer did not happen; a [`FailureReason`](super::FailureReason) says why.
    Failed = 0,
    /// Connections, registration exchange or destination info are being set up.
    Bootstrapping = 1,
    /// Ready: prefill has every destination, decode has its peers.
    WaitingForInput = 2,
    /// Data is moving.
    Transferring = 3,
    /// Terminal: every byte arrived and every side reported done.
    Success = 4,
}

impl State {
    /// Whether the state is `Success` or `Failed`.
    pub fn is_terminal(self) -> bool {
        matches!(self, State::Success | State::Failed)
    }

    /// The state for a raw value, if it names one.
    pub fn from_u8(v: u8) -> Option<State> {
        Some(match v {
            0 => State::Failed,
            1 => State::Bootstrapping,
            2 => State::WaitingForInput,
            3 => State::Transferring,
            4 => State::Success,
            _ => return None,
        })
    }

    /// A short lower-case name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            State::Failed => "failed",
            State::Bootstrapping => "bootstrapping",
            State::WaitingForInput => "waiting_for_input",
            State::Transferring => "transferring",
            State::Success => "success",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Something that happens to a room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// Bootstrap finished (prefill: every destination arrived; decode: peers ready).
    Ready,
    /// A chunk starts moving. Repeating it while transferring is a no-op.
    Start,
    /// Every byte delivered and every side done (an empty transfer may complete straight
    /// from `WaitingForInput`).
    Complete,
    /// Abort, error, lost peer or deadline.
    Fail,
}

/// Why [`transition`] refused an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The room is already terminal; terminal states are sticky.
    Terminal(State),
    /// The event makes no sense in this live state (for example `Complete` while
    /// bootstrapping).
    NotAllowed {
        /// The state the room was in.
        from: State,
        /// The event that was refused.
        event: Event,
    },
    /// The event was meant for one state ([`StateWord::apply_in`]) and the room is in
    /// another by now.
    Moved(State),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Terminal(s) => write!(f, "room is already {s}"),
            Refusal::NotAllowed { from, event } => {
                write!(f, "event {event:?} is not allowed while {from}")
            }
            Refusal::Moved(s) => write!(f, "room is {s} by now"),
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Test-only: the reference design's rule instead of [`transition`]'s, so that the
    /// simulator can show it finds it (`engine::bugs::Bug::MaxRule`).
    pub(crate) static MAX_RULE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The reference design's rule: a failure written outright, every other update the
/// larger of the old state and the new, over an enum where `Failed = 0`; so a late
/// "transferring" resurrects a failed room.
#[cfg(test)]
fn max_rule(from: State, event: Event) -> State {
    let to = match event {
        Event::Fail => return State::Failed,
        Event::Ready => State::WaitingForInput,
        Event::Start => State::Transferring,
        Event::Complete => State::Success,
    };
    if to as u8 > from as u8 {
        to
    } else {
        from
    }
}

/// The transition rule: the new state for `event` in state `from`, or why not.
///
/// Pure and total. Every terminal state refuses every event, so a terminal state, once
/// installed, is never replaced; nothing here depends on the numeric order of states.
pub fn transition(from: State, event: Event) -> Result<State, Refusal> {
    use Event::*;
    use State::*;
    #[cfg(test)]
    if MAX_RULE.with(std::cell::Cell::get) {
        return Ok(max_rule(from, event));
    }
    if from.is_terminal() {
        return Err(Refusal::Terminal(from));
    }
    match (from, event) {
        (_, Fail) => Ok(Failed),
        (Bootstrapping, Ready) => Ok(WaitingForInput),
        (WaitingForInput, Start) | (Transferring, Start) => Ok(Transferring),
        (WaitingForInput, Complete) | (Transferring, Complete) => Ok(Success),
        (from, event) => Err(Refusal::NotAllowed { from, event }),
    }
}

/// The atomic byte a [`StateWord`] keeps its state in: the three operations `apply` and
/// `load` use, with the meaning of `std`'s [`AtomicU8`] methods of the same names.
///
/// Implemented for [`AtomicU8`]; the model checker implements it for loom's atomic.
pub trait AtomicByte {
    /// A byte holding `v`.
    fn new(v: u8) -> Self;
    /// As [`AtomicU8::load`].
    fn load(&self, order: Ordering) -> u8;
    /// As [`AtomicU8::compare_exchange_weak`] (it may fail spuriously).
    fn compare_exchange_weak(
        &self,
        current: u8,
        new: u8,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u8, u8>;
}

impl AtomicByte for AtomicU8 {
    fn new(v: u8) -> Self {
        AtomicU8::new(v)
    }
    fn load(&self, order: Ordering) -> u8 {
        AtomicU8::load(self, order)
    }
    fn compare_exchange_weak(
        &self,
        current: u8,
        new: u8,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u8, u8> {
        AtomicU8::compare_exchange_weak(self, current, new, success, failure)
    }
}

/// A room's state in one atomic byte, changed only through [`transition`].
///
/// Ordering: `SeqCst` throughout. A successful `apply` releases whatever the winner wrote
/// before it (the failure reason) to every thread that loads the new state, and the
/// single total order lets the decode receiver's "announce a write, then re-check the
/// state" pair with "make terminal, then check for writes in flight" (store-buffering),
/// so `drained` can never be true while a write is about to land. On x86 a SeqCst load
/// is a plain load, so `room_poll` pays nothing for it.
#[derive(Debug)]
pub struct StateWord<A: AtomicByte = AtomicU8>(A);

impl StateWord {
    /// A word holding `initial`.
    pub fn new(initial: State) -> Self {
        Self::with_atomic(initial)
    }
}

impl<A: AtomicByte> StateWord<A> {
    /// A word holding `initial` in an atomic byte of type `A` (loom's, in the model
    /// checker; [`StateWord::new`] everywhere else).
    pub fn with_atomic(initial: State) -> Self {
        StateWord(A::new(initial as u8))
    }

    /// The current state (a single atomic load; never blocks).
    pub fn load(&self) -> State {
        decode(self.0.load(Ordering::SeqCst))
    }

    /// Applies `event` in one atomic step: reads the state, asks [`transition`], and
    /// installs the result with a compare-and-swap that fails (and retries with the
    /// fresh state) if anything changed in between. Returns `(old, new)`.
    pub fn apply(&self, event: Event) -> Result<(State, State), Refusal> {
        self.apply_when(event, |_| true)
    }

    /// As [`StateWord::apply`], but only while the room is in `state`: an event decided
    /// on a state read earlier (a deadline of that state) is refused with
    /// [`Refusal::Moved`] once the room has left it, in the same compare-and-swap.
    pub fn apply_in(&self, state: State, event: Event) -> Result<(State, State), Refusal> {
        self.apply_when(event, |s| s == state)
    }

    fn apply_when(
        &self,
        event: Event,
        allowed: impl Fn(State) -> bool,
    ) -> Result<(State, State), Refusal> {
        let mut cur = self.0.load(Ordering::SeqCst);
        loop {
            let from = decode(cur);
            let to = transition(from, event)?;
            if !allowed(from) {
                return Err(Refusal::Moved(from));
            }
            if to == from {
                return Ok((from, to));
            }
            match self
                .0
                .compare_exchange_weak(cur, to as u8, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok((from, to)),
                Err(actual) => cur = actual,
            }
        }
    }
}

fn decode(v: u8) -> State {
    // Only `new` and `apply` store into the word, and both store a `State`.
    State::from_u8(v).unwrap_or(State::Failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};

    const ALL_STATES: [State; 5] = [
        State::Failed,
        State::Bootstrapping,
        State::WaitingForInput,
        State::Transferring,
        State::Success,
    ];
    const ALL_EVENTS: [Event; 4] = [Event::Ready, Event::Start, Event::Complete, Event::Fail];

    #[test]
    fn every_state_event_pair_has_the_documented_outcome() {
        use Event::*;
        use State::*;
        for from in ALL_STATES {
            for event in ALL_EVENTS {
                let expected = match (from, event) {
                    (Failed, _) | (Success, _) => Err(Refusal::Terminal(from)),
                    (_, Fail) => Ok(Failed),
                    (Bootstrapping, Ready) => Ok(WaitingForInput),
                    (WaitingForInput, Start) | (Transferring, Start) => Ok(Transferring),
                    (WaitingForInput, Complete) | (Transferring, Complete) => Ok(Success),
                    _ => Err(Refusal::NotAllowed { from, event }),
                };
                assert_eq!(transition(from, event), expected, "{from:?} + {event:?}");
            }
        }
    }

    #[test]
    fn an_event_meant_for_one_state_is_refused_in_another() {
        let w = StateWord::new(State::Bootstrapping);
        assert_eq!(
            w.apply_in(State::WaitingForInput, Event::Fail),
            Err(Refusal::Moved(State::Bootstrapping))
        );
        assert_eq!(w.load(), State::Bootstrapping);
        w.apply(Event::Ready).unwrap();
        assert_eq!(
            w.apply_in(State::Bootstrapping, Event::Fail),
            Err(Refusal::Moved(State::WaitingForInput))
        );
        assert_eq!(
            w.apply_in(State::WaitingForInput, Event::Fail),
            Ok((State::WaitingForInput, State::Failed))
        );
        // Terminal states refuse first, whatever the condition.
        assert_eq!(
            w.apply_in(State::Failed, Event::Fail),
            Err(Refusal::Terminal(State::Failed))
        );
    }

    #[test]
    fn terminal_states_refuse_everything_through_the_word() {
        for terminal in [State::Failed, State::Success] {
            let w = StateWord::new(terminal);
            for event in ALL_EVENTS {
                assert_eq!(w.apply(event), Err(Refusal::Terminal(terminal)));
                assert_eq!(w.load(), terminal);
            }
        }
    }

    #[test]
    fn a_late_start_never_resurrects_a_failed_room() {
        // The reference design's pin: abort wins, then a worker's "transferring" arrives.
        let w = StateWord::new(State::Transferring);
        assert_eq!(
            w.apply(Event::Fail),
            Ok((State::Transferring, State::Failed))
        );
        assert_eq!(w.apply(Event::Start), Err(Refusal::Terminal(State::Failed)));
        assert_eq!(w.load(), State::Failed);
    }

    #[test]
    fn numeric_values_match_the_reference_design() {
        assert_eq!(State::Failed as u8, 0);
        assert_eq!(State::Bootstrapping as u8, 1);
        assert_eq!(State::WaitingForInput as u8, 2);
        assert_eq!(State::Transferring as u8, 3);
        assert_eq!(State::Success as u8, 4);
        for s in ALL_STATES {
            assert_eq!(State::from_u8(s as u8), Some(s));
        }
        assert_eq!(State::from_u8(5), None);
    }

    /// Many threads race `Fail` against a worker driving Start…Start, Complete. Whoever
    /// wins first decides the terminal state, exactly one thread observes the terminal
    /// transition, and nothing changes the word afterwards.
    #[test]
    fn abort_racing_advance_from_many_threads_keeps_the_first_terminal() {
        const ITERS: usize = 2000;
        const ABORTERS: usize = 3;
        let mut outcomes = [0usize; 2];
        for i in 0..ITERS {
            let w = Arc::new(StateWord::new(State::WaitingForInput));
            let barrier = Arc::new(Barrier::new(ABORTERS + 1));
            let terminal_wins = Arc::new(AtomicUsize::new(0));
            let mut handles = Vec::new();
            for _ in 0..ABORTERS {
                let (w, b, wins) = (w.clone(), barrier.clone(), terminal_wins.clone());
                handles.push(std::thread::spawn(move || {
                    b.wait();
                    if let Ok((from, State::Failed)) = w.apply(Event::Fail) {
                        assert!(!from.is_terminal());
                        wins.fetch_add(1, Ordering::SeqCst);
                    }
                    // After our own attempt the word is terminal, whoever won.
                    assert!(w.load().is_terminal());
                }));
            }
            let (wc, b, wins) = (w.clone(), barrier.clone(), terminal_wins.clone());
            let worker = std::thread::spawn(move || {
                b.wait();
                let chunks = 1 + i % 4;
                for _ in 0..chunks {
                    if wc.apply(Event::Start).is_err() {
                        return;
                    }
                }
                if let Ok((_, State::Success)) = wc.apply(Event::Complete) {
                    wins.fetch_add(1, Ordering::SeqCst);
                }
            });
            for h in handles {
                h.join().unwrap();
            }
            worker.join().unwrap();
            let end = w.load();
            assert!(end.is_terminal());
            assert_eq!(terminal_wins.load(Ordering::SeqCst), 1, "iteration {i}");
            // Sticky: nothing moves it afterwards.
            for event in ALL_EVENTS {
                assert_eq!(w.apply(event), Err(Refusal::Terminal(end)));
            }
            outcomes[(end == State::Success) as usize] += 1;
        }
        assert_eq!(outcomes[0] + outcomes[1], ITERS);
    }
}
