//! Admission of connections: the authentication that starts every connection (the proof
//! itself is `crate::auth`), the bounds on connections not yet authenticated, and how a
//! refusal is counted, logged and named in the failure of the rooms it concerns.
//!
//! Prefill side (responder): an accepted connection gets [`HANDSHAKE_TIMEOUT_MS`] (at
//! most `bootstrap_timeout_ms`) for its `Hello` and the whole exchange, a fixed buffer,
//! and a slot among [`MAX_PENDING`] (at most [`MAX_PENDING_PER_ADDR`] per remote
//! address); nothing else is read from it before it proved the key. A refused
//! connection is closed, counted in `auth_failures` and logged at warn level the first
//! time its address is refused (debug after that). Prefill rooms cannot be told which
//! decode engine would have claimed them, so none is failed by a refusal (a stranger
//! could otherwise cancel them); a room that then times out in bootstrapping names the
//! last refusal in its reason.
//!
//! Decode side (initiator): a connection to a prefill engine that fails to authenticate
//! loses that peer, failing its rooms at once: `MISMATCH` when the settings or keys
//! differ (or TLS: one side only, a certificate the other refuses), `PROTOCOL` for a bad
//! proof or a replay, `PEER_LOST` for an incomplete one.
//!
//! Without a key or TLS, and `auth` at `auto`, an engine serves only its own host
//! (`Config::local_only`): the prefill side answers a connection from an address that
//! is not loopback with `AuthRefused` (not on this host) before reading anything from it,
//! the decode side drops a connection it made to such an address before writing to it;
//! both count and log it like the refusals above. (The engine could not start listening
//! beyond loopback: `Node::new`.)
//!
//! With TLS (`crate::tls`), the prefill side tells a control connection (a TLS record
//! first) from a data connection (a plain frame first) by the first byte, runs the TLS
//! handshake for the former, refuses a plain control connection or a TLS data
//! connection, and keys each control session's data connections with the secret of its
//! TLS session, with or without a cluster key. Every TLS failure is a refusal as above.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Control, Peer, SetupError};
use crate::auth::{self, Failure, Key, Local, NonceCache, PeerHello, Reason, SessionSecret};
use crate::config::{AuthMode, Config};
use crate::error::Result;
use crate::node::is_local;
use crate::proto::{ConnKind, Message, Role as WireRole, PROTO_VERSION};
use crate::room::Cause;
use crate::tls::{HandshakeError, Tls, Wire};

/// Longest time a connection may take to authenticate (capped by
/// `bootstrap_timeout_ms`).
pub(crate) const HANDSHAKE_TIMEOUT_MS: u64 = 5_000;
/// Most accepted connections still authenticating at once; more are refused at once.
pub(crate) const MAX_PENDING: usize = 256;
/// Most of those from one remote address.
pub(crate) const MAX_PENDING_PER_ADDR: usize = 32;
/// Nonces of authenticated connections remembered to name replays.
const SEEN_NONCES: usize = 4096;
/// Control sessions (one per decode engine) whose data connections may still come.
const MAX_SESSIONS: usize = 4096;
/// Most decode engines one prefill engine serves at once (each has a control
/// connection, two threads and up to `MAX_CONNECTIONS_PER_PEER` data connections with a
/// thread each); a control connection from one more is refused.
pub(crate) const MAX_PEERS: usize = 1024;
/// Remote addresses remembered as already logged.
const MAX_LOGGED: usize = 4096;

