//! The staging ring: device memory moves over TCP through a bounded ring of pinned host
//! slots, allocated once and reused. Sending, device-to-host copies of the next slots
//! run while the socket writes the slot before them; receiving, the socket reads the
//! next slot while the host-to-device copies of the slots before it run.
//!
//! The copies are a [`CopyEngine`]'s: the CUDA driver's ([`crate::cuda::copy`]) in the
//! engine, a host-memory one in the unit tests below, so the same ring logic (ordering,
//! back-pressure, aborts, draining) is tested on any machine.
//!
//! The rules the ring keeps:
//! - A slot is reused only after its previous copy completed (back-pressure: at most
//!   `slots` copies are queued or running).
//! - Sending, a piece is written only after its own copy completed, and in order.
//! - Receiving, a copy into device memory is issued only while the room is live
//!   (`enter` gives a guard), and the guard is held until that copy completed: a room
//!   reports drained only once no copy into its pages is queued or running. Once the
//!   room ended, no further copy is issued.
//! - Every call returns only after each copy it issued completed, whatever happened.

use std::collections::VecDeque;
use std::io;

/// Asynchronous copies between device memory and pinned host slots, completed in the
/// order issued (one stream).
pub trait CopyEngine {
    /// A pinned host buffer.
    type Slot;
    /// The completion of one issued copy.
    type Done;

    /// A pinned host buffer of `len` bytes (allocated once per ring slot).
    fn alloc(&self, len: usize) -> io::Result<Self::Slot>;

    /// The bytes of `slot` (no copy into or out of it is pending).
    fn bytes<'a>(&self, slot: &'a mut Self::Slot) -> &'a mut [u8];

    /// Issues a copy of `len` bytes from device address `src` into `slot` at byte `at`.
    ///
    /// # Safety
    /// `src..src + len` is device memory that stays valid until the copy completed,
    /// `at + len` is at most the slot's length, and the slot is not used until
    /// [`wait`](Self::wait) returned for the copy.
    unsafe fn to_host(
        &self,
        src: usize,
        slot: &mut Self::Slot,
        at: usize,
        len: usize,
    ) -> io::Result<Self::Done>;

    /// Issues a copy of the first `len` bytes of `slot` to device address `dst`.
    ///
    /// # Safety
    /// As [`to_host`](Self::to_host), for `dst..dst + len`, which no one else writes
    /// meanwhile.
    unsafe fn to_device(&self, slot: &Self::Slot, len: usize, dst: usize)
        -> io::Result<Self::Done>;

    /// Waits until the copy completed (or failed).
    fn wait(&self, done: Self::Done) -> io::Result<()>;
}

/// What a sending ring's writer says after a piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Go on.
    Go,
    /// The room ended: write nothing more.
    Stop,
}

/// A bounded ring of pinned host slots and the copy engine that fills and empties them.
pub struct Ring<E: CopyEngine> {
    engine: E,
    slots: Vec<Option<E::Slot>>,
    slot_len: usize,
}

/// A slot's pending copy: which slot, and its completion.
struct Pending<D, X> {
    slot: usize,
    done: D,
    extra: X,
}

impl<E: CopyEngine> Ring<E> {
    /// A ring of `slots` slots of `slot_len` bytes each, allocated now.
    pub fn new(engine: E, slots: usize, slot_len: usize) -> io::Result<Self> {
        assert!(slots > 0 && slot_len > 0, "a ring has slots");
        let slots = (0..slots)
            .map(|_| engine.alloc(slot_len).map(Some))
            .collect::<io::Result<_>>()?;
        Ok(Ring {
            engine,
            slots,
            slot_len,
        })
    }

    /// Bytes of one slot: the longest piece the ring moves.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// The copy engine.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// Waits for `p`'s copy and gives its slot back; the first error wins in `err`.
    fn complete<X>(&mut self, p: Pending<E::Done, X>, err: &mut Option<io::Error>) -> X {
        if let Err(e) = self.engine.wait(p.done) {
            err.get_or_insert(e);
        }
        p.extra
    }

