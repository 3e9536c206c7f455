//! The panic boundary and the pointer checks. Every exported function's body is one of
//! the two macros below, and every pointer it receives goes through a check here before
//! it is used.

use std::any::Any;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::status::{clear_last_error, kvxfer_status, set_last_error};
use crate::err;
use crate::error::{Error, ErrorKind, Result};

/// Runs a fallible body under the panic boundary and turns its outcome into a status,
/// recording the message of a failure (or a panic) as this thread's last error.
macro_rules! ffi_status {
    ($body:block) => {
        $crate::ffi::boundary::status_call(|| -> $crate::error::Result<()> { $body })
    };
}

/// Runs an infallible body under the panic boundary, returning `$neutral` on a panic.
macro_rules! ffi_value {
    ($neutral:expr, $body:block) => {
        $crate::ffi::boundary::value_call($neutral, || $body)
    };
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error (panic caught at the C boundary): {what}")
}

#[doc(hidden)]
pub fn status_call(f: impl FnOnce() -> Result<()>) -> kvxfer_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            clear_last_error();
            kvxfer_status::KVXFER_OK
        }
        Ok(Err(e)) => {
            set_last_error(e.message());
            kvxfer_status::of(e.kind())
        }
        Err(p) => {
            set_last_error(&panic_message(p.as_ref()));
            kvxfer_status::of(ErrorKind::Panic)
        }
    }
}

#[doc(hidden)]
pub fn value_call<T>(neutral: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        set_last_error(&panic_message(p.as_ref()));
        neutral
    })
}

fn null(name: &str) -> Error {
    err!(NullPointer, "argument '{name}' is NULL")
}

/// A slice of `n` elements; `n == 0` gives an empty slice whatever `p` is.
///
/// # Safety
/// A non-NULL `p` with `n > 0` must point to `n` valid, initialized `T` for `'a`.
pub unsafe fn try_slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(err!(
            NullPointer,
            "argument '{name}' is NULL but its count is {n}"
        ));
    }
    if !p.is_aligned() {
        return Err(err!(InvalidArgument, "argument '{name}' is misaligned"));
    }
    if n.checked_mul(std::mem::size_of::<T>().max(1))
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(err!(
            InvalidArgument,
            "argument '{name}': count {n} is too large"
        ));
    }
    // SAFETY: non-NULL, aligned, size within isize::MAX; the caller guarantees `n`
    // initialized elements live for 'a.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A UTF-8 string from a NUL-terminated pointer that must not be NULL.
///
/// # Safety
/// A non-NULL `p` must point to a NUL-terminated string valid for `'a`.
pub unsafe fn try_str<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| err!(InvalidArgument, "argument '{name}' is not valid UTF-8"))
}

/// An output location that must not be NULL; write it only once the call succeeds.
pub fn try_out<'a, T>(p: *mut T, name: &str) -> Result<Out<'a, T>> {
    if p.is_null() {
        Err(null(name))
    } else if !p.is_aligned() {
        Err(err!(InvalidArgument, "argument '{name}' is misaligned"))
    } else {
        Ok(Out(p, std::marker::PhantomData))
    }
}

/// A checked, non-NULL, aligned output pointer.
pub struct Out<'a, T>(*mut T, std::marker::PhantomData<&'a mut T>);

impl<T: Copy> Out<'_, T> {
    /// Stores `v`.
    ///
    /// # Safety
    /// The pointer given to [`try_out`] must be valid for writes of `T`.
    pub unsafe fn write(self, v: T) {
        // SAFETY: non-NULL and aligned (checked in try_out); writable by the caller's
        // contract. `T: Copy`, so no destructor of the old value is skipped.
        unsafe { self.0.write(v) }
    }
}

/// Copies `s` into `buf` (capacity `len`) with a terminating NUL and stores its length
/// (without the NUL) in `out_n`. If `s` does not fit, nothing is copied, `out_n` receives
/// the length needed (without the NUL) and the result is `BufferTooSmall`.
///
/// # Safety
/// A non-NULL `buf` must be valid for `len` bytes of writes.
pub unsafe fn write_string(buf: *mut c_char, len: usize, out_n: *mut usize, s: &str) -> Result<()> {
    let out_n = try_out(out_n, "out_n")?;
    if buf.is_null() && len > 0 {
        return Err(err!(
            NullPointer,
            "argument 'buf' is NULL but its length is {len}"
        ));
    }
    if s.len() >= len {
        // SAFETY: out_n was checked; the caller's contract makes it writable.
        unsafe { out_n.write(s.len()) };
        return Err(err!(
            BufferTooSmall,
            "the result needs {} bytes plus the terminating NUL; the buffer holds {len}",
            s.len()
        ));
    }
    // SAFETY: `buf` is non-NULL (len > s.len() >= 0) and holds `len > s.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
        out_n.write(s.len());
    }
    Ok(())
}

