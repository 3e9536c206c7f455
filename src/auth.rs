//! Mutual authentication of engine connections with a cluster key.
//!
//! Every connection starts with the initiator's (the decode engine's) `Hello`; right
//! after it, before the responder acts on anything else, both engines prove that they
//! hold the key:
//!
//! ```text
//! initiator                                   responder
//!   Hello, AuthHello{auth, key_id, nonce_i}  ──►
//!                                            ◄──  AuthChallenge{auth, engine_id, nonce_r}
//!   AuthProof{HMAC(key, initiator ‖ T)}      ──►      (or AuthRefused, and close)
//!                                            ◄──  AuthProof{HMAC(key, responder ‖ T)}
//!                                                     (or AuthRefused, and close)
//! ```
//!
//! `T`, the transcript, is the protocol version, the connection's kind and index, both
//! engines' roles and ids and both nonces ([`Transcript`]). Each side proves with a fresh
//! nonce of the other's in `T`, so a recorded proof is worth nothing on a new connection;
//! the responder proves only after it verified the initiator, so a stranger learns no tag
//! at all. Tags are compared in constant time (`hmac`'s `verify_slice`).
//!
//! The key of a control connection is the cluster key. A successful control handshake
//! also yields a session secret, `HMAC(key, session ‖ T)`, which both engines keep and
//! which never travels; each data connection of that session runs the same exchange with
//! the session secret as its key, so only the engine that authenticated the control
//! connection can open (or take over) one of its data connections.
//!
//! With `auth=off` on both sides, `AuthHello` and `AuthChallenge` carry zeros and no
//! proof follows. Settings that differ, key ids that differ (the engines hold different
//! keys), a proof that does not verify and a nonce seen before are refused with an
//! [`AuthRefusal`] that tells the peer why, and the connection is closed.
//!
//! Reads during the handshake use a fixed buffer of [`MAX_HANDSHAKE_PAYLOAD`] bytes and
//! accept only the kinds the step expects; one deadline bounds the whole exchange.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;

use crate::proto::{
    AuthMode, AuthRefusal, ConnKind, FrameHeader, Kind, Limits, Message, Role, AUTH_KEY_ID_LEN,
    AUTH_MAC_LEN, AUTH_NONCE_LEN, FRAME_HEADER_LEN, PROTO_VERSION,
};
use crate::tls::Conn;

type HmacSha256 = Hmac<Sha256>;
type Nonce = [u8; AUTH_NONCE_LEN];

/// The fewest bytes a cluster key may have.
pub const MIN_KEY_LEN: usize = 32;
/// The most bytes a cluster key may have.
pub const MAX_KEY_LEN: usize = 4096;
/// The largest payload read before a connection is authenticated: the largest
/// handshake message (`AuthHello` and `AuthChallenge`, 44 bytes) rounded up.
pub const MAX_HANDSHAKE_PAYLOAD: usize = 64;

/// A cluster key. Its bytes never appear in `Debug` output or error messages.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(Vec<u8>);

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({} bytes, id {})", self.0.len(), hex(&self.id()))
    }
}

impl Key {
    /// A key from `bytes`, which must hold [`MIN_KEY_LEN`]..=[`MAX_KEY_LEN`] bytes.
    pub fn new(bytes: Vec<u8>) -> Result<Key, String> {
        if bytes.len() < MIN_KEY_LEN {
            return Err(format!(
                "a key needs at least {MIN_KEY_LEN} random bytes, this one has {}",
                bytes.len()
            ));
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(format!(
                "a key has at most {MAX_KEY_LEN} bytes, this one has {}",
                bytes.len()
            ));
        }
        Ok(Key(bytes))
    }

    /// A key written in hexadecimal (two digits per byte, either case; at least
    /// 2 × [`MIN_KEY_LEN`] digits). The error never repeats the text.
    pub fn from_hex(text: &str) -> Result<Key, String> {
        let digits = text.trim().as_bytes();
        if digits.len() % 2 != 0 {
            return Err(format!(
                "expected hexadecimal digits, two per byte; got an odd number ({})",
                digits.len()
            ));
        }
        let mut bytes = Vec::with_capacity(digits.len() / 2);
        for (i, pair) in digits.chunks(2).enumerate() {
            let nibble = |c: u8| (c as char).to_digit(16);
            match (nibble(pair[0]), nibble(pair[1])) {
                (Some(h), Some(l)) => bytes.push((h * 16 + l) as u8),
                _ => {
                    return Err(format!(
                        "expected hexadecimal digits; byte {i} (digits {}..{}) is not",
                        2 * i,
                        2 * i + 2
                    ))
                }
            }
        }
        Key::new(bytes)
    }

    /// The key in file `path`: its whole content, which must be [`MIN_KEY_LEN`] to
    /// [`MAX_KEY_LEN`] bytes, in a regular file that grants no permission to its group or
    /// to others (mode `0600` or `0400`). Errors name the path (and the mode).
    pub fn from_file(path: &str) -> Result<Key, String> {
        let file = open_private(path)?;
        let mut bytes = Vec::new();
        file.take(MAX_KEY_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read '{path}': {e}"))?;
        Key::new(bytes).map_err(|why| format!("'{path}': {why}"))
    }

    /// The key's id: a fingerprint that tells keys apart and reveals nothing of the key.
    pub fn id(&self) -> [u8; AUTH_KEY_ID_LEN] {
        key_id(&self.0)
    }

    /// The tag of a registry entry (discovery): `body` as stored under etcd key `name`,
    /// bound to that name so that an entry copied under another name does not verify.
    pub fn sign_entry(&self, name: &[u8], body: &[u8]) -> [u8; AUTH_MAC_LEN] {
        entry_mac(&self.0, name, body)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `mac` is the tag of `body` under `name` ([`Key::sign_entry`]), compared
    /// in constant time.
    pub fn verify_entry(&self, name: &[u8], body: &[u8], mac: &[u8]) -> bool {
        entry_mac(&self.0, name, body).verify_slice(mac).is_ok()
    }
}

/// The MAC of a registry entry: label, purpose, the name's length and the name, then the
/// body (the length keeps name and body from sliding into each other).
fn entry_mac(key: &[u8], name: &[u8], body: &[u8]) -> HmacSha256 {
    let len = (name.len() as u64).to_be_bytes();
    hmac_over(
        key,
        &[
            LABEL.as_slice(),
            &[Purpose::RegistryEntry as u8],
            &len,
            name,
            body,
        ],
    )
}

/// Opens secret file `path` (a key) for reading, after checking the open file: a
/// regular file that grants no permission to its group or to others (mode `0600` or
/// `0400`). The checks are on the open file, so the file read is the file checked.
/// Errors name the path (and the mode).
pub(crate) fn open_private(path: &str) -> Result<File, String> {
    use std::os::unix::fs::PermissionsExt;
    let file = File::open(path).map_err(|e| format!("cannot open '{path}': {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat '{path}': {e}"))?;
    if !meta.is_file() {
        return Err(format!("'{path}' is not a regular file"));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "'{path}' has mode {mode:04o}: a key file must be readable only by its owner, \
             with no permission for group or others (chmod 600 '{path}')"
        ));
    }
    Ok(file)
}

