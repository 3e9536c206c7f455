//! TLS 1.3 on the control connection (`tls_cert_file`, `tls_key_file`, `tls_ca_file`).
//!
//! With the three keys set, every control connection starts with a TLS 1.3 handshake
//! (rustls, ring provider, no TLS 1.2, no session resumption) in which both engines
//! present a certificate chained to `tls_ca_file`: the decode engine as the TLS client,
//! the prefill engine as the server. Only after it do the engines exchange their
//! `Hello`s, the cluster-key handshake of [`crate::auth`] (when a key is set) and the
//! rest of the setup, all inside TLS. Host names are not checked: any certificate the
//! cluster's CA signed is a member of the cluster, as anyone holding the cluster key is.
//!
//! Data connections stay plain TCP (KV pages are read into place from the socket), but
//! each proves the control session it belongs to with the HMAC exchange of
//! [`crate::auth`], keyed by a secret exported from the control connection's TLS session
//! ([`Wire::session_secret`]); with `encrypt_data=true` their payloads are sealed with
//! AES-256-GCM under keys derived from that exchange (`transport::tcp::seal`).
//!
//! An engine with TLS and one without cannot talk: the TLS side sees a kvxfer frame
//! where a TLS record was due (or the plain side a TLS record where a frame was due),
//! answers with a plain `AuthRefused { reason: Tls }` and closes; both sides name TLS.
//!
//! # Reader and writer of a TLS control connection
//!
//! A rustls connection is one state machine for both directions and cannot be split
//! like a `TcpStream`. After the setup, the control connection's reader and writer
//! threads share it under a mutex that is held only to encrypt or decrypt, never
//! across a blocking socket call ([`Wire::split`]):
//!
//! - the reader reads ciphertext from its own handle on the socket without any lock,
//!   then takes the lock to hand the bytes to rustls and take out the plaintext;
//! - the writer takes a second lock, the write lock, then the connection lock to
//!   encrypt one frame into a buffer, gives the connection lock back and writes the
//!   buffer to the socket under the write lock alone.
//!
//! So a writer stalled on a peer that does not read never blocks the reader, and the
//! TLS records reach the socket in the order they were sealed (both steps happen under
//! the write lock). What the reader's side of rustls wants to send (a key update
//! answer, an alert) goes out with the next frame the writer sends, or at once when the
//! write lock is free. A dedicated I/O thread polling the socket would do as well at
//! the cost of one more thread per peer and a wakeup per frame; kernel TLS would need
//! rustls' secrets extracted into the kernel and a kernel with the `tls` module.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    ClientConfig, ClientConnection, Connection, DigitallySignedStruct, RootCertStore, ServerConfig,
    ServerConnection, SignatureScheme,
};

use crate::err;
use crate::error::Result;
use crate::proto::FRAME_MAGIC;

/// The name the decode engine asks for; certificates are not checked against it.
const SERVER_NAME: &str = "kvxfer";
/// The label of the control session's exported secret (RFC 8446 section 7.5).
const EXPORT_LABEL: &[u8] = b"EXPORTER-kvxfer-session";

/// The three file keys, in the order their errors name them.
pub const FILE_KEYS: [&str; 3] = ["tls_cert_file", "tls_key_file", "tls_ca_file"];

/// The TLS settings of an engine, loaded from its files when the engine starts.
#[derive(Clone)]
pub struct Tls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls(TLS 1.3, mutual certificates)")
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_certs(key: &str, path: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| err!(BadValue, "config key '{key}': cannot read '{path}': {e}"))?;
    if certs.is_empty() {
        return Err(err!(
            BadValue,
            "config key '{key}': '{path}' holds no PEM certificate (BEGIN CERTIFICATE)"
        ));
    }
    Ok(certs)
}

/// The private key in `path`, a file readable by its owner only (as `auth_key_file`).
fn load_key(path: &str) -> Result<PrivateKeyDer<'static>> {
    let bad = |why: String| err!(BadValue, "config key 'tls_key_file': {why}");
    let file = crate::auth::open_private(path).map_err(bad)?;
    let mut pem = Vec::new();
    // A PEM private key is a few KiB: a file of a MiB holds none.
    file.take(1 << 20)
        .read_to_end(&mut pem)
        .map_err(|e| bad(format!("cannot read '{path}': {e}")))?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| bad(format!("cannot read a PEM private key from '{path}': {e}")))
}

