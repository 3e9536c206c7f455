//! The crate's error type: a kind (which maps one-to-one onto a C status code) and a
//! message that says exactly what went wrong, naming the argument, key or room.

use std::fmt;

/// What class of failure an [`Error`] is. Each kind has one C status code (see
/// `ffi::status`); the numbering lives there, never here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An argument is out of range or malformed.
    InvalidArgument,
    /// A pointer argument that must not be NULL was NULL (raised by the FFI layer).
    NullPointer,
    /// The room (or other object) does not exist.
    NotFound,
    /// The room id is already live in this engine.
    AlreadyExists,
    /// The call is not valid for this engine's role.
    WrongRole,
    /// The call is not valid in the object's current state.
    WrongState,
    /// The operation is not supported by this build or configuration.
    Unsupported,
    /// An output buffer is too small for the result.
    BufferTooSmall,
    /// A configuration key is not known.
    UnknownKey,
    /// A configuration value is not valid for its key.
    BadValue,
    /// The requested transport cannot be used on this machine.
    TransportUnavailable,
    /// An operating-system I/O call failed.
    Io,
    /// A panic was caught at the boundary.
    Panic,
}

/// An error with its kind and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    /// Makes an error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// The error's kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The error's message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Builds an [`Error`] with a formatted message: `err!(NotFound, "room {} not found", id)`.
#[macro_export]
#[doc(hidden)]
macro_rules! err {
    ($kind:ident, $($fmt:tt)+) => {
        $crate::error::Error::new($crate::error::ErrorKind::$kind, format!($($fmt)+))
    };
}
