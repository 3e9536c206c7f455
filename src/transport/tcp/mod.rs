//! The TCP transport: data frames written straight from registered memory with vectored
//! writes (no staging copy) by the sender ([`send`]), and read straight into the granted
//! pages by the receiver ([`recv`]), which asks the engine where each frame may go.

pub mod recv;
pub mod seal;
pub mod send;
mod staged;

use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::RawFd;
use std::time::Duration;

pub use send::SendConn;

/// Largest data frame payload the sender produces; longer runs are split so that frames
/// of other rooms interleave and an abort takes effect within one frame.
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// How long one blocked write (or a read straight into a room's pages) waits before it
/// looks again at its room and its deadline.
const TICK: Duration = Duration::from_millis(10);

/// Bytes a data connection lets wait in its socket unsent (`TCP_NOTSENT_LOWAT`): a
/// write blocks while more than this is queued behind what the network (or the peer's
/// window) has taken. Without it Linux queues up to the whole send buffer (4 MiB by
/// default), which the receiver then copies out after it has left the caches; with
/// four 4 MiB rooms in flight on two cores the engines moved 0.89 of the plain stream
/// instead of 0.79 (docs/bench-journal, issue 12, ninth round). It does not bound the
/// data in flight, so a long fat link still fills its window. It also keeps what an
/// ended room has already committed to the socket short.
pub const NOTSENT_LOWAT: usize = 1 << 20;

/// Sets [`NOTSENT_LOWAT`] on a data connection's sending socket. A kernel without the
/// option (before 3.12) keeps its default, which only costs speed.
pub fn limit_unsent(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let _ = set_int_option(
        s.as_raw_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_NOTSENT_LOWAT,
        NOTSENT_LOWAT as libc::c_int,
    );
}

/// Sets the integer socket option `level`/`name` of `fd` to `value` (`setsockopt`).
pub fn set_int_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: setsockopt reads one c_int through a pointer to a live local of that size;
    // whatever `fd` is, the kernel checks it (a bad one is an error).
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The integer socket option `level`/`name` of `fd` (`getsockopt`).
pub fn int_option(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `v`, a live local of that size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(v)
    } else {
        Err(io::Error::last_os_error())
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