/// Authentication state of one engine.
pub(crate) struct Gate {
    mode: AuthMode,
    /// `auth=auto` with neither a key nor TLS: only engines on this host (loopback
    /// addresses), both ways (`Config::local_only`).
    local_only: bool,
    /// TLS of the control connections, when configured.
    tls: Option<Tls>,
    /// `encrypt_data`.
    encrypt_data: bool,
    key: Option<Key>,
    seen: NonceCache,
    /// Prefill side: the secret of each decode engine's current control session, by
    /// engine id, oldest first for eviction.
    sessions: Mutex<(HashMap<u64, SessionSecret>, VecDeque<u64>)>,
    /// Connections authenticating now: in all, and by remote address.
    pending: Mutex<(usize, HashMap<IpAddr, usize>)>,
    /// Addresses whose refusal was logged at warn level.
    logged: Mutex<HashSet<IpAddr>>,
    /// Addresses whose refusal past a bound (`Control::over_limit`) was logged at warn
    /// level.
    limit_logged: Mutex<HashSet<IpAddr>>,
    /// The last refusal: engine-clock ms and what it said.
    last: Mutex<Option<(u64, String)>>,
}

impl Gate {
    /// The gate for `config`; `auth=required` without a key is an error.
    pub(crate) fn new(config: &Config) -> Result<Gate> {
        let mode = config.auth_mode()?;
        Ok(Gate {
            mode,
            local_only: config.local_only(),
            tls: config.tls()?,
            encrypt_data: config.encrypt_data,
            key: config
                .auth_key
                .clone()
                .filter(|_| mode == AuthMode::Required),
            seen: NonceCache::new(SEEN_NONCES),
            sessions: Mutex::new((HashMap::new(), VecDeque::new())),
            pending: Mutex::new((0, HashMap::new())),
            logged: Mutex::new(HashSet::new()),
            limit_logged: Mutex::new(HashSet::new()),
            last: Mutex::new(None),
        })
    }

    fn session(&self, engine_id: u64) -> Option<SessionSecret> {
        self.sessions.lock().0.get(&engine_id).cloned()
    }

    fn keep_session(&self, engine_id: u64, secret: SessionSecret) {
        let mut g = self.sessions.lock();
        let (map, order) = &mut *g;
        if map.insert(engine_id, secret).is_none() {
            order.push_back(engine_id);
        }
        while order.len() > MAX_SESSIONS {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// Forgets the control session of `engine_id` (one refused after it authenticated),
    /// so that refused sessions do not push out those of engines being served.
    pub(super) fn forget_session(&self, engine_id: u64) {
        let mut g = self.sessions.lock();
        let (map, order) = &mut *g;
        if map.remove(&engine_id).is_some() {
            order.retain(|id| *id != engine_id);
        }
    }

    /// A slot for one more unauthenticated connection from `ip`, if any is free.
    fn slot(&self, ip: IpAddr) -> Option<Slot<'_>> {
        let mut g = self.pending.lock();
        let (total, by_ip) = &mut *g;
        let mine = by_ip.entry(ip).or_insert(0);
        if *total >= MAX_PENDING || *mine >= MAX_PENDING_PER_ADDR {
            if *mine == 0 {
                by_ip.remove(&ip);
            }
            return None;
        }
        *mine += 1;
        *total += 1;
        Some(Slot { gate: self, ip })
    }

    /// The last refusal: when (engine-clock ms) and what.
    pub(crate) fn last_refusal(&self) -> Option<(u64, String)> {
        self.last.lock().clone()
    }

    /// True the first time `ip` is refused (while fewer than `MAX_LOGGED` are known).
    fn first_refusal(&self, ip: IpAddr) -> bool {
        first_time(&self.logged, ip)
    }
}

/// True the first time `ip` is put in `logged` (while fewer than `MAX_LOGGED` are).
fn first_time(logged: &Mutex<HashSet<IpAddr>>, ip: IpAddr) -> bool {
    let mut logged = logged.lock();
    logged.len() < MAX_LOGGED && logged.insert(ip)
}

/// One unauthenticated connection's place in [`Gate::pending`], given back on drop.
struct Slot<'a> {
    gate: &'a Gate,
    ip: IpAddr,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut g = self.gate.pending.lock();
        let (total, by_ip) = &mut *g;
        *total -= 1;
        if let Some(n) = by_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                by_ip.remove(&self.ip);
            }
        }
    }
}

