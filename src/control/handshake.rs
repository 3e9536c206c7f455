//! The messages of a peer's setup and their checks: hello, the registration exchange and
//! the transport agreement (over RDMA, the queue-pair exchange, and later the exchange
//! that replaces a broken queue pair). Each step returns a [`SetupError`] and changes
//! nothing else: the caller of a setup loses the peer, once.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use super::pairing::{self, Pairing};
use super::peer::Path;
use super::{Control, Peer, SetupError};
use crate::proto::{
    self, ConnKind, HostInfo, Message, QpInfo, Registration, Role as WireRole, SameHostSetting,
    WireTransport, PROTO_VERSION,
};
use crate::room::Cause;
use crate::tls::Wire;
use crate::transport::rdma::link::{replacement, ControlSender, RemoteBuffer};
use crate::transport::rdma::peer::{self as rdma, Inbound};
use crate::transport::samehost::{self, NotSameHost};
use crate::transport::DataLink;

/// What a decode engine makes of an answer to its `PathChoice` that is not its echo: the
/// prefill engine refusing the pairing (a `PathChoice` that says why), as MISMATCH; any
/// other message, as a protocol error.
pub(super) fn refusal(m: Message) -> SetupError {
    match m {
        Message::PathChoice {
            same_host: false,
            why,
        } => SetupError::new(crate::room::Cause::Mismatch, why),
        other => format!(
            "expected the PathChoice echoed, got {}",
            other.kind().name()
        )
        .into(),
    }
}

fn transport_name(t: WireTransport) -> &'static str {
    match t {
        WireTransport::Tcp => "TCP",
        WireTransport::Rdma => "RDMA",
    }
}

impl Control {
    pub(super) fn hello(&self, conn: ConnKind, conn_index: u16) -> Message {
        Message::Hello {
            proto_version: PROTO_VERSION,
            role: self.wire_role(),
            engine_id: self.node.engine_id,
            conn,
            conn_index,
        }
    }

    pub(super) fn wire_role(&self) -> WireRole {
        match self.node.role {
            crate::Role::Prefill => WireRole::Prefill,
            crate::Role::Decode => WireRole::Decode,
        }
    }

    /// Our registration for a peer. Over RDMA a decode engine tells each prefill engine
    /// where to write with the keys of the regions it registered for that engine alone
    /// (`inbound`); a prefill engine is never written into and tells no key.
    pub(super) fn registration(&self, inbound: Option<&Inbound>) -> Registration {
        let m = &self.node.memory;
        Registration {
            kv: rdma::buffer_infos(m.kv.get(), |i| inbound.and_then(|k| k.key(false, i))),
            aux: rdma::buffer_infos(m.aux.get(), |i| inbound.and_then(|k| k.key(true, i))),
            layout: m.kv_layout.get().copied(),
            integrity: self.node.config.integrity,
        }
    }

    /// Checks the peer's registration against ours (both sides run this one check, so
    /// both refuse with the same message) and returns the pairing: for each of the
    /// prefill engine's kv buffers, the decode buffer it fills, and both layouts. A
    /// mismatch names the buffer, or the layout field and both values; it is kept as
    /// the last refusal (see [`Control::last_mismatch`]).
    pub(super) fn check_registration(
        &self,
        peer: &str,
        theirs: &Registration,
    ) -> Result<Pairing, SetupError> {
        let ours = self.registration(None);
        let (decode, prefill) = match self.node.role {
            crate::Role::Decode => (&ours, theirs),
            crate::Role::Prefill => (theirs, &ours),
        };
        let setting = |on: bool| if on { "verify" } else { "off" };
        let agreed = if decode.integrity == prefill.integrity {
            Ok(())
        } else {
            Err(format!(
                "integrity={} on the decode engine, integrity={} on the prefill engine \
                 (both must verify, or neither)",
                setting(decode.integrity),
                setting(prefill.integrity)
            ))
        };
        agreed
            .and_then(|()| pairing::pair_kv(decode, prefill))
            .and_then(|p| pairing::check_aux(&decode.aux, &prefill.aux).map(|()| p))
            .map_err(|why| {
                let why = format!("registration mismatch with {peer}: {why}");
                *self.last_mismatch.lock() = Some((self.node.now_ms(), why.clone()));
                SetupError::new(Cause::Mismatch, why)
            })
    }

