//! File descriptors from one engine's process to another's on the same host: the CUDA
//! IPC path's VMM handles are POSIX file descriptors ([`crate::cuda::ipc`]), which
//! cannot cross TCP. They go over a Unix domain socket with `SCM_RIGHTS`.
//!
//! Who gets them, and from whom, is bound to the authenticated control connection: the
//! giving engine (the prefill, which exports) binds a listening socket under a fresh
//! random abstract name and tells the name and a fresh 32-byte nonce to its peer over
//! the control connection, which the cluster key (or TLS) authenticates, along with the
//! peer's own process id from its same-host identity. Then:
//!
//! - the giver accepts a connection only from that process (`SO_PEERCRED` pid) that
//!   first writes the nonce; any other connection (another process found the name in
//!   `/proc/net/unix`, or guessed it) is closed unanswered and the giver goes on waiting,
//!   until its deadline;
//! - the taker checks that the listening socket belongs to the giver's process
//!   (`SO_PEERCRED` of a connected socket names the process that listened), so a
//!   descriptor it receives comes from the authenticated peer and from no other
//!   process.
//!
//! Abstract names live in the network namespace: both engines must share it, which the
//! same-host detection already requires.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// Bytes of the nonce a taker proves itself with.
pub const NONCE_LEN: usize = 32;
/// Descriptors per message (the kernel's `SCM_MAX_FD` is 253).
const FDS_PER_MSG: usize = 250;
/// The most descriptors one offer passes (a bound on what a taker accepts).
pub const MAX_FDS: usize = 65_536;

/// The refused connections an offer names when it times out; the rest are counted, so
/// that a process connecting in a loop cannot grow the offer's memory without bound.
const NAMED_REFUSALS: usize = 8;

/// The connections an offer refused: the first [`NAMED_REFUSALS`] named, the rest
/// counted.
#[derive(Default)]
struct Refusals {
    named: Vec<String>,
    more: usize,
}

impl Refusals {
    fn push(&mut self, what: String) {
        if self.named.len() < NAMED_REFUSALS {
            self.named.push(what);
        } else {
            self.more += 1;
        }
    }

    /// What the timeout's error adds: nothing, or " (refused: ...)".
    fn said(&self) -> String {
        match (self.named.is_empty(), self.more) {
            (true, _) => String::new(),
            (false, 0) => format!(" (refused: {})", self.named.join("; ")),
            (false, n) => format!(" (refused: {}; and {n} more)", self.named.join("; ")),
        }
    }
}

/// A listening socket that gives descriptors to one process, once (see the module's
/// documentation).
pub struct FdOffer {
    listener: UnixListener,
    name: Vec<u8>,
    nonce: [u8; NONCE_LEN],
}

fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| io::Error::other(format!("no random bytes: {e}")))?;
    Ok(b)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The pid of the process at the other end of `fd` (for a connected client socket: the
/// process that called `listen`; for an accepted one: the process that connected).
fn peer_pid(fd: RawFd) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid as u32)
}

/// Compares in time independent of where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl FdOffer {
    /// Binds a listening socket under a fresh random abstract name, with a fresh nonce.
    pub fn bind() -> io::Result<FdOffer> {
        let name = format!("kvxfer-fd-{}-{}", std::process::id(), hex(&random::<16>()?));
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = UnixListener::bind_addr(&addr)?;
        listener.set_nonblocking(true)?;
        Ok(FdOffer {
            listener,
            name: name.into_bytes(),
            nonce: random()?,
        })
    }

    /// The abstract name to tell the taker (over the authenticated control connection).
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// The nonce to tell the taker (over the authenticated control connection).
    pub fn nonce(&self) -> [u8; NONCE_LEN] {
        self.nonce
    }

    /// Gives `fds` to process `pid` once it connects and proves the nonce; connections
    /// from other processes, or without the nonce, are closed and counted in the error
    /// if the deadline passes first. The descriptors stay ours (the kernel duplicates
    /// them into the taker).
    pub fn give(&self, pid: u32, fds: &[BorrowedFd<'_>], within: Duration) -> io::Result<()> {
        self.give_unless(pid, fds, within, &|| false)
    }

    /// As [`give`](Self::give), giving up (an error) as soon as `cancelled` says so
    /// (checked every few milliseconds while no one connects).
    pub fn give_unless(
        &self,
        pid: u32,
        fds: &[BorrowedFd<'_>],
        within: Duration,
        cancelled: &dyn Fn() -> bool,
    ) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::other(format!(
                "{} descriptors to pass, at most {MAX_FDS}",
                fds.len()
            )));
        }
        let deadline = Instant::now() + within;
        let mut refused = Refusals::default();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if cancelled() {
                return Err(io::Error::new(
                    io::ErrorKind::Interrupted,
                    format!("the offer to process {pid} was cancelled"),
                ));
            }
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "process {pid} did not take its descriptors in time{}",
                        refused.said()
                    ),
                ));
            }
            let mut s = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(left.min(Duration::from_millis(2)));
                    continue;
                }
                Err(e) => return Err(e),
            };
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
            s.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
            let from = peer_pid(s.as_raw_fd())?;
            if from != pid {
                refused.push(format!("a connection from process {from}"));
                continue;
            }
            let mut got = [0u8; NONCE_LEN];
            if s.read_exact(&mut got).is_err() || !same(&got, &self.nonce) {
                refused.push(format!("process {from} without the nonce"));
                continue;
            }
            s.write_all(&(fds.len() as u32).to_le_bytes())?;
            for chunk in fds.chunks(FDS_PER_MSG) {
                send_fds(&s, chunk)?;
            }
            return Ok(());
        }
    }
}

