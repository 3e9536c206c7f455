//! Engine configuration: string keys and values, each validated when set, so that an
//! unknown key or a bad value is reported by name at the call that made it.

use std::fmt;

use crate::auth::Key;
use crate::err;
use crate::error::Result;
use crate::log::Level;
pub use crate::proto::AuthMode;
pub use crate::proto::SameHostSetting;

/// Which side of the transfer an engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes the KV cache and sends it.
    Prefill,
    /// Receives the KV cache into pages it set aside.
    Decode,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

/// Which transport moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// RDMA when a usable device exists, TCP otherwise.
    Auto,
    /// TCP sockets.
    Tcp,
    /// RDMA verbs.
    Rdma,
}

/// Every setting of an engine, with defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `role`: must be set.
    pub role: Option<Role>,
    /// `listen`: `host:port` to listen on; port 0 picks any free port.
    pub listen: String,
    /// `transport`.
    pub transport: TransportKind,
    /// `workers`: worker threads.
    pub workers: usize,
    /// `connections_per_peer`: data connections to each peer engine.
    pub connections_per_peer: usize,
    /// `rdma_devices`: comma-separated device names; empty means all active ports.
    pub rdma_devices: Vec<String>,
    /// `rdma_slice_bytes`: longest single RDMA WRITE; longer runs are split.
    pub rdma_slice_bytes: usize,
    /// `rdma_queue_depth`: most RDMA WRITEs outstanding on one queue pair.
    pub rdma_queue_depth: u32,
    /// `bootstrap_timeout_ms`.
    pub bootstrap_timeout_ms: u64,
    /// `waiting_timeout_ms`.
    pub waiting_timeout_ms: u64,
    /// `transfer_timeout_ms`: longest time without progress while transferring.
    pub transfer_timeout_ms: u64,
    /// `heartbeat_interval_ms`.
    pub heartbeat_interval_ms: u64,
    /// `heartbeat_misses`: missed heartbeats before a peer counts as lost.
    pub heartbeat_misses: u32,
    /// `drain_timeout_ms`: longest wait for outstanding writes after an abort.
    pub drain_timeout_ms: u64,
    /// `log_level`: the least severe level passed to the log sink.
    pub log_level: Level,
    /// `auth`: `None` for `auto` (the default): required when a key is set; without a
    /// key or TLS, only engines on this host (see [`Config::auth_mode`] and
    /// [`Config::local_only`]).
    pub auth: Option<AuthMode>,
    /// The cluster key, from `auth_key_file` or `auth_key` (whichever was set last).
    pub auth_key: Option<Key>,
    /// `tls_cert_file`: PEM certificate chain of this engine (leaf first).
    pub tls_cert_file: Option<String>,
    /// `tls_key_file`: PEM private key of that certificate.
    pub tls_key_file: Option<String>,
    /// `tls_ca_file`: PEM certificate(s) of the cluster's CA.
    pub tls_ca_file: Option<String>,
    /// `encrypt_data`: seal KV payloads on TCP data connections (needs TLS).
    pub encrypt_data: bool,
    /// `same_host`: whether engines on one host copy KV directly between their
    /// processes instead of over TCP.
    pub same_host: SameHostSetting,
    /// `integrity`: `true` for `verify` (a digest of every data run, checked where it
    /// landed, before SUCCESS).
    pub integrity: bool,
    /// `discovery`: the `host:port` of each etcd endpoint (`etcd://a:1,b:2`); empty for
    /// no registry.
    pub discovery: Vec<String>,
    /// `discovery_prefix`: the etcd key prefix of this cluster's entries.
    pub discovery_prefix: String,
    /// `instance`: the name of the instance (prefill or decode server) this engine is a
    /// rank of, in the registry.
    pub instance: String,
    /// `rank`: this engine's rank in its instance.
    pub rank: u32,
    /// `instance_ranks`: how many ranks the instance has.
    pub instance_ranks: u32,
    /// `discovery_ttl_ms`: the TTL of this engine's lease in etcd.
    pub discovery_ttl_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            role: None,
            listen: "127.0.0.1:0".to_string(),
            transport: TransportKind::Auto,
            workers: 4,
            connections_per_peer: 2,
            rdma_devices: Vec::new(),
            rdma_slice_bytes: 1 << 20,
            rdma_queue_depth: 128,
            bootstrap_timeout_ms: 30_000,
            waiting_timeout_ms: 60_000,
            transfer_timeout_ms: 30_000,
            heartbeat_interval_ms: 1_000,
            heartbeat_misses: 5,
            drain_timeout_ms: 5_000,
            log_level: Level::Warn,
            auth: None,
            auth_key: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            encrypt_data: false,
            same_host: SameHostSetting::Auto,
            integrity: false,
            discovery: Vec::new(),
            discovery_prefix: "/kvxfer/".to_string(),
            instance: String::new(),
            rank: 0,
            instance_ranks: 1,
            discovery_ttl_ms: 5_000,
        }
    }
}

