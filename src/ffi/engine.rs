//! `kvxfer_engine`: start, stop, address and memory registration.

use std::ffi::{c_char, c_void};

use super::boundary::{try_slice, write_string, BoxHandle};
use super::config::kvxfer_config;
use super::status::kvxfer_status;
use crate::engine::{BufferDesc, Engine};
use crate::log::Logger;

/// A running transfer engine. Every call taking an engine is safe from any thread,
/// concurrently, except `kvxfer_engine_free`, which must not race other calls on it.
pub struct kvxfer_engine {
    _private: [u8; 0],
}

impl BoxHandle for kvxfer_engine {
    type Target = Engine;
    const NAME: &'static str = "engine";
}

/// One registered memory buffer: `len` bytes at `base`, in pages (KV) or slots (aux) of
/// `item_len` bytes each. Page `p` lives at `base + p * item_len`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvxfer_buffer {
    /// First byte of the buffer.
    pub base: *mut c_void,
    /// Length in bytes.
    pub len: usize,
    /// Bytes of one page or slot.
    pub item_len: usize,
}

/// Starts an engine from `cfg` (which is copied; free it whenever you like) and stores
/// it in `*out`. The engine binds its listening socket and starts its threads before
/// this returns.
///
/// Errors: `KVXFER_ERR_BAD_VALUE` if `role` is not set, `KVXFER_ERR_TRANSPORT_UNAVAILABLE`
/// if the requested transport cannot run here, `KVXFER_ERR_IO` if the address cannot be
/// bound, `KVXFER_ERR_NULL_POINTER`. `*out` is written only on success.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_new(
    cfg: *const kvxfer_config,
    out: *mut *mut kvxfer_engine,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL cfg is a live handle.
        let cfg = unsafe { kvxfer_config::try_borrow(cfg) }?;
        let out = super::boundary::try_out(out, "out")?;
        let log = Logger::new(cfg.config.log_level, cfg.sink.clone());
        let engine = Engine::new(cfg.config.clone(), log)?;
        // SAFETY: `out` checked non-NULL and aligned; writable by contract.
        unsafe { out.write(kvxfer_engine::into_raw(engine)) };
        Ok(())
    })
}

/// Stops an engine: every live room becomes FAILED with reason "engine shut down", every
/// library thread is joined, sockets are closed, and the handle is released. `NULL` is a
/// no-op. No other call on this engine may run concurrently or follow.
#[no_mangle]
pub unsafe extern "C" fn kvxfer_engine_free(engine: *mut kvxfer_engine) {
    ffi_value!((), {
        // SAFETY: a non-NULL engine came from kvxfer_engine_new and is not used again.
        unsafe { kvxfer_engine::free(engine) }
    })
}

/// Copies the `host:port` that peers connect to into `buf` (NUL-terminated) and its
/// length (without the NUL) into `*out_n`.
///
/// Errors: `KVXFER_ERR_BUFFER_TOO_SMALL` if `len` cannot hold the address and its NUL;
/// `*out_n` then holds the length needed. `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_address(
    engine: *const kvxfer_engine,
    buf: *mut c_char,
    len: usize,
    out_n: *mut usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine is a live handle.
        let engine = unsafe { kvxfer_engine::try_borrow(engine) }?;
        // SAFETY: buf holds len bytes by contract.
        unsafe { write_string(buf, len, out_n, engine.address()) }
    })
}

fn descs(bufs: &[kvxfer_buffer]) -> Vec<BufferDesc> {
    bufs.iter()
        .map(|b| BufferDesc {
            base: b.base as usize,
            len: b.len,
            item_len: b.item_len,
        })
        .collect()
}

/// Registers the engine's KV buffers, once, before any room is created: `n` buffers,
/// paired by position with the peer's (MHA: one per layer for K and one for V; MLA: one
/// per layer). The memory must stay valid and must not be freed until
/// `kvxfer_engine_free` returns. The array itself is copied.
///
/// Errors: `KVXFER_ERR_INVALID_ARGUMENT` for `n` = 0 or > 4096, a NULL base, `item_len` 0
/// or `len < item_len` (the message names the buffer); `KVXFER_ERR_WRONG_STATE` if
/// already registered; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_kv(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine is a live handle.
        let engine = unsafe { kvxfer_engine::try_borrow(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { try_slice(bufs, n, "bufs") }?;
        engine.register_kv(descs(bufs))
    })
}

/// Registers the engine's aux buffers (per-request metadata rows, indexed by slot: slot
/// `s` of buffer `i` is at `base + s * item_len`), once. Same rules and errors as
/// `kvxfer_register_kv`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_aux(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine is a live handle.
        let engine = unsafe { kvxfer_engine::try_borrow(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { try_slice(bufs, n, "bufs") }?;
        engine.register_aux(descs(bufs))
    })
}
