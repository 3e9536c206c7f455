//! Rooms through the C ABI: create, destination, chunks, poll, abort, failure, drained,
//! clear. Room ids are the router's `uint64_t`.

use std::ffi::c_char;

use super::boundary::{try_out, try_slice, try_str, write_string};
use super::engine::kvxfer_engine;
use super::status::kvxfer_status;
use super::types::{kvxfer_failure_cause, kvxfer_path, kvxfer_room_state};
use crate::err;
use crate::error::Result;

fn aux(aux_slot: i64) -> Result<Option<u32>> {
    if aux_slot < 0 {
        Ok(None)
    } else {
        u32::try_from(aux_slot)
            .map(Some)
            .map_err(|_| err!(InvalidArgument, "aux_slot {aux_slot} is out of range"))
    }
}

/// Creates room `room` in BOOTSTRAPPING.
///
/// Decode engine: `peers` holds `n_peers` (at least 1) NUL-terminated `host:port`
/// addresses of the prefill engines the room pulls from. Prefill engine: `peers` must be
/// NULL and `n_peers` is how many decode engines will send a destination (0 means 1).
///
/// Errors: `KVXFER_ERR_ALREADY_EXISTS` if the id is present (live, or terminal and not
/// cleared); `KVXFER_ERR_INVALID_ARGUMENT` for bad peers; `KVXFER_ERR_WRONG_STATE` before
/// `kvxfer_register_kv`; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_create(
    engine: *const kvxfer_engine,
    room: u64,
    peers: *const *const c_char,
    n_peers: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // Read only if the engine's role takes addresses (it checks which it takes).
        let addrs = (!peers.is_null()).then_some(|| {
            // SAFETY: a non-NULL peers holds n_peers pointers by contract.
            let ptrs = unsafe { try_slice(peers, n_peers, "peers") }?;
            ptrs.iter()
                .enumerate()
                // SAFETY: each element is a NUL-terminated string by contract.
                .map(|(i, &p)| unsafe { try_str(p, &format!("peers[{i}]")) }.map(str::to_string))
                .collect()
        });
        engine.room_create_c(room, addrs, n_peers)
    })
}

/// Prefill engine only: creates room `room` in BOOTSTRAPPING, bound to the `n` decode
/// engines whose ids (`kvxfer_engine_id` on each) `decode_ids` holds: the room waits
/// for one destination from each, and a destination or abort for it from any other
/// engine is refused, counted in `binding_refusals` and changes nothing (a refused
/// destination fails the sender's decode room with a reason naming the binding). The
/// array is copied. For routers that know which decode engines serve a request.
///
/// An engine id is the one a decode engine claims when it connects; with a cluster key
/// (`auth_key`) only an engine holding the key gets in, but the key does not prove which
/// engine it is (see docs/SECURITY.md): binding keeps rooms from being claimed by the
/// wrong engine of the cluster, not from a key holder posing as another engine.
///
/// Errors: `KVXFER_ERR_WRONG_ROLE` on a decode engine; `KVXFER_ERR_ALREADY_EXISTS` if
/// the id is present (live, or terminal and not cleared); `KVXFER_ERR_INVALID_ARGUMENT`
/// for `n` = 0 or > 1024 or an id listed twice; `KVXFER_ERR_WRONG_STATE` before
/// `kvxfer_register_kv`; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_create_for(
    engine: *const kvxfer_engine,
    room: u64,
    decode_ids: *const u64,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        if engine.role() != crate::Role::Prefill {
            return Err(err!(
                WrongRole,
                "kvxfer_room_create_for is for prefill engines; this engine is decode"
            ));
        }
        // SAFETY: decode_ids holds n elements by contract.
        let ids = unsafe { try_slice(decode_ids, n, "decode_ids") }?;
        engine.room_create(room, crate::RoomPeers::DecodeEngines(ids.to_vec()))
    })
}