impl Tls {
    /// Loads the certificate chain, the private key and the CA certificates, and checks
    /// that the chain is signed by the CA and matches the key. Every error names the
    /// config key and the path.
    pub fn load(cert_file: &str, key_file: &str, ca_file: &str) -> Result<Tls> {
        let provider = provider();
        let chain = load_certs("tls_cert_file", cert_file)?;
        let key = load_key(key_file)?;
        let mut roots = RootCertStore::empty();
        for ca in load_certs("tls_ca_file", ca_file)? {
            roots.add(ca).map_err(|e| {
                err!(
                    BadValue,
                    "config key 'tls_ca_file': a certificate in '{ca_file}' is not a usable CA: {e}"
                )
            })?;
        }
        let roots = Arc::new(roots);
        let verifier = ClusterCa {
            roots: roots.clone(),
            provider: provider.clone(),
        };
        // Our own chain must be one the peers accept: refused here rather than at every
        // handshake.
        let leaf = ParsedCertificate::try_from(&chain[0]).map_err(|e| {
            err!(
                BadValue,
                "config key 'tls_cert_file': the first certificate of '{cert_file}' cannot be parsed: {e}"
            )
        })?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &leaf,
            &roots,
            &chain[1..],
            UnixTime::now(),
            provider.signature_verification_algorithms.all,
        )
        .map_err(|e| {
            err!(
                BadValue,
                "config key 'tls_cert_file': the certificate in '{cert_file}' is not valid under \
                 the CA of '{ca_file}': {e}"
            )
        })?;
        let tls13 = &[&rustls::version::TLS13];
        let bad = |what: &str, e: rustls::Error| {
            err!(
                BadValue,
                "config keys 'tls_cert_file'/'tls_key_file' ('{cert_file}', '{key_file}'): \
                 {what}: {e}"
            )
        };
        let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| {
                err!(
                    BadValue,
                    "config key 'tls_ca_file': '{ca_file}' cannot verify clients: {e}"
                )
            })?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(|e| bad("TLS 1.3", e))?
            .with_client_cert_verifier(clients)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| bad("the key does not fit the certificate", e))?;
        // No resumption: every connection is a full handshake with both certificates,
        // and nothing is written on the reader's behalf after it.
        server.send_tls13_tickets = 0;
        server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(tls13)
            .map_err(|e| bad("TLS 1.3", e))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(chain, key)
            .map_err(|e| bad("the key does not fit the certificate", e))?;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(Tls {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// Checks a prefill engine's certificate the way a client's is checked: chained to the
/// cluster's CA, in its validity period, signing the handshake; no host name.
#[derive(Debug)]
struct ClusterCa {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ClusterCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Why a TLS handshake failed.
#[derive(Debug)]
pub enum HandshakeError {
    /// The peer spoke plain kvxfer frames: it has no TLS configured.
    PeerPlain,
    /// Silence past the deadline, or the connection closed or broke.
    Io(io::Error),
    /// TLS itself failed: a certificate not of our CA, an alert from the peer, ...
    Tls(String),
}

/// The bytes that begin every kvxfer frame.
fn is_frame_start(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && bytes[..4] == FRAME_MAGIC.to_le_bytes()
}

/// Whether `bytes` (the first bytes of a connection) begin a TLS handshake record.
pub fn is_tls_record(bytes: &[u8]) -> bool {
    bytes.len() >= 3 && bytes[0] == 0x16 && bytes[1] == 0x03
}

/// A socket that keeps the first bytes read from it, so that a failed handshake can
/// tell a peer without TLS from a broken one.
struct Recorder<'a> {
    sock: &'a mut TcpStream,
    first: Vec<u8>,
}

impl Read for Recorder<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.sock.read(buf)?;
        let room = 16usize.saturating_sub(self.first.len());
        self.first.extend_from_slice(&buf[..n.min(room)]);
        Ok(n)
    }
}

impl Write for Recorder<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