/// The secret of an authenticated control session, from which its data connections
/// prove that they belong to it. Never sent; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionSecret([u8; AUTH_MAC_LEN]);

impl fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionSecret(id {})", hex(&key_id(&self.0)))
    }
}

impl SessionSecret {
    /// The secret of a control session over TLS: bound to the TLS session through
    /// `exported` (what both ends' TLS exporter gives), to whether its data is `sealed`
    /// (`encrypt_data`: engines that differ in it prove different secrets, so their
    /// data connections are refused), and to the cluster-key session `keyed` when a key
    /// is set too.
    pub fn from_tls(
        exported: &[u8; 32],
        sealed: bool,
        keyed: Option<&SessionSecret>,
    ) -> SessionSecret {
        let keyed: &[u8] = keyed.map_or(&[], |k| &k.0);
        SessionSecret(tag(
            exported,
            &[
                LABEL.as_slice(),
                &[Purpose::TlsSession as u8, sealed as u8],
                keyed,
            ],
        ))
    }

    /// A key for `what`, derived from this secret (the two ends derive the same).
    pub fn derive(&self, what: &[u8]) -> [u8; AUTH_MAC_LEN] {
        tag(
            &self.0,
            &[LABEL.as_slice(), &[Purpose::Derived as u8], what],
        )
    }
}

/// Lowercase hexadecimal of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What each tag is for: one byte of the MAC input, so no tag can stand for another.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Purpose {
    KeyId = 1,
    InitiatorProof = 2,
    ResponderProof = 3,
    Session = 4,
    TlsSession = 5,
    DataConnection = 6,
    Derived = 7,
    RegistryEntry = 8,
}

/// The prefix of every MAC input.
const LABEL: &[u8; 12] = b"kvxfer-auth\0";

fn key_id(key: &[u8]) -> [u8; AUTH_KEY_ID_LEN] {
    let tag = tag(key, &[LABEL.as_slice(), &[Purpose::KeyId as u8]]);
    let mut id = [0u8; AUTH_KEY_ID_LEN];
    id.copy_from_slice(&tag[..AUTH_KEY_ID_LEN]);
    id
}

fn hmac_over(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length: new_from_slice cannot fail for it.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    for p in parts {
        m.update(p);
    }
    m
}

fn tag(key: &[u8], parts: &[&[u8]]) -> [u8; AUTH_MAC_LEN] {
    hmac_over(key, parts).finalize().into_bytes().into()
}

/// What a connection's proofs are bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    /// The connection's kind.
    pub conn: ConnKind,
    /// Its index among the initiator's connections of that kind.
    pub conn_index: u16,
    /// The initiator's role and engine id.
    pub initiator: (Role, u64),
    /// The responder's role and engine id.
    pub responder: (Role, u64),
    /// The initiator's nonce.
    pub nonce_i: [u8; AUTH_NONCE_LEN],
    /// The responder's nonce.
    pub nonce_r: [u8; AUTH_NONCE_LEN],
}

/// Bytes of [`Transcript::bytes`].
const TRANSCRIPT_LEN: usize = 2 + 1 + 2 + 1 + 1 + 8 + 8 + 2 * AUTH_NONCE_LEN;

impl Transcript {
    /// The MAC input after the label and purpose: fixed-length fields, in this order,
    /// little-endian: protocol version u16, conn u8, conn_index u16, initiator role u8,
    /// responder role u8, initiator id u64, responder id u64, nonce_i, nonce_r.
    pub fn bytes(&self) -> [u8; TRANSCRIPT_LEN] {
        let mut out = [0u8; TRANSCRIPT_LEN];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        put(&PROTO_VERSION.to_le_bytes());
        put(&[self.conn as u8]);
        put(&self.conn_index.to_le_bytes());
        put(&[self.initiator.0 as u8, self.responder.0 as u8]);
        put(&self.initiator.1.to_le_bytes());
        put(&self.responder.1.to_le_bytes());
        put(&self.nonce_i);
        put(&self.nonce_r);
        out
    }

    fn tag(&self, key: &[u8], purpose: Purpose) -> [u8; AUTH_MAC_LEN] {
        tag(key, &[LABEL.as_slice(), &[purpose as u8], &self.bytes()])
    }

    /// Constant-time check of `mac` as the tag of `purpose`.
    fn verify(&self, key: &[u8], purpose: Purpose, mac: &[u8]) -> bool {
        hmac_over(key, &[LABEL.as_slice(), &[purpose as u8], &self.bytes()])
            .verify_slice(mac)
            .is_ok()
    }

    /// The initiator's proof.
    pub fn initiator_proof(&self, key: &[u8]) -> [u8; AUTH_MAC_LEN] {
        self.tag(key, Purpose::InitiatorProof)
    }

    /// The responder's proof.
    pub fn responder_proof(&self, key: &[u8]) -> [u8; AUTH_MAC_LEN] {
        self.tag(key, Purpose::ResponderProof)
    }

    fn session(&self, key: &[u8]) -> SessionSecret {
        SessionSecret(self.tag(key, Purpose::Session))
    }

    /// What a successful exchange yields: a control connection's session secret, or a
    /// data connection's own secret.
    fn secret(&self, key: &[u8]) -> SessionSecret {
        match self.conn {
            ConnKind::Control => self.session(key),
            ConnKind::Data => SessionSecret(self.tag(key, Purpose::DataConnection)),
        }
    }
}

/// Fresh random bytes from the operating system.
fn nonce() -> Result<[u8; AUTH_NONCE_LEN], Failure> {
    let mut n = [0u8; AUTH_NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| {
        Failure::new(
            Reason::Incomplete,
            format!("the operating system gave no random bytes: {e}"),
        )
    })?;
    Ok(n)
}

