//! Engine configuration: string keys and values, each validated when set, so that an
//! unknown key or a bad value is reported by name at the call that made it.

use std::fmt;

use crate::err;
use crate::error::Result;
use crate::log::Level;

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
        }
    }
}

/// The keys [`Config::set`] accepts, in documentation order.
pub const KEYS: &[&str] = &[
    "role",
    "listen",
    "transport",
    "workers",
    "connections_per_peer",
    "rdma_devices",
    "rdma_slice_bytes",
    "rdma_queue_depth",
    "bootstrap_timeout_ms",
    "waiting_timeout_ms",
    "transfer_timeout_ms",
    "heartbeat_interval_ms",
    "heartbeat_misses",
    "drain_timeout_ms",
    "log_level",
];

/// The longest timeout accepted: one day.
const MAX_TIMEOUT_MS: u64 = 86_400_000;

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
            "workers" => self.workers = int(key, value, 1, 256)? as usize,
            "connections_per_peer" => self.connections_per_peer = int(key, value, 1, 64)? as usize,
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
            "rdma_slice_bytes" => self.rdma_slice_bytes = int(key, value, 4096, 1 << 30)? as usize,
            "rdma_queue_depth" => self.rdma_queue_depth = int(key, value, 1, 4096)? as u32,
            "bootstrap_timeout_ms" => self.bootstrap_timeout_ms = timeout(key, value)?,
            "waiting_timeout_ms" => self.waiting_timeout_ms = timeout(key, value)?,
            "transfer_timeout_ms" => self.transfer_timeout_ms = timeout(key, value)?,
            "heartbeat_interval_ms" => self.heartbeat_interval_ms = timeout(key, value)?,
            "heartbeat_misses" => self.heartbeat_misses = int(key, value, 1, 1000)? as u32,
            "drain_timeout_ms" => self.drain_timeout_ms = timeout(key, value)?,
            "log_level" => {
                self.log_level = Level::parse(v)
                    .ok_or_else(|| bad(key, value, "expected error, warn, info, debug or trace"))?
            }
            _ => {
                return Err(err!(
                    UnknownKey,
                    "unknown config key '{key}' (known keys: {})",
                    KEYS.join(", ")
                ))
            }
        }
        Ok(())
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

fn bad(key: &str, value: &str, why: &str) -> crate::error::Error {
    err!(
        BadValue,
        "bad value '{value}' for config key '{key}': {why}"
    )
}

fn int(key: &str, value: &str, min: u64, max: u64) -> Result<u64> {
    match value.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(bad(
            key,
            value,
            &format!("expected an integer from {min} to {max}"),
        )),
    }
}

fn timeout(key: &str, value: &str) -> Result<u64> {
    int(key, value, 1, MAX_TIMEOUT_MS)
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
        let good = [
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
