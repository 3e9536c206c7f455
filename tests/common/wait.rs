//! Waiting for an engine to get somewhere, with one patience for every test.

use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

use kvxfer::{Cause, Engine, State};

/// How long a test waits for anything before it fails. Below every default deadline
/// (bootstrap and transfer 30 s), so that a room a watchdog fails at its deadline is
/// never taken for one that ended by itself.
pub const LIMIT: Duration = Duration::from_secs(20);

/// Waits until `f` holds; fails the test, naming `what`, after [`LIMIT`].
pub fn wait_until(what: &str, f: impl FnMut() -> bool) {
    wait_until_within(what, LIMIT, f)
}

/// As [`wait_until`], failing after `limit`.
pub fn wait_until_within(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until room `room` of `e` is in state `want`.
pub fn wait_state(e: &Engine, room: u64, want: State) {
    wait_until(&format!("room {room} to be {want}"), || {
        e.room_poll(room).unwrap() == want
    });
}

/// Waits until room `room` of `e` is terminal and returns its state; fails the test if
/// the room is still live after [`LIMIT`].
pub fn wait_terminal(e: &Engine, room: u64) -> State {
    let s = terminal_within(e, room, LIMIT);
    assert!(s.is_terminal(), "room {room} stuck in {s}");
    s
}

/// The state of room `room` of `e` as soon as it is terminal, or after `limit` if it is
/// not by then: the caller says what it expects.
pub fn terminal_within(e: &Engine, room: u64, limit: Duration) -> State {
    let t = Instant::now();
    loop {
        let s = e.room_poll(room).unwrap();
        if s.is_terminal() || t.elapsed() > limit {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Creates `rooms` on decode engine `d` from instance `from`, room `r` into page `r`,
/// and waits until the last of them waits for input.
pub fn rooms_waiting(d: &Engine, from: &str, rooms: RangeInclusive<u64>) {
    for r in rooms.clone() {
        d.room_create_from(r, from).unwrap();
        d.room_set_destination(r, &[r as u32], None).unwrap();
    }
    wait_state(d, *rooms.end(), State::WaitingForInput);
}

/// Checks that each of `rooms` of `e` fails within `limit` because its peer is lost,
/// with a reason that names every one of `parts`.
pub fn fail_peer_lost_naming(
    e: &Engine,
    rooms: RangeInclusive<u64>,
    limit: Duration,
    parts: &[&str],
) {
    for r in rooms {
        assert_eq!(terminal_within(e, r, limit), State::Failed);
        let why = e.room_failure(r).unwrap();
        assert_eq!(why.cause, Cause::PeerLost, "{why}");
        for part in parts {
            assert!(why.message.contains(part), "{part}: {why}");
        }
    }
}

/// Checks that less than `limit` has passed since `since`.
pub fn assert_within(since: Instant, limit: Duration) {
    let took = since.elapsed();
    assert!(took < limit, "{took:?}");
}

/// A call on a room that the test expects to fail on its own (a refused connection, a
/// short deadline): the failure may come first, and then the call is refused for the
/// room's state, which the test checks next. Any other refusal fails the test.
pub fn unless_failed(r: kvxfer::Result<()>) {
    if let Err(e) = r {
        assert_eq!(e.kind(), kvxfer::ErrorKind::WrongState, "{e}");
    }
}
