//! The receiving half of the TCP transport: one thread per data connection reads frames
//! and writes each payload straight into the pages the engine grants it.
//!
//! The transport does not decide where a frame may go: it asks a [`FrameSink`] (the
//! decode engine, which checks the frame against the room's grant, invariant 8) and
//! only then writes, into exactly the bytes granted, under the room's io count, asking
//! the room again before each write ([`read_payload`]).

use std::io::{self, BufRead, IoSliceMut, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use super::TICK;
use crate::proto::{self, DataHeader, Kind, Limits, Message, ReadError, DATA_FRAME_PREFIX_LEN};
use crate::room::IoGuard;

/// Read buffer of a data connection: headers and small frames (a few KiB per page on
/// small models) come out of one `recv` per buffer-full instead of three per frame.
pub const READ_BUFFER: usize = 64 * 1024;

/// A payload rest at least this long is read straight from the socket into the pages
/// (one copy, the kernel's) rather than through the buffer (the kernel's copy into the
/// buffer, then ours out of it into pages that are not in cache). Below it, the frames
/// are small enough that reading several per `recv` through the buffer costs less.
pub const DIRECT_MIN: usize = 16 * 1024;

/// A read straight into one run with at least this much left to come waits in the
/// kernel until the rest (up to [`LOWAT_MAX`]) is there, not for the first segment
/// (`SO_RCVLOWAT`): large pages then come in a few large `recv`s and as many wakeups,
/// where the receiver otherwise drains the socket faster than one sender fills it and
/// is woken for every few segments. Runs that share a `DataRuns` frame (small pages)
/// are read as they come: waiting for a whole frame of them measured slower.
pub const LOWAT_RUN: usize = 256 * 1024;

/// The most a read waits to find in the socket at once (`SO_RCVLOWAT`).
pub const LOWAT_MAX: usize = 1 << 20;

/// A data connection as the receiver reads it: the socket and its read buffer.
///
/// A `BufReader`, except in two ways. A read straight into a room's pages also asks,
/// in the same `recv` (a vectored read), for the next data frame's prefix into the
/// buffer, so that a stream of large frames costs one `recv` per frame and none of the
/// next frame's payload lands in the buffer to be copied again; and after a large
/// payload, a header read into the empty buffer asks for no more than a prefix, for the
/// same reason. And the socket's read
/// timeout (`TICK`, which lets a read straight into the pages look at its room again)
/// is set when such a read begins and taken off only when the connection goes quiet for
/// a tick, not twice per frame; reads through the buffer wait as long as it takes.
pub struct DataStream {
    sock: TcpStream,
    buf: Box<[u8]>,
    /// The unread bytes are `buf[pos..end]`.
    pos: usize,
    end: usize,
    /// The socket's read timeout is `TICK` (else none).
    ticking: bool,
    /// How much a read into the empty buffer asks for: all of it, or only a data frame's
    /// prefix after a large payload (the next frame is likely large too, and its payload
    /// is better read straight into its pages than through the buffer).
    fill: usize,
    /// The socket's `SO_RCVLOWAT` as last set (1, the kernel's default, except around
    /// a read straight into one large run).
    lowat: usize,
}

impl DataStream {
    pub fn new(sock: TcpStream) -> DataStream {
        DataStream {
            sock,
            buf: vec![0; READ_BUFFER].into_boxed_slice(),
            pos: 0,
            end: 0,
            ticking: false,
            fill: READ_BUFFER,
            lowat: 1,
        }
    }

    fn is_empty(&self) -> bool {
        self.pos == self.end
    }

    /// Whether bytes already read from the socket wait in the buffer.
    pub(crate) fn has_buffered(&self) -> bool {
        !self.is_empty()
    }

    /// Sets the read timeout to `TICK`, if it is not.
    fn tick(&mut self) -> io::Result<()> {
        if !self.ticking {
            self.sock.set_read_timeout(Some(TICK))?;
            self.ticking = true;
        }
        Ok(())
    }

    /// Sets the socket's `SO_RCVLOWAT` to `n`, if it is not. A failure leaves it as it
    /// was, which only costs wakeups.
    fn set_lowat(&mut self, n: usize) {
        if n == self.lowat {
            return;
        }
        let v = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
        let fd = self.sock.as_raw_fd();
        if super::set_int_option(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, v).is_ok() {
            self.lowat = n;
        }
    }

    /// Bytes waiting in the socket's receive queue (0 if the kernel does not say).
    fn queued(&self) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: the socket is open while `self` lives; FIONREAD writes one c_int.
        let r = unsafe { libc::ioctl(self.sock.as_raw_fd(), libc::FIONREAD, &mut n) };
        if r == 0 {
            usize::try_from(n).unwrap_or(0)
        } else {
            0
        }
    }

    /// Before a read that may stop short of what it asks (a frame header, a small
    /// payload): the kernel's default again, which wakes the read at the first byte.
    /// Tcp wakes a waiting reader only once `SO_RCVLOWAT` bytes are queued, whatever the
    /// read asked for, so a header read under a large mark would wait for bytes that
    /// may never come.
    fn any_bytes(&mut self) {
        self.set_lowat(1);
    }

    /// A read from the socket that is to wait as long as it takes failed with `e`: if it
    /// was a tick's timeout, the connection went quiet, so the timeout comes off and the
    /// read is to be tried again (`Ok`); any other error of the stream is returned.
    fn waited(&mut self, e: io::Error) -> io::Result<()> {
        if !read_again(&e) {
            return Err(e);
        }
        if self.ticking && e.kind() != io::ErrorKind::Interrupted {
            self.sock.set_read_timeout(None)?;
            self.ticking = false;
        }
        Ok(())
    }

    /// One `recv` straight into `dst` (a room's pages: the rest of one run from `at`,
    /// then the following runs whole), with the next data frame's prefix into the
    /// buffer, which must be empty; gives up after a tick without bytes (the timeout
    /// must be set). Returns how many bytes landed in `dst`.
    fn read_direct(&mut self, dst: &mut [&mut [u8]], at: usize) -> io::Result<usize> {
        debug_assert!(self.is_empty() && self.ticking && !dst.is_empty());
        let (first, rest) = dst.split_first_mut().expect("not empty");
        let mut into = Vec::with_capacity(rest.len().min(MAX_IOV - 2) + 2);
        into.push(IoSliceMut::new(&mut first[at..]));
        into.extend(
            rest.iter_mut()
                .take(MAX_IOV - 2)
                .map(|d| IoSliceMut::new(d)),
        );
        let asked: usize = into.iter().map(|d| d.len()).sum();
        // One large run: wake when its rest (up to LOWAT_MAX) is here. The mark counts
        // bytes beyond those queued now, which the read takes first: the kernel wakes the
        // read by the bytes queued after it began, so a mark of the whole rest would wait
        // past the run's end (for the next frame, or the tick) once part of it was queued.
        let lowat = if into.len() == 1 && asked >= LOWAT_RUN {
            asked.min(LOWAT_MAX).saturating_sub(self.queued()).max(1)
        } else {
            1
        };
        self.set_lowat(lowat);
        into.push(IoSliceMut::new(&mut self.buf[..DATA_FRAME_PREFIX_LEN]));
        let n = self.sock.read_vectored(&mut into)?;
        let mine = n.min(asked);
        self.pos = 0;
        self.end = n - mine;
        Ok(mine)
    }

    /// The next fill of the empty buffer asks for no more than the `n` bytes of headers
    /// still to come, beyond what the buffer holds (so that none of the payload behind
    /// them lands in the buffer to be copied again).
    fn expect(&mut self, n: usize) {
        let buffered = self.end - self.pos;
        if n > buffered {
            self.fill = (n - buffered).min(READ_BUFFER);
        }
    }
}