/// The room cause of a failed authentication, decode side.
fn cause(f: &Failure) -> Cause {
    match f.reason {
        r if r.is_config_mismatch() => Cause::Mismatch,
        Reason::Incomplete | Reason::Busy => Cause::PeerLost,
        _ => Cause::Protocol,
    }
}

/// A connection that passed admission: what it is, and what it proved.
pub(super) struct Admitted {
    /// The connection: TLS for a control connection of an engine with TLS.
    pub wire: Wire,
    /// The decode engine's id, as its `Hello` claimed.
    pub engine_id: u64,
    /// Control or data.
    pub conn: ConnKind,
    /// Its index.
    pub index: u16,
    /// A data connection's own secret (with authentication or TLS on).
    pub secret: Option<SessionSecret>,
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

impl Control {
    fn handshake_deadline(&self) -> Instant {
        let ms = HANDSHAKE_TIMEOUT_MS.min(self.node.config.bootstrap_timeout_ms);
        Instant::now() + Duration::from_millis(ms)
    }

    /// This engine, as the exchange on a connection of kind `conn` sees it. With TLS,
    /// data connections always prove their control session (whose secret comes from
    /// the TLS session), whether or not a cluster key is set.
    fn local(&self, conn: ConnKind) -> Local<'_> {
        let mode = match conn {
            ConnKind::Data if self.gate.tls.is_some() => AuthMode::Required,
            _ => self.gate.mode,
        };
        Local {
            mode,
            key: self.gate.key.as_ref(),
            role: self.wire_role(),
            engine_id: self.node.engine_id,
        }
    }

    /// Whether data payloads are sealed (`encrypt_data=true`, which needs TLS).
    pub(crate) fn encrypts_data(&self) -> bool {
        self.gate.encrypt_data
    }

    /// The secret a control session's data connections prove: from the TLS session
    /// (and the cluster-key session, if any) with TLS, the cluster-key session without.
    fn session_of(&self, wire: &Wire, keyed: Option<SessionSecret>) -> Option<SessionSecret> {
        match wire.session_secret() {
            Some(exported) => Some(SessionSecret::from_tls(
                &exported,
                self.gate.encrypt_data,
                keyed.as_ref(),
            )),
            None => keyed,
        }
    }

    /// Counts and logs a refused connection (at warn level once per address).
    fn refused(&self, addr: Option<SocketAddr>, who: &str, f: &Failure) {
        self.node
            .metrics
            .auth_failures
            .fetch_add(1, Ordering::Relaxed);
        let text = format!("refused {who}: {f}");
        *self.gate.last.lock() = Some((self.node.now_ms(), text.clone()));
        match addr {
            Some(a) if self.gate.first_refusal(a.ip()) => crate::log!(
                self.node.log,
                Warn,
                "{text} (later refusals from {} are logged at debug level)",
                a.ip()
            ),
            _ => crate::log!(self.node.log, Debug, "{text}"),
        }
    }

    /// Counts and logs an authenticated connection refused past a bound (`what` says
    /// which), at warn level once per address. The caller closes it.
    pub(super) fn over_limit(&self, addr: Option<SocketAddr>, what: &str) {
        self.node
            .metrics
            .peer_limit_refusals
            .fetch_add(1, Ordering::Relaxed);
        match addr {
            Some(a) if first_time(&self.gate.limit_logged, a.ip()) => crate::log!(
                self.node.log,
                Warn,
                "refused {what} (later refusals past a bound from {} are logged at debug \
                 level; counted in peer_limit_refusals)",
                a.ip()
            ),
            _ => crate::log!(self.node.log, Debug, "refused {what}"),
        }
    }

    /// Tells the peer of accepted connection `s` at once why it is refused, without
    /// waiting for it to read (best effort).
    fn tell(&self, s: &TcpStream, reason: crate::proto::AuthRefusal) {
        let mut msg = Vec::new();
        let m = Message::AuthRefused {
            reason,
            auth: self.gate.mode,
        };
        if m.encode(&mut msg).is_ok() {
            let _ = s.set_nonblocking(true);
            let _ = std::io::Write::write_all(&mut &*s, &msg);
        }
    }

