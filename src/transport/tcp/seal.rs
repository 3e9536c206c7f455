//! `encrypt_data=true`: the payloads of TCP data connections sealed with AES-256-GCM.
//!
//! Each data connection has a secret of its own that both engines derive from the
//! authentication of that connection, which the control connection's TLS session keys
//! (`crate::auth`, `crate::tls`); a stranger without the session can neither read nor
//! forge a frame. From it comes one AES-256-GCM key per direction (only prefill to
//! decode carries frames). Every frame is sealed under the next value of a 64-bit
//! counter (the nonce: four zero bytes, then the counter big-endian), which both ends
//! count, so a frame dropped, replayed, reordered or moved to another connection fails
//! like a changed one.
//!
//! On the wire a sealed frame is the frame as without encryption, its payload
//! encrypted, then the 16-byte tag, which the frame header does not count. The frame
//! prefix (frame header and data header: room, generation, pages) is the associated
//! data, so a frame cannot be pointed at other pages. A `Done` frame is sent as it is,
//! followed by the tag of an empty payload with the frame as associated data.
//!
//! The receiver admits each data frame from its header before it reads the payload
//! (a frame refused ends the connection there, one for a room that ended is read
//! through and dropped), then reads the whole sealed payload into a buffer of its own
//! and opens it there; only a payload whose tag verified is copied into the room's
//! pages, through the grant its header got ([`FrameSink`]). The buffer goes back down
//! to the largest frame a prefill engine sends after a larger one. A tag that does not
//! verify ends the connection with a reason naming `encrypt_data`; the engine loses the
//! peer and its rooms fail with that reason. This costs a copy on each side (the sender seals into a
//! buffer instead of writing from registered memory; the receiver opens in a buffer
//! instead of reading into the pages): `kvxfer-bench --tls` measures it.
//!
//! The sender writes whole sealed frames only: a room that ends while a batch waits
//! for the connection sends nothing more of it, but a frame once begun is finished (the
//! counter of both ends must stay in step).

use std::io::{self, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

use super::recv::{Admit, FrameSink, Grant, READ_BUFFER};
use super::{MAX_FRAME_BYTES, TICK};
use crate::auth::SessionSecret;
use crate::proto::{self, DataHeader, Kind, Limits, Message, ReadError, DATA_FRAME_PREFIX_LEN};
use crate::transport::{DataLink, Sent, Watch};

/// Bytes of the tag after each sealed frame.
pub const TAG_LEN: usize = 16;

/// What the key of the prefill-to-decode direction is derived for.
const PREFILL_TO_DECODE: &[u8] = b"encrypt_data prefill->decode aes-256-gcm";

/// One direction's key and frame counter.
struct Sealer {
    key: LessSafeKey,
    counter: u64,
}

impl Sealer {
    fn new(secret: &SessionSecret) -> Sealer {
        let bytes = secret.derive(PREFILL_TO_DECODE);
        let key = UnboundKey::new(&AES_256_GCM, &bytes).expect("a 32-byte AES-256 key");
        Sealer {
            key: LessSafeKey::new(key),
            counter: 0,
        }
    }

    /// The nonce of the next frame.
    fn next(&mut self) -> Nonce {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&self.counter.to_be_bytes());
        self.counter += 1;
        Nonce::assume_unique_for_key(n)
    }

    /// Moves past one frame without opening it (a frame read through and dropped).
    fn skip(&mut self) {
        self.counter += 1;
    }

    /// Seals `payload` in place with associated data `aad`; returns the tag.
    fn seal(&mut self, aad: &[u8], payload: &mut [u8]) -> [u8; TAG_LEN] {
        let nonce = self.next();
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(aad), payload)
            .expect("AES-GCM seals any payload of a frame's size");
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Opens `sealed` (payload then tag) in place; the payload's length on success.
    fn open(&mut self, aad: &[u8], sealed: &mut [u8]) -> Option<usize> {
        let nonce = self.next();
        self.key
            .open_in_place(nonce, Aad::from(aad), sealed)
            .ok()
            .map(|p| p.len())
    }
}

/// The receiving end's key of one data connection.
pub struct Opener(Sealer);

impl Opener {
    /// The opener of the data connection whose own secret is `secret`.
    pub fn new(secret: &SessionSecret) -> Opener {
        Opener(Sealer::new(secret))
    }
}

