//! The receiving half of the TCP transport: one thread per data connection reads frames
//! and writes each payload straight into the pages the engine grants it.
//!
//! The transport does not decide where a frame may go: it asks a [`FrameSink`] (the
//! decode engine, which checks the frame against the room's grant, invariant 8) and
//! only then writes, into exactly the bytes granted, under the room's io count, asking
//! the room again before each write ([`read_payload`]).

use std::io::{self, BufRead, BufReader, Read};
use std::net::TcpStream;

use super::TICK;
use crate::proto::{self, DataHeader, Kind, Limits, Message, ReadError};
use crate::room::IoGuard;

/// Read buffer of a data connection: headers and small frames (a few KiB per page on
/// small models) come out of one `recv` per buffer-full instead of three per frame.
/// Payload reads at least this long bypass it and land straight in the pages.
pub const READ_BUFFER: usize = 64 * 1024;

/// A data connection as the receiver reads it.
pub type DataStream = BufReader<TcpStream>;

/// Where a data frame's payload may go, as the engine decides.
pub enum Admit<G> {
    /// Into the pages the grant holds.
    Write(G),
    /// Nowhere: the room is gone or terminal; the payload is read and dropped.
    Discard,
    /// The peer broke the protocol: the connection closes with this reason.
    Refuse(String),
}

/// The pages a data frame was admitted to.
pub trait Grant {
    /// The bytes the frame's payload fills, exactly. Written only while a guard from
    /// [`Grant::enter`] is held.
    #[allow(clippy::mut_from_ref)]
    fn pages(&self) -> &mut [u8];

    /// Counts one write into the pages in (until the guard drops) and says whether the
    /// room is still live; `None`: it ended, write nothing more.
    fn enter(&self) -> Option<IoGuard<'_>>;

    /// The payload has been read: into the pages whole (`complete`), or only in part
    /// before the room ended (the rest was dropped).
    fn finish(self, complete: bool);
}

/// What a data connection's frames are for: the decode engine, for one peer.
pub trait FrameSink {
    type Grant<'a>: Grant
    where
        Self: 'a;

    /// A frame's header arrived: the peer is alive.
    fn heard(&self);

    /// Where a data frame's payload goes.
    fn admit(&self, h: &DataHeader) -> Admit<Self::Grant<'_>>;

    /// A Done frame: the peer sent every frame of the room (on this or another
    /// connection).
    fn done(&self, room: u64, generation: u64, pages_sent: u32, aux_sent: bool);

    /// A protocol error ended the connection (counted by the sink).
    fn protocol_error(&self);
}

/// Reads one data connection until it ends; returns why it ended.
pub fn serve<S: FrameSink>(s: TcpStream, sink: &S, limits: &Limits) -> String {
    let mut s = BufReader::with_capacity(READ_BUFFER, s);
    loop {
        let hdr = match proto::read_frame_header(&mut s, limits) {
            Ok(h) => h,
            Err(ReadError::Closed) => return "data connection closed".to_string(),
            Err(ReadError::Proto(e)) => {
                sink.protocol_error();
                return format!("malformed frame: {e}");
            }
            Err(e) => return format!("data read failed: {e}"),
        };
        sink.heard();
        let r = match hdr.kind {
            Kind::Data => proto::read_data_header(&mut s, &hdr, limits)
                .map_err(|e| e.to_string())
                .and_then(|dh| data(&mut s, sink, &dh)),
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

/// One data frame whose header was read: its payload into the granted pages, or dropped.
fn data<S: FrameSink>(s: &mut DataStream, sink: &S, h: &DataHeader) -> Result<(), String> {
    let grant = match sink.admit(h) {
        Admit::Write(g) => g,
        Admit::Discard => return discard(s, h.byte_len as u64),
        Admit::Refuse(why) => return Err(why),
    };
    let dst = grant.pages();
    debug_assert_eq!(
        dst.len(),
        h.byte_len as usize,
        "a grant is the frame's bytes"
    );
    let read =
        read_payload(s, dst, &|| grant.enter()).map_err(|e| format!("data read failed: {e}"))?;
    let complete = read == dst.len();
    if !complete {
        // The room ended: the rest of the frame goes nowhere.
        discard(s, (dst.len() - read) as u64)?;
    }
    grant.finish(complete);
    Ok(())
}

fn discard(s: &mut DataStream, n: u64) -> Result<(), String> {
    super::discard(s, n).map_err(|e| format!("data read failed: {e}"))
}

/// Reads `dst.len()` payload bytes into `dst` (a room's pages): what the buffer holds,
/// then more from the socket, a `recv` at a time. A rest at least as long as the buffer
/// is read straight from the socket into `dst`, so large payloads are copied once, by
/// the kernel, as without the buffer; a shorter rest goes through the buffer, which then
/// also picks up the frames behind it.
///
/// `enter` counts a write into the room's pages in (the guard counts it out) and says
/// whether the room is still live; it is asked before each copy out of the buffer and
/// each `recv` straight into `dst`, and once it says no, nothing more is written into
/// `dst`. So the room's io count is held only while bytes are being written into its
/// pages: a `recv` into the buffer holds nothing, and a `recv` straight into the pages
/// gives up after `TICK` without bytes and asks again, so a room that ends is
/// drained within a tick even if its peer stopped sending mid-frame, and a slow peer is
/// never cut for it. Returns how many bytes were read into `dst`; the caller discards
/// the rest of the payload.
pub fn read_payload<'r>(
    s: &mut DataStream,
    dst: &mut [u8],
    enter: &dyn Fn() -> Option<IoGuard<'r>>,
) -> io::Result<usize> {
    let mut filled = 0;
    let mut ticking = false;
    let r = (|| {
        while filled < dst.len() {
            let rest = &mut dst[filled..];
            let n = if s.buffer().is_empty() && rest.len() >= s.capacity() {
                if !ticking {
                    s.get_ref().set_read_timeout(Some(TICK))?;
                    ticking = true;
                }
                let Some(_io) = enter() else { break };
                // The buffer is empty, so bypassing it keeps the byte order.
                match s.get_mut().read(rest) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => n,
                    Err(e) if read_again(&e) => continue,
                    Err(e) => return Err(e),
                }
            } else {
                // Once a read straight into the pages set the tick, a slow peer's
                // rest makes this read time out too: wait on (nothing is held here).
                let have = match s.fill_buf() {
                    Ok([]) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(have) => have,
                    Err(e) if read_again(&e) => continue,
                    Err(e) => return Err(e),
                };
                let Some(_io) = enter() else { break };
                let n = have.len().min(rest.len());
                rest[..n].copy_from_slice(&have[..n]);
                s.consume(n);
                n
            };
            filled += n;
        }
        Ok(())
    })();
    if ticking {
        // Frame headers are read without a timeout: an idle connection just waits.
        s.get_ref().set_read_timeout(None)?;
    }
    r.map(|()| filled)
}

/// A read that ended without bytes and without an error of the stream: interrupted, or
/// the tick's read timeout (`read_payload` sets it on the first read straight into the
/// pages, and every later read of the payload, through the buffer too, may meet it).
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
        (bytes, BufReader::with_capacity(READ_BUFFER, s), writer)
    }

    /// Mixed small and large payload reads through the buffer come out in stream order,
    /// and `discard` through the buffer skips exactly its bytes.
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
}
