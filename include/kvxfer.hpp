/*
 * libkvxfer: a small header-only C++17 layer over the C ABI in kvxfer.h.
 *
 * - Every failing C call becomes a kvxfer::Error carrying the kvxfer_status and the
 *   per-thread message from kvxfer_last_error() (read right after the failing call).
 * - kvxfer::Config and kvxfer::Engine own their handles (std::unique_ptr with a deleter
 *   that calls the _free function); they are movable, not copyable.
 * - Statuses, room states, failure causes and log levels are enum classes with the C
 *   values; their names come from the C tables (kvxfer_status_str, ...).
 * - A log sink may be any std::function, which the library owns and releases
 *   (kvxfer_config_set_log_sink2).
 *
 * Nothing here adds behaviour: each member calls one C function (address() and
 * failure() may call it twice to size the buffer; register_kv_layers() and
 * register_kv_layout() first check that their two vectors have one length, and
 * register_kv_layout() sets the layout's struct_size). The C documentation in kvxfer.h is the
 * reference for ownership, threading and errors.
 */

#ifndef KVXFER_HPP
#define KVXFER_HPP

#include "kvxfer.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvxfer {

/// The library version, such as "0.1.0" (from the shared library, not the header).
inline std::string version() { return kvxfer_version(); }

/// The static name of a status code, such as "KVXFER_ERR_NOT_FOUND".
inline const char *status_name(kvxfer_status code) {
    return kvxfer_status_str(static_cast<int32_t>(code));
}

/// A call's status (values of kvxfer_status).
enum class Status : int32_t {
    Ok = KVXFER_OK,
    InvalidArgument = KVXFER_ERR_INVALID_ARGUMENT,
    NullPointer = KVXFER_ERR_NULL_POINTER,
    NotFound = KVXFER_ERR_NOT_FOUND,
    AlreadyExists = KVXFER_ERR_ALREADY_EXISTS,
    WrongRole = KVXFER_ERR_WRONG_ROLE,
    WrongState = KVXFER_ERR_WRONG_STATE,
    Unsupported = KVXFER_ERR_UNSUPPORTED,
    BufferTooSmall = KVXFER_ERR_BUFFER_TOO_SMALL,
    UnknownKey = KVXFER_ERR_UNKNOWN_KEY,
    BadValue = KVXFER_ERR_BAD_VALUE,
    TransportUnavailable = KVXFER_ERR_TRANSPORT_UNAVAILABLE,
    Io = KVXFER_ERR_IO,
    Panic = KVXFER_ERR_PANIC,
};

/// The status's C name, such as "KVXFER_ERR_NOT_FOUND" (kvxfer_status_str).
inline const char *to_string(Status s) noexcept {
    return kvxfer_status_str(static_cast<int32_t>(s));
}

/// The message of the last failed call on this thread ("" after a successful call).
inline std::string last_error() {
    std::size_t n = kvxfer_last_error(nullptr, 0);
    std::string s(n + 1, '\0');
    kvxfer_last_error(&s[0], s.size());
    s.resize(n);
    return s;
}

/// A failed call: the status and the library's message for it.
class Error : public std::runtime_error {
  public:
    Error(kvxfer_status code, std::string message)
        : std::runtime_error(std::string(status_name(code)) + ": " + message),
          code_(code), message_(std::move(message)) {}

    /// The status the C call returned.
    kvxfer_status code() const noexcept { return code_; }
    /// The same, as the enum class.
    Status status() const noexcept { return static_cast<Status>(code_); }
    /// The library's message alone (what() is "<status name>: <message>").
    const std::string &message() const noexcept { return message_; }

  private:
    kvxfer_status code_;
    std::string message_;
};

/// Throws kvxfer::Error unless `status` is KVXFER_OK. Call it right after the C call,
/// before any other kvxfer_* call on this thread, so the message is that call's.
inline void check(kvxfer_status status) {
    if (status != KVXFER_OK) {
        throw Error(status, last_error());
    }
}

