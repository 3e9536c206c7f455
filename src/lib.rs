//! libkvxfer: the KV-cache transfer engine of prefill/decode disaggregated LLM serving.
//!
//! The layers, from the C ABI down (docs/ARCHITECTURE.md draws them): `ffi` (the C ABI;
//! it only converts and checks), [`engine`] (rooms: the scheduler's calls, each role's
//! side, when a room changes state), `control` (peers: connections, handshake,
//! heartbeats, loss), [`transport`] (moving bytes: TCP and RDMA), [`proto`] (the wire
//! format), [`room`] (a room's state word and the room table), and beside them `node`
//! (what an engine's layers share: configuration, log, clock, threads, registered
//! memory), [`layout`] (how a rank's KV pages are laid out), [`auth`], [`config`],
//! [`log`] and `metrics`. See `DESIGN.md` of the project's shared notes for the
//! invariants.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod error;

pub mod auth;
pub mod tls;

pub mod config;
pub(crate) mod control;
pub mod cuda;
pub(crate) mod discovery;
pub mod engine;
pub mod integrity;
pub mod layout;
pub mod log;
pub(crate) mod metrics;
pub(crate) mod node;
pub mod proto;
pub mod room;
pub mod slice;
#[cfg(feature = "test-hooks")]
pub mod testing;
pub mod transport;

#[doc(hidden)]
pub mod ffi;

pub use config::{Config, Role};
pub use engine::{BufferDesc, DataPath, Engine, MemKind, RoomPeers};
pub use error::{Error, ErrorKind, Result};
pub use layout::{KvKind, KvLayout, PageOrder};
pub use room::{Cause, FailureReason, State};

/// The crate version, from Cargo.toml.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
