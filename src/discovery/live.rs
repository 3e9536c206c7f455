//! The discovery of a running engine: its two threads (the registrar: lease, entry,
//! keep-alive; the watcher: the prefix into the cache, and the departures it sees) and
//! the cache the scheduler's calls read.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use super::entry::Entry;
use super::etcd::{parse_watch, Etcd, EtcdError, Event, WatchMsg, NOT_FOUND};
use crate::auth::Key;
use crate::config::Role;
use crate::control::Control;
use crate::err;
use crate::error::Result;
use crate::node::Node;
use crate::room::Cause;

/// How long a read of the watch waits before the watcher looks at the clock and at
/// whether the engine stops.
const TICK: Duration = Duration::from_millis(100);
/// The first wait after a failed call; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// How long an entry missing from the registry when etcd came back has to come back:
/// its TTL and two of the longest retry backoffs (its engine's registrar may be waiting
/// one out).
fn grace(e: &Entry) -> Duration {
    Duration::from_millis(e.ttl_ms) + 2 * MAX_BACKOFF
}

/// An entry in the cache.
pub(super) struct Cached {
    pub(super) entry: Entry,
    /// Not in the registry when it was last read whole (after etcd came back): it has
    /// [`grace`] to come back before it counts as gone.
    missing_since: Option<Instant>,
}

#[derive(Default)]
pub(super) struct Cache {
    /// Verified entries by etcd key.
    pub(super) entries: HashMap<Vec<u8>, Cached>,
    /// The newest incarnation seen under each key, kept after the entry goes: an older
    /// one (a replayed entry) is refused.
    newest: HashMap<Vec<u8>, u64>,
    /// Keys whose refusal was logged at WARN already (later ones log at DEBUG).
    warned: std::collections::HashSet<Vec<u8>>,
}

pub(crate) struct Discovery {
    node: Arc<Node>,
    pub(super) control: Arc<Control>,
    pub(super) etcd: Etcd,
    key: Key,
    pub(super) prefix: String,
    incarnation: u64,
    pub(super) cache: Mutex<Cache>,
    /// The cache was filled from etcd at least once.
    pub(super) synced: AtomicBool,
    /// Wakes the registrar (a registration changed, the engine stops).
    wake: (Mutex<bool>, Condvar),
    /// The watch's socket, to cut it when the engine stops.
    watch_sock: Mutex<Option<TcpStream>>,
    /// This engine's etcd key.
    own_key: Vec<u8>,
    /// The watcher saw this engine's entry deleted or overwritten with one that does
    /// not verify: the registrar puts it again.
    republish: AtomicBool,
}

impl Discovery {
    pub fn start(node: Arc<Node>, control: Arc<Control>) -> Result<Arc<Discovery>> {
        let c = &node.config;
        // A call waits at most a third of the TTL, so that a keep-alive that fails on one
        // endpoint still has time on another.
        let timeout = Duration::from_millis((c.discovery_ttl_ms / 3).clamp(300, 2_000));
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let mut low = [0u8; 1];
        getrandom::fill(&mut low).map_err(|e| err!(Io, "no random bytes: {e}"))?;
        let d = Arc::new(Discovery {
            etcd: Etcd::new(c.discovery.clone(), timeout),
            key: c.auth_key.clone().expect("checked by discovery::start"),
            prefix: c.discovery_prefix.clone(),
            incarnation: (micros << 8) | low[0] as u64,
            cache: Mutex::new(Cache::default()),
            synced: AtomicBool::new(false),
            wake: (Mutex::new(false), Condvar::new()),
            watch_sock: Mutex::new(None),
            own_key: format!("{}{}/{}", c.discovery_prefix, c.instance, c.rank).into_bytes(),
            republish: AtomicBool::new(false),
            node,
            control,
        });
        let r = d.clone();
        d.node.spawn("kvxfer-registry", move || {
            r.guarded("registrar", Self::registrar)
        })?;
        let w = d.clone();
        d.node.spawn("kvxfer-registry-watch", move || {
            w.guarded("watcher", Self::watcher)
        })?;
        crate::log!(
            d.node.log,
            Info,
            "discovery through {} under {}: {} {} rank {} of {}, incarnation {}",
            d.etcd.describe(),
            d.prefix,
            d.node.role,
            d.node.config.instance,
            d.node.config.rank,
            d.node.config.instance_ranks,
            d.incarnation
        );
        Ok(d)
    }