    /// Decode side: with `auth=auto` and neither a key nor TLS, refuses the connection
    /// `s` just made to `peer` if it leads to another host (counted and logged as a
    /// refusal), before anything is sent on it.
    pub(super) fn local_peer(
        &self,
        s: &TcpStream,
        peer: &Arc<Peer>,
    ) -> std::result::Result<(), SetupError> {
        if !self.gate.local_only {
            return Ok(());
        }
        let addr = s.peer_addr().ok();
        if addr.is_some_and(|a| is_local(a.ip())) {
            return Ok(());
        }
        let f = Failure::new(
            Reason::NotLocal,
            format!(
                "{} is at {}, not on this host, and this engine works only with engines on its \
                 own host: it has no cluster key and no TLS, and 'auth' at its default \
                 ('auto'). Give every engine the same key ('auth_key_file'), or set 'auth' to \
                 'off' on both to run without authentication",
                peer.name,
                addr.map_or_else(|| "an unknown address".into(), |a| a.to_string())
            ),
        );
        self.refused(addr, &peer.name, &f);
        Err(SetupError::new(cause(&f), f.to_string()))
    }

    /// Tells a peer in the clear that TLS is on one side only (best effort).
    fn refuse_tls(&self, s: &TcpStream) {
        let mut msg = Vec::new();
        let m = Message::AuthRefused {
            reason: crate::proto::AuthRefusal::Tls,
            auth: self.gate.mode,
        };
        if m.encode(&mut msg).is_ok() {
            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = std::io::Write::write_all(&mut &*s, &msg);
        }
    }

