//! The little HTTP/1.1 that etcd's JSON gateway needs: a POST with a JSON body, its
//! answer read whole (`Content-Length`, chunked, or to the end), and the watch: one POST
//! whose chunked answer is a stream of JSON messages, one per line, read with a short
//! timeout so that the reading thread can stop, and shut from another thread.
//!
//! Why not an HTTP client crate: the watch is a long-lived streaming answer that the
//! discovery thread must leave at once when the engine stops or etcd stops answering;
//! that needs a timeout per read and the socket in hand, which blocking clients hide
//! (their timeouts are per phase of a whole request). What is here is a client for one
//! server (etcd 3.4's gateway, Go's `net/http`): no TLS, no redirects, no keep-alive.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The largest answer (or head, or one watch message) read: a range of a few thousand
/// entries fits.
const MAX_BODY: usize = 16 << 20;

/// An answer: status code and body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Opens a connection to `addr` (`host:port`) within `timeout`.
fn connect(addr: &str, timeout: Duration) -> Result<TcpStream, String> {
    let mut last = format!("{addr} resolves to no address");
    let addrs = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?;
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = format!("cannot connect to {addr}: {e}"),
        }
    }
    Err(last)
}

fn request(addr: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// Connects to `addr` and sends the POST of `body` to `path`; reads and writes on the
/// socket it returns give up after `timeout` each.
fn send(addr: &str, path: &str, body: &[u8], timeout: Duration) -> Result<TcpStream, String> {
    let mut s = connect(addr, timeout)?;
    s.set_write_timeout(Some(timeout))
        .and_then(|_| s.set_read_timeout(Some(timeout)))
        .map_err(|e| e.to_string())?;
    s.write_all(&request(addr, path, body))
        .map_err(|e| format!("{addr}: cannot send: {e}"))?;
    Ok(s)
}

/// POSTs `body` to `path` on `addr` and reads the whole answer, all within `timeout`.
pub fn post(addr: &str, path: &str, body: &[u8], timeout: Duration) -> Result<Answer, String> {
    let deadline = Instant::now() + timeout;
    let mut s = send(addr, path, body, timeout)?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        if let Some((status, head_len, framing)) = parse_head(&raw)? {
            let mut rest = raw.split_off(head_len);
            loop {
                match framing.complete(&rest)? {
                    Some(body) => return Ok(Answer { status, body }),
                    None => match read_some(&mut s, &mut buf, deadline, addr)? {
                        0 if framing == Framing::ToEnd => return Ok(Answer { status, body: rest }),
                        0 => return Err(format!("{addr}: the answer was cut short")),
                        n => rest.extend_from_slice(&buf[..n]),
                    },
                }
                if rest.len() > MAX_BODY {
                    return Err(format!("{addr}: answer larger than {MAX_BODY} bytes"));
                }
            }
        }
        match read_some(&mut s, &mut buf, deadline, addr)? {
            0 => return Err(format!("{addr}: closed before answering")),
            n => raw.extend_from_slice(&buf[..n]),
        }
        if raw.len() > MAX_BODY {
            return Err(format!("{addr}: answer head larger than {MAX_BODY} bytes"));
        }
    }
}

fn read_some(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    addr: &str,
) -> Result<usize, String> {
    loop {
        match s.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if timed_out(&e) && Instant::now() < deadline => continue,
            Err(e) if timed_out(&e) => return Err(format!("{addr}: no answer in time")),
            Err(e) => return Err(format!("{addr}: {e}")),
        }
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
    ToEnd,
}

impl Framing {
    /// The whole body if `rest` holds all of it.
    fn complete(self, rest: &[u8]) -> Result<Option<Vec<u8>>, String> {
        match self {
            Framing::Length(n) => Ok((rest.len() >= n).then(|| rest[..n].to_vec())),
            Framing::ToEnd => Ok(None),
            Framing::Chunked => {
                let mut dechunk = Dechunk::default();
                let mut out = Vec::new();
                dechunk.feed(rest, &mut out)?;
                Ok(dechunk.finished.then_some(out))
            }
        }
    }
}

