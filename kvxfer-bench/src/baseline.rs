//! The limits kvxfer is measured against, in the same run on the same host:
//!
//! - a plain TCP stream from the prefill process to the decode process, with as many
//!   connections as the engine uses per peer, large writes from a buffer and large reads
//!   into a buffer (the link limit for this transport);
//! - a memcpy of the same volume inside one process, on one thread (the host memory
//!   limit);
//! - with `--same-host`, a memcpy of the same volume in pages of the run's page size,
//!   each to a scattered place, on as many threads as the engine has copying threads
//!   (its data connections): the limit of the same-host path's work.
//!
//! The buffers are `--baseline-buf-mib` per connection (64 MiB by default, beyond the
//! caches), walked 4 MiB at a time, so that the baseline, like the engine, streams through
//! memory rather than re-using a cache-hot buffer.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::sys::{HostBusy, HostMark, Pages, Region, Usage};

/// One memcpy call, and the default write and read size of the TCP baseline.
pub const IO: usize = 4 << 20;

/// What a baseline measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct Measured {
    pub bytes: u64,
    pub secs: f64,
    /// This process's CPU and switches during the phase.
    pub usage: Usage,
    /// The host's CPUs during the phase (the other process and the kernel's threads too).
    pub host: HostBusy,
}

impl Measured {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
}

/// Each connection's buffer of the TCP baseline: its size and its pages.
#[derive(Debug, Clone, Copy)]
pub struct Buffers {
    pub mib: usize,
    pub pages: Pages,
}

impl Buffers {
    fn region(self) -> Region {
        Region::new(self.mib << 20, self.pages)
    }
}

/// memcpy of `bytes` (or for `secs` when non-zero) between two 256 MiB regions.
pub fn memcpy(bytes: u64, secs: f64, pages: Pages) -> Measured {
    let len = 256 << 20;
    let src = Region::new(len, pages);
    let dst = Region::new(len, pages);
    // SAFETY: both regions are private to this function.
    let (s, d) = unsafe { (src.bytes_mut(), dst.bytes_mut()) };
    for (i, x) in s.iter_mut().enumerate().step_by(64) {
        *x = i as u8;
    }
    let (u0, h0) = (Usage::now(), HostMark::now());
    let t = Instant::now();
    let mut done = 0u64;
    let mut off = 0;
    loop {
        if secs > 0.0 {
            if t.elapsed().as_secs_f64() >= secs {
                break;
            }
        } else if done >= bytes {
            break;
        }
        let n = if secs > 0.0 {
            IO
        } else {
            IO.min((bytes - done) as usize)
        };
        let n = n.min(len - off);
        d[off..off + n].copy_from_slice(&s[off..off + n]);
        std::hint::black_box(&d[off]);
        done += n as u64;
        off = (off + n) % len;
    }
    Measured {
        bytes: done,
        secs: t.elapsed().as_secs_f64(),
        usage: Usage::now().since(u0),
        host: h0.since(),
    }
}