/// A key [`Config::set`] accepts: one row of [`KEYS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigKey {
    /// The key.
    pub name: &'static str,
    /// Its default as a value `set` takes (setting it changes nothing), or `None` where
    /// there is no default value: `role` must be set, the key files have none.
    pub default: Option<&'static str>,
    /// What it accepts.
    pub accepts: Accepts,
}

/// The values a key accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepts {
    /// One of these words.
    OneOf(&'static [&'static str]),
    /// An integer from `min` to `max`, both included.
    Int {
        /// The smallest value.
        min: u64,
        /// The largest value.
        max: u64,
    },
    /// Text of the key's own form (an address, device names, a path, a key).
    Text,
}

/// The longest timeout accepted: one day.
const MAX_TIMEOUT_MS: u64 = 86_400_000;

const fn key(name: &'static str, default: Option<&'static str>, accepts: Accepts) -> ConfigKey {
    ConfigKey {
        name,
        default,
        accepts,
    }
}

const fn int(min: u64, max: u64) -> Accepts {
    Accepts::Int { min, max }
}

const TIMEOUT: Accepts = int(1, MAX_TIMEOUT_MS);

/// Every key [`Config::set`] accepts, in documentation order, with its default and the
/// values it takes. [`Config::set`] takes its integer ranges from here; tests check that
/// [`Config::default`] has these defaults, that `set` takes these values, and that
/// `kvxfer_config_set`'s documentation in `include/kvxfer.h` lists every key with its
/// default and values.
pub const KEYS: &[ConfigKey] = &[
    key("role", None, Accepts::OneOf(&["prefill", "decode"])),
    key("listen", Some("127.0.0.1:0"), Accepts::Text),
    key(
        "transport",
        Some("auto"),
        Accepts::OneOf(&["auto", "tcp", "rdma"]),
    ),
    key("workers", Some("4"), int(1, 256)),
    key("connections_per_peer", Some("2"), int(1, 64)),
    key("rdma_devices", Some(""), Accepts::Text),
    key("rdma_slice_bytes", Some("1048576"), int(4096, 1 << 30)),
    key("rdma_queue_depth", Some("128"), int(1, 4096)),
    key("bootstrap_timeout_ms", Some("30000"), TIMEOUT),
    key("waiting_timeout_ms", Some("60000"), TIMEOUT),
    key("transfer_timeout_ms", Some("30000"), TIMEOUT),
    key("heartbeat_interval_ms", Some("1000"), TIMEOUT),
    key("heartbeat_misses", Some("5"), int(1, 1000)),
    key("drain_timeout_ms", Some("5000"), TIMEOUT),
    key(
        "log_level",
        Some("warn"),
        Accepts::OneOf(&["error", "warn", "info", "debug", "trace"]),
    ),
    key(
        "same_host",
        Some("auto"),
        Accepts::OneOf(&["auto", "require", "off"]),
    ),
    key("integrity", Some("off"), Accepts::OneOf(&["verify", "off"])),
    key(
        "auth",
        Some("auto"),
        Accepts::OneOf(&["auto", "required", "off"]),
    ),
    key("auth_key_file", None, Accepts::Text),
    key("auth_key", None, Accepts::Text),
    key("tls_cert_file", None, Accepts::Text),
    key("tls_key_file", None, Accepts::Text),
    key("tls_ca_file", None, Accepts::Text),
    key(
        "encrypt_data",
        Some("false"),
        Accepts::OneOf(&["true", "false"]),
    ),
    key("discovery", Some(""), Accepts::Text),
    key("discovery_prefix", Some("/kvxfer/"), Accepts::Text),
    key("instance", Some(""), Accepts::Text),
    key("rank", Some("0"), int(0, 65_535)),
    key("instance_ranks", Some("1"), int(1, 65_536)),
    key("discovery_ttl_ms", Some("5000"), int(2_000, 3_600_000)),
];

