//! The ring with a host-memory copy engine whose copies run on a thread of their own, in
//! the order issued, and can be held back: ordering, back-pressure, aborts and draining.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use super::*;

/// What the copy thread shares with the tests.
#[derive(Default)]
struct Shared {
    /// Copies issued and not yet completed.
    outstanding: AtomicUsize,
    /// The most outstanding at once.
    max_outstanding: AtomicUsize,
    /// Copies issued, in order: (to device?, device address, len).
    issued: Mutex<Vec<(bool, usize, usize)>>,
    /// While true, the copy thread holds every copy back.
    held: Mutex<bool>,
    release: Condvar,
    /// The next copy to device fails.
    fail_next: AtomicBool,
}

/// A copy engine over host memory: "device" addresses are host addresses, copies run
/// on one thread in issue order.
struct HostCopy {
    shared: Arc<Shared>,
    tx: mpsc::Sender<(usize, usize, usize, mpsc::Sender<io::Result<()>>)>,
}

impl HostCopy {
    fn new() -> (HostCopy, Arc<Shared>) {
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel::<(usize, usize, usize, mpsc::Sender<io::Result<()>>)>();
        let s = shared.clone();
        std::thread::spawn(move || {
            for (src, dst, len, done) in rx {
                let mut held = s.held.lock().unwrap();
                while *held {
                    held = s.release.wait(held).unwrap();
                }
                drop(held);
                // SAFETY: the ring's contract: both ranges stay valid and untouched
                // until the copy is waited for; the tests own both.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
                s.outstanding.fetch_sub(1, Ordering::SeqCst);
                let _ = done.send(Ok(()));
            }
        });
        (
            HostCopy {
                shared: shared.clone(),
                tx,
            },
            shared,
        )
    }

    fn issue(&self, to_device: bool, src: usize, dst: usize, len: usize) -> io::Result<Done> {
        let dev = if to_device { dst } else { src };
        self.shared
            .issued
            .lock()
            .unwrap()
            .push((to_device, dev, len));
        if to_device && self.shared.fail_next.swap(false, Ordering::SeqCst) {
            return Err(io::Error::other("injected copy failure"));
        }
        let n = self.shared.outstanding.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.max_outstanding.fetch_max(n, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel();
        self.tx.send((src, dst, len, tx)).unwrap();
        Ok(Done(rx))
    }
}

struct Done(mpsc::Receiver<io::Result<()>>);

impl CopyEngine for HostCopy {
    type Slot = Vec<u8>;
    type Done = Done;

    fn alloc(&self, len: usize) -> io::Result<Vec<u8>> {
        Ok(vec![0xEE; len])
    }

    fn bytes<'a>(&self, slot: &'a mut Vec<u8>) -> &'a mut [u8] {
        slot
    }

    unsafe fn to_host(
        &self,
        src: usize,
        slot: &mut Vec<u8>,
        at: usize,
        len: usize,
    ) -> io::Result<Done> {
        self.issue(false, src, slot.as_mut_ptr() as usize + at, len)
    }

    unsafe fn to_device(&self, slot: &Vec<u8>, len: usize, dst: usize) -> io::Result<Done> {
        self.issue(true, slot.as_ptr() as usize, dst, len)
    }

    fn wait(&self, done: Done) -> io::Result<()> {
        done.0.recv().unwrap()
    }
}

fn hold(s: &Shared, on: bool) {
    *s.held.lock().unwrap() = on;
    s.release.notify_all();
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn sending_writes_every_piece_in_order_byte_exact_after_its_own_copy() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 3, 64).unwrap();
    let dev = pattern(1000, 7);
    // Scattered pieces of several lengths, some a whole slot.
    let pieces: Vec<Vec<(usize, usize)>> =
        [(0, 64), (200, 10), (64, 64), (900, 64), (500, 1), (10, 33)]
            .iter()
            .map(|&(off, len)| vec![(dev.as_ptr() as usize + off, len)])
            .collect();
    let mut got: Vec<(usize, Vec<u8>)> = Vec::new();
    // SAFETY: `dev` outlives the call.
    let flow = unsafe {
        ring.send(&pieces, &|| true, &mut |i, b| {
            got.push((i, b.to_vec()));
            Ok(Flow::Go)
        })
    }
    .unwrap();
    assert_eq!(flow, Flow::Go);
    assert_eq!(got.len(), pieces.len());
    for (k, (i, bytes)) in got.iter().enumerate() {
        assert_eq!(*i, k, "in order");
        let (src, len) = pieces[k][0];
        let off = src - dev.as_ptr() as usize;
        assert_eq!(bytes[..], dev[off..off + len], "piece {k}");
    }
    assert!(shared.max_outstanding.load(Ordering::SeqCst) <= 3);
    assert_eq!(shared.outstanding.load(Ordering::SeqCst), 0);
}

