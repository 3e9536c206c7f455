//! `kvxfer_buffer_desc`: a registered buffer with the kind of memory it is (host, or CUDA
//! device memory of a given device), and the registration calls that take it
//! (`kvxfer_register_kv_desc`, `kvxfer_register_aux_desc`). `kvxfer_buffer` stays as it
//! is, for host memory.

use std::ffi::c_void;

use super::boundary::try_slice;
use super::engine::kvxfer_engine;
use super::layout::{self, kvxfer_kv_layout};
use super::status::kvxfer_status;
use crate::err;
use crate::error::Result;
use crate::transport::{BufferDesc, MemKind};

/// Where a registered buffer's bytes live (values of `kvxfer_buffer_desc.kind`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_memory_kind {
    /// Host memory of this process (what `kvxfer_buffer` registers).
    KVXFER_MEMORY_HOST = 0,
    /// CUDA device memory of device `device` (`cudaMalloc`, or a CUDA VMM range:
    /// `cuMemCreate` + `cuMemMap`, possibly of several physical allocations).
    KVXFER_MEMORY_CUDA = 1,
}

/// One registered memory buffer with its memory kind: `len` bytes at `base`, in pages
/// (KV) or slots (aux) of `item_len` bytes. Set `struct_size` to
/// `sizeof(kvxfer_buffer_desc)` in every element: fields are only ever appended, and the
/// library refuses a size it does not know.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvxfer_buffer_desc {
    /// `sizeof(kvxfer_buffer_desc)` as the caller compiled it.
    pub struct_size: usize,
    /// A `kvxfer_memory_kind` value.
    pub kind: u32,
    /// The CUDA device ordinal for `KVXFER_MEMORY_CUDA` (as the driver counts devices,
    /// so as `CUDA_VISIBLE_DEVICES` makes them); must be 0 for `KVXFER_MEMORY_HOST`.
    pub device: u32,
    /// First byte of the buffer (a device address for `KVXFER_MEMORY_CUDA`).
    pub base: *mut c_void,
    /// Length in bytes.
    pub len: usize,
    /// Bytes of one page or slot.
    pub item_len: usize,
}

/// The sizes of `kvxfer_buffer_desc` the library reads. One version so far.
const SIZES: [usize; 1] = [std::mem::size_of::<kvxfer_buffer_desc>()];

/// Reads `n` descriptors: the first element's `struct_size` before the array is taken
/// as an array of this library's struct (its stride depends on it), then each
/// element's, and converts them (unknown kinds are an error naming the element).
///
/// # Safety
/// A non-NULL `p` with `n > 0` must point to `n` readable `kvxfer_buffer_desc` of the
/// size the caller compiled.
unsafe fn read_descs(p: *const kvxfer_buffer_desc, n: usize) -> Result<Vec<BufferDesc>> {
    let ours = std::mem::size_of::<kvxfer_buffer_desc>();
    let check = |i: usize, size: usize| {
        if SIZES.contains(&size) {
            return Ok(());
        }
        let hint = if size > ours {
            format!(
                "larger than this library's ({}): the caller was built against a newer \
                 kvxfer.h",
                crate::VERSION
            )
        } else {
            "set it to sizeof(kvxfer_buffer_desc)".to_string()
        };
        Err(err!(
            InvalidArgument,
            "bufs[{i}].struct_size is {size}, not sizeof(kvxfer_buffer_desc) = {ours}; {hint}"
        ))
    };
    if n > 0 && !p.is_null() && p.is_aligned() {
        // SAFETY: non-NULL and aligned; every version of the struct starts with
        // struct_size, which the caller guarantees readable. No reference to the whole
        // struct is made before its size is known.
        check(0, unsafe { std::ptr::addr_of!((*p).struct_size).read() })?;
    }
    // SAFETY: the caller guarantees n elements; element 0's size is this library's, so
    // the array has this library's stride.
    let descs = unsafe { try_slice(p, n, "bufs") }?;
    descs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            check(i, d.struct_size)?;
            let kind = match d.kind {
                0 if d.device == 0 => MemKind::Host,
                0 => {
                    return Err(err!(
                        InvalidArgument,
                        "bufs[{i}].device is {} for host memory (KVXFER_MEMORY_HOST): set it \
                         to 0",
                        d.device
                    ))
                }
                1 => MemKind::Cuda { device: d.device },
                k => {
                    return Err(err!(
                        InvalidArgument,
                        "bufs[{i}].kind {k} is neither KVXFER_MEMORY_HOST (0) nor \
                         KVXFER_MEMORY_CUDA (1)"
                    ))
                }
            };
            Ok(BufferDesc {
                base: d.base as usize,
                len: d.len,
                item_len: d.item_len,
                kind,
            })
        })
        .collect()
}

