//! The C log sink: its level enum and callback types, and the bridge that turns a C
//! callback and its context into the engine's [`Sink`].

use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;

use crate::log::{Level, Sink};

/// Log levels passed to a log sink, most severe first.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_log_level {
    /// Something failed.
    KVXFER_LOG_ERROR = 1,
    /// A room failed, a peer was lost: handled, but worth an operator's eye.
    KVXFER_LOG_WARN = 2,
    /// Lifecycle: engine start and stop, peers connected.
    KVXFER_LOG_INFO = 3,
    /// Per-room detail.
    KVXFER_LOG_DEBUG = 4,
    /// Per-chunk detail.
    KVXFER_LOG_TRACE = 5,
}

impl From<Level> for kvxfer_log_level {
    fn from(l: Level) -> Self {
        match l {
            Level::Error => kvxfer_log_level::KVXFER_LOG_ERROR,
            Level::Warn => kvxfer_log_level::KVXFER_LOG_WARN,
            Level::Info => kvxfer_log_level::KVXFER_LOG_INFO,
            Level::Debug => kvxfer_log_level::KVXFER_LOG_DEBUG,
            Level::Trace => kvxfer_log_level::KVXFER_LOG_TRACE,
        }
    }
}

/// A log sink: called with the `ctx` given at registration, a level and one
/// NUL-terminated line (valid only during the call). It may be called from any library
/// thread, concurrently, so it must be thread-safe; it must not call back into the
/// engine that logs. It must return normally: a C++ sink must not throw (catch
/// everything inside it), and no sink may `longjmp` out; unwinding into the library is
/// undefined behaviour.
pub type kvxfer_log_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, level: kvxfer_log_level, message: *const c_char)>;

/// Releases a context the library was given ownership of, such as a log sink's `ctx`
/// (see `kvxfer_config_set_log_sink2`). Called once; like the callback it belongs to, it
/// must return normally (no exception, no `longjmp`).
pub type kvxfer_drop_fn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// A C sink: the callback, its context, and what releases the context.
struct CSink {
    f: unsafe extern "C" fn(*mut c_void, kvxfer_log_level, *const c_char),
    ctx: *mut c_void,
    drop: kvxfer_drop_fn,
}

impl CSink {
    fn call(&self, level: Level, line: &str) {
        let line = CString::new(line.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the sink contract of kvxfer_config_set_log_sink{,2}: `f` may be called
        // with `ctx` from any thread until `drop` runs; `line` outlives the call.
        unsafe { (self.f)(self.ctx, level.into(), line.as_ptr()) }
    }
}

impl Drop for CSink {
    /// The last user of the sink is gone: no call is in progress or can start (every
    /// caller held a reference), so the context is released, once.
    fn drop(&mut self) {
        if let Some(release) = self.drop {
            // SAFETY: the contract of kvxfer_config_set_log_sink2: `drop` is called
            // once with the `ctx` it came with, after the last call of `f`.
            unsafe { release(self.ctx) }
        }
    }
}

// SAFETY: the caller of kvxfer_config_set_log_sink{,2} promises that the callback, its
// `ctx` and `drop` may be used from any thread, the callback concurrently (documented
// on those functions).
unsafe impl Send for CSink {}
// SAFETY: as above.
unsafe impl Sync for CSink {}

/// The engine's sink for a C callback, or `None` (stderr) for a NULL `f`. The library
/// owns `ctx` from here on: `drop(ctx)` runs when the last clone of the returned sink is
/// dropped, or before this returns if `f` is NULL (nothing will use `ctx`).
///
/// # Safety
/// `f` and `drop` (each if not NULL) must keep the sink contract documented on
/// `kvxfer_config_set_log_sink2` for `ctx`.
pub(crate) unsafe fn c_sink(
    f: kvxfer_log_fn,
    ctx: *mut c_void,
    drop: kvxfer_drop_fn,
) -> Option<Sink> {
    let Some(f) = f else {
        if let Some(release) = drop {
            // SAFETY: as in CSink::drop; there is no callback, so no call to wait for.
            unsafe { release(ctx) }
        }
        return None;
    };
    let c = CSink { f, ctx, drop };
    Some(Arc::new(move |level: Level, line: &str| c.call(level, line)) as Sink)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// What a context saw: calls, drops, and calls that came after a drop.
    #[derive(Default)]
    struct Seen {
        calls: AtomicUsize,
        drops: AtomicUsize,
        late_calls: AtomicUsize,
    }

    unsafe extern "C" fn record(ctx: *mut c_void, _: kvxfer_log_level, _: *const c_char) {
        // SAFETY: every test passes a live `Seen` as ctx.
        let seen = unsafe { &*ctx.cast::<Seen>() };
        if seen.drops.load(Ordering::SeqCst) > 0 {
            seen.late_calls.fetch_add(1, Ordering::SeqCst);
        }
        seen.calls.fetch_add(1, Ordering::SeqCst);
    }

    unsafe extern "C" fn release(ctx: *mut c_void) {
        // SAFETY: as above.
        unsafe { &*ctx.cast::<Seen>() }
            .drops
            .fetch_add(1, Ordering::SeqCst);
    }

    fn ctx(seen: &Seen) -> *mut c_void {
        (seen as *const Seen).cast_mut().cast()
    }

    #[test]
    fn the_context_is_released_once_after_the_last_clone_and_its_last_call() {
        let seen = Seen::default();
        // SAFETY: `seen` outlives every use of the sink; `record` and `release` are
        // thread-safe.
        let sink = unsafe { c_sink(Some(record), ctx(&seen), Some(release)) }.unwrap();
        let clones: Vec<Sink> = (0..4).map(|_| sink.clone()).collect();
        drop(sink);
        std::thread::scope(|s| {
            for c in clones {
                s.spawn(move || {
                    for _ in 0..100 {
                        c(Level::Info, "line");
                    }
                });
            }
        });
        assert_eq!(seen.calls.load(Ordering::SeqCst), 400);
        assert_eq!(seen.drops.load(Ordering::SeqCst), 1);
        assert_eq!(seen.late_calls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_null_callback_releases_the_context_at_once_and_a_null_drop_releases_nothing() {
        let seen = Seen::default();
        // SAFETY: as above.
        assert!(unsafe { c_sink(None, ctx(&seen), Some(release)) }.is_none());
        assert_eq!(seen.drops.load(Ordering::SeqCst), 1);
        // SAFETY: as above.
        let sink = unsafe { c_sink(Some(record), ctx(&seen), None) }.unwrap();
        sink(Level::Warn, "x");
        drop(sink);
        assert_eq!(seen.drops.load(Ordering::SeqCst), 1);
        assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
    }
}