    /// Prefill side: the TLS handshake (with TLS configured and a TLS record coming),
    /// then the `Hello` of accepted connection `s` and its authentication.
    /// `Ok(Some(..))` to go on; `Ok(None)` when it was refused (counted and logged here;
    /// dropping it closes it); `Err` for a protocol error before the exchange with
    /// authentication and TLS off, as before authentication existed.
    pub(super) fn admit(&self, s: TcpStream) -> std::result::Result<Option<Admitted>, String> {
        let addr = s.peer_addr().ok();
        let who = addr.map_or_else(
            || "a connection".to_string(),
            |a| format!("connection from {a}"),
        );
        if self.gate.local_only && !addr.is_some_and(|a| is_local(a.ip())) {
            // Nothing is read from it: it is told why, best effort, and closed.
            self.tell(&s, crate::proto::AuthRefusal::NotLocal);
            let f = Failure::new(
                Reason::NotLocal,
                "this engine accepts only engines on its own host (loopback addresses): it \
                 has no cluster key and no TLS, and 'auth' at its default ('auto'). Give \
                 every engine the same key ('auth_key_file'), or set 'auth' to 'off' to \
                 accept any address without authentication",
            );
            self.refused(addr, &who, &f);
            return Ok(None);
        }
        let Some(_slot) = addr.map_or(Some(None), |a| self.gate.slot(a.ip()).map(Some)) else {
            self.tell(&s, crate::proto::AuthRefusal::Busy);
            let f = Failure {
                reason: Reason::Busy,
                detail: format!(
                    "{MAX_PENDING} connections (or {MAX_PENDING_PER_ADDR} from one address) are \
                     already authenticating"
                ),
            };
            self.refused(addr, &who, &f);
            return Ok(None);
        };
        let deadline = self.handshake_deadline();
        let required = self.gate.mode == AuthMode::Required || self.gate.tls.is_some();
        let refuse = |f: Failure| {
            self.refused(addr, &who, &f);
            Ok(None)
        };
        let mut wire = match &self.gate.tls {
            Some(tls) => match first_byte(&s, deadline) {
                Ok(TLS_HANDSHAKE) => match tls.accept(s, deadline) {
                    Ok(w) => w,
                    Err((e, s)) => {
                        let f = tls_failure(e, "this prefill engine");
                        if f.reason == Reason::TlsMismatch {
                            self.refuse_tls(&s);
                        }
                        return refuse(f);
                    }
                },
                Ok(_) => Wire::Plain(s),
                Err(f) => return refuse(f),
            },
            None => Wire::Plain(s),
        };
        // Before the exchange, with auth off, a broken peer is a protocol error as before.
        let early = |f: Failure, wire: &Wire| {
            if f.reason == Reason::TlsMismatch {
                self.refuse_tls(wire.tcp());
            }
            if required || f.reason == Reason::TlsMismatch {
                self.refused(addr, &who, &f);
                Ok(None)
            } else {
                Err(f.detail)
            }
        };
        let hello = match auth::read_hello(&mut wire, deadline) {
            Ok(Message::Hello {
                proto_version,
                role,
                engine_id,
                conn,
                conn_index,
            }) => {
                if proto_version != PROTO_VERSION {
                    return early(
                        Failure::new(
                            Reason::Malformed,
                            format!(
                                "peer speaks protocol {proto_version}, this build {PROTO_VERSION}"
                            ),
                        ),
                        &wire,
                    );
                }
                if role != WireRole::Decode {
                    return early(
                        Failure::new(
                            Reason::Malformed,
                            format!("peer is a {role:?} engine, expected Decode"),
                        ),
                        &wire,
                    );
                }
                PeerHello {
                    role,
                    engine_id,
                    conn,
                    conn_index,
                }
            }
            Ok(other) => unreachable!("read_hello returned a {:?}", other.kind()),
            Err(f) => return early(f, &wire),
        };
        if self.gate.tls.is_some() {
            match (hello.conn, wire.is_tls()) {
                (ConnKind::Control, false) => {
                    return early(
                        Failure::new(
                            Reason::TlsMismatch,
                            "the peer opened its control connection without TLS (it has no \
                             tls_cert_file, tls_key_file and tls_ca_file set), this prefill \
                             engine requires TLS",
                        ),
                        &wire,
                    )
                }
                (ConnKind::Data, true) => {
                    return early(
                        Failure::new(
                            Reason::Malformed,
                            "a data connection over TLS (data connections are plain TCP)",
                        ),
                        &wire,
                    )
                }
                _ => {}
            }
        }
        let who = format!(
            "decode engine {:016x} at {} ({} connection {})",
            hello.engine_id,
            addr.map_or_else(|| "?".into(), |a| a.to_string()),
            match hello.conn {
                ConnKind::Control => "control",
                ConnKind::Data => "data",
            },
            hello.conn_index
        );
        let local = self.local(hello.conn);
        match auth::respond(
            &mut wire,
            &local,
            &hello,
            |id| self.gate.session(id),
            &self.gate.seen,
            deadline,
        ) {
            Ok(secret) => {
                let secret = match hello.conn {
                    ConnKind::Control => {
                        if let Some(session) = self.session_of(&wire, secret) {
                            self.gate.keep_session(hello.engine_id, session);
                        }
                        None
                    }
                    ConnKind::Data => secret,
                };
                // The rest of the setup has the usual timeouts.
                wire.tcp()
                    .set_read_timeout(Some(self.node.bootstrap_timeout()))
                    .and_then(|()| wire.tcp().set_write_timeout(None))
                    .map_err(|e| e.to_string())?;
                Ok(Some(Admitted {
                    wire,
                    engine_id: hello.engine_id,
                    conn: hello.conn,
                    index: hello.conn_index,
                    secret,
                }))
            }
            Err(f) if !required && matches!(f.reason, Reason::Incomplete | Reason::Malformed) => {
                Err(f.detail)
            }
            Err(f) => {
                self.refused(addr, &who, &self.hint(hello.conn, f));
                Ok(None)
            }
        }
    }

