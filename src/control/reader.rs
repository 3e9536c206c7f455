//! A peer's control connection once set up: its writer thread (the peer's control
//! queue, with a stall limit) and its reader thread, which checks that each message is
//! one this engine's role may receive and hands it to the engine.

use std::io::Read;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Control, Events, Peer};
use crate::proto::{self, FrameHeader, Message, ReadError, WireTransport};
use crate::tls::{Split, Wire};
use crate::transport::tcp::SendConn;
use crate::Role;

/// The writing half of a control connection.
enum CtrlWriter {
    Plain(Arc<SendConn>),
    Tls(crate::tls::Writer),
}

impl CtrlWriter {
    fn send_frame(&self, frame: &[u8]) -> std::io::Result<()> {
        match self {
            CtrlWriter::Plain(c) => c.send_frame(frame),
            CtrlWriter::Tls(w) => w.send_frame(frame),
        }
    }
}

impl Control {
    /// Starts the control writer thread and the control reader thread of `peer`.
    pub(super) fn start_control(
        self: &Arc<Self>,
        peer: &Arc<Peer>,
        ctrl: Wire,
    ) -> Result<(), String> {
        if peer.is_lost() {
            return Err("lost during setup".to_string());
        }
        // A peer that stops reading its control connection (while it may keep sending,
        // which keeps its heartbeat fresh) is lost once a write makes no progress for
        // as long as a silent peer is allowed.
        let stall = self.node.peer_deadline();
        let (conn, reader) = match ctrl.split().map_err(|e| e.to_string())? {
            Split::Plain(s) => {
                let writer = s.try_clone().map_err(|e| e.to_string())?;
                let conn =
                    Arc::new(SendConn::with_stall(writer, stall).map_err(|e| e.to_string())?);
                peer.ctrl.write_directly(conn.clone());
                (CtrlWriter::Plain(conn), Box::new(s) as Box<dyn Read + Send>)
            }
            Split::Tls(reader, writer) => {
                writer.set_stall(stall).map_err(|e| e.to_string())?;
                (
                    CtrlWriter::Tls(writer),
                    Box::new(reader) as Box<dyn Read + Send>,
                )
            }
        };
        let (control, p) = (self.clone(), peer.clone());
        self.spawn_for_peer("kvxfer-ctrl-tx", peer, move || {
            while let Some(frame) = p.ctrl.pop() {
                let r = conn.send_frame(&frame);
                p.ctrl.written();
                if let Err(e) = r {
                    control.lose(
                        &p,
                        format!(
                            "control write failed: {e} (no progress for up to {} ms)",
                            stall.as_millis()
                        ),
                    );
                    break;
                }
                p.last_sent_ms
                    .store(control.node.now_ms(), Ordering::Relaxed);
            }
        });
        let (control, p) = (self.clone(), peer.clone());
        self.spawn_for_peer("kvxfer-ctrl-rx", peer, move || {
            control.control_reader(&p, reader)
        });
        Ok(())
    }

    fn control_reader(&self, peer: &Arc<Peer>, mut s: Box<dyn Read + Send>) {
        let node = &self.node;
        loop {
            let r = proto::read_frame_header(&mut s, &node.limits).and_then(|hdr: FrameHeader| {
                if !hdr.kind.is_control() {
                    return Err(ReadError::Io(std::io::Error::other(format!(
                        "{} frame on the control connection",
                        hdr.kind.name()
                    ))));
                }
                proto::read_control(&mut s, &hdr, &node.limits)
            });
            let why = match r {
                Ok(msg) => {
                    peer.last_recv_ms.store(node.now_ms(), Ordering::Relaxed);
                    let Some(events) = self.events() else { return };
                    let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.dispatch(&*events, peer, msg)
                    }));
                    match handled {
                        Ok(Ok(())) => continue,
                        Ok(Err(why)) => {
                            node.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                            format!("protocol error: {why}")
                        }
                        Err(_) => "internal error handling a control frame".into(),
                    }
                }
                Err(ReadError::Closed) => "connection closed".into(),
                Err(ReadError::Proto(e)) => {
                    node.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    format!("malformed frame: {e}")
                }
                Err(e) => format!("control read failed: {e}"),
            };
            return self.lose(peer, why);
        }
    }

    /// One control message: handled here (heartbeats, queue-pair replacements) or by the
    /// engine, if this engine's role may receive it; a protocol error otherwise.
    fn dispatch(&self, events: &dyn Events, peer: &Arc<Peer>, msg: Message) -> Result<(), String> {
        let rdma = self.node.rdma.is_some();
        match (msg, self.node.role) {
            (Message::Heartbeat { .. }, _) => {}
            (
                Message::Destination {
                    room,
                    generation,
                    pages,
                    aux_slot,
                },
                Role::Prefill,
            ) => events.destination(peer, room, generation, pages, aux_slot),
            (
                Message::Abort {
                    room,
                    generation,
                    reason,
                },
                _,
            ) => events.abort(peer, room, generation, reason),
            (Message::AbortAck { room, generation }, Role::Decode) => {
                crate::log!(
                    self.node.log,
                    Debug,
                    "{} acknowledged the abort of room {room} (gen {generation})",
                    peer.name
                );
                events.abort_ack(peer, room, generation)
            }
            (
                Message::Transport {
                    transport: WireTransport::Rdma,
                    qps,
                },
                _,
            ) if rdma => self.on_reconnect(peer, &qps)?,
            (
                Message::Progress {
                    room,
                    generation,
                    aux_rows,
                    bytes,
                    kv,
                    runs,
                },
                Role::Decode,
            ) if rdma => events.progress(
                peer,
                super::Progress {
                    room,
                    generation,
                    aux_rows,
                    bytes,
                    kv,
                    runs,
                },
            ),
            (
                Message::Done {
                    room,
                    generation,
                    pages_sent,
                    aux_sent,
                },
                Role::Decode,
            ) if rdma => events.done(peer, room, generation, pages_sent, aux_sent),
            (Message::SameHost(theirs), Role::Prefill) if !rdma => {
                self.on_same_host(peer, theirs)?
            }
            (Message::PathChoice { same_host, why }, Role::Prefill) if !rdma => {
                self.on_path_choice(peer, same_host, why)?
            }
            (m, role) => {
                return Err(format!(
                    "unexpected {} message on a {role} engine's control connection",
                    m.kind().name()
                ))
            }
        }
        Ok(())
    }
}