/// Why a connection failed authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The peer does not authenticate (`auth=off`) and this engine requires it.
    NoKey,
    /// This engine has `auth=off` and the peer requires authentication.
    Mismatch,
    /// The engines hold different keys (their key ids differ).
    WrongKey,
    /// A proof does not verify.
    BadProof,
    /// The handshake reuses the nonce of an earlier authenticated connection.
    Replay,
    /// A data connection that belongs to no authenticated control session.
    NoSession,
    /// Too many connections were waiting to authenticate.
    Busy,
    /// The handshake did not complete: silence past the deadline, or the connection
    /// closed or broke in the middle.
    Incomplete,
    /// A frame of the wrong kind, too large, or malformed where a handshake frame was due.
    Malformed,
    /// One engine has TLS configured, the other not.
    TlsMismatch,
    /// The TLS handshake failed: a certificate not of the cluster's CA, an alert.
    Tls,
    /// The peer is on another host, and one of the two engines has neither a key nor
    /// TLS and `auth` at `auto`, so it works only with engines on its own host.
    NotLocal,
}

impl Reason {
    /// A short name, as logged: `no key`, `wrong key`, `bad proof`, `replay`, ...
    pub fn name(self) -> &'static str {
        match self {
            Reason::NoKey => "no key",
            Reason::Mismatch => "settings differ",
            Reason::WrongKey => "wrong key",
            Reason::BadProof => "bad proof",
            Reason::Replay => "replay",
            Reason::NoSession => "no session",
            Reason::Busy => "busy",
            Reason::Incomplete => "incomplete handshake",
            Reason::Malformed => "malformed handshake",
            Reason::TlsMismatch => "TLS on one side only",
            Reason::Tls => "TLS handshake failed",
            Reason::NotLocal => "not on this host",
        }
    }

    /// Whether the two engines' configurations disagree (settings or keys), rather than
    /// one of them misbehaving.
    pub fn is_config_mismatch(self) -> bool {
        matches!(
            self,
            Reason::NoKey
                | Reason::Mismatch
                | Reason::WrongKey
                | Reason::TlsMismatch
                | Reason::Tls
                | Reason::NotLocal
        )
    }
}

/// A failed authentication: why, and what exactly happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The class of failure.
    pub reason: Reason,
    /// One line of detail.
    pub detail: String,
}

impl Failure {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Failure {
        Failure {
            reason,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = match self.reason {
            Reason::Mismatch | Reason::NoKey | Reason::NotLocal => "authentication mismatch",
            Reason::TlsMismatch => "TLS mismatch",
            Reason::Tls => "TLS authentication failed",
            _ => "authentication failed",
        };
        write!(f, "{word} ({}): {}", self.reason.name(), self.detail)
    }
}

/// This engine, as the handshake sees it.
#[derive(Debug, Clone, Copy)]
pub struct Local<'a> {
    /// The `auth` setting.
    pub mode: AuthMode,
    /// The cluster key (present when `mode` is required).
    pub key: Option<&'a Key>,
    /// This engine's role.
    pub role: Role,
    /// This engine's id.
    pub engine_id: u64,
}

impl Local<'_> {
    fn name(&self) -> &'static str {
        match self.role {
            Role::Prefill => "this prefill engine",
            Role::Decode => "this decode engine",
        }
    }
}

/// The initiator's `Hello`, as the responder read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerHello {
    /// The initiator's role.
    pub role: Role,
    /// The initiator's engine id.
    pub engine_id: u64,
    /// The connection's kind.
    pub conn: ConnKind,
    /// Its index.
    pub conn_index: u16,
}

/// Nonces of connections that authenticated, so that a replayed handshake is told
/// apart from a merely wrong one. Bounded: the oldest are forgotten first. Replays are
/// refused whether or not their nonce is still here (the responder's fresh nonce makes
/// an old proof worthless); the cache only names the reason, and refuses them earlier.
pub struct NonceCache {
    cap: usize,
    /// The nonces, and the order they came in.
    seen: Mutex<(HashSet<Nonce>, VecDeque<Nonce>)>,
}

impl NonceCache {
    /// A cache of the last `cap` nonces.
    pub fn new(cap: usize) -> NonceCache {
        NonceCache {
            cap: cap.max(1),
            seen: Mutex::new((HashSet::new(), VecDeque::new())),
        }
    }

    /// Whether `n` was recorded.
    pub fn contains(&self, n: &[u8; AUTH_NONCE_LEN]) -> bool {
        self.seen.lock().0.contains(n)
    }

    /// Records `n`; false if it was already there.
    pub fn insert(&self, n: [u8; AUTH_NONCE_LEN]) -> bool {
        let mut g = self.seen.lock();
        let (set, order) = &mut *g;
        if !set.insert(n) {
            return false;
        }
        order.push_back(n);
        while order.len() > self.cap {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
        true
    }
}

/// A socket with one deadline for the whole exchange: every read and write waits at
/// most until then, so a peer that trickles bytes gains nothing.
struct Timed<'a, S: Conn> {
    s: &'a mut S,
    deadline: Instant,
}

impl<S: Conn> Timed<'_, S> {
    fn remaining(&self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    fn timed_out(&self) -> Failure {
        Failure::new(
            Reason::Incomplete,
            "no complete handshake before the deadline",
        )
    }

    /// Fills `buf`. `what` names the part for errors; `first` says no byte of the
    /// frame was read yet.
    fn read_full(&mut self, buf: &mut [u8], what: &str, first: bool) -> Result<(), Failure> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = self.remaining().ok_or_else(|| self.timed_out())?;
            self.s
                .set_read_timeout(Some(left))
                .map_err(|e| Failure::new(Reason::Incomplete, e.to_string()))?;
            match self.s.read(&mut buf[filled..]) {
                Ok(0) if first && filled == 0 => {
                    return Err(Failure::new(
                        Reason::Incomplete,
                        format!("the connection closed where a {what} was due"),
                    ))
                }
                Ok(0) => {
                    return Err(Failure::new(
                        Reason::Incomplete,
                        format!(
                            "the connection closed inside a {what} ({filled} of {} bytes; \
                             truncated)",
                            buf.len()
                        ),
                    ))
                }
                Ok(n) => filled += n.min(buf.len() - filled),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(self.timed_out())
                }
                Err(e) => {
                    return Err(Failure::new(
                        Reason::Incomplete,
                        format!("reading a {what}: {e}"),
                    ))
                }
            }
        }
        Ok(())
    }

    fn send(&mut self, msg: &Message) -> Result<(), Failure> {
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + MAX_HANDSHAKE_PAYLOAD);
        msg.encode(&mut frame)
            .map_err(|e| Failure::new(Reason::Malformed, e.to_string()))?;
        let left = self.remaining().ok_or_else(|| self.timed_out())?;
        self.s
            .set_write_timeout(Some(left))
            .and_then(|()| self.s.write_all(&frame))
            .map_err(|e| {
                Failure::new(
                    Reason::Incomplete,
                    format!("sending {}: {e}", msg.kind().name()),
                )
            })
    }

    /// Tells the peer why, best effort (it may be gone), then fails with `f`.
    fn refuse<T>(&mut self, reason: AuthRefusal, mode: AuthMode, f: Failure) -> Result<T, Failure> {
        let _ = self.send(&Message::AuthRefused { reason, auth: mode });
        Err(f)
    }
}