    pub(super) fn write_msg(&self, s: &mut Wire, msg: &Message) -> Result<(), String> {
        let mut frame = Vec::new();
        msg.encode(&mut frame).map_err(|e| e.to_string())?;
        s.write_all(&frame).map_err(|e| e.to_string())
    }

    pub(super) fn read_msg(&self, s: &mut Wire) -> Result<Message, String> {
        let limits = &self.node.limits;
        let hdr = proto::read_frame_header(s, limits).map_err(|e| e.to_string())?;
        if !hdr.kind.is_control() {
            return Err(format!("expected a control frame, got {}", hdr.kind.name()));
        }
        proto::read_control(s, &hdr, limits).map_err(|e| e.to_string())
    }

    pub(super) fn expect_hello(
        &self,
        s: &mut Wire,
        role: WireRole,
    ) -> Result<(u64, ConnKind, u16), String> {
        self.check_hello(self.read_msg(s)?, role)
    }

    /// The engine id, connection kind and index of `m`, a `Hello` from an engine of
    /// `role` that speaks our protocol; why not otherwise.
    pub(super) fn check_hello(
        &self,
        m: Message,
        role: WireRole,
    ) -> Result<(u64, ConnKind, u16), String> {
        match m {
            Message::Hello {
                proto_version,
                role: r,
                engine_id,
                conn,
                conn_index,
            } => {
                if proto_version != PROTO_VERSION {
                    return Err(format!(
                        "peer speaks protocol {proto_version}, this build {PROTO_VERSION}"
                    ));
                }
                if r != role {
                    return Err(format!("peer is a {r:?} engine, expected {role:?}"));
                }
                Ok((engine_id, conn, conn_index))
            }
            other => Err(format!("expected Hello, got {}", other.kind().name())),
        }
    }

    pub(super) fn expect_registration(&self, s: &mut Wire) -> Result<Registration, String> {
        match self.read_msg(s)? {
            Message::Registration(r) => Ok(r),
            other => Err(format!(
                "expected Registration, got {}",
                other.kind().name()
            )),
        }
    }

    fn wire_transport(&self) -> WireTransport {
        if self.node.rdma.is_some() {
            WireTransport::Rdma
        } else {
            WireTransport::Tcp
        }
    }

    fn expect_transport(&self, s: &mut Wire, peer: &Peer) -> Result<Vec<QpInfo>, SetupError> {
        let (transport, qps) = match self.read_msg(s)? {
            Message::Transport { transport, qps } => (transport, qps),
            other => return Err(format!("expected Transport, got {}", other.kind().name()).into()),
        };
        self.agree_transport(peer, transport)?;
        Ok(qps)
    }

    /// Both engines must move data the same way: a mismatch fails the peer as MISMATCH.
    fn agree_transport(&self, peer: &Peer, theirs: WireTransport) -> Result<(), SetupError> {
        let ours = self.wire_transport();
        if theirs == ours {
            return Ok(());
        }
        Err(SetupError::new(
            Cause::Mismatch,
            format!(
                "transport mismatch: this {} engine moves data over {}, {} over {}",
                self.node.role,
                transport_name(ours),
                peer.name,
                transport_name(theirs)
            ),
        ))
    }