/// Decode side of the TCP baseline: prepares its buffers, waits for the prefill side to
/// have prepared its own (`wait_ready`), connects `conns` streams to the prefill's
/// baseline listener and reads until each is closed. Timed from the first connection to
/// the last end of stream.
pub fn tcp_receive(
    addr: &str,
    conns: usize,
    buf: Buffers,
    io: usize,
    wait_ready: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Measured, String> {
    let bufs: Vec<Region> = (0..conns).map(|_| buf.region()).collect();
    wait_ready()?;
    let (u0, h0) = (Usage::now(), HostMark::now());
    let t = Instant::now();
    let mut streams = Vec::new();
    for _ in 0..conns {
        let s = TcpStream::connect(addr)
            .map_err(|e| format!("baseline: cannot connect to {addr}: {e}"))?;
        streams.push(s);
    }
    let readers: Vec<_> = streams
        .into_iter()
        .zip(bufs)
        .map(|(mut s, buf)| {
            std::thread::spawn(move || -> Result<u64, String> {
                // SAFETY: private to this thread.
                let b = unsafe { buf.bytes_mut() };
                let mut total = 0u64;
                let mut off = 0;
                loop {
                    let end = (off + io).min(b.len());
                    match s.read(&mut b[off..end]) {
                        Ok(0) => return Ok(total),
                        Ok(n) => {
                            total += n as u64;
                            off = (off + n) % b.len();
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(format!("baseline: read failed: {e}")),
                    }
                }
            })
        })
        .collect();
    let mut bytes = 0;
    for r in readers {
        bytes += r
            .join()
            .map_err(|_| "baseline reader panicked".to_string())??;
    }
    Ok(Measured {
        bytes,
        secs: t.elapsed().as_secs_f64(),
        usage: Usage::now().since(u0),
        host: h0.since(),
    })
}

/// Prefill side of the TCP baseline: prepares its buffers, says so (`ready`), accepts
/// `conns` streams and writes `bytes` in all (or for `secs` when non-zero), split evenly,
/// then closes them.
pub fn tcp_send(
    listener: &TcpListener,
    conns: usize,
    bytes: u64,
    secs: f64,
    buf: Buffers,
    io: usize,
    ready: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Measured, String> {
    let bufs: Vec<Region> = (0..conns)
        .map(|_| {
            let r = buf.region();
            // SAFETY: not shared yet.
            for (j, x) in unsafe { r.bytes_mut() }.iter_mut().enumerate().step_by(64) {
                *x = j as u8;
            }
            r
        })
        .collect();
    ready()?;
    let (u0, h0) = (Usage::now(), HostMark::now());
    let t = Instant::now();
    listener.set_nonblocking(false).map_err(|e| e.to_string())?;
    let mut writers = Vec::new();
    for (i, buf) in bufs.into_iter().enumerate() {
        let (mut s, _) = listener
            .accept()
            .map_err(|e| format!("baseline: accept failed: {e}"))?;
        let share = bytes / conns as u64 + u64::from((i as u64) < bytes % conns as u64);
        writers.push(std::thread::spawn(move || -> Result<u64, String> {
            s.set_write_timeout(Some(Duration::from_secs(60)))
                .map_err(|e| e.to_string())?;
            // SAFETY: private to this thread.
            let b = unsafe { buf.bytes_mut() };
            let start = Instant::now();
            let mut sent = 0u64;
            let mut off = 0;
            loop {
                let n = if secs > 0.0 {
                    if start.elapsed().as_secs_f64() >= secs {
                        break;
                    }
                    io
                } else {
                    if sent >= share {
                        break;
                    }
                    io.min((share - sent) as usize)
                };
                let n = n.min(b.len() - off);
                s.write_all(&b[off..off + n])
                    .map_err(|e| format!("baseline: write failed: {e}"))?;
                sent += n as u64;
                off = (off + n) % b.len();
            }
            let _ = s.shutdown(Shutdown::Write);
            Ok(sent)
        }));
    }
    let mut sent = 0;
    for w in writers {
        sent += w
            .join()
            .map_err(|_| "baseline writer panicked".to_string())??;
    }
    Ok(Measured {
        bytes: sent,
        secs: t.elapsed().as_secs_f64(),
        usage: Usage::now().since(u0),
        host: h0.since(),
    })
}

/// memcpy of `bytes` (or for `secs` when non-zero) in pages of `page` bytes, each page
/// of a 256 MiB region to a scattered page of another (a fixed odd-stride permutation),
/// on `threads` threads at once, each taking every `threads`-th page.
pub fn memcpy_pages(bytes: u64, secs: f64, page: usize, threads: usize, pages: Pages) -> Measured {
    let len = (256usize << 20).max(page * threads);
    let src = Region::new(len, pages);
    let dst = Region::new(len, pages);
    let n = len / page;
    // An odd stride coprime with n places page i at (i * stride) % n, a bijection.
    let stride = (0..)
        .map(|k| 40_503 + 2 * k)
        .find(|s| gcd(*s, n) == 1)
        .unwrap_or(1);
    let (s_addr, d_addr) = (src.addr(), dst.addr());
    let (u0, h0) = (Usage::now(), HostMark::now());
    let t = Instant::now();
    let done: u64 = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|w| {
                scope.spawn(move || {
                    let share = bytes / threads as u64;
                    let mut copied = 0u64;
                    let mut i = w;
                    loop {
                        if secs > 0.0 {
                            if t.elapsed().as_secs_f64() >= secs {
                                break;
                            }
                        } else if copied >= share {
                            break;
                        }
                        let j = (i * stride) % n;
                        // SAFETY: pages i (read) and j (written) lie inside the two
                        // regions, which outlive the scope; each thread writes only the
                        // images of its own pages i (i = w mod threads), so no two
                        // threads write one byte.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                (s_addr + i * page) as *const u8,
                                (d_addr + j * page) as *mut u8,
                                page,
                            );
                        }
                        copied += page as u64;
                        i += threads;
                        if i >= n {
                            i = w;
                        }
                    }
                    copied
                })
            })
            .collect();
        workers.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    Measured {
        bytes: done,
        secs: t.elapsed().as_secs_f64(),
        usage: Usage::now().since(u0),
        host: h0.since(),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
