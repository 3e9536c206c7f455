//! Decode side: connecting to a prefill engine, once per peer, in the background.

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Control, Peer, SetupError};
use crate::proto::{ConnKind, Message, Role as WireRole};
use crate::tls::Wire;
use crate::transport::rdma::peer::Inbound;
use crate::transport::tcp;
use crate::transport::tcp::seal::Opener;

impl Control {
    /// The peer for prefill engine `addr`, connecting to it in the background if there
    /// is none (or the last one was lost).
    pub fn peer_for(self: &Arc<Self>, addr: &str) -> Arc<Peer> {
        let mut peers = self.peers.lock();
        if let Some(p) = peers.get(addr) {
            if !p.is_lost() {
                return p.clone();
            }
        }
        let peer = Peer::new(
            addr.to_string(),
            format!("prefill {addr}"),
            self.node.now_ms(),
            self.node.log.clone(),
        );
        peers.insert(addr.to_string(), peer.clone());
        drop(peers);
        let (control, p) = (self.clone(), peer.clone());
        self.spawn_for_peer("kvxfer-connect", &peer, move || {
            #[cfg(feature = "test-hooks")]
            if crate::testing::take_fault("connect.panic", p.fault_key()) {
                panic!("injected fault connect.panic");
            }
            match control.connect(&p) {
                Ok(()) => {
                    if let Some(events) = control.events() {
                        events.connected(&p);
                    }
                }
                Err(e) => control.lose_with(&p, e.cause, e.why),
            }
        });
        peer
    }

    /// Handshake, authentication, registration, transport and data connections to a
    /// prefill engine; the peer is ready when it returns Ok.
    fn connect(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<(), SetupError> {
        let node = &self.node;
        let timeout = node.bootstrap_timeout();
        let addr = peer.key.clone();
        let sock = tcp::connect(&addr, timeout).map_err(|e| format!("cannot connect: {e}"))?;
        self.local_peer(&sock, peer)?;
        peer.track(&sock);
        let mut ctrl = self.secure(sock, peer)?;
        ctrl.tcp()
            .set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        self.write_msg(&mut ctrl, &self.hello(ConnKind::Control, 0))?;
        let session = self.authenticate(&mut ctrl, peer, ConnKind::Control, 0, None)?;
        let (their_id, _, _) = self.expect_hello(&mut ctrl, WireRole::Prefill)?;
        let _ = peer.remote_id.set(their_id);
        if let Some(dev) = &node.rdma {
            // Only now, with the peer authenticated: its keys to our memory.
            // SAFETY: the host keeps registered memory valid until the engine is freed;
            // the inbound side lives in the peer, which the engine drops before that.
            let inbound = unsafe {
                Inbound::new(dev, node.memory.kv.get(), node.memory.aux.get(), &peer.name)
            }?;
            let _ = peer.inbound.set(inbound);
            if peer.is_lost() {
                // Lost meanwhile: its loss pass may have missed them.
                peer.inbound.get().map(Inbound::shut);
                return Err("lost during setup".to_string().into());
            }
        }
        self.write_msg(
            &mut ctrl,
            &Message::Registration(self.registration(peer.inbound.get())),
        )?;
        let theirs = self.expect_registration(&mut ctrl)?;
        let pairing = self.check_registration(&peer.name, &theirs)?;
        peer.set_pairing(pairing);
        let _ = peer.aux_count.set(theirs.aux.len());
        let rdma = self.decode_transport(peer, &mut ctrl)?;
        if rdma {
            self.paired(peer, super::Path::Rdma, None, false);
        } else {
            self.decode_same_host(peer, &mut ctrl)?;
        }
        let data_conns = if rdma {
            0
        } else {
            node.config.connections_per_peer
        };
        for i in 0..data_conns {
            let d = tcp::connect(&addr, timeout).map_err(|e| format!("cannot connect: {e}"))?;
            peer.track(&d);
            d.set_read_timeout(Some(timeout))
                .map_err(|e| e.to_string())?;
            let mut d = Wire::Plain(d);
            self.write_msg(&mut d, &self.hello(ConnKind::Data, i as u16))?;
            let secret =
                self.authenticate(&mut d, peer, ConnKind::Data, i as u16, session.as_ref())?;
            match self.read_msg(&mut d)? {
                m @ Message::Hello { .. } => {
                    self.check_hello(m, WireRole::Prefill)?;
                }
                m => return Err(super::handshake::refusal(m)),
            }
            let Wire::Plain(d) = d else {
                unreachable!("data connections are plain TCP")
            };
            d.set_read_timeout(None).map_err(|e| e.to_string())?;
            let open = match secret.filter(|_| self.encrypts_data()) {
                Some(secret) => Some(Opener::new(&secret)),
                None if self.encrypts_data() => {
                    return Err(format!(
                        "encrypt_data=true but data connection {i} proved no secret"
                    )
                    .into())
                }
                None => None,
            };
            self.serve_data(peer, d, open);
        }
        ctrl.tcp()
            .set_read_timeout(None)
            .map_err(|e| e.to_string())?;
        self.start_control(peer, ctrl)?;
        // Silence is measured from here: a slow setup is not a missed heartbeat.
        peer.last_recv_ms.store(node.now_ms(), Ordering::Relaxed);
        peer.set_ready();
        crate::log!(node.log, Info, "connected to {}", peer.name);
        Ok(())
    }

    /// Starts the reader of data connection `d` of `peer`: the engine serves it, and its
    /// end loses the peer.
    fn serve_data(self: &Arc<Self>, peer: &Arc<Peer>, d: TcpStream, open: Option<Opener>) {
        let (control, p) = (self.clone(), peer.clone());
        self.spawn_for_peer("kvxfer-recv", peer, move || {
            let why = match control.events() {
                Some(events) => events.serve_data(&p, d, open),
                None => "engine shut down".to_string(),
            };
            control.lose(&p, why);
        });
    }
}
