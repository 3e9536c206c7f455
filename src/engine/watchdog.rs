//! The watchdog: every non-terminal state has a deadline, and this thread fails rooms
//! whose deadline passed, with a reason naming the deadline.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Shared as Inner;
use crate::room::{Cause, FailureReason, State, NO_DEADLINE};

/// How often to scan: a quarter of the shortest deadline, within 2..=100 ms.
fn scan_interval(inner: &Inner) -> Duration {
    let c = &inner.config;
    let shortest = c
        .bootstrap_timeout_ms
        .min(c.waiting_timeout_ms)
        .min(c.transfer_timeout_ms)
        .min(c.heartbeat_interval_ms);
    Duration::from_millis((shortest / 4).clamp(2, 100))
}

pub(super) fn run(inner: &Inner) {
    let interval = scan_interval(inner);
    loop {
        {
            let mut g = inner.wake.0.lock();
            if inner.stopping.load(Ordering::Acquire) {
                return;
            }
            inner.wake.1.wait_for(&mut g, interval);
        }
        if inner.stopping.load(Ordering::Acquire) {
            return;
        }
        // A panic here must not end the watchdog: catch it, log it, go on.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scan(inner);
            inner.heartbeat();
            inner.expire_held();
        }));
        if r.is_err() {
            crate::log!(inner.log, Error, "watchdog scan panicked; continuing");
        }
    }
}

fn scan(inner: &Inner) {
    let now = inner.now_ms();
    for room in inner.rooms.snapshot() {
        inner.decode_drain_deadline(&room, now);
        let deadline = room.deadline_ms();
        if deadline == NO_DEADLINE || deadline > now {
            continue;
        }
        let c = &inner.config;
        let (cause, what, ms) = match room.state() {
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
            "room {} exceeded its deadline {what}={ms} in state {}",
            room.id(),
            room.state()
        );
        if let Some(missing) = inner.decode_missing(&room) {
            message = format!("{message}: {missing}");
        }
        inner.fail_room(&room, FailureReason::local(cause, message), None);
    }
    if inner.rdma.is_some() {
        inner.send_due_acks();
    }
}
