//! The verbs layer of the RDMA transport: devices, memory regions and RC queue pairs that
//! post RDMA WRITEs and wait for their completions.
//!
//! Resources come from the `sideway` crate, whose `rdma-mummy-sys` loads libibverbs with
//! `dlopen` when the library is loaded: there is no link-time dependency, and on a host
//! without rdma-core every verb fails cleanly, which [`Device::open`] reports as "no
//! device". The hot path (chained `ibv_post_send`, `ibv_poll_cq`) and the completion
//! channel calls sideway does not wrap (`ibv_req_notify_cq`, `ibv_get_cq_event`,
//! `ibv_ack_cq_events`) are called through `rdma-mummy-sys` directly.
//!
//! Ownership keeps the destruction order verbs require: every sideway object holds an
//! `Arc` to what it was created from (QP -> CQ and PD, CQ -> completion channel and
//! context, channel -> context, MR -> PD -> context), so a QP is destroyed before its CQ,
//! the CQ before its channel, and the PD before the context, whatever order the owners
//! drop in. Completion events are acknowledged as soon as they are read, so
//! `ibv_destroy_cq` never waits for unacknowledged events.

use std::fmt;
use std::io;
use std::net::Ipv6Addr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
};
use sideway::ibverbs::AccessFlags;

/// Connection data of one RC queue pair, exchanged over the control connection: the
/// wire's own type (queue pair number, 24-bit PSN, LID, GID, `ibv_mtu` value 1..=5).
pub use crate::proto::QpInfo as EndpointInfo;

/// How the port addresses packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GidKind {
    /// InfiniBand link layer: LID routing, GID index 0.
    Ib,
    /// RoCE v1 (Ethernet, GRH in an Ethernet frame).
    RoceV1,
    /// RoCE v2 (Ethernet, UDP/IP).
    RoceV2,
}

impl fmt::Display for GidKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidKind::Ib => "IB",
            GidKind::RoceV1 => "RoCEv1",
            GidKind::RoceV2 => "RoCEv2",
        })
    }
}

/// One opened device port: context, protection domain, port number, GID index/GID, lid,
/// active MTU.
///
/// `Send + Sync` without `unsafe impl`: it only holds sideway's context and PD (both
/// `Send + Sync`; libibverbs contexts and PDs are thread-safe) and plain data.
pub struct Device {
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    kind: GidKind,
    lid: u16,
    mtu: u8,
    max_qp_wr: u32,
    max_cqe: u32,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.describe())
    }
}

/// Formats an error with its chain of sources ("verb failed: Invalid argument ...").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        let t = x.to_string();
        if !s.ends_with(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = x.source();
    }
    s
}