/// A room's state (values of kvxfer_room_state; Failed is the smallest so that polls
/// can be MIN-reduced across ranks).
enum class RoomState : int32_t {
    Failed = KVXFER_ROOM_FAILED,
    Bootstrapping = KVXFER_ROOM_BOOTSTRAPPING,
    WaitingForInput = KVXFER_ROOM_WAITING_FOR_INPUT,
    Transferring = KVXFER_ROOM_TRANSFERRING,
    Success = KVXFER_ROOM_SUCCESS,
};

/// Whether `s` is Success or Failed (terminal states never change until a clear).
inline bool is_terminal(RoomState s) noexcept {
    return s == RoomState::Failed || s == RoomState::Success;
}

namespace detail {
/// `name` without `prefix` when it starts with it, else `name`.
inline const char *without_prefix(const char *name, const char *prefix) noexcept {
    std::size_t n = std::strlen(prefix);
    return std::strncmp(name, prefix, n) == 0 ? name + n : name;
}
} // namespace detail

/// The state's name without its prefix, such as "WAITING_FOR_INPUT" (from
/// kvxfer_room_state_str; "KVXFER_UNKNOWN_ROOM_STATE" for a value that names none).
inline const char *to_string(RoomState s) noexcept {
    return detail::without_prefix(kvxfer_room_state_str(static_cast<int32_t>(s)),
                                  "KVXFER_ROOM_");
}

/// The class of a room's failure (values of kvxfer_failure_cause).
enum class FailureCause : int32_t {
    Aborted = KVXFER_CAUSE_ABORTED,
    PeerLost = KVXFER_CAUSE_PEER_LOST,
    BootstrapTimeout = KVXFER_CAUSE_BOOTSTRAP_TIMEOUT,
    WaitingTimeout = KVXFER_CAUSE_WAITING_TIMEOUT,
    TransferTimeout = KVXFER_CAUSE_TRANSFER_TIMEOUT,
    Protocol = KVXFER_CAUSE_PROTOCOL,
    Mismatch = KVXFER_CAUSE_MISMATCH,
    Transfer = KVXFER_CAUSE_TRANSFER,
    Shutdown = KVXFER_CAUSE_SHUTDOWN,
    Internal = KVXFER_CAUSE_INTERNAL,
    Integrity = KVXFER_CAUSE_INTEGRITY,
};

/// The cause's name without its prefix, such as "PEER_LOST" (from
/// kvxfer_failure_cause_str; "KVXFER_UNKNOWN_CAUSE" for a value that names none).
inline const char *to_string(FailureCause c) noexcept {
    return detail::without_prefix(kvxfer_failure_cause_str(static_cast<int32_t>(c)),
                                  "KVXFER_CAUSE_");
}

/// The path a room's data takes with its peer engines (values of kvxfer_path).
enum class Path : int32_t {
    Unknown = KVXFER_PATH_UNKNOWN,
    Tcp = KVXFER_PATH_TCP,
    Rdma = KVXFER_PATH_RDMA,
    SameHost = KVXFER_PATH_SAME_HOST,
    CudaIpc = KVXFER_PATH_CUDA_IPC,
    Mixed = KVXFER_PATH_MIXED,
};

/// A log line's level (values of kvxfer_log_level), most severe first.
enum class LogLevel : int32_t {
    Error = KVXFER_LOG_ERROR,
    Warn = KVXFER_LOG_WARN,
    Info = KVXFER_LOG_INFO,
    Debug = KVXFER_LOG_DEBUG,
    Trace = KVXFER_LOG_TRACE,
};

/// A log sink: called from library threads, concurrently, with a level and one line
/// (valid during the call only). It must be thread-safe and must not call into the
/// engine that logs. An exception it throws is caught and its line lost (one must not
/// reach the library).
using LogFunction = std::function<void(LogLevel level, std::string_view line)>;

