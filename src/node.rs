//! This engine as one node of the cluster: what both the engine (rooms) and the control
//! layer (peers) stand on, and neither owns: its role, configuration, log, identity and
//! address, clock, metrics, library threads, registered memory (and the layout of its KV
//! pages) and RDMA device.

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::config::{Config, Role, TransportKind};
use crate::err;
use crate::error::Result;
use crate::layout::KvLayout;
use crate::log::Logger;
use crate::metrics::Metrics;
use crate::proto::Limits;
use crate::transport::rdma::verbs::{Access, Device, Region};
use crate::transport::{BufferDesc, Memory};

/// The most buffers of one kind an engine may register.
pub const MAX_BUFFERS: usize = 4096;

pub(crate) struct Node {
    pub role: Role,
    pub config: Config,
    pub log: Logger,
    /// The `host:port` peers connect to.
    pub address: String,
    /// A random 64-bit id, fresh per engine (the decode side's name on the prefill side).
    pub engine_id: u64,
    pub limits: Limits,
    /// The RDMA device data moves through, or `None` over TCP.
    pub rdma: Option<Arc<Device>>,
    pub metrics: Metrics,
    pub memory: Registry,
    /// 16 random bytes a decode engine on this host reads to prove it may copy from
    /// this process, and that it is this process (`transport::samehost`). Boxed: its
    /// address is sent to peers and must not move.
    pub probe: Box<[u8; 16]>,
    clock: Instant,
    /// Set once, when the engine stops. Release/Acquire: a thread that sees it set also
    /// sees everything the stopping thread did before (the rooms it failed).
    stopping: AtomicBool,
    /// Wakes the watchdog's sleep when the engine stops.
    wake: (Mutex<()>, Condvar),
    /// A pipe whose read end turns readable when the engine stops, for threads that
    /// wait on sockets with `poll(2)` (the acceptor): they sleep until there is work or
    /// the engine stops, with no timer.
    stop_pipe: (OwnedFd, OwnedFd),
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Node {
    /// A node for `config`: its RDMA device (or TCP), its listening socket bound.
    pub fn new(config: Config, log: Logger) -> Result<(Arc<Node>, TcpListener)> {
        let role = config.require_role()?;
        let (rdma, why_tcp) = choose_transport(&config, &log)?;
        if rdma.is_some() && config.same_host == crate::proto::SameHostSetting::Require {
            return Err(err!(
                BadValue,
                "same_host=require applies to engines that move data over TCP, and this \
                 engine moves it over RDMA (set transport=tcp, or same_host=auto)"
            ));
        }
        let listener = bind(&config.listen)?;
        let local = listener
            .local_addr()
            .map_err(|e| err!(Io, "cannot read the listening address: {e}"))?;
        if config.local_only() && !is_local(local.ip()) {
            return Err(err!(
                BadValue,
                "config key 'listen' is '{}', which is not a loopback address, and this engine \
                 has no cluster key: with 'auth' at its default ('auto') and neither a key nor \
                 TLS, an engine works only with engines on its own host. Give every engine \
                 the same key ('auth_key_file'), or set 'auth' to 'off' to run without \
                 authentication on this address",
                config.listen
            ));
        }
        let address = advertised(local);
        match &rdma {
            Some(dev) => crate::log!(
                log,
                Info,
                "{role} engine listening on {address}, transport rdma ({})",
                dev.describe()
            ),
            None => crate::log!(
                log,
                Info,
                "{role} engine listening on {address}, transport tcp{why_tcp}"
            ),
        }
        let node = Node {
            role,
            engine_id: engine_id(&address),
            config,
            log,
            address,
            limits: Limits::default(),
            rdma,
            metrics: Metrics::default(),
            memory: Registry::default(),
            probe: Box::new(probe()?),
            clock: Instant::now(),
            stopping: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            stop_pipe: pipe()?,
            threads: Mutex::new(Vec::new()),
        };
        Ok((Arc::new(node), listener))
    }

    /// This engine's identity for the same-host path, with its setting (and, on a
    /// prefill engine, its probe).
    pub fn host_info(&self) -> crate::proto::HostInfo {
        let probe = (self.role == Role::Prefill).then_some(&*self.probe);
        let device = [&self.memory.kv, &self.memory.aux]
            .iter()
            .any(|m| m.get().is_some_and(Memory::has_device));
        crate::transport::samehost::local(self.config.same_host, probe, device)
    }

    /// Milliseconds on the engine's monotonic clock.
    pub fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Marks the engine stopping and wakes the watchdog and every thread waiting in
    /// [`Node::wait_readable`].
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        // The read end stays readable from here on (nothing reads it): a wait that
        // begins later returns at once too. A full pipe (EAGAIN) is readable already.
        // SAFETY: the write end is open while `self` lives; one byte from a local.
        let _ = unsafe { libc::write(self.stop_pipe.1.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        let _g = self.wake.0.lock();
        self.wake.1.notify_all();
    }

    /// Sleeps up to `interval`, or until the engine stops; whether it is stopping.
    pub fn sleep(&self, interval: Duration) -> bool {
        let mut g = self.wake.0.lock();
        if self.is_stopping() {
            return true;
        }
        self.wake.1.wait_for(&mut g, interval);
        self.is_stopping()
    }

    /// Waits until `fd` is readable (for a listener: a connection is waiting) or the
    /// engine stops. Returns at once if either is already so; an interrupted wait
    /// returns too (the caller looks again).
    pub fn wait_readable(&self, fd: RawFd) {
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.stop_pipe.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd entries; both descriptors are open for the call.
        let _ = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
    }

    /// Starts a library thread that is joined when the engine stops. A thread that cannot
    /// be started is an error naming it (the caller decides what it fails).
    pub fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let h = std::thread::Builder::new()
            .name(name.into())
            .spawn(f)
            .map_err(|e| err!(Io, "cannot start thread {name}: {e}"))?;
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(h);
        Ok(())
    }

    /// Joins every library thread, calling `between` before each round: threads may
    /// start threads (the acceptor, connectors), so it goes on until none is left.
    pub fn join_all(&self, between: impl Fn()) {
        loop {
            between();
            let threads: Vec<JoinHandle<()>> = self.threads.lock().drain(..).collect();
            if threads.is_empty() {
                return;
            }
            for t in threads {
                let _ = t.join();
            }
        }
    }

    /// How long a peer may stay silent before it counts as lost.
    pub fn peer_deadline(&self) -> Duration {
        Duration::from_millis(
            self.config.heartbeat_interval_ms * self.config.heartbeat_misses as u64,
        )
    }

    pub fn bootstrap_timeout(&self) -> Duration {
        Duration::from_millis(self.config.bootstrap_timeout_ms)
    }

    /// Registers the KV (or aux) buffers, and over RDMA on the prefill side their memory
    /// regions, local-only (the sources of our writes; nothing may write into them). A
    /// decode engine registers its buffers for each prefill engine apart, in that
    /// engine's own protection domain, when it connects
    /// ([`crate::transport::rdma::peer::Inbound`]).
    ///
    /// KV buffers may come with the layout of their pages (`layout`, never with aux):
    /// it must pass [`KvLayout::check`] and every buffer's `item_len` must be its
    /// [`KvLayout::page_bytes`]. Peers learn it at the registration exchange.
    pub fn register(
        &self,
        bufs: Vec<BufferDesc>,
        layers: Option<Vec<u32>>,
        layout: Option<KvLayout>,
        aux: bool,
    ) -> Result<()> {
        let r = &self.memory;
        let (slot, regions_slot, what) = if aux {
            (&r.aux, &r.aux_regions, "aux")
        } else {
            (&r.kv, &r.kv_regions, "kv")
        };
        debug_assert!(!aux || layout.is_none(), "aux buffers have no layout");
        // One registration at a time: the regions and the memory are published together.
        let _one = r.registering.lock();
        check_buffers(&bufs, what)?;
        if let Some(i) = bufs.iter().position(|b| !b.kind.is_host()) {
            if self.rdma.is_some() {
                return Err(err!(
                    Unsupported,
                    "{what} buffer {i} is {}: GPU memory over RDMA (DMA-BUF registration) is \
                     not supported; set transport=tcp (device pages then travel through \
                     pinned host staging)",
                    bufs[i].kind
                ));
            }
            // A decode engine's receiver of sealed frames decrypts into its pages with
            // the CPU.
            for (on, key) in [(self.config.encrypt_data, "encrypt_data=on")] {
                if on && self.role == Role::Decode {
                    return Err(err!(
                        Unsupported,
                        "{what} buffer {i} is {}: a decode engine with {key} cannot receive \
                         into device memory in this build (the receiver touches the pages \
                         with the CPU)",
                        bufs[i].kind
                    ));
                }
            }
            crate::cuda::check_buffers(&bufs, what)?;
        }
        if let Some(layout) = &layout {
            check_layout(&bufs, layout)?;
        }
        if slot.get().is_some() {
            return Err(err!(WrongState, "{what} buffers are already registered"));
        }
        if r.sealed.load(Ordering::SeqCst) {
            // A peer connected so far has our registration without these buffers, and
            // its links know nothing of them.
            return Err(err!(
                WrongState,
                "register every buffer before the first room is created or peer connects: \
                 peers connected so far would not know these {what} buffers"
            ));
        }
        if let Some(dev) = self.rdma.as_ref().filter(|_| self.role == Role::Prefill) {
            let mut regions = Vec::new();
            for (i, b) in bufs.iter().enumerate() {
                // SAFETY: the host promises the buffer stays valid until the engine is
                // freed; regions live in the engine and are dropped with it.
                let r = unsafe { dev.register(b.base, b.len, Access::Local) }.map_err(|e| {
                    err!(
                        TransportUnavailable,
                        "{what} buffer {i}: cannot register {} bytes with {}: {e}",
                        b.len,
                        dev.name()
                    )
                })?;
                regions.push(r);
            }
            // Regions first: a peer that sees the memory registered finds its regions too.
            let _ = regions_slot.set(Arc::new(regions));
        }
        let memory = match layers {
            Some(l) => Memory::with_layers(bufs, l),
            None => Memory::new(bufs),
        };
        // The layout first: a peer that sees the kv buffers registered finds it too.
        if let Some(layout) = layout {
            let _ = r.kv_layout.set(layout);
        }
        slot.set(memory)
            .map_err(|_| err!(WrongState, "{what} buffers are already registered"))
    }
}

/// What the engine registered: its KV and aux buffers, and (prefill over RDMA) their
/// local-only memory regions.
#[derive(Default)]
pub(crate) struct Registry {
    pub kv: OnceLock<Memory>,
    pub aux: OnceLock<Memory>,
    /// The layout of the KV pages, if the host registered one (set before `kv`).
    pub kv_layout: OnceLock<KvLayout>,
    pub kv_regions: OnceLock<Arc<Vec<Region>>>,
    pub aux_regions: OnceLock<Arc<Vec<Region>>>,
    registering: Mutex<()>,
    /// Set (under `registering`) when the first room is created or peer connects: from
    /// then on the registration is what peers know, and no buffer may be added. SeqCst
    /// (read under the same lock as it is set, so any order would do).
    sealed: AtomicBool,
}

impl Registry {
    /// Closes registration: peers are about to learn it (see `sealed`).
    pub fn seal(&self) {
        if !self.sealed.load(Ordering::SeqCst) {
            let _one = self.registering.lock();
            self.sealed.store(true, Ordering::SeqCst);
        }
    }