/// Runs `f` on a message header for one byte and a control buffer with room for
/// `bytes` of descriptor data (`CMSG_SPACE`), zeroed and aligned for `cmsghdr`; both
/// live for the call.
fn with_msghdr<T>(bytes: usize, f: impl FnOnce(&mut libc::msghdr) -> T) -> T {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    f(&mut msg)
}

/// Sends one byte with `fds` as `SCM_RIGHTS`.
fn send_fds(s: &UnixStream, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let bytes = std::mem::size_of_val(raw.as_slice());
    let sent = with_msghdr(bytes, |msg| {
        // SAFETY: msg_control points at CMSG_SPACE(bytes) bytes (aligned for cmsghdr, see
        // with_msghdr), enough for one header and `bytes` of data, so the first header
        // and its data lie inside the control buffer; the descriptors are live
        // (borrowed) for the call.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                raw.len(),
            );
            libc::sendmsg(s.as_raw_fd(), msg, libc::MSG_NOSIGNAL)
        }
    });
    if sent != 1 {
        return Err(if sent < 0 {
            io::Error::last_os_error()
        } else {
            io::Error::other("sendmsg sent nothing")
        });
    }
    Ok(())
}

/// Receives one byte and up to `max` descriptors (close-on-exec) from `s`.
fn recv_fds(s: &UnixStream, max: usize) -> io::Result<Vec<OwnedFd>> {
    let bytes = max * std::mem::size_of::<RawFd>();
    with_msghdr(bytes, |msg| {
        // SAFETY: the kernel writes at most one byte into the header's byte and at most
        // msg_controllen bytes into its control buffer, both live for the call
        // (with_msghdr).
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut out = Vec::new();
        // SAFETY: walks the control headers the kernel wrote into the control buffer
        // with the CMSG macros, which stay within msg_controllen; each SCM_RIGHTS
        // header's data holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors, now ours (each
        // is owned once).
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    let p = libc::CMSG_DATA(c).cast::<RawFd>();
                    for i in 0..data / std::mem::size_of::<RawFd>() {
                        out.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                    }
                }
                c = libc::CMSG_NXTHDR(msg, c);
            }
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the giver closed the socket before its descriptors",
            ));
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::other("descriptors were cut off (MSG_CTRUNC)"));
        }
        Ok(out)
    })
}

