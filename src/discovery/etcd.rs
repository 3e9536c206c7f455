//! The calls of etcd's v3 JSON gateway (`/v3/...`, served by etcd 3.4 and later on its
//! client port) that discovery makes: lease grant, keep-alive and revoke, put, range
//! and watch over a prefix. Keys and values travel in base64; 64-bit numbers as strings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};

use super::http::{self, Stream};

/// What went wrong with a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdError {
    /// No endpoint answered (or one answered with something that is not etcd's): try
    /// again later.
    Down(String),
    /// etcd answered and refused: its gRPC code and message (5: not found, such as a
    /// lease that expired).
    Refused(i64, String),
}

impl std::fmt::Display for EtcdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EtcdError::Down(why) => write!(f, "etcd unreachable: {why}"),
            EtcdError::Refused(code, why) => write!(f, "etcd refused (code {code}): {why}"),
        }
    }
}

/// gRPC's NOT_FOUND, which etcd answers for an unknown lease.
pub const NOT_FOUND: i64 = 5;

/// One change of a watched key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub deleted: bool,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

/// One message of a watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchMsg {
    /// Changes, and the revision they bring the store to.
    Events(i64, Vec<Event>),
    /// The watch was created, or a progress note: nothing changed.
    Quiet,
    /// etcd ended the watch (the start revision was compacted, ...): read the prefix
    /// again.
    Canceled(String),
}

/// A client of an etcd cluster through its gateway: the endpoints (`host:port`) are
/// tried in turn, starting from the last one that answered.
pub struct Etcd {
    endpoints: Vec<String>,
    at: AtomicUsize,
    timeout: Duration,
}

impl Etcd {
    pub fn new(endpoints: Vec<String>, timeout: Duration) -> Etcd {
        Etcd {
            endpoints,
            at: AtomicUsize::new(0),
            timeout,
        }
    }

    /// The endpoints, as `etcd://a,b` for messages.
    pub fn describe(&self) -> String {
        format!("etcd://{}", self.endpoints.join(","))
    }

    /// POSTs `body` to `path` on the first endpoint that answers.
    fn call(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        self.call_within(path, body, self.timeout)
    }

    /// As [`Etcd::call`], each endpoint given at most `timeout`.
    fn call_within(&self, path: &str, body: &Value, timeout: Duration) -> Result<Value, EtcdError> {
        let body = body.to_string().into_bytes();
        let n = self.endpoints.len();
        let first = self.at.load(Ordering::Relaxed);
        let mut errors = Vec::new();
        for i in 0..n {
            let at = (first + i) % n;
            let ep = &self.endpoints[at];
            match http::post(ep, path, &body, timeout) {
                Ok(a) => {
                    self.at.store(at, Ordering::Relaxed);
                    let v: Value = serde_json::from_slice(&a.body).map_err(|e| {
                        EtcdError::Down(format!("{ep}{path}: not JSON ({e}), HTTP {}", a.status))
                    })?;
                    if a.status == 200 {
                        return Ok(v);
                    }
                    let code = v.get("code").and_then(num).unwrap_or(-1);
                    let msg = v.get("message").and_then(Value::as_str).unwrap_or("");
                    // Unavailable (14) or a deadline (4): this member cannot serve now.
                    if code == 14 || code == 4 {
                        errors.push(format!("{ep}: {msg}"));
                        continue;
                    }
                    return Err(EtcdError::Refused(code, format!("{ep}{path}: {msg}")));
                }
                Err(e) => errors.push(e),
            }
        }
        Err(EtcdError::Down(errors.join("; ")))
    }

    /// A new lease of `ttl_s` seconds: its id.
    pub fn grant(&self, ttl_s: u64) -> Result<i64, EtcdError> {
        let v = self.call("/v3/lease/grant", &json!({ "TTL": ttl_s }))?;
        v.get("ID")
            .and_then(num)
            .ok_or_else(|| EtcdError::Down(format!("lease grant answered without an ID: {v}")))
    }

    /// Renews lease `id`: its TTL, or `None` if the lease is gone (expired or revoked).
    pub fn keepalive(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let v = self.call("/v3/lease/keepalive", &json!({ "ID": id.to_string() }))?;
        let ttl = v.get("result").and_then(|r| r.get("TTL")).and_then(num);
        Ok(ttl.filter(|&t| t > 0))
    }