/// The most slices in one vectored read (Linux's `IOV_MAX`).
const MAX_IOV: usize = 1024;

impl Read for DataStream {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.is_empty() && out.len() >= self.buf.len() {
            self.any_bytes();
            loop {
                match self.sock.read(out) {
                    Ok(n) => return Ok(n),
                    Err(e) => self.waited(e)?,
                }
            }
        }
        let have = self.fill_buf()?;
        let n = have.len().min(out.len());
        out[..n].copy_from_slice(&have[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for DataStream {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.is_empty() {
            self.any_bytes();
        }
        while self.is_empty() {
            match self.sock.read(&mut self.buf[..self.fill]) {
                Ok(n) => {
                    self.pos = 0;
                    self.end = n;
                    if n == 0 {
                        break;
                    }
                }
                Err(e) => self.waited(e)?,
            }
        }
        Ok(&self.buf[self.pos..self.end])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.end);
    }
}

/// Where a data frame's payload may go, as the engine decides.
pub enum Admit<G> {
    /// Into the pages the grant holds.
    Write(G),
    /// Nowhere: the room is gone or terminal; the payload is read and dropped.
    Discard,
    /// The peer broke the protocol: the connection closes with this reason.
    Refuse(String),
}

/// The pages the runs of one data frame were admitted to (one room's, every run of the
/// frame: a frame is admitted or refused whole).
pub trait Grant {
    /// The bytes run `i` of the frame fills, exactly. Written only while a guard from
    /// [`Grant::enter`] is held.
    #[allow(clippy::mut_from_ref)]
    fn pages(&self, i: usize) -> &mut [u8];

