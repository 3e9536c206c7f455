//! CUDA IPC between two processes on one host: the exporting process (a prefill engine)
//! makes handles of the device allocations its registered buffers lie in; the importing
//! process (a decode engine) opens them once into an import table, and copies runs from
//! them into its own device pages, device to device, on a stream of its own.
//!
//! Two kinds of allocations, found per allocation range of each registered buffer (the
//! walk of [`super::check_buffers`]):
//! - VMM memory (`cuMemCreate` + `cuMemMap`, PyTorch's `expandable_segments`): the
//!   allocation's handle (`cuMemRetainAllocationHandle`) is exported as a POSIX file
//!   descriptor (`cuMemExportToShareableHandle`), which must travel over a Unix socket
//!   ([`crate::transport::fdpass`]); the importer maps it into a range of its own
//!   (`cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`,
//!   `cuMemSetAccess`). The allocation must have been created with
//!   `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` among its requested handle types;
//!   otherwise the export fails, and says so.
//! - Other device memory (`cudaMalloc`): a legacy IPC handle (`cuIpcGetMemHandle`, 64
//!   bytes that may travel in any message), opened with `cuIpcOpenMemHandle`.
//!
//! Each range names its GPU by UUID (ordinals differ between processes that see different
//! devices); the importer refuses ranges on a GPU it does not see, or cannot reach by peer
//! access, before it imports anything.
//!
//! The importer trusts nothing of the exporter's addresses: a copy names its source by
//! the exporter's address, which [`Imports::translate`] maps through the table and
//! refuses unless every byte lies in an imported range. A peer can make the importer
//! read only memory it exported itself.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, OwnedFd};

use super::driver::{
    self, Context, CuDevicePtr, CuHandle, Driver, IpcApi, IpcMemHandle, MemAccessDesc,
    ATTR_RANGE_SIZE, ATTR_RANGE_START_ADDR, IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    MEM_ACCESS_FLAGS_PROT_READWRITE, MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    MEM_LOCATION_TYPE_DEVICE, STREAM_NON_BLOCKING,
};
use crate::err;
use crate::error::Result;
use crate::transport::{BufferDesc, MemKind};

/// The most ranges one export may hold (a bound on what an importer decodes).
pub const MAX_RANGES: usize = 65_536;

/// How one exported allocation is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportHandle {
    /// A legacy IPC handle (`cudaMalloc` memory).
    Legacy(IpcMemHandle),
    /// A VMM allocation: the file descriptor at this index of the export's descriptors.
    Fd(u32),
}

/// One device allocation of the exporting process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exported {
    /// Its first byte, in the exporting process.
    pub base: u64,
    /// Its bytes.
    pub len: u64,
    /// The CUDA device it is memory of, by the exporter's ordinal.
    pub device: u32,
    /// That device's UUID: ordinals differ between processes that see different devices
    /// (`CUDA_VISIBLE_DEVICES`, containers), UUIDs do not.
    pub uuid: [u8; 16],
    pub handle: ExportHandle,
}

/// What an exporting process hands its peer: the ranges (for a control message) and the
/// descriptors of its VMM allocations (for a Unix socket), in the order of the indices.
pub struct Exports {
    pub ranges: Vec<Exported>,
    pub fds: Vec<OwnedFd>,
}

/// Bytes of one encoded range.
const RANGE_BYTES: usize = 8 + 8 + 4 + 16 + 1 + 64;

/// Encodes `ranges` for a control message: a count, then each range.
pub fn encode(ranges: &[Exported]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + ranges.len() * RANGE_BYTES);
    out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for r in ranges {
        out.extend_from_slice(&r.base.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&r.device.to_le_bytes());
        out.extend_from_slice(&r.uuid);
        let mut handle = [0u8; 64];
        match r.handle {
            ExportHandle::Legacy(h) => {
                out.push(0);
                handle = h.0;
            }
            ExportHandle::Fd(i) => {
                out.push(1);
                handle[..4].copy_from_slice(&i.to_le_bytes());
            }
        }
        out.extend_from_slice(&handle);
    }
    out
}

