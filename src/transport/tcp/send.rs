//! The sending half of the TCP transport: data frames written straight from registered
//! memory with vectored writes (no staging copy), and control frames.

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::TICK;
use crate::proto::{self, DataHeader, DATA_FRAME_PREFIX_LEN};
use crate::transport::{Sent, Watch};

/// Zeros that end a frame whose room ended mid-frame.
static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// One outgoing connection shared by several workers; each frame is written whole under
/// the lock, so frames never interleave.
#[derive(Debug)]
pub struct SendConn {
    stream: Mutex<TcpStream>,
    /// The stream's socket, for [`SendConn::flush`] without the lock.
    fd: std::os::fd::RawFd,
    /// A write that makes no progress for this long fails (the peer stopped reading).
    stall: Option<Duration>,
    /// A write failed and the stream is shut: nothing more can go out on it. Relaxed:
    /// the stream itself refuses writes once shut; this only spares the attempt.
    broken: AtomicBool,
}

impl SendConn {
    /// Wraps a connected stream: writes block as the socket says.
    pub fn new(stream: TcpStream) -> Self {
        SendConn {
            fd: stream.as_raw_fd(),
            stream: Mutex::new(stream),
            stall: None,
            broken: AtomicBool::new(false),
        }
    }

    /// Wraps a connected control stream: a write that makes no progress for `stall`
    /// fails (the peer stopped reading).
    pub fn with_stall(stream: TcpStream, stall: Duration) -> io::Result<Self> {
        stream.set_write_timeout(Some(TICK.min(stall)))?;
        Ok(SendConn {
            fd: stream.as_raw_fd(),
            stream: Mutex::new(stream),
            stall: Some(stall),
            broken: AtomicBool::new(false),
        })
    }

    /// Wraps a connected data stream: a write that makes no progress for `stall` fails,
    /// and a blocked write looks at its room every few milliseconds ([`Watch`]).
    /// Little of it waits in the socket unsent ([`super::NOTSENT_LOWAT`]).
    pub fn data(stream: TcpStream, stall: Duration) -> io::Result<Self> {
        stream.set_write_timeout(Some(TICK.min(stall)))?;
        super::limit_unsent(&stream);
        Ok(SendConn {
            fd: stream.as_raw_fd(),
            stream: Mutex::new(stream),
            stall: Some(stall),
            broken: AtomicBool::new(false),
        })
    }

    /// Writes several data frames with vectored writes under one lock.
    /// While another worker holds the connection, the room is watched too: if it ends,
    /// nothing is written.
    /// With `more`, the batch's tail may wait in the socket for what follows (`MSG_MORE`)
    /// until the next write or [`SendConn::flush`].
    pub fn send_batch(
        &self,
        runs: &[(DataHeader, &[u8])],
        watch: &mut Watch<'_>,
        more: bool,
    ) -> io::Result<Sent> {
        let mut s = loop {
            if let Some(s) = self.stream.try_lock_for(TICK) {
                break s;
            }
            if (watch.ended)() {
                (watch.release)();
                return Ok(Sent::RoomEnded);
            }
        };
        self.write_batch(&mut s, runs, watch, more)
    }