/// An `io::Error` saying `what` failed because of `e`, keeping the OS error kind.
fn io_error(what: String, e: &(dyn std::error::Error + 'static)) -> io::Error {
    let mut kind = io::ErrorKind::Other;
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(x) = src {
        if let Some(io) = x.downcast_ref::<io::Error>() {
            kind = io.kind();
            break;
        }
        src = x.source();
    }
    io::Error::new(kind, format!("{what}: {}", chain(e)))
}

/// A usable port found on one opened device.
struct PortChoice {
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    kind: GidKind,
    lid: u16,
    mtu: u8,
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// The port's valid GIDs as (index, gid, RoCE v2?); `len` is the port's GID table length
/// and `ports` the device's port count.
///
/// # Safety
/// `ctx` is an open device context.
unsafe fn gid_table(
    ctx: *mut sys::ibv_context,
    port: u8,
    ports: u8,
    len: usize,
) -> Result<Vec<(u32, [u8; 16], bool)>, String> {
    let blank = sys::ibv_gid_entry {
        gid: sys::ibv_gid { raw: [0; 16] },
        gid_index: 0,
        port_num: 0,
        gid_type: 0,
        ndev_ifindex: 0,
    };
    // The table call fills the entries of every port.
    let mut entries = vec![blank; len.max(1) * ports.max(1) as usize];
    // SAFETY: `ctx` is open (caller); `entries` is a writable array of `entries.len()`
    // `ibv_gid_entry`, whose size the wrapper passes along.
    let n = unsafe { sys::ibv_query_gid_table(ctx, entries.as_mut_ptr(), entries.len(), 0) };
    if n >= 0 {
        entries.truncate(n as usize);
        return Ok(entries
            .iter()
            .filter(|e| e.port_num == port as u32)
            .map(|e| {
                // SAFETY: both union members are plain bytes.
                let raw = unsafe { e.gid.raw };
                (e.gid_index, raw, e.gid_type == sys::IBV_GID_TYPE_ROCE_V2)
            })
            .collect());
    }
    // Older rdma-core: one entry at a time (empty entries read as zero GIDs).
    let mut out = Vec::new();
    for index in 0..len.min(256) as u32 {
        let mut gid = sys::ibv_gid { raw: [0; 16] };
        // SAFETY: `ctx` is open; `gid` is a writable `ibv_gid`.
        if unsafe { sys::ibv_query_gid(ctx, port, index as i32, &mut gid) } != 0 {
            continue;
        }
        // SAFETY: plain bytes.
        let raw = unsafe { gid.raw };
        if raw == [0; 16] {
            continue;
        }
        let mut ty: sys::ibv_gid_type_sysfs = 0;
        // SAFETY: `ctx` is open; `ty` is writable.
        let v2 = unsafe { sys::ibv_query_gid_type(ctx, port, index, &mut ty) } == 0
            && ty == sys::IBV_GID_TYPE_SYSFS_ROCE_V2;
        out.push((index, raw, v2));
    }
    Ok(out)
}

/// The first ACTIVE port of `ctx` and its GID, or None.
fn choose_port(
    ctx: &Arc<DeviceContext>,
    name: &str,
    ports: u8,
) -> Result<Option<PortChoice>, String> {
    // SAFETY: the pointer is only used while `ctx` (which owns it) is alive.
    let raw = unsafe { ctx.context() }.as_ptr();
    for port in 1..=ports {
        // SAFETY: all-zero is a valid `ibv_port_attr` (plain integers).
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is an open context; `attr` is writable.
        let rc = unsafe { sys::ibv_query_port(raw, port, &mut attr) };
        if rc != 0 {
            return Err(format!(
                "{name}: ibv_query_port(port {port}) failed: {}",
                io::Error::from_raw_os_error(rc)
            ));
        }
        if attr.state != sys::ibv_port_state::IBV_PORT_ACTIVE {
            continue;
        }
        let mtu = attr.active_mtu.clamp(1, 5) as u8;
        if attr.link_layer == sys::IBV_LINK_LAYER_ETHERNET {
            // SAFETY: `raw` is an open context.
            let table = unsafe { gid_table(raw, port, ports, attr.gid_tbl_len.max(0) as usize) }?;
            let pick = table
                .iter()
                .filter(|g| g.0 <= u8::MAX as u32)
                .find(|g| g.2 && is_ipv4_mapped(&g.1))
                .or_else(|| table.iter().find(|g| g.2 && g.0 <= u8::MAX as u32))
                .map(|g| (g.0 as u8, g.1, GidKind::RoceV2));
            let (gid_index, gid, kind) = match pick {
                Some(p) => p,
                None => {
                    let g = ctx.query_gid(port, 0).map_err(|e| {
                        format!(
                            "{name}: ibv_query_gid(port {port}, 0) failed: {}",
                            chain(&e)
                        )
                    })?;
                    (0, g.raw, GidKind::RoceV1)
                }
            };
            return Ok(Some(PortChoice {
                port,
                gid_index,
                gid,
                kind,
                lid: attr.lid,
                mtu,
            }));
        }
        let g = ctx.query_gid(port, 0).map_err(|e| {
            format!(
                "{name}: ibv_query_gid(port {port}, 0) failed: {}",
                chain(&e)
            )
        })?;
        return Ok(Some(PortChoice {
            port,
            gid_index: 0,
            gid: g.raw,
            kind: GidKind::Ib,
            lid: attr.lid,
            mtu,
        }));
    }
    Ok(None)
}

impl Device {
    /// Opens the first usable device: `names` empty = any device with an ACTIVE port, else
    /// only those names (in the given order).
    ///
    /// Ok(None) when no usable device exists, including when libibverbs cannot be loaded
    /// or the device list is empty; Err only when devices exist but opening or querying
    /// failed (the message names the device and the verb). With several candidates, one
    /// that fails is skipped when a later one works.
    ///
    /// GID choice: on an Ethernet link layer (RoCE) a RoCE v2 GID that is IPv4-mapped
    /// (`::ffff:a.b.c.d`), else any RoCE v2 GID, else index 0; on InfiniBand GID index 0
    /// and the port LID.
    pub fn open(names: &[String]) -> Result<Option<Arc<Device>>, String> {
        // Without libibverbs (or without devices) the list is NULL or empty.
        let Ok(list) = DeviceList::new() else {
            return Ok(None);
        };
        let found: Vec<_> = list.iter().collect();
        let order: Vec<_> = if names.is_empty() {
            found
        } else {
            names
                .iter()
                .filter_map(|n| found.iter().find(|d| d.name() == *n).copied())
                .collect()
        };
        let mut first_err = None;
        for dev in order {
            let name = dev.name();
            match Self::open_one(&dev, name) {
                Ok(Some(d)) => return Ok(Some(Arc::new(d))),
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    fn open_one(
        dev: &sideway::ibverbs::device::Device<'_>,
        name: String,
    ) -> Result<Option<Device>, String> {
        let ctx = dev
            .open()
            .map_err(|e| format!("{name}: ibv_open_device failed: {}", chain(&e)))?;
        let attr = ctx
            .query_device()
            .map_err(|e| format!("{name}: ibv_query_device failed: {}", chain(&e)))?;
        let Some(p) = choose_port(&ctx, &name, attr.phys_port_cnt())? else {
            return Ok(None);
        };
        let pd = ctx
            .alloc_pd()
            .map_err(|e| format!("{name}: ibv_alloc_pd failed: {}", chain(&e)))?;
        Ok(Some(Device {
            pd,
            ctx,
            name,
            port: p.port,
            gid_index: p.gid_index,
            gid: p.gid,
            kind: p.kind,
            lid: p.lid,
            mtu: p.mtu,
            max_qp_wr: attr.max_qp_wr().max(1) as u32,
            max_cqe: attr.max_cqe().max(1) as u32,
        }))
    }

    /// The device name, e.g. "rxe0".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// One line for logs, e.g. "rxe0 port 1 gid[1] ::ffff:10.0.2.15 RoCEv2 mtu 1024".
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} port {} gid[{}] {} {} mtu {}",
            self.name,
            self.port,
            self.gid_index,
            Ipv6Addr::from(self.gid),
            self.kind,
            128u32 << self.mtu
        );
        if self.kind == GidKind::Ib {
            s.push_str(&format!(" lid {}", self.lid));
        }
        s
    }

    /// Registers `[base, base+len)` in the device's own protection domain, with
    /// `access`.
    ///
    /// # Safety
    /// As [`Domain::register`].
    pub unsafe fn register(&self, base: usize, len: usize, access: Access) -> io::Result<Region> {
        // SAFETY: the caller's contract, passed on.
        unsafe { register_in(&self.pd, &self.name, base, len, access) }
    }

    /// A protection domain of its own on this device: its regions can be written only
    /// through its own queue pairs, and deregistering them revokes their keys.
    pub fn domain(self: &Arc<Self>) -> io::Result<Domain> {
        let pd = self
            .ctx
            .alloc_pd()
            .map_err(|e| io_error(format!("{}: ibv_alloc_pd", self.name), &e))?;
        Ok(Domain {
            pd,
            dev: Arc::clone(self),
        })
    }

    /// A new RC queue pair in the device's own protection domain (see
    /// [`Domain::endpoint`]).
    pub fn endpoint(self: &Arc<Self>, depth: u32, access: Access) -> io::Result<Endpoint> {
        endpoint_in(self, &self.pd, depth, access)
    }
}

/// Who may touch a region or a queue pair's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only this process: a source of RDMA WRITEs. A peer's write into it fails at the
    /// device with a remote access error.
    Local,
    /// Peers may write into it (through a queue pair that allows it, in the same
    /// protection domain, with its remote key).
    RemoteWrite,
}

impl Access {
    fn flags(self) -> AccessFlags {
        match self {
            Access::Local => AccessFlags::none(),
            // Remote write requires local write (verbs).
            Access::RemoteWrite => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
        }
    }
}

/// A protection domain of its own ([`Device::domain`]): regions and queue pairs that
/// only each other can use.
pub struct Domain {
    pd: Arc<ProtectionDomain>,
    dev: Arc<Device>,
}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain")
            .field("device", &self.dev.name)
            .finish()
    }
}

