//! A prefill engine whose one decode engine is a fake one ([`super::fake`]) that stops
//! reading its data connection: a room's first chunk is larger than the socket buffers,
//! so its write blocks inside it, and whatever the scheduler enqueues behind it is
//! still queued when the test aborts the room. The sender's skip path (DESIGN.md
//! invariant 4) is then taken for certain, not by chance, whatever the threads do.

use std::io::Read;
use std::net::TcpStream;
use std::time::Duration;

use kvxfer::proto::{self, DataHeader, Kind, Limits, Message};
use kvxfer::{Cause, Engine, RoomPeers, State};

use super::fake::{self, destination, KeepAlive};
use super::memory::{pattern, source, Region};
use super::wait::{wait_state, wait_until};

/// Bytes of a page: a data frame holds 16 of them (4 MiB).
pub const PAGE: usize = 256 * 1024;
/// Pages of the chunk that blocks: 16 MiB per kv buffer, four frames, more than the
/// socket buffers of the loopback hold (4 MiB to send at most, and the receiver's
/// window, which does not grow while nobody reads).
pub const BLOCKING: u32 = 64;
/// Pages of the room's last chunk, behind it.
pub const LAST: u32 = 2;
/// Frames of a whole kv buffer of the blocking chunk.
const FRAMES: usize = (BLOCKING as usize * PAGE).div_ceil(4 << 20);

/// One worker and one data connection: the room's batches and the marker room's go
/// through one sender, in the order of the rooms.
const ONE_WORKER: &[(&str, &str)] = &[
    // The fake speaks TCP only, whatever path the suite runs over.
    ("transport", "tcp"),
    ("same_host", "off"),
    ("workers", "1"),
    ("connections_per_peer", "1"),
];

/// A prefill engine of `bufs` kv buffers of [`BLOCKING`] + [`LAST`] source pages and a
/// fake decode engine of the same that reads its data connection only when told.
pub struct SlowReader {
    pub p: Engine,
    _mem: Vec<Region>,
    /// The fake's control connection, read for the prefill's Aborts.
    ctrl: TcpStream,
    /// Heartbeats on the control connection, and the fake's messages between them.
    keep: KeepAlive,
    data: TcpStream,
    bufs: usize,
}

impl SlowReader {
    pub fn new(bufs: usize) -> SlowReader {
        let pages = (BLOCKING + LAST) as usize;
        let mem = source(bufs, pages, PAGE);
        let p = super::engine::engine("prefill", &mem, ONE_WORKER);
        let id = 0x510E;
        let ctrl = fake::decode_ctrl(p.address(), id, bufs, pages, PAGE);
        let keep = KeepAlive::on(&ctrl);
        let data = fake::decode_data(p.address(), id, 0);
        SlowReader {
            p,
            _mem: mem,
            ctrl,
            keep,
            data,
            bufs,
        }
    }

    /// Creates prefill room `room` and sends its destination of `pages` pages (its
    /// generation: the room id); the room waits for input.
    pub fn ready(&self, room: u64, pages: u32) {
        self.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        self.keep
            .send(&destination(room, room, (0..pages).collect()));
        wait_state(&self.p, room, State::WaitingForInput);
    }

    /// Waits until the first bytes of a data frame wait in the fake's socket: the
    /// sender took the room's first batch, and cannot finish the chunk while nobody
    /// reads.
    pub fn wait_blocked(&self, room: u64) {
        let mut first = [0u8; 1];
        assert_eq!(self.data.peek(&mut first).unwrap(), 1, "the engine hung up");
        assert_eq!(self.p.room_poll(room).unwrap(), State::Transferring);
    }

    /// Aborts `room` with `reason` from the prefill's scheduler, or from the fake
    /// decode engine (its Abort on the control connection); the prefill room is FAILED
    /// when this returns, with the reason, first-hand or from the peer.
    pub fn abort(&mut self, room: u64, from_decode: bool, reason: &str) {
        if from_decode {
            self.keep.send(&Message::Abort {
                room,
                generation: room,
                reason: reason.into(),
            });
            wait_state(&self.p, room, State::Failed);
        } else {
            self.p.room_abort(room, reason).unwrap();
            assert_eq!(self.p.room_poll(room).unwrap(), State::Failed);
            // The decode side is told.
            match fake::recv_past_heartbeats(&mut self.ctrl) {
                Message::Abort {
                    room: r,
                    generation,
                    reason: why,
                } => {
                    assert_eq!((r, generation), (room, room));
                    assert!(why.contains(reason), "{why}");
                }
                m => panic!("expected the Abort of room {room}, got {m:?}"),
            }
        }
        let why = self.p.room_failure(room).unwrap();
        assert_eq!(why.cause, Cause::Aborted, "{why}");
        assert_eq!(why.from_peer, from_decode, "{why}");
        assert!(why.message.contains(reason), "{why}");
    }

