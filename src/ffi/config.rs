//! `kvxfer_config`: a bag of string settings an engine is created from.

use std::ffi::{c_char, c_void};

use super::boundary::{try_str, BoxHandle};
use super::log::{c_sink, kvxfer_drop_fn, kvxfer_log_fn};
use super::status::kvxfer_status;
use crate::config::Config;
use crate::log::Sink;

/// An engine configuration. Create with `kvxfer_config_new`, release with
/// `kvxfer_config_free`. Not thread-safe: use one config from one thread at a time.
pub struct kvxfer_config {
    _private: [u8; 0],
}

pub(crate) struct ConfigObject {
    pub(crate) config: Config,
    pub(crate) sink: Option<Sink>,
}

impl BoxHandle for kvxfer_config {
    type Target = ConfigObject;
    const NAME: &'static str = "cfg";
}

/// Creates a configuration with every key at its default (the defaults are listed on
/// `kvxfer_config_set`) and stores it in `*out`.
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
/// Keys:
/// - `role`: `prefill` | `decode`. No default: must be set.
/// - `listen` (default `127.0.0.1:0`): `host:port` to listen on, port 0 = any; IPv6 as
///   `[addr]:port`; with a wildcard host such as `0.0.0.0`, `kvxfer_engine_address`
///   reports this machine's host name. An address that is not loopback needs a key, TLS
///   or `auth=off` (see `auth`).
/// - `transport` (default `auto`): `auto` | `tcp` | `rdma`.
/// - `workers` (default `4`, 1..256): worker threads.
/// - `connections_per_peer` (default `2`, 1..64): data connections to each peer engine
///   (TCP only).
/// - `rdma_devices` (default empty: every device with an active port): comma-separated
///   device names.
/// - `rdma_slice_bytes` (default `1048576`, 4096..1073741824): longest single RDMA WRITE.
/// - `rdma_queue_depth` (default `128`, 1..4096): most writes outstanding per queue pair.
/// - `bootstrap_timeout_ms` (default `30000`, 1..86400000): longest a room may stay
///   BOOTSTRAPPING.
/// - `waiting_timeout_ms` (default `60000`, 1..86400000): longest a room may stay
///   WAITING_FOR_INPUT.
/// - `transfer_timeout_ms` (default `30000`, 1..86400000): longest a TRANSFERRING room may
///   go without progress.
/// - `heartbeat_interval_ms` (default `1000`, 1..86400000): time between heartbeats to
///   each peer engine.
/// - `heartbeat_misses` (default `5`, 1..1000): missed heartbeats before a peer engine
///   counts as lost.
/// - `drain_timeout_ms` (default `5000`, 1..86400000): RDMA: longest a failed decode room
///   waits for the prefill's acknowledgement before its peer's queue pairs are shut.
/// - `log_level` (default `warn`): `error` | `warn` | `info` | `debug` | `trace`.
/// - `same_host` (default `auto`): `auto` | `require` | `off`. Engines on one host (the
///   same boot id and network namespace, learnt in the handshake after authentication)
///   move KV without the network: the decode engine copies the pages straight from the
///   prefill process's registered memory (`process_vm_readv`; a batch of at most 64 KiB
///   of host memory goes inline on the path's connection instead, where a copy's answer
///   would cost more than the bytes). It needs the same PID
///   namespace and permission to read the prefill process (same user and Yama
///   `ptrace_scope` 0, or `CAP_SYS_PTRACE`), which the pairing proves by reading a probe.
///   `auto`: that path when it can be used, TCP otherwise (logged at WARN with the
///   reason, counted in `same_host_fallbacks`). `require`: that path or no pairing (the
///   rooms fail as MISMATCH, the reason naming why, such as `ptrace denied:
///   ptrace_scope=2`). `off`: never. TCP transport only (RDMA engines use RDMA).
///   `kvxfer_room_path` tells which path a room took.
/// - `integrity` (default `off`): `verify` | `off`. `verify`: the prefill engine sends
///   with every data run a CRC32C of the run's bytes bound to its room, generation and
///   destination (buffer, pages, offset), and the decode engine recomputes it over the
///   bytes where they landed, before it counts them: a room reaches SUCCESS only when
///   every run matched, and a mismatch fails it as `KVXFER_CAUSE_INTEGRITY` with a reason
///   naming the prefill engine, buffer, page and byte range (`kvxfer_room_verified`).
///   Over TCP and the same-host path the digest travels in the run's header; over RDMA
///   in the progress message of its completed writes, checked where they landed on a
///   thread of its own. Both engines of a pair must have the same setting, else their
///   rooms fail as MISMATCH naming both. Off by default because it costs a CRC32C pass
///   over every byte on each side (0.03-0.09 CPU s per GB more per side, 0.66-0.83 of
///   the throughput over TCP, on the 2-core host it was measured on;
///   docs/BENCHMARKS.md).
///
/// Authentication:
/// - `auth` (default `auto`): `auto` | `required` | `off`. `auto`: `required` when a key
///   is set; without a key or TLS, the engine works only with engines on its own host:
///   it must listen on a loopback address (else `kvxfer_engine_new` fails with
///   `KVXFER_ERR_BAD_VALUE` naming `listen` and `auth`), a prefill engine refuses
///   connections from other addresses (counted in `auth_failures`), a decode engine
///   does not connect to a prefill engine elsewhere (its rooms fail with
///   `KVXFER_CAUSE_MISMATCH`, the reason naming `auth`). `required`: every connection
///   proves the key. `off`: no authentication, any address, any peer.
/// - `auth_key_file`: path of the cluster key: the file's whole content, 32 to 4096
///   bytes, best 32 random bytes such as `head -c 32 /dev/urandom`; the file must be a
///   regular file that grants nothing to group or others, mode 0600 or 0400, else the
///   message names the path and its mode; read when this call is made.
/// - `auth_key`: the key in hexadecimal, 64 to 8192 digits; meant for tests, since a key
///   in a config string tends to reach logs and process listings; the message of a bad
///   value never repeats it.
///
/// TLS (all three keys or none; see docs/SECURITY.md for what it protects):
/// - `tls_cert_file`: path of this engine's certificate chain, PEM, leaf first; the
///   leaf must be signed (through the chain) by a CA of `tls_ca_file` and allow
///   TLS server and client use (extended key usages serverAuth and clientAuth, or none).
/// - `tls_key_file`: path of that certificate's private key, PEM (PKCS#8, PKCS#1 or
///   SEC1); like `auth_key_file`, a regular file that grants nothing to group or
///   others (mode 0600 or 0400), else the message names the path and its mode.
/// - `tls_ca_file`: path of the cluster CA's certificate(s), PEM. Host names are not
///   checked: any certificate it signed is a member of the cluster.
/// - `encrypt_data` (default `false`): `true` | `false`. `true` seals every KV payload on
///   TCP data connections with AES-256-GCM, under keys derived from the control
///   connection's TLS session, one per data connection; a payload that does not verify
///   is never written and fails the rooms of that peer. Needs TLS. RDMA writes are not
///   encrypted.
///
/// Discovery (engines that find each other through etcd; see docs/ARCHITECTURE.md):
/// - `discovery` (default empty: no registry): `etcd://host:port[,host:port...]`, the
///   client endpoints of an etcd cluster (3.4 or later; its JSON gateway, plain HTTP).
///   The engine publishes its entry (engine id, incarnation, role, `instance`, `rank`,
///   address, transport, KV buffers and layout) under a lease it keeps alive, signed with
///   the cluster key, which `discovery` therefore needs (else `kvxfer_engine_new` fails
///   with `KVXFER_ERR_BAD_VALUE`), as it needs `instance`. It watches every entry under
///   `discovery_prefix`: `kvxfer_room_create_from` finds a prefill instance's ranks
///   there, entries that do not verify are ignored (counted in `registry_rejected`), and
///   a peer whose entry leaves (lease expired, deleted, replaced by a new incarnation)
///   is lost at once. etcd being away stops nothing: rooms go on with the engines known.
/// - `discovery_prefix` (default `/kvxfer/`): the etcd key prefix of the cluster's
///   entries, ending in `/`; an entry is `<prefix><instance>/<rank>`.
/// - `instance` (default empty): the name of the instance this engine is a rank of, 1 to
///   128 of `A-Z a-z 0-9 . _ -`; needed with `discovery`.
/// - `rank` (default `0`, 0..65535): this engine's rank in its instance, below
///   `instance_ranks`.
/// - `instance_ranks` (default `1`, 1..65536): how many ranks the instance has; a room
///   by instance needs every one of them registered.
/// - `discovery_ttl_ms` (default `5000`, 2000..3600000): the TTL of the engine's lease,
///   rounded up to whole seconds; its entry is gone that long after the engine is
///   (keep-alives every third of it).
///
/// With the three `tls_*` keys set, every control connection is TLS 1.3 with a
/// certificate on both sides (the cluster-key handshake, when a key is set, runs inside
/// it), and data connections prove the control session they belong to even without a
/// key. The files are read by `kvxfer_engine_new`, which fails with
/// `KVXFER_ERR_BAD_VALUE` naming the key and the path when only some of the three are
/// set, a file cannot be read or holds no usable PEM, the key's file grants anything to
/// group or others, the key does not fit the certificate, the certificate is not signed
/// by the CA, or `encrypt_data=true` has no TLS. An engine with TLS and one without
/// fail their rooms as with different `auth` settings, the reasons naming TLS; so do
/// engines that differ in `encrypt_data`, the reasons naming it.
///
/// Whichever of `auth_key_file` and `auth_key` is set last is the key. With
/// `auth=required` every connection between two engines proves, both ways, that both
/// hold the key before anything else on it is acted on; engines that differ in `auth` or
/// in key fail their rooms (decode side: `KVXFER_CAUSE_MISMATCH`, the reason naming
/// authentication and both settings; prefill side: at `bootstrap_timeout_ms`, the
/// reason naming the refused connection). `auth=required` without a key makes
/// `kvxfer_engine_new` fail with `KVXFER_ERR_BAD_VALUE`. A keyless `auto` engine and an
/// `off` one on the same host work together (neither authenticates).
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