/// Runs the handshake of `conn` over `sock` until `deadline`.
fn handshake(
    sock: &mut TcpStream,
    conn: &mut Connection,
    deadline: Instant,
) -> std::result::Result<(), HandshakeError> {
    let mut rec = Recorder {
        sock,
        first: Vec::new(),
    };
    while conn.is_handshaking() || conn.wants_write() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HandshakeError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "no complete TLS handshake before the deadline",
            )));
        }
        rec.sock
            .set_read_timeout(Some(left))
            .and_then(|()| rec.sock.set_write_timeout(Some(left)))
            .map_err(HandshakeError::Io)?;
        match conn.complete_io(&mut rec) {
            Ok((0, 0)) if conn.is_handshaking() => {
                return Err(if is_frame_start(&rec.first) {
                    HandshakeError::PeerPlain
                } else {
                    HandshakeError::Io(io::ErrorKind::UnexpectedEof.into())
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::InvalidData || is_frame_start(&rec.first) => {
                return Err(if is_frame_start(&rec.first) {
                    HandshakeError::PeerPlain
                } else {
                    HandshakeError::Tls(e.to_string())
                })
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && !rec.first.is_empty() => {
                return Err(HandshakeError::Tls(
                    "the peer closed the connection during the TLS handshake (it refused our \
                     certificate, or does not speak TLS)"
                        .into(),
                ))
            }
            Err(e) => return Err(HandshakeError::Io(e)),
        }
    }
    // The setup that follows sets its own timeouts.
    rec.sock
        .set_read_timeout(None)
        .and_then(|()| rec.sock.set_write_timeout(None))
        .map_err(HandshakeError::Io)
}

impl Tls {
    /// Decode side: the client handshake on a connected socket.
    pub fn connect(
        &self,
        mut sock: TcpStream,
        deadline: Instant,
    ) -> std::result::Result<Wire, HandshakeError> {
        let name = ServerName::try_from(SERVER_NAME).expect("a valid DNS name");
        let conn = ClientConnection::new(self.client.clone(), name)
            .map_err(|e| HandshakeError::Tls(e.to_string()))?;
        let mut conn = Connection::Client(conn);
        conn.set_buffer_limit(None);
        handshake(&mut sock, &mut conn, deadline)?;
        Ok(Wire::Tls(Box::new(TlsConn { sock, conn })))
    }

    /// Prefill side: the server handshake on an accepted socket.
    pub fn accept(
        &self,
        mut sock: TcpStream,
        deadline: Instant,
    ) -> std::result::Result<Wire, (HandshakeError, TcpStream)> {
        let conn = match ServerConnection::new(self.server.clone()) {
            Ok(c) => c,
            Err(e) => return Err((HandshakeError::Tls(e.to_string()), sock)),
        };
        let mut conn = Connection::Server(conn);
        conn.set_buffer_limit(None);
        match handshake(&mut sock, &mut conn, deadline) {
            Ok(()) => Ok(Wire::Tls(Box::new(TlsConn { sock, conn }))),
            Err(e) => Err((e, sock)),
        }
    }
}

/// A TLS connection during the setup: the socket and the rustls state.
pub struct TlsConn {
    sock: TcpStream,
    conn: Connection,
}

/// A control or data connection during its setup: plain TCP, or TLS over it.
pub enum Wire {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS 1.3 over TCP.
    Tls(Box<TlsConn>),
}

impl Wire {
    /// The socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Wire::Plain(s) => s,
            Wire::Tls(t) => &t.sock,
        }
    }

    /// Whether this is a TLS connection.
    pub fn is_tls(&self) -> bool {
        matches!(self, Wire::Tls(_))
    }

    /// A secret both ends of a TLS connection share and no one else knows: bound to
    /// this TLS session, from rustls' exporter. `None` for plain TCP.
    pub fn session_secret(&self) -> Option<[u8; 32]> {
        let Wire::Tls(t) = self else { return None };
        t.conn
            .export_keying_material([0u8; 32], EXPORT_LABEL, None)
            .ok()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().peer_addr()
    }

    /// Splits the connection for its reader and writer threads.
    pub fn split(self) -> io::Result<Split> {
        match self {
            Wire::Plain(s) => Ok(Split::Plain(s)),
            Wire::Tls(t) => {
                let TlsConn { sock, conn } = *t;
                let read = sock.try_clone()?;
                let shared = Arc::new(Shared {
                    conn: Mutex::new(conn),
                    write: Mutex::new(sock),
                });
                Ok(Split::Tls(
                    Reader {
                        sock: read,
                        shared: shared.clone(),
                        buf: vec![0; 16 * 1024 + 512].into_boxed_slice(),
                        pos: 0,
                        end: 0,
                    },
                    Writer { shared },
                ))
            }
        }
    }
}

