//! The watchdog: every non-terminal state has a deadline, and this thread fails rooms
//! whose deadline passed, with a reason naming the deadline. It also runs the periodic
//! duties of the other parts: heartbeats (control), the drain of cleared rooms and of
//! failed RDMA decode rooms, expiry of the prefill's holding area and acknowledgements.

use std::sync::Arc;
use std::time::Duration;

use super::core::{self, Side};
use super::lifecycle;
use crate::config::Config;
use crate::room::{Cause, FailureReason, State, NO_DEADLINE};

/// How often to scan: a quarter of the shortest deadline, within 2..=100 ms.
fn scan_interval(c: &Config) -> Duration {
    let shortest = c
        .bootstrap_timeout_ms
        .min(c.waiting_timeout_ms)
        .min(c.transfer_timeout_ms)
        .min(c.heartbeat_interval_ms);
    Duration::from_millis((shortest / 4).clamp(2, 100))
}

/// Starts the watchdog thread of `side`.
pub(crate) fn start<S: Side>(side: &Arc<S>) -> crate::error::Result<()> {
    let s = side.clone();
    side.core().node.spawn("kvxfer-watchdog", move || run(&*s))
}

fn run<S: Side>(side: &S) {
    let node = &side.core().node;
    let interval = scan_interval(&node.config);
    while !node.sleep(interval) {
        // A panic here must not end the watchdog: catch it, log it, go on.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let now = node.now_ms();
            scan(side, now);
            core::release_drained(side, now);
            side.tick(now);
            side.core().control.heartbeat();
        }));
        if r.is_err() {
            crate::log!(node.log, Error, "watchdog scan panicked; continuing");
        }
    }
}

fn scan<S: Side>(side: &S, now: u64) {
    let c = &side.core().node.config;
    for room in side.core().rooms.snapshot() {
        side.watch(&room, now);
        // The state first, then its deadline: a transition arms the new state's deadline
        // before its compare-and-swap, so a deadline read after the state is that
        // state's (or a later one's), and the room is failed only if still in that state.
        let state = room.state();
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("watchdog.scan", room.id());
        let deadline = room.deadline_ms();
        if deadline == NO_DEADLINE || deadline > now {
            continue;
        }
        let (cause, what, ms) = match state {
            State::Bootstrapping => (
                Cause::BootstrapTimeout,
                "bootstrap_timeout_ms",
                c.bootstrap_timeout_ms,
            ),
            State::WaitingForInput => (
                Cause::WaitingTimeout,
                "waiting_timeout_ms",
                c.waiting_timeout_ms,
            ),
            State::Transferring => (
                Cause::TransferTimeout,
                "transfer_timeout_ms",
                c.transfer_timeout_ms,
            ),
            State::Success | State::Failed => continue,
        };
        let mut message = format!(
            "room {} exceeded its deadline {what}={ms} in state {state}",
            room.id(),
        );
        if let Some(note) = side.deadline_note(&room) {
            message.push_str(&note);
        }
        lifecycle::fail_in(side, &room, state, FailureReason::local(cause, message));
    }
}
