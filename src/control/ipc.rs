//! The CUDA IPC path's setup, inside the same-host pairing ([`super::handshake`]): when
//! either engine registered device memory, the prefill engine follows its `SameHost`
//! answer with an `IpcOffer` (its exported allocations, or why it offers none), and the
//! decode engine takes the offer's descriptors, imports the allocations once per pairing
//! and chooses the path, or says why not (a fallback to TCP staging with `auto`, a
//! failure with `same_host=require`).
//!
//! The descriptors come from the prefill's process only: the offer's socket name and
//! nonce travel on this authenticated control connection, the prefill gives them to the
//! decode's pid (from its `SameHost`) once it proves the nonce, and the decode checks
//! that the socket is the prefill's pid, which the same-host check proved with the probe
//! ([`crate::transport::fdpass`]).

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use super::peer::Path;
use super::{Control, Peer};
use crate::cuda::ipc::{self, ExportHandle, Imports};
use crate::proto::{self, HostInfo, Message, SameHostSetting};
use crate::transport::fdpass::{self, FdOffer};
use crate::transport::samehost::NotSameHost;
use crate::transport::{BufferDesc, MemKind};

/// Whether a same-host pairing between engines with these identities has an `IpcOffer`:
/// the prefill (`prefill`) does not have `same_host=off` and either engine registered
/// device memory. Both engines decide it from the same two `SameHost` messages.
pub(super) fn offered(prefill: &HostInfo, decode: &HostInfo) -> bool {
    prefill.setting != SameHostSetting::Off && (prefill.device_memory || decode.device_memory)
}

fn kind_byte(k: MemKind) -> u8 {
    u8::from(!k.is_host())
}

impl Control {
    fn buffers(&self) -> (Vec<BufferDesc>, Vec<BufferDesc>) {
        let m = &self.node.memory;
        let list = |x: Option<&crate::transport::Memory>| {
            x.map(|m| m.buffers().to_vec()).unwrap_or_default()
        };
        (list(m.kv.get()), list(m.aux.get()))
    }

    /// Prefill side: the `IpcOffer` for a decode engine (identity `theirs`) on this host,
    /// exporting our device allocations and giving their descriptors to its process on a
    /// thread of our own; or, with `why` set, the reason none is offered.
    pub(super) fn ipc_offer(&self, peer: &Arc<Peer>, theirs: &HostInfo) -> Message {
        let (kv, aux) = self.buffers();
        let kinds: Vec<u8> = kv.iter().chain(&aux).map(|b| kind_byte(b.kind)).collect();
        let refuse = |why: String| {
            let _ = peer.ipc_offered.set(false);
            Message::IpcOffer {
                ranges: Vec::new(),
                kinds: kinds.clone(),
                socket: Vec::new(),
                nonce: [0; proto::IPC_NONCE_LEN],
                why: proto::truncate_reason(&why, self.node.limits.max_reason_len).to_string(),
            }
        };
        if self.node.config.integrity {
            return refuse(
                "integrity=verify: device pages copied through CUDA IPC could not be \
                 digested without a copy back to the host (TCP staging digests them)"
                    .into(),
            );
        }
        if kv.iter().chain(&aux).all(|b| b.kind.is_host()) {
            return refuse("the prefill engine registered no device memory".into());
        }
        let all: Vec<BufferDesc> = kv.into_iter().chain(aux).collect();
        let exports = match ipc::export(&all) {
            Ok(e) => e,
            Err(e) => return refuse(format!("CUDA IPC export failed: {}", e.message())),
        };
        let ranges = ipc::encode(&exports.ranges);
        if ranges.len() > proto::MAX_IPC_RANGES_LEN {
            return refuse(format!(
                "{} device allocations to export",
                exports.ranges.len()
            ));
        }
        let offer = match FdOffer::bind() {
            Ok(o) => o,
            Err(e) => return refuse(format!("no Unix socket for the descriptors: {e}")),
        };
        let (socket, nonce) = (offer.name().to_vec(), offer.nonce());
        let (pid, within) = (theirs.pid, self.setup_timeout());
        let log = self.node.log.clone();
        let name = peer.name.clone();
        let (node, weak) = (self.node.clone(), Arc::downgrade(peer));
        // The descriptors go only to the decode's process, proving the nonce; given or
        // not by the deadline (or once the engine stops, the peer is lost or its pairing
        // took another path), this thread ends and closes our copies of them.
        let give = move || {
            let fds: Vec<_> = exports.fds.iter().map(|f| f.as_fd()).collect();
            let elsewhere = |p: &Peer| {
                p.is_lost()
                    || p.path
                        .get()
                        .is_some_and(|x| !matches!(x, Path::CudaIpc { .. }))
            };
            let cancelled = || node.is_stopping() || weak.upgrade().is_none_or(|p| elsewhere(&p));
            if let Err(e) = offer.give_unless(pid, &fds, within, &cancelled) {
                crate::log!(log, Info, "CUDA IPC descriptors for {name} not taken: {e}");
            }
        };
        if let Err(e) = self.node.spawn("kvxfer-ipc-give", Box::new(give)) {
            return refuse(format!("no thread to pass the descriptors: {e}"));
        }
        let _ = peer.ipc_offered.set(true);
        Message::IpcOffer {
            ranges,
            kinds,
            socket,
            nonce,
            why: String::new(),
        }
    }