impl Domain {
    /// Registers `[base, base+len)` in this domain with `access`.
    ///
    /// # Safety
    /// The memory must stay valid (mapped, not freed) until the returned region is
    /// dropped: the device reads and (for remote writes from a peer) writes it without
    /// the CPU's involvement.
    pub unsafe fn register(&self, base: usize, len: usize, access: Access) -> io::Result<Region> {
        // SAFETY: the caller's contract, passed on.
        unsafe { register_in(&self.pd, &self.dev.name, base, len, access) }
    }

    /// A new RC queue pair in this domain (see [`endpoint_in`]).
    pub fn endpoint(&self, depth: u32, access: Access) -> io::Result<Endpoint> {
        endpoint_in(&self.dev, &self.pd, depth, access)
    }
}

/// Registers `[base, base+len)` in `pd`.
///
/// # Safety
/// As [`Domain::register`].
unsafe fn register_in(
    pd: &Arc<ProtectionDomain>,
    name: &str,
    base: usize,
    len: usize,
    access: Access,
) -> io::Result<Region> {
    // SAFETY: the caller keeps the memory valid for the life of the region, which holds
    // the only handle to the MR.
    let mr = unsafe { pd.reg_mr(base, len, access.flags()) }.map_err(|e| {
        let e = io_error(format!("{name}: ibv_reg_mr({base:#x}, {len} bytes)"), &e);
        if e.kind() == io::ErrorKind::OutOfMemory {
            // The usual cause: the locked-memory limit, not a lack of memory.
            io::Error::new(e.kind(), format!("{e} (check ulimit -l / RLIMIT_MEMLOCK)"))
        } else {
            e
        }
    })?;
    Ok(Region { mr, base, len })
}

