//! A decode engine's outbox: the batches of frames planned for it, waiting for one of
//! its links. Every link of the peer has a sender thread that takes batches from the
//! outbox, so one room's frames go out over all of the peer's connections (or RDMA
//! queue pairs) at once, and a slow peer holds up only its own links.
//!
//! Rooms are served oldest first: what is queued for a room goes out before what a
//! younger room queued earlier. A room sent layer by layer queues its last layers after
//! the next room's first ones; in arrival order a link behind the compute would share
//! itself between the two and finish both late, where whole chunks finish one room,
//! then the next.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

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

/// What a sender takes from an outbox: a batch of frames, or a room's Done for the
/// engine. A thread that plans (the scheduler's enqueue, a control reader) never writes
/// on a data connection itself, since a write can wait on the network: when it
/// completes a room, its Done goes here for a sender to write.
pub(crate) enum Item {
    Batch(Batch),
    Done { room: Arc<PRoom>, frame: Vec<u8> },
}

struct Queue<T> {
    /// Each item with its room's order (the room's generation: older rooms first).
    items: VecDeque<(u64, T)>,
    closed: bool,
}

/// The outbox of one decode engine: its batches, taken by the sender threads of its
/// links. (Generic only so that its tests need no room.)
///
/// A std `Condvar` on purpose: on Linux its `notify_all` wakes every waiting sender in
/// one futex call. A planner that woke the senders one call at a time lost its core to
/// the first one woken (a wakeup preempts the waker), so the other senders slept until
/// the first had written its batch: on two cores, one room's halves went out one after
/// the other, and its senders and receivers piled onto one core.
pub(crate) struct Outbox<T = Item> {
    queue: Mutex<Queue<T>>,
    ready: Condvar,
}

impl<T> Default for Outbox<T> {
    fn default() -> Self {
        Outbox {
            queue: Mutex::new(Queue {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> Outbox<T> {
    /// The queue. No code panics while holding it, so a poisoned lock is taken as is.
    fn queue(&self) -> MutexGuard<'_, Queue<T>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `batches` in order (one chunk's for this destination, or a room's Done),
    /// behind everything queued for rooms of order `room` or older and ahead of younger
    /// rooms' items, then wakes the senders in one call: as many as there are batches,
    /// all when several. Once the outbox is closed nothing is queued and `batches` come
    /// back.
    pub fn push_all(&self, room: u64, batches: Vec<T>) -> Vec<T> {
        let n = batches.len();
        {
            let mut q = self.queue();
            if q.closed {
                return batches;
            }
            let at = q
                .items
                .iter()
                .rposition(|(order, _)| *order <= room)
                .map_or(0, |i| i + 1);
            for (k, b) in batches.into_iter().enumerate() {
                q.items.insert(at + k, (room, b));
            }
        }
        match n {
            0 => {}
            1 => self.ready.notify_one(),
            _ => self.ready.notify_all(),
        }
        Vec::new()
    }

    /// The next batch, waiting for one; `None` once closed.
    pub fn pop(&self) -> Option<T> {
        let mut q = self.queue();
        loop {
            if q.closed {
                return None;
            }
            if let Some((_, b)) = q.items.pop_front() {
                return Some(b);
            }
            q = self.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// No more batches: the senders end; what was queued is returned (its rooms are
    /// failed by whoever closed the outbox).
    pub fn close(&self) -> Vec<T> {
        let mut q = self.queue();
        q.closed = true;
        self.ready.notify_all();
        q.items.drain(..).map(|(_, b)| b).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::thread;
    use std::time::Duration;

    /// Two senders asleep on an empty outbox and one chunk of two batches: both wake
    /// from the one push, and each takes a batch (each takes one and leaves). Had the
    /// push woken only one, the other would sleep on with the second batch queued.
    #[test]
    fn one_push_of_several_batches_wakes_every_sleeping_sender() {
        let outbox = Arc::new(Outbox::<u32>::default());
        let (tx, rx) = mpsc::channel();
        let senders: Vec<_> = (0..2)
            .map(|_| {
                let (outbox, tx) = (outbox.clone(), tx.clone());
                thread::spawn(move || tx.send(outbox.pop()).unwrap())
            })
            .collect();
        // Both senders are asleep in pop() once the queue's lock is free and nobody
        // has taken anything; give them the time to get there.
        thread::sleep(Duration::from_millis(50));
        assert!(outbox.push_all(0, vec![1, 2]).is_empty());
        let mut got: Vec<_> = (0..2)
            .map(|_| {
                rx.recv_timeout(Duration::from_secs(10))
                    .expect("a sender slept on")
            })
            .collect();
        got.sort();
        assert_eq!(got, vec![Some(1), Some(2)]);
        for s in senders {
            s.join().unwrap();
        }
    }

    #[test]
    fn batches_keep_their_order_and_come_back_once_closed() {
        let outbox = Outbox::<u32>::default();
        assert!(outbox.push_all(7, vec![1, 2]).is_empty());
        assert!(outbox.push_all(7, vec![3]).is_empty());
        assert_eq!(outbox.pop(), Some(1));
        assert_eq!(outbox.close(), vec![2, 3]);
        assert_eq!(outbox.pop(), None);
        assert_eq!(outbox.push_all(7, vec![4, 5]), vec![4, 5]);
    }

    /// An older room's batches go ahead of those a younger room queued before them, in
    /// their order and behind the older room's own; rooms of one age keep theirs.
    #[test]
    fn an_older_rooms_batches_go_ahead_of_a_younger_rooms_queued_before_them() {
        let outbox = Outbox::<u32>::default();
        assert!(outbox.push_all(1, vec![10, 11]).is_empty());
        assert!(outbox.push_all(2, vec![20, 21]).is_empty());
        assert!(outbox.push_all(1, vec![12, 13]).is_empty());
        assert!(outbox.push_all(3, vec![30]).is_empty());
        assert!(outbox.push_all(0, vec![1]).is_empty());
        assert!(outbox.push_all(2, vec![22]).is_empty());
        let order: Vec<u32> = std::iter::from_fn(|| {
            let q = outbox.queue();
            let empty = q.items.is_empty();
            drop(q);
            (!empty).then(|| outbox.pop().unwrap())
        })
        .collect();
        assert_eq!(order, vec![1, 10, 11, 12, 13, 20, 21, 22, 30]);
    }
}
