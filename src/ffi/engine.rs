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

/// Registers the engine's KV buffers with a layer id each (`layer_ids[i]` for `bufs[i]`),
/// instead of `kvxfer_register_kv`. Buffers then pair with the peer's by layer id (several
/// buffers of one layer, such as K and V, pair in the order registered), so a pipeline
/// stage registers only its own layers and a decode room pulling from several stages
/// completes when, together, they delivered every decode buffer exactly once. Both sides
/// must use layer ids, or neither.
///
/// Errors: as `kvxfer_register_kv`, and `KVXFER_ERR_INVALID_ARGUMENT` for a layer id
/// above `INT32_MAX`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_kv_layers(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer,
    layer_ids: *const u32,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine is a live handle.
        let engine = unsafe { kvxfer_engine::try_borrow(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { try_slice(bufs, n, "bufs") }?;
        // SAFETY: layer_ids holds n elements by contract.
        let layers = unsafe { try_slice(layer_ids, n, "layer_ids") }?;
        engine.register_kv_layers(descs(bufs), layers.to_vec())
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

/// Counters and gauges of one engine, for a server to export.
///
/// Counters only grow; gauges (`rooms_by_state`, `inflight`) describe the rooms present
/// now. `rooms_created` = `rooms_succeeded` + `rooms_failed` + rooms still live.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvxfer_metrics {
    /// Rooms created since the engine started.
    pub rooms_created: u64,
    /// Rooms that reached SUCCESS.
    pub rooms_succeeded: u64,
    /// Rooms that reached FAILED.
    pub rooms_failed: u64,
    /// Rooms that reached FAILED, indexed by `kvxfer_failure_cause` value (index 0 and
    /// values beyond the last cause stay 0).
    pub rooms_failed_by_cause: [u64; 16],
    /// Rooms present (not cleared), indexed by `kvxfer_room_state` value.
    pub rooms_by_state: [u64; 5],
    /// Rooms present and not terminal.
    pub inflight: u64,
    /// KV and aux payload bytes written to peers.
    pub bytes_sent: u64,
    /// KV and aux payload bytes read from peers.
    pub bytes_received: u64,
    /// Chunks fully sent.
    pub chunks: u64,
    /// Peer engines lost (connection closed, silent past the heartbeat deadline, or bad
    /// frames).
    pub peers_lost: u64,
    /// Malformed or out-of-protocol frames received.
    pub protocol_errors: u64,
    /// Data frames discarded because their room was gone or terminal.
    pub dropped_frames: u64,
    /// Peer messages that named an unknown room.
    pub unknown_room_frames: u64,
    /// Destinations that arrived before their prefill room was created.
    pub held_destinations: u64,
    /// Early destinations refused because the holding area was full.
    pub held_overflow: u64,
    /// Early destinations whose room was not created in time.
    pub held_expired: u64,
}

/// Copies the engine's metrics into `*out`. `size` must be `sizeof(kvxfer_metrics)` as
/// the caller compiled it: the library writes at most that many bytes, so a caller built
/// against an older, shorter struct stays safe when fields are appended.
///
/// Errors: `KVXFER_ERR_NULL_POINTER`; `KVXFER_ERR_INVALID_ARGUMENT` if `size` is 0.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_metrics(
    engine: *const kvxfer_engine,
    out: *mut kvxfer_metrics,
    size: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine is a live handle.
        let engine = unsafe { kvxfer_engine::try_borrow(engine) }?;
        if out.is_null() {
            return Err(crate::err!(NullPointer, "argument 'out' is NULL"));
        }
        if size == 0 {
            return Err(crate::err!(
                InvalidArgument,
                "size is 0; pass sizeof(kvxfer_metrics)"
            ));
        }
        let m = engine.metrics();
        let mut c = kvxfer_metrics {
            rooms_created: m.rooms_created,
            rooms_succeeded: m.rooms_succeeded,
            rooms_failed: m.rooms_failed_total(),
            rooms_by_state: m.rooms_by_state,
            inflight: m.inflight,
            bytes_sent: m.bytes_sent,
            bytes_received: m.bytes_received,
            chunks: m.chunks,
            peers_lost: m.peers_lost,
            protocol_errors: m.protocol_errors,
            dropped_frames: m.dropped_frames,
            unknown_room_frames: m.unknown_room_frames,
            held_destinations: m.held,
            held_overflow: m.held_overflow,
            held_expired: m.held_expired,
            ..Default::default()
        };
        for (cause, n) in crate::room::Cause::ALL.iter().zip(m.rooms_failed) {
            let code = super::room::kvxfer_failure_cause::from(*cause) as usize;
            c.rooms_failed_by_cause[code] = n;
        }
        let n = size.min(std::mem::size_of::<kvxfer_metrics>());
        // SAFETY: `out` is non-NULL and the caller guarantees `size` writable bytes; we
        // copy `n <= size` bytes from a local of at least `n` bytes. No alignment is
        // assumed on the destination.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&c as *const kvxfer_metrics).cast::<u8>(),
                out.cast::<u8>(),
                n,
            )
        };
        Ok(())
    })
}

/// Copies the engine's metrics in the Prometheus text exposition format (version 0.0.4;
/// every series labelled with `role`) into `buf` (NUL-terminated) and its length into
/// `*out_n`.
///
/// Errors: `KVXFER_ERR_BUFFER_TOO_SMALL` (with `*out_n` = length needed; 16 KiB is
/// always enough today); `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_metrics_text(
    engine: *const kvxfer_engine,
    buf: *mut c_char,
    len: usize,
    out_n: *mut usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine is a live handle.
        let engine = unsafe { kvxfer_engine::try_borrow(engine) }?;
        let text = engine.metrics().prometheus(&engine.role().to_string());
        // SAFETY: buf holds len bytes by contract.
        unsafe { write_string(buf, len, out_n, &text) }
    })
}
