//! A decode engine's outbox: the batches of frames planned for it, waiting for one of
//! its links. Every link of the peer has a sender thread that takes batches from the
//! outbox, so one room's frames go out over all of the peer's connections (or RDMA
//! queue pairs) at once, and a slow peer holds up only its own links.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::plan::Planned;
use super::PRoom;
use crate::control::Peer;

/// The batches of one chunk not written yet, and whether one of them was dropped.
pub(crate) struct Ticket {
    /// Batches of the chunk not yet ended (written, skipped or failed). AcqRel: the
    /// sender that ends the last one sees the others' ends.
    left: AtomicUsize,
    /// A batch of the chunk was not written whole (its room ended, or the write failed):
    /// the chunk does not count as sent. Relaxed: read after `left` reached 0.
    dropped: AtomicBool,
}

impl Ticket {
    pub fn new(batches: usize) -> Arc<Ticket> {
        Arc::new(Ticket {
            left: AtomicUsize::new(batches),
            dropped: AtomicBool::new(false),
        })
    }

    /// One batch of the chunk ended (`written`: whole); whether the chunk was then sent
    /// whole.
    pub fn end(&self, written: bool) -> bool {
        if !written {
            self.dropped.store(true, Ordering::Relaxed);
        }
        self.left.fetch_sub(1, Ordering::AcqRel) == 1 && !self.dropped.load(Ordering::Relaxed)
    }
}

/// Frames of one room for one destination, written by one link in one call (one
/// vectored write on TCP, one chain of RDMA writes).
pub(crate) struct Batch {
    pub room: Arc<PRoom>,
    /// The destination's engine (whose outbox this is).
    pub peer: Arc<Peer>,
    pub frames: Vec<Planned>,
    pub bytes: usize,
    pub chunk: Arc<Ticket>,
    /// The last batch planned for this destination in the room's last chunk: Done
    /// likely follows it on the same link.
    pub last: bool,
}

#[derive(Default)]
struct Queue {
    batches: VecDeque<Batch>,
    closed: bool,
}

/// The outbox of one decode engine.
#[derive(Default)]
pub(crate) struct Outbox {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Outbox {
    /// Queues `batch`; false (and the batch back) once the outbox is closed.
    pub fn push(&self, batch: Batch) -> Result<(), Batch> {
        let mut q = self.queue.lock();
        if q.closed {
            return Err(batch);
        }
        q.batches.push_back(batch);
        self.ready.notify_one();
        Ok(())
    }

    /// The next batch, waiting for one; `None` once closed.
    pub fn pop(&self) -> Option<Batch> {
        let mut q = self.queue.lock();
        loop {
            if q.closed {
                return None;
            }
            if let Some(b) = q.batches.pop_front() {
                return Some(b);
            }
            self.ready.wait(&mut q);
        }
    }

    /// No more batches: the senders end; what was queued is returned (its rooms are
    /// failed by whoever closed the outbox).
    pub fn close(&self) -> Vec<Batch> {
        let mut q = self.queue.lock();
        q.closed = true;
        self.ready.notify_all();
        q.batches.drain(..).collect()
    }
}