/// Reads one handshake frame into a fixed buffer: its kind must be one of `want` (read
/// from the header, before any payload byte), its payload at most
/// [`MAX_HANDSHAKE_PAYLOAD`] bytes. Nothing of any other kind is decoded.
fn read_frame<S: Conn>(t: &mut Timed<'_, S>, want: &[Kind]) -> Result<Message, Failure> {
    let mut hdr = [0u8; FRAME_HEADER_LEN];
    let expected = want
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(" or ");
    t.read_full(&mut hdr, &format!("{expected} frame"), true)?;
    let limits = Limits::default();
    let h = FrameHeader::decode(&hdr, &limits).map_err(|e| {
        if crate::tls::is_tls_record(&hdr) {
            Failure::new(
                Reason::TlsMismatch,
                "the peer speaks TLS (it has tls_cert_file, tls_key_file and tls_ca_file \
                 set), this engine has no TLS configured",
            )
        } else {
            Failure::new(Reason::Malformed, e.to_string())
        }
    })?;
    if !want.contains(&h.kind) {
        return Err(Failure::new(
            Reason::Malformed,
            format!(
                "a {} frame where {expected} was due (nothing is accepted before the handshake)",
                h.kind.name()
            ),
        ));
    }
    let len = h.payload_len as usize;
    if len > MAX_HANDSHAKE_PAYLOAD {
        return Err(Failure::new(
            Reason::Malformed,
            format!(
                "an oversized {} frame: {len} payload bytes, a handshake frame has at most \
                 {MAX_HANDSHAKE_PAYLOAD}",
                h.kind.name()
            ),
        ));
    }
    let mut buf = [0u8; MAX_HANDSHAKE_PAYLOAD];
    t.read_full(&mut buf[..len], &format!("{} frame", h.kind.name()), false)?;
    Message::decode(h.kind, &buf[..len], &limits)
        .map_err(|e| Failure::new(Reason::Malformed, e.to_string()))
}

/// Reads the initiator's `Hello` the way the rest of the handshake is read: the kind
/// checked from the header, the payload into a fixed buffer, one deadline.
pub fn read_hello<S: Conn>(s: &mut S, deadline: Instant) -> Result<Message, Failure> {
    read_frame(&mut Timed { s, deadline }, &[Kind::Hello])
}

/// Why a prefill engine refused us from another host ([`AuthRefusal::NotLocal`]).
pub const NOT_LOCAL_PEER: &str =
    "the peer accepts only engines on its own host: it has no cluster key and no TLS, and \
     'auth' at its default ('auto'). Give every engine the same key ('auth_key_file'), or \
     set 'auth' to 'off' on both to run without authentication";

/// What the peer's refusal means, seen from `me`.
fn refused(me: &Local<'_>, reason: AuthRefusal, theirs: AuthMode) -> Failure {
    let ours = me.mode;
    let (r, detail) = match reason {
        AuthRefusal::Mismatch if ours == AuthMode::Required => (
            Reason::NoKey,
            format!(
                "the peer has auth={}, {} auth={}",
                theirs.name(),
                me.name(),
                ours.name()
            ),
        ),
        AuthRefusal::Mismatch => (
            Reason::Mismatch,
            format!(
                "the peer has auth={}, {} auth={}",
                theirs.name(),
                me.name(),
                ours.name()
            ),
        ),
        AuthRefusal::WrongKey => (
            Reason::WrongKey,
            format!(
                "the peer refused our key id {}: it holds a different cluster key",
                me.key.map_or_else(String::new, |k| hex(&k.id()))
            ),
        ),
        AuthRefusal::BadProof => (Reason::BadProof, "the peer refused our proof".into()),
        AuthRefusal::Replay => (
            Reason::Replay,
            "the peer saw our nonce before and refused it as a replay".into(),
        ),
        AuthRefusal::NoSession => (
            Reason::NoSession,
            "the peer knows no authenticated control session for this data connection".into(),
        ),
        AuthRefusal::Busy => (
            Reason::Busy,
            "the peer has too many connections waiting to authenticate".into(),
        ),
        AuthRefusal::Tls => (
            Reason::TlsMismatch,
            format!(
                "the peer requires TLS (it has tls_cert_file, tls_key_file and tls_ca_file \
                 set), {} has no TLS configured",
                me.name()
            ),
        ),
        AuthRefusal::NotLocal => (Reason::NotLocal, NOT_LOCAL_PEER.into()),
    };
    Failure::new(r, detail)
}

/// A mismatch of settings, seen from `me`.
fn mismatch(me: &Local<'_>, theirs: AuthMode) -> Failure {
    let r = if me.mode == AuthMode::Required {
        Reason::NoKey
    } else {
        Reason::Mismatch
    };
    Failure::new(
        r,
        format!(
            "the peer has auth={}, {} auth={}",
            theirs.name(),
            me.name(),
            me.mode.name()
        ),
    )
}

fn peer_role(me: Role) -> Role {
    match me {
        Role::Prefill => Role::Decode,
        Role::Decode => Role::Prefill,
    }
}

