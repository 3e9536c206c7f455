//! The C enums more than one class file uses (room states, failure causes), their
//! names, and the sizes of the arrays in `kvxfer_metrics` that they index.

use std::ffi::{c_char, CStr};

use crate::room::{Cause, State};

/// A room's state. Values are fixed (kept from the reference design): FAILED is the
/// smallest, so hosts can MIN-reduce polls across tensor-parallel ranks.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_room_state {
    /// Terminal: the transfer did not happen; `kvxfer_room_failure` says why.
    KVXFER_ROOM_FAILED = 0,
    /// Connections, registration or destination info are being set up.
    KVXFER_ROOM_BOOTSTRAPPING = 1,
    /// Ready for data: prefill has every destination; decode may send its destination.
    KVXFER_ROOM_WAITING_FOR_INPUT = 2,
    /// Data is moving.
    KVXFER_ROOM_TRANSFERRING = 3,
    /// Terminal: every page arrived and every engine reported done.
    KVXFER_ROOM_SUCCESS = 4,
}

/// Entries of `kvxfer_metrics.rooms_by_state`: one per `kvxfer_room_state` value.
/// (`tests/header.rs` writes it into the header as a `#define`.)
pub const KVXFER_ROOM_STATES: usize = 5;

impl kvxfer_room_state {
    /// Every state, by value.
    const ALL: [kvxfer_room_state; KVXFER_ROOM_STATES] = [
        kvxfer_room_state::KVXFER_ROOM_FAILED,
        kvxfer_room_state::KVXFER_ROOM_BOOTSTRAPPING,
        kvxfer_room_state::KVXFER_ROOM_WAITING_FOR_INPUT,
        kvxfer_room_state::KVXFER_ROOM_TRANSFERRING,
        kvxfer_room_state::KVXFER_ROOM_SUCCESS,
    ];

    /// The state whose value is `v`, if any.
    fn from_value(v: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as i32 == v)
    }

    /// The state's C name.
    fn name(self) -> &'static CStr {
        use kvxfer_room_state::*;
        match self {
            KVXFER_ROOM_FAILED => c"KVXFER_ROOM_FAILED",
            KVXFER_ROOM_BOOTSTRAPPING => c"KVXFER_ROOM_BOOTSTRAPPING",
            KVXFER_ROOM_WAITING_FOR_INPUT => c"KVXFER_ROOM_WAITING_FOR_INPUT",
            KVXFER_ROOM_TRANSFERRING => c"KVXFER_ROOM_TRANSFERRING",
            KVXFER_ROOM_SUCCESS => c"KVXFER_ROOM_SUCCESS",
        }
    }
}

impl From<State> for kvxfer_room_state {
    fn from(s: State) -> Self {
        match s {
            State::Failed => kvxfer_room_state::KVXFER_ROOM_FAILED,
            State::Bootstrapping => kvxfer_room_state::KVXFER_ROOM_BOOTSTRAPPING,
            State::WaitingForInput => kvxfer_room_state::KVXFER_ROOM_WAITING_FOR_INPUT,
            State::Transferring => kvxfer_room_state::KVXFER_ROOM_TRANSFERRING,
            State::Success => kvxfer_room_state::KVXFER_ROOM_SUCCESS,
        }
    }
}

/// The class of a room's failure.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_failure_cause {
    /// Aborted by a scheduler (this side's, or the peer's: see `from_peer`), or cleared
    /// while live.
    KVXFER_CAUSE_ABORTED = 1,
    /// The peer engine stopped answering or its connection broke.
    KVXFER_CAUSE_PEER_LOST = 2,
    /// `bootstrap_timeout_ms` passed.
    KVXFER_CAUSE_BOOTSTRAP_TIMEOUT = 3,
    /// `waiting_timeout_ms` passed.
    KVXFER_CAUSE_WAITING_TIMEOUT = 4,
    /// No progress within `transfer_timeout_ms`.
    KVXFER_CAUSE_TRANSFER_TIMEOUT = 5,
    /// The peer sent an invalid message.
    KVXFER_CAUSE_PROTOCOL = 6,
    /// The sides disagree (page counts, buffer layout).
    KVXFER_CAUSE_MISMATCH = 7,
    /// Moving the bytes failed.
    KVXFER_CAUSE_TRANSFER = 8,
    /// The engine was freed with the room live.
    KVXFER_CAUSE_SHUTDOWN = 9,
    /// An internal error (a library bug, caught).
    KVXFER_CAUSE_INTERNAL = 10,
    /// With `integrity=verify`: the bytes where a data run landed do not match the digest
    /// the prefill engine sent with it (corrupted on the way or on either host, written
    /// at the wrong place, or a run of an earlier use of the room id); the reason names
    /// the prefill engine, the buffer, the page and the byte range.
    KVXFER_CAUSE_INTEGRITY = 11,
}

