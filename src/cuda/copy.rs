//! The CUDA copy engine of the staging ring ([`crate::transport::staging`]): pinned host
//! slots (`cuMemHostAlloc`), asynchronous copies on a stream of the device's primary
//! context, and an event per copy for its completion. The context is pushed around each
//! driver call and popped after, so the calling thread is left as it was.

use std::io;

use super::driver::{self, Context, CuHandle, Driver, EVENT_DISABLE_TIMING, STREAM_NON_BLOCKING};
use crate::error::Result;
use crate::transport::staging::{CopyEngine, Ring};

/// Slots of a staging ring.
pub const SLOTS: usize = 4;
/// Bytes of a staging slot, at least (a slot holds at least one page).
pub const SLOT_BYTES: usize = 1 << 20;

/// Copies between one device's memory and pinned host memory, on a stream of its own.
pub struct CudaCopy {
    d: &'static Driver,
    ctx: Context,
    stream: CuHandle,
    device: u32,
}

// SAFETY: the stream handle is used only through the driver, which is thread-safe; a
// CudaCopy is used by one thread at a time (it is not Sync).
unsafe impl Send for CudaCopy {}

fn io_err(what: &str, e: String) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

impl CudaCopy {
    /// A copy engine for device `device`, loading the driver if needed.
    pub fn new(device: u32) -> Result<CudaCopy> {
        let d = driver::load()?;
        let ctx = d.primary_context(device)?;
        let mut stream: CuHandle = std::ptr::null_mut();
        d.with_context(ctx, || {
            // SAFETY: writes one stream handle, in the device's context.
            d.check(unsafe { (d.cuStreamCreate)(&mut stream, STREAM_NON_BLOCKING) })
        })?
        .map_err(|e| crate::err!(TransportUnavailable, "cuStreamCreate failed: {e}"))?;
        Ok(CudaCopy {
            d,
            ctx,
            stream,
            device,
        })
    }

    /// The device it copies to and from.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Runs a driver call in the device's context; `what` names it in errors.
    fn call(&self, what: &str, f: impl FnOnce() -> driver::CuResult) -> io::Result<()> {
        let r = self
            .d
            .with_context(self.ctx, f)
            .map_err(|e| io_err(what, e.to_string()))?;
        self.d.check(r).map_err(|e| io_err(what, e))
    }

    /// An event recorded on the stream after the work issued so far.
    /// An event behind the copy just issued. If none can be made, the stream is waited
    /// for before the error returns: a caller that sees an error must be able to take
    /// the copy as over (the room's io count drops, the slot is reused or freed).
    fn record(&self) -> io::Result<Event> {
        let mut ev: CuHandle = std::ptr::null_mut();
        // SAFETY: writes one event handle.
        let made = self.call("cuEventCreate", || unsafe {
            (self.d.cuEventCreate)(&mut ev, EVENT_DISABLE_TIMING)
        });
        // SAFETY: a live event and stream of this context.
        let recorded = made.and_then(|()| {
            self.call("cuEventRecord", || unsafe {
                (self.d.cuEventRecord)(ev, self.stream)
            })
        });
        match recorded {
            Ok(()) => Ok(Event(ev)),
            Err(e) => {
                if !ev.is_null() {
                    // SAFETY: the event made above, destroyed once.
                    let _ = self.call("cuEventDestroy", || unsafe {
                        (self.d.cuEventDestroy_v2)(ev)
                    });
                }
                // SAFETY: our live stream.
                let _ = self.call("cuStreamSynchronize", || unsafe {
                    (self.d.cuStreamSynchronize)(self.stream)
                });
                Err(e)
            }
        }
    }
}

impl Drop for CudaCopy {
    fn drop(&mut self) {
        // SAFETY: the stream is ours; every copy on it was waited for (the ring returns
        // only after its copies completed).
        let _ = self.call("cuStreamDestroy", || unsafe {
            (self.d.cuStreamDestroy_v2)(self.stream)
        });
    }
}