/// The initiator's side, right after it sent its `Hello` on connection (`conn`,
/// `conn_index`). A data connection proves `session`, the secret of its authenticated
/// control connection. Returns, with authentication on, the session secret of a
/// control connection, or the secret of this one data connection (which both ends
/// share, fresh for each connection); `None` with authentication off.
pub fn initiate<S: Conn>(
    s: &mut S,
    me: &Local<'_>,
    conn: ConnKind,
    conn_index: u16,
    session: Option<&SessionSecret>,
    deadline: Instant,
) -> Result<Option<SessionSecret>, Failure> {
    let mut t = Timed { s, deadline };
    let key: Option<&[u8]> = match (me.mode, conn) {
        (AuthMode::Off, _) => None,
        (AuthMode::Required, ConnKind::Control) => me.key.map(|k| k.0.as_slice()),
        (AuthMode::Required, ConnKind::Data) => session.map(|s| s.0.as_slice()),
    };
    let (key_id, nonce_i) = match (me.mode, key) {
        (AuthMode::Off, _) => ([0; AUTH_KEY_ID_LEN], [0; AUTH_NONCE_LEN]),
        (AuthMode::Required, Some(k)) => (key_id(k), nonce()?),
        (AuthMode::Required, None) => {
            return Err(Failure::new(
                Reason::NoSession,
                "no authenticated control session to open a data connection for",
            ))
        }
    };
    t.send(&Message::AuthHello {
        auth: me.mode,
        key_id,
        nonce: nonce_i,
    })?;
    let (engine_id, nonce_r) = match read_frame(&mut t, &[Kind::AuthChallenge, Kind::AuthRefused])?
    {
        Message::AuthRefused { reason, auth } => return Err(refused(me, reason, auth)),
        Message::AuthChallenge {
            auth,
            engine_id,
            nonce,
        } => {
            if auth != me.mode {
                return t.refuse(AuthRefusal::Mismatch, me.mode, mismatch(me, auth));
            }
            (engine_id, nonce)
        }
        other => unreachable!("read_frame returned a {:?}", other.kind()),
    };
    let Some(key) = key else {
        return Ok(None);
    };
    let transcript = Transcript {
        conn,
        conn_index,
        initiator: (me.role, me.engine_id),
        responder: (peer_role(me.role), engine_id),
        nonce_i,
        nonce_r,
    };
    t.send(&Message::AuthProof {
        mac: transcript.initiator_proof(key),
    })?;
    match read_frame(&mut t, &[Kind::AuthProof, Kind::AuthRefused])? {
        Message::AuthRefused { reason, auth } => Err(refused(me, reason, auth)),
        Message::AuthProof { mac } => {
            if !transcript.verify(key, Purpose::ResponderProof, &mac) {
                return t.refuse(
                    AuthRefusal::BadProof,
                    me.mode,
                    Failure::new(
                        Reason::BadProof,
                        "the peer's proof does not verify: it does not hold the key \
                         (or replays an old handshake)",
                    ),
                );
            }
            Ok(Some(transcript.secret(key)))
        }
        other => unreachable!("read_frame returned a {:?}", other.kind()),
    }
}