/// The path a room's data takes with its peer engines (`kvxfer_room_path`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_path {
    /// No peer engine of the room is paired yet (a prefill room before its destination
    /// arrived, a decode room still connecting).
    KVXFER_PATH_UNKNOWN = 0,
    /// Data frames over the TCP data connections.
    KVXFER_PATH_TCP = 1,
    /// RDMA writes.
    KVXFER_PATH_RDMA = 2,
    /// Both engines on one host: the decode engine copies the pages directly from the
    /// prefill process's memory (`same_host`).
    KVXFER_PATH_SAME_HOST = 3,
    /// Both engines on one host with CUDA device memory: the decode engine copies the
    /// device pages device to device through CUDA IPC (host pages, such as aux rows, as
    /// `KVXFER_PATH_SAME_HOST`).
    KVXFER_PATH_CUDA_IPC = 4,
    /// The room's peer engines took different paths.
    KVXFER_PATH_MIXED = 15,
}

impl From<crate::DataPath> for kvxfer_path {
    fn from(p: crate::DataPath) -> Self {
        use kvxfer_path::*;
        match p {
            crate::DataPath::Unknown => KVXFER_PATH_UNKNOWN,
            crate::DataPath::Tcp => KVXFER_PATH_TCP,
            crate::DataPath::Rdma => KVXFER_PATH_RDMA,
            crate::DataPath::SameHost => KVXFER_PATH_SAME_HOST,
            crate::DataPath::CudaIpc => KVXFER_PATH_CUDA_IPC,
            crate::DataPath::Mixed => KVXFER_PATH_MIXED,
        }
    }
}

/// Entries of `kvxfer_metrics.rooms_failed_by_cause`, indexed by `kvxfer_failure_cause`
/// value: room for causes added later (index 0 and values past the last cause stay 0).
/// (`tests/header.rs` writes it into the header as a `#define`.)
pub const KVXFER_METRICS_CAUSES: usize = 16;

// Every cause has its slot in the metrics array.
const _: () = assert!(Cause::ALL.len() < KVXFER_METRICS_CAUSES);

impl kvxfer_failure_cause {
    /// The cause whose value is `v`, if any.
    fn from_value(v: i32) -> Option<Self> {
        Cause::ALL
            .into_iter()
            .map(Self::from)
            .find(|c| *c as i32 == v)
    }

    /// The cause's C name.
    fn name(self) -> &'static CStr {
        use kvxfer_failure_cause::*;
        match self {
            KVXFER_CAUSE_ABORTED => c"KVXFER_CAUSE_ABORTED",
            KVXFER_CAUSE_PEER_LOST => c"KVXFER_CAUSE_PEER_LOST",
            KVXFER_CAUSE_BOOTSTRAP_TIMEOUT => c"KVXFER_CAUSE_BOOTSTRAP_TIMEOUT",
            KVXFER_CAUSE_WAITING_TIMEOUT => c"KVXFER_CAUSE_WAITING_TIMEOUT",
            KVXFER_CAUSE_TRANSFER_TIMEOUT => c"KVXFER_CAUSE_TRANSFER_TIMEOUT",
            KVXFER_CAUSE_PROTOCOL => c"KVXFER_CAUSE_PROTOCOL",
            KVXFER_CAUSE_MISMATCH => c"KVXFER_CAUSE_MISMATCH",
            KVXFER_CAUSE_TRANSFER => c"KVXFER_CAUSE_TRANSFER",
            KVXFER_CAUSE_SHUTDOWN => c"KVXFER_CAUSE_SHUTDOWN",
            KVXFER_CAUSE_INTERNAL => c"KVXFER_CAUSE_INTERNAL",
            KVXFER_CAUSE_INTEGRITY => c"KVXFER_CAUSE_INTEGRITY",
        }
    }
}

