//! The TCP transport: data frames written straight from registered memory with vectored
//! writes (no staging copy), and read straight into destination pages.

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use parking_lot::Mutex;

use crate::proto::{DataHeader, DATA_FRAME_PREFIX_LEN};

/// Largest data frame payload the sender produces; longer runs are split so that frames
/// of other rooms interleave and an abort takes effect within one frame.
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// One outgoing connection shared by several workers; each frame is written whole under
/// the lock, so frames never interleave.
#[derive(Debug)]
pub struct SendConn {
    stream: Mutex<TcpStream>,
}

impl SendConn {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> Self {
        SendConn {
            stream: Mutex::new(stream),
        }
    }

    /// Writes several data frames with one vectored write sequence under one lock.
    pub fn send_batch(&self, runs: &[(DataHeader, &[u8])]) -> io::Result<()> {
        let prefixes = prefixes(runs)?;
        write_batch(&mut self.stream.lock(), runs, &prefixes)
    }

    /// As [`SendConn::send_batch`] if no other worker is writing on the connection;
    /// `None` otherwise, with nothing written.
    pub fn try_send_batch(&self, runs: &[(DataHeader, &[u8])]) -> Option<io::Result<()>> {
        let prefixes = match prefixes(runs) {
            Ok(p) => p,
            Err(e) => return Some(Err(e)),
        };
        let mut s = self.stream.try_lock()?;
        Some(write_batch(&mut s, runs, &prefixes))
    }

    /// Writes an encoded control frame.
    pub fn send_frame(&self, frame: &[u8]) -> io::Result<()> {
        self.stream.lock().write_all(frame)
    }
}

/// The encoded frame prefix (frame header and data header) of each run.
fn prefixes(runs: &[(DataHeader, &[u8])]) -> io::Result<Vec<[u8; DATA_FRAME_PREFIX_LEN]>> {
    runs.iter()
        .map(|(hdr, _)| {
            let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
            hdr.encode_frame(&mut prefix)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            Ok(prefix)
        })
        .collect()
}

/// Writes each run behind its prefix, in order, with vectored writes.
fn write_batch(
    s: &mut TcpStream,
    runs: &[(DataHeader, &[u8])],
    prefixes: &[[u8; DATA_FRAME_PREFIX_LEN]],
) -> io::Result<()> {
    let mut slices = Vec::with_capacity(runs.len() * 2);
    for ((_, bytes), prefix) in runs.iter().zip(prefixes) {
        slices.push(IoSlice::new(prefix));
        slices.push(IoSlice::new(bytes));
    }
    write_all_vectored(s, &mut slices)
}

fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl super::DataLink for SendConn {
    fn write_runs(&self, runs: &[(DataHeader, &[u8])]) -> io::Result<()> {
        self.send_batch(runs)
    }

    fn try_write_runs(&self, runs: &[(DataHeader, &[u8])]) -> Option<io::Result<()>> {
        self.try_send_batch(runs)
    }

    fn finish(&self, done_frame: &[u8]) -> io::Result<()> {
        self.send_frame(done_frame)
    }
}

/// Reads and throws away `n` bytes (data for a room that may no longer be written).
pub fn discard(r: &mut impl Read, mut n: u64) -> io::Result<()> {
    let mut scratch = [0u8; 64 * 1024];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        r.read_exact(&mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Connects to `addr` (`host:port`) within `timeout`, trying each resolved address.
pub fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}