namespace detail {
inline void log_call(void *ctx, kvxfer_log_level level, const char *line) noexcept {
    try {
        (*static_cast<const LogFunction *>(ctx))(static_cast<LogLevel>(level), line);
    } catch (...) {
        // Unwinding into the library is undefined behaviour: the line is lost instead.
    }
}

inline void log_drop(void *ctx) noexcept { delete static_cast<LogFunction *>(ctx); }

/// Calls `f(buf, len, &out_n)` with a growing buffer until it fits.
template <class F> std::string read_string(F &&f) {
    std::string s(64, '\0');
    for (;;) {
        std::size_t n = 0;
        kvxfer_status st = f(&s[0], s.size(), &n);
        if (st == KVXFER_OK) {
            s.resize(n);
            return s;
        }
        if (st == KVXFER_ERR_BUFFER_TOO_SMALL && n + 1 > s.size()) {
            s.assign(n + 1, '\0');
            continue;
        }
        check(st);
        throw Error(st, "unexpected result while reading a string");
    }
}
} // namespace detail

/// An engine configuration (kvxfer_config). Every key is validated when set.
class Config {
  public:
    Config() {
        kvxfer_config *c = nullptr;
        check(kvxfer_config_new(&c));
        handle_.reset(c);
    }

    /// Sets `key` to `value`; throws KVXFER_ERR_UNKNOWN_KEY / KVXFER_ERR_BAD_VALUE.
    Config &set(const std::string &key, const std::string &value) {
        check(kvxfer_config_set(handle_.get(), key.c_str(), value.c_str()));
        return *this;
    }

    /// Routes engine log lines to `sink(ctx, level, line)`; nullptr restores stderr.
    /// `sink` and `ctx` must outlive every engine created from this config, and `sink`
    /// must be thread-safe and must not throw (see kvxfer_config_set_log_sink).
    Config &set_log_sink(kvxfer_log_fn sink, void *ctx) {
        check(kvxfer_config_set_log_sink(handle_.get(), sink, ctx));
        return *this;
    }

    /// Routes engine log lines to `sink`; an empty function restores stderr. The library
    /// keeps its own copy of `sink`, shared by the engines created from this config, and
    /// destroys it once this config and all those engines are gone (or the config's
    /// sink is replaced and no engine uses the old one), after its last call returned
    /// (kvxfer_config_set_log_sink2).
    Config &set_log_sink(LogFunction sink) {
        if (!sink) {
            check(kvxfer_config_set_log_sink2(handle_.get(), nullptr, nullptr, nullptr));
            return *this;
        }
        auto owned = std::make_unique<LogFunction>(std::move(sink));
        check(kvxfer_config_set_log_sink2(handle_.get(), &detail::log_call, owned.get(),
                                          &detail::log_drop));
        owned.release(); // the library's now (on error it stayed ours, and is freed)
        return *this;
    }

    kvxfer_config *get() const noexcept { return handle_.get(); }

  private:
    struct Deleter {
        void operator()(kvxfer_config *c) const noexcept { kvxfer_config_free(c); }
    };
    std::unique_ptr<kvxfer_config, Deleter> handle_;
};

/// A running engine (kvxfer_engine). Destroying it fails every live room with
/// "engine shut down" and joins the library's threads. Registered memory must outlive
/// the Engine.
/// A kvxfer_buffer_desc of host memory.
inline kvxfer_buffer_desc host_buffer(void *base, std::size_t len, std::size_t item_len) {
    kvxfer_buffer_desc d{};
    d.struct_size = sizeof d;
    d.kind = KVXFER_MEMORY_HOST;
    d.base = base;
    d.len = len;
    d.item_len = item_len;
    return d;
}

/// A kvxfer_buffer_desc of CUDA device memory of `device` (a device address, such as
/// cudaMalloc's or a CUDA VMM range's).
inline kvxfer_buffer_desc cuda_buffer(uint32_t device, void *base, std::size_t len,
                                      std::size_t item_len) {
    kvxfer_buffer_desc d = host_buffer(base, len, item_len);
    d.kind = KVXFER_MEMORY_CUDA;
    d.device = device;
    return d;
}

class Engine {
  public:
    explicit Engine(const Config &config) {
        kvxfer_engine *e = nullptr;
        check(kvxfer_engine_new(config.get(), &e));
        handle_.reset(e);
    }