    /// Decode side, after the registration exchange: agree on the transport and, over
    /// RDMA, connect one queue pair to each of the prefill engine's (one per worker), in
    /// the peer's own protection domain. Returns whether the peer writes over RDMA.
    pub(super) fn decode_transport(
        &self,
        peer: &Arc<Peer>,
        ctrl: &mut Wire,
    ) -> Result<bool, SetupError> {
        let ours = self.wire_transport();
        self.write_msg(
            ctrl,
            &Message::Transport {
                transport: ours,
                qps: Vec::new(),
            },
        )?;
        let theirs = self.expect_transport(ctrl, peer)?;
        let Some(inbound) = peer.inbound.get() else {
            return Ok(false);
        };
        let infos = inbound.connect(&theirs, &peer.name)?;
        self.write_msg(
            ctrl,
            &Message::Transport {
                transport: ours,
                qps: infos,
            },
        )?;
        Ok(true)
    }

    /// Decode side, after a TCP transport agreement: offer the same-host path (unless
    /// `same_host=off`), decide it from the prefill's answer ([`samehost::check`]), tell
    /// the prefill and wait for its echo, so that the path is set on both sides before
    /// any data connection opens. With `same_host=require`, a pairing that cannot take
    /// it fails as MISMATCH with the reason.
    pub(super) fn decode_same_host(
        &self,
        peer: &Arc<Peer>,
        ctrl: &mut Wire,
    ) -> Result<(), SetupError> {
        let setting = self.node.config.same_host;
        if setting == SameHostSetting::Off {
            self.paired(peer, Path::Tcp, Some("same_host=off here"), false);
            return Ok(());
        }
        let ours = self.node.host_info();
        self.write_msg(ctrl, &Message::SameHost(ours))?;
        let theirs = match self.read_past_heartbeats(ctrl)? {
            Message::SameHost(h) => h,
            other => return Err(format!("expected SameHost, got {}", other.kind().name()).into()),
        };
        // With device memory on either side the prefill follows with its CUDA IPC offer
        // (read whatever is decided, to keep the connection in step).
        let offer = if super::ipc::offered(&theirs, &ours) {
            Some(self.read_past_heartbeats(ctrl)?)
        } else {
            None
        };
        let device = ours.device_memory || theirs.device_memory;
        let choice = samehost::check(&ours, &theirs).and_then(|()| match offer {
            Some(offer) => self.take_ipc(peer, &theirs, offer),
            None => Ok(()),
        });
        let why = choice.as_ref().err().map(|e| e.why().to_string());
        let limits = &self.node.limits;
        let told = Message::PathChoice {
            same_host: choice.is_ok(),
            why: proto::truncate_reason(why.as_deref().unwrap_or(""), limits.max_reason_len)
                .to_string(),
        };
        self.write_msg(ctrl, &told)?;
        match self.read_past_heartbeats(ctrl)? {
            m if m == told => {}
            m => return Err(refusal(m)),
        }
        match choice {
            Ok(()) => {
                let path = if device {
                    Path::CudaIpc { pid: theirs.pid }
                } else {
                    Path::SameHost { pid: theirs.pid }
                };
                self.paired(peer, path, None, false);
                Ok(())
            }
            Err(e) if setting == SameHostSetting::Require => Err(SetupError::new(
                crate::room::Cause::Mismatch,
                format!(
                    "same_host=require, but the same-host path to {} cannot be used: {}",
                    peer.name,
                    e.why()
                ),
            )),
            Err(e) => {
                let warn = matches!(e, NotSameHost::Refused(_));
                self.paired(peer, Path::Tcp, Some(e.why()), warn);
                Ok(())
            }
        }
    }

    fn read_past_heartbeats(&self, s: &mut Wire) -> Result<Message, String> {
        loop {
            match self.read_msg(s)? {
                Message::Heartbeat { .. } => continue,
                m => return Ok(m),
            }
        }
    }