/// A data connection whose frames are sealed: the prefill engine's data link with
/// `encrypt_data=true`.
pub struct SealedConn {
    inner: Mutex<Sending>,
    /// A write failed and the stream is shut. Relaxed: the stream refuses writes once
    /// shut; this only spares the attempt.
    broken: AtomicBool,
}

struct Sending {
    stream: TcpStream,
    sealer: Sealer,
    /// The frame being sealed: prefix, payload, tag.
    buf: Vec<u8>,
}

impl SealedConn {
    /// Wraps connected data stream `stream` with the connection's `secret`; a write that
    /// makes no progress for `stall` fails.
    pub fn new(stream: TcpStream, stall: Duration, secret: &SessionSecret) -> io::Result<Self> {
        stream.set_write_timeout(Some(stall))?;
        super::limit_unsent(&stream);
        Ok(SealedConn {
            inner: Mutex::new(Sending {
                stream,
                sealer: Sealer::new(secret),
                buf: Vec::new(),
            }),
            broken: AtomicBool::new(false),
        })
    }

    fn broken(&self, s: &Sending, e: io::Error) -> io::Error {
        self.broken.store(true, Ordering::Relaxed);
        let _ = s.stream.shutdown(std::net::Shutdown::Both);
        e
    }
}

impl Sending {
    /// Seals `payload` behind `prefix` (the associated data) and writes the frame.
    fn send(&mut self, prefix: &[u8], payload: &[u8]) -> io::Result<()> {
        self.buf.clear();
        self.buf.extend_from_slice(prefix);
        self.buf.extend_from_slice(payload);
        let tag = self.sealer.seal(prefix, &mut self.buf[prefix.len()..]);
        self.buf.extend_from_slice(&tag);
        self.stream.write_all(&self.buf)
    }
}

impl DataLink for SealedConn {
    fn write_runs(&self, runs: &[(DataHeader, &[u8])], watch: &mut Watch<'_>) -> io::Result<Sent> {
        let mut s = loop {
            if let Some(s) = self.inner.try_lock_for(TICK) {
                break s;
            }
            if (watch.ended)() {
                (watch.release)();
                return Ok(Sent::RoomEnded);
            }
        };
        for (i, (hdr, bytes)) in runs.iter().enumerate() {
            if i > 0 && (watch.ended)() {
                (watch.release)();
                return Ok(Sent::RoomEnded);
            }
            let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
            hdr.encode_frame(&mut prefix)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            if let Err(e) = s.send(&prefix, bytes) {
                return Err(self.broken(&s, e));
            }
        }
        Ok(Sent::All)
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    fn finish(&self, done_frame: &[u8]) -> io::Result<()> {
        let mut s = self.inner.lock();
        match s.send(done_frame, &[]) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.broken(&s, e)),
        }
    }
}

/// After a frame larger than this, the payload buffer goes back down to it: the
/// largest frame a prefill engine sends ([`MAX_FRAME_BYTES`]) and its tag. A stream of
/// frames reuses one buffer, and a connection holds no more than this between frames
/// whatever a frame's header claimed.
pub const KEEP_BUFFER: usize = MAX_FRAME_BYTES + TAG_LEN;

/// Reads one sealed data connection until it ends; returns why it ended. Each frame is
/// admitted from its header before its payload is read (see [`Receiving::frame`]).
pub fn serve<S: FrameSink>(s: TcpStream, sink: &S, limits: &Limits, open: Opener) -> String {
    let mut rx = Receiving::new(BufReader::with_capacity(READ_BUFFER, s), open);
    loop {
        if let Err(why) = rx.frame(sink, limits) {
            return why;
        }
    }
}

/// The receiving end of a sealed data connection: the stream, its key and frame
/// counter, and the buffer a payload is opened in.
pub(crate) struct Receiving<R> {
    r: R,
    open: Sealer,
    /// A payload and its tag, until its tag verified.
    buf: Vec<u8>,
    /// Frames read so far (for messages).
    frames: u64,
}

impl<R: Read> Receiving<R> {
    pub(crate) fn new(r: R, open: Opener) -> Self {
        Receiving {
            r,
            open: open.0,
            buf: Vec::new(),
            frames: 0,
        }
    }

