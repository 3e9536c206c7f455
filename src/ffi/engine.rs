//! `kvxfer_engine`: start, stop, address and memory registration.

use std::ffi::{c_char, c_void};

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::boundary::{try_slice, write_string, BoxHandle};
use super::config::kvxfer_config;
use super::layout::{self, kvxfer_kv_layout};
use super::status::kvxfer_status;
use super::types::{kvxfer_failure_cause, KVXFER_METRICS_CAUSES, KVXFER_ROOM_STATES};
use crate::engine::{BufferDesc, Engine, MetricsSnapshot};
use crate::error::Result;
use crate::log::Logger;

/// A running transfer engine. Every call taking an engine is safe from any thread,
/// concurrently, `kvxfer_engine_free` included: a call that races the free, or comes
/// after it, fails with `KVXFER_ERR_WRONG_STATE` ("the engine was freed").
pub struct kvxfer_engine {
    _private: [u8; 0],
}

/// What a `kvxfer_engine *` points to: the engine, and what lets a call that races
/// `kvxfer_engine_free` (or follows it) fail cleanly instead of touching freed memory.
/// A cell is never freed (it is a few dozen bytes per engine ever created, kept
/// reachable in `CELLS`), so a freed handle still points to a cell, which says closed.
struct EngineCell {
    /// Calls in progress on the handle. SeqCst, paired with `closed`: a call counts
    /// itself in and then reads `closed`; free sets `closed` and then waits for the
    /// count to reach 0 (store buffering: either the call sees the handle closed, or
    /// free sees the call and waits for it).
    inflight: AtomicUsize,
    /// Set once, by the first `kvxfer_engine_free`.
    closed: AtomicBool,
    /// The engine, until free takes it out (with `closed` set and no call in progress).
    engine: UnsafeCell<Option<Engine>>,
}

// SAFETY: `engine` is shared (`&Engine`, which is Sync) only by calls counted in
// `inflight` while `closed` is false, and taken out (exclusively) only by the one free
// that set `closed`, after it saw `inflight` at 0; see `enter` and `kvxfer_engine_free`.
unsafe impl Sync for EngineCell {}

/// Every engine cell ever made: never freed, so a stale handle stays valid to read.
static CELLS: parking_lot::Mutex<Vec<&'static EngineCell>> = parking_lot::Mutex::new(Vec::new());

/// A call in progress on an engine handle: derefs to the engine; counts itself out
/// when dropped.
pub(crate) struct EngineRef<'a>(&'a EngineCell);

impl std::ops::Deref for EngineRef<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        // SAFETY: an EngineRef exists only while counted in `inflight` with `closed`
        // false at its start (enter), so free has not taken the engine out and will not
        // until this is dropped.
        unsafe { (*self.0.engine.get()).as_ref() }.expect("a live cell holds its engine")
    }
}