    /// Prefill side, on the control reader: a decode engine's same-host offer, answered
    /// with our identity (and probe, unless `same_host=off`). Only before the path is
    /// chosen.
    pub(super) fn on_same_host(&self, peer: &Arc<Peer>, theirs: HostInfo) -> Result<(), String> {
        if peer.path.get().is_some() || peer.ipc_offered.get().is_some() {
            return Err("a same-host offer after the path was chosen".into());
        }
        let mut ours = self.node.host_info();
        if ours.setting == SameHostSetting::Off {
            (ours.probe_addr, ours.probe) = (0, [0; 16]);
        }
        peer.send(&Message::SameHost(ours));
        if super::ipc::offered(&ours, &theirs) {
            peer.send(&self.ipc_offer(peer, &theirs));
        }
        Ok(())
    }

    /// Prefill side, on the control reader: the decode engine's choice of path, applied
    /// and echoed (the decode engine opens its data connections after the echo). With
    /// `same_host=require` here, a choice of TCP loses the peer as MISMATCH.
    pub(super) fn on_path_choice(
        &self,
        peer: &Arc<Peer>,
        same_host: bool,
        why: String,
    ) -> Result<(), String> {
        if peer.path.get().is_some() {
            return Err("a second PathChoice".into());
        }
        if !same_host && self.node.config.same_host == SameHostSetting::Require {
            // Refused in the answer; the decode engine fails its rooms with the reason
            // and closes the connection.
            let refused = format!(
                "same_host=require on the prefill engine, but the pairing takes TCP: {why}"
            );
            crate::log!(self.node.log, Warn, "refusing {}: {refused}", peer.name);
            peer.send(&Message::PathChoice {
                same_host: false,
                why: proto::truncate_reason(&refused, self.node.limits.max_reason_len).to_string(),
            });
            return Ok(());
        }
        let path = match (same_host, peer.ipc_offered.get()) {
            // The decode engine copies; we only need to know that it does.
            (true, None) => Path::SameHost { pid: 0 },
            (true, Some(true)) => Path::CudaIpc { pid: 0 },
            (true, Some(false)) => {
                return Err("a same-host choice after an IpcOffer that offered nothing".into())
            }
            (false, _) => Path::Tcp,
        };
        let note = (!same_host).then_some(why.as_str());
        self.paired(peer, path, note, false);
        peer.send(&Message::PathChoice { same_host, why });
        Ok(())
    }