/// Decode engine only: creates room `room` in BOOTSTRAPPING, pulling from every rank of
/// prefill instance `instance` (NUL-terminated; the `instance` config key of those
/// engines), found in this engine's copy of the registry (config key `discovery`): as
/// `kvxfer_room_create` with their addresses, in rank order. Never waits for etcd: it
/// reads the copy that the engine's watch keeps current, so it works on while etcd is
/// unreachable, with the engines known when it was last reached.
///
/// Each rank's entry carries its KV buffers and layout, checked here as the
/// registration exchange checks them; the exchange checks them again when the room
/// connects. A room whose prefill engine leaves the registry (its lease expired, or a
/// new incarnation replaced it) fails as `KVXFER_CAUSE_PEER_LOST` with a reason starting
/// `registry:`.
///
/// Errors: `KVXFER_ERR_NOT_FOUND` if no prefill engine of that instance is registered,
/// or not every rank of it (`instance_ranks`), the message naming the missing ranks and
/// the instances known; `KVXFER_ERR_INVALID_ARGUMENT` if a rank's buffers or layout
/// cannot pair with this engine's (the message names the rank, the field and both
/// values) or its ranks disagree on their count; `KVXFER_ERR_WRONG_STATE` without
/// `discovery` or before `kvxfer_register_kv`; `KVXFER_ERR_WRONG_ROLE` on a prefill
/// engine; `KVXFER_ERR_ALREADY_EXISTS` if the id is present; `KVXFER_ERR_UNSUPPORTED`
/// in a build without discovery; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_create_from(
    engine: *const kvxfer_engine,
    room: u64,
    instance: *const c_char,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: a NUL-terminated string by contract.
        let instance = unsafe { try_str(instance, "instance") }?;
        engine.room_create_from(room, instance)
    })
}

/// Decode engine only: the destination of room `room`, sent to every prefill engine of
/// the room: `n_pages` page indices into the KV buffers, filled in order by the prefill's
/// chunks, and the aux slot for the request's metadata rows (`aux_slot < 0` means none).
///
/// May be called while the room is BOOTSTRAPPING (it is sent once the prefill engines
/// are connected) or WAITING_FOR_INPUT. Once the room is terminal, no byte lands in these
/// pages after `kvxfer_room_drained` reports true.
///
/// Errors: `KVXFER_ERR_WRONG_ROLE` on a prefill engine; `KVXFER_ERR_NOT_FOUND`;
/// `KVXFER_ERR_WRONG_STATE` if the room is terminal or already has a destination;
/// `KVXFER_ERR_INVALID_ARGUMENT` for a page outside the registered buffers, a page
/// listed twice or an aux slot out of range.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_set_destination(
    engine: *const kvxfer_engine,
    room: u64,
    pages: *const u32,
    n_pages: usize,
    aux_slot: i64,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: pages holds n_pages elements by contract.
        let pages = unsafe { try_slice(pages, n_pages, "pages") }?;
        engine.room_set_destination(room, pages, aux(aux_slot)?)
    })
}

/// Prefill engine only: queues the next chunk of room `room`: `n_pages` source page
/// indices (may be 0), written to the next unused destination pages in order.
/// `is_last` closes the room; `aux_slot` (>= 0) names the source aux slot and is allowed
/// only with `is_last`. Never blocks on the network. Once the room has its
/// destinations, a small chunk (at most 1,024 pages x KV buffers x destinations) is
/// planned into frames by the calling thread, which takes microseconds and spares a
/// worker's wakeup; a larger one is planned by a worker.
///
/// Chunks enqueued before every destination arrived are held and sent, in order, when
/// it does. The source pages must not change, nor be reused, until
/// `kvxfer_room_drained` reports true: after the room is terminal, a batch being sent
/// or an RDMA write in flight may still read them. A chunk with more pages than the
/// destination has left, or a last chunk that leaves destination pages unfilled, fails the room on both sides: here with cause MISMATCH, on the decode
/// engine as ABORTED from the peer with this side's reason.
///
/// Errors: `KVXFER_ERR_WRONG_ROLE` on a decode engine; `KVXFER_ERR_NOT_FOUND`;
/// `KVXFER_ERR_WRONG_STATE` if the room is terminal or already got its last chunk;
/// `KVXFER_ERR_INVALID_ARGUMENT` for a page or slot out of range or an aux slot without
/// `is_last`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_enqueue_chunk(
    engine: *const kvxfer_engine,
    room: u64,
    pages: *const u32,
    n_pages: usize,
    is_last: bool,
    aux_slot: i64,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: pages holds n_pages elements by contract.
        let pages = unsafe { try_slice(pages, n_pages, "pages") }?;
        engine.enqueue_chunk(room, pages, is_last, aux(aux_slot)?)
    })
}

