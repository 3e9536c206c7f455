//! Status codes, their names, the per-thread last error message and the version.

use std::cell::RefCell;
use std::ffi::c_char;

use crate::error::ErrorKind;

/// The result of every fallible call. `KVXFER_OK` is zero; every other value names one
/// class of failure, and the per-thread message from `kvxfer_last_error` says exactly
/// what went wrong. Values are never reused or renumbered.
#[repr(i32)]
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_status {
    /// Success.
    KVXFER_OK = 0,
    /// An argument is out of range or malformed.
    KVXFER_ERR_INVALID_ARGUMENT = 1,
    /// A pointer that must not be NULL was NULL.
    KVXFER_ERR_NULL_POINTER = 2,
    /// The room does not exist (never created, or cleared).
    KVXFER_ERR_NOT_FOUND = 3,
    /// The room id is already present in this engine.
    KVXFER_ERR_ALREADY_EXISTS = 4,
    /// The call is for the other role (prefill vs decode).
    KVXFER_ERR_WRONG_ROLE = 5,
    /// The call is not valid in the current state (of the room or the engine).
    KVXFER_ERR_WRONG_STATE = 6,
    /// Not supported by this build or configuration.
    KVXFER_ERR_UNSUPPORTED = 7,
    /// An output buffer is too small; the length output holds the size needed.
    KVXFER_ERR_BUFFER_TOO_SMALL = 8,
    /// Unknown configuration key.
    KVXFER_ERR_UNKNOWN_KEY = 9,
    /// Bad configuration value (or a required key is missing).
    KVXFER_ERR_BAD_VALUE = 10,
    /// The requested transport cannot be used on this machine.
    KVXFER_ERR_TRANSPORT_UNAVAILABLE = 11,
    /// An operating-system I/O call failed.
    KVXFER_ERR_IO = 12,
    /// A panic inside the library was caught at the boundary (a library bug).
    KVXFER_ERR_PANIC = 13,
}

impl kvxfer_status {
    /// The status for an error kind.
    pub(crate) fn of(kind: ErrorKind) -> kvxfer_status {
        use kvxfer_status::*;
        match kind {
            ErrorKind::InvalidArgument => KVXFER_ERR_INVALID_ARGUMENT,
            ErrorKind::NullPointer => KVXFER_ERR_NULL_POINTER,
            ErrorKind::NotFound => KVXFER_ERR_NOT_FOUND,
            ErrorKind::AlreadyExists => KVXFER_ERR_ALREADY_EXISTS,
            ErrorKind::WrongRole => KVXFER_ERR_WRONG_ROLE,
            ErrorKind::WrongState => KVXFER_ERR_WRONG_STATE,
            ErrorKind::Unsupported => KVXFER_ERR_UNSUPPORTED,
            ErrorKind::BufferTooSmall => KVXFER_ERR_BUFFER_TOO_SMALL,
            ErrorKind::UnknownKey => KVXFER_ERR_UNKNOWN_KEY,
            ErrorKind::BadValue => KVXFER_ERR_BAD_VALUE,
            ErrorKind::TransportUnavailable => KVXFER_ERR_TRANSPORT_UNAVAILABLE,
            ErrorKind::Io => KVXFER_ERR_IO,
            ErrorKind::Panic => KVXFER_ERR_PANIC,
        }
    }

    fn name(code: i32) -> &'static [u8] {
        match code {
            0 => b"KVXFER_OK\0",
            1 => b"KVXFER_ERR_INVALID_ARGUMENT\0",
            2 => b"KVXFER_ERR_NULL_POINTER\0",
            3 => b"KVXFER_ERR_NOT_FOUND\0",
            4 => b"KVXFER_ERR_ALREADY_EXISTS\0",
            5 => b"KVXFER_ERR_WRONG_ROLE\0",
            6 => b"KVXFER_ERR_WRONG_STATE\0",
            7 => b"KVXFER_ERR_UNSUPPORTED\0",
            8 => b"KVXFER_ERR_BUFFER_TOO_SMALL\0",
            9 => b"KVXFER_ERR_UNKNOWN_KEY\0",
            10 => b"KVXFER_ERR_BAD_VALUE\0",
            11 => b"KVXFER_ERR_TRANSPORT_UNAVAILABLE\0",
            12 => b"KVXFER_ERR_IO\0",
            13 => b"KVXFER_ERR_PANIC\0",
            _ => b"KVXFER_UNKNOWN_STATUS\0",
        }
    }
}