    /// The "host:port" peers connect to.
    std::string address() const {
        return detail::read_string([this](char *buf, std::size_t len, std::size_t *n) {
            return kvxfer_engine_address(handle_.get(), buf, len, n);
        });
    }

    /// This engine's id, which it claims when it connects to a peer: give a decode
    /// engine's id to create_prefill_room_for() on the prefill side.
    uint64_t id() const {
        uint64_t id = 0;
        check(kvxfer_engine_id(handle_.get(), &id));
        return id;
    }

    /// Sleeps until a room of this engine changes state or wake() is called, after the
    /// count `seen`, or `timeout_ms` passes; returns the count of changes (0 ms: at once).
    /// Read changes(), poll the rooms, then wait(seen): no change in between is missed.
    uint64_t wait(uint64_t seen, uint32_t timeout_ms) const {
        uint64_t n = 0;
        check(kvxfer_engine_wait(handle_.get(), seen, timeout_ms, &n));
        return n;
    }

    /// The count of changes wait() waits past.
    uint64_t changes() const { return wait(0, 0); }

    /// Wakes every wait(), as a room's change would (for the host's own events).
    void wake() const { check(kvxfer_engine_wake(handle_.get())); }

    /// Counters and gauges (see kvxfer_metrics).
    kvxfer_metrics metrics() const {
        kvxfer_metrics m{};
        check(kvxfer_engine_metrics(handle_.get(), &m, sizeof m));
        return m;
    }

    /// The metrics in the Prometheus text exposition format.
    std::string metrics_text() const {
        return detail::read_string([this](char *buf, std::size_t len, std::size_t *n) {
            return kvxfer_engine_metrics_text(handle_.get(), buf, len, n);
        });
    }

    void register_kv(const std::vector<kvxfer_buffer> &bufs) {
        check(kvxfer_register_kv(handle_.get(), bufs.data(), bufs.size()));
    }

    /// Instead of register_kv: buffers with a layer id each (`layer_ids[i]` for
    /// `bufs[i]`), so pipeline stages register only their layers and pair by layer.
    /// Vectors of different lengths throw KVXFER_ERR_INVALID_ARGUMENT.
    void register_kv_layers(const std::vector<kvxfer_buffer> &bufs,
                            const std::vector<uint32_t> &layer_ids) {
        if (bufs.size() != layer_ids.size()) {
            throw Error(KVXFER_ERR_INVALID_ARGUMENT,
                        "register_kv_layers: " + std::to_string(bufs.size()) +
                            " buffers but " + std::to_string(layer_ids.size()) +
                            " layer ids");
        }
        check(kvxfer_register_kv_layers(handle_.get(), bufs.data(), layer_ids.data(),
                                        bufs.size()));
    }

    /// Instead of register_kv: buffers with the layout of their pages (see
    /// kvxfer_kv_layout; struct_size is set here) and, unless `layer_ids` is empty, a
    /// layer id each. Peers exchange layouts when they connect and refuse ones that cannot
    /// meet (the decode room fails as Mismatch, naming the field and both values); layouts
    /// that differ in tensor-parallel rank or size, page size or page order move head
    /// slices (see kvxfer_register_kv_layout).
    /// A non-empty `layer_ids` of another length than `bufs` throws
    /// KVXFER_ERR_INVALID_ARGUMENT.
    void register_kv_layout(const std::vector<kvxfer_buffer> &bufs, kvxfer_kv_layout layout,
                            const std::vector<uint32_t> &layer_ids = {}) {
        if (!layer_ids.empty() && bufs.size() != layer_ids.size()) {
            throw Error(KVXFER_ERR_INVALID_ARGUMENT,
                        "register_kv_layout: " + std::to_string(bufs.size()) +
                            " buffers but " + std::to_string(layer_ids.size()) +
                            " layer ids");
        }
        layout.struct_size = sizeof layout;
        check(kvxfer_register_kv_layout(handle_.get(), bufs.data(),
                                        layer_ids.empty() ? nullptr : layer_ids.data(),
                                        bufs.size(), &layout));
    }

