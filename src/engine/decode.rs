//! The decode (receiving) side: destinations sent to the prefill engines, data frames read
//! straight into granted pages, and completion when every prefill engine is done.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::peer::Peer;
use super::{ERoom, RoomExt, Shared};
use crate::error::Result;
use crate::proto::{self, DataHeader, Kind, Message, ReadError, Target};
use crate::room::{Cause, Event, FailureReason, State};
use crate::transport::tcp;

/// Read buffer of a data connection: headers and small frames (a few KiB per page on
/// small models) come out of one `recv` per buffer-full instead of three per frame.
/// Payload reads at least this long bypass it and land straight in the pages.
const READ_BUFFER: usize = 64 * 1024;

/// A data connection as the receiver reads it.
type DataStream = BufReader<TcpStream>;

pub(crate) struct DecodeRoom {
    /// The prefill engines the room pulls from.
    pub peers: Vec<Arc<Peer>>,
    inner: Mutex<DecodeState>,
}

#[derive(Default)]
struct DecodeState {
    dest: Option<Destination>,
    /// The destination went out to the peers.
    sent: bool,
    /// Per peer (same order as `peers`): KV page-writes received, aux rows received, done.
    progress: Vec<Progress>,
    /// RDMA, per peer: it can write into the room no more (it acknowledged the abort, or
    /// its queue pairs are shut).
    quiet: Vec<bool>,
    /// RDMA: engine-clock ms after which a failed room's silent peers are cut off.
    drain_deadline_ms: Option<u64>,
}

#[derive(Default, Clone, Copy)]
struct Progress {
    kv_pages: u64,
    aux_rows: u64,
    /// The peer's Done arrived: the pages it says it sent and whether it sent aux rows.
    /// Over TCP the room's last frames may still be on another data connection.
    claim: Option<(u32, bool)>,
    done: bool,
}

/// What a peer's Done claim comes to, given what has arrived so far.
enum Settle {
    Fail(String),
    /// Frames the claim counts are still on their way (another data connection).
    Wait,
    Done,
}

struct Destination {
    pages: Arc<[u32]>,
    /// page → position in `pages`.
    pos: HashMap<u32, u32>,
    aux: Option<u32>,
}

impl DecodeRoom {
    pub fn new(peers: Vec<Arc<Peer>>) -> Self {
        let n = peers.len();
        DecodeRoom {
            peers,
            inner: Mutex::new(DecodeState {
                progress: vec![Progress::default(); n],
                quiet: vec![false; n],
                ..Default::default()
            }),
        }
    }
}