impl Drop for EngineRef<'_> {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl kvxfer_engine {
    /// A new handle for `engine`.
    fn into_raw(engine: Engine) -> *mut kvxfer_engine {
        let cell: &'static EngineCell = Box::leak(Box::new(EngineCell {
            inflight: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            engine: UnsafeCell::new(Some(engine)),
        }));
        CELLS.lock().push(cell);
        (cell as *const EngineCell).cast_mut().cast()
    }

    /// Enters a call on a handle that must not be NULL: the engine, for as long as the
    /// returned guard lives; `KVXFER_ERR_WRONG_STATE` if the engine was freed.
    ///
    /// # Safety
    /// A non-NULL `p` must come from `kvxfer_engine_new` (freed or not).
    pub(crate) unsafe fn enter<'a>(p: *const kvxfer_engine) -> Result<EngineRef<'a>> {
        // SAFETY: a non-NULL handle points to a cell made by into_raw, never freed.
        let cell = unsafe { p.cast::<EngineCell>().as_ref() }
            .ok_or_else(|| crate::err!(NullPointer, "argument 'engine' is NULL"))?;
        cell.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = EngineRef(cell);
        if cell.closed.load(Ordering::SeqCst) {
            return Err(crate::err!(
                WrongState,
                "the engine was freed (kvxfer_engine_free)"
            ));
        }
        Ok(guard)
    }
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
/// Errors: `KVXFER_ERR_BAD_VALUE` if `role` is not set, `auth` is `required` without a
/// key, `listen` is not a loopback address while the engine has neither a key nor TLS
/// and `auth` is not `off` (the message names both keys), or a TLS file is unusable;
/// `KVXFER_ERR_TRANSPORT_UNAVAILABLE` if the requested transport cannot run here,
/// `KVXFER_ERR_IO` if the address cannot be bound, `KVXFER_ERR_NULL_POINTER`. `*out` is
/// written only on success.
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
/// no-op, and so is freeing a handle again. Calls on the engine that race the free are
/// waited for (they never block on the network), and calls that start after it began
/// fail with `KVXFER_ERR_WRONG_STATE`. Must not be called from inside the engine's log
/// sink.
#[no_mangle]
pub unsafe extern "C" fn kvxfer_engine_free(engine: *mut kvxfer_engine) {
    ffi_value!((), {
        // SAFETY: a non-NULL handle points to a cell made by into_raw, never freed.
        let Some(cell) = (unsafe { engine.cast::<EngineCell>().as_ref() }) else {
            return;
        };
        if cell.closed.swap(true, Ordering::SeqCst) {
            return; // freed before
        }
        // A call asleep in kvxfer_engine_wait returns at once (the count moves past
        // what it waits on) rather than at its timeout.
        // SAFETY: the engine is taken out only below, by this call, after this shared
        // reference is gone; calls in progress share it meanwhile, as this one does.
        if let Some(engine) = unsafe { (*cell.engine.get()).as_ref() } {
            engine.wake();
        }
        while cell.inflight.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        // SAFETY: `closed` is set, by this call only, and no call is in progress: no
        // reference to the engine exists or can be made (see EngineCell).
        let engine = unsafe { (*cell.engine.get()).take() };
        drop(engine);
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
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: buf holds len bytes by contract.
        unsafe { write_string(buf, len, out_n, engine.address()) }
    })
}

/// Stores this engine's id in `*out`: a random 64-bit number chosen when the engine
/// started, which it claims whenever it connects to a peer. A router passes a decode
/// engine's id to `kvxfer_room_create_for` on the prefill side to bind a room to it.
///
/// Errors: `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_id(
    engine: *const kvxfer_engine,
    out: *mut u64,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = super::boundary::try_out(out, "out")?;
        // SAFETY: `out` checked non-NULL and aligned; writable by contract.
        unsafe { out.write(engine.engine_id()) };
        Ok(())
    })
}

/// Sleeps until a room of this engine changes state (it becomes ready, starts
/// transferring, succeeds or fails) or `kvxfer_engine_wake` is called, after the count
/// `seen`, or until `timeout_ms` passes; stores the count of changes in `*out_changes`.
/// With `timeout_ms` 0 it returns the count at once.
///
/// So a scheduler thread can sleep until there is something to poll instead of polling
/// on a timer: read the count, poll the rooms, then wait with the count read. A change
/// in between makes the wait return at once, so none is missed. `kvxfer_engine_free`
/// wakes every waiting call (it returns `KVXFER_OK`; the next call fails with
/// `KVXFER_ERR_WRONG_STATE`). Must not be called from inside the engine's log sink.
///
/// Errors: `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_wait(
    engine: *const kvxfer_engine,
    seen: u64,
    timeout_ms: u32,
    out_changes: *mut u64,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = super::boundary::try_out(out_changes, "out_changes")?;
        let changes = engine.wait(seen, std::time::Duration::from_millis(timeout_ms.into()));
        // SAFETY: `out` checked non-NULL and aligned; writable by contract.
        unsafe { out.write(changes) };
        Ok(())
    })
}

/// Counts a change as a room's would, waking every `kvxfer_engine_wait`: for the host's
/// own events (work handed over by another thread) on the same wait.
///
/// Errors: `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_engine_wake(engine: *const kvxfer_engine) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        engine.wake();
        Ok(())
    })
}

fn descs(bufs: &[kvxfer_buffer]) -> Vec<BufferDesc> {
    bufs.iter()
        .map(|b| BufferDesc::host(b.base as usize, b.len, b.item_len))
        .collect()
}

