//! Test-only pause points, compiled only with the `test-hooks` feature (never in a
//! release build of the library).
//!
//! A pause point is a named place in engine code, reached with a room id
//! ([`pause_point`]). A test arms it for one room ([`pause_at`]); the next thread that
//! reaches that point for that room parks there until the test [`release`]s it, and the
//! test can wait until it is parked ([`wait_paused`]). Each arming catches one thread
//! once. Unarmed points cost one relaxed atomic load.
//!
//! A point is kept only for what the simulator (`src/engine/sim/`, single-threaded)
//! cannot reach: a race of the shell itself (a lock, an atomic or a lookup against
//! another thread, a thread's I/O), or an ordering of a decision not yet taken out of
//! the shell; an ordering of the pure cores' inputs is the simulator's
//! (`engine::sim::scenarios`). docs/ARCHITECTURE.md has the table, point by point.
//!
//! Points in the engine:
//! - `"prefill.write_done"` (src/engine/prefill/send.rs, `write_done`): a sender
//!   thread is about to write the room's Done on its data connection.
//! - `"rdma.batch_done"` (src/transport/rdma/link.rs): a batch's RDMA WRITEs completed,
//!   and the worker still counts them on the room (its io count), so an acknowledgement
//!   of an abort must wait.
//! - `"watchdog.scan"` (src/engine/watchdog.rs): the watchdog has read the room's state
//!   and not yet its deadline.
//! - `"prefill.on_destination"` (src/engine/prefill/arrivals/mod.rs): a control reader
//!   has a decode engine's destination for the room in hand and has not looked at
//!   anything yet.
//! - `"prefill.attach_lost"` (same file, `attach`): the destination was added to the
//!   room and its engine found lost; the room is not failed yet.
//! - `"decode.attach"` (src/engine/decode/mod.rs, `create`): a decode room was created
//!   and its prefill engines looked up (their connections may be under way), and it is
//!   not yet attached to them.
//! - `"decode.verify"` (src/engine/decode/verify.rs, `verify_progress`): the verifier
//!   counted itself in a room's io and has not checked its state yet.
//! - `"accept.link_up"` (src/control/accept.rs), keyed by the port of the prefill
//!   engine's own address: a decode engine's data connection is admitted and its link
//!   added to the peer, which was not lost then; its sender is not started yet.
//! - `"accept.data_answered"` (src/control/accept.rs), keyed by the port of the
//!   prefill engine's own address: the prefill engine has answered a decode engine's
//!   data connection (its Hello is written) and its accepting thread has not returned.
//!
//! Faults are one-shot, per room: a test injects one ([`inject_fault`]) and the engine
//! takes it at the named place. Faults in the engine:
//! - `"rdma.bad_rkey"` (src/transport/rdma/link.rs): the next RDMA WRITE of the room
//!   goes out with a wrong remote key, so the decode side's device refuses it and the
//!   write completes in error (remote access error).
//! - `"recv.panic"` (src/engine/decode/receive.rs, `admit`): the TCP receiver panics on the
//!   room's next data frame.
//!
//! Faults aimed at a peer rather than a room are keyed by the port of the peer's
//! address (decode side):
//! - `"connect.panic"`: the connector thread to that prefill engine panics at its start.
//! - `"spawn:<thread name>"` (src/control/mod.rs, `spawn_for_peer`): starting that thread
//!   for that peer fails, as if the system refused a new thread.
//!
//! A parked thread gives up after [`PARK_LIMIT`] so that a test that fails before
//! releasing cannot hang the engine's shutdown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The longest a thread stays parked at a pause point without being released.
pub const PARK_LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a thread to arrive.
    Armed,
    /// A thread is parked here.
    Paused,
    /// The test let it go (or it gave up); the entry is removed by whoever leaves last.
    Released,
}

struct Point {
    name: String,
    room: u64,
    phase: Phase,
}

static POINTS: Mutex<Vec<Point>> = Mutex::new(Vec::new());
static CHANGED: Condvar = Condvar::new();
/// Points armed and not yet released: the engine's fast path skips the lock when zero.
static ARMED: AtomicUsize = AtomicUsize::new(0);

fn find(points: &[Point], name: &str, room: u64) -> Option<usize> {
    points.iter().position(|p| p.name == name && p.room == room)
}