/// Reads `dst.len()` payload bytes: first what the buffer already holds, then (for a
/// rest at least as long as the buffer) straight from the socket into `dst`, so large
/// payloads are copied once, by the kernel, as without the buffer; a shorter rest goes
/// through the buffer, which then also picks up the frames behind it. `stop` (the room
/// went terminal) is asked before anything is written into `dst` and after every
/// straight read: once it says so, nothing more is. Returns how many bytes were read into `dst`; the caller
/// discards the rest of the payload.
///
/// One `recv` per payload when the socket holds it, as in a plain stream: checking the
/// room every 256 KiB instead made 13 times the stream's `recv` calls per GB. A `recv`
/// returns as soon as any bytes arrive, so however slow the link, a room that ends
/// stops taking bytes at the next arrival.
fn read_payload(s: &mut DataStream, dst: &mut [u8], stop: &dyn Fn() -> bool) -> io::Result<usize> {
    if stop() {
        return Ok(0);
    }
    let have = s.buffer().len().min(dst.len());
    dst[..have].copy_from_slice(&s.buffer()[..have]);
    s.consume(have);
    let mut filled = have;
    if dst.len() - filled < s.capacity() {
        s.read_exact(&mut dst[filled..])?;
        return Ok(dst.len());
    }
    // The buffer is empty here (it held less than `dst`), so bypassing it keeps the byte
    // order.
    while filled < dst.len() {
        if stop() {
            break;
        }
        match s.get_mut().read(&mut dst[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn ext(room: &ERoom) -> Option<&DecodeRoom> {
    match &room.ext {
        RoomExt::Decode(d) => Some(d),
        RoomExt::Prefill(_) => None,
    }
}

/// Why a data frame was refused: the peer broke the protocol (close the connection) or
/// the room simply cannot take it any more (discard the bytes).
enum Refuse {
    Protocol(String),
    Discard,
}

impl Shared {
    /// Moves a room whose peers are all connected to WAITING_FOR_INPUT, and sends its
    /// destination if the scheduler already gave it.
    pub(crate) fn decode_try_ready(&self, room: &Arc<ERoom>) {
        let Some(d) = ext(room) else { return };
        if !d.peers.iter().all(|p| p.is_ready()) {
            return;
        }
        let n_kv = self.kv.get().map_or(0, |m| m.buffers().len());
        let maps: Vec<&[u32]> = d
            .peers
            .iter()
            .map(|p| p.kv_map.get().map_or(&[][..], |m| &m[..]))
            .collect();
        if let Err(why) = super::pairing::check_coverage(n_kv, &maps) {
            self.fail_room(
                room,
                FailureReason::local(Cause::Mismatch, format!("room {}: {why}", room.id())),
                None,
            );
            return;
        }
        if room.state() == State::Bootstrapping {
            self.arm(room, State::WaitingForInput);
            let _ = room.advance(Event::Ready);
        }
        self.decode_send_destination(room);
    }

    pub(crate) fn decode_set_destination(
        &self,
        room: &Arc<ERoom>,
        pages: &[u32],
        aux: Option<u32>,
    ) -> Result<()> {
        let d = ext(room).expect("decode engine rooms are decode rooms");
        {
            let mut st = d.inner.lock();
            if st.dest.is_some() {
                return Err(crate::err!(
                    WrongState,
                    "room {} already has its destination",
                    room.id()
                ));
            }
            st.dest = Some(Destination {
                pages: pages.into(),
                pos: pages
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| (p, i as u32))
                    .collect(),
                aux,
            });
        }
        if room.state() == State::WaitingForInput {
            // Fresh deadline: waiting now means waiting for the prefill's data.
            self.arm(room, State::WaitingForInput);
        }
        self.decode_send_destination(room);
        // Nothing to receive (no pages, no aux slot) still completes only on every
        // prefill's Done.
        Ok(())
    }

    /// Sends the destination to every peer, once, when both it and the peers are ready.
    fn decode_send_destination(&self, room: &Arc<ERoom>) {
        let Some(d) = ext(room) else { return };
        if room.state() != State::WaitingForInput {
            return;
        }
        let msg = {
            let mut st = d.inner.lock();
            let Some(dest) = st.dest.as_ref() else { return };
            if st.sent {
                return;
            }
            let msg = Message::Destination {
                room: room.id(),
                generation: room.generation(),
                pages: dest.pages.to_vec(),
                aux_slot: dest.aux,
            };
            st.sent = true;
            msg
        };
        for p in &d.peers {
            p.send(self, &msg);
        }
    }

    /// One data connection from a prefill engine: frames are read and written into the
    /// granted pages until the connection ends.
    pub(crate) fn data_reader(&self, peer: &Arc<Peer>, s: TcpStream) {
        let mut s = BufReader::with_capacity(READ_BUFFER, s);
        let why = loop {
            let hdr = match proto::read_frame_header(&mut s, &self.limits) {
                Ok(h) => h,
                Err(ReadError::Closed) => break "data connection closed".to_string(),
                Err(ReadError::Proto(e)) => {
                    self.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    break format!("malformed frame: {e}");
                }
                Err(e) => break format!("data read failed: {e}"),
            };
            peer.last_recv_ms.store(self.now_ms(), Ordering::Relaxed);
            let r = match hdr.kind {
                Kind::Data => proto::read_data_header(&mut s, &hdr, &self.limits)
                    .map_err(|e| e.to_string())
                    .and_then(|dh| self.on_data(peer, &mut s, &dh)),
                Kind::Done => match proto::read_control(&mut s, &hdr, &self.limits) {
                    Ok(Message::Done {
                        room,
                        generation,
                        pages_sent,
                        aux_sent,
                    }) => {
                        self.on_done(peer, room, generation, pages_sent, aux_sent);
                        Ok(())
                    }
                    Ok(_) => Err("Done frame decoded as another kind".into()),
                    Err(e) => Err(e.to_string()),
                },
                k => Err(format!(
                    "unexpected {} frame on a data connection",
                    k.name()
                )),
            };
            if let Err(why) = r {
                self.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                break why;
            }
        };
        self.lose_peer(peer, why);
    }

    /// Validates one data frame against the room's grant and reads its bytes into the
    /// pages (or discards them). `Err` means the connection must close.
    fn on_data(
        &self,
        peer: &Arc<Peer>,
        s: &mut DataStream,
        h: &DataHeader,
    ) -> std::result::Result<(), String> {
        let room = self.rooms.get_generation(h.room, h.generation);
        let target = match room.as_ref() {
            None => Err(Refuse::Discard),
            Some(room) => self.check_data(peer, room, h),
        };
        let (room, buffer, idx) = match target {
            Ok(t) => t,
            Err(Refuse::Discard) => {
                self.metrics.dropped_frames.fetch_add(1, Ordering::Relaxed);
                return tcp::discard(s, h.byte_len as u64).map_err(|e| e.to_string());
            }
            Err(Refuse::Protocol(why)) => {
                if let Some(room) = room.as_ref() {
                    self.fail_room(
                        room,
                        FailureReason::local(Cause::Protocol, format!("{} sent {why}", peer.name)),
                        None,
                    );
                }
                return Err(why);
            }
        };
        let mem = match h.target {
            Target::Kv => self.kv.get(),
            Target::Aux => self.aux.get(),
        }
        .expect("checked");
        let io = room.begin_io();
        // Checked after announcing the write (begin_io): once the room is terminal,
        // nothing more lands in its pages, and clear waits for a read in progress.
        let r = mem
            .pages_mut(buffer as usize, h.first_page, h.n_pages)
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|dst| read_payload(s, dst, &|| room.state().is_terminal()));
        drop(io);
        let read = r.map_err(|e| format!("data read failed: {e}"))?;
        let written = read == h.byte_len as usize;
        if !written {
            // The room ended: the rest of the frame goes nowhere.
            tcp::discard(s, (h.byte_len as usize - read) as u64)
                .map_err(|e| format!("data read failed: {e}"))?;
        }
        self.metrics
            .bytes_received
            .fetch_add(h.byte_len as u64, Ordering::Relaxed);
        if written {
            match h.target {
                Target::Kv => self.decode_count(peer, &room, idx, h.n_pages as u64, 0),
                Target::Aux => self.decode_count(peer, &room, idx, 0, 1),
            }
        }
        Ok(())
    }

    /// Counts page writes and aux rows of peer `idx` that landed in the room's pages
    /// (a TCP frame read, or an RDMA batch completed), re-arms the room's no-progress
    /// deadline, and completes the room if the peer's Done was only waiting for them.
    fn decode_count(
        &self,
        peer: &Arc<Peer>,
        room: &Arc<ERoom>,
        idx: usize,
        kv_pages: u64,
        aux_rows: u64,
    ) {
        let Some(d) = ext(room) else { return };
        let claimed = {
            let mut st = d.inner.lock();
            let pr = &mut st.progress[idx];
            pr.kv_pages += kv_pages;
            pr.aux_rows += aux_rows;
            pr.claim.is_some()
        };
        room.set_deadline_ms(self.now_ms() + self.config.transfer_timeout_ms);
        if claimed {
            self.decode_settle(peer, room, idx);
        }
    }

    /// Checks a data frame: the room pulls from this peer, is live, has a destination,
    /// and the frame's pages are granted to it, in registered buffers, with the right
    /// length. Returns the room, our buffer the frame fills, and the peer's position.
    fn check_data(
        &self,
        peer: &Arc<Peer>,
        room: &Arc<ERoom>,
        h: &DataHeader,
    ) -> std::result::Result<(Arc<ERoom>, u32, usize), Refuse> {
        let proto_err =
            |why: String| Refuse::Protocol(format!("a bad data frame for room {}: {why}", h.room));
        let d = ext(room).ok_or(Refuse::Discard)?;
        let Some(idx) = d.peers.iter().position(|p| Arc::ptr_eq(p, peer)) else {
            return Err(proto_err("the room does not pull from this engine".into()));
        };
        if room.state().is_terminal() {
            return Err(Refuse::Discard);
        }
        let (mem, what, local) = match h.target {
            Target::Kv => (
                self.kv.get(),
                "kv",
                peer.kv_map
                    .get()
                    .and_then(|m| m.get(h.buffer as usize).copied()),
            ),
            Target::Aux => (self.aux.get(), "aux", Some(h.buffer)),
        };
        let item_len = local
            .and_then(|b| mem.and_then(|m| m.item_len(b as usize)))
            .ok_or_else(|| proto_err(format!("{what} buffer {} is not registered", h.buffer)))?;
        if h.byte_len as u64 != h.n_pages as u64 * item_len as u64 {
            return Err(proto_err(format!(
                "{} bytes for {} pages of {item_len}",
                h.byte_len, h.n_pages
            )));
        }
        {
            let st = d.inner.lock();
            let dest = st
                .dest
                .as_ref()
                .ok_or_else(|| proto_err("no destination was sent".into()))?;
            match h.target {
                Target::Kv => {
                    let pos = *dest.pos.get(&h.first_page).ok_or_else(|| {
                        proto_err(format!("page {} was not granted", h.first_page))
                    })? as usize;
                    let end = pos + h.n_pages as usize;
                    let granted = end <= dest.pages.len()
                        && dest.pages[pos..end]
                            .iter()
                            .enumerate()
                            .all(|(i, &p)| p as u64 == h.first_page as u64 + i as u64);
                    if !granted {
                        return Err(proto_err(format!(
                            "pages {}..{} were not granted",
                            h.first_page,
                            h.first_page as u64 + h.n_pages as u64
                        )));
                    }
                }
                Target::Aux => {
                    if dest.aux != Some(h.first_page) || h.n_pages != 1 {
                        return Err(proto_err(format!(
                            "aux slot {} was not granted",
                            h.first_page
                        )));
                    }
                }
            }
        }
        // Progress: re-arm before entering (or staying in) TRANSFERRING, so the watchdog
        // never sees the new state with the old state's deadline.
        room.set_deadline_ms(self.now_ms() + self.config.transfer_timeout_ms);
        let _ = room.advance(Event::Start);
        Ok((room.clone(), local.unwrap_or(h.buffer), idx))
    }

    /// A prefill engine's Done: its claim is checked against what arrived (see
    /// [`Shared::decode_settle`]), and the room completes when every prefill engine is
    /// done.
    pub(crate) fn on_done(
        &self,
        peer: &Arc<Peer>,
        id: u64,
        generation: u64,
        pages_sent: u32,
        aux_sent: bool,
    ) {
        let Some((room, idx)) = self.decode_room_of(peer, id, generation) else {
            return;
        };
        let Some(d) = ext(&room) else { return };
        d.inner.lock().progress[idx].claim = Some((pages_sent, aux_sent));
        self.decode_settle(peer, &room, idx);
    }

    /// Completes the room (or fails it) once peer `idx`'s Done claim and every frame it
    /// counts have arrived. Over RDMA, progress and Done come in order on the control
    /// connection, so a claim short of what arrived is a broken promise at once; over
    /// TCP the missing frames may still be on another data connection, and the room's
    /// transfer deadline bounds the wait.
    fn decode_settle(&self, peer: &Arc<Peer>, room: &Arc<ERoom>, idx: usize) {
        let Some(d) = ext(room) else { return };
        let n_kv = peer.kv_map.get().map_or(0, Vec::len) as u64;
        let n_aux = peer.aux_count.get().copied().unwrap_or(0) as u64;
        let any_aux = d
            .peers
            .iter()
            .any(|p| p.aux_count.get().copied().unwrap_or(0) > 0);
        let ordered = self.rdma.is_some();
        let (verdict, all_done) = {
            let mut st = d.inner.lock();
            let pr = st.progress[idx];
            let Some((pages_sent, aux_sent)) = pr.claim else {
                return;
            };
            if pr.done {
                return;
            }
            let (want_pages, want_aux) = match &st.dest {
                Some(dest) => (dest.pages.len() as u64, dest.aux.is_some()),
                None => (0, false),
            };
            let want_writes = want_pages * n_kv;
            let want_rows = if want_aux { n_aux } else { 0 };
            let verdict = if pages_sent as u64 != want_pages {
                Settle::Fail(format!(
                    "{} sent {pages_sent} pages for a destination of {want_pages}",
                    peer.name
                ))
            } else if want_aux && !any_aux {
                Settle::Fail(
                    "the destination has an aux slot but no prefill engine registered aux buffers"
                        .to_string(),
                )
            } else if want_aux && n_aux > 0 && !aux_sent {
                Settle::Fail(format!("{} did not send the aux rows", peer.name))
            } else if pr.kv_pages > want_writes || pr.aux_rows > want_rows {
                Settle::Fail(format!(
                    "{} wrote {} page writes and {} aux rows for {want_writes} and {want_rows}",
                    peer.name, pr.kv_pages, pr.aux_rows
                ))
            } else if pr.kv_pages < want_writes || pr.aux_rows < want_rows {
                if ordered {
                    Settle::Fail(format!(
                        "{} reported done after {} of {want_writes} page writes and {} of \
                         {want_rows} aux rows",
                        peer.name, pr.kv_pages, pr.aux_rows
                    ))
                } else {
                    Settle::Wait
                }
            } else {
                st.progress[idx].done = true;
                Settle::Done
            };
            (verdict, st.progress.iter().all(|p| p.done))
        };
        match verdict {
            Settle::Fail(why) => {
                self.fail_room(
                    room,
                    FailureReason::local(Cause::Mismatch, format!("room {}: {why}", room.id())),
                    None,
                );
            }
            Settle::Done if all_done => {
                if room.advance(Event::Complete).is_ok() {
                    self.metrics.succeeded();
                    crate::log!(self.log, Debug, "room {} received", room.id());
                }
            }
            Settle::Done | Settle::Wait => {}
        }
    }

    /// For a transfer timeout's message: the peers whose Done arrived while frames it
    /// counts never did.
    pub(crate) fn decode_missing(&self, room: &ERoom) -> Option<String> {
        let d = ext(room)?;
        let st = d.inner.lock();
        let missing: Vec<String> = d
            .peers
            .iter()
            .zip(&st.progress)
            .filter(|(_, pr)| pr.claim.is_some() && !pr.done)
            .map(|(p, pr)| {
                format!(
                    "{} reported done but only {} page writes and {} aux rows arrived",
                    p.name, pr.kv_pages, pr.aux_rows
                )
            })
            .collect();
        (!missing.is_empty()).then(|| missing.join("; "))
    }

    /// Whether no peer can still write into a decode room's pages over RDMA: the room
    /// succeeded (every write completed before Done), its destination never went out, or
    /// every peer acknowledged the abort or was cut off. Always true over TCP, where the
    /// receiver itself refuses late bytes, and on the prefill side.
    pub(crate) fn decode_quiet(&self, room: &ERoom) -> bool {
        if self.rdma.is_none() || room.state() == State::Success {
            return true;
        }
        let Some(d) = ext(room) else { return true };
        let st = d.inner.lock();
        !st.sent || st.quiet.iter().all(|&q| q)
    }

    /// `peer` can no longer write into `room` (decode side).
    pub(crate) fn decode_peer_quiet(&self, room: &ERoom, peer: &Arc<Peer>) {
        let Some(d) = ext(room) else { return };
        if let Some(i) = d.peers.iter().position(|p| Arc::ptr_eq(p, peer)) {
            d.inner.lock().quiet[i] = true;
        }
    }

    /// A prefill engine's AbortAck: its writes into the room have all completed.
    pub(crate) fn decode_on_abort_ack(&self, peer: &Arc<Peer>, id: u64, generation: u64) {
        if let Some(room) = self.rooms.get_generation(id, generation) {
            self.decode_peer_quiet(&room, peer);
        }
    }

    /// The decode room a prefill engine's message names, and that engine's position in
    /// it; an unknown room (or generation) is counted.
    fn decode_room_of(
        &self,
        peer: &Arc<Peer>,
        id: u64,
        generation: u64,
    ) -> Option<(Arc<ERoom>, usize)> {
        let Some(room) = self.rooms.get_generation(id, generation) else {
            self.metrics
                .unknown_room_frames
                .fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let idx = ext(&room)?
            .peers
            .iter()
            .position(|p| Arc::ptr_eq(p, peer))?;
        Some((room, idx))
    }

    /// RDMA: a prefill engine's writes of one batch of the room completed. Counts them
    /// as TCP data frames are counted ([`Shared::decode_count`]).
    pub(crate) fn decode_on_progress(
        &self,
        peer: &Arc<Peer>,
        id: u64,
        generation: u64,
        (pages, aux_rows, bytes): (u32, u32, u64),
    ) {
        let Some((room, idx)) = self.decode_room_of(peer, id, generation) else {
            return;
        };
        let Some(d) = ext(&room) else { return };
        if room.state().is_terminal() {
            return;
        }
        if !d.inner.lock().sent {
            self.fail_room(
                &room,
                FailureReason::local(
                    Cause::Mismatch,
                    format!(
                        "room {id}: {} wrote before it had the destination",
                        peer.name
                    ),
                ),
                None,
            );
            return;
        }
        self.metrics
            .bytes_received
            .fetch_add(bytes, Ordering::Relaxed);
        self.decode_count(peer, &room, idx, pages as u64, aux_rows as u64);
        let _ = room.advance(Event::Start);
    }

    /// Watchdog duty over RDMA: a failed decode room whose peers have not all
    /// acknowledged within `drain_timeout_ms` has those peers cut off (their queue pairs
    /// shut), so that it drains and no late write can land in its pages.
    pub(crate) fn decode_drain_deadline(&self, room: &ERoom, now: u64) {
        if self.rdma.is_none() || room.state() != State::Failed || self.decode_quiet(room) {
            return;
        }
        let Some(d) = ext(room) else { return };
        let silent: Vec<Arc<Peer>> = {
            let mut st = d.inner.lock();
            let deadline = *st
                .drain_deadline_ms
                .get_or_insert(now.saturating_add(self.config.drain_timeout_ms));
            if now < deadline {
                return;
            }
            d.peers
                .iter()
                .zip(&st.quiet)
                .filter(|(_, &q)| !q)
                .map(|(p, _)| p.clone())
                .collect()
        };
        for p in silent {
            self.lose_peer(
                &p,
                format!(
                    "no acknowledgement of the abort of room {} within drain_timeout_ms={}",
                    room.id(),
                    self.config.drain_timeout_ms
                ),
            );
            self.decode_peer_quiet(room, &p);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;

    /// Mixed small and large payload reads through the buffer come out in stream order,
    /// and `discard` through the buffer skips exactly its bytes.
    #[test]
    fn buffered_payload_reads_keep_the_byte_order() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let sizes = [
            16usize,
            40,
            4096,
            3 * READ_BUFFER + 7,
            100,
            READ_BUFFER,
            1,
            300_000,
        ];
        let total: usize = sizes.iter().sum::<usize>() + 5000;
        let bytes: Vec<u8> = (0..total).map(|i| (i * 7 + i / 251) as u8).collect();
        let send = bytes.clone();
        let writer = std::thread::spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            // Odd-sized writes so that reads straddle what the buffer holds.
            for part in send.chunks(10_007) {
                c.write_all(part).unwrap();
            }
        });
        let (s, _) = l.accept().unwrap();
        let mut s = BufReader::with_capacity(READ_BUFFER, s);
        let mut at = 0;
        for (i, &n) in sizes.iter().enumerate() {
            if i == 3 {
                tcp::discard(&mut s, 5000).unwrap();
                at += 5000;
            }
            // A room that ended takes nothing, and the bytes stay in the stream.
            let mut untouched = vec![0u8; n];
            assert_eq!(read_payload(&mut s, &mut untouched, &|| true).unwrap(), 0);
            assert!(untouched.iter().all(|&x| x == 0));
            let mut dst = vec![0u8; n];
            assert_eq!(read_payload(&mut s, &mut dst, &|| false).unwrap(), n);
            assert!(dst == bytes[at..at + n], "read {i} ({n} bytes) differs");
            at += n;
        }
        assert_eq!(at, total);
        writer.join().unwrap();
    }
}