/// Registers the engine's KV buffers, once, before any room is created: `n` buffers,
/// paired by position with the peer's (MHA: one per layer for K and one for V; MLA: one
/// per layer). The memory must stay valid and must not be freed until
/// `kvxfer_engine_free` returns. The array itself is copied.
///
/// Errors: `KVXFER_ERR_INVALID_ARGUMENT` for `n` = 0 or > 4096, a NULL base, `item_len` 0
/// or `len < item_len` (the message names the buffer); `KVXFER_ERR_WRONG_STATE` if
/// already registered, or once the first room was created or a peer connected (peers
/// learn the registration when they connect); `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_kv(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
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
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { try_slice(bufs, n, "bufs") }?;
        // SAFETY: layer_ids holds n elements by contract.
        let layers = unsafe { try_slice(layer_ids, n, "layer_ids") }?;
        engine.register_kv_layers(descs(bufs), layers.to_vec())
    })
}

/// Registers the engine's KV buffers with the layout of their pages (`*layout`, copied),
/// instead of `kvxfer_register_kv` or `kvxfer_register_kv_layers`, once, before any room
/// is created. `layer_ids` is NULL (buffers pair by position) or holds `n` layer ids
/// (buffers pair by layer id, as with `kvxfer_register_kv_layers`). The layout names the
/// model's KV heads, this engine's tensor-parallel rank and size (and so the heads it
/// holds: `kv_heads / tp_size` of them, or with fewer heads than ranks one head
/// replicated on `tp_size / kv_heads` ranks, or for `KVXFER_KV_LATENT` the whole latent),
/// and its pages; every buffer's `item_len` must be `page_tokens` x heads held x
/// `head_dim` x `dtype_bytes`. The memory must stay valid until `kvxfer_engine_free`
/// returns; the arrays and the layout are copied.
///
/// Peers exchange layouts when they connect, and both sides refuse, with one message
/// naming the field and both values (decode's first): a peer that registered no layout
/// (a byte copy between a sliced and an unsliced layout would put heads in the wrong
/// place), another kind (MLA against MHA/GQA), another `kv_heads`, `head_dim` or
/// `dtype_bytes`, or page sizes of which neither divides the other. Layouts equal in every
/// field pair as a byte copy of whole pages; any other pair that meets moves head slices:
/// each prefill rank writes into each decode page the bytes of the heads both hold (a
/// replicated head or the latent from one replica per decode rank), tokens landing at
/// their position whatever the page sizes and orders. A decode room then names every
/// prefill rank of the instance, and each prefill room waits for every decode rank. A
/// refusal fails the decode
/// engine's rooms with that peer at once (`KVXFER_CAUSE_MISMATCH`, the message as
/// reason). A prefill room is named by no decode engine before the exchange, so it fails
/// at its bootstrap deadline (`KVXFER_CAUSE_BOOTSTRAP_TIMEOUT`), its reason quoting the
/// last refusal.
///
/// Errors: as `kvxfer_register_kv_layers`; `KVXFER_ERR_NULL_POINTER` for a NULL `layout`;
/// `KVXFER_ERR_INVALID_ARGUMENT` for a `struct_size` other than
/// `sizeof(kvxfer_kv_layout)`, an unknown `page_order` or `kind`, a zero field,
/// `tp_rank >= tp_size`, heads that do not divide among the ranks (nor the ranks among
/// the heads), a latent with `kv_heads` other than 1, or a buffer whose `item_len` is not
/// the layout's page bytes (the message names the field or the buffer, and the values).
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_kv_layout(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer,
    layer_ids: *const u32,
    n: usize,
    layout: *const kvxfer_kv_layout,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { try_slice(bufs, n, "bufs") }?;
        let layers = if layer_ids.is_null() {
            None
        } else {
            // SAFETY: a non-NULL layer_ids holds n elements by contract.
            Some(unsafe { try_slice(layer_ids, n, "layer_ids") }?.to_vec())
        };
        // SAFETY: a non-NULL layout points to a readable struct of its struct_size.
        let layout = unsafe { layout::read(layout) }?;
        engine.register_kv_layout(descs(bufs), layers, layout)
    })
}

/// Registers the engine's aux buffers (per-request metadata rows, indexed by slot: slot
/// `s` of buffer `i` is at `base + s * item_len`), once, before any room is created. Same
/// rules and errors as `kvxfer_register_kv`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_aux(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { try_slice(bufs, n, "bufs") }?;
        engine.register_aux(descs(bufs))
    })
}