#[test]
fn a_piece_of_several_ranges_is_packed_into_one_slot_in_order() {
    let (engine, _) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 64).unwrap();
    let dev = pattern(512, 11);
    let at = |off: usize, len: usize| (dev.as_ptr() as usize + off, len);
    let pieces = vec![
        vec![at(100, 10), at(0, 20), at(300, 34)],
        vec![at(7, 64)],
        vec![at(1, 1)],
    ];
    let mut got = Vec::new();
    // SAFETY: `dev` outlives the call.
    unsafe {
        ring.send(&pieces, &|| true, &mut |i, b| {
            got.push((i, b.to_vec()));
            Ok(Flow::Go)
        })
    }
    .unwrap();
    let want0: Vec<u8> = [&dev[100..110], &dev[0..20], &dev[300..334]].concat();
    assert_eq!(got[0], (0, want0));
    assert_eq!(got[1], (1, dev[7..71].to_vec()));
    assert_eq!(got[2], (2, dev[1..2].to_vec()));
}

#[test]
fn sending_copies_ahead_of_the_socket_at_most_one_slot_per_piece_and_never_more_than_the_ring() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 4, 16).unwrap();
    let dev = pattern(16 * 20, 1);
    let pieces: Vec<Vec<(usize, usize)>> = (0..20)
        .map(|i| vec![(dev.as_ptr() as usize + i * 16, 16)])
        .collect();
    let mut issued_at_write = Vec::new();
    // SAFETY: `dev` outlives the call.
    unsafe {
        ring.send(&pieces, &|| true, &mut |_, _| {
            issued_at_write.push(shared.issued.lock().unwrap().len());
            Ok(Flow::Go)
        })
    }
    .unwrap();
    // When piece 0 is written, the copies of pieces 0..4 were issued (overlap), and never
    // more than 4 ahead of the writes.
    assert_eq!(issued_at_write[0], 4);
    for (k, n) in issued_at_write.iter().enumerate() {
        assert!(*n <= k + 4, "piece {k}: {n} issued");
    }
    assert_eq!(shared.max_outstanding.load(Ordering::SeqCst), 4);
}

#[test]
fn a_room_that_ends_while_sending_issues_no_more_copies_and_drains_the_ones_in_flight() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 8).unwrap();
    let dev = pattern(8 * 10, 3);
    let pieces: Vec<Vec<(usize, usize)>> = (0..10)
        .map(|i| vec![(dev.as_ptr() as usize + i * 8, 8)])
        .collect();
    let live = AtomicBool::new(true);
    let mut written = 0;
    // SAFETY: `dev` outlives the call.
    let flow = unsafe {
        ring.send(&pieces, &|| live.load(Ordering::SeqCst), &mut |_, _| {
            written += 1;
            if written == 3 {
                live.store(false, Ordering::SeqCst);
            }
            Ok(Flow::Go)
        })
    }
    .unwrap();
    assert_eq!(flow, Flow::Stop);
    // Two slots: when piece 2 was written, piece 3 and 4 at most were issued.
    let issued = shared.issued.lock().unwrap().len();
    assert!(issued <= 5, "{issued} copies issued after the room ended");
    assert_eq!(written, 3, "nothing written after the room ended");
    assert_eq!(
        shared.outstanding.load(Ordering::SeqCst),
        0,
        "drained on return"
    );

    // The writer may stop it too.
    let (engine, _) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 8).unwrap();
    let mut calls = 0;
    // SAFETY: `dev` outlives the call.
    let flow = unsafe {
        ring.send(&pieces, &|| true, &mut |_, _| {
            calls += 1;
            Ok(Flow::Stop)
        })
    }
    .unwrap();
    assert_eq!((flow, calls), (Flow::Stop, 1));
}

/// A room's io count as the receiving side sees it: each guard counts one copy in.
#[derive(Default)]
struct Room {
    io: AtomicUsize,
    ended: AtomicBool,
}

struct Guard<'a>(&'a AtomicUsize);

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Room {
    fn enter(&self) -> Option<Guard<'_>> {
        self.io.fetch_add(1, Ordering::SeqCst);
        let g = Guard(&self.io);
        (!self.ended.load(Ordering::SeqCst)).then_some(g)
    }
}

/// A socket as a byte stream read in slot-sized reads.
fn stream(bytes: &[u8]) -> impl FnMut(&mut [u8]) -> io::Result<bool> + '_ {
    let mut at = 0;
    move |buf: &mut [u8]| {
        buf.copy_from_slice(&bytes[at..at + buf.len()]);
        at += buf.len();
        Ok(true)
    }
}