    /// Runs one of the threads' loops; a panic in it is logged and the loop starts
    /// again (after a pause), so discovery never dies with the engine still running.
    fn guarded(self: &Arc<Self>, what: &str, body: fn(&Arc<Self>)) {
        while !self.node.is_stopping() {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(self))) {
                Ok(()) => return,
                Err(e) => {
                    crate::log!(
                        self.node.log,
                        Error,
                        "discovery {what} panicked: {}; starting it again",
                        crate::control::panic_message(&*e)
                    );
                    self.node.sleep(MAX_BACKOFF);
                }
            }
        }
    }

    /// Wakes the registrar: a registration changed, or the engine stops.
    pub fn wake(&self) {
        *self.wake.0.lock() = true;
        self.wake.1.notify_all();
        if self.node.is_stopping() {
            if let Some(s) = self.watch_sock.lock().take() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    fn sleep(&self, d: Duration) {
        let mut woken = self.wake.0.lock();
        if !*woken && !self.node.is_stopping() {
            self.wake.1.wait_for(&mut woken, d);
        }
        *woken = false;
    }

    /// This engine's entry, signed; `None` before its KV buffers are registered.
    fn value(&self) -> Option<(String, Vec<u8>)> {
        let node = &self.node;
        node.memory.kv.get()?;
        let c = &node.config;
        let e = Entry {
            engine_id: node.engine_id,
            incarnation: self.incarnation,
            role: node.role,
            instance: c.instance.clone(),
            rank: c.rank,
            ranks: c.instance_ranks,
            address: node.address.clone(),
            transport: if node.rdma.is_some() { "rdma" } else { "tcp" }.to_string(),
            ttl_ms: c.discovery_ttl_ms,
            registration: self.control.own_registration(),
        };
        Some((e.key(&self.prefix), e.sign(&self.prefix, &self.key)))
    }

    /// The registrar: a lease, this engine's entry under it (again whenever it changes
    /// or the lease is lost), keep-alives at a third of the TTL; on stop, the lease is
    /// revoked, which deletes the entry.
    fn registrar(self: &Arc<Self>) {
        let ttl_ms = self.node.config.discovery_ttl_ms;
        let ttl_s = ttl_ms.div_ceil(1000);
        let interval = Duration::from_millis(ttl_ms / 3);
        let mut lease: Option<i64> = None;
        let mut published: Option<Vec<u8>> = None;
        let mut next_keepalive = Instant::now();
        let mut backoff = MIN_BACKOFF;
        let mut down_since: Option<Instant> = None;
        while !self.node.is_stopping() {
            if self.republish.swap(false, Ordering::Relaxed) {
                published = None;
            }
            let step = (|| -> std::result::Result<(), EtcdError> {
                let id = match lease {
                    Some(id) => id,
                    None => {
                        let id = self.etcd.grant(ttl_s)?;
                        lease = Some(id);
                        published = None;
                        next_keepalive = Instant::now() + interval;
                        id
                    }
                };
                if let Some((key, value)) = self.value() {
                    if published.as_ref() != Some(&value) {
                        if let Err(e) = self.etcd.put(key.as_bytes(), &value, id) {
                            if matches!(e, EtcdError::Refused(NOT_FOUND, _)) {
                                lease = None;
                            }
                            return Err(e);
                        }
                        published = Some(value);
                        self.node
                            .metrics
                            .registry_registrations
                            .fetch_add(1, Ordering::Relaxed);
                        crate::log!(
                            self.node.log,
                            Info,
                            "registered {key} in {}",
                            self.etcd.describe()
                        );
                    }
                }
                if Instant::now() >= next_keepalive {
                    match self.etcd.keepalive(id)? {
                        Some(_) => next_keepalive = Instant::now() + interval,
                        None => {
                            lease = None;
                            return Err(EtcdError::Refused(
                                NOT_FOUND,
                                format!("lease {id} expired (etcd kept nothing of it)"),
                            ));
                        }
                    }
                }
                Ok(())
            })();
            match step {
                Ok(()) => {
                    if let Some(since) = down_since.take() {
                        crate::log!(
                            self.node.log,
                            Warn,
                            "registry {} reachable again after {} ms; registration resumed",
                            self.etcd.describe(),
                            since.elapsed().as_millis()
                        );
                    }
                    backoff = MIN_BACKOFF;
                    self.sleep(next_keepalive.saturating_duration_since(Instant::now()));
                }
                Err(e @ EtcdError::Refused(NOT_FOUND, _)) if lease.is_none() => {
                    // The lease is gone (etcd was away longer than the TTL, or lost its
                    // data): a new one and the entry again, after the shortest pause.
                    crate::log!(self.node.log, Warn, "registry: {e}; registering again");
                    self.sleep(MIN_BACKOFF);
                }
                Err(e) => {
                    self.node
                        .metrics
                        .registry_errors
                        .fetch_add(1, Ordering::Relaxed);
                    if down_since.is_none() {
                        down_since = Some(Instant::now());
                        // An outage is an etcd that does not answer (which also has the
                        // watcher read again); one that refuses this engine's calls is
                        // an error, and may still serve the watch.
                        if matches!(e, EtcdError::Down(_)) {
                            self.node
                                .metrics
                                .registry_outages
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        crate::log!(
                            self.node.log,
                            Warn,
                            "registry lost: {e}; rooms go on with the peers known, retrying"
                        );
                    } else {
                        crate::log!(
                            self.node.log,
                            Info,
                            "registry still unreachable, retry in {} ms: {e}",
                            backoff.as_millis()
                        );
                    }
                    self.sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        if let Some(id) = lease {
            match self.etcd.revoke(id) {
                Ok(()) => crate::log!(self.node.log, Info, "registry entry withdrawn"),
                Err(e) => crate::log!(
                    self.node.log,
                    Info,
                    "registry entry not withdrawn ({e}); it expires with its lease"
                ),
            }
        }
    }

    /// The watcher: reads the prefix whole into the cache, then follows the watch from
    /// the revision read; starts again (after a backoff) whenever the watch breaks.
    fn watcher(self: &Arc<Self>) {
        let prefix = self.prefix.clone().into_bytes();
        let mut backoff = MIN_BACKOFF;
        while !self.node.is_stopping() {
            let result = self.etcd.range(&prefix).and_then(|(rev, kvs)| {
                self.resync(kvs);
                self.etcd.watch(&prefix, rev + 1, TICK)
            });
            let mut stream = match result {
                Ok(s) => s,
                Err(e) => {
                    self.watch_failed(format_args!(
                        "registry watch: {e}; retry in {} ms",
                        backoff.as_millis()
                    ));
                    self.expire_missing();
                    self.node.sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            backoff = MIN_BACKOFF;
            *self.watch_sock.lock() = stream.socket().ok();
            // An outage the registrar sees after this point ends the watch: a watch
            // whose etcd went quiet (a partition) may never say so itself.
            let outages = self.outages();
            let ended = loop {
                if self.node.is_stopping() {
                    return;
                }
                if self.outages() != outages {
                    break "the registrar cannot reach etcd".to_string();
                }
                self.expire_missing();
                match stream.next() {
                    Ok(None) => {}
                    Ok(Some(line)) => match parse_watch(&line) {
                        Ok(WatchMsg::Events(_, events)) => {
                            for e in events {
                                self.apply(e);
                            }
                        }
                        Ok(WatchMsg::Quiet) => {}
                        Ok(WatchMsg::Canceled(why)) => break why,
                        Err(why) => break why,
                    },
                    Err(why) => break why,
                }
            };
            self.watch_sock.lock().take();
            if !self.node.is_stopping() {
                self.watch_failed(format_args!("registry watch ended: {ended}; reading again"));
                self.node.sleep(MIN_BACKOFF);
            }
        }
    }

    /// The watch could not start or broke: counts a registry error and logs `why`.
    fn watch_failed(&self, why: std::fmt::Arguments<'_>) {
        self.node
            .metrics
            .registry_errors
            .fetch_add(1, Ordering::Relaxed);
        crate::log!(self.node.log, Info, "{why}");
    }

    fn outages(&self) -> u64 {
        self.node.metrics.registry_outages.load(Ordering::Relaxed)
    }

    /// The prefix as etcd holds it now: every entry is taken as a put; cached entries
    /// that are not there have their TTL to come back (etcd may have come back without
    /// their leases, and their engines register again).
    fn resync(&self, kvs: Vec<(Vec<u8>, Vec<u8>)>) {
        let present: std::collections::HashSet<Vec<u8>> =
            kvs.iter().map(|(k, _)| k.clone()).collect();
        for (key, value) in kvs {
            self.apply(Event {
                deleted: false,
                key,
                value,
            });
        }
        let now = Instant::now();
        for (k, c) in self.cache.lock().entries.iter_mut() {
            if present.contains(k) {
                c.missing_since = None;
            } else if c.missing_since.is_none() {
                c.missing_since = Some(now);
            }
        }
        self.synced.store(true, Ordering::Release);
    }

    /// Cached entries missing from the registry for longer than their [`grace`] are
    /// gone.
    fn expire_missing(&self) {
        let gone: Vec<Entry> = {
            let mut cache = self.cache.lock();
            let expired: Vec<Vec<u8>> = cache
                .entries
                .iter()
                .filter(|(_, c)| {
                    c.missing_since
                        .is_some_and(|t| t.elapsed() > grace(&c.entry))
                })
                .map(|(k, _)| k.clone())
                .collect();
            expired
                .iter()
                .filter_map(|k| cache.entries.remove(k))
                .map(|c| c.entry)
                .collect()
        };
        for e in gone {
            self.depart(
                &e,
                "was not in the registry when etcd came back, nor within its lease TTL and \
                 the retry backoff after",
            );
        }
    }

    /// One change of a key under the prefix.
    fn apply(&self, ev: Event) {
        let name = String::from_utf8_lossy(&ev.key).into_owned();
        if ev.deleted {
            if ev.key == self.own_key {
                // Deleted while this engine lives (its lease was not revoked by it):
                // put it again. (At stop the registrar has left its loop already.)
                self.put_again("deleted");
            }
            let gone = self.cache.lock().entries.remove(&ev.key);
            if let Some(c) = gone {
                let why = format!(
                    "left the registry: its lease (ttl {} ms) expired, or it was deleted",
                    c.entry.ttl_ms
                );
                self.depart(&c.entry, &why);
            }
            return;
        }
        let entry = match Entry::verify(&self.prefix, &ev.key, &ev.value, &self.key) {
            Ok(e) => e,
            Err(why) => return self.refuse(&ev.key, &name, &why),
        };
        let replaced = {
            let mut cache = self.cache.lock();
            let newest = cache.newest.get(&ev.key).copied().unwrap_or(0);
            if entry.incarnation < newest {
                drop(cache);
                return self.refuse(
                    &ev.key,
                    &name,
                    &format!(
                        "incarnation {} is older than {newest}, already seen there (a replayed entry)",
                        entry.incarnation
                    ),
                );
            }
            cache.newest.insert(ev.key.clone(), entry.incarnation);
            let old = cache.entries.insert(
                ev.key.clone(),
                Cached {
                    entry: entry.clone(),
                    missing_since: None,
                },
            );
            old.map(|c| c.entry)
                .filter(|o| o.engine_id != entry.engine_id || o.incarnation != entry.incarnation)
        };
        if let Some(old) = replaced {
            if old.engine_id == self.node.engine_id {
                // Two engines configured with one instance and rank: the other one's
                // entry replaced ours, and readers now take it for this name.
                crate::log!(
                    self.node.log,
                    Error,
                    "registry: engine {:016x} at {} registered as {} rank {}, which is this \
                     engine's name: check 'instance' and 'rank'",
                    entry.engine_id,
                    entry.address,
                    entry.instance,
                    entry.rank
                );
            }
            let why = format!(
                "was replaced by a new incarnation ({}, engine {:016x} at {})",
                entry.incarnation, entry.engine_id, entry.address
            );
            self.depart(&old, &why);
        }
    }

    /// Has the registrar put this engine's entry again: someone else `what` it.
    fn put_again(&self, what: &str) {
        if self.node.is_stopping() {
            return;
        }
        crate::log!(
            self.node.log,
            Warn,
            "registry: this engine's entry was {what} by someone else; putting it again"
        );
        self.republish.store(true, Ordering::Relaxed);
        self.wake();
    }

    fn refuse(&self, key: &[u8], name: &str, why: &str) {
        if key == self.own_key {
            self.put_again("overwritten with one that does not verify");
        }
        self.node
            .metrics
            .registry_rejected
            .fetch_add(1, Ordering::Relaxed);
        let first = {
            let mut cache = self.cache.lock();
            // Bounded: past this many names, every refusal logs at DEBUG.
            cache.warned.len() < 4096 && cache.warned.insert(key.to_vec())
        };
        if first {
            crate::log!(self.node.log, Warn, "registry entry {name} ignored: {why}");
        } else {
            crate::log!(self.node.log, Debug, "registry entry {name} ignored: {why}");
        }
    }

    /// The engine of `e` is gone from the registry (`why`): the peers that are that
    /// engine are lost, failing their rooms with a reason naming the registry.
    fn depart(&self, e: &Entry, why: &str) {
        if e.engine_id == self.node.engine_id || e.role == self.node.role {
            return;
        }
        let reason = format!(
            "registry: the entry of {} {} rank {} (engine {:016x}, incarnation {}) {why}",
            e.role, e.instance, e.rank, e.engine_id, e.incarnation
        );
        crate::log!(self.node.log, Info, "{reason}");
        for p in self.control.peers() {
            let same = match self.node.role {
                // Prefill engines know decode engines by the id they claimed.
                Role::Prefill => p.engine_id == Some(e.engine_id),
                // Decode engines know prefill engines by address; the id the prefill
                // engine gave in its Hello tells a new engine at the same address apart
                // (a peer still in its setup has none yet, and goes).
                Role::Decode => {
                    p.key == e.address && p.remote_id.get().is_none_or(|&id| id == e.engine_id)
                }
            };
            if same && !p.is_lost() {
                self.node
                    .metrics
                    .registry_departures
                    .fetch_add(1, Ordering::Relaxed);
                self.control.lose_with(&p, Cause::PeerLost, reason.clone());
            }
        }
    }
}