/// A new RC queue pair in `pd` with its own CQ and completion channel; `depth` is the
/// most send work requests outstanding at once (clamped to the device's limit).
/// `access` says whether its peer may write into regions of the domain through it.
fn endpoint_in(
    dev: &Arc<Device>,
    pd: &Arc<ProtectionDomain>,
    depth: u32,
    access: Access,
) -> io::Result<Endpoint> {
    {
        let this = dev;
        if depth == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "endpoint depth must be at least 1",
            ));
        }
        let depth = depth
            .min(this.max_qp_wr)
            .min(this.max_cqe.saturating_sub(1).max(1));
        let name = &this.name;
        let channel = this
            .ctx
            .create_comp_channel()
            .map_err(|e| io_error(format!("{name}: ibv_create_comp_channel"), &e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| io::Error::new(e.kind(), format!("{name}: completion channel: {e}")))?;
        let cq = this
            .ctx
            .create_cq_builder()
            .setup_cqe(depth + 1)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| io_error(format!("{name}: ibv_create_cq({} entries)", depth + 1), &e))?;
        let qp = pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(depth)
            .setup_max_send_sge(1)
            .setup_max_recv_wr(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq))
            .build()
            .map_err(|e| io_error(format!("{name}: ibv_create_qp(RC, {depth} send WRs)"), &e))?;
        Ok(Endpoint {
            qp,
            cq,
            channel,
            dev: Arc::clone(this),
            _pd: Arc::clone(pd),
            access,
            psn: random_psn(),
            depth,
            state: EpState::Fresh,
            posted: 0,
            done: 0,
        })
    }
}

/// A random 24-bit packet sequence number.
fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS once per thread and perturbed per instance.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(now);
    (h.finish() as u32) & 0x00ff_ffff
}

/// A registered memory region (deregistered on drop).
///
/// `Send + Sync` without `unsafe impl`: sideway's `MemoryRegion` is; an MR's keys are
/// immutable and `ibv_dereg_mr` runs once, in drop.
pub struct Region {
    mr: Arc<MemoryRegion>,
    base: usize,
    len: usize,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .finish()
    }
}