/// Counters and gauges of one engine, for a server to export.
///
/// Counters only grow; gauges (`rooms_by_state`, `inflight`, `rooms_draining`) describe
/// the rooms present now. `rooms_created` = `rooms_succeeded` + `rooms_failed` + rooms
/// still live. Fields are only ever appended (see `kvxfer_engine_metrics`).
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
    pub rooms_failed_by_cause: [u64; KVXFER_METRICS_CAUSES],
    /// Rooms present (not cleared), indexed by `kvxfer_room_state` value.
    pub rooms_by_state: [u64; KVXFER_ROOM_STATES],
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
    /// Aborts from decode engines (or losses of one) before their prefill room was
    /// created that the holding area had no place for: those rooms fail at their
    /// bootstrap deadline instead of at once.
    pub tombstone_overflow: u64,
    /// Cleared prefill rooms the holding area had no place to remember: late messages
    /// about them may be taken for a new use of their id.
    pub cleared_overflow: u64,
    /// Rooms cleared before they drained (`kvxfer_room_drained`), still draining in the
    /// background; the library releases them once no transport operation can touch
    /// their memory.
    pub rooms_draining: u64,
    /// Connections refused at authentication, on either side (see `auth` and the `tls_*`
    /// keys in `kvxfer_config_set`): no key, wrong key, bad proof, replay, an incomplete
    /// or malformed handshake, too many connections authenticating at once, a failed TLS
    /// handshake (a certificate not of the CA, an alert), TLS on one side only, or another
    /// host where an engine without a key serves only its own (`auth=auto`).
    pub auth_failures: u64,
    /// Prefill engine: destinations and aborts refused because their room is bound to
    /// other decode engines (`kvxfer_room_create_for`). Each refused destination is
    /// answered with a failure of its decode room; the prefill room is unchanged.
    pub binding_refusals: u64,
    /// Prefill engine: data runs written to decode engines, KV and aux (TCP: data frames;
    /// RDMA: writes). A byte copy of consecutive pages is one run per buffer (cut at the
    /// largest frame); head slices between different layouts are one run per byte
    /// segment, so runs per page tell how finely a transfer was cut.
    pub data_runs_sent: u64,
    /// Prefill engine: authenticated connections refused past a bound on what one decode
    /// engine, or all of them, may hold: a control connection from a new decode engine
    /// while the engine already serves 1024, a data connection whose index is 64 or more
    /// (`connections_per_peer` is at most 64) or is already live for its engine. Each is
    /// closed and logged (warn level the first time per address, debug after).
    pub peer_limit_refusals: u64,
    /// Decode engine: KV and aux bytes whose digest matched where they landed
    /// (`integrity=verify`).
    pub bytes_verified: u64,
    /// Rooms failed because a data run's digest did not match the bytes where it landed
    /// (decode: found; prefill: told by the decode engine).
    pub integrity_failures: u64,
    /// Peer pairings whose data takes TCP (one per peer engine connected).
    pub pairings_tcp: u64,
    /// Peer pairings whose data takes RDMA.
    pub pairings_rdma: u64,
    /// Peer pairings on one host whose data the decode engine copies directly from the
    /// prefill process (`same_host`).
    pub pairings_same_host: u64,
    /// Pairings on one host that took TCP because the same-host path could not be used
    /// (each also logged at WARN with the reason).
    pub same_host_fallbacks: u64,
    /// Discovery (`discovery`): times this engine put its entry into the registry: once
    /// its KV buffers are registered, again when its registration changes (aux buffers)
    /// and after its lease was lost (etcd away longer than `discovery_ttl_ms`, or
    /// restarted without its data).
    pub registry_registrations: u64,
    /// Discovery: calls to etcd that failed (each retry counts, each is logged) and
    /// watches that broke.
    pub registry_errors: u64,
    /// Discovery: times etcd stopped answering this engine (or did not answer when it
    /// started), each logged at WARN, as is its return.
    pub registry_outages: u64,
    /// Discovery: registry entries ignored (logged at WARN once per key): not signed
    /// with the cluster key, malformed, stored under a name other than the one signed,
    /// or an older incarnation than one already seen under that name.
    pub registry_rejected: u64,
    /// Discovery: peer engines lost because their entry left the registry (its lease
    /// expired, or it was deleted) or a new incarnation of the engine replaced it.
    pub registry_departures: u64,
    /// Peer pairings on one host with CUDA device memory whose device pages the decode
    /// engine copies device to device through CUDA IPC (`same_host`).
    pub pairings_cuda_ipc: u64,
}

