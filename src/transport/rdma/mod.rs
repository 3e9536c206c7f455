//! RDMA transport: one-sided RDMA WRITEs over RC queue pairs (InfiniBand or RoCE).
//!
//! [`verbs`] is the thin layer over libibverbs (through the `sideway` crate, which loads
//! libibverbs at run time, so the library works on hosts without RDMA); [`link`] is the
//! prefill side's data link over one queue pair; [`peer`] is what one peer engine's
//! handshake sets up and its loss tears down.

pub mod link;
pub mod peer;
pub mod verbs;