    /// For run `i` into device memory: its device and the device address of its first
    /// byte (the run's bytes then go through the staging ring, and [`pages`](Self::pages)
    /// is never asked for it). `None`: host memory.
    fn device(&self, _i: usize) -> Option<(u32, usize)> {
        None
    }

    /// Counts one write into the pages in (until the guard drops) and says whether the
    /// room is still live; `None`: it ended, write nothing more.
    fn enter(&self) -> Option<IoGuard<'_>>;

    /// The payloads have been read: `complete[i]`, run `i` whole into its pages, or
    /// only in part before the room ended (the rest was dropped).
    fn finish(self, complete: &[bool]);

    /// As [`finish`](Self::finish), for a frame with runs into device memory:
    /// `received[i]` is the digest ([`crate::integrity`]) of run `i`'s bytes as they
    /// were received, taken in the staging slots before the copy to the device (`None`
    /// for runs into host memory, whose digest is taken where they landed).
    fn finish_staged(self, complete: &[bool], received: &[Option<u32>])
    where
        Self: Sized,
    {
        let _ = received;
        self.finish(complete)
    }
}

/// What a data connection's frames are for: the decode engine, for one peer.
pub trait FrameSink {
    type Grant<'a>: Grant
    where
        Self: 'a;

    /// A frame's header arrived: the peer is alive.
    fn heard(&self);

    /// Where the payloads of a data frame's runs go (`runs`: one for `Data`, one room's
    /// for `DataRuns`), all of them checked before any byte is read.
    fn admit(&self, runs: &[DataHeader]) -> Admit<Self::Grant<'_>>;

    /// As [`admit`](Self::admit), for runs whose headers are not yet known to come from
    /// the peer (a sealed frame, before its tag is checked): a refusal only says why,
    /// and changes no room (a header changed on the way must not fail a room).
    fn admit_unverified(&self, runs: &[DataHeader]) -> Admit<Self::Grant<'_>>;

    /// A Done frame: the peer sent every frame of the room (on this or another
    /// connection).
    fn done(&self, room: u64, generation: u64, pages_sent: u32, aux_sent: bool);