    void register_aux(const std::vector<kvxfer_buffer> &bufs) {
        check(kvxfer_register_aux(handle_.get(), bufs.data(), bufs.size()));
    }

    /// Instead of the other register_kv calls: buffers with their memory kind (make them
    /// with host_buffer() or cuda_buffer(); struct_size is set here), a layer id each
    /// unless `layer_ids` is empty, and a layout unless `layout` is null (see
    /// kvxfer_register_kv_desc). CUDA buffers are checked against the CUDA driver, loaded
    /// at run time: without it this throws KVXFER_ERR_TRANSPORT_UNAVAILABLE naming what is
    /// missing. A non-empty `layer_ids` of another length than `bufs` throws
    /// KVXFER_ERR_INVALID_ARGUMENT.
    void register_kv_desc(std::vector<kvxfer_buffer_desc> bufs,
                          const std::vector<uint32_t> &layer_ids = {},
                          const kvxfer_kv_layout *layout = nullptr) {
        if (!layer_ids.empty() && bufs.size() != layer_ids.size()) {
            throw Error(KVXFER_ERR_INVALID_ARGUMENT,
                        "register_kv_desc: " + std::to_string(bufs.size()) +
                            " buffers but " + std::to_string(layer_ids.size()) +
                            " layer ids");
        }
        for (kvxfer_buffer_desc &b : bufs) {
            b.struct_size = sizeof b;
        }
        kvxfer_kv_layout l{};
        if (layout != nullptr) {
            l = *layout;
            l.struct_size = sizeof l;
        }
        check(kvxfer_register_kv_desc(handle_.get(), bufs.data(),
                                      layer_ids.empty() ? nullptr : layer_ids.data(),
                                      bufs.size(), layout != nullptr ? &l : nullptr));
    }

    /// Instead of register_aux: aux buffers with their memory kind (struct_size is set
    /// here).
    void register_aux_desc(std::vector<kvxfer_buffer_desc> bufs) {
        for (kvxfer_buffer_desc &b : bufs) {
            b.struct_size = sizeof b;
        }
        check(kvxfer_register_aux_desc(handle_.get(), bufs.data(), bufs.size()));
    }

    /// Decode engine: creates `room`, pulling from the prefill engines at `prefills`
    /// ("host:port" each, at least one).
    void create_decode_room(uint64_t room, const std::vector<std::string> &prefills) {
        std::vector<const char *> ptrs;
        ptrs.reserve(prefills.size());
        for (const std::string &p : prefills) {
            ptrs.push_back(p.c_str());
        }
        check(kvxfer_room_create(handle_.get(), room, ptrs.data(), ptrs.size()));
    }

    /// Prefill engine: creates `room`, expecting a destination from `n_decoders`
    /// decode engines (0 means 1).
    void create_prefill_room(uint64_t room, std::size_t n_decoders = 1) {
        check(kvxfer_room_create(handle_.get(), room, nullptr, n_decoders));
    }

    /// Decode engine: creates `room` pulling from every rank of prefill instance
    /// `instance`, found in the engine's copy of the registry (config key `discovery`),
    /// in rank order. Never waits for etcd; an instance not (wholly) registered throws
    /// with KVXFER_ERR_NOT_FOUND.
    void create_decode_room_from(uint64_t room, const std::string &instance) {
        check(kvxfer_room_create_from(handle_.get(), room, instance.c_str()));
    }

    /// Prefill engine: creates `room` bound to the decode engines `decode_ids` (their
    /// id()), one destination from each; any other engine's destination or abort for it
    /// is refused and counted (kvxfer_metrics::binding_refusals).
    void create_prefill_room_for(uint64_t room, const std::vector<uint64_t> &decode_ids) {
        check(kvxfer_room_create_for(handle_.get(), room, decode_ids.data(),
                                     decode_ids.size()));
    }