    /// Reads one frame. `Err` ends the connection, saying why; a protocol error is
    /// counted on the sink first.
    ///
    /// A data frame is admitted from its header before any byte of its payload is read
    /// ([`FrameSink::admit_unverified`]: the header is not yet known to be the peer's,
    /// so a refusal acts on no room):
    /// - refused: the connection ends there, its payload unread;
    /// - discarded (its room ended): the payload and tag are read through and dropped,
    ///   with no buffer, and the counter moves on, so the next frame's tag checks as
    ///   before (this frame's is not checked: nothing of it is written);
    /// - admitted: the payload is read into the buffer, opened there, and copied into
    ///   the granted pages only once its tag verified; the buffer then goes back down
    ///   to [`KEEP_BUFFER`].
    pub(crate) fn frame<S: FrameSink>(&mut self, sink: &S, limits: &Limits) -> Result<(), String> {
        let hdr = match proto::read_frame_header(&mut self.r, limits) {
            Ok(h) => h,
            Err(ReadError::Closed) => return Err("data connection closed".to_string()),
            Err(ReadError::Proto(e)) => {
                sink.protocol_error();
                return Err(format!("malformed frame: {e}"));
            }
            Err(e) => return Err(format!("data read failed: {e}")),
        };
        sink.heard();
        self.frames += 1;
        let r = match hdr.kind {
            Kind::Data => proto::read_data_header(&mut self.r, &hdr, limits)
                .map_err(|e| e.to_string())
                .and_then(|dh| self.data(sink, &dh)),
            Kind::Done => self.done(sink, &hdr, limits),
            k => Err(format!(
                "unexpected {} frame on a data connection",
                k.name()
            )),
        };
        if r.is_err() {
            sink.protocol_error();
        }
        r
    }

    fn tampered(&self) -> String {
        format!(
            "encrypt_data: data frame {} of this connection failed its integrity check \
             (tampered, corrupt, replayed or out of order); nothing of it was written",
            self.frames
        )
    }

    /// A data frame whose data header `dh` was read.
    fn data<S: FrameSink>(&mut self, sink: &S, dh: &DataHeader) -> Result<(), String> {
        let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
        dh.encode_frame(&mut prefix).map_err(|e| e.to_string())?;
        let sealed = dh.byte_len as usize + TAG_LEN;
        let grant = match sink.admit_unverified(std::slice::from_ref(dh)) {
            Admit::Write(g) => g,
            Admit::Discard => {
                super::discard(&mut self.r, sealed as u64)
                    .map_err(|e| format!("data read failed: {e}"))?;
                self.open.skip();
                return Ok(());
            }
            Admit::Refuse(why) => {
                return Err(format!(
                    "encrypt_data: data frame {} of this connection was refused from its \
                     header, before its payload was read (its tag unchecked: changed on the \
                     way, or sent so): {why}",
                    self.frames
                ))
            }
        };
        self.buf.clear();
        self.buf.resize(sealed, 0);
        self.r
            .read_exact(&mut self.buf)
            .map_err(|e| format!("data read failed: {e}"))?;
        // A payload that does not verify leaves the grant unused: nothing is written.
        let n = self
            .open
            .open(&prefix, &mut self.buf)
            .ok_or_else(|| self.tampered())?;
        let complete = match grant.enter() {
            Some(_io) => {
                grant.pages(0).copy_from_slice(&self.buf[..n]);
                true
            }
            None => false,
        };
        grant.finish(&[complete]);
        if self.buf.capacity() > KEEP_BUFFER {
            self.buf = Vec::with_capacity(KEEP_BUFFER);
        }
        Ok(())
    }