    /// With TLS, a data connection that proves another session than its control
    /// connection's most likely comes from an engine that differs in `encrypt_data`:
    /// `f`, saying so.
    fn hint(&self, conn: ConnKind, mut f: Failure) -> Failure {
        if self.gate.tls.is_some() && conn == ConnKind::Data && f.reason == Reason::NoSession {
            f.detail.push_str(&format!(
                " (with TLS, engines that differ in encrypt_data prove different sessions: \
                 this engine has encrypt_data={})",
                self.gate.encrypt_data
            ));
        }
        f
    }

    /// Decode side: the control connection to `peer` on socket `s`: a TLS client
    /// handshake with TLS configured (a failure is counted, logged and names TLS), the
    /// socket as it is without.
    pub(super) fn secure(
        &self,
        s: TcpStream,
        peer: &Arc<Peer>,
    ) -> std::result::Result<Wire, SetupError> {
        let Some(tls) = &self.gate.tls else {
            return Ok(Wire::Plain(s));
        };
        let addr = s.peer_addr().ok();
        tls.connect(s, self.handshake_deadline()).map_err(|e| {
            let f = tls_failure(e, "this decode engine");
            self.refused(addr, &peer.name, &f);
            SetupError::new(cause(&f), f.to_string())
        })
    }

    /// Decode side: authenticates connection `s` to `peer` (connection `conn_index` of
    /// kind `conn`) right after our `Hello` went out. A data connection proves
    /// `session`, what its control connection's authentication returned. A refusal is
    /// counted and logged here; the caller loses the peer with the error, which names
    /// authentication. Returns the control session's secret (what its data connections
    /// prove), or a data connection's own secret.
    pub(super) fn authenticate(
        &self,
        s: &mut Wire,
        peer: &Arc<Peer>,
        conn: ConnKind,
        conn_index: u16,
        session: Option<&SessionSecret>,
    ) -> std::result::Result<Option<SessionSecret>, SetupError> {
        let timeouts = (s.tcp().read_timeout(), s.tcp().write_timeout());
        let local = self.local(conn);
        let r = auth::initiate(
            s,
            &local,
            conn,
            conn_index,
            session,
            self.handshake_deadline(),
        );
        if let (Ok(read), Ok(write)) = timeouts {
            let _ = s.tcp().set_read_timeout(read);
            let _ = s.tcp().set_write_timeout(write);
        }
        match r {
            Ok(secret) if conn == ConnKind::Control => Ok(self.session_of(s, secret)),
            Ok(secret) => Ok(secret),
            Err(f) => {
                let f = self.hint(conn, f);
                self.refused(s.peer_addr().ok(), &peer.name, &f);
                let cause = match f.reason {
                    Reason::NoSession if self.gate.tls.is_some() => Cause::Mismatch,
                    _ => cause(&f),
                };
                Err(SetupError::new(cause, f.to_string()))
            }
        }
    }
}

/// The first byte the peer sends, waiting for it until `deadline`.
fn first_byte(s: &TcpStream, deadline: Instant) -> std::result::Result<u8, Failure> {
    let mut b = [0u8; 1];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::new(
                Reason::Incomplete,
                "no complete handshake before the deadline",
            ));
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| Failure::new(Reason::Incomplete, e.to_string()))?;
        match s.peek(&mut b) {
            Ok(0) => {
                return Err(Failure::new(
                    Reason::Incomplete,
                    "the connection closed before its first byte",
                ))
            }
            Ok(_) => return Ok(b[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Failure::new(
                    Reason::Incomplete,
                    format!("no complete handshake before the deadline ({e})"),
                ))
            }
        }
    }
}

/// A failed TLS handshake as an authentication failure, seen from `me`.
fn tls_failure(e: HandshakeError, me: &str) -> Failure {
    match e {
        HandshakeError::PeerPlain => Failure::new(
            Reason::TlsMismatch,
            format!(
                "the peer speaks without TLS (it has no tls_cert_file, tls_key_file and \
                 tls_ca_file set), {me} requires TLS"
            ),
        ),
        HandshakeError::Io(e) => Failure::new(Reason::Incomplete, format!("TLS handshake: {e}")),
        HandshakeError::Tls(why) => Failure::new(Reason::Tls, why),
    }
}
