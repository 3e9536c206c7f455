//! Verified bytes over RDMA (DESIGN inv. 10): the prefill's `Progress` carries the header
//! and digest of every run its completed writes carried, and the decode engine checks
//! each against the bytes where they landed, in its own pages, before it counts them.
//!
//! The check runs on the verifier thread, not on the control connection's reader: a
//! room of many MB must not hold up the heartbeats, aborts and other rooms' messages
//! behind it. The reader hands the verifier each `Progress` and, behind them, each
//! `Done` of the peer, in the order they came, so a Done is settled only after every
//! batch it counts was verified (and the ordered settle of RDMA stays right). A room
//! that ended meanwhile is neither read nor counted.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::receive::Refuse;
use super::{DRoom, DecodeEngine};
use crate::control::{Peer, Progress};
use crate::engine::lifecycle;
use crate::proto::Target;
use crate::room::{Cause, FailureReason};

/// A control message the verifier handles, in the order the reader passed it on.
pub(super) enum Job {
    /// A batch of writes completed, with its runs' digests.
    Progress(Arc<Peer>, Progress),
    /// The peer's Done: room, generation, pages sent, aux rows sent.
    Done(Arc<Peer>, u64, u64, u32, bool),
}

/// The most jobs the verifier's queue holds. A reader that would queue more waits for
/// a place (the peer's later control messages wait behind it: back-pressure on the
/// peer), so a peer that sends Progress faster than its runs can be verified cannot grow
/// the engine's memory without bound.
const MOST_JOBS: usize = 4096;

/// The verifier's queue, bounded ([`MOST_JOBS`]).
pub(super) struct Verifier<T = Job> {
    jobs: Mutex<VecDeque<T>>,
    /// A job was queued.
    ready: Condvar,
    /// A job was taken: a place is free.
    space: Condvar,
}

impl<T> Default for Verifier<T> {
    fn default() -> Self {
        Verifier {
            jobs: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            space: Condvar::new(),
        }
    }
}

impl<T> Verifier<T> {
    /// Queues `job` behind the others, once the queue has a place for it. Dropped if
    /// `gone` says meanwhile that it will never be verified (its peer was lost, which
    /// failed its rooms, or the engine stops).
    pub fn push(&self, job: T, gone: impl Fn() -> bool) {
        let mut jobs = self.jobs.lock();
        while jobs.len() >= MOST_JOBS {
            if gone() {
                return;
            }
            self.space.wait_for(&mut jobs, IDLE);
        }
        jobs.push_back(job);
        self.ready.notify_one();
    }

    /// The oldest job, waiting for one until `stopping` says the engine stops.
    fn pop(&self, stopping: impl Fn() -> bool) -> Option<T> {
        let mut jobs = self.jobs.lock();
        loop {
            if stopping() {
                return None;
            }
            if let Some(job) = jobs.pop_front() {
                // Every reader waiting for a place looks again.
                self.space.notify_all();
                return Some(job);
            }
            self.ready.wait_for(&mut jobs, IDLE);
        }
    }
}

/// How often an idle verifier looks whether the engine stops.
const IDLE: Duration = Duration::from_millis(50);

impl DecodeEngine {
    /// Starts the verifier thread (with `integrity=verify` over RDMA), which runs until
    /// the engine stops.
    pub fn start_verifier(self: &Arc<Self>) -> crate::error::Result<()> {
        let node = &self.core.node;
        if !node.config.integrity || node.rdma.is_none() {
            return Ok(());
        }
        let engine = self.clone();
        node.spawn("kvxfer-verify", move || engine.verify_loop())
    }

    fn verify_loop(&self) {
        let node = &self.core.node;
        loop {
            let Some(job) = self.verifier.pop(|| node.is_stopping()) else {
                return;
            };
            // A panic drops the message, as if lost: the room fails on the peer's Done
            // (its bytes do not add up) or its deadline. It must not end the thread,
            // which serves every room.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match job {
                Job::Progress(peer, p) => self.on_progress(&peer, p),
                Job::Done(peer, room, generation, pages, aux) => {
                    self.on_done(&peer, room, generation, pages, aux)
                }
            }));
            if r.is_err() {
                crate::log!(node.log, Error, "internal error (panic) verifying a room");
            }
        }
    }

    /// With `integrity=verify`: checks the runs of `peer`'s `p` (for a live room whose
    /// destination went out) like the headers of TCP data frames: they add up to what
    /// `p` counts, are granted to the room and take no byte twice; then reads each where
    /// it landed and compares its digest. True if every run matched (counted in
    /// `bytes_verified`); otherwise the room failed (as INTEGRITY on a mismatch naming
    /// the buffer, page and byte range, as PROTOCOL on runs that do not fit) and false.
    /// A room that ended meanwhile is not read (false).
    pub(super) fn verify_progress(
        &self,
        peer: &Arc<Peer>,
        room: &Arc<DRoom>,
        p: &Progress,
    ) -> bool {
        let fail = |cause, why: String| {
            lifecycle::fail(
                self,
                room,
                FailureReason::local(cause, format!("{} sent {why}", peer.name)),
                None,
            );
            false
        };
        if let Some(why) = runs_disagree(p) {
            return fail(Cause::Protocol, why);
        }
        if p.runs.is_empty() {
            return true; // nothing was written
        }
        // Counted in before the state is checked: a room that ended is not read, and
        // one that ends while its pages are read is not drained until they were.
        let io = room.begin_io();
        #[cfg(feature = "test-hooks")]
        crate::testing::pause_point("decode.verify", p.room);
        if room.state().is_terminal() {
            return false;
        }
        let runs = match self.check_data(peer, room, &p.runs) {
            Ok((_, runs)) => runs,
            Err(Refuse::Discard) => return false,
            Err(Refuse::NotOurs(why) | Refuse::Protocol(why)) => {
                return fail(Cause::Protocol, why);
            }
        };
        #[cfg(feature = "test-hooks")]
        if crate::testing::take_fault("rdma.changed_after_landing", p.room) {
            // A destination byte changes between landing and verification.
            let (h, mem, buffer) = &runs[0];
            let landed = mem
                .bytes_mut(
                    *buffer as usize,
                    h.first_page,
                    h.n_pages,
                    h.page_off as usize,
                    h.byte_len as usize,
                )
                .expect("checked by check_data");
            if let Some(b) = landed.last_mut() {
                *b ^= 0x01;
            }
        }
        let ok = self.verify_runs(peer, room, runs.iter().map(|r| (r, None)));
        drop(io);
        ok
    }
}

