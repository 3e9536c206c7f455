// Shared helpers for the gtest suites: handles, registered memory, a log capture and a
// way to read a failed call's status together with its message.
#ifndef KVXFER_CPP_TESTS_SUPPORT_HPP
#define KVXFER_CPP_TESTS_SUPPORT_HPP

#include "kvxfer.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace kvtest {

/// The current thread's last error message.
inline std::string last_error() {
    std::size_t n = kvxfer_last_error(nullptr, 0);
    std::string s(n + 1, '\0');
    kvxfer_last_error(&s[0], s.size());
    s.resize(n);
    return s;
}

inline bool contains(const std::string &haystack, const std::string &needle) {
    return haystack.find(needle) != std::string::npos;
}

/// A call's status and the message it left, read right after the call.
struct Result {
    kvxfer_status status;
    std::string message;
};

inline Result result(kvxfer_status st) { return Result{st, last_error()}; }

inline std::ostream &operator<<(std::ostream &os, const Result &r) {
    return os << kvxfer_status_str(r.status) << " (\"" << r.message << "\")";
}

/// Asserts that a call failed with `want` and left a non-empty message. Use as
/// EXPECT_TRUE(fails_with(KVXFER_ERR_X, kvxfer_call(...))): the call runs before this
/// function reads the thread's last error.
inline ::testing::AssertionResult fails_with(kvxfer_status want, kvxfer_status got) {
    std::string msg = last_error();
    if (got != want) {
        return ::testing::AssertionFailure()
               << "got " << kvxfer_status_str(got) << ", want " << kvxfer_status_str(want)
               << " (message: \"" << msg << "\")";
    }
    if (msg.empty()) {
        return ::testing::AssertionFailure()
               << kvxfer_status_str(got) << " left an empty last error message";
    }
    return ::testing::AssertionSuccess() << kvxfer_status_str(got) << ": " << msg;
}

/// Asserts KVXFER_OK and an empty message.
inline ::testing::AssertionResult ok(kvxfer_status got) {
    std::string msg = last_error();
    if (got != KVXFER_OK) {
        return ::testing::AssertionFailure()
               << "got " << kvxfer_status_str(got) << ": " << msg;
    }
    if (!msg.empty()) {
        return ::testing::AssertionFailure() << "KVXFER_OK left a message: " << msg;
    }
    return ::testing::AssertionSuccess();
}

struct ConfigFree {
    void operator()(kvxfer_config *c) const noexcept { kvxfer_config_free(c); }
};
struct EngineFree {
    void operator()(kvxfer_engine *e) const noexcept { kvxfer_engine_free(e); }
};
using ConfigPtr = std::unique_ptr<kvxfer_config, ConfigFree>;
using EnginePtr = std::unique_ptr<kvxfer_engine, EngineFree>;

/// The transport the suites run over: `tcp`, unless KVXFER_TEST_TRANSPORT says otherwise
/// (`make test-rdma` runs them with `rdma` inside a soft-RoCE guest). Keys a test sets
/// itself come after it and win.
inline const char *test_transport() {
    const char *t = std::getenv("KVXFER_TEST_TRANSPORT");
    return t != nullptr && *t != '\0' ? t : "tcp";
}

/// Whether this run has an RDMA device (the soft-RoCE guest).
inline bool rdma_device_present() { return std::string(test_transport()) == "rdma"; }

inline ConfigPtr new_config() {
    kvxfer_config *c = nullptr;
    kvxfer_status st = kvxfer_config_new(&c);
    EXPECT_EQ(st, KVXFER_OK);
    return ConfigPtr(c);
}

/// A config with `role` and the given extra keys set; every set must succeed.
inline ConfigPtr config(const char *role,
                        const std::vector<std::pair<std::string, std::string>> &keys = {}) {
    ConfigPtr c = new_config();
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "role", role)));
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "transport", test_transport())));
    for (const auto &kv : keys) {
        EXPECT_TRUE(ok(kvxfer_config_set(c.get(), kv.first.c_str(), kv.second.c_str())))
            << kv.first << "=" << kv.second;
    }
    return c;
}

inline EnginePtr new_engine(const kvxfer_config *cfg) {
    kvxfer_engine *e = nullptr;
    kvxfer_status st = kvxfer_engine_new(cfg, &e);
    std::string msg = last_error();
    EXPECT_EQ(st, KVXFER_OK) << kvxfer_status_str(st) << ": " << msg;
    return EnginePtr(e);
}

inline EnginePtr engine(const char *role,
                        const std::vector<std::pair<std::string, std::string>> &keys = {}) {
    ConfigPtr c = config(role, keys);
    return new_engine(c.get());
}

inline std::string address(const kvxfer_engine *e) {
    char buf[256];
    std::size_t n = 0;
    EXPECT_TRUE(ok(kvxfer_engine_address(e, buf, sizeof buf, &n)));
    return std::string(buf, n);
}

/// Real, malloc'd memory laid out like a small model's KV cache: `n_buffers` buffers of
/// `pages` pages of `page_bytes` each. Freed on destruction, so declare it before the
/// engine that registers it (it must outlive the engine).
class Memory {
  public:
    Memory(std::size_t n_buffers, std::size_t pages, std::size_t page_bytes) {
        for (std::size_t i = 0; i < n_buffers; ++i) {
            void *p = std::malloc(pages * page_bytes);
            if (p == nullptr) {
                throw std::bad_alloc();
            }
            std::memset(p, static_cast<int>(i & 0xff), pages * page_bytes);
            blocks_.push_back(p);
            bufs_.push_back(kvxfer_buffer{p, pages * page_bytes, page_bytes});
        }
    }
    ~Memory() {
        for (void *p : blocks_) {
            std::free(p);
        }
    }
    Memory(const Memory &) = delete;
    Memory &operator=(const Memory &) = delete;