    /// Revokes lease `id`, deleting its keys; each endpoint is given at most 300 ms
    /// (an engine revokes as it stops, and its stop must not wait on an etcd away: the
    /// lease then expires by itself).
    pub fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        let body = json!({ "ID": id.to_string() });
        let timeout = self.timeout.min(Duration::from_millis(300));
        self.call_within("/v3/lease/revoke", &body, timeout)
            .map(|_| ())
    }

    /// Puts `key` = `value` under lease `lease`.
    pub fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let body = json!({
            "key": B64.encode(key),
            "value": B64.encode(value),
            "lease": lease.to_string(),
        });
        self.call("/v3/kv/put", &body).map(|_| ())
    }

    /// Every key under `prefix` with its value, and the store's revision.
    #[allow(clippy::type_complexity)]
    pub fn range(&self, prefix: &[u8]) -> Result<(i64, Vec<(Vec<u8>, Vec<u8>)>), EtcdError> {
        let body = json!({
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix)),
        });
        let v = self.call("/v3/kv/range", &body)?;
        let rev = revision(&v)
            .ok_or_else(|| EtcdError::Down(format!("range without a revision: {v}")))?;
        let mut out = Vec::new();
        for kv in v.get("kvs").and_then(Value::as_array).into_iter().flatten() {
            out.push((bytes(kv.get("key")), bytes(kv.get("value"))));
        }
        Ok((rev, out))
    }

    /// A watch of every key under `prefix` from revision `from`; reads of it wait at most
    /// `tick` each.
    pub fn watch(&self, prefix: &[u8], from: i64, tick: Duration) -> Result<Stream, EtcdError> {
        let body = json!({ "create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix)),
            "start_revision": from.to_string(),
        }})
        .to_string();
        let at = self.at.load(Ordering::Relaxed) % self.endpoints.len();
        let ep = &self.endpoints[at];
        Stream::open(ep, "/v3/watch", body.as_bytes(), self.timeout, tick).map_err(EtcdError::Down)
    }
}

/// One message of a watch stream.
pub fn parse_watch(line: &[u8]) -> Result<WatchMsg, String> {
    let v: Value = serde_json::from_slice(line).map_err(|e| format!("watch: not JSON ({e})"))?;
    let Some(r) = v.get("result") else {
        let msg = v
            .get("error")
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
            .unwrap_or("no result");
        return Ok(WatchMsg::Canceled(msg.to_string()));
    };
    if r.get("canceled").and_then(Value::as_bool) == Some(true) {
        let why = r
            .get("cancel_reason")
            .and_then(Value::as_str)
            .unwrap_or("canceled by etcd");
        let compacted = r.get("compact_revision").and_then(num).unwrap_or(0);
        return Ok(WatchMsg::Canceled(format!(
            "{why} (compact revision {compacted})"
        )));
    }
    let Some(events) = r.get("events").and_then(Value::as_array) else {
        return Ok(WatchMsg::Quiet);
    };
    let rev = revision(r).unwrap_or(0);
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        let kv = e.get("kv");
        out.push(Event {
            deleted: e.get("type").and_then(Value::as_str) == Some("DELETE"),
            key: bytes(kv.and_then(|k| k.get("key"))),
            value: bytes(kv.and_then(|k| k.get("value"))),
        });
    }
    Ok(WatchMsg::Events(rev, out))
}

/// The end of the range of keys starting with `prefix` (etcd's `range_end`): the prefix
/// with its last byte below 0xff incremented and the rest cut.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

/// A 64-bit number, which the gateway writes as a string.
fn num(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn revision(v: &Value) -> Option<i64> {
    v.get("header")
        .and_then(|h| h.get("revision"))
        .and_then(num)
}

/// A base64 field's bytes (empty when absent or malformed).
fn bytes(v: Option<&Value>) -> Vec<u8> {
    v.and_then(Value::as_str)
        .and_then(|s| B64.decode(s).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_of_a_prefix_ends_past_its_last_key() {
        assert_eq!(prefix_end(b"/kvxfer/"), b"/kvxfer0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn watch_messages_as_etcd_3_4_writes_them() {
        let line = br#"{"result":{"header":{"revision":"5"},"events":[{"kv":{"key":"L2svYw==","mod_revision":"4","value":"eA==","lease":"77"}},{"type":"DELETE","kv":{"key":"L2svYQ==","mod_revision":"5"}}]}}"#;
        let WatchMsg::Events(rev, ev) = parse_watch(line).unwrap() else {
            panic!("events expected")
        };
        assert_eq!(rev, 5);
        assert_eq!(
            ev[0],
            Event {
                deleted: false,
                key: b"/k/c".to_vec(),
                value: b"x".to_vec()
            }
        );
        assert_eq!((ev[1].deleted, ev[1].key.as_slice()), (true, &b"/k/a"[..]));
        let created = br#"{"result":{"header":{"revision":"3"},"created":true}}"#;
        assert_eq!(parse_watch(created).unwrap(), WatchMsg::Quiet);
        let canceled =
            br#"{"result":{"header":{"revision":"9"},"canceled":true,"compact_revision":"7"}}"#;
        assert!(matches!(parse_watch(canceled).unwrap(), WatchMsg::Canceled(w) if w.contains('7')));
        assert!(parse_watch(b"not json").is_err());
    }
}
