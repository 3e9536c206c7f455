//! Reading frames from a blocking byte stream.
//!
//! A receive loop calls [`read_frame_header`], then [`read_control`] for control kinds or
//! [`read_data_header`] for [`Kind::Data`] (after which it reads `byte_len` bytes into the
//! checked destination itself). Each call reads exactly the bytes it needs, so the
//! stream stays at a frame boundary between frames. Payload buffers are allocated only
//! after the header has been validated.

use std::fmt;
use std::io::{self, ErrorKind, Read};

use super::data::DataHeader;
use super::frame::{FrameHeader, Kind, Limits, ProtoError};
use super::message::Message;
use super::{DATA_HEADER_LEN, FRAME_HEADER_LEN};

/// Why a frame could not be read from a stream.
///
/// After [`ReadError::Closed`] or [`ReadError::Idle`] the stream is still at a frame
/// boundary. After [`ReadError::Io`] or [`ReadError::Proto`] its position within the
/// protocol is unknown: close the connection (and fail the peer's rooms).
#[derive(Debug)]
pub enum ReadError {
    /// The peer closed the stream cleanly at a frame boundary (end of stream before the
    /// first byte of a frame header).
    Closed,
    /// A read timed out (`WouldBlock` or `TimedOut`, e.g. from a socket read timeout)
    /// before the first byte of a frame header; nothing was consumed and the call may be
    /// retried. A timeout after a frame has started is an [`ReadError::Io`] instead.
    Idle(io::Error),
    /// An I/O error, including end of stream or a timeout in the middle of a frame
    /// (reported as `UnexpectedEof` / the original error).
    Io(io::Error),
    /// The bytes read are not a valid frame.
    Proto(ProtoError),
}

impl ReadError {
    /// True if the stream is still at a frame boundary ([`ReadError::Closed`] or
    /// [`ReadError::Idle`]).
    pub fn at_frame_boundary(&self) -> bool {
        matches!(self, ReadError::Closed | ReadError::Idle(_))
    }
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Closed => f.write_str("connection closed by peer"),
            ReadError::Idle(e) => write!(f, "no frame arrived before the read timeout: {e}"),
            ReadError::Io(e) => write!(f, "I/O error: {e}"),
            ReadError::Proto(e) => write!(f, "protocol error: {e}"),
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Closed => None,
            ReadError::Idle(e) | ReadError::Io(e) => Some(e),
            ReadError::Proto(e) => Some(e),
        }
    }
}

impl From<ProtoError> for ReadError {
    fn from(e: ProtoError) -> Self {
        ReadError::Proto(e)
    }
}

