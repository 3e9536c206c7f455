//! `kvxfer_config`: a bag of string settings an engine is created from.

use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;

use super::boundary::{try_str, BoxHandle};
use super::status::kvxfer_status;
use crate::config::Config;
use crate::log::{Level, Sink};

/// An engine configuration. Create with `kvxfer_config_new`, release with
/// `kvxfer_config_free`. Not thread-safe: use one config from one thread at a time.
pub struct kvxfer_config {
    _private: [u8; 0],
}

/// Log levels passed to a log sink, most severe first.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_log_level {
    /// Something failed.
    KVXFER_LOG_ERROR = 1,
    /// A room failed, a peer was lost: handled, but worth an operator's eye.
    KVXFER_LOG_WARN = 2,
    /// Lifecycle: engine start and stop, peers connected.
    KVXFER_LOG_INFO = 3,
    /// Per-room detail.
    KVXFER_LOG_DEBUG = 4,
    /// Per-chunk detail.
    KVXFER_LOG_TRACE = 5,
}

impl From<Level> for kvxfer_log_level {
    fn from(l: Level) -> Self {
        match l {
            Level::Error => kvxfer_log_level::KVXFER_LOG_ERROR,
            Level::Warn => kvxfer_log_level::KVXFER_LOG_WARN,
            Level::Info => kvxfer_log_level::KVXFER_LOG_INFO,
            Level::Debug => kvxfer_log_level::KVXFER_LOG_DEBUG,
            Level::Trace => kvxfer_log_level::KVXFER_LOG_TRACE,
        }
    }
}

/// A log sink: called with the `ctx` given at registration, a level and one
/// NUL-terminated line (valid only during the call). It may be called from any library
/// thread, concurrently, so it must be thread-safe; it must not call back into the
/// engine that logs.
pub type kvxfer_log_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, level: kvxfer_log_level, message: *const c_char)>;

pub(crate) struct ConfigObject {
    pub(crate) config: Config,
    pub(crate) sink: Option<Sink>,
}

impl BoxHandle for kvxfer_config {
    type Target = ConfigObject;
    const NAME: &'static str = "cfg";
}

/// Creates a configuration with every key at its default and stores it in `*out`.
///
/// Defaults: `listen=127.0.0.1:0`, `transport=auto`, `workers=4`,
/// `connections_per_peer=2`, `rdma_devices=` (all), `rdma_slice_bytes=1048576`,
/// `rdma_queue_depth=128`, `bootstrap_timeout_ms=30000`,
/// `waiting_timeout_ms=60000`, `transfer_timeout_ms=30000`,
/// `heartbeat_interval_ms=1000`, `heartbeat_misses=5`, `drain_timeout_ms=5000`,
/// `log_level=warn`. `role` has no default and must be set.
///
/// Errors: `KVXFER_ERR_NULL_POINTER` if `out` is NULL.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_config_new(out: *mut *mut kvxfer_config) -> kvxfer_status {
    ffi_status!({
        let out = super::boundary::try_out(out, "out")?;
        let cfg = kvxfer_config::into_raw(ConfigObject {
            config: Config::default(),
            sink: None,
        });
        // SAFETY: `out` was checked non-NULL and aligned; writable by contract.
        unsafe { out.write(cfg) };
        Ok(())
    })
}

/// Sets configuration `key` to `value` (both NUL-terminated UTF-8; copied).
///
/// Keys: `role` (`prefill` | `decode`), `listen` (`host:port`, port 0 = any; IPv6 as
/// `[addr]:port`; with a wildcard host such as `0.0.0.0`, `kvxfer_engine_address`
/// reports this machine's host name), `transport` (`auto` | `tcp` | `rdma`), `workers` (1..256),
/// `connections_per_peer` (1..64, TCP only), `rdma_devices` (comma-separated names,
/// empty = every device with an active port), `rdma_slice_bytes` (4096..2^30: longest
/// single RDMA WRITE), `rdma_queue_depth` (1..4096: most writes outstanding per queue
/// pair), `bootstrap_timeout_ms`, `waiting_timeout_ms`, `transfer_timeout_ms`,
/// `heartbeat_interval_ms`, `drain_timeout_ms` (1..86400000; RDMA: longest a failed
/// decode room waits for the prefill's acknowledgement before its peer's queue pairs are
/// shut), `heartbeat_misses`
/// (1..1000), `log_level` (`error` | `warn` | `info` | `debug` | `trace`).
///
/// Errors: `KVXFER_ERR_UNKNOWN_KEY` for a key not listed, `KVXFER_ERR_BAD_VALUE` for a
/// value the key does not accept (the message names both), `KVXFER_ERR_NULL_POINTER`.
/// The configuration is unchanged on error.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_config_set(
    cfg: *mut kvxfer_config,
    key: *const c_char,
    value: *const c_char,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL cfg is a live handle used by one thread (documented).
        let cfg = unsafe { kvxfer_config::try_borrow_mut(cfg) }?;
        // SAFETY: NUL-terminated strings by contract.
        let key = unsafe { try_str(key, "key") }?;
        // SAFETY: as above.
        let value = unsafe { try_str(value, "value") }?;
        cfg.config.set(key, value)
    })
}

struct CSink {
    f: unsafe extern "C" fn(*mut c_void, kvxfer_log_level, *const c_char),
    ctx: *mut c_void,
}

impl CSink {
    fn call(&self, level: Level, line: &str) {
        let line = CString::new(line.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the sink contract of kvxfer_config_set_log_sink; `line` outlives the
        // call.
        unsafe { (self.f)(self.ctx, level.into(), line.as_ptr()) }
    }
}

// SAFETY: the caller of kvxfer_config_set_log_sink promises that the callback and its
// `ctx` may be used from any thread, concurrently (documented on that function).
unsafe impl Send for CSink {}
// SAFETY: as above.
unsafe impl Sync for CSink {}

/// Routes the engine's log lines to `sink(ctx, level, line)` instead of stderr. A NULL
/// `sink` restores stderr. Lines below the `log_level` key are not passed.
///
/// `sink` and `ctx` must stay valid until every engine created from this config is
/// freed, and `sink` must be callable from any thread, concurrently.
///
/// Errors: `KVXFER_ERR_NULL_POINTER` if `cfg` is NULL.
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_config_set_log_sink(
    cfg: *mut kvxfer_config,
    sink: kvxfer_log_fn,
    ctx: *mut c_void,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL cfg is a live handle used by one thread (documented).
        let cfg = unsafe { kvxfer_config::try_borrow_mut(cfg) }?;
        cfg.sink = sink.map(|f| {
            let c = CSink { f, ctx };
            Arc::new(move |level: Level, line: &str| c.call(level, line)) as Sink
        });
        Ok(())
    })
}

/// Releases a configuration. `NULL` is a no-op. Engines created from it are not
/// affected (they copied what they need).
#[no_mangle]
pub unsafe extern "C" fn kvxfer_config_free(cfg: *mut kvxfer_config) {
    ffi_value!((), {
        // SAFETY: a non-NULL cfg came from kvxfer_config_new and is not used again.
        unsafe { kvxfer_config::free(cfg) }
    })
}
