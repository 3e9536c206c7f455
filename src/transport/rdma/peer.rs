//! The RDMA side of one peer engine: what the handshake sets up once per peer and what a
//! peer's loss tears down.
//!
//! - Decode side ([`Inbound`]): a protection domain of the peer's own, the decode
//!   engine's KV and aux buffers registered in it for remote writes (the keys the peer
//!   gets), and the queue pairs the peer writes through. Shutting it moves the queue
//!   pairs to the error state first, then deregisters the regions: nothing lands after,
//!   and the peer's keys are revoked.
//! - Prefill side ([`outbound`]): one queue pair per worker to the decode engine, each an
//!   [`RdmaLink`], with local-only access.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::link::{ControlSender, LinkSetup, RdmaLink, RemoteBuffer};
use super::verbs::{Access, Device, Domain, Endpoint, EndpointInfo, Region};
use crate::proto::{BufferInfo, QpInfo};
use crate::transport::Memory;

/// Decode side over RDMA: the domain, regions and queue pairs of one prefill engine.
pub struct Inbound {
    /// Queue pairs first: they are shut before the regions are deregistered.
    qps: Mutex<Vec<Endpoint>>,
    /// `None` once shut (the regions deregistered, the keys revoked).
    keys: Mutex<Option<Keys>>,
}

struct Keys {
    /// Regions first: they are deregistered before their domain is freed.
    kv: Vec<Region>,
    aux: Vec<Region>,
    domain: Domain,
}

impl Inbound {
    /// Makes a protection domain for one peer (`who`, for messages) and registers every
    /// buffer of `kv` and `aux` in it for remote writes.
    ///
    /// # Safety
    /// The memory of `kv` and `aux` must stay valid until the returned value is dropped
    /// or shut (the host's registration contract, for the engine's lifetime).
    pub unsafe fn new(
        dev: &Arc<Device>,
        kv: Option<&Memory>,
        aux: Option<&Memory>,
        who: &str,
    ) -> Result<Inbound, String> {
        let domain = dev
            .domain()
            .map_err(|e| format!("cannot make an RDMA protection domain: {e}"))?;
        let register = |m: Option<&Memory>, what: &str| {
            m.map_or(Ok(Vec::new()), |m| {
                m.buffers()
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        // SAFETY: the caller keeps the memory valid while the region lives.
                        unsafe { domain.register(b.base, b.len, Access::RemoteWrite) }.map_err(
                            |e| format!("{what} buffer {i}: cannot register it for {who}: {e}"),
                        )
                    })
                    .collect::<Result<Vec<Region>, String>>()
            })
        };
        let kv = register(kv, "kv")?;
        let aux = register(aux, "aux")?;
        Ok(Inbound {
            qps: Mutex::new(Vec::new()),
            keys: Mutex::new(Some(Keys { kv, aux, domain })),
        })
    }

    /// The address and key of KV buffer `i` (aux when `aux`), for the registration.
    pub fn key(&self, aux: bool, i: usize) -> Option<(u64, u32)> {
        let keys = self.keys.lock();
        let k = keys.as_ref()?;
        let r = if aux { k.aux.get(i) } else { k.kv.get(i) }?;
        Some((r.base() as u64, r.rkey()))
    }

    fn endpoint(&self) -> Result<Endpoint, String> {
        match self.keys.lock().as_ref() {
            Some(k) => k
                .domain
                .endpoint(1, Access::RemoteWrite)
                .map_err(|e| format!("cannot create an RDMA queue pair: {e}")),
            None => Err("the peer's RDMA keys are revoked (lost)".to_string()),
        }
    }

    /// Connects one queue pair of ours to each of the peer's `theirs`; our side's
    /// connection data, for the answer.
    pub fn connect(&self, theirs: &[QpInfo], who: &str) -> Result<Vec<QpInfo>, String> {
        if theirs.is_empty() {
            return Err(format!("{who} offered no RDMA queue pairs"));
        }
        let mut eps = Vec::with_capacity(theirs.len());
        for remote in theirs {
            let mut ep = self.endpoint()?;
            ep.connect(remote)
                .map_err(|e| format!("cannot connect an RDMA queue pair to {who}: {e}"))?;
            eps.push(ep);
        }
        let infos = eps.iter().map(Endpoint::info).collect();
        let mut qps = self.qps.lock();
        qps.extend(eps);
        if self.keys.lock().is_none() {
            // Shut meanwhile: its pass may have missed these.
            for qp in qps.iter_mut() {
                qp.shut();
            }
            return Err("lost during setup".into());
        }
        Ok(infos)
    }

    /// The peer replaced its broken queue pair `i` by `theirs`: shuts ours first (nothing
    /// more lands through it), connects a new one to theirs and returns its connection
    /// data; `None` if this side is shut (no queue pair may reopen).
    pub fn replace(&self, i: usize, theirs: &QpInfo) -> Result<Option<EndpointInfo>, String> {
        let mut qps = self.qps.lock();
        if self.keys.lock().is_none() {
            return Ok(None);
        }
        let n = qps.len();
        let Some(old) = qps.get_mut(i) else {
            return Err(format!("a request to replace queue pair {i} of {n}"));
        };
        old.shut();
        let mut ep = self.endpoint()?;
        ep.connect(theirs)
            .map_err(|e| format!("cannot connect a replacement queue pair: {e}"))?;
        let info = ep.info();
        qps[i] = ep;
        Ok(Some(info))
    }

    /// No write of the peer may land from here on: its queue pairs move to the error
    /// state, then its regions are deregistered (its keys revoked). Idempotent.
    pub fn shut(&self) {
        let mut qps = self.qps.lock();
        for qp in qps.iter_mut() {
            qp.shut();
        }
        self.keys.lock().take();
    }
}