    /// Records the path of `peer`'s pairing, counts it and says it in one log line (a
    /// warning for a same-host pairing that falls back to TCP, with why).
    pub(super) fn paired(&self, peer: &Peer, path: Path, why: Option<&str>, fallback: bool) {
        if peer.path.set(path).is_err() {
            return;
        }
        let m = &self.node.metrics;
        let counter = match path {
            Path::Tcp => &m.pairings_tcp,
            Path::Rdma => &m.pairings_rdma,
            Path::SameHost { .. } => &m.pairings_same_host,
            Path::CudaIpc { .. } => &m.pairings_cuda_ipc,
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = path.data_path().name();
        match (why, fallback) {
            (Some(why), true) => {
                m.same_host_fallbacks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                crate::log!(
                    self.node.log,
                    Warn,
                    "pairing with {}: {name}, not the same-host path: {why}",
                    peer.name
                );
            }
            (Some(why), false) => {
                crate::log!(
                    self.node.log,
                    Info,
                    "pairing with {}: {name} ({why})",
                    peer.name
                )
            }
            (None, _) => crate::log!(self.node.log, Info, "pairing with {}: {name}", peer.name),
        }
    }

    /// Prefill side, after the registration exchange: agree on the transport and, over
    /// RDMA, open one queue pair per worker to the decode engine, each a data link.
    pub(super) fn prefill_transport(
        &self,
        peer: &Arc<Peer>,
        s: &mut Wire,
        theirs: &Registration,
        map: &[u32],
    ) -> Result<(), SetupError> {
        let ours = self.wire_transport();
        let reply = |s: &mut Wire, qps: Vec<QpInfo>| {
            self.write_msg(
                s,
                &Message::Transport {
                    transport: ours,
                    qps,
                },
            )
        };
        let asked = match self.read_msg(s)? {
            Message::Transport { transport, .. } => transport,
            other => return Err(format!("expected Transport, got {}", other.kind().name()).into()),
        };
        let Some(dev) = self.node.rdma.as_ref().filter(|_| asked == ours) else {
            // TCP, or a mismatch: our answer tells the peer which, then agree or fail.
            reply(s, Vec::new())?;
            return self.agree_transport(peer, asked);
        };
        let config = &self.node.config;
        let eps = rdma::outbound_endpoints(dev, config.rdma_queue_depth, config.workers)?;
        reply(s, eps.iter().map(|e| e.info()).collect())?;
        let remotes = self.expect_transport(s, peer)?;
        let memory = &self.node.memory;
        let control = || -> ControlSender {
            let weak = Arc::downgrade(peer);
            Box::new(move |frame| match weak.upgrade() {
                Some(p) if p.send_frame(frame) => Ok(()),
                _ => Err(std::io::Error::other("the control connection is gone")),
            })
        };
        let setup = rdma::Outbound {
            device: dev,
            depth: config.rdma_queue_depth,
            local_kv: memory.kv_regions.get().cloned().unwrap_or_default(),
            local_aux: memory.aux_regions.get().cloned().unwrap_or_default(),
            remote_kv: map
                .iter()
                .map(|&j| RemoteBuffer::from(&theirs.kv[j as usize]))
                .collect(),
            remote_aux: theirs.aux.iter().map(RemoteBuffer::from).collect(),
            slice: config.rdma_slice_bytes,
            stall: Duration::from_millis(config.transfer_timeout_ms),
            control: &control,
            integrity: config.integrity,
        };
        let links = rdma::outbound(eps, &remotes, &setup, &peer.name)?;
        self.paired(peer, Path::Rdma, None, false);
        *peer.data.write() = links
            .iter()
            .map(|l| l.clone() as Arc<dyn DataLink>)
            .collect();
        *peer.rdma_links.write() = links;
        if peer.is_lost() {
            peer.data.write().clear();
            peer.rdma_links.write().clear();
            return Ok(());
        }
        if let Some(events) = self.events() {
            for link in peer.data.read().iter() {
                events.clone().link_up(peer, link.clone());
            }
        }
        Ok(())
    }

    /// A replacement queue pair after a broken one. On the decode side: the prefill
    /// engine's new queue pair `i` (the first entry with a queue pair number); shut the
    /// old one, connect a new one of ours to it and answer, echoing the request's queue
    /// pair in entry `i + 1`. On the prefill side: that answer.
    pub(super) fn on_reconnect(&self, peer: &Arc<Peer>, qps: &[QpInfo]) -> Result<(), String> {
        let Some((i, q)) = qps.iter().enumerate().find(|(_, q)| q.qpn != 0) else {
            return Err("a queue pair request names no queue pair".into());
        };
        match self.node.role {
            crate::Role::Prefill => {
                let link = peer.rdma_links.read().get(i).cloned();
                // The entry after the answer echoes the queue pair it answers.
                let echo = qps.get(i + 1).map_or(0, |e| e.qpn);
                match link {
                    Some(l) => {
                        l.answer(*q, echo);
                        Ok(())
                    }
                    None => Err(format!(
                        "an answer for queue pair {i}, which we never asked for"
                    )),
                }
            }
            crate::Role::Decode => {
                let Some(inbound) = peer.inbound.get() else {
                    return Err("a queue pair request from a peer that writes over TCP".into());
                };
                // First of all (inside replace): nothing more lands through the old one
                // (the prefill engine sends this before it acknowledges anything written
                // through it). None if the peer is shut: no queue pair may reopen.
                let Some(info) = inbound.replace(i, q)? else {
                    return Ok(());
                };
                crate::log!(
                    self.node.log,
                    Info,
                    "replaced RDMA queue pair {i} of {}",
                    peer.name
                );
                peer.send(&replacement(i, info, Some(*q)));
                Ok(())
            }
        }
    }
}