/// A connection split for its reader and writer threads.
pub enum Split {
    /// Plain TCP: one socket, cloned by whoever needs two.
    Plain(TcpStream),
    /// TLS: the two halves.
    Tls(Reader, Writer),
}

/// The socket options the setup changes, on either kind of connection.
pub trait Conn: Read + Write {
    /// As `TcpStream::set_read_timeout`.
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// As `TcpStream::set_write_timeout`.
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Conn for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

impl Conn for Wire {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp().set_read_timeout(t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp().set_write_timeout(t)
    }
}

impl TlsConn {
    /// What rustls still has to do before a read or write (as `rustls::Stream`).
    fn complete_prior_io(&mut self) -> io::Result<()> {
        if self.conn.is_handshaking() {
            self.conn.complete_io(&mut self.sock)?;
        }
        if self.conn.wants_write() {
            self.conn.complete_io(&mut self.sock)?;
        }
        Ok(())
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let t = match self {
            Wire::Plain(s) => return s.read(buf),
            Wire::Tls(t) => t,
        };
        t.complete_prior_io()?;
        while t.conn.wants_read() {
            if t.conn.complete_io(&mut t.sock)?.0 == 0 {
                break;
            }
        }
        t.conn.reader().read(buf)
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let t = match self {
            Wire::Plain(s) => return s.write(buf),
            Wire::Tls(t) => t,
        };
        t.complete_prior_io()?;
        let n = t.conn.writer().write(buf)?;
        while t.conn.wants_write() {
            t.conn.complete_io(&mut t.sock)?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        let t = match self {
            Wire::Plain(s) => return s.flush(),
            Wire::Tls(t) => t,
        };
        t.complete_prior_io()?;
        t.conn.writer().flush()?;
        while t.conn.wants_write() {
            t.conn.complete_io(&mut t.sock)?;
        }
        Ok(())
    }
}

/// What the reader and the writer of a split TLS connection share.
struct Shared {
    /// The rustls state: held only to encrypt or decrypt.
    conn: Mutex<Connection>,
    /// The socket records are written to; held from sealing a frame to its last byte
    /// on the socket, so records go out in the order they were sealed.
    write: Mutex<TcpStream>,
}

impl Shared {
    /// Seals what rustls has to send and writes it (write lock held by the caller).
    fn flush(&self, sock: &mut TcpStream) -> io::Result<()> {
        let mut out = Vec::new();
        {
            let mut c = self.conn.lock();
            while c.wants_write() {
                c.write_tls(&mut out)?;
            }
        }
        sock.write_all(&out)
    }
}

/// The reading half of a TLS control connection.
pub struct Reader {
    sock: TcpStream,
    shared: Arc<Shared>,
    /// Ciphertext read from the socket; `buf[pos..end]` is not yet handed to rustls.
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl Read for Reader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            let wants_write = {
                let mut c = self.shared.conn.lock();
                match c.reader().read(out) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if self.pos < self.end {
                    // One read_tls at a time, the plaintext taken out in between, so
                    // rustls' plaintext buffer never fills.
                    let mut rest = &self.buf[self.pos..self.end];
                    let n = c.read_tls(&mut rest)?;
                    self.pos += n;
                    c.process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    c.wants_write()
                } else {
                    false
                }
            };
            if wants_write {
                // Else the writer sends it with its next frame.
                if let Some(mut s) = self.shared.write.try_lock() {
                    self.shared.flush(&mut s)?;
                }
            }
            if self.pos < self.end {
                continue;
            }
            // No lock across the blocking read.
            let n = self.sock.read(&mut self.buf)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the TLS connection without close_notify",
                ));
            }
            (self.pos, self.end) = (0, n);
        }
    }
}

/// The writing half of a TLS control connection.
pub struct Writer {
    shared: Arc<Shared>,
}

impl Writer {
    /// Sets how long a write may make no progress before it fails.
    pub fn set_stall(&self, stall: Duration) -> io::Result<()> {
        self.shared.write.lock().set_write_timeout(Some(stall))
    }

    /// Seals `frame` and writes it whole.
    pub fn send_frame(&self, frame: &[u8]) -> io::Result<()> {
        let mut s = self.shared.write.lock();
        self.shared.conn.lock().writer().write_all(frame)?;
        self.shared.flush(&mut s).inspect_err(|_| {
            let _ = s.shutdown(Shutdown::Both);
        })
    }
}