impl From<Cause> for kvxfer_failure_cause {
    fn from(c: Cause) -> Self {
        use kvxfer_failure_cause::*;
        match c {
            Cause::Aborted => KVXFER_CAUSE_ABORTED,
            Cause::PeerLost => KVXFER_CAUSE_PEER_LOST,
            Cause::BootstrapTimeout => KVXFER_CAUSE_BOOTSTRAP_TIMEOUT,
            Cause::WaitingTimeout => KVXFER_CAUSE_WAITING_TIMEOUT,
            Cause::TransferTimeout => KVXFER_CAUSE_TRANSFER_TIMEOUT,
            Cause::Protocol => KVXFER_CAUSE_PROTOCOL,
            Cause::Mismatch => KVXFER_CAUSE_MISMATCH,
            Cause::Transfer => KVXFER_CAUSE_TRANSFER,
            Cause::Shutdown => KVXFER_CAUSE_SHUTDOWN,
            Cause::Internal => KVXFER_CAUSE_INTERNAL,
            Cause::Integrity => KVXFER_CAUSE_INTEGRITY,
        }
    }
}

/// The name of a room state, such as `"KVXFER_ROOM_WAITING_FOR_INPUT"`, as a static
/// NUL-terminated string; `"KVXFER_UNKNOWN_ROOM_STATE"` for a value that names no state.
///
/// Never fails, never NULL, safe from any thread; does not change the last error.
#[no_mangle]
pub extern "C" fn kvxfer_room_state_str(state: i32) -> *const c_char {
    ffi_value!(c"KVXFER_PANIC".as_ptr(), {
        kvxfer_room_state::from_value(state)
            .map_or(c"KVXFER_UNKNOWN_ROOM_STATE", kvxfer_room_state::name)
            .as_ptr()
    })
}

/// The name of a failure cause, such as `"KVXFER_CAUSE_PEER_LOST"`, as a static
/// NUL-terminated string; `"KVXFER_UNKNOWN_CAUSE"` for a value that names no cause.
///
/// Never fails, never NULL, safe from any thread; does not change the last error.
#[no_mangle]
pub extern "C" fn kvxfer_failure_cause_str(cause: i32) -> *const c_char {
    ffi_value!(c"KVXFER_PANIC".as_ptr(), {
        kvxfer_failure_cause::from_value(cause)
            .map_or(c"KVXFER_UNKNOWN_CAUSE", kvxfer_failure_cause::name)
            .as_ptr()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn str_of(p: *const c_char) -> String {
        // SAFETY: the _str functions return static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string()
    }

    #[test]
    fn every_state_and_cause_is_named_as_its_c_constant() {
        for s in kvxfer_room_state::ALL {
            assert_eq!(str_of(kvxfer_room_state_str(s as i32)), format!("{s:?}"));
        }
        assert_eq!(kvxfer_room_state::ALL.len(), KVXFER_ROOM_STATES);
        for c in Cause::ALL.map(kvxfer_failure_cause::from) {
            assert_eq!(str_of(kvxfer_failure_cause_str(c as i32)), format!("{c:?}"));
        }
    }

    #[test]
    fn values_that_name_nothing_are_unknown() {
        for v in [-1, 5, 99, i32::MIN, i32::MAX] {
            assert_eq!(
                str_of(kvxfer_room_state_str(v)),
                "KVXFER_UNKNOWN_ROOM_STATE"
            );
        }
        for v in [-1, 0, 12, 16, i32::MIN, i32::MAX] {
            assert_eq!(str_of(kvxfer_failure_cause_str(v)), "KVXFER_UNKNOWN_CAUSE");
        }
    }
}