/// The most data connections one engine opens to a peer (`connections_per_peer`), which
/// is also the most a prefill engine accepts from one decode engine.
pub const MAX_CONNECTIONS_PER_PEER: usize = range("connections_per_peer").1 as usize;

/// The range of integer key `name` in [`KEYS`]. Meant for `const` contexts, where a name
/// without a range fails the build.
const fn range(name: &str) -> (u64, u64) {
    let mut i = 0;
    while i < KEYS.len() {
        if const_eq(KEYS[i].name, name) {
            if let Accepts::Int { min, max } = KEYS[i].accepts {
                return (min, max);
            }
        }
        i += 1;
    }
    panic!("not an integer key of KEYS")
}

const fn const_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Parses integer key `key` against its range in [`KEYS`].
macro_rules! int_key {
    ($key:literal, $value:expr) => {{
        const RANGE: (u64, u64) = range($key);
        parse_int($key, $value, RANGE.0, RANGE.1)
    }};
}

impl Config {
    /// Sets `key` to `value`, or names what is wrong. The config is unchanged on error.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let v = value.trim();
        match key {
            "role" => {
                self.role = Some(match v {
                    "prefill" => Role::Prefill,
                    "decode" => Role::Decode,
                    _ => return Err(bad(key, value, "expected 'prefill' or 'decode'")),
                })
            }
            "listen" => {
                parse_host_port(v).map_err(|why| bad(key, value, &why))?;
                self.listen = v.to_string();
            }
            "transport" => {
                self.transport = match v {
                    "auto" => TransportKind::Auto,
                    "tcp" => TransportKind::Tcp,
                    "rdma" => TransportKind::Rdma,
                    _ => return Err(bad(key, value, "expected 'auto', 'tcp' or 'rdma'")),
                }
            }
            "workers" => self.workers = int_key!("workers", value)? as usize,
            "connections_per_peer" => {
                self.connections_per_peer = int_key!("connections_per_peer", value)? as usize
            }
            "rdma_devices" => {
                let names: Vec<String> = v
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                if let Some(n) = names.iter().find(|n| {
                    !n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
                }) {
                    return Err(bad(key, value, &format!("'{n}' is not a device name")));
                }
                self.rdma_devices = names;
            }
            "rdma_slice_bytes" => {
                self.rdma_slice_bytes = int_key!("rdma_slice_bytes", value)? as usize
            }
            "rdma_queue_depth" => {
                self.rdma_queue_depth = int_key!("rdma_queue_depth", value)? as u32
            }
            "bootstrap_timeout_ms" => {
                self.bootstrap_timeout_ms = int_key!("bootstrap_timeout_ms", value)?
            }
            "waiting_timeout_ms" => {
                self.waiting_timeout_ms = int_key!("waiting_timeout_ms", value)?
            }
            "transfer_timeout_ms" => {
                self.transfer_timeout_ms = int_key!("transfer_timeout_ms", value)?
            }
            "heartbeat_interval_ms" => {
                self.heartbeat_interval_ms = int_key!("heartbeat_interval_ms", value)?
            }
            "heartbeat_misses" => {
                self.heartbeat_misses = int_key!("heartbeat_misses", value)? as u32
            }
            "drain_timeout_ms" => self.drain_timeout_ms = int_key!("drain_timeout_ms", value)?,
            "log_level" => {
                self.log_level = Level::parse(v)
                    .ok_or_else(|| bad(key, value, "expected error, warn, info, debug or trace"))?
            }
            "auth" => {
                self.auth = match v {
                    "auto" => None,
                    "required" => Some(AuthMode::Required),
                    "off" => Some(AuthMode::Off),
                    _ => return Err(bad(key, value, "expected 'auto', 'required' or 'off'")),
                }
            }
            "auth_key_file" => {
                let k = Key::from_file(v)
                    .map_err(|why| err!(BadValue, "bad value for config key '{key}': {why}"))?;
                self.auth_key = Some(k);
            }
            "auth_key" => {
                // The value is a secret: the message never repeats it.
                let k = Key::from_hex(v).map_err(|why| {
                    err!(
                        BadValue,
                        "bad value for config key '{key}' (value not shown): {why}"
                    )
                })?;
                self.auth_key = Some(k);
            }
            "tls_cert_file" | "tls_key_file" | "tls_ca_file" => {
                if v.is_empty() {
                    return Err(bad(key, value, "expected the path of a PEM file"));
                }
                let path = Some(v.to_string());
                match key {
                    "tls_cert_file" => self.tls_cert_file = path,
                    "tls_key_file" => self.tls_key_file = path,
                    _ => self.tls_ca_file = path,
                }
            }
            "encrypt_data" => {
                self.encrypt_data = match v {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad(key, value, "expected 'true' or 'false'")),
                }
            }
            "integrity" => {
                self.integrity = match v {
                    "verify" => true,
                    "off" => false,
                    _ => return Err(bad(key, value, "expected 'verify' or 'off'")),
                }
            }
            "same_host" => {
                self.same_host = match v {
                    "auto" => SameHostSetting::Auto,
                    "require" => SameHostSetting::Require,
                    "off" => SameHostSetting::Off,
                    _ => return Err(bad(key, value, "expected 'auto', 'require' or 'off'")),
                }
            }
            "discovery" => {
                self.discovery = parse_discovery(v).map_err(|why| bad(key, value, &why))?
            }
            "discovery_prefix" => {
                if v.is_empty()
                    || v.len() > 256
                    || !v.ends_with('/')
                    || !v.bytes().all(|c| c.is_ascii_graphic())
                {
                    return Err(bad(
                        key,
                        value,
                        "expected an etcd key prefix ending in '/', such as /kvxfer/ (at most \
                         256 printable characters, no spaces)",
                    ));
                }
                self.discovery_prefix = v.to_string();
            }
            "instance" => {
                if !v.is_empty() && !valid_instance(v) {
                    return Err(bad(key, value, "expected 1 to 128 of A-Z a-z 0-9 . _ -"));
                }
                self.instance = v.to_string();
            }
            "rank" => self.rank = int_key!("rank", value)? as u32,
            "instance_ranks" => self.instance_ranks = int_key!("instance_ranks", value)? as u32,
            "discovery_ttl_ms" => self.discovery_ttl_ms = int_key!("discovery_ttl_ms", value)?,
            _ => {
                return Err(err!(
                    UnknownKey,
                    "unknown config key '{key}' (known keys: {})",
                    KEYS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
                ))
            }
        }
        Ok(())
    }

    /// The authentication the handshake runs: as set, or with `auth=auto` `required`
    /// when a key is set and `off` otherwise. `auth=required` without a key is an error.
    pub fn auth_mode(&self) -> Result<AuthMode> {
        match (self.auth, &self.auth_key) {
            (Some(AuthMode::Required), None) => Err(err!(
                BadValue,
                "config key 'auth' is 'required' but no key is set: set 'auth_key_file' \
                 (or 'auth_key')"
            )),
            (Some(mode), _) => Ok(mode),
            (None, Some(_)) => Ok(AuthMode::Required),
            (None, None) => Ok(AuthMode::Off),
        }
    }

    /// Whether this engine works only with engines on its own host: `auth=auto` with
    /// neither a key nor TLS, so that nothing would prove who a peer is. It then listens
    /// on a loopback address only, accepts connections only from loopback addresses and
    /// connects only to them; `auth=off` lifts this explicitly.
    pub fn local_only(&self) -> bool {
        self.auth.is_none()
            && self.auth_key.is_none()
            && self.tls_cert_file.is_none()
            && self.tls_key_file.is_none()
            && self.tls_ca_file.is_none()
    }

    /// The TLS settings: loaded from the three files when all three are set, `None`
    /// when none is. Only some of them set, a file that cannot be read or holds no
    /// usable PEM, and `encrypt_data=true` without TLS are errors naming the key.
    pub fn tls(&self) -> Result<Option<crate::tls::Tls>> {
        let files = [&self.tls_cert_file, &self.tls_key_file, &self.tls_ca_file];
        let set: Vec<&str> = crate::tls::FILE_KEYS
            .iter()
            .zip(files)
            .filter(|(_, f)| f.is_some())
            .map(|(k, _)| *k)
            .collect();
        if set.is_empty() {
            if self.encrypt_data {
                return Err(err!(
                    BadValue,
                    "config key 'encrypt_data' is 'true' but TLS is not configured: its keys \
                     come from the TLS session, set 'tls_cert_file', 'tls_key_file' and \
                     'tls_ca_file'"
                ));
            }
            return Ok(None);
        }
        match files {
            [Some(cert), Some(key), Some(ca)] => crate::tls::Tls::load(cert, key, ca).map(Some),
            _ => {
                let missing: Vec<String> = crate::tls::FILE_KEYS
                    .iter()
                    .zip(files)
                    .filter(|(_, f)| f.is_none())
                    .map(|(k, _)| format!("'{k}'"))
                    .collect();
                Err(err!(
                    BadValue,
                    "TLS needs all three of 'tls_cert_file', 'tls_key_file' and 'tls_ca_file' \
                     (or none): {} set, {} missing",
                    set.join(", "),
                    missing.join(" and ")
                ))
            }
        }
    }

    /// The role, or an error saying it must be set.
    pub fn require_role(&self) -> Result<Role> {
        self.role.ok_or_else(|| {
            err!(
                BadValue,
                "config key 'role' must be set to 'prefill' or 'decode'"
            )
        })
    }
}