/// The status, head length and framing of an answer whose head `raw` holds whole;
/// `None` while the head is incomplete.
fn parse_head(raw: &[u8]) -> Result<Option<(u16, usize, Framing)>, String> {
    let Some(end) = find(raw, b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "answer head is not text")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if !version.starts_with("HTTP/1.") {
        return Err(format!("not an HTTP/1 answer: {status_line:?}"));
    }
    let status = code
        .parse::<u16>()
        .map_err(|_| format!("bad status line {status_line:?}"))?;
    let mut framing = Framing::ToEnd;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(format!("bad header line {line:?}"));
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("transfer-encoding") {
            if value.eq_ignore_ascii_case("chunked") {
                framing = Framing::Chunked;
            } else {
                return Err(format!("unsupported transfer-encoding {value:?}"));
            }
        } else if name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let n = value
                .parse::<usize>()
                .map_err(|_| format!("bad content-length {value:?}"))?;
            if n > MAX_BODY {
                return Err(format!("answer of {n} bytes, more than {MAX_BODY}"));
            }
            framing = Framing::Length(n);
        }
    }
    Ok(Some((status, end + 4, framing)))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A resumable decoder of a chunked body: fed the raw bytes as they come, it emits the
/// body's bytes of every whole chunk.
#[derive(Debug, Default)]
struct Dechunk {
    /// The last (zero-length) chunk was seen.
    finished: bool,
}

impl Dechunk {
    /// Decodes the whole chunks at the start of `raw` into `out`; returns how many bytes
    /// of `raw` they took (the rest is an incomplete chunk, to be fed again with more).
    fn feed(&mut self, raw: &[u8], out: &mut Vec<u8>) -> Result<usize, String> {
        if self.finished {
            // What follows the last chunk (trailers, the final CRLF) carries nothing.
            return Ok(raw.len());
        }
        let mut at = 0;
        loop {
            let Some(eol) = find(&raw[at..], b"\r\n") else {
                if raw.len() - at > 64 {
                    return Err("bad chunk size line".into());
                }
                break;
            };
            let line = std::str::from_utf8(&raw[at..at + eol]).map_err(|_| "bad chunk size")?;
            let size_text = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| format!("bad chunk size {size_text:?}"))?;
            if size > MAX_BODY {
                return Err(format!("chunk of {size} bytes, more than {MAX_BODY}"));
            }
            let start = at + eol + 2;
            if size == 0 {
                // The last chunk; trailers (none from etcd) and the final CRLF follow.
                self.finished = true;
                return Ok(raw.len());
            }
            if raw.len() < start + size + 2 {
                break;
            }
            if &raw[start + size..start + size + 2] != b"\r\n" {
                return Err("chunk not followed by CRLF".into());
            }
            out.extend_from_slice(&raw[start..start + size]);
            at = start + size + 2;
        }
        Ok(at)
    }
}

/// A streaming answer (the watch): JSON messages, one per line, in a chunked body.
pub struct Stream {
    sock: TcpStream,
    addr: String,
    /// Raw bytes not yet decoded (an incomplete chunk).
    raw: Vec<u8>,
    /// Body bytes not yet split into lines.
    body: Vec<u8>,
    dechunk: Dechunk,
    chunked: bool,
}

impl Stream {
    /// POSTs `body` to `path` on `addr` and reads the answer's head within `timeout`;
    /// reads of the body then wait at most `tick` each.
    pub fn open(
        addr: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
        tick: Duration,
    ) -> Result<Stream, String> {
        let deadline = Instant::now() + timeout;
        let mut s = send(addr, path, body, timeout)?;
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        let (status, head_len, framing) = loop {
            if let Some(head) = parse_head(&raw)? {
                break head;
            }
            match read_some(&mut s, &mut buf, deadline, addr)? {
                0 => return Err(format!("{addr}: closed before answering")),
                n => raw.extend_from_slice(&buf[..n]),
            }
            if raw.len() > 64 << 10 {
                return Err(format!("{addr}: answer head too large"));
            }
        };
        if status != 200 {
            return Err(format!("{addr}{path}: HTTP status {status}"));
        }
        s.set_read_timeout(Some(tick)).map_err(|e| e.to_string())?;
        let raw = raw.split_off(head_len);
        Ok(Stream {
            sock: s,
            addr: addr.to_string(),
            raw,
            body: Vec::new(),
            dechunk: Dechunk::default(),
            chunked: framing == Framing::Chunked,
        })
    }