impl Region {
    /// The local key, for work requests reading from this region.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The remote key a peer uses to write into this region.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// First registered address.
    pub fn base(&self) -> usize {
        self.base
    }

    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One RDMA WRITE: `len` bytes from local `addr` (inside a region with `lkey`) to
/// `remote_addr` (in a peer region with `rkey`).
#[derive(Debug, Clone, Copy)]
pub struct WriteOp {
    /// Local source address.
    pub addr: usize,
    /// Bytes to write.
    pub len: usize,
    /// Local key of the region holding the source.
    pub lkey: u32,
    /// Destination address in the peer's address space.
    pub remote_addr: u64,
    /// Remote key of the peer region holding the destination.
    pub rkey: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum EpState {
    /// Created, not connected.
    Fresh,
    /// In RTS.
    Connected,
    /// In ERR (or failed to connect): the reason.
    Broken(String),
}

/// An RC queue pair used by one thread at a time (wrap it in a Mutex to share).
///
/// `Send` (and `Sync`) without `unsafe impl`: sideway's QP, CQ and channel are
/// `Send + Sync`, and every verb is issued through `&mut self`, so one thread at a time
/// posts and polls. Work-request arrays are built per call and never stored.
pub struct Endpoint {
    // Field order is drop order; the Arcs inside sideway's objects enforce it anyway.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    dev: Arc<Device>,
    /// The protection domain the queue pair lives in (kept alive with it).
    _pd: Arc<ProtectionDomain>,
    /// Whether the peer may write into our regions through this queue pair.
    access: Access,
    psn: u32,
    depth: u32,
    state: EpState,
    /// Sequence number of the next work request (its `wr_id`); never reused.
    posted: u64,
    /// Every work request below this has completed (successfully or not).
    done: u64,
}

/// The largest single WRITE: RC messages are limited to 2^31 bytes.
const MAX_WR_LEN: usize = 1 << 30;
/// Work requests per `ibv_post_send` chain.
const CHAIN: usize = 32;
/// Completions read per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;
/// How long to poll the CQ before sleeping on the completion channel.
const SPIN: Duration = Duration::from_micros(50);
/// How long to wait for flushed completions after the QP entered the error state.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// `ibv_wc_status_str` text and enum name of a completion status.
fn wc_status(status: u32) -> (&'static str, &'static str) {
    use sys::ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => ("success", "IBV_WC_SUCCESS"),
        IBV_WC_LOC_LEN_ERR => ("local length error", "IBV_WC_LOC_LEN_ERR"),
        IBV_WC_LOC_QP_OP_ERR => ("local QP operation error", "IBV_WC_LOC_QP_OP_ERR"),
        IBV_WC_LOC_EEC_OP_ERR => ("local EE context operation error", "IBV_WC_LOC_EEC_OP_ERR"),
        IBV_WC_LOC_PROT_ERR => ("local protection error", "IBV_WC_LOC_PROT_ERR"),
        IBV_WC_WR_FLUSH_ERR => ("Work Request Flushed Error", "IBV_WC_WR_FLUSH_ERR"),
        IBV_WC_MW_BIND_ERR => ("memory management operation error", "IBV_WC_MW_BIND_ERR"),
        IBV_WC_BAD_RESP_ERR => ("bad response error", "IBV_WC_BAD_RESP_ERR"),
        IBV_WC_LOC_ACCESS_ERR => ("local access error", "IBV_WC_LOC_ACCESS_ERR"),
        IBV_WC_REM_INV_REQ_ERR => ("remote invalid request error", "IBV_WC_REM_INV_REQ_ERR"),
        IBV_WC_REM_ACCESS_ERR => ("remote access error", "IBV_WC_REM_ACCESS_ERR"),
        IBV_WC_REM_OP_ERR => ("remote operation error", "IBV_WC_REM_OP_ERR"),
        IBV_WC_RETRY_EXC_ERR => ("transport retry counter exceeded", "IBV_WC_RETRY_EXC_ERR"),
        IBV_WC_RNR_RETRY_EXC_ERR => ("RNR retry counter exceeded", "IBV_WC_RNR_RETRY_EXC_ERR"),
        IBV_WC_LOC_RDD_VIOL_ERR => ("local RDD violation error", "IBV_WC_LOC_RDD_VIOL_ERR"),
        IBV_WC_REM_INV_RD_REQ_ERR => ("remote invalid RD request", "IBV_WC_REM_INV_RD_REQ_ERR"),
        IBV_WC_REM_ABORT_ERR => ("aborted error", "IBV_WC_REM_ABORT_ERR"),
        IBV_WC_INV_EECN_ERR => ("invalid EE context number", "IBV_WC_INV_EECN_ERR"),
        IBV_WC_INV_EEC_STATE_ERR => ("invalid EE context state", "IBV_WC_INV_EEC_STATE_ERR"),
        IBV_WC_FATAL_ERR => ("fatal error", "IBV_WC_FATAL_ERR"),
        IBV_WC_RESP_TIMEOUT_ERR => ("response timeout error", "IBV_WC_RESP_TIMEOUT_ERR"),
        IBV_WC_GENERAL_ERR => ("general error", "IBV_WC_GENERAL_ERR"),
        IBV_WC_TM_ERR => ("TM error", "IBV_WC_TM_ERR"),
        IBV_WC_TM_RNDV_INCOMPLETE => ("TM software rendezvous", "IBV_WC_TM_RNDV_INCOMPLETE"),
        _ => ("unknown", "IBV_WC_?"),
    }
}

/// The `ibv_mtu` value as sideway's enum.
fn mtu_enum(v: u8) -> Mtu {
    match v {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// The work requests of a `write` call: every op cut into pieces of at most `slice` bytes.
struct Pieces<'a> {
    ops: &'a [WriteOp],
    slice: usize,
    op: usize,
    off: usize,
}

impl Iterator for Pieces<'_> {
    type Item = (u64, u32, u32, u64, u32);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let op = self.ops.get(self.op)?;
            if self.off >= op.len {
                self.op += 1;
                self.off = 0;
                continue;
            }
            let n = (op.len - self.off).min(self.slice);
            let item = (
                (op.addr + self.off) as u64,
                n as u32,
                op.lkey,
                op.remote_addr + self.off as u64,
                op.rkey,
            );
            self.off += n;
            return Some(item);
        }
    }
}

/// Why a wait for completions ended without progress.
enum WaitEnd {
    /// No completion within the stall limit.
    Stalled,
    /// A verb failed (the reason).
    Failed(String),
}

impl Endpoint {
    /// This endpoint's connection data for the peer.
    pub fn info(&self) -> EndpointInfo {
        EndpointInfo {
            qpn: self.qp.qp_number(),
            psn: self.psn,
            lid: self.dev.lid,
            gid: self.dev.gid,
            mtu: self.dev.mtu,
        }
    }