#[test]
fn receiving_lands_every_byte_in_order_through_the_slots_with_long_pieces_split() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 3, 32).unwrap();
    let mut dev = vec![0u8; 1000];
    let base = dev.as_mut_ptr() as usize;
    let pieces = [
        (base + 500, 100),
        (base, 32),
        (base + 40, 7),
        (base + 800, 150),
    ];
    let total: usize = pieces.iter().map(|p| p.1).sum();
    let wire = pattern(total, 9);
    let room = Room::default();
    // SAFETY: `dev` outlives the call and nothing else writes it.
    let landed = unsafe { ring.recv(&pieces, &mut stream(&wire), &|| room.enter()) }.unwrap();
    assert_eq!(landed, total);
    let mut at = 0;
    for (dst, len) in pieces {
        let off = dst - base;
        assert_eq!(dev[off..off + len], wire[at..at + len]);
        at += len;
    }
    assert_eq!(dev[100..200], [0u8; 100], "nothing outside the pieces");
    assert!(shared.max_outstanding.load(Ordering::SeqCst) <= 3);
    assert_eq!(room.io.load(Ordering::SeqCst), 0);
}

#[test]
fn receiving_holds_the_room_undrained_while_a_copy_into_it_is_queued_or_running() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 16).unwrap();
    let mut dev = vec![0u8; 64];
    let base = dev.as_mut_ptr() as usize;
    let wire = pattern(64, 2);
    let room = Arc::new(Room::default());
    hold(&shared, true);
    let saw_undrained = Arc::new(AtomicBool::new(false));
    let (r2, s2, seen) = (room.clone(), shared.clone(), saw_undrained.clone());
    let watcher = std::thread::spawn(move || {
        // While copies are held back, the room counts them in.
        while s2.issued.lock().unwrap().len() < 2 {
            std::thread::yield_now();
        }
        seen.store(r2.io.load(Ordering::SeqCst) >= 2, Ordering::SeqCst);
        hold(&s2, false);
    });
    // SAFETY: `dev` outlives the call.
    let landed = unsafe { ring.recv(&[(base, 64)], &mut stream(&wire), &|| room.enter()) }.unwrap();
    watcher.join().unwrap();
    assert!(
        saw_undrained.load(Ordering::SeqCst),
        "queued copies count as io"
    );
    assert_eq!(landed, 64);
    assert_eq!(
        room.io.load(Ordering::SeqCst),
        0,
        "drained once every copy completed"
    );
    assert_eq!(dev, wire);
    // Back-pressure: two slots, so never more than two copies queued.
    assert_eq!(shared.max_outstanding.load(Ordering::SeqCst), 2);
}

#[test]
fn a_room_that_ends_while_receiving_gets_no_further_copy_and_its_pages_keep_their_poison() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 16).unwrap();
    let mut dev = vec![0xAAu8; 128];
    let base = dev.as_mut_ptr() as usize;
    let wire = pattern(128, 4);
    let room = Room::default();
    let mut reads = 0;
    let mut inner = stream(&wire);
    let mut read = |b: &mut [u8]| {
        reads += 1;
        if reads == 3 {
            // The room is aborted while the third slot is being read.
            room.ended.store(true, Ordering::SeqCst);
        }
        inner(b)
    };
    // SAFETY: `dev` outlives the call.
    let landed = unsafe { ring.recv(&[(base, 128)], &mut read, &|| room.enter()) }.unwrap();
    assert_eq!(landed, 32, "two slots landed before the abort");
    assert_eq!(dev[..32], wire[..32]);
    assert!(
        dev[32..].iter().all(|&b| b == 0xAA),
        "poison intact after the abort"
    );
    let to_device = shared.issued.lock().unwrap().iter().filter(|c| c.0).count();
    assert_eq!(to_device, 2, "no copy issued for the ended room");
    assert_eq!(room.io.load(Ordering::SeqCst), 0);

    // A read cut short by the room's end also stops it.
    let (engine, _) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 16).unwrap();
    let room = Room::default();
    let mut n = 0;
    // SAFETY: `dev` outlives the call.
    let landed = unsafe {
        ring.recv(
            &[(base, 64)],
            &mut |_b| {
                n += 1;
                Ok(n == 1)
            },
            &|| room.enter(),
        )
    }
    .unwrap();
    assert_eq!(landed, 16);
}

#[test]
fn a_failed_copy_is_an_error_after_the_copies_before_it_drained() {
    let (engine, shared) = HostCopy::new();
    let mut ring = Ring::new(engine, 2, 8).unwrap();
    let mut dev = vec![0u8; 32];
    let base = dev.as_mut_ptr() as usize;
    let wire = pattern(32, 5);
    let room = Room::default();
    let mut reads = 0;
    let mut inner = stream(&wire);
    let mut read = |b: &mut [u8]| {
        reads += 1;
        if reads == 2 {
            shared.fail_next.store(true, Ordering::SeqCst);
        }
        inner(b)
    };
    // SAFETY: `dev` outlives the call.
    let e = unsafe { ring.recv(&[(base, 32)], &mut read, &|| room.enter()) }.unwrap_err();
    assert!(e.to_string().contains("injected"));
    assert_eq!(room.io.load(Ordering::SeqCst), 0);
    assert_eq!(shared.outstanding.load(Ordering::SeqCst), 0);
}