    const std::vector<kvxfer_buffer> &buffers() const { return bufs_; }
    const kvxfer_buffer *data() const { return bufs_.data(); }
    std::size_t size() const { return bufs_.size(); }

  private:
    std::vector<void *> blocks_;
    std::vector<kvxfer_buffer> bufs_;
};

/// Collects log lines from an engine's log sink (thread-safe; the sink may be called
/// from any library thread).
class LogCapture {
  public:
    static void sink(void *ctx, kvxfer_log_level level, const char *line) {
        auto *self = static_cast<LogCapture *>(ctx);
        std::lock_guard<std::mutex> g(self->mu_);
        self->lines_.emplace_back(level, line);
    }

    std::vector<std::pair<kvxfer_log_level, std::string>> lines() const {
        std::lock_guard<std::mutex> g(mu_);
        return lines_;
    }

    /// Whether some line at `level` contains every one of `parts`.
    bool has(kvxfer_log_level level, const std::vector<std::string> &parts) const {
        for (const auto &l : lines()) {
            if (l.first != level) {
                continue;
            }
            bool all = true;
            for (const auto &p : parts) {
                all = all && contains(l.second, p);
            }
            if (all) {
                return true;
            }
        }
        return false;
    }

    std::string dump() const {
        std::string out;
        for (const auto &l : lines()) {
            out += "  [" + std::to_string(static_cast<int>(l.first)) + "] " + l.second + "\n";
        }
        return out;
    }

  private:
    mutable std::mutex mu_;
    std::vector<std::pair<kvxfer_log_level, std::string>> lines_;
};

inline kvxfer_room_state poll(const kvxfer_engine *e, uint64_t room) {
    kvxfer_room_state s = KVXFER_ROOM_SUCCESS;
    EXPECT_TRUE(ok(kvxfer_room_poll(e, room, &s))) << "room " << room;
    return s;
}

inline std::string failure(const kvxfer_engine *e, uint64_t room) {
    char buf[512];
    std::size_t n = 0;
    EXPECT_TRUE(ok(kvxfer_room_failure(e, room, buf, sizeof buf, &n)));
    return std::string(buf, n);
}

/// A listening TCP socket on loopback that never accepts and never answers: the kernel
/// completes connections to it, so a decode engine pointed at it connects and then waits
/// for a handshake that never comes. Rooms pulling from it stay BOOTSTRAPPING (until
/// their deadline or the engine stops), without depending on timing.
class SilentPeer {
  public:
    SilentPeer() {
        fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof sa;
        if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr *>(&sa), sizeof sa) != 0 ||
            ::listen(fd_, 128) != 0 ||
            ::getsockname(fd_, reinterpret_cast<sockaddr *>(&sa), &len) != 0) {
            ADD_FAILURE() << "cannot open a listening socket: " << std::strerror(errno);
        }
        address_ = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
    }
    ~SilentPeer() {
        if (fd_ >= 0) {
            ::close(fd_);
        }
    }
    SilentPeer(const SilentPeer &) = delete;
    SilentPeer &operator=(const SilentPeer &) = delete;

    const std::string &address() const { return address_; }

  private:
    int fd_ = -1;
    std::string address_;
};

/// A loopback address where nothing listens (a port that was just free).
inline std::string closed_address() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa), 0);
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr *>(&sa), &len), 0);
    ::close(fd);
    return "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
}

/// Polls until `pred(state)` holds or `limit` passes; returns the last state seen.
template <class Pred>
kvxfer_room_state wait_for(const kvxfer_engine *e, uint64_t room, Pred pred,
                           std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    auto until = std::chrono::steady_clock::now() + limit;
    kvxfer_room_state s = KVXFER_ROOM_FAILED;
    for (;;) {
        kvxfer_status st = kvxfer_room_poll(e, room, &s);
        EXPECT_EQ(st, KVXFER_OK) << "room " << room;
        if (st != KVXFER_OK || pred(s) || std::chrono::steady_clock::now() >= until) {
            return s;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
}

inline kvxfer_room_state wait_terminal(const kvxfer_engine *e, uint64_t room,
                                       std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    return wait_for(
        e, room,
        [](kvxfer_room_state s) { return s == KVXFER_ROOM_FAILED || s == KVXFER_ROOM_SUCCESS; },
        limit);
}

/// Waits until `room` is drained: at once over TCP once terminal; over RDMA a failed
/// decode room drains when the prefill's acknowledgement arrives.
inline bool wait_drained(const kvxfer_engine *e, uint64_t room,
                         std::chrono::milliseconds limit = std::chrono::seconds(5)) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
        bool drained = false;
        if (kvxfer_room_drained(e, room, &drained) != KVXFER_OK) {
            return false;
        }
        if (drained) {
            return true;
        }
        if (std::chrono::steady_clock::now() > deadline) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

struct Cause {
    kvxfer_failure_cause cause;
    bool from_peer;
};

inline Cause cause_of(const kvxfer_engine *e, uint64_t room) {
    Cause c{KVXFER_CAUSE_INTERNAL, false};
    EXPECT_TRUE(ok(kvxfer_room_failure_cause(e, room, &c.cause, &c.from_peer)));
    return c;
}

/// A decode room's peer list: owned strings and the pointer array the C call takes.
struct Peers {
    explicit Peers(std::vector<std::string> a) : addrs(std::move(a)) {
        for (const auto &s : addrs) {
            ptrs.push_back(s.c_str());
        }
    }
    Peers(const Peers &) = delete;
    Peers &operator=(const Peers &) = delete;
    std::vector<std::string> addrs;
    std::vector<const char *> ptrs;
};

} // namespace kvtest

#endif