    /// Sends `pieces` in order, each a list of device ranges (address, length) of at
    /// most [`slot_len`](Self::slot_len) bytes together: a piece's ranges are copied one
    /// after the other into a slot, up to a slot per piece ahead, and the slot's bytes
    /// are handed to `write(i, bytes)` once every copy of the piece completed. `live` is
    /// asked before each piece's copies are issued; once it says no (or `write` says
    /// [`Flow::Stop`]), nothing more is issued or written. Returns once every copy issued
    /// completed: `Ok(Flow::Go)` if every piece was written.
    ///
    /// # Safety
    /// Every range is device memory valid for the duration of the call.
    pub unsafe fn send(
        &mut self,
        pieces: &[Vec<(usize, usize)>],
        live: &dyn Fn() -> bool,
        write: &mut dyn FnMut(usize, &[u8]) -> io::Result<Flow>,
    ) -> io::Result<Flow> {
        let total = |p: &[(usize, usize)]| p.iter().map(|r| r.1).sum::<usize>();
        assert!(pieces.iter().all(|p| total(p) <= self.slot_len));
        let n = self.slots.len();
        let mut pending: VecDeque<Pending<Vec<E::Done>, usize>> = VecDeque::with_capacity(n);
        let (mut next, mut flow, mut err) = (0, Flow::Go, None);
        loop {
            // Fill every free slot with the next pieces' copies.
            while flow == Flow::Go && err.is_none() && next < pieces.len() && pending.len() < n {
                if !live() {
                    flow = Flow::Stop;
                    break;
                }
                let slot = next % n;
                let s = self.slots[slot]
                    .as_mut()
                    .expect("a free slot holds its buffer");
                let mut done = Vec::with_capacity(pieces[next].len());
                let mut at = 0;
                for &(src, len) in &pieces[next] {
                    // SAFETY: the caller guarantees the range; the slot is free (its
                    // earlier copies were waited for, in order), `at + len` is within it
                    // (the piece fits, asserted above), and it is not used until these
                    // copies are.
                    match unsafe { self.engine.to_host(src, s, at, len) } {
                        Ok(d) => done.push(d),
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                    at += len;
                }
                pending.push_back(Pending {
                    slot,
                    done,
                    extra: next,
                });
                next += 1;
            }
            let Some(p) = pending.pop_front() else { break };
            let slot = p.slot;
            let i = p.extra;
            for d in p.done {
                if let Err(e) = self.engine.wait(d) {
                    err.get_or_insert(e);
                }
            }
            if flow == Flow::Go && err.is_none() {
                let s = self.slots[slot].as_mut().expect("a slot holds its buffer");
                let bytes = &self.engine.bytes(s)[..total(&pieces[i])];
                match write(i, bytes) {
                    Ok(Flow::Go) => {}
                    Ok(Flow::Stop) => flow = Flow::Stop,
                    Err(e) => err = Some(e),
                }
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(flow),
        }
    }

    /// Receives `pieces` (device address and length, any length: longer ones go through
    /// several slots) in order: `read` fills a slot with the next bytes of the stream
    /// (`Ok(false)`: the room ended mid-read, the caller drops the rest), then `enter`
    /// is asked for the room's guard; with it, the copy to device memory is issued and
    /// the guard held until the copy completed; without it (the room ended), nothing
    /// more is issued. A slot is refilled only after its copy completed. Returns, once
    /// every copy issued completed, how many bytes went to device memory (the first
    /// ones, in order).
    ///
    /// # Safety
    /// Every piece is device memory valid for the duration of the call, which nothing
    /// else writes while a guard from `enter` is held.
    pub unsafe fn recv<G>(
        &mut self,
        pieces: &[(usize, usize)],
        read: &mut dyn FnMut(&mut [u8]) -> io::Result<bool>,
        enter: &dyn Fn() -> Option<G>,
    ) -> io::Result<usize> {
        let n = self.slots.len();
        let mut pending: VecDeque<Pending<E::Done, G>> = VecDeque::with_capacity(n);
        let (mut landed, mut k, mut err) = (0usize, 0usize, None);
        'pieces: for &(dst, len) in pieces {
            let mut at = 0;
            while at < len {
                let chunk = (len - at).min(self.slot_len);
                let slot = k % n;
                k += 1;
                // Back-pressure: the slot's earlier copy completes (its guard drops).
                if pending.len() == n {
                    let p = pending.pop_front().expect("n pending");
                    debug_assert_eq!(p.slot, slot);
                    drop(self.complete(p, &mut err));
                }
                if err.is_some() {
                    break 'pieces;
                }
                let s = self.slots[slot]
                    .as_mut()
                    .expect("a free slot holds its buffer");
                match read(&mut self.engine.bytes(s)[..chunk]) {
                    Ok(true) => {}
                    Ok(false) => break 'pieces,
                    Err(e) => {
                        err = Some(e);
                        break 'pieces;
                    }
                }
                // Counted in before the copy is issued, held until it completed.
                let Some(guard) = enter() else {
                    break 'pieces;
                };
                // SAFETY: the caller guarantees the piece (`at + chunk <= len`); the
                // slot's bytes were just read and stay untouched until the copy is
                // waited for.
                match unsafe { self.engine.to_device(s, chunk, dst + at) } {
                    Ok(done) => pending.push_back(Pending {
                        slot,
                        done,
                        extra: guard,
                    }),
                    Err(e) => {
                        err = Some(e);
                        break 'pieces;
                    }
                }
                landed += chunk;
                at += chunk;
            }
        }
        while let Some(p) = pending.pop_front() {
            drop(self.complete(p, &mut err));
        }
        match err {
            Some(e) => Err(e),
            None => Ok(landed),
        }
    }
}

#[cfg(test)]
mod tests;