    /// A Done frame, then its tag (of an empty payload, the frame as associated data).
    fn done<S: FrameSink>(
        &mut self,
        sink: &S,
        hdr: &proto::FrameHeader,
        limits: &Limits,
    ) -> Result<(), String> {
        match proto::read_control(&mut self.r, hdr, limits) {
            Ok(
                m @ Message::Done {
                    room,
                    generation,
                    pages_sent,
                    aux_sent,
                },
            ) => {
                let mut frame = Vec::new();
                let mut tag = [0u8; TAG_LEN];
                m.encode(&mut frame).map_err(|e| e.to_string())?;
                self.r
                    .read_exact(&mut tag)
                    .map_err(|e| format!("data read failed: {e}"))?;
                self.open
                    .open(&frame, &mut tag)
                    .ok_or_else(|| self.tampered())?;
                sink.done(room, generation, pages_sent, aux_sent);
                Ok(())
            }
            Ok(_) => Err("Done frame decoded as another kind".into()),
            Err(e) => Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{RefCell, UnsafeCell};

    use super::*;
    use crate::proto::Target;
    use crate::room::{IoGuard, Room};

    /// A decode side in miniature: room 1 takes any frame into a page of the frame's
    /// size, room 2 has ended (its frames are discarded), any other room is a protocol
    /// error. Records each call.
    struct Sink {
        room: Room<()>,
        /// Room 1's page, sized by the last frame admitted for it.
        page: UnsafeCell<Vec<u8>>,
        calls: RefCell<Vec<String>>,
    }

    struct Page<'a>(&'a Sink);

    impl Grant for Page<'_> {
        fn pages(&self, _: usize) -> &mut [u8] {
            // SAFETY: one thread, and one grant at a time, uses the page; the test reads
            // it only between frames.
            unsafe { &mut *self.0.page.get() }
        }

        fn enter(&self) -> Option<IoGuard<'_>> {
            self.0.calls.borrow_mut().push("enter".into());
            Some(self.0.room.begin_io())
        }

