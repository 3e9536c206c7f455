//! The few operating-system facilities the benchmark needs beyond std: the system-wide
//! monotonic clock (comparable between the two processes on one host), CPU time of the
//! process and of one thread, and page-aligned memory shared with an engine.
//!
//! Linux only: the calls are declared here against the C library std already links.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::os::raw::{c_int, c_long};
use std::ptr::NonNull;

#[repr(C)]
struct Timespec {
    tv_sec: c_long,
    tv_nsec: c_long,
}

#[repr(C)]
struct Timeval {
    tv_sec: c_long,
    tv_usec: c_long,
}

/// `struct rusage`: two timevals, then fourteen longs.
#[repr(C)]
struct Rusage {
    ru_utime: Timeval,
    ru_stime: Timeval,
    _rest: [c_long; 14],
}

extern "C" {
    fn clock_gettime(clock: c_int, ts: *mut Timespec) -> c_int;
    fn getrusage(who: c_int, usage: *mut Rusage) -> c_int;
}

const CLOCK_MONOTONIC: c_int = 1;
const CLOCK_THREAD_CPUTIME_ID: c_int = 3;
const RUSAGE_SELF: c_int = 0;

fn clock_ns(clock: c_int) -> u64 {
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime writes only into it.
    let rc = unsafe { clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime({clock}) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on this host (it is what
/// `std::time::Instant` reads on Linux, but as a number another process can compare).
pub fn mono_ns() -> u64 {
    clock_ns(CLOCK_MONOTONIC)
}

/// CPU time of the calling thread, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of this process (every thread), user and system, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cpu {
    pub user_us: u64,
    pub sys_us: u64,
}

impl Cpu {
    /// Now, for this process.
    pub fn now() -> Cpu {
        let mut u = Rusage {
            ru_utime: Timeval {
                tv_sec: 0,
                tv_usec: 0,
            },
            ru_stime: Timeval {
                tv_sec: 0,
                tv_usec: 0,
            },
            _rest: [0; 14],
        };
        // SAFETY: `u` is a valid, writable rusage; getrusage writes only into it.
        let rc = unsafe { getrusage(RUSAGE_SELF, &mut u) };
        assert_eq!(rc, 0, "getrusage failed");
        let us = |t: &Timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        Cpu {
            user_us: us(&u.ru_utime),
            sys_us: us(&u.ru_stime),
        }
    }

    /// The CPU used since `earlier`.
    pub fn since(self, earlier: Cpu) -> Cpu {
        Cpu {
            user_us: self.user_us.saturating_sub(earlier.user_us),
            sys_us: self.sys_us.saturating_sub(earlier.sys_us),
        }
    }

    /// User plus system, in seconds.
    pub fn secs(self) -> f64 {
        (self.user_us + self.sys_us) as f64 / 1e6
    }
}

/// A page-aligned, zeroed block of memory that an engine may read or write through its
/// address while the benchmark holds it (registered memory). Every access from the
/// benchmark goes through the methods below, whose callers promise that the engine is
/// not writing the same bytes at that moment (the page belongs to no live room).
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Region is plain memory; which thread touches which bytes when is governed by
// the room protocol (see the type's documentation), not by the owner.
unsafe impl Send for Region {}
// SAFETY: as above; shared references only hand out slices under the same contract.
unsafe impl Sync for Region {}

const ALIGN: usize = 4096;

impl Region {
    /// `len` zeroed bytes (`len` > 0), every page touched so that page faults are not
    /// measured later.
    pub fn new(len: usize) -> Region {
        assert!(len > 0);
        let layout = Layout::from_size_align(len, ALIGN).expect("region layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            handle_alloc_error(layout)
        };
        let r = Region { ptr, len };
        r.touch();
        r
    }

    fn touch(&self) {
        for off in (0..self.len).step_by(ALIGN) {
            // SAFETY: `off` < len, inside the allocation; nobody else holds it yet.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
        }
    }

    /// The first byte's address, for `BufferDesc::base`.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.len
    }

    fn check(&self, off: usize, n_words: usize) {
        assert!(off % 8 == 0, "unaligned word offset {off}");
        assert!(
            off.checked_add(n_words * 8).is_some_and(|e| e <= self.len),
            "words {off}+{n_words}x8 outside a region of {} bytes",
            self.len
        );
    }

    /// The `n_words` u64 words starting at byte `off`.
    ///
    /// # Safety
    /// No engine may be writing these bytes while the slice lives.
    pub unsafe fn words(&self, off: usize, n_words: usize) -> &[u64] {
        self.check(off, n_words);
        // SAFETY: in bounds and 8-aligned (checked; the base is page-aligned); the caller
        // promises no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off) as *const u64, n_words) }
    }

    /// Mutable `n_words` u64 words starting at byte `off`.
    ///
    /// # Safety
    /// Nobody else (engine or benchmark thread) may access these bytes while the slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn words_mut(&self, off: usize, n_words: usize) -> &mut [u64] {
        self.check(off, n_words);
        // SAFETY: in bounds and aligned (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off) as *mut u64, n_words) }
    }

    /// All bytes, mutable.
    ///
    /// # Safety
    /// As [`Region::words_mut`], for the whole region.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: the whole allocation; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).expect("region layout");
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}