    /// Sends what a write with `more` left waiting in the socket: setting `TCP_NODELAY`
    /// pushes the pending frames (Linux), and the data connections have it set anyway.
    pub fn flush(&self) {
        // The socket stays open while `self` lives.
        let _ = super::set_int_option(self.fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
    }

    /// Writes as much of `frame` as the socket takes now, without waiting for the
    /// connection or for buffer space (`MSG_DONTWAIT`); returns how many bytes went out.
    /// Nothing (0) when another thread holds the connection, the socket is full or a
    /// write fails: the caller queues the rest for the writer, which meets the failure.
    pub fn try_send_frame(&self, frame: &[u8]) -> usize {
        if self.broken.load(Ordering::Relaxed) {
            return 0;
        }
        let Some(s) = self.stream.try_lock() else {
            return 0;
        };
        let mut sent = 0;
        while sent < frame.len() {
            let rest = &frame[sent..];
            // SAFETY: the socket is open while the lock is held; `rest` is live.
            let n = unsafe {
                libc::send(
                    s.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            match n {
                n if n > 0 => sent += n as usize,
                n if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
                _ => break,
            }
        }
        sent
    }

    /// Writes an encoded control frame.
    pub fn send_frame(&self, frame: &[u8]) -> io::Result<()> {
        let mut s = self.stream.lock();
        self.write_all(&mut s, &mut [IoSlice::new(frame)], &mut 0, None, false)
            .map(|_| ())
    }

    /// Writes the runs in frames ([`frames`]), in order. If the room ends while a write
    /// waits, the frame in progress is ended with zeros and the others are dropped.
    fn write_batch(
        &self,
        s: &mut TcpStream,
        runs: &[(DataHeader, &[u8])],
        watch: &mut Watch<'_>,
        more: bool,
    ) -> io::Result<Sent> {
        let (heads, frames) = frames(runs)?;
        let mut slices = Vec::with_capacity(runs.len() + frames.len());
        for (head, carried) in &frames {
            slices.push(IoSlice::new(&heads[head.clone()]));
            slices.extend(runs[carried.clone()].iter().map(|(_, b)| IoSlice::new(b)));
        }
        // A failed write may have stopped mid-frame: the stream is out of step for good,
        // so it is shut, and the reader sees it end instead of reading the next frame's
        // bytes as this one's.
        let broken = |s: &TcpStream, e: io::Error| {
            self.broken.store(true, Ordering::Relaxed);
            let _ = s.shutdown(std::net::Shutdown::Both);
            e
        };
        let mut written = 0;
        match self.write_all(s, &mut slices, &mut written, Some(watch.ended), more) {
            Ok(false) => return Ok(Sent::All),
            Ok(true) => (watch.release)(),
            Err(e) => return Err(broken(s, e)),
        }
        // The rest of the frame in progress, if one was begun: the rest of its prefix,
        // then zeros.
        let mut at = 0;
        for (head, carried) in &frames {
            let prefix = &heads[head.clone()];
            let bytes: usize = runs[carried.clone()].iter().map(|(_, b)| b.len()).sum();
            let end = at + prefix.len() + bytes;
            if written < end {
                if written == at {
                    break; // between two frames: nothing begun
                }
                let mut tail = Vec::new();
                if written < at + prefix.len() {
                    tail.push(IoSlice::new(&prefix[written - at..]));
                }
                let mut zeros = end - written.max(at + prefix.len());
                while zeros > 0 {
                    let k = zeros.min(ZEROS.len());
                    tail.push(IoSlice::new(&ZEROS[..k]));
                    zeros -= k;
                }
                self.write_all(s, &mut tail, &mut 0, None, false)
                    .map_err(|e| broken(s, e))?;
                break;
            }
            at = end;
        }
        Ok(Sent::RoomEnded)
    }

    /// Writes every slice (adding to `written`), retrying writes that time out while
    /// `stall` has not passed since the last progress. After a write that waited or
    /// wrote only part of what was asked, asks `ended`: if it says so, stops there and
    /// returns true.
    fn write_all(
        &self,
        w: &mut TcpStream,
        mut bufs: &mut [IoSlice<'_>],
        written: &mut usize,
        ended: Option<&dyn Fn() -> bool>,
        more: bool,
    ) -> io::Result<bool> {
        IoSlice::advance_slices(&mut bufs, 0);
        let mut progress = Instant::now();
        let ended = || ended.is_some_and(|f| f());
        while !bufs.is_empty() {
            let asked: usize = bufs.iter().map(|b| b.len()).sum();
            match send_vectored(w, bufs, more) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
                    *written += n;
                    progress = Instant::now();
                    if n < asked && ended() {
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if ended() {
                        return Ok(true);
                    }
                    if self.stall.is_none_or(|stall| progress.elapsed() >= stall) {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }
}

/// Writes every byte of `runs` in the frames of [`frames`] with vectored writes,
/// waiting as the socket's write timeout allows (a timeout is an error); with `more` the
/// tail may wait in the socket for what follows (`MSG_MORE`). For a writer that holds
/// the connection for the whole batch and watches no room (the same-host path's small
/// batches, `CopyLink`).
pub(crate) fn write_frames(
    s: &TcpStream,
    runs: &[(DataHeader, &[u8])],
    more: bool,
) -> io::Result<()> {
    let (heads, frames) = frames(runs)?;
    let mut bufs: Vec<IoSlice<'_>> = Vec::with_capacity(frames.len() + runs.len());
    for (head, carried) in &frames {
        bufs.push(IoSlice::new(&heads[head.clone()]));
        bufs.extend(runs[carried.clone()].iter().map(|(_, b)| IoSlice::new(b)));
    }
    let mut bufs = &mut bufs[..];
    while !bufs.is_empty() {
        match send_vectored(s, bufs, more) {
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `writev` as `sendmsg` with `MSG_NOSIGNAL`: a peer that closed gives `EPIPE`, never a
/// SIGPIPE that would kill a host process which did not ignore it (Rust's own
/// `write` uses `send` with the same flag; its `write_vectored` uses `writev`).
fn send_vectored(s: &TcpStream, bufs: &[IoSlice<'_>], more: bool) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix; sendmsg only reads the buffers.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len().min(1024) as _;
    // SAFETY: the socket is open for the borrow's length; msg points at live iovecs.
    let flags = libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, flags) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// A run at least this long goes in a `Data` frame of its own: one `recv` per run is
/// cheap enough for it, and the receiver reads it straight into its pages anyway.
pub const RUNS_MAX_RUN: usize = 256 * 1024;

/// The most payload bytes of one `DataRuns` frame. A room that ends mid-frame still
/// costs the frame's rest in zeros, so frames stay far below [`MAX_FRAME_BYTES`].
///
/// [`MAX_FRAME_BYTES`]: super::MAX_FRAME_BYTES
pub const RUNS_FRAME_BYTES: usize = 1 << 20;

/// A batch's frames: their encoded prefixes, one after the other, and for each frame
/// its prefix's range in them and the range of runs it carries.
type Frames = (Vec<u8>, Vec<(Range<usize>, Range<usize>)>);

/// How a batch's runs go on the wire: consecutive runs shorter than [`RUNS_MAX_RUN`]
/// together in `DataRuns` frames of at most [`RUNS_FRAME_BYTES`] (and
/// [`MAX_RUNS`](proto::MAX_RUNS) runs), each other run in a `Data` frame; so a batch of
/// small pages is read by the receiver with one `recv` per frame, not one per page.
fn frames(runs: &[(DataHeader, &[u8])]) -> io::Result<Frames> {
    let invalid = |e: proto::ProtoError| io::Error::new(io::ErrorKind::InvalidInput, e.to_string());
    let (mut heads, mut frames) = (Vec::new(), Vec::new());
    let small = |i: usize| runs[i].1.len() < RUNS_MAX_RUN;
    let mut i = 0;
    while i < runs.len() {
        let (mut j, mut bytes) = (i + 1, runs[i].1.len());
        if small(i) {
            while j < runs.len()
                && j - i < proto::MAX_RUNS as usize
                && small(j)
                && bytes + runs[j].1.len() <= RUNS_FRAME_BYTES
            {
                bytes += runs[j].1.len();
                j += 1;
            }
        }
        let at = heads.len();
        if j - i == 1 {
            let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
            runs[i].0.encode_frame(&mut prefix).map_err(invalid)?;
            heads.extend_from_slice(&prefix);
        } else {
            let hdrs: Vec<DataHeader> = runs[i..j].iter().map(|(h, _)| *h).collect();
            proto::encode_runs_prefix(&hdrs, &mut heads).map_err(invalid)?;
        }
        frames.push((at..heads.len(), i..j));
        i = j;
    }
    Ok((heads, frames))
}

impl crate::transport::DataLink for SendConn {
    fn write_runs(&self, runs: &[(DataHeader, &[u8])], watch: &mut Watch<'_>) -> io::Result<Sent> {
        self.send_batch(runs, watch, false)
    }

    fn write_last_runs(
        &self,
        runs: &[(DataHeader, &[u8])],
        watch: &mut Watch<'_>,
    ) -> io::Result<Sent> {
        self.send_batch(runs, watch, true)
    }

    fn flush(&self) {
        SendConn::flush(self)
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    fn finish(&self, done_frame: &[u8]) -> io::Result<()> {
        self.send_frame(done_frame)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::proto::{self, Kind, Limits, Target};

    /// Small runs go together in `DataRuns` frames of at most `RUNS_FRAME_BYTES`; a
    /// run of `RUNS_MAX_RUN` or more, or a small run alone, in a `Data` frame.
    #[test]
    fn small_runs_share_frames_and_large_runs_go_alone() {
        let page = vec![0u8; 32 * 1024];
        let big = vec![0u8; RUNS_MAX_RUN];
        let h = |first_page: usize, n: usize| DataHeader {
            room: 1,
            generation: 1,
            target: Target::Kv,
            buffer: 0,
            first_page: first_page as u32,
            n_pages: 1,
            byte_len: n as u32,
            page_off: 0,
            digest: 0,
        };
        let per = RUNS_FRAME_BYTES / page.len();
        let mut runs: Vec<(DataHeader, &[u8])> =
            (0..=per).map(|p| (h(p, page.len()), &page[..])).collect();
        runs.push((h(per + 1, big.len()), &big));
        runs.push((h(per + 2, page.len()), &page));
        let (heads, frames) = frames(&runs).unwrap();
        let carried: Vec<_> = frames.iter().map(|(_, r)| r.clone()).collect();
        assert_eq!(
            carried,
            [0..per, per..per + 1, per + 1..per + 2, per + 2..per + 3]
        );
        let mut at = 0;
        for (head, carried) in &frames {
            let limits = proto::Limits::default();
            let mut r = &heads[head.clone()];
            let fh = proto::read_frame_header(&mut r, &limits).unwrap();
            let n = if carried.len() > 1 {
                assert_eq!(fh.kind, Kind::DataRuns);
                proto::read_runs(&mut r, &fh, &limits).unwrap().len()
            } else {
                assert_eq!(fh.kind, Kind::Data);
                proto::read_data_header(&mut r, &fh, &limits).unwrap();
                1
            };
            assert!(r.is_empty(), "the prefix is the headers only");
            assert_eq!(n, carried.len());
            assert_eq!(head.start, at);
            at = head.end;
        }
        assert_eq!(at, heads.len());
    }

    /// A data connection keeps at most `NOTSENT_LOWAT` bytes unsent in its socket: with
    /// the kernel's default a 4 MiB send buffer of them can wait there.
    #[test]
    fn a_data_connection_limits_what_waits_unsent() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let _r = l.accept().unwrap();
        let fd = w.as_raw_fd();
        let conn = SendConn::data(w, Duration::from_secs(10)).unwrap();
        let v = super::super::int_option(fd, libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT);
        assert_eq!(v.unwrap() as usize, super::super::NOTSENT_LOWAT);
        drop(conn);
    }

    /// A room's last batch may wait in the socket for its Done (`MSG_MORE`); `flush`
    /// sends it at once. (Without the flush the frame stays back: checked first, so the
    /// test shows the hold it guards against.)
    #[test]
    fn a_last_batch_held_for_its_done_goes_out_on_flush() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        w.set_nodelay(true).unwrap();
        let (mut r, _) = l.accept().unwrap();
        r.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let conn = SendConn::data(w, Duration::from_secs(10)).unwrap();
        let page = vec![0x5Au8; 4096];
        let h = DataHeader {
            room: 3,
            generation: 1,
            target: Target::Kv,
            buffer: 0,
            first_page: 0,
            n_pages: 1,
            byte_len: page.len() as u32,
            page_off: 0,
            digest: 0,
        };
        let never = || false;
        let mut release = || {};
        let mut watch = Watch {
            ended: &never,
            release: &mut release,
        };
        let sent = conn.send_batch(&[(h, &page)], &mut watch, true).unwrap();
        assert_eq!(sent, Sent::All);
        let mut buf = vec![0u8; DATA_FRAME_PREFIX_LEN + page.len()];
        let held = r.read(&mut buf);
        assert!(
            held.is_err(),
            "the frame went out before the flush: {held:?}"
        );
        conn.flush();
        r.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        r.read_exact(&mut buf).unwrap();
        assert!(buf[DATA_FRAME_PREFIX_LEN..].iter().all(|&x| x == 0x5A));
    }

    /// A batch blocked on a reader that does not read, whose room ends meanwhile: the
    /// frame in progress is ended with zeros, the others are not sent, the room's io is
    /// released once, and the stream holds only whole frames.
    #[test]
    fn a_batch_whose_room_ends_while_blocked_ends_its_frame_with_zeros() {
        const FRAME: usize = 1 << 20;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut r, _) = l.accept().unwrap();
        let conn = SendConn::data(w, Duration::from_secs(10)).unwrap();
        let pages: Vec<Vec<u8>> = (0..8u8).map(|k| vec![k | 0x80; FRAME]).collect();
        let ended = AtomicBool::new(false);
        let released = AtomicUsize::new(0);
        let reader = std::thread::spawn(move || {
            // Read nothing until the writer has surely blocked and seen the room end.
            std::thread::sleep(Duration::from_millis(300));
            let mut all = Vec::new();
            r.read_to_end(&mut all).unwrap();
            all
        });
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                ended.store(true, Ordering::SeqCst);
            });
            let runs: Vec<(DataHeader, &[u8])> = pages
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    let h = DataHeader {
                        room: 7,
                        generation: 1,
                        target: Target::Kv,
                        buffer: 0,
                        first_page: k as u32,
                        n_pages: 1,
                        byte_len: FRAME as u32,
                        page_off: 0,
                        digest: 0,
                    };
                    (h, &p[..])
                })
                .collect();
            let ended_now = || ended.load(Ordering::SeqCst);
            let mut release = || {
                released.fetch_add(1, Ordering::SeqCst);
            };
            let mut watch = Watch {
                ended: &ended_now,
                release: &mut release,
            };
            let sent = conn.send_batch(&runs, &mut watch, false).unwrap();
            assert_eq!(sent, Sent::RoomEnded);
        });
        assert_eq!(released.load(Ordering::SeqCst), 1);
        drop(conn);
        let all = reader.join().unwrap();
        // Parse: whole frames only, each page's bytes then (in the last one) zeros.
        let mut at = &all[..];
        let mut frames = 0;
        let mut zeros = false;
        while !at.is_empty() {
            let limits = Limits::default();
            let h = proto::read_frame_header(&mut at, &limits).unwrap();
            assert_eq!(h.kind, Kind::Data);
            let d = proto::read_data_header(&mut at, &h, &limits).unwrap();
            assert_eq!(d.first_page, frames);
            let (payload, rest) = at.split_at(d.byte_len as usize);
            let want = frames as u8 | 0x80;
            let cut = payload.iter().position(|&x| x != want).unwrap_or(FRAME);
            assert!(payload[cut..].iter().all(|&x| x == 0), "frame {frames}");
            assert!(!zeros, "a frame after the one ended with zeros");
            zeros = cut < FRAME;
            at = rest;
            frames += 1;
        }
        assert!(
            (frames as usize) < pages.len() || zeros,
            "the whole batch went out although its room ended"
        );
    }
}