thread_local! {
    /// The message of the last failed call on this thread; empty after a success.
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn set_last_error(message: &str) {
    LAST_ERROR.with(|m| {
        let mut m = m.borrow_mut();
        m.clear();
        m.push_str(message);
    });
}

pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|m| m.borrow_mut().clear());
}

/// The name of a status code, such as `"KVXFER_ERR_NOT_FOUND"`, as a static
/// NUL-terminated string; `"KVXFER_UNKNOWN_STATUS"` for a value that names no status.
///
/// Never fails, never NULL, safe from any thread; does not change the last error.
#[no_mangle]
pub extern "C" fn kvxfer_status_str(code: i32) -> *const c_char {
    ffi_value!(c"KVXFER_PANIC".as_ptr(), {
        kvxfer_status::name(code).as_ptr().cast()
    })
}

/// Copies the message of the last failed call on this thread into `buf` (NUL-terminated,
/// truncated to `len - 1` bytes) and returns the message's full length in bytes, without
/// the NUL, like `snprintf`. Pass `buf = NULL, len = 0` to ask for the length only.
///
/// Each call that returns `KVXFER_OK` empties the message, so read it right after the
/// call that failed. Does not change the last error itself.
#[no_mangle]
pub unsafe extern "C" fn kvxfer_last_error(buf: *mut c_char, len: usize) -> usize {
    ffi_value!(0, {
        LAST_ERROR.with(|m| {
            let m = m.borrow();
            if !buf.is_null() && len > 0 {
                let n = m.len().min(len - 1);
                // SAFETY: the caller gives `buf` with room for `len` bytes; we write
                // `n + 1 <= len` bytes, and `m` is a distinct Rust allocation.
                unsafe {
                    std::ptr::copy_nonoverlapping(m.as_ptr(), buf.cast::<u8>(), n);
                    *buf.add(n) = 0;
                }
            }
            m.len()
        })
    })
}

/// The library version, such as `"0.1.0"` (equal to `KVXFER_VERSION` in the header the
/// caller compiled against, when both come from the same release). Static; never NULL.
#[no_mangle]
pub extern "C" fn kvxfer_version() -> *const c_char {
    ffi_value!(c"unknown".as_ptr(), {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn every_status_has_its_own_name() {
        let mut seen = std::collections::HashSet::new();
        for code in 0..=13 {
            // SAFETY: kvxfer_status_str returns a static NUL-terminated string.
            let s = unsafe { CStr::from_ptr(kvxfer_status_str(code)) };
            assert!(s.to_str().unwrap().starts_with("KVXFER_"));
            assert!(seen.insert(s.to_owned()), "duplicate name for {code}");
        }
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(kvxfer_status_str(99)) };
        assert_eq!(unknown.to_str().unwrap(), "KVXFER_UNKNOWN_STATUS");
    }

    #[test]
    fn last_error_copies_truncates_and_reports_the_full_length() {
        set_last_error("room 5 not found");
        let mut buf = [0x7f as c_char; 8];
        // SAFETY: buf has 8 bytes.
        let n = unsafe { kvxfer_last_error(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(n, 16);
        // SAFETY: kvxfer_last_error NUL-terminated it.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
        assert_eq!(s.to_str().unwrap(), "room 5 ");
        // SAFETY: NULL with len 0 only asks for the length.
        assert_eq!(unsafe { kvxfer_last_error(std::ptr::null_mut(), 0) }, 16);
        clear_last_error();
        // SAFETY: as above.
        assert_eq!(unsafe { kvxfer_last_error(std::ptr::null_mut(), 0) }, 0);
    }
}
