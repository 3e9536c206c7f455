//! What the integration tests share: waiting for an engine ([`wait`]), test engines and
//! what they log ([`engine`]), their registered memory ([`memory`]), a prefill and a
//! decode engine side by side ([`pair`]), the prefill child process of the
//! multi-process tests ([`child`]), fake peer engines on raw sockets ([`fake`]),
//! a fake decode engine that stops reading its data connection ([`slow`]), certificates
//! for the TLS tests ([`pki`]), and a deterministic generator for random moments
//! ([`rng`]).
//!
//! Compiled into every test binary, each of which uses only part of it.
#![allow(dead_code)]

pub mod child;
pub mod engine;
pub mod etcd;
pub mod fake;
pub mod fakecuda;
pub mod memory;
pub mod pair;
pub mod pki;
pub mod rng;
pub mod slow;
pub mod wait;

#[allow(unused_imports)]
pub use child::{child_prefill_main, plan, ChildPrefill, BUFS, ITEM, PAGES};
#[allow(unused_imports)]
pub use engine::{
    config, descs, engine, quiet, start, test_integrity, test_transport, KeyFile, Log,
};
#[allow(unused_imports)]
pub use memory::{
    all_filled, fill_pages, first_unlike_source, pattern, poisoned, source, Region, POISON,
};
#[allow(unused_imports)]
pub use pair::{Pair, PairBuilder};
#[allow(unused_imports)]
pub use rng::Rng;
#[allow(unused_imports)]
pub use wait::{
    assert_within, fail_peer_lost_naming, rooms_waiting, terminal_within, unless_failed,
    wait_state, wait_terminal, wait_until, wait_until_within, LIMIT,
};