    /// Pages every KV buffer holds (0 before registration).
    pub fn kv_pages(&self) -> usize {
        self.kv.get().map(Memory::capacity).unwrap_or(0)
    }

    /// Slots every aux buffer holds (0 without aux buffers).
    pub fn aux_slots(&self) -> usize {
        self.aux.get().map(Memory::capacity).unwrap_or(0)
    }
}

fn engine_id(address: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(address.as_bytes());
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// The RDMA device to use, or `None` for TCP with the reason (for the log).
fn choose_transport(config: &Config, log: &Logger) -> Result<(Option<Arc<Device>>, String)> {
    let names = if config.rdma_devices.is_empty() {
        "any device with an active port".to_string()
    } else {
        format!("rdma_devices={}", config.rdma_devices.join(","))
    };
    match config.transport {
        TransportKind::Tcp => Ok((None, String::new())),
        TransportKind::Rdma => match Device::open(&config.rdma_devices) {
            Ok(Some(dev)) => Ok((Some(dev), String::new())),
            Ok(None) => Err(err!(
                TransportUnavailable,
                "transport 'rdma': no usable RDMA device ({names}; is libibverbs installed and \
                 a port ACTIVE?); use transport 'tcp' or 'auto'"
            )),
            Err(why) => Err(err!(TransportUnavailable, "transport 'rdma': {why}")),
        },
        TransportKind::Auto => match Device::open(&config.rdma_devices) {
            Ok(Some(dev)) => Ok((Some(dev), String::new())),
            Ok(None) => Ok((None, format!(" (auto: no usable RDMA device, {names})"))),
            Err(why) => {
                crate::log!(log, Warn, "transport auto: RDMA unusable, using TCP: {why}");
                Ok((None, format!(" (auto: RDMA unusable: {why})")))
            }
        },
    }
}

/// Whether `ip` is a loopback address (an IPv4-mapped one included): a peer there is on
/// this host.
pub(crate) fn is_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_loopback(),
        IpAddr::V6(a) => a.is_loopback() || a.to_ipv4_mapped().is_some_and(|a| a.is_loopback()),
    }
}