    /// Sends room `marker`, one page of every kv buffer, behind everything queued for
    /// older rooms; then reads the data connection, from its first byte, to the
    /// marker's Done, which ends it: every older room's item was taken from the outbox
    /// before the marker's. Checks the marker's frames (whole, its page's bytes) and
    /// returns the other data frames (`room`'s: any other room's, or a Done that is not
    /// the marker's, fails the test), each with its payload.
    pub fn read_to_marker(&mut self, room: u64, marker: u64) -> Vec<(DataHeader, Vec<u8>)> {
        self.ready(marker, 1);
        self.p.enqueue_chunk(marker, &[0], true, None).unwrap();
        let l = Limits::default();
        let mut frames = Vec::new();
        let mut marker_frames = 0;
        loop {
            let h = proto::read_frame_header(&mut self.data, &l).unwrap();
            if h.kind == Kind::Done {
                match proto::read_control(&mut self.data, &h, &l).unwrap() {
                    Message::Done { room: r, .. } if r == marker => break,
                    done => panic!("{done:?} before the marker's (room {room} aborted)"),
                }
            }
            let dh = proto::read_data_header(&mut self.data, &h, &l).unwrap();
            let mut payload = vec![0u8; dh.byte_len as usize];
            self.data.read_exact(&mut payload).unwrap();
            match dh.room {
                r if r == room => frames.push((dh, payload)),
                r if r == marker => {
                    assert!(
                        true_prefix(&dh, &payload) == payload.len(),
                        "the marker's frame is not its page"
                    );
                    marker_frames += 1;
                }
                r => panic!("a frame for room {r}"),
            }
        }
        assert_eq!(marker_frames, self.bufs, "the marker's frames");
        frames
    }

    /// Whether nothing more comes on the data connection within `window`.
    pub fn data_quiet_for(&mut self, window: Duration) -> bool {
        self.data.set_read_timeout(Some(window)).unwrap();
        let mut byte = [0u8; 1];
        let quiet = match self.data.read(&mut byte) {
            Ok(n) => n == 0,
            Err(e) => matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        };
        self.data.set_read_timeout(Some(fake::READ_LIMIT)).unwrap();
        quiet
    }

    /// The end of a test: `room` stays FAILED and drained, the marker SUCCESS, the peer
    /// was never cut, nothing is in flight, and once both rooms are cleared nothing is
    /// left.
    pub fn assert_nothing_left(&mut self, room: u64, marker: u64) {
        assert_eq!(super::wait::wait_terminal(&self.p, marker), State::Success);
        assert_eq!(self.p.room_poll(room).unwrap(), State::Failed);
        wait_until("the aborted room to drain", || {
            self.p.room_drained(room).unwrap()
        });
        assert!(
            self.data_quiet_for(Duration::from_millis(100)),
            "bytes came after the marker's Done"
        );
        let m = self.p.metrics();
        assert_eq!(m.peers_lost, 0, "the slow reader was cut");
        assert_eq!(m.inflight, 0);
        assert_eq!(m.chunks, 1, "a chunk of room {room} counts as sent");
        for r in [room, marker] {
            self.p.room_clear(r).unwrap();
        }
        assert_eq!(self.p.room_count(), 0);
        assert_eq!(self.p.metrics().rooms_draining, 0);
    }
}

/// How many of a frame's first bytes are its source pages' (the [`pattern`] of its kv
/// buffer, its first page on).
pub fn true_prefix(h: &DataHeader, payload: &[u8]) -> usize {
    let (b, first) = (h.buffer as usize, h.first_page as usize);
    payload
        .iter()
        .enumerate()
        .position(|(i, &x)| x != pattern(b, first + i / PAGE, i % PAGE))
        .unwrap_or(payload.len())
}

/// Checks the frames the aborted room sent (as [`SlowReader::read_to_marker`] returns
/// them): every one is of kv buffer 0 and of the blocking chunk's pages (nothing of a
/// call queued behind it); each holds that page's bytes, then zeros only where the
/// abort cut it, and only the last may be cut; the chunk did not go out whole. Returns
/// whether the last one was cut.
pub fn assert_cut_in_the_blocking_chunk(frames: &[(DataHeader, Vec<u8>)]) -> bool {
    let mut cut = false;
    for (k, (h, payload)) in frames.iter().enumerate() {
        assert_eq!(
            h.buffer, 0,
            "frame {k} is of a call queued behind the block"
        );
        assert!(
            h.first_page + h.n_pages <= BLOCKING,
            "frame {k} (pages {}+{}) is of the last chunk",
            h.first_page,
            h.n_pages
        );
        let n = true_prefix(h, payload);
        assert!(payload[n..].iter().all(|&x| x == 0), "frame {k}: {h:?}");
        if n < payload.len() {
            assert_eq!(k, frames.len() - 1, "zeros before the room's last frame");
            cut = true;
        }
    }
    assert!(
        cut || frames.len() < FRAMES,
        "the blocking chunk went out whole although nobody read ({} frames)",
        frames.len()
    );
    cut
}