        fn finish(self, complete: &[bool]) {
            self.0
                .calls
                .borrow_mut()
                .push(format!("finish {complete:?}"));
        }
    }

    impl Sink {
        fn new() -> Sink {
            Sink {
                room: Room::new(1, 1, crate::Role::Decode, 0, ()),
                page: UnsafeCell::new(Vec::new()),
                calls: RefCell::new(Vec::new()),
            }
        }

        fn page(&self) -> Vec<u8> {
            // SAFETY: no grant is in use between frames.
            unsafe { (*self.page.get()).clone() }
        }

        fn calls(&self) -> Vec<String> {
            self.calls.borrow_mut().drain(..).collect()
        }
    }

    impl FrameSink for Sink {
        type Grant<'a> = Page<'a>;

        fn heard(&self) {}

        fn admit(&self, _: &[DataHeader]) -> Admit<Page<'_>> {
            panic!("a sealed frame is admitted before its tag is checked")
        }

        fn admit_unverified(&self, runs: &[DataHeader]) -> Admit<Page<'_>> {
            let h = &runs[0];
            self.calls
                .borrow_mut()
                .push(format!("admit room {}", h.room));
            match h.room {
                1 => {
                    // SAFETY: as in `pages`.
                    unsafe { *self.page.get() = vec![0; h.byte_len as usize] };
                    Admit::Write(Page(self))
                }
                2 => Admit::Discard,
                r => Admit::Refuse(format!("room {r} does not pull from this engine")),
            }
        }

        fn done(&self, room: u64, _: u64, _: u32, _: bool) {
            self.calls.borrow_mut().push(format!("done room {room}"));
        }

        fn protocol_error(&self) {
            self.calls.borrow_mut().push("protocol error".into());
        }
    }

    /// The sealed bytes of a data frame of `len` bytes of `fill` for `room`, as the
    /// sender writes it.
    fn sealed(s: &mut Sealer, room: u64, len: usize, fill: u8) -> Vec<u8> {
        let h = DataHeader {
            room,
            generation: 1,
            target: Target::Kv,
            buffer: 0,
            first_page: 0,
            n_pages: 1,
            byte_len: len as u32,
            page_off: 0,
            digest: 0,
        };
        let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
        h.encode_frame(&mut prefix).unwrap();
        let mut frame = prefix.to_vec();
        frame.extend(std::iter::repeat_n(fill, len));
        let tag = s.seal(&prefix, &mut frame[DATA_FRAME_PREFIX_LEN..]);
        frame.extend_from_slice(&tag);
        frame
    }

    /// A frame whose header is refused ends the connection before a byte of its
    /// payload is read: however large it claims to be, nothing is buffered for it, and
    /// its room is not failed (the header's tag is unchecked).
    #[test]
    fn a_refused_frame_ends_the_connection_before_its_payload_is_read() {
        let mut tx = Sealer::new(&secret(3));
        let claimed = 64 << 20;
        let frame = sealed(&mut tx, 9, claimed, 0x5a);
        // Only the frame's prefix ever comes: had the receiver waited for the payload, it
        // would fail reading it instead.
        let mut wire = &frame[..DATA_FRAME_PREFIX_LEN];
        let sink = Sink::new();
        let mut rx = Receiving::new(&mut wire, Opener::new(&secret(3)));
        let why = rx.frame(&sink, &Limits::default()).unwrap_err();
        assert!(why.contains("refused from its header"), "{why}");
        assert!(why.contains("room 9 does not pull"), "{why}");
        assert_eq!(rx.buf.capacity(), 0, "a payload buffer was made");
        assert_eq!(sink.calls(), ["admit room 9", "protocol error"]);
        assert!(wire.is_empty());
    }

    /// A frame for a room that ended is read through without a buffer, and the frames
    /// after it still open under the counter; a frame larger than the largest a prefill
    /// engine sends lands whole and leaves the buffer at that size; a changed payload is
    /// never written.
    #[test]
    fn discarded_frames_keep_the_counter_and_the_buffer_goes_back_down_after_a_large_one() {
        let mut tx = Sealer::new(&secret(4));
        let big = KEEP_BUFFER + 4096;
        let mut wire = Vec::new();
        wire.extend(sealed(&mut tx, 2, 3 << 20, 0x11)); // discarded
        wire.extend(sealed(&mut tx, 1, big, 0x22));
        wire.extend(sealed(&mut tx, 1, 1000, 0x33));
        let mut changed = sealed(&mut tx, 1, 1000, 0x44);
        changed[DATA_FRAME_PREFIX_LEN + 10] ^= 1;
        wire.extend(changed);
        let mut r = &wire[..];
        let sink = Sink::new();
        let mut rx = Receiving::new(&mut r, Opener::new(&secret(4)));
        let limits = Limits::default();
        rx.frame(&sink, &limits).unwrap();
        assert_eq!(sink.calls(), ["admit room 2"]);
        assert_eq!(rx.buf.capacity(), 0, "a discarded frame was buffered");
        rx.frame(&sink, &limits).unwrap();
        assert_eq!(sink.calls(), ["admit room 1", "enter", "finish [true]"]);
        assert!(sink.page().len() == big && sink.page().iter().all(|&b| b == 0x22));
        assert!(rx.buf.capacity() <= KEEP_BUFFER, "{}", rx.buf.capacity());
        rx.frame(&sink, &limits).unwrap();
        assert_eq!(sink.calls(), ["admit room 1", "enter", "finish [true]"]);
        assert_eq!(sink.page(), vec![0x33; 1000]);
        let why = rx.frame(&sink, &limits).unwrap_err();
        assert!(why.contains("integrity"), "{why}");
        // Admitted, then never entered: nothing written, nothing counted.
        assert_eq!(sink.calls(), ["admit room 1", "protocol error"]);
        assert_eq!(sink.page(), vec![0; 1000]);
    }

    fn secret(b: u8) -> SessionSecret {
        SessionSecret::from_tls(&[b; 32], true, None)
    }

    #[test]
    fn a_sealed_payload_opens_only_unchanged_in_order_and_under_its_key() {
        let (mut s, mut o) = (Sealer::new(&secret(1)), Sealer::new(&secret(1)));
        let mut frames = Vec::new();
        for k in 0..3u8 {
            let mut p = vec![k; 100];
            let tag = s.seal(b"prefix", &mut p);
            assert_ne!(p, vec![k; 100], "the payload is encrypted");
            p.extend_from_slice(&tag);
            frames.push(p);
        }
        // In order: each opens to what was sealed.
        let mut first = frames[0].clone();
        assert_eq!(o.open(b"prefix", &mut first), Some(100));
        assert_eq!(first[..100], [0u8; 100]);
        // Out of order (frame 2 where 1 is due), a changed byte, changed associated
        // data, another key: none opens.
        let mut skip = frames[2].clone();
        assert_eq!(o.open(b"prefix", &mut skip), None);
        for (aad, flip, key) in [
            (&b"prefix"[..], Some(5), 1),
            (&b"prefiX"[..], None, 1),
            (&b"prefix"[..], None, 2),
        ] {
            let mut o = Sealer::new(&secret(key));
            o.counter = 1;
            let mut f = frames[1].clone();
            if let Some(i) = flip {
                f[i] ^= 1;
            }
            assert_eq!(o.open(aad, &mut f), None, "{aad:?} {flip:?} {key}");
        }
    }
}