/// Prefill engine only: queues layers `layer_first .. layer_first + layer_count` of the
/// token chunk whose source pages are the `n_pages` of `pages`, as soon as those layers
/// are computed, so that each layer's KV moves while the next is computed. Layers are
/// the layer ids the KV buffers were registered with (`kvxfer_register_kv_layers`, or
/// `kvxfer_register_kv_layout` with ids), or without layer ids the buffers' positions
/// (buffer `i` is layer `i`). Never blocks on the network; each call's frames start
/// moving at once, in the order of the calls.
///
/// The first call with a page list opens the chunk, which takes the next unused
/// destination pages as `kvxfer_enqueue_chunk` does; later calls with the same list add
/// layers to it, in any order, interleaved with other chunks' calls. `is_last` closes
/// the room (every chunk must have every layer by then); `aux_slot` (>= 0) names the
/// source aux slot and is allowed only with `is_last`. `kvxfer_enqueue_chunk` is one
/// call with every layer of a new chunk.
///
/// A layer enqueued twice for one chunk, a page list that overlaps an open chunk's
/// without being it, or a room closed while a chunk misses a layer fails the room with a
/// reason naming the chunk (numbered from 0 in the order opened) and the layer, with
/// cause MISMATCH, and the call returns `KVXFER_ERR_INVALID_ARGUMENT` with that reason;
/// the decode engine fails the room as ABORTED from the peer. Overflowing the
/// destination fails the room as `kvxfer_enqueue_chunk` does.
///
/// Errors: `KVXFER_ERR_WRONG_ROLE` on a decode engine; `KVXFER_ERR_NOT_FOUND`;
/// `KVXFER_ERR_WRONG_STATE` if the room is terminal (the message names its state; its
/// reason is `kvxfer_room_failure`) or already closed; `KVXFER_ERR_INVALID_ARGUMENT` for
/// a page or slot out of range, an aux slot without `is_last`, `layer_count` 0, a layer
/// not registered on this engine, or the room failures above.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_enqueue_layers(
    engine: *const kvxfer_engine,
    room: u64,
    pages: *const u32,
    n_pages: usize,
    layer_first: u32,
    layer_count: u32,
    is_last: bool,
    aux_slot: i64,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: pages holds n_pages elements by contract.
        let pages = unsafe { try_slice(pages, n_pages, "pages") }?;
        engine.enqueue_layers(
            room,
            pages,
            layer_first,
            layer_count,
            is_last,
            aux(aux_slot)?,
        )
    })
}

/// Stores the state of room `room` in `*state`. Never blocks on the network: a lookup
/// under one of 64 shard read locks (held for the lookup alone; it can wait only behind
/// a create or clear of a room in the same shard, which hold it as briefly) and one
/// atomic load. Terminal states (SUCCESS, FAILED) never change until the room is
/// cleared.
///
/// Errors: `KVXFER_ERR_NOT_FOUND`; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_poll(
    engine: *const kvxfer_engine,
    room: u64,
    state: *mut kvxfer_room_state,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = try_out(state, "state")?;
        let s = engine.room_poll(room)?;
        // SAFETY: checked by try_out; writable by contract.
        unsafe { out.write(s.into()) };
        Ok(())
    })
}