/// Whether `name` may name an instance in the registry: 1 to 128 of
/// `A-Z a-z 0-9 . _ -`.
pub fn valid_instance(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

/// The endpoints of `etcd://host:port[,host:port...]`; empty text for none.
fn parse_discovery(v: &str) -> std::result::Result<Vec<String>, String> {
    if v.is_empty() {
        return Ok(Vec::new());
    }
    let list = v
        .strip_prefix("etcd://")
        .ok_or("expected etcd://host:port[,host:port...] (or empty for none)")?;
    let mut out = Vec::new();
    for ep in list.split(',').map(str::trim) {
        parse_host_port(ep).map_err(|why| format!("endpoint '{ep}': {why}"))?;
        out.push(ep.to_string());
    }
    Ok(out)
}

fn bad(key: &str, value: &str, why: &str) -> crate::error::Error {
    err!(
        BadValue,
        "bad value '{value}' for config key '{key}': {why}"
    )
}

fn parse_int(key: &str, value: &str, min: u64, max: u64) -> Result<u64> {
    match value.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(bad(
            key,
            value,
            &format!("expected an integer from {min} to {max}"),
        )),
    }
}

/// Splits `host:port` (IPv6 hosts in brackets), checking the port is a number.
pub fn parse_host_port(s: &str) -> std::result::Result<(&str, u16), String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| "expected host:port".to_string())?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err("the host is empty".to_string());
    }
    if host.contains(':') && !s.starts_with('[') {
        return Err("IPv6 hosts must be written in brackets, like [::1]:port".to_string());
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("'{port}' is not a port number"))?;
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn every_documented_key_accepts_a_good_value() {
        let key_file = private_file("good", &[7; 32]);
        let good: [(&str, &str); 30] = [
            ("role", "decode"),
            ("listen", "[::1]:0"),
            ("transport", "tcp"),
            ("workers", "8"),
            ("connections_per_peer", "3"),
            ("rdma_devices", "mlx5_0, rxe0"),
            ("rdma_slice_bytes", "65536"),
            ("rdma_queue_depth", "32"),
            ("bootstrap_timeout_ms", "100"),
            ("waiting_timeout_ms", "200"),
            ("transfer_timeout_ms", "300"),
            ("heartbeat_interval_ms", "50"),
            ("heartbeat_misses", "3"),
            ("drain_timeout_ms", "400"),
            ("log_level", "debug"),
            ("auth", "required"),
            ("auth_key_file", &key_file),
            ("auth_key", &"ab".repeat(32)),
            ("tls_cert_file", "/etc/kvxfer/engine.pem"),
            ("tls_key_file", "/etc/kvxfer/engine.key"),
            ("tls_ca_file", "/etc/kvxfer/ca.pem"),
            ("encrypt_data", "true"),
            ("same_host", "require"),
            ("integrity", "verify"),
            ("discovery", "etcd://127.0.0.1:2379, [::1]:2379"),
            ("discovery_prefix", "/cluster-7/kvxfer/"),
            ("instance", "prefill-a"),
            ("rank", "3"),
            ("instance_ranks", "4"),
            ("discovery_ttl_ms", "3000"),
        ];
        assert_eq!(good.len(), KEYS.len());
        let mut c = Config::default();
        for (k, v) in good {
            c.set(k, v).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
        }
        assert_eq!(c.role, Some(Role::Decode));
        assert_eq!(c.workers, 8);
        assert_eq!(c.rdma_devices, vec!["mlx5_0", "rxe0"]);
        assert_eq!((c.rdma_slice_bytes, c.rdma_queue_depth), (65536, 32));
        assert_eq!(c.drain_timeout_ms, 400);
        assert_eq!(c.log_level, Level::Debug);
        assert_eq!(c.auth, Some(AuthMode::Required));
        assert_eq!(c.auth_key, Some(Key::new(vec![0xab; 32]).unwrap()));
        assert_eq!(c.discovery, vec!["127.0.0.1:2379", "[::1]:2379"]);
        assert_eq!(
            (c.discovery_prefix.as_str(), c.instance.as_str()),
            ("/cluster-7/kvxfer/", "prefill-a")
        );
        assert_eq!((c.rank, c.instance_ranks, c.discovery_ttl_ms), (3, 4, 3000));
    }

    #[test]
    fn the_defaults_in_keys_are_the_defaults() {
        for k in KEYS {
            let Some(default) = k.default else { continue };
            let mut c = Config::default();
            c.set(k.name, default)
                .unwrap_or_else(|e| panic!("{}={default}: {e}", k.name));
            assert_eq!(
                c,
                Config::default(),
                "{} is not {default:?} by default",
                k.name
            );
        }
        // The keys without a default value are absent until set.
        let c = Config::default();
        assert_eq!((c.role, c.auth_key.is_some()), (None, false));
    }

    #[test]
    fn every_key_takes_the_values_keys_lists_and_no_integer_outside_its_range() {
        for k in KEYS {
            let mut c = Config::default();
            match k.accepts {
                Accepts::OneOf(words) => {
                    for w in words {
                        c.set(k.name, w)
                            .unwrap_or_else(|e| panic!("{}={w}: {e}", k.name));
                    }
                    assert!(c.set(k.name, "none-of-them").is_err(), "{}", k.name);
                }
                Accepts::Int { min, max } => {
                    for v in [min, max] {
                        c.set(k.name, &v.to_string())
                            .unwrap_or_else(|e| panic!("{}={v}: {e}", k.name));
                    }
                    for v in [min.checked_sub(1), Some(max + 1)].into_iter().flatten() {
                        let e = c.set(k.name, &v.to_string()).unwrap_err();
                        assert!(e.message().contains(&format!("{min} to {max}")), "{e}");
                    }
                }
                Accepts::Text => {}
            }
        }
    }

    /// A file holding `bytes`, readable only by its owner.
    fn private_file(name: &str, bytes: &[u8]) -> String {
        use std::os::unix::fs::PermissionsExt;
        let p = std::env::temp_dir().join(format!("kvxfer-config-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p.to_str().unwrap().to_string()
    }

    #[test]
    fn auth_defaults_to_required_with_a_key_and_off_without() {
        let mut c = Config::default();
        assert_eq!(c.auth_mode().unwrap(), AuthMode::Off);
        c.set("auth", "off").unwrap();
        c.set("auth", "auto").unwrap();
        assert_eq!(c, Config::default());
        c.set("auth", "required").unwrap();
        let e = c.auth_mode().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadValue);
        assert!(e.message().contains("'auth'") && e.message().contains("auth_key_file"));
        c.auth = None;
        c.set("auth_key", &"01".repeat(40)).unwrap();
        assert_eq!(c.auth_mode().unwrap(), AuthMode::Required);
        c.set("auth", "off").unwrap();
        assert_eq!(c.auth_mode().unwrap(), AuthMode::Off);
    }

    #[test]
    fn only_auto_without_a_key_or_tls_keeps_to_this_host() {
        let mut c = Config::default();
        assert!(c.local_only());
        c.set("auth", "off").unwrap();
        assert!(!c.local_only(), "auth=off");
        c.set("auth", "auto").unwrap();
        c.set("auth_key", &"01".repeat(32)).unwrap();
        assert!(!c.local_only(), "a key");
        let mut c = Config::default();
        c.set("tls_ca_file", "/etc/kvxfer/ca.pem").unwrap();
        assert!(!c.local_only(), "TLS");
    }

    #[test]
    fn bad_keys_are_refused_naming_the_file_but_never_the_key() {
        use std::os::unix::fs::PermissionsExt;
        let mut c = Config::default();
        let open = private_file("open", &[7; 32]);
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = c.set("auth_key_file", &open).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadValue);
        for part in ["auth_key_file", open.as_str(), "0644", "owner"] {
            assert!(e.message().contains(part), "{}", e.message());
        }
        let short = private_file("short", &[7; 16]);
        let e = c.set("auth_key_file", &short).unwrap_err();
        assert!(
            e.message().contains(&short) && e.message().contains("32"),
            "{}",
            e.message()
        );
        let secret = "5e".repeat(31);
        let e = c.set("auth_key", &secret).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadValue);
        assert!(e.message().contains("auth_key") && !e.message().contains(&secret));
        let e = c.set("auth_key", &"xy".repeat(32)).unwrap_err();
        assert!(!e.message().contains("xyxy"), "{}", e.message());
        assert!(!format!(
            "{:?}",
            Config {
                auth_key: Some(Key::new(vec![0x5e; 32]).unwrap()),
                ..Config::default()
            }
        )
        .contains("5e, 5e"));
        assert_eq!(c, Config::default());
        for p in [open, short] {
            let _ = std::fs::remove_file(p);
        }
    }

    #[test]
    fn bad_values_name_the_key_and_leave_the_config_unchanged() {
        let mut c = Config::default();
        for (k, v) in [
            ("role", "both"),
            ("listen", "nohost"),
            ("listen", "host:99999"),
            ("listen", ":80"),
            ("transport", "udp"),
            ("workers", "0"),
            ("workers", "-1"),
            ("heartbeat_misses", "x"),
            ("drain_timeout_ms", "0"),
            ("rdma_devices", "a;b"),
            ("rdma_slice_bytes", "100"),
            ("rdma_queue_depth", "0"),
            ("log_level", "loud"),
            ("auth", "maybe"),
            ("auth_key_file", "/nonexistent/kvxfer.key"),
            ("tls_ca_file", " "),
            ("encrypt_data", "yes"),
            ("same_host", "maybe"),
            ("integrity", "sometimes"),
            ("discovery", "http://127.0.0.1:2379"),
            ("discovery", "etcd://127.0.0.1"),
            ("discovery", "etcd://a:1,,b:2"),
            ("discovery_prefix", "kvxfer"),
            ("discovery_prefix", "/kv xfer/"),
            ("instance", "prefill/a"),
            ("rank", "65536"),
            ("instance_ranks", "0"),
            ("discovery_ttl_ms", "1000"),
        ] {
            let e = c.set(k, v).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::BadValue, "{k}={v}");
            assert!(e.message().contains(k), "{}", e.message());
            assert!(e.message().contains(v), "{}", e.message());
        }
        assert_eq!(c, Config::default());
    }

    #[test]
    fn an_unknown_key_is_named() {
        let e = Config::default().set("wrokers", "2").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownKey);
        assert!(e.message().contains("'wrokers'"));
    }

    #[test]
    fn role_is_required() {
        let e = Config::default().require_role().unwrap_err();
        assert!(e.message().contains("role"));
    }
}