/// Arms pause point `name` for room `room`: the next thread to reach it for that room
/// parks there. Arming an armed point does nothing.
pub fn pause_at(name: &str, room: u64) {
    let mut points = POINTS.lock();
    if find(&points, name, room).is_none() {
        points.push(Point {
            name: name.to_string(),
            room,
            phase: Phase::Armed,
        });
        ARMED.fetch_add(1, Ordering::SeqCst);
    }
}

/// Waits until a thread is parked at `name` for `room`; false if none arrived within
/// `timeout` (or the point is not armed).
pub fn wait_paused(name: &str, room: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut points = POINTS.lock();
    loop {
        match find(&points, name, room).map(|i| points[i].phase) {
            Some(Phase::Paused) => return true,
            Some(Phase::Armed) => {}
            Some(Phase::Released) | None => return false,
        }
        if CHANGED.wait_until(&mut points, deadline).timed_out() {
            return matches!(
                find(&points, name, room).map(|i| points[i].phase),
                Some(Phase::Paused)
            );
        }
    }
}

/// Lets the thread parked at `name` for `room` go on, or disarms the point if no thread
/// reached it yet.
pub fn release(name: &str, room: u64) {
    let mut points = POINTS.lock();
    if let Some(i) = find(&points, name, room) {
        match points[i].phase {
            Phase::Armed => {
                points.remove(i);
                ARMED.fetch_sub(1, Ordering::SeqCst);
            }
            Phase::Paused => points[i].phase = Phase::Released,
            Phase::Released => {}
        }
        CHANGED.notify_all();
    }
}

static FAULTS: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
/// Faults injected and not yet taken: the engine's fast path skips the lock when zero.
static INJECTED: AtomicUsize = AtomicUsize::new(0);

/// Injects fault `name` for room `room`: the engine takes it once at that place.
pub fn inject_fault(name: &str, room: u64) {
    FAULTS.lock().push((name.to_string(), room));
    INJECTED.fetch_add(1, Ordering::SeqCst);
}

/// Engine side: whether fault `name` was injected for `room` (and takes it).
pub(crate) fn take_fault(name: &str, room: u64) -> bool {
    if INJECTED.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let mut faults = FAULTS.lock();
    match faults.iter().position(|(n, r)| n == name && *r == room) {
        Some(i) => {
            faults.remove(i);
            INJECTED.fetch_sub(1, Ordering::SeqCst);
            true
        }
        None => false,
    }
}

/// The port of `host:port`, the key of the points and faults aimed at an engine rather
/// than a room (0 if there is none).
pub(crate) fn port_key(addr: &str) -> u64 {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// Engine side: parks here if the test armed `name` for `room`.
pub(crate) fn pause_point(name: &str, room: u64) {
    if ARMED.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut points = POINTS.lock();
    let Some(i) = find(&points, name, room) else {
        return;
    };
    if points[i].phase != Phase::Armed {
        return;
    }
    points[i].phase = Phase::Paused;
    CHANGED.notify_all();
    let deadline = Instant::now() + PARK_LIMIT;
    loop {
        let i = find(&points, name, room).expect("only the parked thread removes it");
        if points[i].phase == Phase::Released
            || CHANGED.wait_until(&mut points, deadline).timed_out()
        {
            let i = find(&points, name, room).expect("only the parked thread removes it");
            points.remove(i);
            ARMED.fetch_sub(1, Ordering::SeqCst);
            CHANGED.notify_all();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_armed_point_parks_one_thread_until_released() {
        pause_at("unit.point", 7);
        let t = std::thread::spawn(|| {
            pause_point("unit.point", 8); // another room: passes
            pause_point("unit.point", 7); // parks
            pause_point("unit.point", 7); // one-shot: passes
        });
        assert!(wait_paused("unit.point", 7, Duration::from_secs(10)));
        assert!(!t.is_finished());
        release("unit.point", 7);
        t.join().unwrap();
        assert!(!wait_paused("unit.point", 7, Duration::from_millis(1)));
    }

    #[test]
    fn releasing_an_unreached_point_disarms_it() {
        pause_at("unit.unreached", 1);
        release("unit.unreached", 1);
        pause_point("unit.unreached", 1); // does not park
    }
}