/// Decodes what [`encode`] wrote; every field is checked by [`Imports::open`] after.
pub fn decode(b: &[u8]) -> std::result::Result<Vec<Exported>, String> {
    let n = b
        .get(..4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize)
        .ok_or("an IPC export without its count")?;
    if n > MAX_RANGES || b.len() != 4 + n * RANGE_BYTES {
        return Err(format!(
            "an IPC export of {n} ranges in {} bytes (at most {MAX_RANGES} ranges of \
             {RANGE_BYTES} bytes)",
            b.len()
        ));
    }
    let u64_at = |c: &[u8], at: usize| u64::from_le_bytes(c[at..at + 8].try_into().expect("8"));
    let u32_at = |c: &[u8], at: usize| u32::from_le_bytes(c[at..at + 4].try_into().expect("4"));
    b[4..]
        .chunks(RANGE_BYTES)
        .map(|c| {
            let mut h = [0u8; 64];
            h.copy_from_slice(&c[37..101]);
            let mut uuid = [0u8; 16];
            uuid.copy_from_slice(&c[20..36]);
            let handle = match c[36] {
                0 => ExportHandle::Legacy(IpcMemHandle(h)),
                1 => ExportHandle::Fd(u32_at(&h, 0)),
                k => return Err(format!("an IPC export range of kind {k}")),
            };
            Ok(Exported {
                base: u64_at(c, 0),
                len: u64_at(c, 8),
                device: u32_at(c, 16),
                uuid,
                handle,
            })
        })
        .collect()
}

fn call(d: &Driver, ctx: Context, what: &str, f: impl FnOnce() -> driver::CuResult) -> Result<()> {
    let r = d.with_context(ctx, f)?;
    d.check(r)
        .map_err(|e| err!(TransportUnavailable, "{what} failed: {e}"))
}

/// Exports every device allocation that the device buffers of `bufs` lie in (each once,
/// however many buffers share it). Host buffers are skipped.
pub fn export(bufs: &[BufferDesc]) -> Result<Exports> {
    let mut out = Exports {
        ranges: Vec::new(),
        fds: Vec::new(),
    };
    if bufs.iter().all(|b| b.kind.is_host()) {
        return Ok(out);
    }
    let d = driver::load()?;
    let api = d.ipc()?;
    let mut seen = BTreeMap::new();
    for (i, b) in bufs.iter().enumerate() {
        let MemKind::Cuda { device } = b.kind else {
            continue;
        };
        let ctx = d.primary_context(device)?;
        let uuid = device_uuid(d, api, device)?;
        let (mut at, end) = (b.base as u64, b.base as u64 + b.len as u64);
        while at < end {
            let attr = |a| {
                d.with_context(ctx, || d.pointer_attribute(a, at))?
                    .map_err(|r| {
                        err!(
                            InvalidArgument,
                            "kv buffer {i}: address {at:#x}: {}",
                            d.describe(r)
                        )
                    })
            };
            let start: u64 = attr(ATTR_RANGE_START_ADDR)?;
            let size: u64 = attr(ATTR_RANGE_SIZE)?;
            if start > at || start.saturating_add(size) <= at {
                return Err(err!(
                    InvalidArgument,
                    "kv buffer {i}: the driver gives {at:#x} the allocation {start:#x}+{size}"
                ));
            }
            if let std::collections::btree_map::Entry::Vacant(v) = seen.entry(start) {
                v.insert(());
                let handle = export_one(d, api, ctx, start, size, &mut out.fds)?;
                out.ranges.push(Exported {
                    base: start,
                    len: size,
                    device,
                    uuid,
                    handle,
                });
            }
            at = start + size;
        }
    }
    Ok(out)
}