    /// A protocol error ended the connection (counted by the sink).
    fn protocol_error(&self);
}

/// The next frame header on a data connection, with `sink` told that the peer was
/// heard; otherwise why the connection ends (a malformed header is counted by `sink`).
pub(crate) fn next_frame<R: io::Read, S: FrameSink>(
    r: &mut R,
    sink: &S,
    limits: &Limits,
) -> Result<proto::FrameHeader, String> {
    let hdr = match proto::read_frame_header(r, limits) {
        Ok(h) => h,
        Err(ReadError::Closed) => return Err("data connection closed".to_string()),
        Err(ReadError::Proto(e)) => {
            sink.protocol_error();
            return Err(format!("malformed frame: {e}"));
        }
        Err(e) => return Err(format!("data read failed: {e}")),
    };
    sink.heard();
    Ok(hdr)
}

/// Reads one data connection until it ends; returns why it ended.
pub fn serve<S: FrameSink>(s: TcpStream, sink: &S, limits: &Limits) -> String {
    let mut s = DataStream::new(s);
    // The connection's staging rings for runs into device memory, made on first use.
    let mut rings = crate::cuda::copy::Rings::default();
    loop {
        let hdr = match next_frame(&mut s, sink, limits) {
            Ok(h) => h,
            Err(why) => return why,
        };
        let r = match hdr.kind {
            Kind::Data | Kind::DataRuns => data_frame(&mut s, sink, &hdr, limits, &mut rings),
            Kind::Done => match proto::read_control(&mut s, &hdr, limits) {
                Ok(Message::Done {
                    room,
                    generation,
                    pages_sent,
                    aux_sent,
                }) => {
                    sink.done(room, generation, pages_sent, aux_sent);
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
            sink.protocol_error();
            return why;
        }
    }
}

/// Serves the `Data` or `DataRuns` frame whose header `hdr` was read (runs into device
/// memory through `rings`).
pub(crate) fn data_frame<S: FrameSink>(
    s: &mut DataStream,
    sink: &S,
    hdr: &proto::FrameHeader,
    limits: &Limits,
    rings: &mut crate::cuda::copy::Rings,
) -> Result<(), String> {
    if hdr.kind == Kind::Data {
        return proto::read_data_header(s, hdr, limits)
            .map_err(|e| e.to_string())
            .and_then(|dh| data(s, sink, std::slice::from_ref(&dh), rings));
    }
    proto::read_runs_count(s, hdr, limits)
        .and_then(|n| {
            s.expect(n as usize * proto::DATA_HEADER_LEN);
            proto::read_run_headers(s, hdr, n, limits)
        })
        .map_err(|e| e.to_string())
        .and_then(|runs| data(s, sink, &runs, rings))
}

/// The runs of one data frame (one run for `Data`; one room's runs for `DataRuns`)
/// whose headers were read: admitted together before any byte is read, then their
/// payloads into the granted pages with as few `recv`s as they allow, or dropped.
fn data<S: FrameSink>(
    s: &mut DataStream,
    sink: &S,
    runs: &[DataHeader],
    rings: &mut crate::cuda::copy::Rings,
) -> Result<(), String> {
    let grant = match sink.admit(runs) {
        Admit::Write(g) => g,
        Admit::Discard => {
            let bytes: u64 = runs.iter().map(|h| u64::from(h.byte_len)).sum();
            return discard(s, bytes);
        }
        Admit::Refuse(why) => return Err(why),
    };
    if (0..runs.len()).any(|i| grant.device(i).is_some()) {
        return super::staged::data(s, grant, runs, rings);
    }
    let mut dst: Vec<&mut [u8]> = (0..runs.len()).map(|i| grant.pages(i)).collect();
    debug_assert!(
        dst.iter()
            .zip(runs)
            .all(|(d, h)| d.len() == h.byte_len as usize),
        "a grant is the run's bytes"
    );
    // The runs of a frame are one room's: its io count covers them all.
    let mut read = read_payloads(s, &mut dst, &|| grant.enter())
        .map_err(|e| format!("data read failed: {e}"))?;
    drop(dst);
    let mut complete = Vec::with_capacity(runs.len());
    for h in runs {
        let len = h.byte_len as usize;
        let got = read.min(len);
        read -= got;
        if got < len {
            // The room ended: the rest of the run goes nowhere.
            discard(s, (len - got) as u64)?;
        }
        complete.push(got == len);
    }
    grant.finish(&complete);
    Ok(())
}

pub(super) fn discard(s: &mut DataStream, n: u64) -> Result<(), String> {
    super::discard(s, n).map_err(|e| format!("data read failed: {e}"))
}

/// Reads payload bytes into `dst` (a room's pages, one slice per run, filled in order)
/// until every slice is full: what the buffer holds, then more from the socket, a
/// `recv` at a time. A rest of at least [`DIRECT_MIN`] bytes is read straight from the
/// socket into the slices (every slice left, with the next frame's prefix into the
/// buffer), so large payloads are copied once, by the kernel; a shorter rest goes
/// through the buffer, which then also picks up the frames behind it.
///
/// `enter` counts a write into the room's pages in (the guard counts it out) and says
/// whether the room is still live; it is asked before each copy out of the buffer and
/// each `recv` straight into `dst`, and once it says no, nothing more is written into
/// `dst`. So the room's io count is held only while bytes are being written into its
/// pages: a `recv` into the buffer holds nothing, and a `recv` straight into the pages
/// gives up after `TICK` without bytes and asks again, so a room that ends is
/// drained within a tick even if its peer stopped sending mid-frame, and a slow peer is
/// never cut for it. Returns how many bytes were read into `dst` (the first ones, in
/// order); the caller discards the rest of the payload.
pub fn read_payloads<'r>(
    s: &mut DataStream,
    dst: &mut [&mut [u8]],
    enter: &dyn Fn() -> Option<IoGuard<'r>>,
) -> io::Result<usize> {
    let total: usize = dst.iter().map(|d| d.len()).sum();
    let (mut i, mut at, mut filled) = (0, 0, 0);
    s.fill = READ_BUFFER;
    while filled < total {
        if at == dst[i].len() {
            (i, at) = (i + 1, 0);
            continue;
        }
        let n = if s.is_empty() && total - filled >= DIRECT_MIN {
            s.tick()?;
            let Some(_io) = enter() else { break };
            match s.read_direct(&mut dst[i..], at) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(e) if read_again(&e) => continue,
                Err(e) => return Err(e),
            }
        } else {
            // Waits as long as the peer takes (nothing is held here).
            let have = s.fill_buf()?;
            if have.is_empty() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let Some(_io) = enter() else { break };
            let rest = &mut dst[i][at..];
            let n = have.len().min(rest.len());
            rest[..n].copy_from_slice(&have[..n]);
            s.consume(n);
            n
        };
        filled += n;
        // Past the slices `n` filled.
        let mut left = n;
        while left > 0 {
            let k = left.min(dst[i].len() - at);
            (at, left) = (at + k, left - k);
            if at == dst[i].len() && left > 0 {
                (i, at) = (i + 1, 0);
            }
        }
    }
    if total >= DIRECT_MIN {
        s.fill = DATA_FRAME_PREFIX_LEN;
    }
    Ok(filled)
}

/// [`read_payloads`] into one slice.
pub fn read_payload<'r>(
    s: &mut DataStream,
    dst: &mut [u8],
    enter: &dyn Fn() -> Option<IoGuard<'r>>,
) -> io::Result<usize> {
    read_payloads(s, &mut [dst], enter)
}