/// The responder's side, after it read the initiator's `Hello` (`peer`): reads
/// `AuthHello` and completes the exchange. A data connection must prove the secret that
/// `session_for(peer.engine_id)` returns (the engine's authenticated control session).
/// `seen` holds the nonces of earlier authenticated connections; this one's is added on
/// success. Returns what [`initiate`] returns. On failure the peer has been told why
/// (best effort).
pub fn respond<S: Conn>(
    s: &mut S,
    me: &Local<'_>,
    peer: &PeerHello,
    session_for: impl FnOnce(u64) -> Option<SessionSecret>,
    seen: &NonceCache,
    deadline: Instant,
) -> Result<Option<SessionSecret>, Failure> {
    let mut t = Timed { s, deadline };
    let (theirs, key_id_i, nonce_i) = match read_frame(&mut t, &[Kind::AuthHello])? {
        Message::AuthHello {
            auth,
            key_id,
            nonce,
        } => (auth, key_id, nonce),
        other => unreachable!("read_frame returned a {:?}", other.kind()),
    };
    if theirs != me.mode {
        return t.refuse(AuthRefusal::Mismatch, me.mode, mismatch(me, theirs));
    }
    if me.mode == AuthMode::Off {
        t.send(&Message::AuthChallenge {
            auth: AuthMode::Off,
            engine_id: 0,
            nonce: [0; AUTH_NONCE_LEN],
        })?;
        return Ok(None);
    }
    let session;
    let key: &[u8] = match peer.conn {
        ConnKind::Control => match me.key {
            Some(k) => &k.0,
            None => {
                return Err(Failure::new(
                    Reason::NoKey,
                    "auth=required without a key (a configuration error)",
                ))
            }
        },
        ConnKind::Data => {
            session = session_for(peer.engine_id);
            match &session {
                Some(s) => &s.0,
                None => {
                    return t.refuse(
                        AuthRefusal::NoSession,
                        me.mode,
                        Failure::new(
                            Reason::NoSession,
                            format!(
                                "data connection {} of engine {:016x}, which has no authenticated \
                                 control session here",
                                peer.conn_index, peer.engine_id
                            ),
                        ),
                    )
                }
            }
        }
    };
    let ours = key_id(key);
    if key_id_i != ours {
        let f = match peer.conn {
            ConnKind::Control => Failure::new(
                Reason::WrongKey,
                format!(
                    "the peer holds cluster key id {}, {} {}",
                    hex(&key_id_i),
                    me.name(),
                    hex(&ours)
                ),
            ),
            ConnKind::Data => Failure::new(
                Reason::NoSession,
                format!(
                    "data connection {} of engine {:016x} proves another session than its \
                     engine's current control session",
                    peer.conn_index, peer.engine_id
                ),
            ),
        };
        let code = match f.reason {
            Reason::WrongKey => AuthRefusal::WrongKey,
            _ => AuthRefusal::NoSession,
        };
        return t.refuse(code, me.mode, f);
    }
    if seen.contains(&nonce_i) {
        return t.refuse(
            AuthRefusal::Replay,
            me.mode,
            Failure::new(
                Reason::Replay,
                "the handshake reuses the nonce of an earlier authenticated connection",
            ),
        );
    }
    let nonce_r = nonce()?;
    t.send(&Message::AuthChallenge {
        auth: me.mode,
        engine_id: me.engine_id,
        nonce: nonce_r,
    })?;
    let transcript = Transcript {
        conn: peer.conn,
        conn_index: peer.conn_index,
        initiator: (peer.role, peer.engine_id),
        responder: (me.role, me.engine_id),
        nonce_i,
        nonce_r,
    };
    let mac = match read_frame(&mut t, &[Kind::AuthProof, Kind::AuthRefused])? {
        Message::AuthRefused { reason, auth } => return Err(refused(me, reason, auth)),
        Message::AuthProof { mac } => mac,
        other => unreachable!("read_frame returned a {:?}", other.kind()),
    };
    if !transcript.verify(key, Purpose::InitiatorProof, &mac) {
        return t.refuse(
            AuthRefusal::BadProof,
            me.mode,
            Failure::new(
                Reason::BadProof,
                "the peer's proof does not verify against this connection's nonces",
            ),
        );
    }
    if !seen.insert(nonce_i) {
        return t.refuse(
            AuthRefusal::Replay,
            me.mode,
            Failure::new(
                Reason::Replay,
                "the nonce was used by another connection meanwhile",
            ),
        );
    }
    t.send(&Message::AuthProof {
        mac: transcript.responder_proof(key),
    })?;
    Ok(Some(transcript.secret(key)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::os::unix::fs::PermissionsExt;

    fn key(byte: u8) -> Key {
        Key::new(vec![byte; 32]).unwrap()
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    fn decode(mode: AuthMode, key: Option<&Key>) -> Local<'_> {
        Local {
            mode,
            key,
            role: Role::Decode,
            engine_id: 0xDEC0,
        }
    }

    fn prefill(mode: AuthMode, key: Option<&Key>) -> Local<'_> {
        Local {
            mode,
            key,
            role: Role::Prefill,
            engine_id: 0x9EF1,
        }
    }

    fn hello_of(me: &Local<'_>, conn: ConnKind, conn_index: u16) -> PeerHello {
        PeerHello {
            role: me.role,
            engine_id: me.engine_id,
            conn,
            conn_index,
        }
    }

    type Outcome = Result<Option<SessionSecret>, Failure>;

    /// Runs one handshake: `d` initiates, `p` responds.
    fn run(
        d: &Local<'_>,
        p: &Local<'_>,
        conn: ConnKind,
        session_d: Option<&SessionSecret>,
        session_p: Option<SessionSecret>,
        seen: &NonceCache,
    ) -> (Outcome, Outcome) {
        let (mut c, mut s) = pair();
        let hello = hello_of(d, conn, 1);
        std::thread::scope(|sc| {
            let r = sc.spawn(|| respond(&mut s, p, &hello, |_| session_p, seen, soon()));
            let i = initiate(&mut c, d, conn, 1, session_d, soon());
            // The initiator may end first: close so a waiting responder sees it.
            drop(c);
            (i, r.join().unwrap())
        })
    }

    #[test]
    fn the_same_key_authenticates_both_sides_and_derives_one_session() {
        let k = key(1);
        let (d, p) = (
            decode(AuthMode::Required, Some(&k)),
            prefill(AuthMode::Required, Some(&k)),
        );
        let seen = NonceCache::new(16);
        let (i, r) = run(&d, &p, ConnKind::Control, None, None, &seen);
        let (si, sr) = (i.unwrap().unwrap(), r.unwrap().unwrap());
        assert_eq!(si, sr);
        // The session secret opens a data connection; a second control session has
        // another secret.
        let (i, r) = run(&d, &p, ConnKind::Data, Some(&si), Some(sr.clone()), &seen);
        // Both ends of the data connection share a secret of its own.
        let (di, dr) = (i.unwrap().unwrap(), r.unwrap().unwrap());
        assert_eq!(di, dr);
        assert_ne!(di, si);
        let (i, _) = run(&d, &p, ConnKind::Data, Some(&si), Some(sr.clone()), &seen);
        assert_ne!(
            i.unwrap().unwrap(),
            di,
            "each data connection has its own secret"
        );
        let (i2, _) = run(&d, &p, ConnKind::Control, None, None, &seen);
        assert_ne!(i2.unwrap().unwrap(), si);
    }

    #[test]
    fn both_off_passes_without_a_proof() {
        let (d, p) = (decode(AuthMode::Off, None), prefill(AuthMode::Off, None));
        let (i, r) = run(&d, &p, ConnKind::Control, None, None, &NonceCache::new(4));
        assert_eq!((i.unwrap(), r.unwrap()), (None, None));
    }

    #[test]
    fn different_keys_are_a_wrong_key_on_both_sides() {
        let (k1, k2) = (key(1), key(2));
        let (d, p) = (
            decode(AuthMode::Required, Some(&k1)),
            prefill(AuthMode::Required, Some(&k2)),
        );
        let (i, r) = run(&d, &p, ConnKind::Control, None, None, &NonceCache::new(4));
        let (i, r) = (i.unwrap_err(), r.unwrap_err());
        assert_eq!((i.reason, r.reason), (Reason::WrongKey, Reason::WrongKey));
        assert!(r.detail.contains(&hex(&k1.id())) && r.detail.contains(&hex(&k2.id())));
        assert!(
            i.to_string()
                .starts_with("authentication failed (wrong key)"),
            "{i}"
        );
    }

    #[test]
    fn one_side_off_is_a_mismatch_naming_both_settings_on_both_sides() {
        let k = key(1);
        for (dm, pm) in [
            (AuthMode::Off, AuthMode::Required),
            (AuthMode::Required, AuthMode::Off),
        ] {
            let dk = (dm == AuthMode::Required).then_some(&k);
            let pk = (pm == AuthMode::Required).then_some(&k);
            let (d, p) = (decode(dm, dk), prefill(pm, pk));
            let (i, r) = run(&d, &p, ConnKind::Control, None, None, &NonceCache::new(4));
            for (f, me, mine, theirs) in [
                (i.unwrap_err(), "this decode engine", dm, pm),
                (r.unwrap_err(), "this prefill engine", pm, dm),
            ] {
                let want = if mine == AuthMode::Required {
                    Reason::NoKey
                } else {
                    Reason::Mismatch
                };
                assert_eq!(f.reason, want, "{f}");
                let s = f.to_string();
                assert!(s.starts_with("authentication mismatch"), "{s}");
                assert!(s.contains(&format!("{me} auth={}", mine.name())), "{s}");
                assert!(
                    s.contains(&format!("peer has auth={}", theirs.name())),
                    "{s}"
                );
            }
        }
    }

    /// Runs a real handshake through a relay that records what the initiator sent.
    fn record_initiator(d: &Local<'_>, p: &Local<'_>, seen: &NonceCache) -> Vec<u8> {
        let (mut c, s) = pair();
        let (r_out, mut r_in) = pair();
        let (mut s_read, mut s_write) = (s.try_clone().unwrap(), s);
        let (mut r_out_read, mut r_out_write) = (r_out.try_clone().unwrap(), r_out);
        let hello = hello_of(d, ConnKind::Control, 1);
        std::thread::scope(|sc| {
            let rec = sc.spawn(move || {
                let (mut all, mut buf) = (Vec::new(), [0u8; 256]);
                while let Ok(n @ 1..) = s_read.read(&mut buf) {
                    all.extend_from_slice(&buf[..n]);
                    let _ = r_out_write.write_all(&buf[..n]);
                }
                let _ = r_out_write.shutdown(std::net::Shutdown::Write);
                all
            });
            sc.spawn(move || {
                let mut buf = [0u8; 256];
                while let Ok(n @ 1..) = r_out_read.read(&mut buf) {
                    let _ = s_write.write_all(&buf[..n]);
                }
                let _ = s_write.shutdown(std::net::Shutdown::Write);
            });
            let r = sc.spawn(move || {
                let out = respond(&mut r_in, p, &hello, |_| None, seen, soon());
                let _ = r_in.shutdown(std::net::Shutdown::Both);
                out
            });
            initiate(&mut c, d, ConnKind::Control, 1, None, soon()).unwrap();
            r.join().unwrap().unwrap();
            c.shutdown(std::net::Shutdown::Both).unwrap();
            rec.join().unwrap()
        })
    }

    #[test]
    fn a_replayed_initiator_handshake_is_refused_as_a_replay() {
        let k = key(3);
        let (d, p) = (
            decode(AuthMode::Required, Some(&k)),
            prefill(AuthMode::Required, Some(&k)),
        );
        let seen = NonceCache::new(16);
        let recorded = record_initiator(&d, &p, &seen);
        assert_eq!(recorded.len(), 2 * FRAME_HEADER_LEN + 44 + 32);
        let hello = hello_of(&d, ConnKind::Control, 1);
        for cache in [&seen, &NonceCache::new(16)] {
            let (mut c, mut s) = pair();
            c.write_all(&recorded).unwrap();
            let f = respond(&mut s, &p, &hello, |_| None, cache, soon()).unwrap_err();
            // Known nonce: named a replay; forgotten nonce: the old proof fails against
            // the fresh challenge.
            let want = if std::ptr::eq(cache, &seen) {
                Reason::Replay
            } else {
                Reason::BadProof
            };
            assert_eq!(f.reason, want, "{f}");
        }
    }

    #[test]
    fn a_replayed_responder_handshake_is_refused_by_the_initiator() {
        let k = key(4);
        let (d, p) = (
            decode(AuthMode::Required, Some(&k)),
            prefill(AuthMode::Required, Some(&k)),
        );
        // Record the responder's answers to a real initiator.
        let (mut c, mut s) = pair();
        let mut tap = c.try_clone().unwrap();
        let hello = hello_of(&d, ConnKind::Control, 1);
        let seen = NonceCache::new(4);
        std::thread::scope(|sc| {
            let r = sc.spawn(|| respond(&mut s, &p, &hello, |_| None, &seen, soon()));
            // Drive the initiator's half by hand so that the responder's bytes stay in
            // the socket for us to read.
            let n = nonce().unwrap();
            let mut out = Vec::new();
            Message::AuthHello {
                auth: AuthMode::Required,
                key_id: k.id(),
                nonce: n,
            }
            .encode(&mut out)
            .unwrap();
            c.write_all(&out).unwrap();
            let mut t = Timed {
                s: &mut tap,
                deadline: soon(),
            };
            let Message::AuthChallenge {
                engine_id,
                nonce: nr,
                ..
            } = read_frame(&mut t, &[Kind::AuthChallenge]).unwrap()
            else {
                panic!()
            };
            let tr = Transcript {
                conn: ConnKind::Control,
                conn_index: 1,
                initiator: (Role::Decode, d.engine_id),
                responder: (Role::Prefill, engine_id),
                nonce_i: n,
                nonce_r: nr,
            };
            let mut out = Vec::new();
            Message::AuthProof {
                mac: tr.initiator_proof(&k.0),
            }
            .encode(&mut out)
            .unwrap();
            c.write_all(&out).unwrap();
            let proof = read_frame(&mut t, &[Kind::AuthProof]).unwrap();
            r.join().unwrap().unwrap();
            // Replay challenge and proof to a fresh initiator.
            let (mut c2, mut fake) = pair();
            let mut replay = Vec::new();
            Message::AuthChallenge {
                auth: AuthMode::Required,
                engine_id,
                nonce: nr,
            }
            .encode(&mut replay)
            .unwrap();
            proof.encode(&mut replay).unwrap();
            fake.write_all(&replay).unwrap();
            let f = initiate(&mut c2, &d, ConnKind::Control, 1, None, soon()).unwrap_err();
            assert_eq!(f.reason, Reason::BadProof, "{f}");
        });
    }

    #[test]
    fn a_data_connection_needs_the_current_session_secret() {
        let k = key(5);
        let (d, p) = (
            decode(AuthMode::Required, Some(&k)),
            prefill(AuthMode::Required, Some(&k)),
        );
        let seen = NonceCache::new(16);
        let (i, r) = run(&d, &p, ConnKind::Control, None, None, &seen);
        let (old, _) = (i.unwrap().unwrap(), r.unwrap());
        let (i, r) = run(&d, &p, ConnKind::Control, None, None, &seen);
        let (new_d, new_p) = (i.unwrap().unwrap(), r.unwrap().unwrap());
        // A stale session, or none at all, is refused; the current one passes.
        let (i, r) = run(
            &d,
            &p,
            ConnKind::Data,
            Some(&old),
            Some(new_p.clone()),
            &seen,
        );
        assert_eq!(i.unwrap_err().reason, Reason::NoSession);
        assert_eq!(r.unwrap_err().reason, Reason::NoSession);
        let (i, r) = run(&d, &p, ConnKind::Data, Some(&new_d), None, &seen);
        assert_eq!(i.unwrap_err().reason, Reason::NoSession);
        assert_eq!(r.unwrap_err().reason, Reason::NoSession);
        let (i, r) = run(&d, &p, ConnKind::Data, Some(&new_d), Some(new_p), &seen);
        assert!(i.is_ok() && r.is_ok());
    }

    #[test]
    fn a_forged_proof_is_refused_as_a_bad_proof() {
        let k = key(6);
        let (d, p) = (
            decode(AuthMode::Required, Some(&k)),
            prefill(AuthMode::Required, Some(&k)),
        );
        let (mut c, mut s) = pair();
        let hello = hello_of(&d, ConnKind::Control, 0);
        let mut out = Vec::new();
        // Claims the right key id, but cannot compute the proof.
        Message::AuthHello {
            auth: AuthMode::Required,
            key_id: k.id(),
            nonce: [7; AUTH_NONCE_LEN],
        }
        .encode(&mut out)
        .unwrap();
        Message::AuthProof {
            mac: [0x55; AUTH_MAC_LEN],
        }
        .encode(&mut out)
        .unwrap();
        c.write_all(&out).unwrap();
        let f = respond(&mut s, &p, &hello, |_| None, &NonceCache::new(4), soon()).unwrap_err();
        assert_eq!(f.reason, Reason::BadProof, "{f}");
    }

    #[test]
    fn silence_truncation_and_oversize_end_the_handshake() {
        let k = key(7);
        let p = prefill(AuthMode::Required, Some(&k));
        let hello = hello_of(&decode(AuthMode::Required, Some(&k)), ConnKind::Control, 0);
        let seen = NonceCache::new(4);
        // Silence: the deadline ends it.
        let (_c, mut s) = pair();
        let t = Instant::now();
        let f = respond(
            &mut s,
            &p,
            &hello,
            |_| None,
            &seen,
            Instant::now() + Duration::from_millis(200),
        )
        .unwrap_err();
        assert_eq!(f.reason, Reason::Incomplete, "{f}");
        assert!(t.elapsed() >= Duration::from_millis(200));
        // Truncated: a header, half a payload, close.
        let (mut c, mut s) = pair();
        let mut out = Vec::new();
        Message::AuthHello {
            auth: AuthMode::Required,
            key_id: k.id(),
            nonce: [1; AUTH_NONCE_LEN],
        }
        .encode(&mut out)
        .unwrap();
        c.write_all(&out[..30]).unwrap();
        drop(c);
        let f = respond(&mut s, &p, &hello, |_| None, &seen, soon()).unwrap_err();
        assert_eq!(f.reason, Reason::Incomplete, "{f}");
        assert!(f.detail.contains("truncated"), "{f}");
        // Oversized: refused from the header alone, with no payload sent.
        let (mut c, mut s) = pair();
        c.write_all(&FrameHeader::new(Kind::AuthHello, 1 << 20).encode())
            .unwrap();
        let f = respond(&mut s, &p, &hello, |_| None, &seen, soon()).unwrap_err();
        assert_eq!(f.reason, Reason::Malformed, "{f}");
        assert!(f.detail.contains("oversized"), "{f}");
        // Another kind where AuthHello is due: refused from the header.
        let (mut c, mut s) = pair();
        c.write_all(&FrameHeader::new(Kind::Destination, 28).encode())
            .unwrap();
        let f = respond(&mut s, &p, &hello, |_| None, &seen, soon()).unwrap_err();
        assert_eq!(f.reason, Reason::Malformed, "{f}");
        assert!(f.detail.contains("a Destination frame"), "{f}");
    }

    #[test]
    fn a_trickling_peer_is_held_only_until_the_one_deadline() {
        let k = key(8);
        let p = prefill(AuthMode::Required, Some(&k));
        let hello = hello_of(&decode(AuthMode::Required, Some(&k)), ConnKind::Control, 0);
        let (mut c, mut s) = pair();
        let mut out = Vec::new();
        Message::AuthHello {
            auth: AuthMode::Required,
            key_id: k.id(),
            nonce: [1; AUTH_NONCE_LEN],
        }
        .encode(&mut out)
        .unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                // One byte every 50 ms: each read alone would be well within any timeout.
                for b in &out {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    if c.write_all(&[*b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
            let t = Instant::now();
            let f = respond(
                &mut s,
                &p,
                &hello,
                |_| None,
                &NonceCache::new(4),
                Instant::now() + Duration::from_millis(500),
            )
            .unwrap_err();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(f.reason, Reason::Incomplete, "{f}");
            // 60 bytes at 50 ms would take 3 s: the deadline, not the bytes, ended it.
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        });
    }

    #[test]
    fn every_transcript_field_changes_the_proof() {
        let k = key(9);
        let base = Transcript {
            conn: ConnKind::Control,
            conn_index: 0,
            initiator: (Role::Decode, 1),
            responder: (Role::Prefill, 2),
            nonce_i: [1; AUTH_NONCE_LEN],
            nonce_r: [2; AUTH_NONCE_LEN],
        };
        let variants = [
            Transcript {
                conn: ConnKind::Data,
                ..base
            },
            Transcript {
                conn_index: 1,
                ..base
            },
            Transcript {
                initiator: (Role::Prefill, 1),
                ..base
            },
            Transcript {
                initiator: (Role::Decode, 3),
                ..base
            },
            Transcript {
                responder: (Role::Decode, 2),
                ..base
            },
            Transcript {
                responder: (Role::Prefill, 3),
                ..base
            },
            Transcript {
                nonce_i: [3; AUTH_NONCE_LEN],
                ..base
            },
            Transcript {
                nonce_r: [3; AUTH_NONCE_LEN],
                ..base
            },
        ];
        let proof = base.initiator_proof(&k.0);
        assert!(base.verify(&k.0, Purpose::InitiatorProof, &proof));
        assert!(!base.verify(&k.0, Purpose::ResponderProof, &proof));
        assert!(!base.verify(&key(10).0, Purpose::InitiatorProof, &proof));
        assert_ne!(base.responder_proof(&k.0), proof);
        assert_ne!(base.session(&k.0).0, proof);
        for v in variants {
            assert!(!v.verify(&k.0, Purpose::InitiatorProof, &proof), "{v:?}");
        }
        assert_eq!(base.bytes()[..2], PROTO_VERSION.to_le_bytes());
    }

    #[test]
    fn keys_from_hex_check_digits_and_length_and_never_echo_the_text() {
        let good = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        let k = Key::from_hex(good).unwrap();
        assert_eq!(k.0[15], 0xff);
        assert_eq!(k, Key::from_hex(&good.to_lowercase()).unwrap());
        assert_ne!(k.id(), key(0).id());
        for bad in [
            &good[..62],
            &good[..63],
            "zz",
            &format!("{}zz", &good[..62]),
        ] {
            let e = Key::from_hex(bad).unwrap_err();
            assert!(!e.contains(bad), "{e}");
        }
        let dbg = format!("{k:?}");
        assert!(!dbg.contains("0011") && dbg.contains("32 bytes"), "{dbg}");
    }

    #[test]
    fn key_files_must_be_private_regular_and_long_enough() {
        let dir = std::env::temp_dir().join(format!("kvxfer-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, bytes: &[u8], mode: u32| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p.to_str().unwrap().to_string()
        };
        let ok = file("ok", &[9; 32], 0o600);
        assert_eq!(Key::from_file(&ok).unwrap(), Key::new(vec![9; 32]).unwrap());
        assert!(Key::from_file(&file("ro", &[9; 40], 0o400)).is_ok());
        for (name, mode, shown) in [
            ("g", 0o640, "0640"),
            ("o", 0o604, "0604"),
            ("w", 0o620, "0620"),
        ] {
            let p = file(name, &[9; 32], mode);
            let e = Key::from_file(&p).unwrap_err();
            assert!(e.contains(&p) && e.contains(shown), "{e}");
        }
        let short = file("short", &[9; 31], 0o600);
        let e = Key::from_file(&short).unwrap_err();
        assert!(e.contains(&short) && e.contains("at least 32"), "{e}");
        let long = file("long", &vec![9; MAX_KEY_LEN + 1], 0o600);
        assert!(Key::from_file(&long).unwrap_err().contains("at most"));
        let d = dir.to_str().unwrap();
        assert!(Key::from_file(d)
            .unwrap_err()
            .contains("not a regular file"));
        let missing = format!("{d}/missing");
        assert!(Key::from_file(&missing).unwrap_err().contains(&missing));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_nonce_cache_is_bounded_and_forgets_the_oldest() {
        let c = NonceCache::new(2);
        assert!(c.insert([1; 32]) && c.insert([2; 32]));
        assert!(!c.insert([1; 32]));
        assert!(c.insert([3; 32]));
        assert!(!c.contains(&[1; 32]) && c.contains(&[2; 32]) && c.contains(&[3; 32]));
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
