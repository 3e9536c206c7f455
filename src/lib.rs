//! libkvxfer: the KV-cache transfer engine of prefill/decode disaggregated LLM serving.
//!
//! The safe Rust core lives in [`room`], [`engine`], [`config`] and [`log`]; the C ABI in
//! `ffi` only converts and checks. See `DESIGN.md` in the repository for the invariants.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod error;

pub mod config;
pub mod engine;
pub mod log;
pub mod proto;
pub mod room;
#[cfg(feature = "test-hooks")]
pub mod testing;
pub mod transport;

#[doc(hidden)]
pub mod ffi;

pub use config::{Config, Role};
pub use engine::{BufferDesc, Engine, RoomPeers};
pub use error::{Error, ErrorKind, Result};
pub use room::{Cause, FailureReason, State};

/// The crate version, from Cargo.toml.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