/// A read that ended without bytes and without an error of the stream: interrupted, or
/// the tick's read timeout.
fn read_again(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;
    use std::thread::JoinHandle;
    use std::time::Duration;

    use super::*;

    /// `total` bytes of a pattern, sent by `write` on a thread over a loopback
    /// connection: the bytes, the receiving end as a data connection reads it, and the
    /// writer.
    fn stream_of(
        total: usize,
        write: impl FnOnce(TcpStream, Vec<u8>) + Send + 'static,
    ) -> (Vec<u8>, DataStream, JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let bytes: Vec<u8> = (0..total).map(|i| (i * 7 + i / 251) as u8).collect();
        let send = bytes.clone();
        let writer = std::thread::spawn(move || write(TcpStream::connect(addr).unwrap(), send));
        let (s, _) = l.accept().unwrap();
        (bytes, DataStream::new(s), writer)
    }

    /// Mixed small and large payload reads, through the buffer and straight into the
    /// pages with the next bytes into the buffer, come out in stream order, and `discard`
    /// through the buffer skips exactly its bytes.
    #[test]
    fn buffered_payload_reads_keep_the_byte_order() {
        let sizes = [
            16usize,
            40,
            4096,
            3 * READ_BUFFER + 7,
            100,
            READ_BUFFER,
            1,
            300_000,
            // Straight into the pages with the next bytes into the buffer, back to back.
            DIRECT_MIN,
            32 * 1024,
            32 * 1024,
            DIRECT_MIN + 1,
            20,
            50_000,
        ];
        let total: usize = sizes.iter().sum::<usize>() + 5000;
        let (bytes, mut s, writer) = stream_of(total, |mut c, send| {
            // Odd-sized writes so that reads straddle what the buffer holds.
            for part in send.chunks(10_007) {
                c.write_all(part).unwrap();
            }
        });
        let room = crate::room::Room::new(1, 1, crate::Role::Decode, 0, ());
        let mut at = 0;
        for (i, &n) in sizes.iter().enumerate() {
            if i == 3 {
                super::super::discard(&mut s, 5000).unwrap();
                at += 5000;
            }
            // A room that ended takes nothing, and the bytes stay in the stream.
            let mut untouched = vec![0u8; n];
            assert_eq!(read_payload(&mut s, &mut untouched, &|| None).unwrap(), 0);
            assert!(untouched.iter().all(|&x| x == 0));
            let mut dst = vec![0u8; n];
            let live = || Some(room.begin_io());
            assert_eq!(read_payload(&mut s, &mut dst, &live).unwrap(), n);
            assert_eq!(room.io_in_flight(), 0);
            assert!(dst == bytes[at..at + n], "read {i} ({n} bytes) differs");
            at += n;
        }
        assert_eq!(at, total);
        writer.join().unwrap();
    }

    /// The runs of a `DataRuns` frame: small and large slices are filled in order,
    /// through the buffer and straight into several pages with one `recv`; a room that
    /// ends part way takes no byte after it, and says how many it took.
    #[test]
    fn several_runs_are_filled_in_order_and_a_room_that_ends_stops_them() {
        let sizes = [
            40usize,
            32 * 1024,
            32 * 1024,
            100,
            3 * READ_BUFFER,
            4096,
            32 * 1024,
        ];
        let one: usize = sizes.iter().sum();
        let (bytes, mut s, writer) = stream_of(2 * one + 56, |mut c, send| {
            for part in send.chunks(30_011) {
                c.write_all(part).unwrap();
            }
        });
        let room = crate::room::Room::new(1, 1, crate::Role::Decode, 0, ());
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let live = || Some(room.begin_io());
        assert_eq!(read_payloads(&mut s, &mut dst, &live).unwrap(), one);
        assert_eq!(room.io_in_flight(), 0);
        assert!(bufs.concat() == bytes[..one]);

        // The room ends after two writes into its pages: what they took is counted and
        // nothing after it is written.
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let writes = std::cell::Cell::new(0);
        let ends = || {
            writes.set(writes.get() + 1);
            (writes.get() <= 2).then(|| room.begin_io())
        };
        let took = read_payloads(&mut s, &mut dst, &ends).unwrap();
        assert!(took > 0 && took < one, "took {took}");
        let got = bufs.concat();
        assert!(got[..took] == bytes[one..one + took]);
        assert!(
            got[took..].iter().all(|&x| x == 0),
            "a byte landed after the end"
        );
        super::super::discard(&mut s, (one - took) as u64).unwrap();
        let mut tail = vec![0u8; 56];
        assert_eq!(read_payload(&mut s, &mut tail, &live).unwrap(), 56);
        assert!(tail == bytes[2 * one..]);
        writer.join().unwrap();
    }

    /// A payload read straight into the pages, whose last bytes (less than the buffer)
    /// come after a pause longer than the read tick: the rest is read through the buffer
    /// with the tick still set, and the tick's timeouts are waited out, not an error
    /// (the demo lost its prefill peer with "data read failed: Resource temporarily
    /// unavailable" when they were).
    #[test]
    fn a_rest_after_a_pause_longer_than_the_tick_is_waited_for() {
        let n = 2 * READ_BUFFER + 100;
        let (bytes, mut s, writer) = stream_of(n, move |mut c, send| {
            c.write_all(&send[..n - 100]).unwrap();
            std::thread::sleep(TICK * 5 + Duration::from_millis(20));
            c.write_all(&send[n - 100..]).unwrap();
        });
        let room = crate::room::Room::new(1, 1, crate::Role::Decode, 0, ());
        let mut dst = vec![0u8; n];
        let live = || Some(room.begin_io());
        assert_eq!(read_payload(&mut s, &mut dst, &live).unwrap(), n);
        assert!(dst == bytes);
        assert_eq!(room.io_in_flight(), 0);
        writer.join().unwrap();
    }

    /// A large run is read under a low-water mark (one wakeup for its rest), and the
    /// mark is off again for what follows: a few bytes sent after a pause (a Done frame
    /// at a room's end) are read at once. Left at the run's mark, the header read would
    /// wait for a mark's worth of bytes that never come: tcp wakes a reader only once
    /// `SO_RCVLOWAT` bytes are queued, whatever the read asked for.
    #[test]
    fn a_few_bytes_after_a_large_run_are_read_without_waiting_for_more() {
        let n = LOWAT_MAX;
        let tail = 30;
        let (peer_tx, peer_rx) = std::sync::mpsc::channel::<TcpStream>();
        let (bytes, mut s, writer) = stream_of(n + tail, move |mut c, send| {
            // The receiving end, only to see what is queued in it.
            let peer = DataStream::new(peer_rx.recv().unwrap());
            // A little first, so that the run's read begins with most of it to come:
            // the rest goes only once the reader has taken these (its read has begun),
            // and a while after, so that it is waiting for them, however late the
            // reading thread was scheduled on a loaded machine.
            c.write_all(&send[..1000]).unwrap();
            let give_up = std::time::Instant::now() + Duration::from_secs(10);
            while peer.queued() > 0 && std::time::Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(100));
            c.write_all(&send[1000..n]).unwrap();
            // Longer than a tick: the reader's timeout comes off, and it waits for
            // the socket alone.
            std::thread::sleep(TICK * 5);
            c.write_all(&send[n..]).unwrap();
            std::thread::sleep(Duration::from_secs(30));
        });
        peer_tx.send(s.sock.try_clone().unwrap()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let room = crate::room::Room::new(1, 1, crate::Role::Decode, 0, ());
            let mut dst = vec![0u8; n];
            let live = || Some(room.begin_io());
            let got = read_payload(&mut s, &mut dst, &live).unwrap();
            let run_ok = got == n && dst == bytes[..n];
            let marked = s.lowat > 1;
            let mut rest = Vec::new();
            while rest.len() < tail {
                let have = s.fill_buf().unwrap();
                assert!(!have.is_empty(), "the stream ended");
                rest.extend_from_slice(have);
                let k = have.len();
                s.consume(k);
            }
            let _ = tx.send((run_ok, marked, rest == bytes[n..]));
        });
        let (run_ok, marked, rest_ok) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the bytes after the large run were not read within 10 s");
        assert!(run_ok, "the large run arrived whole and in order");
        assert!(marked, "the large run was read under a low-water mark");
        assert!(rest_ok);
        drop(writer);
    }
}
