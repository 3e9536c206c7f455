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
//! The receiver reads a whole sealed payload into a buffer of its own and opens it
//! there; only a payload whose tag verified is copied into the room's pages, through the
//! same grant as unsealed frames ([`FrameSink`]). A tag that does not verify ends the
//! connection with a reason naming `encrypt_data`; the engine loses the peer and its
//! rooms fail with that reason. This costs a copy on each side (the sender seals into a
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
use super::TICK;
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

/// Reads one sealed data connection until it ends; returns why it ended. As
/// [`super::recv::serve`], each payload opened before it is admitted.
pub fn serve<S: FrameSink>(s: TcpStream, sink: &S, limits: &Limits, open: Opener) -> String {
    let mut open = open.0;
    let mut r = BufReader::with_capacity(READ_BUFFER, s);
    let mut buf = Vec::new();
    let mut frames: u64 = 0;
    loop {
        let hdr = match proto::read_frame_header(&mut r, limits) {
            Ok(h) => h,
            Err(ReadError::Closed) => return "data connection closed".to_string(),
            Err(ReadError::Proto(e)) => {
                sink.protocol_error();
                return format!("malformed frame: {e}");
            }
            Err(e) => return format!("data read failed: {e}"),
        };
        sink.heard();
        frames += 1;
        let tampered = || {
            format!(
                "encrypt_data: data frame {frames} of this connection failed its integrity \
                 check (tampered, corrupt, replayed or out of order); nothing of it was written"
            )
        };
        let r = match hdr.kind {
            Kind::Data => proto::read_data_header(&mut r, &hdr, limits)
                .map_err(|e| e.to_string())
                .and_then(|dh| {
                    let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
                    dh.encode_frame(&mut prefix).map_err(|e| e.to_string())?;
                    buf.resize(dh.byte_len as usize + TAG_LEN, 0);
                    r.read_exact(&mut buf)
                        .map_err(|e| format!("data read failed: {e}"))?;
                    let n = open.open(&prefix, &mut buf).ok_or_else(tampered)?;
                    deliver(sink, &dh, &buf[..n])
                }),
            Kind::Done => match proto::read_control(&mut r, &hdr, limits) {
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
                    m.encode(&mut frame)
                        .map_err(|e| e.to_string())
                        .and_then(|()| {
                            r.read_exact(&mut tag)
                                .map_err(|e| format!("data read failed: {e}"))
                        })
                        .and_then(|()| open.open(&frame, &mut tag).ok_or_else(tampered))
                        .map(|_| sink.done(room, generation, pages_sent, aux_sent))
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
            sink.protocol_error();
            return why;
        }
    }
}

/// An opened payload into the pages its frame was admitted to, if any.
fn deliver<S: FrameSink>(sink: &S, h: &DataHeader, plain: &[u8]) -> Result<(), String> {
    let grant = match sink.admit(std::slice::from_ref(h)) {
        Admit::Write(g) => g,
        Admit::Discard => return Ok(()),
        Admit::Refuse(why) => return Err(why),
    };
    let complete = match grant.enter() {
        Some(_io) => {
            grant.pages(0).copy_from_slice(plain);
            true
        }
        None => false,
    };
    grant.finish(&[complete]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
