//! The prefill side of the same-host path ([`super::samehost`] says why the decode
//! engine copies): a data connection on which a batch goes out as one `Copy` message
//! (each run's header and the address of its bytes here) and ends when the decode engine
//! answers `Copied`, since the decode process reads the pages until then.
//!
//! Up to [`MAX_IN_FLIGHT`] batches are in flight on a link: the sender writes a batch's
//! `Copy` and takes its next batch at once, and the link's reader thread ends each batch
//! (the [`BatchEnd`] its sender gave, which holds the room's io count) when its answer
//! comes. The decode engine answers a connection's copies in their order, so the answers
//! come in the order of the batches. A batch waiting longer than the stall for its answer
//! (the decode process stopped, say) breaks the link, and every batch waiting on it ends
//! with the error, so a room's io count never waits on a peer for longer than that.
//!
//! An answer that ends a room's last batch completes the room on the reader thread, which
//! then writes the room's Done; it holds the Done frames back until it has served every
//! answer it read, and writes them together.
//!
//! A batch of host memory of at most [`INLINE_MAX_BYTES`] is not copied: it goes inline
//! in data frames as over TCP (`write_runs`), ends once written, and has no answer.

use std::collections::VecDeque;
use std::io::{self, BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{BatchEnd, DataLink, Pipelined, Sent, Watch};
use crate::proto::{self, DataHeader, Kind, Limits, Message, ReadError};

/// A batch of host memory of at most this many bytes goes inline, as a TCP data frame on
/// the same connection, instead of as a copy: below it, the copy's answer and the Done
/// that must wait for it (three crossings between the processes, each a wakeup) cost more
/// than the two kernel copies of the bytes (one crossing, the Done right behind).
pub const INLINE_MAX_BYTES: usize = 64 << 10;

/// The most batches a link keeps waiting for their answers; a sender with one more waits.
pub const MAX_IN_FLIGHT: usize = 16;

/// A batch whose `Copy` went out, waiting for its answer.
struct Waiting {
    room: u64,
    generation: u64,
    since: Instant,
    end: BatchEnd,
}

/// The batches waiting for their answers, in the order their `Copy` went out.
struct Queue {
    waiting: VecDeque<Waiting>,
    /// Why the link broke; once set nothing more is queued.
    broken: Option<String>,
}

/// What a link and its reader thread share.
struct Shared {
    /// The writing half: `Copy` and `Done` frames.
    stream: Mutex<TcpStream>,
    queue: Mutex<Queue>,
    /// Signalled when an answer frees a place in the queue, or the link breaks.
    space: Condvar,
    /// Whether the link broke (a copy of `queue.broken` that needs no lock).
    broken: AtomicBool,
    /// The connection, shut when the link breaks so that both threads leave it.
    socket: TcpStream,
    /// The reader thread, once it runs: a Done it writes (an answer completed a room)
    /// waits in `done` until it has served every answer it read, then goes out with the
    /// others in one write.
    reader: OnceLock<ThreadId>,
    done: Mutex<Vec<u8>>,
}

impl Shared {
    /// Breaks the link (once) and ends every waiting batch with `why`.
    fn broke(&self, why: String) {
        let ended: Vec<Waiting> = {
            let mut q = self.queue.lock();
            if q.broken.is_none() {
                q.broken = Some(why.clone());
                self.broken.store(true, Ordering::Relaxed);
                let _ = self.socket.shutdown(Shutdown::Both);
            }
            self.space.notify_all();
            q.waiting.drain(..).collect()
        };
        for w in ended {
            (w.end)(Err(io::Error::other(why.clone())));
        }
    }

    /// Writes the Done frames the reader thread held back (see [`CopyLink::finish`]).
    fn send_done(&self) -> io::Result<()> {
        let mut done = self.done.lock();
        if done.is_empty() {
            return Ok(());
        }
        let written = self.stream.lock().write_all(&done);
        done.clear();
        written
    }
}

/// A same-host data connection of a prefill engine (see the module's documentation).
pub struct CopyLink {
    shared: Arc<Shared>,
    stall: Duration,
}

impl CopyLink {
    /// Wraps an accepted data connection; a write or an answer that takes longer than
    /// `stall` breaks the link. `spawn` starts the link's reader thread (the engine's
    /// own, joined when it stops).
    pub fn new(
        stream: TcpStream,
        stall: Duration,
        limits: Limits,
        spawn: impl FnOnce(Box<dyn FnOnce() + Send>) -> Result<(), String>,
    ) -> Result<CopyLink, String> {
        let setup = |e: io::Error| format!("same-host data connection: {e}");
        stream.set_write_timeout(Some(stall)).map_err(setup)?;
        // The reader wakes at least twice a stall to look at its oldest batch.
        let tick = (stall / 2).max(Duration::from_millis(10));
        stream.set_read_timeout(Some(tick)).map_err(setup)?;
        let reader = stream.try_clone().map_err(setup)?;
        let socket = stream.try_clone().map_err(setup)?;
        let shared = Arc::new(Shared {
            stream: Mutex::new(stream),
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                broken: None,
            }),
            space: Condvar::new(),
            broken: AtomicBool::new(false),
            socket,
            reader: OnceLock::new(),
            done: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        spawn(Box::new(move || {
            let read = std::panic::AssertUnwindSafe(|| read_answers(&s, reader, &limits, stall));
            if std::panic::catch_unwind(read).is_err() {
                s.broke("internal error: the reader of copy answers panicked".into());
            }
        }))?;
        Ok(CopyLink { shared, stall })
    }
}

/// The reader thread: ends each waiting batch when its answer comes, and breaks the link
/// when an answer is wrong or late, or the connection ends.
fn read_answers(shared: &Shared, stream: TcpStream, limits: &Limits, stall: Duration) {
    let _ = shared.reader.set(std::thread::current().id());
    let mut r = BufReader::new(stream);
    let why = loop {
        if shared.broken.load(Ordering::Relaxed) {
            return;
        }
        if r.buffer().is_empty() {
            if let Err(e) = shared.send_done() {
                break format!("writing Done failed: {e}");
            }
        }
        let answer = proto::read_frame_header(&mut r, limits).and_then(|h| match h.kind {
            Kind::Copied => proto::read_control(&mut r, &h, limits),
            k => Err(ReadError::Proto(proto::ProtoError::NotControlKind {
                kind: k,
            })),
        });
        let (room, generation, whole) = match answer {
            Ok(Message::Copied {
                room,
                generation,
                whole,
            }) => (room, generation, whole),
            Ok(m) => break format!("a {} frame in place of a copy's answer", m.kind().name()),
            Err(ReadError::Idle(_)) => {
                let q = shared.queue.lock();
                match q.waiting.front() {
                    Some(w) if w.since.elapsed() >= stall => {
                        break format!(
                            "no answer to a copy of room {} in {} ms",
                            w.room,
                            stall.as_millis()
                        )
                    }
                    _ => continue,
                }
            }
            Err(e) => break format!("no answer to a copy: {e}"),
        };
        let ended = {
            let mut q = shared.queue.lock();
            match q.waiting.front() {
                Some(w) if (w.room, w.generation) == (room, generation) => {
                    shared.space.notify_one();
                    q.waiting.pop_front()
                }
                _ => None,
            }
        };
        match ended {
            Some(w) => (w.end)(Ok(if whole { Sent::All } else { Sent::RoomEnded })),
            None => break format!("an answer for room {room} that no copy waits for"),
        }
    };
    shared.broke(why);
}

impl Pipelined for CopyLink {
    /// One thread starts batches on a link (its sender): the answers come in the order
    /// the `Copy` frames went out, which is the order of the queue.
    fn start(&self, runs: &[(DataHeader, u64)], end: BatchEnd) {
        let Some((first, _)) = runs.first() else {
            return end(Ok(Sent::All));
        };
        let msg = Message::Copy {
            runs: runs.to_vec(),
        };
        let mut frame = Vec::new();
        if let Err(e) = msg.encode(&mut frame) {
            return end(Err(io::Error::other(e)));
        }
        let mut end = Some(end);
        loop {
            // A place in the queue, waited for without the stream's lock: the reader
            // writes Done frames under it when an answer completes a room.
            {
                let mut q = self.shared.queue.lock();
                while q.broken.is_none() && q.waiting.len() >= MAX_IN_FLIGHT {
                    self.shared.space.wait_for(&mut q, self.stall);
                }
            }
            let mut s = self.shared.stream.lock();
            let mut q = self.shared.queue.lock();
            if let Some(why) = q.broken.clone() {
                drop((q, s));
                let end = end.take().expect("a batch ends once");
                return end(Err(io::Error::other(why)));
            }
            if q.waiting.len() >= MAX_IN_FLIGHT {
                continue; // taken meanwhile (a batch started on another thread)
            }
            q.waiting.push_back(Waiting {
                room: first.room,
                generation: first.generation,
                since: Instant::now(),
                end: end.take().expect("a batch ends once"),
            });
            drop(q);
            let written = s.write_all(&frame);
            drop(s);
            if let Err(e) = written {
                self.shared.broke(format!("writing a copy failed: {e}"));
            }
            return;
        }
    }
}

impl CopyLink {
    /// Writes a small batch inline ([`INLINE_MAX_BYTES`]) in data frames, as over TCP.
    fn inline(&self, runs: &[(DataHeader, &[u8])], more: bool) -> io::Result<Sent> {
        let written = super::tcp::send::write_frames(&self.shared.stream.lock(), runs, more);
        if let Err(e) = &written {
            self.shared
                .broke(format!("writing a batch inline failed: {e}"));
        }
        written.map(|()| Sent::All)
    }
}

impl DataLink for CopyLink {
    /// A small batch of host memory, sent inline (see [`INLINE_MAX_BYTES`]): one
    /// `DataRuns` frame with the runs' bytes, which the decode engine reads into its
    /// pages as over TCP. Returns once the bytes are in the socket (no answer comes).
    fn write_runs(&self, runs: &[(DataHeader, &[u8])], _: &mut Watch<'_>) -> io::Result<Sent> {
        self.inline(runs, false)
    }

    /// As `write_runs`, the frame's tail waiting in the socket for the room's Done
    /// (`MSG_MORE`), as over TCP.
    fn write_last_runs(&self, runs: &[(DataHeader, &[u8])], _: &mut Watch<'_>) -> io::Result<Sent> {
        self.inline(runs, true)
    }

    /// Sends what a write with `more` left waiting in the socket: setting `TCP_NODELAY`
    /// pushes the pending frames (Linux).
    fn flush(&self) {
        let fd = self.shared.socket.as_raw_fd();
        let _ = super::tcp::set_int_option(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
    }

    fn as_pipelined(&self) -> Option<&dyn Pipelined> {
        Some(self)
    }

    fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Relaxed)
    }

    /// On the reader thread (an answer completed the room) the frame waits until the
    /// reader served every answer it has read, and goes out with the others then.
    fn finish(&self, done_frame: &[u8]) -> io::Result<()> {
        let shared = &self.shared;
        if shared.reader.get() == Some(&std::thread::current().id()) {
            shared.done.lock().extend_from_slice(done_frame);
            return Ok(());
        }
        let written = shared.stream.lock().write_all(done_frame);
        if let Err(e) = &written {
            self.shared.broke(format!("writing Done failed: {e}"));
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::sync::mpsc;

    use super::*;
    use crate::proto::Target;

    /// A link over loopback (its reader on a plain thread) and the decode end of it.
    fn link(stall: Duration) -> (CopyLink, BufReader<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        let spawn = |f: Box<dyn FnOnce() + Send>| {
            std::thread::spawn(f);
            Ok(())
        };
        let link = CopyLink::new(ours, stall, Limits::default(), spawn).unwrap();
        (link, BufReader::new(theirs))
    }

    fn header(room: u64) -> DataHeader {
        DataHeader {
            room,
            generation: 1,
            target: Target::Kv,
            buffer: 0,
            first_page: 0,
            n_pages: 1,
            byte_len: 4,
            page_off: 0,
            digest: 0,
        }
    }

    /// Starts a batch of room `room`; its end goes to `ends` with the room.
    fn start(link: &CopyLink, room: u64, ends: &mpsc::Sender<(u64, io::Result<Sent>)>) {
        let bytes = [0u8; 4];
        let ends = ends.clone();
        link.start(
            &[(header(room), bytes.as_ptr() as u64)],
            Box::new(move |r| ends.send((room, r)).unwrap()),
        );
    }

    fn read_copy(r: &mut BufReader<TcpStream>) -> u64 {
        let limits = Limits::default();
        let h = proto::read_frame_header(r, &limits).unwrap();
        match proto::read_control(r, &h, &limits).unwrap() {
            Message::Copy { runs } => runs[0].0.room,
            m => panic!("{} in place of a copy", m.kind().name()),
        }
    }

    fn answer(w: &mut TcpStream, room: u64, whole: bool) {
        let mut frame = Vec::new();
        Message::Copied {
            room,
            generation: 1,
            whole,
        }
        .encode(&mut frame)
        .unwrap();
        w.write_all(&frame).unwrap();
    }

    /// Three batches start without waiting for an answer (the decode end reads all three
    /// before it answers any), and each ends when its answer comes, in order.
    #[test]
    fn batches_are_in_flight_together_and_end_on_their_answers_in_order() {
        let (link, mut r) = link(Duration::from_secs(10));
        let (tx, rx) = mpsc::channel();
        for room in 1..=3 {
            start(&link, room, &tx);
        }
        assert_eq!(
            [read_copy(&mut r), read_copy(&mut r), read_copy(&mut r)],
            [1, 2, 3]
        );
        assert!(rx.try_recv().is_err(), "a batch ended before its answer");
        let mut w = r.get_ref().try_clone().unwrap();
        answer(&mut w, 1, true);
        answer(&mut w, 2, false);
        answer(&mut w, 3, true);
        let ends: Vec<(u64, Sent)> = (0..3)
            .map(|_| {
                let (room, r) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
                (room, r.unwrap())
            })
            .collect();
        assert_eq!(ends, [(1, Sent::All), (2, Sent::RoomEnded), (3, Sent::All)]);
        assert!(!link.is_broken());
    }

    /// A Done written by a batch's end (on the reader thread, as when an answer
    /// completes a room) waits until the reader served the answers it read, then goes
    /// out: every one arrives, in order, after the answers that completed the rooms.
    #[test]
    fn dones_written_as_answers_complete_rooms_go_out_once_the_answers_are_served() {
        let (link, mut r) = link(Duration::from_secs(10));
        let link = Arc::new(link);
        for room in 1..=3u64 {
            let bytes = [0u8; 4];
            let l = link.clone();
            let end = Box::new(move |_| {
                let mut done = Vec::new();
                Message::Done {
                    room,
                    generation: 1,
                    pages_sent: 1,
                    aux_sent: false,
                }
                .encode(&mut done)
                .unwrap();
                l.finish(&done).unwrap();
            });
            link.start(&[(header(room), bytes.as_ptr() as u64)], end);
        }
        for room in 1..=3 {
            assert_eq!(read_copy(&mut r), room);
        }
        let mut w = r.get_ref().try_clone().unwrap();
        for room in 1..=3 {
            answer(&mut w, room, true);
        }
        let limits = Limits::default();
        for want in 1..=3 {
            let h = proto::read_frame_header(&mut r, &limits).unwrap();
            match proto::read_control(&mut r, &h, &limits).unwrap() {
                Message::Done { room, .. } => assert_eq!(room, want),
                m => panic!("{} in place of Done", m.kind().name()),
            }
        }
    }

    /// A small batch goes inline: one `DataRuns` frame with the runs' headers and bytes,
    /// ended at once (no answer waits), and the link stays whole.
    #[test]
    fn a_small_batch_goes_inline_as_one_data_frame() {
        let (link, mut r) = link(Duration::from_secs(10));
        let (a, b) = ([1u8; 4], [2u8; 4]);
        let mut h2 = header(7);
        h2.first_page = 1;
        let mut watch_ended = || false;
        let mut release = || {};
        let mut watch = Watch {
            ended: &mut watch_ended,
            release: &mut release,
        };
        let sent = link
            .write_runs(&[(header(7), &a[..]), (h2, &b[..])], &mut watch)
            .unwrap();
        assert_eq!(sent, Sent::All);
        let limits = Limits::default();
        let h = proto::read_frame_header(&mut r, &limits).unwrap();
        assert_eq!(h.kind, Kind::DataRuns);
        let n = proto::read_runs_count(&mut r, &h, &limits).unwrap();
        let runs = proto::read_run_headers(&mut r, &h, n, &limits).unwrap();
        assert_eq!(runs, vec![header(7), h2]);
        let mut bytes = [0u8; 8];
        std::io::Read::read_exact(&mut r, &mut bytes).unwrap();
        assert_eq!(bytes, [1, 1, 1, 1, 2, 2, 2, 2]);
        assert!(!link.is_broken());
        // More runs than one DataRuns frame may carry: split as over TCP, not refused.
        let many: Vec<(DataHeader, &[u8])> = (0..1200u32)
            .map(|i| {
                let mut h = header(8);
                h.first_page = i;
                (h, &a[..])
            })
            .collect();
        assert_eq!(link.write_runs(&many, &mut watch).unwrap(), Sent::All);
        let mut got = 0;
        while got < many.len() {
            let h = proto::read_frame_header(&mut r, &limits).unwrap();
            assert_eq!(h.kind, Kind::DataRuns);
            let n = proto::read_runs_count(&mut r, &h, &limits).unwrap();
            let runs = proto::read_run_headers(&mut r, &h, n, &limits).unwrap();
            assert_eq!(runs[0].first_page, got as u32);
            let mut payload = vec![0u8; runs.len() * 4];
            std::io::Read::read_exact(&mut r, &mut payload).unwrap();
            got += runs.len();
        }
        assert_eq!(got, many.len());
    }

    /// No answer within the stall: the link breaks, every waiting batch ends with the
    /// error, and a batch started afterwards ends with it at once.
    #[test]
    fn a_late_answer_breaks_the_link_and_ends_every_waiting_batch() {
        let stall = Duration::from_millis(100);
        let (link, mut r) = link(stall);
        let (tx, rx) = mpsc::channel();
        let t0 = Instant::now();
        start(&link, 1, &tx);
        start(&link, 2, &tx);
        read_copy(&mut r);
        for want in [1, 2] {
            let (room, e) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(room, want);
            let e = e.unwrap_err().to_string();
            assert!(e.contains("no answer to a copy of room 1"), "{e}");
        }
        assert!(t0.elapsed() >= stall);
        assert!(link.is_broken());
        start(&link, 3, &tx);
        let (room, e) = rx.recv_timeout(Duration::from_secs(1)).unwrap();
        assert_eq!(room, 3);
        assert!(e.is_err());
    }

    /// An answer for a room no copy waits for (or out of order) breaks the link.
    #[test]
    fn an_answer_out_of_order_breaks_the_link() {
        let (link, mut r) = link(Duration::from_secs(10));
        let (tx, rx) = mpsc::channel();
        start(&link, 1, &tx);
        start(&link, 2, &tx);
        read_copy(&mut r);
        read_copy(&mut r);
        answer(&mut r.get_ref().try_clone().unwrap(), 2, true);
        for _ in 0..2 {
            let (_, e) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            let e = e.unwrap_err().to_string();
            assert!(
                e.contains("an answer for room 2 that no copy waits for"),
                "{e}"
            );
        }
        assert!(link.is_broken());
    }

    /// A sender with [`MAX_IN_FLIGHT`] batches waiting waits for an answer before its
    /// next batch goes out.
    #[test]
    fn a_full_link_holds_the_next_batch_until_an_answer() {
        let (link, mut r) = link(Duration::from_secs(10));
        let link = Arc::new(link);
        let (tx, rx) = mpsc::channel();
        for room in 0..MAX_IN_FLIGHT as u64 {
            start(&link, room, &tx);
        }
        let started = Arc::new(AtomicBool::new(false));
        let next = {
            let (link, tx, started) = (link.clone(), tx.clone(), started.clone());
            std::thread::spawn(move || {
                start(&link, 99, &tx);
                started.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !started.load(Ordering::SeqCst),
            "a batch beyond the limit went out"
        );
        for room in 0..MAX_IN_FLIGHT as u64 {
            assert_eq!(read_copy(&mut r), room);
        }
        answer(&mut r.get_ref().try_clone().unwrap(), 0, true);
        next.join().unwrap();
        assert_eq!(read_copy(&mut r), 99);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap().0, 0);
    }
}