/// Aborts room `room`: a live room becomes FAILED with `reason` (NUL-terminated UTF-8,
/// copied; NULL for a default text) and the peer engines are told. Idempotent; a
/// terminal room is left as it is (still `KVXFER_OK`).
///
/// Errors: `KVXFER_ERR_NOT_FOUND`; `KVXFER_ERR_INVALID_ARGUMENT` for a reason that is not
/// UTF-8.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_abort(
    engine: *const kvxfer_engine,
    room: u64,
    reason: *const c_char,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let reason = if reason.is_null() {
            ""
        } else {
            // SAFETY: NUL-terminated by contract.
            unsafe { try_str(reason, "reason") }?
        };
        engine.room_abort(room, reason)
    })
}

/// Copies the failure reason of FAILED room `room` into `buf` (NUL-terminated) and its
/// length into `*out_n`. The first reason recorded is kept; later failures do not
/// overwrite it. A reason that came from the peer engine starts with `"peer: "`.
///
/// Errors: `KVXFER_ERR_NOT_FOUND`; `KVXFER_ERR_WRONG_STATE` if the room is not FAILED;
/// `KVXFER_ERR_BUFFER_TOO_SMALL` (with `*out_n` = length needed); `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_failure(
    engine: *const kvxfer_engine,
    room: u64,
    buf: *mut c_char,
    len: usize,
    out_n: *mut usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let why = engine.room_failure(room)?;
        // SAFETY: buf holds len bytes by contract.
        unsafe { write_string(buf, len, out_n, &why.to_string()) }
    })
}

/// Stores the class of FAILED room `room`'s failure in `*cause` and whether the reason
/// came from the peer engine in `*from_peer`.
///
/// Errors: as `kvxfer_room_failure`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_failure_cause(
    engine: *const kvxfer_engine,
    room: u64,
    cause: *mut kvxfer_failure_cause,
    from_peer: *mut bool,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let cause = try_out(cause, "cause")?;
        let from_peer = try_out(from_peer, "from_peer")?;
        let why = engine.room_failure(room)?;
        // SAFETY: both checked by try_out; writable by contract.
        unsafe {
            cause.write(why.cause.into());
            from_peer.write(why.from_peer);
        }
        Ok(())
    })
}

/// Stores in `*drained` whether room `room`'s memory may be reused: the room is terminal
/// and no transport operation can still touch its pages. This is the one test a host
/// makes before it gives a room's pages to another request (and before it clears the
/// room, since a cleared room can no longer be asked). Decode engine: no write into its
/// destination pages can still land (over TCP the receiver refuses every byte for a
/// terminal room and checks the room before each copy and each `recv`, so this becomes
/// true as soon as the `recv` in progress returns; over RDMA, once every prefill engine
/// of the room acknowledged that its writes completed, or was lost, or
/// `drain_timeout_ms` passed and its queue pairs were shut; a room that succeeded is
/// drained at once; on the same-host path, as over TCP: no copy of its own into the
/// pages is in progress). Prefill engine: no worker is still reading its source pages
/// (on the same-host path: the decode engine answered every copy of them, or its link
/// was given up after the stall). A live room is never drained. Never blocks.
///
/// Errors: `KVXFER_ERR_NOT_FOUND`; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_drained(
    engine: *const kvxfer_engine,
    room: u64,
    drained: *mut bool,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = try_out(drained, "drained")?;
        let d = engine.room_drained(room)?;
        // SAFETY: checked by try_out; writable by contract.
        unsafe { out.write(d) };
        Ok(())
    })
}