/// Routes the engine's log lines to `sink(ctx, level, line)` instead of stderr. A NULL
/// `sink` restores stderr. Lines below the `log_level` key are not passed.
///
/// `sink` and `ctx` must stay valid until every engine created from this config is
/// freed, and `sink` must be callable from any thread, concurrently (see
/// `kvxfer_log_fn`: it must not unwind). To hand `ctx` over to the library instead, use
/// `kvxfer_config_set_log_sink2`.
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
        // SAFETY: the caller keeps `sink` and `ctx` valid and thread-safe (documented);
        // without a drop function the library never releases `ctx`.
        cfg.sink = unsafe { c_sink(sink, ctx, None) };
        Ok(())
    })
}

/// As `kvxfer_config_set_log_sink`, and the library takes `ctx` over: it calls
/// `drop(ctx)` (if `drop` is not NULL) exactly once, after the last call of `sink` has
/// returned: once this config and every engine created from it have been freed, or once
/// the config's sink is replaced and no engine uses the old one. `drop` runs on the
/// thread whose `kvxfer_config_free`, `kvxfer_engine_free` or `kvxfer_config_set_log_sink*`
/// call released the last use, before that call returns. With a NULL `sink` the library
/// keeps nothing and calls `drop(ctx)` before returning. This lets a host hand over a
/// context it allocated, such as a C++ `std::function`.
///
/// `sink` must be callable from any thread, concurrently, until `drop` runs. `drop` must
/// not call back into the library, and neither may unwind (no C++ exception, no
/// `longjmp`).
///
/// Errors: `KVXFER_ERR_NULL_POINTER` if `cfg` is NULL; `ctx` then stays the caller's
/// (`drop` is not called).
#[no_mangle]
#[must_use]
pub unsafe extern "C" fn kvxfer_config_set_log_sink2(
    cfg: *mut kvxfer_config,
    sink: kvxfer_log_fn,
    ctx: *mut c_void,
    drop: kvxfer_drop_fn,
) -> kvxfer_status {
    ffi_status!({
        // SAFETY: a non-NULL cfg is a live handle used by one thread (documented).
        let cfg = unsafe { kvxfer_config::try_borrow_mut(cfg) }?;
        // SAFETY: the caller hands over `ctx` with `sink` and `drop` under the contract
        // documented above.
        cfg.sink = unsafe { c_sink(sink, ctx, drop) };
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