    /// Decode engine: the destination pages and aux slot (< 0: none) of `room`.
    void set_destination(uint64_t room, const std::vector<uint32_t> &pages,
                         int64_t aux_slot = -1) {
        check(kvxfer_room_set_destination(handle_.get(), room, pages.data(), pages.size(),
                                          aux_slot));
    }

    /// Prefill engine: the next chunk of `room` (source pages; aux slot only when last).
    void enqueue_chunk(uint64_t room, const std::vector<uint32_t> &pages, bool is_last,
                       int64_t aux_slot = -1) {
        check(kvxfer_enqueue_chunk(handle_.get(), room, pages.data(), pages.size(), is_last,
                                   aux_slot));
    }

    /// The room's state; never blocks.
    /// Prefill only: queues layers [layer_first, layer_first + layer_count) of the chunk
    /// of source `pages` as soon as they are computed (kvxfer_enqueue_layers).
    void enqueue_layers(uint64_t room, const std::vector<uint32_t> &pages, uint32_t layer_first,
                        uint32_t layer_count, bool is_last, int64_t aux_slot = -1) {
        check(kvxfer_enqueue_layers(handle_.get(), room, pages.data(), pages.size(), layer_first,
                                    layer_count, is_last, aux_slot));
    }

    /// Decode only: how many of the room's first layers have landed whole
    /// (kvxfer_room_layers_landed).
    uint32_t layers_landed(uint64_t room) const {
        uint32_t n = 0;
        check(kvxfer_room_layers_landed(handle_.get(), room, &n));
        return n;
    }

    RoomState poll(uint64_t room) const {
        kvxfer_room_state s{};
        check(kvxfer_room_poll(handle_.get(), room, &s));
        return static_cast<RoomState>(s);
    }

    /// Fails a live room with `reason` ("" for the default text); no effect on a
    /// terminal one.
    void abort(uint64_t room, const std::string &reason = std::string()) {
        check(kvxfer_room_abort(handle_.get(), room, reason.empty() ? nullptr : reason.c_str()));
    }

    /// The recorded reason of a FAILED room (throws KVXFER_ERR_WRONG_STATE otherwise).
    std::string failure(uint64_t room) const {
        return detail::read_string([this, room](char *buf, std::size_t len, std::size_t *n) {
            return kvxfer_room_failure(handle_.get(), room, buf, len, n);
        });
    }

    /// The class of a FAILED room's failure; `*from_peer` (if given) says whether the
    /// peer engine reported it.
    FailureCause failure_cause(uint64_t room, bool *from_peer = nullptr) const {
        kvxfer_failure_cause c{};
        bool peer = false;
        check(kvxfer_room_failure_cause(handle_.get(), room, &c, &peer));
        if (from_peer != nullptr) {
            *from_peer = peer;
        }
        return static_cast<FailureCause>(c);
    }

    /// Decode only: whether the room reached SUCCESS with every byte verified
    /// (kvxfer_room_verified).
    bool verified(uint64_t room) const {
        bool v = false;
        check(kvxfer_room_verified(handle_.get(), room, &v));
        return v;
    }

    /// The path the room's data takes with its peer engines (kvxfer_room_path).
    Path path(uint64_t room) const {
        kvxfer_path p{};
        check(kvxfer_room_path(handle_.get(), room, &p));
        return static_cast<Path>(p);
    }

    /// Whether the room is terminal and its memory may be reused (decode: no write can
    /// still land; prefill: no read of its source pages is in progress).
    bool drained(uint64_t room) const {
        bool d = false;
        check(kvxfer_room_drained(handle_.get(), room, &d));
        return d;
    }

    /// Releases the room (aborting it first if live); the id may then be reused.
    void clear(uint64_t room) { check(kvxfer_room_clear(handle_.get(), room)); }

    kvxfer_engine *get() const noexcept { return handle_.get(); }

  private:
    struct Deleter {
        void operator()(kvxfer_engine *e) const noexcept { kvxfer_engine_free(e); }
    };
    std::unique_ptr<kvxfer_engine, Deleter> handle_;
};

} // namespace kvxfer

#endif /* KVXFER_HPP */