    /// Send work requests that may be outstanding at once.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Ok if the endpoint is connected (`connected`) or still fresh (`!connected`);
    /// otherwise the error naming its state.
    fn require(&self, connected: bool) -> io::Result<()> {
        match (&self.state, connected) {
            (EpState::Connected, true) | (EpState::Fresh, false) => Ok(()),
            (EpState::Broken(r), _) => Err(io::Error::other(format!("endpoint is broken: {r}"))),
            (EpState::Fresh, true) => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "endpoint is not connected",
            )),
            (EpState::Connected, false) => Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "endpoint is already connected",
            )),
        }
    }

    /// Moves the QP through INIT, RTR and RTS towards `remote`, allowing the peer to
    /// write into our regions of its domain only if the endpoint was made with
    /// [`Access::RemoteWrite`]. Path MTU is the smaller of both ports'; local ACK timeout
    /// 14 (about 67 ms), 7 retries, 7 RNR retries. Any failure leaves the endpoint
    /// broken.
    pub fn connect(&mut self, remote: &EndpointInfo) -> io::Result<()> {
        self.require(false)?;
        if !(1..=5).contains(&remote.mtu) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("peer endpoint has invalid MTU value {}", remote.mtu),
            ));
        }
        let r = self.connect_inner(remote);
        match &r {
            Ok(()) => self.state = EpState::Connected,
            Err(e) => {
                self.state = EpState::Broken(format!("connect failed: {e}"));
                self.enter_error_state();
            }
        }
        r
    }

    fn connect_inner(&mut self, remote: &EndpointInfo) -> io::Result<()> {
        let dev = Arc::clone(&self.dev);
        let name = &dev.name;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(self.access.flags());
        self.qp
            .modify(&attr)
            .map_err(|e| io_error(format!("{name}: ibv_modify_qp(INIT)"), &e))?;

        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(dev.port)
            .setup_service_level(0);
        if dev.kind != GidKind::Ib {
            // RoCE has no LIDs: the GRH (source GID index, destination GID) routes. A
            // RoCE v2 packet is IP, so it needs a real hop limit.
            ah.setup_grh(&Gid { raw: remote.gid }, 0, dev.gid_index, 64, 0);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_enum(dev.mtu.min(remote.mtu)))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn & 0x00ff_ffff)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.qp.modify(&attr).map_err(|e| {
            io_error(
                format!(
                    "{name}: ibv_modify_qp(RTR to qpn {:#x} gid {})",
                    remote.qpn,
                    Ipv6Addr::from(remote.gid)
                ),
                &e,
            )
        })?;

        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        self.qp
            .modify(&attr)
            .map_err(|e| io_error(format!("{name}: ibv_modify_qp(RTS)"), &e))?;
        Ok(())
    }

    /// Moves the QP to the ERR state: nothing more can be written through it (from this
    /// side or the peer's). Idempotent.
    pub fn shut(&mut self) {
        if !matches!(self.state, EpState::Broken(_)) {
            self.state = EpState::Broken("endpoint was shut".into());
        }
        self.enter_error_state();
    }

    /// Whether the endpoint can no longer write (a completion error, a stall, `shut`, or a
    /// failed `connect`).
    pub fn is_broken(&self) -> bool {
        matches!(self.state, EpState::Broken(_))
    }

    fn enter_error_state(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        // Moving to ERR is allowed from every state; if it still fails there is nothing
        // better to do than what the caller does next (drop the endpoint).
        let _ = self.qp.modify(&attr);
    }

    /// Posts every op as RDMA WRITEs and waits until all of them completed.
    ///
    /// Ops longer than `slice` bytes (0 = no limit) are split; work requests go out in
    /// chains, every few signaled, with never more than the endpoint's depth outstanding.
    /// Waiting polls the CQ briefly, then sleeps on the completion channel.
    ///
    /// Ok only when every write completed successfully. A completion error returns the
    /// verbs status ("remote access error (IBV_WC_REM_ACCESS_ERR), vendor_err 0x..");
    /// no completion for `stall` returns "no completion for N ms". Either way the QP is
    /// moved to ERR, its flushed work requests are drained before returning (nothing is
    /// left outstanding), and every later call fails at once.
    pub fn write(&mut self, ops: &[WriteOp], slice: usize, stall: Duration) -> io::Result<()> {
        self.require(true)?;
        let slice = if slice == 0 {
            MAX_WR_LEN
        } else {
            slice.min(MAX_WR_LEN)
        };
        let mut total = 0u64;
        for op in ops {
            if op.addr.checked_add(op.len).is_none()
                || op.remote_addr.checked_add(op.len as u64).is_none()
            {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("write of {} bytes at {:#x} wraps around", op.len, op.addr),
                ));
            }
            total += op.len.div_ceil(slice) as u64;
        }
        if total == 0 {
            return Ok(());
        }
        let first = self.posted;
        let end = first + total;
        let depth = self.depth as u64;
        // Signal every `every`-th work request and the last. Any `depth` consecutive
        // requests contain a signaled one, so a full window always completes something.
        let every = (depth / 4).max(1);
        let mut pieces = Pieces {
            ops,
            slice,
            op: 0,
            off: 0,
        };
        let mut last_progress = Instant::now();
        let mut seen = self.done;
        let mut wrs: Vec<sys::ibv_send_wr> = Vec::with_capacity(CHAIN);
        let mut sges: Vec<sys::ibv_sge> = Vec::with_capacity(CHAIN);
        while self.done < end {
            while self.posted < end && self.posted - self.done < depth {
                let n = (end - self.posted)
                    .min(depth - (self.posted - self.done))
                    .min(CHAIN as u64) as usize;
                wrs.clear();
                sges.clear();
                for i in 0..n {
                    let id = self.posted + i as u64;
                    let Some((addr, length, lkey, remote_addr, rkey)) = pieces.next() else {
                        unreachable!("fewer pieces than counted");
                    };
                    sges.push(sys::ibv_sge { addr, length, lkey });
                    let signaled = (id - first + 1) % every == 0 || id + 1 == end;
                    // SAFETY: all-zero is a valid `ibv_send_wr` (integers, null pointers
                    // and unions of those).
                    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
                    wr.wr_id = id;
                    wr.num_sge = 1;
                    wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    wr.send_flags = if signaled {
                        sys::ibv_send_flags::IBV_SEND_SIGNALED.0
                    } else {
                        0
                    };
                    wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
                    wrs.push(wr);
                }
                // Link the chain only now that neither vector grows any more.
                let sge_base = sges.as_mut_ptr();
                let wr_base = wrs.as_mut_ptr();
                for i in 0..n {
                    // SAFETY: `i < n == wrs.len() == sges.len()`; the pointers stay valid
                    // until both vectors are next modified, after ibv_post_send returns.
                    unsafe {
                        let wr = &mut *wr_base.add(i);
                        wr.sg_list = sge_base.add(i);
                        wr.next = if i + 1 < n {
                            wr_base.add(i + 1)
                        } else {
                            std::ptr::null_mut()
                        };
                    }
                }
                let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
                // SAFETY: the QP is alive (owned by self); `wrs` is a well-formed chain of
                // `n` requests whose SGEs name memory the caller registered; the provider
                // copies the requests before returning.
                let rc = unsafe { sys::ibv_post_send(self.qp.qp().as_ptr(), wr_base, &mut bad) };
                if rc != 0 {
                    // Requests before `bad` were posted.
                    let ok = if bad.is_null() {
                        0
                    } else {
                        // SAFETY: `bad` points into `wrs`.
                        unsafe { bad.offset_from(wr_base) }.clamp(0, n as isize) as u64
                    };
                    self.posted += ok;
                    let reason = format!(
                        "{}: ibv_post_send failed: {}",
                        self.dev.name,
                        io::Error::from_raw_os_error(rc)
                    );
                    return Err(self.fail(reason));
                }
                self.posted += n as u64;
            }
            if let Err(reason) = self.reap() {
                return Err(self.fail(reason));
            }
            if self.done > seen {
                seen = self.done;
                last_progress = Instant::now();
                continue;
            }
            match self.wait(last_progress + stall) {
                Ok(()) => {}
                Err(WaitEnd::Stalled) => {
                    let reason = format!("no completion for {} ms", stall.as_millis());
                    return Err(self.fail(reason));
                }
                Err(WaitEnd::Failed(reason)) => return Err(self.fail(reason)),
            }
            if self.done > seen {
                seen = self.done;
                last_progress = Instant::now();
            }
        }
        Ok(())
    }

    /// Reads available completions. Ok(true) if `done` advanced; Err with the reason of
    /// the first failed completion (after reading the whole batch).
    fn reap(&mut self) -> Result<bool, String> {
        // SAFETY: all-zero is a valid `ibv_wc`.
        let mut wcs: [sys::ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        let mut progress = false;
        let mut failure = None;
        loop {
            // SAFETY: the CQ is alive (self.cq); `wcs` has room for POLL_BATCH entries.
            let n = unsafe {
                sys::ibv_poll_cq(self.cq.cq().as_ptr(), POLL_BATCH as i32, wcs.as_mut_ptr())
            };
            if n < 0 {
                return Err(format!("{}: ibv_poll_cq failed ({n})", self.dev.name));
            }
            for wc in &wcs[..n as usize] {
                if wc.wr_id >= self.done {
                    self.done = wc.wr_id + 1;
                    progress = true;
                }
                if wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS && failure.is_none() {
                    let (text, name) = wc_status(wc.status);
                    failure = Some(format!(
                        "RDMA WRITE failed on {} qpn {:#x}: {text} ({name}), vendor_err {:#x}",
                        self.dev.name,
                        self.qp.qp_number(),
                        wc.vendor_err
                    ));
                }
            }
            if (n as usize) < POLL_BATCH {
                break;
            }
        }
        match failure {
            Some(f) => Err(f),
            None => Ok(progress),
        }
    }

    /// Waits until the CQ has completions or `deadline` passes, without spinning for
    /// long: a short poll loop, then arm the CQ, poll once more (a completion that came
    /// before arming raises no event), and sleep in poll(2) on the channel's fd.
    fn wait(&mut self, deadline: Instant) -> Result<(), WaitEnd> {
        let spin_end = Instant::now() + SPIN;
        // SAFETY (for the raw pointers below): the CQ and channel are owned by self and
        // outlive this call.
        let cq = unsafe { self.cq.cq() }.as_ptr();
        let channel = unsafe { self.channel.comp_channel() }.as_ptr();
        loop {
            if self.cq_nonempty()? {
                return Ok(());
            }
            if Instant::now() >= spin_end {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            // SAFETY: `cq` is alive.
            let rc = unsafe { sys::ibv_req_notify_cq(cq, 0) };
            if rc != 0 {
                return Err(WaitEnd::Failed(format!(
                    "{}: ibv_req_notify_cq failed: {}",
                    self.dev.name,
                    io::Error::from_raw_os_error(rc)
                )));
            }
            // A completion that arrived between the last poll and arming raised no event.
            if self.cq_nonempty()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitEnd::Stalled);
            }
            let left = deadline - now;
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            let mut pfd = libc::pollfd {
                fd: self.channel.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(WaitEnd::Failed(format!(
                        "{}: poll on the completion channel failed: {e}",
                        self.dev.name
                    )));
                }
                continue;
            }
            if r > 0 {
                // The fd is non-blocking: read every pending event and acknowledge each at
                // once, so ibv_destroy_cq never waits for an unacknowledged one.
                loop {
                    let mut ev_cq: *mut sys::ibv_cq = std::ptr::null_mut();
                    let mut ev_ctx: *mut libc::c_void = std::ptr::null_mut();
                    // SAFETY: `channel` is alive; the out-pointers are valid.
                    let got = unsafe { sys::ibv_get_cq_event(channel, &mut ev_cq, &mut ev_ctx) };
                    if got != 0 {
                        break;
                    }
                    // SAFETY: `ev_cq` came from ibv_get_cq_event (it is our CQ, the only one
                    // on this channel).
                    unsafe { sys::ibv_ack_cq_events(ev_cq, 1) };
                }
                return Ok(());
            }
        }
    }

    /// Reads the CQ (verbs cannot peek): Ok(true) if any completion advanced `done`.
    fn cq_nonempty(&mut self) -> Result<bool, WaitEnd> {
        self.reap().map_err(WaitEnd::Failed)
    }

    /// Marks the endpoint broken with `reason`, moves the QP to ERR and drains every
    /// outstanding work request (flushed ones complete with errors).
    fn fail(&mut self, reason: String) -> io::Error {
        self.state = EpState::Broken(reason.clone());
        self.enter_error_state();
        let deadline = Instant::now() + DRAIN_LIMIT;
        while self.done < self.posted {
            // Errors while draining are the flushes themselves.
            let _ = self.reap();
            if self.done >= self.posted || Instant::now() >= deadline {
                break;
            }
            match self.wait(deadline) {
                Ok(()) | Err(WaitEnd::Failed(_)) => {}
                Err(WaitEnd::Stalled) => break,
            }
        }
        if self.done < self.posted {
            let left = self.posted - self.done;
            return io::Error::other(format!(
                "{reason}; {left} writes still outstanding after draining for {} s",
                DRAIN_LIMIT.as_secs()
            ));
        }
        io::Error::other(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_long_ops_and_skip_empty_ones() {
        let ops = [
            WriteOp {
                addr: 1000,
                len: 10,
                lkey: 1,
                remote_addr: 5000,
                rkey: 2,
            },
            WriteOp {
                addr: 0,
                len: 0,
                lkey: 1,
                remote_addr: 0,
                rkey: 2,
            },
            WriteOp {
                addr: 2000,
                len: 4,
                lkey: 3,
                remote_addr: 9000,
                rkey: 4,
            },
        ];
        let p: Vec<_> = Pieces {
            ops: &ops,
            slice: 4,
            op: 0,
            off: 0,
        }
        .collect();
        assert_eq!(
            p,
            vec![
                (1000, 4, 1, 5000, 2),
                (1004, 4, 1, 5004, 2),
                (1008, 2, 1, 5008, 2),
                (2000, 4, 3, 9000, 4),
            ]
        );
    }

    #[test]
    fn ipv4_mapped_gids_are_recognised() {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 2, 15]);
        assert!(is_ipv4_mapped(&g));
        assert_eq!(Ipv6Addr::from(g).to_string(), "::ffff:10.0.2.15");
        let mut link_local = [0u8; 16];
        link_local[0] = 0xfe;
        link_local[1] = 0x80;
        assert!(!is_ipv4_mapped(&link_local));
    }

    #[test]
    fn completion_statuses_have_verbs_names() {
        let (text, name) = wc_status(sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
        assert_eq!(
            (text, name),
            ("remote access error", "IBV_WC_REM_ACCESS_ERR")
        );
        assert_eq!(wc_status(999).1, "IBV_WC_?");
    }

    #[test]
    fn psns_fit_in_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= 0x00ff_ffff);
        }
    }
}