/// Why the runs of `p` do not add up to what it counts (bytes, aux rows and KV bytes
/// per buffer), if they do not: the digests must cover every byte counted.
fn runs_disagree(p: &Progress) -> Option<String> {
    let mut kv: Vec<(u32, u64)> = Vec::new();
    let (mut bytes, mut rows) = (0u64, 0u64);
    for h in &p.runs {
        match h.target {
            Target::Kv => match kv.iter_mut().find(|(b, _)| *b == h.buffer) {
                Some((_, n)) => *n += u64::from(h.byte_len),
                None => kv.push((h.buffer, u64::from(h.byte_len))),
            },
            Target::Aux => rows += 1,
        }
        bytes += u64::from(h.byte_len);
    }
    let mut counted: Vec<(u32, u64)> = p.kv.iter().copied().filter(|&(_, n)| n > 0).collect();
    counted.sort_unstable();
    kv.sort_unstable();
    let agree = bytes == p.bytes && rows == u64::from(p.aux_rows) && kv == counted;
    (!agree).then(|| {
        format!(
            "progress of room {} counting {} bytes, {} aux rows and KV bytes {:?} with \
             digested runs of {bytes} bytes, {rows} aux rows and KV bytes {kv:?}",
            p.room, p.bytes, p.aux_rows, counted
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::DataHeader;

    #[test]
    fn a_full_queue_makes_the_reader_wait_for_a_place_or_drops_a_job_of_a_peer_gone() {
        let q: Arc<Verifier<usize>> = Arc::default();
        for i in 0..MOST_JOBS {
            q.push(i, || false);
        }
        // Gone meanwhile: dropped, the queue keeps its bound.
        q.push(MOST_JOBS, || true);
        assert_eq!(q.jobs.lock().len(), MOST_JOBS);
        // Otherwise the reader waits until a job is taken, then queues behind the rest.
        let reader = {
            let q = q.clone();
            std::thread::spawn(move || q.push(MOST_JOBS + 1, || false))
        };
        assert_eq!(q.pop(|| false), Some(0));
        reader.join().unwrap();
        let jobs = q.jobs.lock();
        assert_eq!(jobs.len(), MOST_JOBS);
        assert_eq!(jobs.back(), Some(&(MOST_JOBS + 1)));
        assert_eq!(jobs.front(), Some(&1));
    }

    fn run(target: Target, buffer: u32, byte_len: u32) -> DataHeader {
        DataHeader {
            room: 4,
            generation: 1,
            target,
            buffer,
            first_page: 3,
            n_pages: 1,
            byte_len,
            page_off: 0,
            digest: 0,
        }
    }

    fn progress(kv: Vec<(u32, u64)>, aux_rows: u32, bytes: u64, runs: Vec<DataHeader>) -> Progress {
        Progress {
            room: 4,
            generation: 1,
            aux_rows,
            bytes,
            kv,
            runs,
        }
    }

    #[test]
    fn runs_that_add_up_to_the_counts_agree_in_any_order() {
        let runs = vec![
            run(Target::Kv, 1, 100),
            run(Target::Kv, 0, 50),
            run(Target::Aux, 0, 8),
            run(Target::Kv, 1, 100),
        ];
        let p = progress(vec![(0, 50), (1, 200)], 1, 258, runs);
        assert_eq!(runs_disagree(&p), None);
        assert_eq!(runs_disagree(&progress(vec![], 0, 0, vec![])), None);
    }

    #[test]
    fn counts_the_runs_do_not_cover_disagree() {
        let runs = || vec![run(Target::Kv, 0, 100), run(Target::Aux, 0, 8)];
        for p in [
            // A byte counted that no digest covers, on a buffer or in all.
            progress(vec![(0, 101)], 1, 109, runs()),
            progress(vec![(0, 100)], 1, 109, runs()),
            // The right total on the wrong buffer.
            progress(vec![(1, 100)], 1, 108, runs()),
            // An aux row more or less.
            progress(vec![(0, 100)], 2, 108, runs()),
            progress(vec![(0, 100)], 0, 108, runs()),
            // Bytes with no runs at all.
            progress(vec![(0, 100)], 0, 100, vec![]),
        ] {
            let why = runs_disagree(&p).expect("counts without digests");
            assert!(why.contains("digested runs"), "{why}");
        }
    }
}