fn is_timeout(kind: ErrorKind) -> bool {
    matches!(kind, ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Fills `buf`, retrying on `Interrupted`. `what` names the part being read for the
/// end-of-stream error. If `at_boundary`, end of stream or a timeout before the first
/// byte is reported as [`ReadError::Closed`] / [`ReadError::Idle`].
pub(super) fn fill<R: Read>(
    r: &mut R,
    buf: &mut [u8],
    what: &str,
    at_boundary: bool,
) -> Result<(), ReadError> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if at_boundary && filled == 0 => return Err(ReadError::Closed),
            Ok(0) => {
                return Err(ReadError::Io(io::Error::new(
                    ErrorKind::UnexpectedEof,
                    format!(
                        "connection closed in the middle of a {what} ({filled} of {} bytes read)",
                        buf.len()
                    ),
                )))
            }
            // `min` keeps a reader that over-reports `n` from pushing us out of bounds.
            Ok(n) => filled = filled.saturating_add(n).min(buf.len()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if at_boundary && filled == 0 && is_timeout(e.kind()) => {
                return Err(ReadError::Idle(e))
            }
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}

/// Reads and validates one frame header ([`FrameHeader::decode`]).
///
/// End of stream before the first byte gives [`ReadError::Closed`]; a timeout before the
/// first byte gives [`ReadError::Idle`]; end of stream after it gives
/// [`ReadError::Io`] with `UnexpectedEof`.
pub fn read_frame_header<R: Read>(r: &mut R, limits: &Limits) -> Result<FrameHeader, ReadError> {
    let mut buf = [0u8; FRAME_HEADER_LEN];
    fill(r, &mut buf, "frame header", true)?;
    Ok(FrameHeader::decode(&buf, limits)?)
}

/// Reads the payload of the control frame whose header is `hdr` and decodes it
/// ([`Message::decode`]).
///
/// `hdr.payload_len` is checked against `limits` again before the payload buffer is
/// allocated, so a hand-built header cannot size the allocation. A data frame header
/// gives [`ProtoError::NotControlKind`] without reading anything.
pub fn read_control<R: Read>(
    r: &mut R,
    hdr: &FrameHeader,
    limits: &Limits,
) -> Result<Message, ReadError> {
    if !hdr.kind.is_control() {
        return Err(ProtoError::NotControlKind { kind: hdr.kind }.into());
    }
    hdr.check_payload_len(limits)?;
    let len = usize::try_from(hdr.payload_len).map_err(|_| ProtoError::PayloadTooLarge {
        kind: hdr.kind,
        len: u64::from(hdr.payload_len),
        max: usize::MAX as u64,
    })?;
    let mut payload = vec![0u8; len];
    fill(r, &mut payload, "control payload", false)?;
    Ok(Message::decode(hdr.kind, &payload, limits)?)
}

/// Reads and validates the data header of the data frame whose header is `hdr`
/// ([`DataHeader::decode`]). The stream is then positioned at the frame's `byte_len`
/// data bytes, which the caller must read (or discard) before the next frame.
///
/// A control frame header gives [`ProtoError::NotDataKind`] without reading anything.
pub fn read_data_header<R: Read>(
    r: &mut R,
    hdr: &FrameHeader,
    limits: &Limits,
) -> Result<DataHeader, ReadError> {
    let buf: [u8; DATA_HEADER_LEN] = read_data_start(r, hdr, Kind::Data, limits, "data header")?;
    Ok(DataHeader::decode(&buf, hdr.payload_len, limits)?)
}

/// Checks that `hdr` is a data frame of `kind` within `limits` (nothing is read if not),
/// then reads the `N` bytes that start its payload (`what`, for the end-of-stream error).
pub(super) fn read_data_start<R: Read, const N: usize>(
    r: &mut R,
    hdr: &FrameHeader,
    kind: Kind,
    limits: &Limits,
    what: &str,
) -> Result<[u8; N], ReadError> {
    if hdr.kind != kind {
        return Err(ProtoError::NotDataKind { kind: hdr.kind }.into());
    }
    hdr.check_payload_len(limits)?;
    let mut buf = [0u8; N];
    fill(r, &mut buf, what, false)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::super::message::sample_messages;
    use super::super::{Target, DATA_FRAME_PREFIX_LEN};
    use super::*;

    /// What one frame decoded to.
    #[derive(Debug, PartialEq)]
    enum Frame {
        Control(Message),
        Data(DataHeader, Vec<u8>),
    }

    /// Reads one whole frame the way a receive loop would.
    fn read_frame<R: Read>(r: &mut R, limits: &Limits) -> Result<Frame, ReadError> {
        let hdr = read_frame_header(r, limits)?;
        if hdr.kind.is_control() {
            return Ok(Frame::Control(read_control(r, &hdr, limits)?));
        }
        let d = read_data_header(r, &hdr, limits)?;
        let mut bytes = vec![0u8; d.byte_len as usize];
        fill(r, &mut bytes, "data", false)?;
        Ok(Frame::Data(d, bytes))
    }

    /// The canonical encoding of a decoded frame.
    fn encode_frame(f: &Frame) -> Vec<u8> {
        match f {
            Frame::Control(m) => {
                let mut out = Vec::new();
                m.encode(&mut out).unwrap();
                out
            }
            Frame::Data(d, bytes) => {
                let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
                d.encode_frame(&mut prefix).unwrap();
                let mut out = prefix.to_vec();
                out.extend_from_slice(bytes);
                out
            }
        }
    }

    fn sample_frames() -> Vec<Vec<u8>> {
        let mut frames: Vec<Vec<u8>> = sample_messages()
            .into_iter()
            .map(|m| encode_frame(&Frame::Control(m)))
            .collect();
        for (target, n_pages, len) in [(Target::Kv, 2u32, 64usize), (Target::Aux, 1, 0)] {
            let d = DataHeader {
                room: 9,
                generation: 1,
                target,
                buffer: 3,
                first_page: 10,
                n_pages,
                byte_len: len as u32,
                page_off: 0,
                digest: 0,
            };
            let bytes = (0..len).map(|i| i as u8).collect();
            frames.push(encode_frame(&Frame::Data(d, bytes)));
        }
        frames
    }

    /// Yields at most one byte per call and fails with `Interrupted` every other call.
    struct Trickle<'a> {
        data: &'a [u8],
        interrupt: bool,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.interrupt = !self.interrupt;
            if self.interrupt {
                return Err(io::Error::from(ErrorKind::Interrupted));
            }
            let n = buf.len().min(1).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    /// Yields `data`, then times out forever.
    struct TimesOut<'a> {
        data: &'a [u8],
    }

    impl Read for TimesOut<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.data.is_empty() {
                return Err(io::Error::from(ErrorKind::WouldBlock));
            }
            let n = buf.len().min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn back_to_back_frames_are_read_in_order_then_closed() {
        let frames = sample_frames();
        let stream: Vec<u8> = frames.concat();
        let limits = Limits::default();
        let mut r = stream.as_slice();
        for f in &frames {
            let got = read_frame(&mut r, &limits).unwrap();
            assert_eq!(&encode_frame(&got), f);
        }
        let e = read_frame(&mut r, &limits).unwrap_err();
        assert!(matches!(e, ReadError::Closed), "{e}");
        assert!(e.at_frame_boundary());
    }

    #[test]
    fn partial_reads_and_interrupts_are_retried() {
        let frames = sample_frames();
        let stream: Vec<u8> = frames.concat();
        let mut r = Trickle {
            data: &stream,
            interrupt: false,
        };
        for f in &frames {
            let got = read_frame(&mut r, &Limits::default()).unwrap();
            assert_eq!(&encode_frame(&got), f);
        }
        assert!(matches!(
            read_frame_header(&mut r, &Limits::default()),
            Err(ReadError::Closed)
        ));
    }

    #[test]
    fn eof_inside_a_header_is_an_io_error() {
        let frame = &sample_frames()[0];
        let e = read_frame_header(&mut &frame[..5], &Limits::default()).unwrap_err();
        match &e {
            ReadError::Io(io) => assert_eq!(io.kind(), ErrorKind::UnexpectedEof),
            other => panic!("expected Io, got {other:?}"),
        }
        assert!(e.to_string().contains("5 of 16"), "{e}");
        assert!(!e.at_frame_boundary());
    }

    #[test]
    fn timeout_before_a_frame_is_idle_and_after_its_start_is_io() {
        let frame = &sample_frames()[0];
        let limits = Limits::default();
        let mut r = TimesOut { data: &[] };
        assert!(matches!(
            read_frame_header(&mut r, &limits),
            Err(ReadError::Idle(_))
        ));
        let mut r = TimesOut { data: &frame[..3] };
        match read_frame_header(&mut r, &limits) {
            Err(ReadError::Io(e)) => assert_eq!(e.kind(), ErrorKind::WouldBlock),
            other => panic!("expected Io, got {other:?}"),
        }
        let mut r = TimesOut {
            data: &frame[..FRAME_HEADER_LEN],
        };
        let hdr = read_frame_header(&mut r, &limits).unwrap();
        assert!(matches!(
            read_control(&mut r, &hdr, &limits),
            Err(ReadError::Io(_))
        ));
    }

    #[test]
    fn protocol_errors_surface_as_proto() {
        let mut frame = sample_frames()[0].clone();
        frame[0] = 0;
        let e = read_frame_header(&mut frame.as_slice(), &Limits::default()).unwrap_err();
        assert!(
            matches!(e, ReadError::Proto(ProtoError::BadMagic { .. })),
            "{e}"
        );
        assert!(
            e.to_string().starts_with("protocol error: bad frame magic"),
            "{e}"
        );
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn oversize_hand_built_header_is_rejected_before_reading() {
        let limits = Limits::default();
        let hdr = FrameHeader::new(Kind::Registration, u32::MAX);
        // An empty reader would give Io(UnexpectedEof) if anything were read.
        let e = read_control(&mut io::empty(), &hdr, &limits).unwrap_err();
        assert!(
            matches!(
                e,
                ReadError::Proto(ProtoError::PayloadTooLarge {
                    kind: Kind::Registration,
                    ..
                })
            ),
            "{e}"
        );
    }

    #[test]
    fn wrong_reader_for_the_kind_is_rejected_before_reading() {
        let limits = Limits::default();
        let data = FrameHeader::new(Kind::Data, 100);
        assert!(matches!(
            read_control(&mut io::empty(), &data, &limits),
            Err(ReadError::Proto(ProtoError::NotControlKind {
                kind: Kind::Data
            }))
        ));
        let hello = FrameHeader::new(Kind::Hello, 14);
        assert!(matches!(
            read_data_header(&mut io::empty(), &hello, &limits),
            Err(ReadError::Proto(ProtoError::NotDataKind {
                kind: Kind::Hello
            }))
        ));
    }

    #[test]
    fn every_truncation_of_every_frame_is_an_error() {
        let limits = Limits::default();
        for frame in sample_frames() {
            for cut in 0..frame.len() {
                let mut r = &frame[..cut];
                let res = read_frame(&mut r, &limits);
                match res {
                    Err(ReadError::Closed) => assert_eq!(cut, 0),
                    Err(ReadError::Io(e)) => assert_eq!(e.kind(), ErrorKind::UnexpectedEof),
                    other => panic!("cut {cut} of {frame:?}: {other:?}"),
                }
            }
        }
    }

    /// xorshift64*: a tiny deterministic PRNG for the mutation test.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.0 = x;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn random_mutations_never_panic_and_accepted_frames_are_canonical() {
        let frames = sample_frames();
        let small = Limits {
            max_control_payload: 64,
            max_pages: 3,
            max_buffers: 2,
            max_reason_len: 8,
            max_data_bytes: 16,
            max_qps: 2,
        };
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let (mut accepted, mut rejected) = (0usize, 0usize);
        for iter in 0..6000 {
            let mut frame = frames[rng.below(frames.len())].clone();
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(frame.len());
                match rng.below(3) {
                    0 => frame[i] ^= 1 << rng.below(8),
                    1 => frame[i] = rng.next() as u8,
                    _ => frame[i] = [0, 1, 0x7f, 0x80, 0xff][rng.below(5)],
                }
            }
            if rng.below(8) == 0 {
                frame.truncate(rng.below(frame.len() + 1));
            }
            let limits = if iter % 4 == 0 {
                small
            } else {
                Limits::default()
            };
            let mut r = frame.as_slice();
            match read_frame(&mut r, &limits) {
                Ok(f) => {
                    accepted += 1;
                    let consumed = frame.len() - r.len();
                    assert_eq!(encode_frame(&f), &frame[..consumed], "iteration {iter}");
                }
                Err(e) => {
                    rejected += 1;
                    assert!(!e.to_string().is_empty());
                }
            }
        }
        // Both outcomes must actually occur, or the test exercises nothing.
        assert!(accepted > 100 && rejected > 1000, "{accepted} / {rejected}");
    }

    #[test]
    fn random_payloads_never_panic() {
        let mut rng = XorShift(42);
        let limits = Limits::default();
        for _ in 0..3000 {
            let len = rng.below(80);
            let payload: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            for kind in Kind::ALL {
                let _ = Message::decode(kind, &payload, &limits);
            }
            let mut d = [0u8; DATA_HEADER_LEN];
            d.iter_mut().for_each(|b| *b = rng.next() as u8);
            let _ = DataHeader::decode(&d, rng.next() as u32, &limits);
        }
    }
}