/// The copy of a snapshot into `kvxfer_metrics`, one field per C field named in the
/// metrics table (`src/metrics.rs`): the struct literal has no `..`, so a C field the
/// table does not name, or names twice, fails the build; `C_FIELDS` lets a test check
/// the order.
macro_rules! c_metrics {
    ($($kind:ident $name:ident ($($c:ident),+) $series:literal $help:literal;)*) => {
        impl From<&MetricsSnapshot> for kvxfer_metrics {
            fn from(s: &MetricsSnapshot) -> kvxfer_metrics {
                kvxfer_metrics { $($($c: c_value!($kind $c, s.$name),)+)* }
            }
        }

        /// The C fields the table names, in its order, with their offsets.
        #[cfg(test)]
        const C_FIELDS: &[(&str, usize)] =
            &[$($((stringify!($c), std::mem::offset_of!(kvxfer_metrics, $c)),)+)*];
    };
}

/// One C field's value: a `by_cause` row is the total and the array by C value.
macro_rules! c_value {
    (by_cause rooms_failed, $s:ident.$name:ident) => {
        $s.rooms_failed_total()
    };
    (by_cause rooms_failed_by_cause, $s:ident.$name:ident) => {
        by_cause_value(&$s.$name)
    };
    ($kind:ident $c:ident, $s:ident.$name:ident) => {
        $s.$name
    };
}

crate::metrics_table!(c_metrics);