/// Registers the engine's KV buffers, each with the kind of memory it is, instead of
/// `kvxfer_register_kv`, `kvxfer_register_kv_layers` or `kvxfer_register_kv_layout`,
/// once, before any room is created. `layer_ids` is NULL (buffers pair by position) or
/// holds `n` layer ids (as `kvxfer_register_kv_layers`); `layout` is NULL (pages are
/// copied byte for byte) or the layout of the pages (as `kvxfer_register_kv_layout`).
/// The memory must stay valid until `kvxfer_engine_free` returns; the arrays and the
/// layout are copied.
///
/// A `KVXFER_MEMORY_CUDA` buffer is checked against the CUDA driver, which the library
/// loads at run time (`libcuda.so.1`, or the file named by the environment variable
/// `KVXFER_CUDA_LIBRARY`): every byte must be device memory of `device`; a buffer may
/// span several allocations (CUDA VMM). The library never reads or writes device memory
/// with the CPU. GPU memory over RDMA is not supported.
///
/// Errors: as `kvxfer_register_kv_layout`; `KVXFER_ERR_INVALID_ARGUMENT` for a
/// `struct_size` other than `sizeof(kvxfer_buffer_desc)`, an unknown `kind`, a nonzero
/// `device` for host memory, a CUDA device that does not exist, or device memory the
/// driver does not know as memory of that device (the message names the buffer and the
/// byte); `KVXFER_ERR_TRANSPORT_UNAVAILABLE` when a CUDA buffer is registered and the
/// driver cannot be loaded, `cuInit` fails or the driver sees no device (the message
/// names the library and what is missing); `KVXFER_ERR_UNSUPPORTED` for CUDA memory on
/// an engine that uses RDMA (set `transport=tcp`) or on a decode engine with
/// `encrypt_data=on`.
///
/// Device pages move over TCP through pinned host staging (4 slots of at least 1 MiB per
/// sending thread and per receiving connection, allocated on first use); the same-host
/// path does not take device memory (a pairing then uses TCP, or with
/// `same_host=require` fails). With `integrity=verify` a decode engine digests a run into
/// device memory in the staging slots, before the copy to the device.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_kv_desc(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer_desc,
    layer_ids: *const u32,
    n: usize,
    layout: *const kvxfer_kv_layout,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { read_descs(bufs, n) }?;
        let layers = if layer_ids.is_null() {
            None
        } else {
            // SAFETY: a non-NULL layer_ids holds n elements by contract.
            Some(unsafe { try_slice(layer_ids, n, "layer_ids") }?.to_vec())
        };
        let layout = if layout.is_null() {
            None
        } else {
            // SAFETY: a non-NULL layout points to a readable struct of its struct_size.
            Some(unsafe { layout::read(layout) }?)
        };
        match (layers, layout) {
            (layers, Some(layout)) => engine.register_kv_layout(bufs, layers, layout),
            (Some(layers), None) => engine.register_kv_layers(bufs, layers),
            (None, None) => engine.register_kv(bufs),
        }
    })
}

/// Registers the engine's aux buffers with the kind of memory each is, instead of
/// `kvxfer_register_aux`. Same rules and errors as `kvxfer_register_aux` and, for the
/// descriptors, `kvxfer_register_kv_desc`.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_register_aux_desc(
    engine: *const kvxfer_engine,
    bufs: *const kvxfer_buffer_desc,
    n: usize,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL engine came from kvxfer_engine_new (freed or not).
        let engine = unsafe { kvxfer_engine::enter(engine) }?;
        // SAFETY: bufs holds n elements by contract.
        let bufs = unsafe { read_descs(bufs, n) }?;
        engine.register_aux(bufs)
    })
}
