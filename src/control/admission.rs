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
//! differ, `PROTOCOL` for a bad proof or a replay, `PEER_LOST` for an incomplete one.

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
use crate::proto::{ConnKind, Message, Role as WireRole, PROTO_VERSION};
use crate::room::Cause;

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
/// Remote addresses remembered as already logged.
const MAX_LOGGED: usize = 4096;

/// Authentication state of one engine.
pub(crate) struct Gate {
    mode: AuthMode,
    key: Option<Key>,
    seen: NonceCache,
    /// Prefill side: the secret of each decode engine's current control session, by
    /// engine id, oldest first for eviction.
    sessions: Mutex<(HashMap<u64, SessionSecret>, VecDeque<u64>)>,
    /// Connections authenticating now: in all, and by remote address.
    pending: Mutex<(usize, HashMap<IpAddr, usize>)>,
    /// Addresses whose refusal was logged at warn level.
    logged: Mutex<HashSet<IpAddr>>,
    /// The last refusal: engine-clock ms and what it said.
    last: Mutex<Option<(u64, String)>>,
}

impl Gate {
    /// The gate for `config`; `auth=required` without a key is an error.
    pub(crate) fn new(config: &Config) -> Result<Gate> {
        let mode = config.auth_mode()?;
        Ok(Gate {
            mode,
            key: config
                .auth_key
                .clone()
                .filter(|_| mode == AuthMode::Required),
            seen: NonceCache::new(SEEN_NONCES),
            sessions: Mutex::new((HashMap::new(), VecDeque::new())),
            pending: Mutex::new((0, HashMap::new())),
            logged: Mutex::new(HashSet::new()),
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

    /// True the first time `ip` is refused (while fewer than `MAX_LOGGED` are known).
    /// The last refusal: when (engine-clock ms) and what.
    pub(crate) fn last_refusal(&self) -> Option<(u64, String)> {
        self.last.lock().clone()
    }

    fn first_refusal(&self, ip: IpAddr) -> bool {
        let mut logged = self.logged.lock();
        logged.len() < MAX_LOGGED && logged.insert(ip)
    }
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

impl Control {
    fn handshake_deadline(&self) -> Instant {
        let ms = HANDSHAKE_TIMEOUT_MS.min(self.node.config.bootstrap_timeout_ms);
        Instant::now() + Duration::from_millis(ms)
    }

    fn local(&self) -> Local<'_> {
        Local {
            mode: self.gate.mode,
            key: self.gate.key.as_ref(),
            role: self.wire_role(),
            engine_id: self.node.engine_id,
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

    /// Prefill side: reads the `Hello` of accepted connection `s` and authenticates it.
    /// `Ok(Some((engine id, connection kind, index)))` to go on; `Ok(None)` when it was
    /// refused (counted and logged here; dropping `s` closes it); `Err` for a protocol
    /// error before the exchange with `auth=off`, as before authentication existed.
    pub(super) fn admit(
        &self,
        s: &mut TcpStream,
    ) -> std::result::Result<Option<(u64, ConnKind, u16)>, String> {
        let addr = s.peer_addr().ok();
        let who = addr.map_or_else(
            || "a connection".to_string(),
            |a| format!("connection from {a}"),
        );
        let Some(_slot) = addr.map_or(Some(None), |a| self.gate.slot(a.ip()).map(Some)) else {
            let mut msg = Vec::new();
            let busy = Message::AuthRefused {
                reason: crate::proto::AuthRefusal::Busy,
                auth: self.gate.mode,
            };
            if busy.encode(&mut msg).is_ok() {
                let _ = s.set_nonblocking(true);
                let _ = std::io::Write::write_all(s, &msg);
            }
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
        let required = self.gate.mode == AuthMode::Required;
        // Before the exchange, with auth off, a broken peer is a protocol error as before.
        let early = |f: Failure| {
            if required {
                self.refused(addr, &who, &f);
                Ok(None)
            } else {
                Err(f.detail)
            }
        };
        let hello = match auth::read_hello(s, deadline) {
            Ok(Message::Hello {
                proto_version,
                role,
                engine_id,
                conn,
                conn_index,
            }) => {
                if proto_version != PROTO_VERSION {
                    return early(Failure {
                        reason: Reason::Malformed,
                        detail: format!(
                            "peer speaks protocol {proto_version}, this build {PROTO_VERSION}"
                        ),
                    });
                }
                if role != WireRole::Decode {
                    return early(Failure {
                        reason: Reason::Malformed,
                        detail: format!("peer is a {role:?} engine, expected Decode"),
                    });
                }
                PeerHello {
                    role,
                    engine_id,
                    conn,
                    conn_index,
                }
            }
            Ok(other) => unreachable!("read_hello returned a {:?}", other.kind()),
            Err(f) => return early(f),
        };
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
        let local = self.local();
        match auth::respond(
            s,
            &local,
            &hello,
            |id| self.gate.session(id),
            &self.gate.seen,
            deadline,
        ) {
            Ok(secret) => {
                if let Some(secret) = secret {
                    self.gate.keep_session(hello.engine_id, secret);
                }
                // The rest of the setup has the usual timeouts.
                s.set_read_timeout(Some(self.node.bootstrap_timeout()))
                    .and_then(|()| s.set_write_timeout(None))
                    .map_err(|e| e.to_string())?;
                Ok(Some((hello.engine_id, hello.conn, hello.conn_index)))
            }
            Err(f) if !required && matches!(f.reason, Reason::Incomplete | Reason::Malformed) => {
                Err(f.detail)
            }
            Err(f) => {
                self.refused(addr, &who, &f);
                Ok(None)
            }
        }
    }

    /// Decode side: authenticates connection `s` to `peer` (connection `conn_index` of
    /// kind `conn`) right after our `Hello` went out. A data connection proves
    /// `session`, what its control connection's authentication returned. A refusal is
    /// counted and logged here; the caller loses the peer with the error, which names
    /// authentication.
    pub(super) fn authenticate(
        &self,
        s: &mut TcpStream,
        peer: &Arc<Peer>,
        conn: ConnKind,
        conn_index: u16,
        session: Option<&SessionSecret>,
    ) -> std::result::Result<Option<SessionSecret>, SetupError> {
        let timeouts = (s.read_timeout(), s.write_timeout());
        let local = self.local();
        let r = auth::initiate(
            s,
            &local,
            conn,
            conn_index,
            session,
            self.handshake_deadline(),
        );
        if let (Ok(read), Ok(write)) = timeouts {
            let _ = s.set_read_timeout(read);
            let _ = s.set_write_timeout(write);
        }
        r.map_err(|f| {
            self.refused(s.peer_addr().ok(), &peer.name, &f);
            SetupError::new(cause(&f), f.to_string())
        })
    }
}