/// Counts by position in `Cause::ALL`, re-indexed by `kvxfer_failure_cause` value.
fn by_cause_value(counts: &[u64]) -> [u64; KVXFER_METRICS_CAUSES] {
    let mut out = [0; KVXFER_METRICS_CAUSES];
    for (cause, n) in crate::room::Cause::ALL.iter().zip(counts) {
        out[kvxfer_failure_cause::from(*cause) as usize] = *n;
    }
    out
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
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        if out.is_null() {
            return Err(crate::err!(NullPointer, "argument 'out' is NULL"));
        }
        if size == 0 {
            return Err(crate::err!(
                InvalidArgument,
                "size is 0; pass sizeof(kvxfer_metrics)"
            ));
        }
        let c = kvxfer_metrics::from(&engine.metrics());
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
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let text = engine.metrics().prometheus(&engine.role().to_string());
        // SAFETY: buf holds len bytes by contract.
        unsafe { write_string(buf, len, out_n, &text) }
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use super::*;
    use crate::ffi::config::{kvxfer_config_free, kvxfer_config_new, kvxfer_config_set};
    use crate::ffi::room::kvxfer_room_poll;
    use crate::ffi::types::kvxfer_room_state;

    fn prefill() -> *mut kvxfer_engine {
        let mut cfg = std::ptr::null_mut();
        let mut e = std::ptr::null_mut();
        let (k, v) = (
            CString::new("role").unwrap(),
            CString::new("prefill").unwrap(),
        );
        let (tk, tv) = (
            CString::new("transport").unwrap(),
            CString::new("tcp").unwrap(),
        );
        // SAFETY: valid out-pointers and NUL-terminated strings.
        unsafe {
            assert_eq!(kvxfer_config_new(&mut cfg), kvxfer_status::KVXFER_OK);
            assert_eq!(
                kvxfer_config_set(cfg, k.as_ptr(), v.as_ptr()),
                kvxfer_status::KVXFER_OK
            );
            assert_eq!(
                kvxfer_config_set(cfg, tk.as_ptr(), tv.as_ptr()),
                kvxfer_status::KVXFER_OK
            );
            assert_eq!(kvxfer_engine_new(cfg, &mut e), kvxfer_status::KVXFER_OK);
            kvxfer_config_free(cfg);
        }
        e
    }

    fn poll(e: *const kvxfer_engine) -> kvxfer_status {
        let mut st = kvxfer_room_state::KVXFER_ROOM_FAILED;
        // SAFETY: a handle from kvxfer_engine_new (freed or not) and a valid out-pointer.
        unsafe { kvxfer_room_poll(e, 1, &mut st) }
    }

    /// The table in `src/metrics.rs` names every C field (else `From` would not
    /// build), in the order of the struct and of the header C users compile against.
    #[test]
    fn the_metrics_table_names_the_fields_of_kvxfer_metrics_in_their_order() {
        for w in C_FIELDS.windows(2) {
            assert!(
                w[0].1 < w[1].1,
                "the table puts {} before {}, kvxfer_metrics does not",
                w[0].0,
                w[1].0
            );
        }
        let header =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/kvxfer.h"))
                .unwrap();
        let start = header
            .find("typedef struct kvxfer_metrics {")
            .expect("kvxfer_metrics");
        let body = &header[start..start + header[start..].find("} kvxfer_metrics;").unwrap()];
        let declared: Vec<&str> = body
            .lines()
            .filter_map(|l| l.trim().strip_prefix("uint64_t "))
            .map(|f| f.trim_end_matches(';').split('[').next().unwrap())
            .collect();
        let named: Vec<&str> = C_FIELDS.iter().map(|f| f.0).collect();
        assert_eq!(
            declared, named,
            "include/kvxfer.h and the metrics table disagree"
        );
    }

    #[test]
    fn each_c_field_carries_its_value_and_causes_are_indexed_by_c_value() {
        let mut s = MetricsSnapshot {
            rooms_created: 40,
            held: 7,
            rooms_draining: 3,
            auth_failures: 9,
            binding_refusals: 6,
            data_runs_sent: 12,
            peer_limit_refusals: 13,
            inflight: 2,
            ..Default::default()
        };
        s.rooms_failed[0] = 5; // ABORTED
        s.rooms_failed[9] = 11; // INTERNAL
        s.rooms_by_state = [1, 2, 3, 4, 5];
        let c = kvxfer_metrics::from(&s);
        assert_eq!((c.rooms_created, c.held_destinations), (40, 7));
        assert_eq!((c.rooms_draining, c.auth_failures, c.inflight), (3, 9, 2));
        assert_eq!((c.binding_refusals, c.data_runs_sent), (6, 12));
        assert_eq!(c.peer_limit_refusals, 13);
        assert_eq!(c.rooms_failed, 16);
        let mut by_cause = [0; KVXFER_METRICS_CAUSES];
        by_cause[kvxfer_failure_cause::KVXFER_CAUSE_ABORTED as usize] = 5;
        by_cause[kvxfer_failure_cause::KVXFER_CAUSE_INTERNAL as usize] = 11;
        assert_eq!(c.rooms_failed_by_cause, by_cause);
        assert_eq!(c.rooms_by_state, [1, 2, 3, 4, 5]);
    }

    /// DESIGN.md section 5, "every call is safe from any thread": a call after free,
    /// and a second free, fail cleanly instead of touching freed memory.
    #[test]
    fn calls_on_a_freed_engine_fail_with_wrong_state_and_a_second_free_is_harmless() {
        let e = prefill();
        assert_eq!(poll(e), kvxfer_status::KVXFER_ERR_NOT_FOUND);
        // SAFETY: a handle from kvxfer_engine_new.
        unsafe { kvxfer_engine_free(e) };
        assert_eq!(poll(e), kvxfer_status::KVXFER_ERR_WRONG_STATE);
        // SAFETY: as above; freeing again is documented as a no-op.
        unsafe { kvxfer_engine_free(e) };
        assert_eq!(poll(e), kvxfer_status::KVXFER_ERR_WRONG_STATE);
    }

    /// A host tearing down while another thread (a metrics exporter, a scheduler) still
    /// calls: every call either works or fails with WRONG_STATE.
    #[test]
    fn calls_racing_the_free_either_work_or_fail_with_wrong_state() {
        for _ in 0..20 {
            let e = prefill() as usize;
            let callers: Vec<_> = (0..3)
                .map(|_| {
                    std::thread::spawn(move || {
                        let mut calls = 0u64;
                        loop {
                            match poll(e as *const kvxfer_engine) {
                                kvxfer_status::KVXFER_ERR_NOT_FOUND => calls += 1,
                                kvxfer_status::KVXFER_ERR_WRONG_STATE => return calls,
                                other => panic!("unexpected {other:?}"),
                            }
                        }
                    })
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_millis(5));
            // SAFETY: a handle from kvxfer_engine_new.
            unsafe { kvxfer_engine_free(e as *mut kvxfer_engine) };
            for c in callers {
                c.join().unwrap();
            }
        }
    }
}
