//! RDMA transport: one-sided RDMA WRITEs over RC queue pairs (InfiniBand or RoCE).
//!
//! [`verbs`] is the thin layer over libibverbs (through the `sideway` crate, which loads
//! libibverbs at run time, so the library works on hosts without RDMA).

pub mod link;
pub mod verbs;