/// The registration entries of `m`'s buffers, with the address and key of each from
/// `key` (none for a prefill engine, which is never written into).
pub fn buffer_infos(
    m: Option<&Memory>,
    key: impl Fn(usize) -> Option<(u64, u32)>,
) -> Vec<BufferInfo> {
    m.map(|m| {
        m.buffers()
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let (addr, rkey) = key(i).unwrap_or((0, 0));
                BufferInfo {
                    len: b.len as u64,
                    item_len: b.item_len as u64,
                    layer_id: m.layer(i).map_or(BufferInfo::NO_LAYER, |l| l as i32),
                    addr,
                    rkey,
                }
            })
            .collect()
    })
    .unwrap_or_default()
}

/// Prefill side: `n` fresh queue pairs (local-only), to announce to the decode engine.
pub fn outbound_endpoints(
    dev: &Arc<Device>,
    depth: u32,
    n: usize,
) -> Result<Vec<Endpoint>, String> {
    (0..n)
        .map(|_| {
            dev.endpoint(depth, Access::Local)
                .map_err(|e| format!("cannot create an RDMA queue pair: {e}"))
        })
        .collect()
}

/// What the prefill side's links to one decode engine share.
pub struct Outbound<'a> {
    pub device: &'a Arc<Device>,
    pub depth: u32,
    /// Our KV and aux regions (local-only).
    pub local_kv: Arc<Vec<Region>>,
    pub local_aux: Arc<Vec<Region>>,
    /// For each of our KV buffers, the decode buffer it fills; the decode aux buffers.
    pub remote_kv: Vec<RemoteBuffer>,
    pub remote_aux: Vec<RemoteBuffer>,
    pub slice: usize,
    pub stall: Duration,
    /// Sends a control frame to the decode engine (each link gets its own sender).
    pub control: &'a dyn Fn() -> ControlSender,
    /// `integrity=verify`: progress carries every run's header and digest.
    pub integrity: bool,
}

/// Prefill side: connects `eps` to the decode engine's answered queue pairs `remotes`,
/// one link per worker.
pub fn outbound(
    eps: Vec<Endpoint>,
    remotes: &[QpInfo],
    setup: &Outbound<'_>,
    who: &str,
) -> Result<Vec<Arc<RdmaLink>>, String> {
    if remotes.len() != eps.len() {
        return Err(format!(
            "{who} answered {} queue pairs for our {}",
            remotes.len(),
            eps.len()
        ));
    }
    let mut links = Vec::with_capacity(eps.len());
    for (index, (mut ep, remote)) in eps.into_iter().zip(remotes).enumerate() {
        ep.connect(remote)
            .map_err(|e| format!("cannot connect an RDMA queue pair to {who}: {e}"))?;
        links.push(Arc::new(RdmaLink::new(
            ep,
            LinkSetup {
                index,
                device: setup.device.clone(),
                depth: setup.depth,
                local_kv: setup.local_kv.clone(),
                local_aux: setup.local_aux.clone(),
                remote_kv: setup.remote_kv.clone(),
                remote_aux: setup.remote_aux.clone(),
                slice: setup.slice,
                stall: setup.stall,
                control: (setup.control)(),
                integrity: setup.integrity,
            },
        )));
    }
    Ok(links)
}