/// Maps an opaque C handle type to the Rust object behind it. Handles are `Box`ed Rust
/// objects; `kvxfer_X_free(NULL)` is a no-op.
pub(crate) trait BoxHandle: Sized {
    /// The Rust object behind the handle.
    type Target;
    /// The handle's C name, for messages.
    const NAME: &'static str;

    /// Moves `t` to the heap and returns the handle.
    fn into_raw(t: Self::Target) -> *mut Self {
        Box::into_raw(Box::new(t)).cast()
    }

    /// Borrows the object behind a handle that must not be NULL.
    ///
    /// # Safety
    /// A non-NULL `p` must come from `into_raw` and not have been freed.
    unsafe fn try_borrow<'a>(p: *const Self) -> Result<&'a Self::Target> {
        // SAFETY: a live handle points to a `Target` made by `into_raw`.
        unsafe { p.cast::<Self::Target>().as_ref() }
            .ok_or_else(|| err!(NullPointer, "argument '{}' is NULL", Self::NAME))
    }

    /// Mutably borrows the object behind a handle that must not be NULL.
    ///
    /// # Safety
    /// As [`BoxHandle::try_borrow`], and no other reference to it may be live.
    unsafe fn try_borrow_mut<'a>(p: *mut Self) -> Result<&'a mut Self::Target> {
        // SAFETY: as try_borrow; exclusivity is the caller's contract.
        unsafe { p.cast::<Self::Target>().as_mut() }
            .ok_or_else(|| err!(NullPointer, "argument '{}' is NULL", Self::NAME))
    }

    /// Drops the object behind the handle; NULL is a no-op.
    ///
    /// # Safety
    /// A non-NULL `p` must come from `into_raw`, not have been freed, and not be used
    /// again.
    unsafe fn free(p: *mut Self) {
        if !p.is_null() {
            // SAFETY: `p` came from Box::into_raw of a Target and is freed only here.
            drop(unsafe { Box::from_raw(p.cast::<Self::Target>()) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_the_panic_status_with_a_message() {
        let st = status_call(|| panic!("boom in room 3"));
        assert_eq!(st, kvxfer_status::KVXFER_ERR_PANIC);
        let mut buf = [0 as c_char; 128];
        // SAFETY: buf holds 128 bytes.
        unsafe { super::super::status::kvxfer_last_error(buf.as_mut_ptr(), buf.len()) };
        // SAFETY: NUL-terminated by kvxfer_last_error.
        let msg = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
        assert!(msg.contains("boom in room 3"), "{msg}");
        assert_eq!(value_call(7, || panic!("x")), 7);
    }

    #[test]
    fn an_error_sets_the_message_and_a_success_clears_it() {
        let st = status_call(|| Err(err!(NotFound, "room 9 not found")));
        assert_eq!(st, kvxfer_status::KVXFER_ERR_NOT_FOUND);
        // SAFETY: NULL with 0 asks for the length.
        assert_eq!(
            unsafe { super::super::status::kvxfer_last_error(std::ptr::null_mut(), 0) },
            16
        );
        assert_eq!(status_call(|| Ok(())), kvxfer_status::KVXFER_OK);
        // SAFETY: as above.
        assert_eq!(
            unsafe { super::super::status::kvxfer_last_error(std::ptr::null_mut(), 0) },
            0
        );
    }

    #[test]
    fn null_and_oversized_slices_are_refused() {
        // SAFETY: NULL with count 0 never dereferences.
        assert!(unsafe { try_slice::<u32>(std::ptr::null(), 0, "p") }.is_ok());
        // SAFETY: NULL is checked before use.
        let e = unsafe { try_slice::<u32>(std::ptr::null(), 3, "pages") }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NullPointer);
        assert!(e.message().contains("pages"));
        let x = [0u32; 1];
        // SAFETY: the size check fires before any slice is built.
        let e = unsafe { try_slice(x.as_ptr(), usize::MAX / 2, "pages") }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
}