    /// A clone of the socket, to shut it from another thread.
    pub fn socket(&self) -> io::Result<TcpStream> {
        self.sock.try_clone()
    }

    /// The next whole message (one line), `Ok(None)` if none came within a tick; an
    /// error when the stream ended or broke.
    pub fn next(&mut self) -> Result<Option<Vec<u8>>, String> {
        loop {
            if let Some(line) = self.take_line() {
                return Ok(Some(line));
            }
            if self.dechunk.finished {
                return Err(format!("{}: the stream ended", self.addr));
            }
            let mut buf = [0u8; 16 << 10];
            match self.sock.read(&mut buf) {
                Ok(0) => return Err(format!("{}: the stream was closed", self.addr)),
                Ok(n) => self.raw.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if timed_out(&e) => return Ok(None),
                Err(e) => return Err(format!("{}: {e}", self.addr)),
            }
            self.decode()?;
        }
    }

    fn decode(&mut self) -> Result<(), String> {
        if self.chunked {
            let used = self.dechunk.feed(&self.raw, &mut self.body)?;
            self.raw.drain(..used);
        } else {
            self.body.append(&mut self.raw);
        }
        if self.raw.len() + self.body.len() > MAX_BODY {
            return Err(format!(
                "{}: a message larger than {MAX_BODY} bytes",
                self.addr
            ));
        }
        Ok(())
    }

    fn take_line(&mut self) -> Option<Vec<u8>> {
        if !self.raw.is_empty() && self.body.is_empty() {
            // Bytes that came with the head.
            if self.decode().is_err() {
                return None;
            }
        }
        // Blank lines are skipped in a loop: a stream of them (any length, from a
        // misbehaving or tampered etcd) must cost neither stack nor quadratic time.
        let start = self
            .body
            .iter()
            .position(|b| !b.is_ascii_whitespace())
            .unwrap_or(self.body.len());
        self.body.drain(..start);
        let nl = self.body.iter().position(|&b| b == b'\n')?;
        let mut line: Vec<u8> = self.body.drain(..=nl).collect();
        line.pop();
        Some(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch stream of many blank lines (a misbehaving or tampered etcd) is skipped
    /// in one pass: it once recursed per line and overflowed the stack.
    #[test]
    fn a_flood_of_blank_lines_is_skipped_without_recursion() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut s = Stream {
            sock: TcpStream::connect(l.local_addr().unwrap()).unwrap(),
            addr: "test".into(),
            raw: Vec::new(),
            body: vec![b'\n'; 4 << 20],
            dechunk: Dechunk::default(),
            chunked: true,
        };
        s.body.extend_from_slice(b"{\"a\":1}\n");
        assert_eq!(s.take_line(), Some(b"{\"a\":1}".to_vec()));
        assert!(s.body.is_empty());
    }

    #[test]
    fn a_chunked_body_decodes_across_any_split() {
        let raw = b"5\r\nhello\r\n7;ext=1\r\n world\n\r\n0\r\n\r\n";
        for split in 0..raw.len() {
            let mut d = Dechunk::default();
            let mut out = Vec::new();
            let mut pending = raw[..split].to_vec();
            let used = d.feed(&pending, &mut out).unwrap();
            pending.drain(..used);
            pending.extend_from_slice(&raw[split..]);
            let used = d.feed(&pending, &mut out).unwrap();
            assert_eq!(used, pending.len(), "split {split}");
            assert!(d.finished);
            assert_eq!(out, b"hello world\n", "split {split}");
        }
    }

    #[test]
    fn a_bad_chunk_is_an_error_not_a_guess() {
        let mut d = Dechunk::default();
        assert!(d.feed(b"zz\r\nhello\r\n", &mut Vec::new()).is_err());
        assert!(d.feed(b"2\r\nhello\r\n", &mut Vec::new()).is_err());
    }

    #[test]
    fn heads_give_status_and_framing() {
        let h = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(
            parse_head(h).unwrap(),
            Some((200, h.len() - 5, Framing::Length(5)))
        );
        let h = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(
            parse_head(h).unwrap(),
            Some((404, h.len(), Framing::Chunked))
        );
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\n").unwrap(), None);
        assert!(parse_head(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
    }
}