/// Takes the `n` descriptors that process `pid` offers under the abstract `name`,
/// proving `nonce`; fails if the socket's listener is another process, or another
/// count of descriptors comes.
pub fn take(
    name: &[u8],
    nonce: &[u8; NONCE_LEN],
    pid: u32,
    n: usize,
    within: Duration,
) -> io::Result<Vec<OwnedFd>> {
    let addr = SocketAddr::from_abstract_name(name)?;
    let mut s = UnixStream::connect_addr(&addr)?;
    s.set_read_timeout(Some(within))?;
    s.set_write_timeout(Some(within))?;
    let from = peer_pid(s.as_raw_fd())?;
    if from != pid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the descriptor socket {} belongs to process {from}, not to the prefill \
                 engine's process {pid}",
                String::from_utf8_lossy(name)
            ),
        ));
    }
    s.write_all(nonce)?;
    let mut count = [0u8; 4];
    s.read_exact(&mut count).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("process {pid} gave no descriptors (refused, or gone): {e}"),
        )
    })?;
    let count = u32::from_le_bytes(count) as usize;
    if count != n {
        return Err(io::Error::other(format!(
            "process {pid} offers {count} descriptors, {n} expected"
        )));
    }
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let got = recv_fds(&s, (n - out.len()).min(FDS_PER_MSG))?;
        if got.is_empty() {
            return Err(io::Error::other("a message without descriptors"));
        }
        out.extend(got);
    }
    if out.len() != n {
        return Err(io::Error::other(format!(
            "{} descriptors came, {n} expected",
            out.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn memfd(content: &[u8]) -> OwnedFd {
        let mut f = tempfile_like();
        f.write_all(content).unwrap();
        OwnedFd::from(f)
    }

    fn tempfile_like() -> std::fs::File {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; the fd is ours.
        let fd = unsafe { libc::memfd_create(c"kvxfer-fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor owned by nobody else.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }

    fn content(fd: OwnedFd) -> Vec<u8> {
        use std::io::Seek;
        let mut f = std::fs::File::from(fd);
        f.seek(io::SeekFrom::Start(0)).unwrap();
        let mut v = Vec::new();
        f.read_to_end(&mut v).unwrap();
        v
    }

    #[test]
    fn an_offer_names_its_first_refusals_and_counts_the_rest() {
        let mut r = Refusals::default();
        assert_eq!(r.said(), "");
        r.push("a connection from process 7".into());
        assert_eq!(r.said(), " (refused: a connection from process 7)");
        for i in 0..1000 {
            r.push(format!("a connection from process {i}"));
        }
        assert_eq!(r.named.len(), NAMED_REFUSALS);
        assert!(r
            .said()
            .ends_with(&format!("; and {} more)", 1001 - NAMED_REFUSALS)));
    }

    #[test]
    fn descriptors_pass_to_the_process_that_proves_the_nonce_more_than_one_message_of_them() {
        let offer = FdOffer::bind().unwrap();
        let fds: Vec<OwnedFd> = (0..300u16).map(|i| memfd(&i.to_le_bytes())).collect();
        let (name, nonce) = (offer.name().to_vec(), offer.nonce());
        let me = std::process::id();
        let taker =
            std::thread::spawn(move || take(&name, &nonce, me, 300, Duration::from_secs(5)));
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        offer.give(me, &borrowed, Duration::from_secs(5)).unwrap();
        let got = taker.join().unwrap().unwrap();
        assert_eq!(got.len(), 300);
        for (i, fd) in got.into_iter().enumerate() {
            assert_eq!(content(fd), (i as u16).to_le_bytes());
        }
    }

    #[test]
    fn a_wrong_nonce_gets_nothing_and_the_giver_waits_for_the_right_one() {
        let offer = FdOffer::bind().unwrap();
        let fd = memfd(b"kv");
        let (name, nonce) = (offer.name().to_vec(), offer.nonce());
        let me = std::process::id();
        let mut bad = nonce;
        bad[0] ^= 1;
        let n2 = name.clone();
        let stranger = std::thread::spawn(move || take(&n2, &bad, me, 1, Duration::from_secs(5)));
        let good = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            take(&name, &nonce, me, 1, Duration::from_secs(5))
        });
        offer
            .give(me, &[fd.as_fd()], Duration::from_secs(5))
            .unwrap();
        drop(offer); // a connection still waiting is reset
        let e = stranger.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("gave no descriptors"), "{e}");
        let got = good.join().unwrap().unwrap();
        assert_eq!(content(got.into_iter().next().unwrap()), b"kv");
    }

    #[test]
    fn a_cancelled_offer_gives_up_at_once_not_at_its_deadline() {
        let offer = FdOffer::bind().unwrap();
        let fd = memfd(b"kv");
        let t0 = Instant::now();
        let e = offer
            .give_unless(1, &[fd.as_fd()], Duration::from_secs(30), &|| true)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Interrupted, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn the_giver_refuses_other_processes_and_the_taker_checks_the_listener() {
        let offer = FdOffer::bind().unwrap();
        let fd = memfd(b"kv");
        let me = std::process::id();
        // Waiting for another process: this one's connection is refused, and said.
        let (name, nonce) = (offer.name().to_vec(), offer.nonce());
        let t = std::thread::spawn(move || take(&name, &nonce, me, 1, Duration::from_secs(2)));
        let e = offer
            .give(me + 1, &[fd.as_fd()], Duration::from_millis(300))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("a connection from process {me}")),
            "{e}"
        );
        assert!(t.join().unwrap().is_err());
        // A taker told another pid than the listener's refuses before sending the nonce.
        let e = take(
            offer.name(),
            &offer.nonce(),
            me + 1,
            1,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains(&format!("belongs to process {me}")),
            "{e}"
        );
    }
}
