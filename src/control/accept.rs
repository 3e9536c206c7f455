//! Prefill side: accepting decode engines' connections, each set up on a thread of its
//! own: authentication first, then the control connection's setup or a data connection.

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::admission::MAX_PEERS;
use super::{panic_message, Control, Path, Peer, SetupError};
use crate::config::MAX_CONNECTIONS_PER_PEER;
use crate::proto::{ConnKind, Message, SameHostSetting};
use crate::transport::copy_link::CopyLink;
use crate::transport::tcp::seal::SealedConn;
use crate::transport::tcp::SendConn;
use crate::transport::DataLink;

impl Control {
    /// Accepts connections until the engine stops, asleep while none is waiting.
    pub fn accept_loop(self: &Arc<Self>, listener: TcpListener) {
        let node = &self.node;
        if let Err(e) = listener.set_nonblocking(true) {
            crate::log!(node.log, Error, "listener: {e}");
            return;
        }
        while !node.is_stopping() {
            match listener.accept() {
                Ok((s, from)) => {
                    let control = self.clone();
                    let token = self.handshaking.track(&s);
                    let started = node.spawn("kvxfer-accept", move || {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_nodelay(true);
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            control.incoming(s)
                        }))
                        .unwrap_or_else(|e| {
                            Err(format!(
                                "internal error: the handshake panicked: {}",
                                panic_message(&*e)
                            ))
                        });
                        control.handshaking.untrack(token);
                        if let Err(why) = r {
                            control
                                .node
                                .metrics
                                .protocol_errors
                                .fetch_add(1, Ordering::Relaxed);
                            crate::log!(
                                control.node.log,
                                Warn,
                                "rejected connection from {from}: {why}"
                            );
                        }
                    });
                    if let Err(e) = started {
                        // The connection is closed with the closure that held it.
                        self.handshaking.untrack(token);
                        crate::log!(node.log, Error, "connection from {from} dropped: {e}");
                    }
                }
                // Nothing waiting: sleep until a connection is (or the engine stops).
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    node.wait_readable(listener.as_raw_fd())
                }
                Err(e) => {
                    crate::log!(node.log, Warn, "accept failed: {e}");
                    // Out of descriptors, say: the listener stays readable, so wait a
                    // little instead of spinning on it.
                    node.sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// An accepted connection: handshake, then control (registration, reader) or data.
    fn incoming(self: &Arc<Self>, s: TcpStream) -> Result<(), String> {
        let node = &self.node;
        if node.role != crate::Role::Prefill {
            return Err("decode engines accept no connections".into());
        }
        let addr = s.peer_addr().ok();
        let from = addr.map(|a| a.to_string()).unwrap_or_default();
        s.set_read_timeout(Some(node.bootstrap_timeout()))
            .map_err(|e| e.to_string())?;
        let Some(admitted) = self.admit(s)? else {
            return Ok(()); // refused: counted and logged by admit; dropping it closes it
        };
        let (engine_id, conn, index) = (admitted.engine_id, admitted.conn, admitted.index);
        let mut s = admitted.wire;
        let key = format!("{engine_id:016x}");
        match conn {
            ConnKind::Control => {
                if node.memory.kv.get().is_none() {
                    return Err("this prefill engine has not registered its KV buffers yet".into());
                }
                node.memory.seal();
                let peer = Peer::of_engine(
                    engine_id,
                    format!("decode engine {key} at {from}"),
                    node.now_ms(),
                    node.log.clone(),
                );
                // Known before our Registration goes out: the decode engine opens its data
                // connections as soon as it has read it, and they must find this peer.
                let old = {
                    let mut peers = self.peers.lock();
                    if !peers.contains_key(&key) && peers.len() >= MAX_PEERS {
                        drop(peers);
                        self.gate.forget_session(engine_id);
                        self.over_limit(
                            addr,
                            &format!(
                                "decode engine {key} at {from}: this prefill engine already \
                                 serves {MAX_PEERS} decode engines, the most it serves at once"
                            ),
                        );
                        return Ok(()); // dropping the connection closes it
                    }
                    peers.insert(key, peer.clone())
                };
                peer.track(s.tcp());
                if let Some(old) = old {
                    self.lose(
                        &old,
                        "replaced by a new connection from the same engine".into(),
                    );
                }
                let setup = (|| -> Result<(), SetupError> {
                    self.write_msg(&mut s, &self.hello(ConnKind::Control, 0))?;
                    self.write_msg(&mut s, &Message::Registration(self.registration(None)))?;
                    let theirs = self.expect_registration(&mut s)?;
                    let pairing = self.check_registration(&peer.name, &theirs)?;
                    peer.set_pairing(pairing.clone());
                    self.prefill_transport(&peer, &mut s, &theirs, &pairing.map)?;
                    s.tcp().set_read_timeout(None).map_err(|e| e.to_string())?;
                    Ok(self.start_control(&peer, s)?)
                })();
                if let Err(e) = setup {
                    self.lose_with(&peer, e.cause, e.why.clone());
                    return Err(e.why);
                }
                // Silence is measured from here: a slow setup is not a missed heartbeat.
                peer.last_recv_ms.store(node.now_ms(), Ordering::Relaxed);
                peer.set_ready();
                crate::log!(node.log, Info, "accepted {}", peer.name);
                Ok(())
            }
            ConnKind::Data => {
                let peer =
                    self.peers.lock().get(&key).cloned().ok_or_else(|| {
                        format!("data connection {index} from unknown engine {key}")
                    })?;
                if node.rdma.is_some() {
                    return Err(format!(
                        "data connection {index} from {key}: this engine moves data over RDMA"
                    ));
                }
                // At most one live link per index, and indices below the most a decode
                // engine opens: at most MAX_CONNECTIONS_PER_PEER links (and their sender
                // threads) per decode engine, whatever it sends.
                if usize::from(index) >= MAX_CONNECTIONS_PER_PEER {
                    self.over_limit(
                        addr,
                        &format!(
                            "data connection {index} from decode engine {key} at {from}: \
                             indices go up to {} (connections_per_peer is at most \
                             {MAX_CONNECTIONS_PER_PEER})",
                            MAX_CONNECTIONS_PER_PEER - 1
                        ),
                    );
                    return Ok(()); // dropping the connection closes it
                }
                // Checked and claimed under one lock, so that two connections with one
                // index cannot both get in.
                let mut live = peer.data_index.lock();
                let taken = live
                    .get(&index)
                    .and_then(std::sync::Weak::upgrade)
                    .is_some_and(|l| !l.is_broken());
                if taken {
                    drop(live);
                    self.over_limit(
                        addr,
                        &format!(
                            "data connection {index} from decode engine {key} at {from}: \
                             its data connection {index} is already up"
                        ),
                    );
                    return Ok(()); // dropping the connection closes it
                }
                peer.track(s.tcp());
                let w = s.tcp().try_clone().map_err(|e| e.to_string())?;
                let stall = node.peer_deadline();
                if peer.path.get().is_none() {
                    // No same-host offer came before the data connections: TCP, unless
                    // we require the same-host path.
                    if node.config.same_host == SameHostSetting::Require {
                        // Refused in place of our Hello: the decode engine fails its
                        // rooms with the reason.
                        let why = format!(
                            "same_host=require on the prefill engine, but {} did not offer \
                             the same-host path (it has same_host=off)",
                            peer.name
                        );
                        let refused = Message::PathChoice {
                            same_host: false,
                            why: why.clone(),
                        };
                        let _ = self.write_msg(&mut s, &refused);
                        return Err(why);
                    }
                    self.paired(&peer, Path::Tcp, Some("no same-host offer"), false);
                }
                let same_host = matches!(
                    peer.path.get(),
                    Some(Path::SameHost { .. } | Path::CudaIpc { .. })
                );
                let link: Arc<dyn DataLink> = match admitted.secret.filter(|_| self.encrypts_data())
                {
                    // Only run headers travel: the decode engine copies the bytes.
                    _ if same_host => Arc::new(CopyLink::new(w, stall, node.limits, |f| {
                        node.spawn("kvxfer-copied", f).map_err(|e| e.to_string())
                    })?),
                    Some(secret) => {
                        Arc::new(SealedConn::new(w, stall, &secret).map_err(|e| e.to_string())?)
                    }
                    None if self.encrypts_data() => {
                        return Err(format!(
                        "data connection {index} from {key}: encrypt_data=true but it proved no \
                             secret"
                    ))
                    }
                    None => Arc::new(SendConn::data(w, stall).map_err(|e| e.to_string())?),
                };
                live.insert(index, Arc::downgrade(&link));
                drop(live);
                // The link is up before our Hello answers the decode engine: once it has
                // every answer it is ready and sends destinations, and a chunk planned
                // for one of them must find the link (nothing goes out on it before a
                // destination, so the answer still comes first on the wire).
                peer.data.write().push(link.clone());
                if peer.is_lost() {
                    peer.data.write().clear();
                    return Ok(());
                }
                #[cfg(feature = "test-hooks")]
                crate::testing::pause_point(
                    "accept.link_up",
                    crate::testing::port_key(&node.address),
                );
                if let Some(events) = self.events() {
                    events.link_up(&peer, link);
                }
                self.write_msg(&mut s, &self.hello(ConnKind::Data, index))?;
                #[cfg(feature = "test-hooks")]
                crate::testing::pause_point(
                    "accept.data_answered",
                    crate::testing::port_key(&node.address),
                );
                Ok(())
            }
        }
    }
}