/// Stores in `*path` the path room `room`'s data takes with its peer engines: TCP, RDMA
/// or `KVXFER_PATH_SAME_HOST` (a direct copy between the two processes on one host,
/// `same_host` in `kvxfer_config_set`), or `KVXFER_PATH_CUDA_IPC` (the same host with
/// CUDA device memory: device pages copied device to device through CUDA IPC) when
/// every peer engine of the room agrees;
/// `KVXFER_PATH_MIXED` when they differ; `KVXFER_PATH_UNKNOWN` while none is paired yet.
/// A path is never changed silently: a same-host pairing that could not take the direct
/// copy is logged at WARN with the reason and counted (`same_host_fallbacks`), and with
/// `same_host=require` its rooms fail as MISMATCH instead. Never blocks.
///
/// Errors: `KVXFER_ERR_NOT_FOUND`; `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_path(
    engine: *const kvxfer_engine,
    room: u64,
    path: *mut kvxfer_path,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = try_out(path, "path")?;
        let p = engine.room_path(room)?;
        // SAFETY: checked by try_out; writable by contract.
        unsafe { out.write(p.into()) };
        Ok(())
    })
}

/// Decode engine only: stores in `*verified` whether room `room` reached SUCCESS with
/// every byte verified: with `integrity=verify` (see `kvxfer_config_set`), every data
/// run of every prefill engine of the room carried a digest bound to the room, its
/// generation and the run's destination, and each matched the bytes where they landed.
/// Over TCP, the same-host path and RDMA alike. False for a room that is live or FAILED
/// (a mismatch fails it as `KVXFER_CAUSE_INTEGRITY`), and with `integrity=off`. Never
/// blocks.
///
/// Errors: `KVXFER_ERR_WRONG_ROLE` on a prefill engine; `KVXFER_ERR_NOT_FOUND`;
/// `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_verified(
    engine: *const kvxfer_engine,
    room: u64,
    verified: *mut bool,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = try_out(verified, "verified")?;
        let v = engine.room_verified(room)?;
        // SAFETY: checked by try_out; writable by contract.
        unsafe { out.write(v) };
        Ok(())
    })
}

/// Decode engine only: stores in `*n` how many of room `room`'s first layers have landed
/// whole, in layer order (the layer ids the KV buffers were registered with, or without
/// ids their positions): layers 0 .. n-1 hold every byte that every prefill engine of
/// the room owes them for the whole destination. For a decode server that starts work on
/// a layer as soon as its KV is in place, while a layer-wise prefill
/// (`kvxfer_enqueue_layers`) still sends the next ones. The count only grows while the
/// room lives; SUCCESS means every layer landed, as ever. With head slices between page
/// sizes that differ, a prefill engine's share is known, and counted, once its Done
/// arrived. Never blocks on the network.
///
/// Errors: `KVXFER_ERR_WRONG_ROLE` on a prefill engine; `KVXFER_ERR_NOT_FOUND`;
/// `KVXFER_ERR_NULL_POINTER`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_layers_landed(
    engine: *const kvxfer_engine,
    room: u64,
    n: *mut u32,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        let out = try_out(n, "n")?;
        let landed = engine.room_layers_landed(room)?;
        // SAFETY: checked by try_out; writable by contract.
        unsafe { out.write(landed) };
        Ok(())
    })
}

/// Releases room `room`'s bookkeeping; a live room is aborted first (FAILED, "cleared
/// while live"). Afterwards the id may be created again at once. Clearing twice is
/// harmless: the second call changes nothing and returns `KVXFER_ERR_NOT_FOUND`.
///
/// Never blocks. Clearing does not make the room's memory reusable: reuse its pages
/// only once `kvxfer_room_drained` reported true, asked before the clear. A room cleared
/// before it drained keeps draining in the background (`rooms_draining` in the
/// metrics) and is released once no transport operation can touch its memory; a peer
/// that still holds it `drain_timeout_ms` after the clear is cut off.
///
/// Errors: `KVXFER_ERR_NOT_FOUND` if the room is not present.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_room_clear(
    engine: *const kvxfer_engine,
    room: u64,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        engine.room_clear(room)
    })
}
