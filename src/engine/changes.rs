//! The scheduler's wait: a count of the times a room of this engine changed state,
//! which a scheduler thread can sleep on instead of polling every room on a timer, and
//! which the host can also bump to wake that thread for its own reasons.
//!
//! Use: read the count (a wait with no timeout returns it at once), poll the rooms,
//! then wait for the count to move past what was read. A change between the read and
//! the wait makes the wait return at once, so none is missed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
pub(crate) struct Changes {
    count: AtomicU64,
    /// Threads inside `wait`: a bump takes the lock and notifies only when there is one.
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Changes {
    /// Counts one change and wakes every waiting thread.
    ///
    /// No wakeup is lost: the count is raised before `waiters` is read, and a waiter
    /// raises `waiters` (under the lock) before it reads the count, both SeqCst. So
    /// either this bump sees the waiter, and its lock waits until the waiter is asleep
    /// in the condvar before notifying, or the waiter sees the raised count.
    pub fn bump(&self) {
        self.count.fetch_add(1, SeqCst);
        if self.waiters.load(SeqCst) > 0 {
            drop(self.lock.lock());
            self.cv.notify_all();
        }
    }

    /// Waits until the count is not `seen`, or `timeout` passed; returns the count.
    pub fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        let now = self.count.load(SeqCst);
        if now != seen || timeout.is_zero() {
            return now;
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut g = self.lock.lock();
        self.waiters.fetch_add(1, SeqCst);
        let count = loop {
            let c = self.count.load(SeqCst);
            if c != seen {
                break c;
            }
            let timed_out = match deadline {
                Some(d) => self.cv.wait_until(&mut g, d).timed_out(),
                None => {
                    self.cv.wait(&mut g);
                    false
                }
            };
            if timed_out {
                break self.count.load(SeqCst);
            }
        };
        self.waiters.fetch_sub(1, SeqCst);
        count
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A waiter that read the count and then waits sees every later bump, however the
    /// two interleave: each wait returns a count past the one it was given, long before
    /// its timeout (which would fail the test).
    #[test]
    fn no_bump_is_lost_between_a_read_and_a_wait() {
        let c = Arc::new(Changes::default());
        let rounds = 20_000u64;
        let waiter = {
            let c = c.clone();
            std::thread::spawn(move || {
                let mut seen = 0;
                while seen < rounds {
                    let next = c.wait(seen, Duration::from_secs(10));
                    assert!(next > seen, "a wait timed out: a bump was lost");
                    seen = next;
                }
            })
        };
        for _ in 0..rounds {
            c.bump();
            if c.waiters.load(SeqCst) == 0 {
                std::thread::yield_now();
            }
        }
        waiter.join().unwrap();
    }

    #[test]
    fn a_wait_times_out_with_the_count_unchanged() {
        let c = Changes::default();
        c.bump();
        assert_eq!(c.wait(0, Duration::ZERO), 1);
        assert_eq!(
            c.wait(7, Duration::from_secs(3600)),
            1,
            "a stale count returns at once"
        );
        assert_eq!(c.wait(1, Duration::from_millis(5)), 1);
    }
}