    fn setup_timeout(&self) -> Duration {
        Duration::from_millis(self.node.config.bootstrap_timeout_ms.max(1000))
    }

    /// Decode side: takes the prefill's `offer` (the pairing's buffer map known), imports
    /// its allocations into the device of our device buffers and keeps the table with the
    /// peer; why the path cannot be taken otherwise.
    pub(super) fn take_ipc(
        &self,
        peer: &Arc<Peer>,
        theirs: &HostInfo,
        offer: Message,
    ) -> Result<(), NotSameHost> {
        let refused = |why: String| NotSameHost::Refused(format!("CUDA IPC: {why}"));
        let Message::IpcOffer {
            ranges,
            kinds,
            socket,
            nonce,
            why,
        } = offer
        else {
            return Err(refused("expected the prefill's IpcOffer".into()));
        };
        if !why.is_empty() {
            return Err(refused(why));
        }
        if self.node.config.integrity {
            return Err(refused("integrity=verify on this decode engine".into()));
        }
        let (kv, aux) = self.buffers();
        let map = peer.kv_map.get().cloned().unwrap_or_default();
        if kinds.len() != map.len() + aux.len() {
            return Err(refused(format!(
                "the prefill names the memory of {} buffers, the pairing has {}",
                kinds.len(),
                map.len() + aux.len()
            )));
        }
        let pairs = map
            .iter()
            .enumerate()
            .map(|(i, &j)| (format!("kv buffer {i}"), kinds[i], kv.get(j as usize)))
            .chain(
                aux.iter()
                    .enumerate()
                    .map(|(k, b)| (format!("aux buffer {k}"), kinds[map.len() + k], Some(b))),
            );
        for (what, theirs_kind, ours) in pairs {
            let ours = ours.map_or(0, |b| kind_byte(b.kind));
            if ours != theirs_kind {
                let name = |k: u8| if k == 1 { "device" } else { "host" };
                return Err(refused(format!(
                    "{what} is {} memory on the prefill engine and {} memory here (device \
                     pages are copied device to device, host pages host to host)",
                    name(theirs_kind),
                    name(ours)
                )));
            }
        }
        let mut devices: Vec<u32> = kv
            .iter()
            .chain(&aux)
            .filter_map(|b| match b.kind {
                MemKind::Cuda { device } => Some(device),
                MemKind::Host => None,
            })
            .collect();
        devices.sort_unstable();
        devices.dedup();
        let [device] = devices[..] else {
            return Err(refused(format!(
                "this engine's device buffers are on {} devices; the path imports into one",
                devices.len()
            )));
        };
        let ranges = ipc::decode(&ranges).map_err(refused)?;
        let n = ranges
            .iter()
            .filter(|r| matches!(r.handle, ExportHandle::Fd(_)))
            .count();
        let fds = fdpass::take(&socket, &nonce, theirs.pid, n, self.setup_timeout())
            .map_err(|e| refused(format!("the descriptors could not be passed: {e}")))?;
        let table = Imports::open(device, &ranges, fds).map_err(|e| refused(e.message().into()))?;
        crate::log!(
            self.node.log,
            Info,
            "CUDA IPC with {}: {} allocations imported into device {device}",
            peer.name,
            table.len()
        );
        let _ = peer.ipc.set(Arc::new(table));
        Ok(())
    }
}