/// A pinned host buffer from `cuMemHostAlloc`, freed on drop.
pub struct Pinned {
    d: &'static Driver,
    ptr: usize,
    len: usize,
}

// SAFETY: plain host memory owned by this value.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once; no copy is pending (the ring
        // waits for every copy it issued before it can be dropped).
        let _ = unsafe { (self.d.cuMemFreeHost)(self.ptr as *mut std::ffi::c_void) };
    }
}

/// One copy's completion: an event, destroyed once waited for.
pub struct Event(CuHandle);

impl CopyEngine for CudaCopy {
    type Slot = Pinned;
    type Done = Event;

    fn alloc(&self, len: usize) -> io::Result<Pinned> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer to `len` bytes of pinned host memory.
        self.call("cuMemHostAlloc", || unsafe {
            (self.d.cuMemHostAlloc)(&mut p, len, 0)
        })?;
        if p.is_null() {
            return Err(io::Error::other("cuMemHostAlloc returned NULL"));
        }
        Ok(Pinned {
            d: self.d,
            ptr: p as usize,
            len,
        })
    }

    fn bytes<'a>(&self, slot: &'a mut Pinned) -> &'a mut [u8] {
        // SAFETY: `len` bytes of pinned host memory owned by the slot, borrowed mutably
        // through it; no copy is pending on it (the ring's contract).
        unsafe { std::slice::from_raw_parts_mut(slot.ptr as *mut u8, slot.len) }
    }

    unsafe fn to_host(
        &self,
        src: usize,
        slot: &mut Pinned,
        at: usize,
        len: usize,
    ) -> io::Result<Event> {
        debug_assert!(at + len <= slot.len);
        // SAFETY: the caller guarantees the device range and `at..at + len` of the slot
        // until the event completes.
        self.call("cuMemcpyDtoHAsync", || unsafe {
            (self.d.cuMemcpyDtoHAsync_v2)((slot.ptr + at) as *mut _, src as u64, len, self.stream)
        })?;
        self.record()
    }

    unsafe fn to_device(&self, slot: &Pinned, len: usize, dst: usize) -> io::Result<Event> {
        debug_assert!(len <= slot.len);
        // SAFETY: as in to_host.
        self.call("cuMemcpyHtoDAsync", || unsafe {
            (self.d.cuMemcpyHtoDAsync_v2)(dst as u64, slot.ptr as *const _, len, self.stream)
        })?;
        self.record()
    }

    fn wait(&self, done: Event) -> io::Result<()> {
        // SAFETY: a live event of this context, destroyed once, after it completed.
        let r = self.call("cuEventSynchronize", || unsafe {
            (self.d.cuEventSynchronize)(done.0)
        });
        // SAFETY: as above.
        let _ = self.call("cuEventDestroy", || unsafe {
            (self.d.cuEventDestroy_v2)(done.0)
        });
        r
    }
}

/// The staging rings of one thread (a sender worker or a data connection's reader), one
/// per device, made on first use and kept: pinned memory is allocated once.
#[derive(Default)]
pub struct Rings {
    rings: Vec<Ring<CudaCopy>>,
}

impl Rings {
    /// The ring of `device`, with slots of at least `min_slot` bytes (a ring with
    /// smaller slots is replaced, once its copies completed, which they have between
    /// calls).
    pub fn get(&mut self, device: u32, min_slot: usize) -> io::Result<&mut Ring<CudaCopy>> {
        let at = self
            .rings
            .iter()
            .position(|r| r.engine().device() == device);
        if let Some(i) = at.filter(|&i| self.rings[i].slot_len() >= min_slot) {
            return Ok(&mut self.rings[i]);
        }
        if let Some(i) = at {
            self.rings.swap_remove(i);
        }
        let engine = CudaCopy::new(device).map_err(|e| io::Error::other(e.to_string()))?;
        self.rings
            .push(Ring::new(engine, SLOTS, min_slot.max(SLOT_BYTES))?);
        Ok(self.rings.last_mut().expect("just pushed"))
    }
}