/// The UUID of device `ordinal`.
fn device_uuid(d: &Driver, api: &IpcApi, ordinal: u32) -> Result<[u8; 16]> {
    let dev = d.device(ordinal)?;
    let mut uuid = [0u8; 16];
    // SAFETY: writes one CUuuid (16 bytes) of a valid device.
    d.check(unsafe { (api.cuDeviceGetUuid)(&mut uuid, dev) })
        .map_err(|e| {
            err!(
                TransportUnavailable,
                "cuDeviceGetUuid({ordinal}) failed: {e}"
            )
        })?;
    Ok(uuid)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether device `ordinal` here can read memory of every GPU the ranges name: its own,
/// or a peer it has access to; a GPU this process does not see (another GPU namespace,
/// other visible devices) cannot be imported from.
fn check_reach(d: &Driver, api: &IpcApi, ordinal: u32, ranges: &[Exported]) -> Result<()> {
    let ours = device_uuid(d, api, ordinal)?;
    let n = d.device_count()?;
    let mut seen: Vec<[u8; 16]> = Vec::new();
    for r in ranges {
        if r.uuid == ours || seen.contains(&r.uuid) {
            continue;
        }
        seen.push(r.uuid);
        let mut at = None;
        for j in 0..n {
            if device_uuid(d, api, j)? == r.uuid {
                at = Some(j);
                break;
            }
        }
        let Some(j) = at else {
            return Err(err!(
                TransportUnavailable,
                "the peer's device memory is on GPU {}, which this process does not see \
                 (another GPU namespace, or other visible devices)",
                hex(&r.uuid)
            ));
        };
        let mut can: c_int = 0;
        // SAFETY: writes one int, for two valid devices.
        d.check(unsafe { (api.cuDeviceCanAccessPeer)(&mut can, d.device(ordinal)?, d.device(j)?) })
            .map_err(|e| err!(TransportUnavailable, "cuDeviceCanAccessPeer failed: {e}"))?;
        if can == 0 {
            return Err(err!(
                TransportUnavailable,
                "device {ordinal} here cannot access the peer's GPU {} (device {j} here): no \
                 peer access between them",
                hex(&r.uuid)
            ));
        }
    }
    Ok(())
}

/// The handle of the allocation `start..start + size`: a file descriptor (pushed to
/// `fds`) for VMM memory, a legacy IPC handle otherwise.
fn export_one(
    d: &Driver,
    api: &IpcApi,
    ctx: Context,
    start: u64,
    size: u64,
    fds: &mut Vec<OwnedFd>,
) -> Result<ExportHandle> {
    let mut h: u64 = 0;
    // SAFETY: writes one allocation handle; fails (writing nothing we use) for memory
    // that is not a VMM mapping.
    let vmm = d.with_context(ctx, || unsafe {
        (api.cuMemRetainAllocationHandle)(&mut h, start as *mut c_void)
    })? == 0;
    if !vmm {
        let mut ipc = IpcMemHandle([0; 64]);
        // SAFETY: writes one 64-byte handle for the allocation at `start`.
        call(d, ctx, "cuIpcGetMemHandle", || unsafe {
            (api.cuIpcGetMemHandle)(&mut ipc, start)
        })
        .map_err(|e| {
            err!(
                TransportUnavailable,
                "exporting the device allocation at {start:#x}+{size}: {}",
                e.message()
            )
        })?;
        return Ok(ExportHandle::Legacy(ipc));
    }
    let mut fd: c_int = -1;
    // SAFETY: writes one int (the descriptor type's shareable handle) for a handle we
    // retained above.
    let exported = call(d, ctx, "cuMemExportToShareableHandle", || unsafe {
        (api.cuMemExportToShareableHandle)(
            (&mut fd as *mut c_int).cast(),
            h,
            MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    });
    // SAFETY: releases the reference cuMemRetainAllocationHandle took, once.
    let _ = d.with_context(ctx, || unsafe { (api.cuMemRelease)(h) });
    exported.map_err(|e| {
        err!(
            TransportUnavailable,
            "exporting the VMM allocation at {start:#x}+{size} as a POSIX file descriptor: \
             {} (it must be created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among \
             its requested handle types)",
            e.message()
        )
    })?;
    if fd < 0 {
        return Err(err!(
            TransportUnavailable,
            "cuMemExportToShareableHandle gave descriptor {fd}"
        ));
    }
    // SAFETY: a fresh descriptor the driver made for us; owned once, here.
    fds.push(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
    Ok(ExportHandle::Fd(fds.len() as u32 - 1))
}

/// How an imported range is given back.
enum Mapped {
    Legacy,
    Vmm { handle: u64 },
}

/// One imported allocation: the exporter's `remote..remote + len` is `local..` here.
struct Segment {
    remote: u64,
    len: u64,
    local: u64,
    mapped: Mapped,
}

/// The import table of one pairing (see the module's documentation): opened once,
/// given back when dropped. Its memory is read only by copies issued through
/// [`DtoD::copy`], which wait for them, so nothing reads it once it is dropped.
pub struct Imports {
    d: &'static Driver,
    api: &'static IpcApi,
    ctx: Context,
    device: u32,
    /// By remote address, disjoint.
    segments: Vec<Segment>,
}

// SAFETY: the table holds addresses and handles of the thread-safe driver API; it is
// changed only while owned (open, drop).
unsafe impl Send for Imports {}
// SAFETY: as for Send: `&Imports` only reads the table.
unsafe impl Sync for Imports {}

impl Imports {
    /// Opens `ranges` (the exporter's, with `fds` its VMM allocations' descriptors, in
    /// index order) into device `device`'s primary context. The ranges are checked
    /// first: none empty or overflowing, none overlapping another, every descriptor
    /// index valid and used once, and every descriptor used.
    pub fn open(device: u32, ranges: &[Exported], fds: Vec<OwnedFd>) -> Result<Imports> {
        check(ranges, fds.len())?;
        let d = driver::load()?;
        let api = d.ipc()?;
        let ctx = d.primary_context(device)?;
        check_reach(d, api, device, ranges)?;
        let mut t = Imports {
            d,
            api,
            ctx,
            device,
            segments: Vec::with_capacity(ranges.len()),
        };
        let mut sorted = ranges.to_vec();
        sorted.sort_by_key(|r| r.base);
        for r in sorted {
            let seg = match r.handle {
                ExportHandle::Legacy(h) => t.open_legacy(&r, h)?,
                ExportHandle::Fd(i) => t.open_vmm(&r, &fds[i as usize])?,
            };
            t.segments.push(seg);
        }
        Ok(t)
    }

    fn open_legacy(&self, r: &Exported, h: IpcMemHandle) -> Result<Segment> {
        let mut p: CuDevicePtr = 0;
        // SAFETY: writes one device pointer; the handle is 64 bytes by value.
        call(self.d, self.ctx, "cuIpcOpenMemHandle", || unsafe {
            (self.api.cuIpcOpenMemHandle_v2)(&mut p, h, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })
        .map_err(|e| self.failed(r, e))?;
        let seg = Segment {
            remote: r.base,
            len: r.len,
            local: p,
            mapped: Mapped::Legacy,
        };
        // The length is the peer's word; the mapping's is the driver's. A range longer
        // than what was opened would let a copy read past it, into memory of ours.
        let (d, ctx) = (self.d, self.ctx);
        let attr = |a| d.with_context(ctx, || d.pointer_attribute::<u64>(a, p));
        // An attribute the driver cannot give makes the range refused.
        let start = attr(ATTR_RANGE_START_ADDR)?.unwrap_or(u64::MAX);
        let size = attr(ATTR_RANGE_SIZE)?.unwrap_or(0);
        let fits = start <= p && p.saturating_add(r.len) <= start.saturating_add(size);
        if !fits {
            self.close(&seg);
            return Err(err!(
                InvalidArgument,
                "the peer's device allocation {:#x} claims {} bytes, but what its handle \
                 opened here is {start:#x}+{size}",
                r.base,
                r.len
            ));
        }
        Ok(seg)
    }

    fn open_vmm(&self, r: &Exported, fd: &OwnedFd) -> Result<Segment> {
        let (d, api, ctx, len) = (self.d, self.api, self.ctx, r.len as usize);
        let mut h: u64 = 0;
        // SAFETY: writes one allocation handle; the descriptor is live (borrowed) and
        // the driver takes its own reference to what it names.
        call(d, ctx, "cuMemImportFromShareableHandle", || unsafe {
            (api.cuMemImportFromShareableHandle)(
                &mut h,
                fd.as_raw_fd() as isize as *mut c_void,
                MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })
        .map_err(|e| self.failed(r, e))?;
        let release = || {
            // SAFETY: the handle imported above, released once.
            let _ = d.with_context(ctx, || unsafe { (api.cuMemRelease)(h) });
        };
        let mut p: CuDevicePtr = 0;
        // SAFETY: writes one address of a fresh reservation of `len` bytes.
        if let Err(e) = call(d, ctx, "cuMemAddressReserve", || unsafe {
            (api.cuMemAddressReserve)(&mut p, len, 0, 0, 0)
        }) {
            release();
            return Err(self.failed(r, e));
        }
        let access = MemAccessDesc {
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: self.device as c_int,
            flags: MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: maps the imported allocation at offset 0 over the whole reservation
        // made above, then grants this device access to it.
        let mapped = call(d, ctx, "cuMemMap", || unsafe {
            (api.cuMemMap)(p, len, 0, h, 0)
        });
        let granted = mapped.and_then(|()| {
            // SAFETY: as above; `access` is one descriptor.
            call(d, ctx, "cuMemSetAccess", || unsafe {
                (api.cuMemSetAccess)(p, len, &access, 1)
            })
            .inspect_err(|_| {
                // SAFETY: unmaps what cuMemMap mapped above.
                let _ = d.with_context(ctx, || unsafe { (api.cuMemUnmap)(p, len) });
            })
        });
        if let Err(e) = granted {
            // SAFETY: frees the reservation made above, now unmapped.
            let _ = d.with_context(ctx, || unsafe { (api.cuMemAddressFree)(p, len) });
            release();
            return Err(self.failed(r, e));
        }
        Ok(Segment {
            remote: r.base,
            len: r.len,
            local: p,
            mapped: Mapped::Vmm { handle: h },
        })
    }

    fn failed(&self, r: &Exported, e: crate::Error) -> crate::Error {
        err!(
            TransportUnavailable,
            "importing the peer's device allocation {:#x}+{} into device {}: {}",
            r.base,
            r.len,
            self.device,
            e.message()
        )
    }

    /// The device it imported into.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Imported allocations.
    pub fn len(&self) -> usize {
        self.segments.len()
    }

    /// Whether nothing was imported.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// The local pieces (address here, bytes) of the exporter's `remote..remote + len`,
    /// in order; `Err` naming the first byte that lies in no imported range.
    pub fn translate(&self, remote: u64, len: u64) -> std::result::Result<Vec<(u64, u64)>, String> {
        translate(&self.segments, remote, len)
    }
}

/// [`Imports::translate`] over `segments` (sorted by remote address, disjoint).
fn translate(
    segments: &[Segment],
    remote: u64,
    len: u64,
) -> std::result::Result<Vec<(u64, u64)>, String> {
    {
        let end = remote
            .checked_add(len)
            .ok_or_else(|| format!("the range {remote:#x}+{len} overflows"))?;
        let mut out = Vec::new();
        let mut at = remote;
        while at < end {
            let i = segments.partition_point(|s| s.remote <= at);
            let seg = i.checked_sub(1).map(|i| &segments[i]);
            let Some(s) = seg.filter(|s| at - s.remote < s.len) else {
                return Err(format!(
                    "byte {} of the range {remote:#x}+{len} (address {at:#x}) lies outside \
                     the device memory the peer exported",
                    at - remote
                ));
            };
            let n = (s.remote + s.len).min(end) - at;
            out.push((s.local + (at - s.remote), n));
            at += n;
        }
        Ok(out)
    }
}

impl Imports {
    /// Gives back one imported segment.
    fn close(&self, s: &Segment) {
        let (d, api, len) = (self.d, self.api, s.len as usize);
        let _ = d.with_context(self.ctx, || match s.mapped {
            // SAFETY: opened by cuIpcOpenMemHandle, closed once; no copy reads it
            // (copies are waited for before DtoD::copy returns, and this table is
            // dropped only when no one borrows it).
            Mapped::Legacy => unsafe { (api.cuIpcCloseMemHandle)(s.local) },
            // SAFETY: as above, for the mapping, reservation and handle made by
            // open_vmm, each given back once.
            Mapped::Vmm { handle } => unsafe {
                (api.cuMemUnmap)(s.local, len);
                (api.cuMemAddressFree)(s.local, len);
                (api.cuMemRelease)(handle)
            },
        });
    }
}

impl Drop for Imports {
    fn drop(&mut self) {
        for s in std::mem::take(&mut self.segments) {
            self.close(&s);
        }
    }
}

/// Checks exported ranges before anything is imported.
fn check(ranges: &[Exported], fds: usize) -> Result<()> {
    if ranges.len() > MAX_RANGES {
        return Err(err!(
            InvalidArgument,
            "{} IPC ranges, at most {MAX_RANGES}",
            ranges.len()
        ));
    }
    let mut used = vec![false; fds];
    let mut sorted: Vec<&Exported> = ranges.iter().collect();
    sorted.sort_by_key(|r| r.base);
    for (i, r) in sorted.iter().enumerate() {
        if r.len == 0 || r.base.checked_add(r.len).is_none() {
            return Err(err!(
                InvalidArgument,
                "the IPC range {:#x}+{} is empty or overflows",
                r.base,
                r.len
            ));
        }
        if let Some(next) = sorted.get(i + 1) {
            if r.base + r.len > next.base {
                return Err(err!(
                    InvalidArgument,
                    "the IPC ranges {:#x}+{} and {:#x}+{} overlap",
                    r.base,
                    r.len,
                    next.base,
                    next.len
                ));
            }
        }
        if let ExportHandle::Fd(k) = r.handle {
            match used.get_mut(k as usize) {
                Some(u) if !*u => *u = true,
                _ => {
                    return Err(err!(
                        InvalidArgument,
                        "the IPC range {:#x}+{} names descriptor {k}, of {fds} passed, or one \
                         another range names",
                        r.base,
                        r.len
                    ))
                }
            }
        }
    }
    if let Some(k) = used.iter().position(|u| !u) {
        return Err(err!(
            InvalidArgument,
            "descriptor {k} of {fds} passed belongs to no IPC range"
        ));
    }
    Ok(())
}

/// Device-to-device copies from an import table into this process's device memory, on a
/// stream of its own (one per thread that copies).
pub struct DtoD {
    d: &'static Driver,
    api: &'static IpcApi,
    ctx: Context,
    stream: CuHandle,
}

// SAFETY: the stream is used only through the thread-safe driver, by one thread at a time
// (DtoD is not Sync).
unsafe impl Send for DtoD {}

impl DtoD {
    /// A copier on device `device` (the device of the pages it copies into, which must be
    /// the device the table imported into).
    pub fn new(device: u32) -> Result<DtoD> {
        let d = driver::load()?;
        let api = d.ipc()?;
        let ctx = d.primary_context(device)?;
        let mut stream: CuHandle = std::ptr::null_mut();
        // SAFETY: writes one stream handle, in the device's context.
        call(d, ctx, "cuStreamCreate", || unsafe {
            (d.cuStreamCreate)(&mut stream, STREAM_NON_BLOCKING)
        })?;
        Ok(DtoD {
            d,
            api,
            ctx,
            stream,
        })
    }

    /// Copies each `(dst, src, len)`: `dst` device memory of this process that the caller
    /// owns for the call (a page it granted), `src` the exporter's address, translated
    /// through `from`. Every source is translated before anything is issued, so a run
    /// outside the exported ranges copies nothing ([`CopyError::Outside`]); otherwise
    /// the copies are issued on the stream and waited for before this returns.
    pub fn copy(
        &self,
        from: &Imports,
        runs: &[(u64, u64, u64)],
    ) -> std::result::Result<(), CopyError> {
        let mut pieces = Vec::with_capacity(runs.len());
        for &(dst, src, len) in runs {
            let mut at = dst;
            for (local, n) in from.translate(src, len).map_err(CopyError::Outside)? {
                pieces.push((at, local, n));
                at += n;
            }
        }
        let (d, api, stream) = (self.d, self.api, self.stream);
        let driver = |e: crate::Error| CopyError::Driver(e.message().to_string());
        for &(dst, src, n) in &pieces {
            // SAFETY: `src..src + n` lies in an imported range of `from` (translated
            // above), which stays open while borrowed; `dst..dst + n` is the caller's;
            // the copy is waited for below, before either borrow ends.
            call(d, self.ctx, "cuMemcpyDtoDAsync", || unsafe {
                (api.cuMemcpyDtoDAsync_v2)(dst, src, n as usize, stream)
            })
            .map_err(|e| {
                // Wait for what was issued: nothing may still read or write after we return.
                let _ = self.wait();
                driver(e)
            })?;
        }
        self.wait().map_err(driver)
    }

    /// Waits for the work issued on the stream so far.
    fn wait(&self) -> Result<()> {
        let d = self.d;
        // SAFETY: our live stream.
        call(d, self.ctx, "cuStreamSynchronize", || unsafe {
            (d.cuStreamSynchronize)(self.stream)
        })
    }
}

impl Drop for DtoD {
    fn drop(&mut self) {
        let d = self.d;
        // SAFETY: our stream; every copy on it was waited for in `copy`.
        let _ = call(d, self.ctx, "cuStreamDestroy", || unsafe {
            (d.cuStreamDestroy_v2)(self.stream)
        });
    }
}

/// Why a copy of [`DtoD::copy`] did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyError {
    /// A source lies outside the exported ranges: the peer asked for memory it did not
    /// export. Nothing was copied.
    Outside(String),
    /// The driver failed a copy (some of the runs may have been copied).
    Driver(String),
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyError::Outside(w) | CopyError::Driver(w) => f.write_str(w),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(base: u64, len: u64, tag: u8) -> Exported {
        Exported {
            base,
            len,
            device: 0,
            uuid: [tag; 16],
            handle: ExportHandle::Legacy(IpcMemHandle([tag; 64])),
        }
    }

    #[test]
    fn ranges_round_trip_and_a_bad_kind_or_length_is_refused() {
        let ranges = vec![
            legacy(0x1000, 4096, 7),
            Exported {
                base: 0x9000,
                len: 8192,
                device: 3,
                uuid: [5; 16],
                handle: ExportHandle::Fd(0),
            },
        ];
        let b = encode(&ranges);
        assert_eq!(decode(&b).unwrap(), ranges);
        assert!(decode(&b[..b.len() - 1]).is_err());
        let mut bad = b.clone();
        bad[4 + 36] = 9;
        assert!(decode(&bad).unwrap_err().contains("kind 9"));
        let mut many = b.clone();
        many[..4].copy_from_slice(&(MAX_RANGES as u32 + 1).to_le_bytes());
        assert!(decode(&many).is_err());
    }

    #[test]
    fn a_run_translates_across_abutting_imports_and_a_byte_outside_them_is_refused() {
        let seg = |remote, len, local| Segment {
            remote,
            len,
            local,
            mapped: Mapped::Legacy,
        };
        // Two abutting allocations there, apart here; a hole after them.
        let t = [
            seg(0x10_000, 0x1000, 0x90_000),
            seg(0x11_000, 0x1000, 0x50_000),
            seg(0x13_000, 0x1000, 0x70_000),
        ];
        assert_eq!(
            translate(&t, 0x10_800, 0x1000).unwrap(),
            vec![(0x90_800, 0x800), (0x50_000, 0x800)]
        );
        assert_eq!(
            translate(&t, 0x13_000, 0x1000).unwrap(),
            vec![(0x70_000, 0x1000)]
        );
        let e = translate(&t, 0x11_800, 0x1000).unwrap_err();
        assert!(
            e.contains("address 0x12000") && e.contains("outside"),
            "{e}"
        );
        assert!(translate(&t, 0xf_fff, 2).is_err());
        assert!(translate(&t, 0x13_fff, 2).is_err());
        assert!(translate(&t, u64::MAX, 2).is_err());
        assert!(translate(&[], 0x10_000, 1).is_err());
    }

    #[test]
    fn overlapping_empty_or_badly_indexed_ranges_are_refused_before_any_import() {
        let ok = [legacy(0x1000, 0x1000, 1), legacy(0x2000, 0x1000, 2)];
        assert!(check(&ok, 0).is_ok());
        let e = check(&[legacy(0x1000, 0x1001, 1), legacy(0x2000, 0x1000, 2)], 0).unwrap_err();
        assert!(e.message().contains("overlap"), "{e}");
        assert!(check(&[legacy(0x1000, 0, 1)], 0).is_err());
        assert!(check(&[legacy(u64::MAX - 1, 2, 1)], 0).is_err());
        let fd = |base, i| Exported {
            base,
            len: 0x1000,
            device: 0,
            uuid: [0; 16],
            handle: ExportHandle::Fd(i),
        };
        assert!(check(&[fd(0x1000, 0), fd(0x2000, 1)], 2).is_ok());
        assert!(check(&[fd(0x1000, 0), fd(0x2000, 0)], 2).is_err());
        assert!(check(&[fd(0x1000, 2)], 2).is_err());
        let e = check(&[fd(0x1000, 0)], 2).unwrap_err();
        assert!(e.message().contains("belongs to no IPC range"), "{e}");
    }
}
