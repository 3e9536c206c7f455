//! The C ABI. Every `extern "C"` symbol of the library lives below this module and
//! nothing else does: each function converts and checks its arguments inside the
//! boundary macro ([`boundary`]) and calls the safe core.

#![allow(non_camel_case_types)]
// `#[must_use]` on each status-returning export is what makes cbindgen emit
// KVXFER_MUST_USE on its C declaration, even though the type is must-use too.
#![allow(clippy::double_must_use)]

#[macro_use]
pub(crate) mod boundary;
pub mod config;
pub mod engine;
pub mod layout;
pub mod log;
pub mod memory;
pub mod room;
pub mod status;
pub mod types;