/// The address peers should connect to: the bound one, except that a wildcard host
/// (`0.0.0.0`, `[::]`) is replaced by this machine's host name, which peers can resolve,
/// when it resolves here.
fn advertised(local: SocketAddr) -> String {
    if !local.ip().is_unspecified() {
        return local.to_string();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    let resolves = !host.is_empty()
        && (host, local.port())
            .to_socket_addrs()
            .is_ok_and(|mut a| a.next().is_some());
    if resolves {
        format!("{host}:{}", local.port())
    } else {
        local.to_string()
    }
}

fn bind(listen: &str) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = listen
        .to_socket_addrs()
        .map_err(|e| {
            err!(
                BadValue,
                "config key 'listen': cannot resolve '{listen}': {e}"
            )
        })?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(err!(
        Io,
        "cannot listen on '{listen}': {}",
        last.map(|e| e.to_string())
            .unwrap_or_else(|| "no address".into())
    ))
}

/// Checks buffer descriptors before anything is registered.
fn check_buffers(bufs: &[BufferDesc], what: &str) -> Result<()> {
    if bufs.is_empty() || bufs.len() > MAX_BUFFERS {
        return Err(err!(
            InvalidArgument,
            "{what} buffer count must be 1 to {MAX_BUFFERS}, not {}",
            bufs.len()
        ));
    }
    for (i, b) in bufs.iter().enumerate() {
        if b.base == 0 {
            return Err(err!(InvalidArgument, "{what} buffer {i}: base is NULL"));
        }
        if b.item_len == 0 {
            return Err(err!(InvalidArgument, "{what} buffer {i}: item_len is 0"));
        }
        if b.len < b.item_len {
            return Err(err!(
                InvalidArgument,
                "{what} buffer {i}: len {} is smaller than item_len {}",
                b.len,
                b.item_len
            ));
        }
        if b.base.checked_add(b.len).is_none() {
            return Err(err!(
                InvalidArgument,
                "{what} buffer {i}: base + len overflows the address space"
            ));
        }
        if b.item_len > u32::MAX as usize / 2 {
            return Err(err!(
                InvalidArgument,
                "{what} buffer {i}: item_len {} is larger than a data frame",
                b.item_len
            ));
        }
    }
    Ok(())
}

/// Checks a KV layout and that every buffer's pages are of its size.
fn check_layout(bufs: &[BufferDesc], layout: &KvLayout) -> Result<()> {
    layout
        .check()
        .map_err(|e| err!(InvalidArgument, "kv layout: {e}"))?;
    let want = layout.page_bytes().unwrap_or(u64::MAX);
    for (i, b) in bufs.iter().enumerate() {
        if b.item_len as u64 != want {
            return Err(err!(
                InvalidArgument,
                "kv buffer {i}: item_len {} differs from the layout's page bytes {want} ({})",
                b.item_len,
                layout.page_bytes_product()
            ));
        }
    }
    Ok(())
}

/// A pipe (read end, write end), both ends close-on-exec and non-blocking.
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(err!(
            Io,
            "cannot create the engine's stop pipe: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Fresh random bytes for [`Node::probe`].
fn probe() -> Result<[u8; 16]> {
    let mut p = [0u8; 16];
    getrandom::fill(&mut p).map_err(|e| err!(Io, "no random bytes for the probe: {e}"))?;
    Ok(p)
}
