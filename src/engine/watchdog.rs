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

/// The deadline rule: whether a room in `state` whose deadline is `deadline` (engine
/// clock, ms) is overdue at `now`; if so, the cause it fails with and the setting it
/// exceeded (its name and value). Terminal states have none.
pub(crate) fn overdue(
    state: State,
    deadline: u64,
    now: u64,
    c: &Config,
) -> Option<(Cause, &'static str, u64)> {
    if deadline == NO_DEADLINE || deadline > now {
        return None;
    }
    Some(match state {
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
        State::Success | State::Failed => return None,
    })
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
        let Some((cause, what, ms)) = overdue(state, room.deadline_ms(), now, c) else {
            continue;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_room_is_overdue_only_past_its_deadline_and_names_its_state_s_setting() {
        let c = Config::default();
        assert_eq!(overdue(State::Bootstrapping, 10, 9, &c), None);
        assert_eq!(
            overdue(State::Bootstrapping, NO_DEADLINE, u64::MAX - 1, &c),
            None
        );
        let (cause, what, ms) = overdue(State::Bootstrapping, 10, 10, &c).unwrap();
        assert_eq!(
            (cause, what, ms),
            (
                Cause::BootstrapTimeout,
                "bootstrap_timeout_ms",
                c.bootstrap_timeout_ms
            )
        );
        assert_eq!(
            overdue(State::WaitingForInput, 1, 5, &c).unwrap().0,
            Cause::WaitingTimeout
        );
        assert_eq!(
            overdue(State::Transferring, 1, 5, &c).unwrap().0,
            Cause::TransferTimeout
        );
        assert_eq!(overdue(State::Failed, 1, 5, &c), None);
        assert_eq!(overdue(State::Success, 1, 5, &c), None);
    }
}
