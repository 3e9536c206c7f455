// Engine lifecycle through the C ABI and kvxfer.hpp: start and stop, the listening
// address, the log sink (and one the library owns), what stopping does to live rooms,
// and the C++ layer's registration and room factories.
#include "kvxfer.hpp"
#include "support.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

using namespace kvtest;

namespace {

// Splits "host:port"; port 0 if malformed.
std::pair<std::string, int> split_address(const std::string &a) {
    std::size_t colon = a.rfind(':');
    if (colon == std::string::npos || colon + 1 >= a.size()) {
        return {a, 0};
    }
    for (std::size_t i = colon + 1; i < a.size(); ++i) {
        if (a[i] < '0' || a[i] > '9') {
            return {a, 0};
        }
    }
    return {a.substr(0, colon), std::stoi(a.substr(colon + 1))};
}

} // namespace

TEST(Engine, StartsAndStopsInBothRoles) {
    for (const char *role : {"prefill", "decode"}) {
        ConfigPtr c = config(role);
        kvxfer_engine *e = nullptr;
        ASSERT_TRUE(ok(kvxfer_engine_new(c.get(), &e))) << role;
        ASSERT_NE(e, nullptr);
        kvxfer_engine_free(e);
    }
}

TEST(Engine, FreeOfNullIsANoOp) {
    kvxfer_engine_free(nullptr);
    kvxfer_config_free(nullptr);
    SUCCEED();
}

// Every call is safe from any thread, kvxfer_engine_free included: a call after the free
// (or racing it) fails with KVXFER_ERR_WRONG_STATE, and a second free does nothing. Under
// AddressSanitizer this also proves no call touches freed memory.
TEST(Engine, CallsAfterOrRacingFreeFailWithWrongStateAndASecondFreeIsANoOp) {
    for (int round = 0; round < 10; ++round) {
        ConfigPtr c = config("prefill");
        kvxfer_engine *e = nullptr;
        ASSERT_TRUE(ok(kvxfer_engine_new(c.get(), &e)));
        std::atomic<int> unexpected{0};
        std::vector<std::thread> callers;
        for (int t = 0; t < 3; ++t) {
            callers.emplace_back([e, &unexpected] {
                for (;;) {
                    kvxfer_room_state st{};
                    kvxfer_status s = kvxfer_room_poll(e, 1, &st);
                    if (s == KVXFER_ERR_WRONG_STATE) {
                        return;
                    }
                    if (s != KVXFER_ERR_NOT_FOUND) {
                        ++unexpected;
                        return;
                    }
                }
            });
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        kvxfer_engine_free(e);
        for (auto &t : callers) {
            t.join();
        }
        EXPECT_EQ(unexpected.load(), 0);
        kvxfer_room_state st{};
        EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE, kvxfer_room_poll(e, 1, &st)));
        kvxfer_engine_free(e);
    }
}

TEST(Engine, AddressIsLoopbackHostAndANonzeroPortThatAcceptsConnections) {
    EnginePtr e = engine("decode");
    std::string a = address(e.get());
    auto hp = split_address(a);
    EXPECT_EQ(hp.first, "127.0.0.1") << a;
    ASSERT_GT(hp.second, 0) << a;
    ASSERT_LT(hp.second, 65536) << a;

    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(hp.second));
    ASSERT_EQ(::inet_pton(AF_INET, hp.first.c_str(), &sa.sin_addr), 1);
    int rc = ::connect(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa);
    int err = errno;
    ::close(fd);
    EXPECT_EQ(rc, 0) << "connect to " << a << ": " << std::strerror(err);
}

TEST(Engine, TwoEnginesListenOnDifferentPorts) {
    EnginePtr a = engine("prefill");
    EnginePtr b = engine("decode");
    EXPECT_NE(address(a.get()), address(b.get()));
}

TEST(Engine, AddressBufferTooSmallReportsTheLengthNeeded) {
    EnginePtr e = engine("prefill");
    std::string full = address(e.get());

    // Asking with no buffer at all.
    std::size_t n = 12345;
    EXPECT_TRUE(fails_with(KVXFER_ERR_BUFFER_TOO_SMALL,
                           kvxfer_engine_address(e.get(), nullptr, 0, &n)));
    EXPECT_EQ(n, full.size());

    // One byte short: the address fits but its NUL does not.
    std::vector<char> buf(full.size(), 'x');
    n = 0;
    Result r = result(kvxfer_engine_address(e.get(), buf.data(), buf.size(), &n));
    EXPECT_EQ(r.status, KVXFER_ERR_BUFFER_TOO_SMALL) << r;
    EXPECT_EQ(n, full.size());
    EXPECT_TRUE(contains(r.message, std::to_string(full.size()))) << r;
    EXPECT_EQ(std::string(buf.begin(), buf.end()), std::string(full.size(), 'x'))
        << "nothing is copied when the buffer is too small";

    // Exactly enough.
    buf.assign(full.size() + 1, 'x');
    n = 0;
    EXPECT_TRUE(ok(kvxfer_engine_address(e.get(), buf.data(), buf.size(), &n)));
    EXPECT_EQ(n, full.size());
    EXPECT_EQ(std::string(buf.data()), full);
}

TEST(Engine, LogSinkReceivesLinesAtOrAboveTheConfiguredLevel) {
    LogCapture debug_log;
    Memory mem(2, 4, 4096);
    {
        ConfigPtr c = config("prefill", {{"log_level", "debug"}});
        ASSERT_TRUE(ok(kvxfer_config_set_log_sink(c.get(), &LogCapture::sink, &debug_log)));
        EnginePtr e = new_engine(c.get());
        ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), mem.data(), mem.size())));
        ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 7, nullptr, 1)));
        EXPECT_TRUE(debug_log.has(KVXFER_LOG_INFO, {"listening on", address(e.get())}))
            << debug_log.dump();
        EXPECT_TRUE(debug_log.has(KVXFER_LOG_DEBUG, {"room 7 created"})) << debug_log.dump();
    }

    // At the default level (warn) neither the start nor the room creation is passed.
    LogCapture warn_log;
    {
        ConfigPtr c = config("prefill");
        ASSERT_TRUE(ok(kvxfer_config_set_log_sink(c.get(), &LogCapture::sink, &warn_log)));
        EnginePtr e = new_engine(c.get());
        ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), mem.data(), mem.size())));
        ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 7, nullptr, 1)));
        EXPECT_TRUE(warn_log.lines().empty()) << warn_log.dump();
        // A room failing is a warning, so it is passed.
        ASSERT_TRUE(ok(kvxfer_room_abort(e.get(), 7, "client went away")));
        EXPECT_TRUE(warn_log.has(KVXFER_LOG_WARN, {"room 7", "client went away"}))
            << warn_log.dump();
    }
}

TEST(Engine, FreeFailsLiveRoomsWithEngineShutDown) {
    // The room cannot be polled once its engine is gone, so the engine's own log is the
    // witness: the shutdown fails the live room with "engine shut down".
    LogCapture log;
    SilentPeer silent; // outlives the engine
    Memory mem(2, 4, 4096);
    Peers peers({silent.address()});
    {
        ConfigPtr c = config("decode");
        ASSERT_TRUE(ok(kvxfer_config_set_log_sink(c.get(), &LogCapture::sink, &log)));
        EnginePtr e = new_engine(c.get());
        ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), mem.data(), mem.size())));
        ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 42, peers.ptrs.data(), 1)));
        ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 43, peers.ptrs.data(), 1)));
        ASSERT_TRUE(ok(kvxfer_room_abort(e.get(), 43, "done with it")));
        EXPECT_EQ(poll(e.get(), 42), KVXFER_ROOM_BOOTSTRAPPING);
    }
    EXPECT_TRUE(log.has(KVXFER_LOG_WARN, {"room 42", "engine shut down"})) << log.dump();
    // Room 43 was already terminal: its abort is its only line; shutdown leaves it be.
    int room43_lines = 0;
    for (const auto &l : log.lines()) {
        room43_lines += contains(l.second, "room 43") ? 1 : 0;
    }
    EXPECT_EQ(room43_lines, 1) << log.dump();
}

TEST(Engine, FreeingAPrefillEngineFailsTheDecodeSideOfItsRooms) {
    // A second engine shows what the peer sees: its room becomes FAILED, told either by
    // the Abort the stopping engine sends ("peer: engine shut down") or by the closed
    // connection (peer lost), whichever arrives first.
    Memory pmem(2, 8, 4096);
    Memory dmem(2, 8, 4096);
    EnginePtr d = engine("decode");
    ASSERT_TRUE(ok(kvxfer_register_kv(d.get(), dmem.data(), dmem.size())));
    EnginePtr p = engine("prefill");
    ASSERT_TRUE(ok(kvxfer_register_kv(p.get(), pmem.data(), pmem.size())));
    Peers peers({address(p.get())});
    ASSERT_TRUE(ok(kvxfer_room_create(p.get(), 5, nullptr, 1)));
    ASSERT_TRUE(ok(kvxfer_room_create(d.get(), 5, peers.ptrs.data(), 1)));
    std::vector<uint32_t> pages = {0, 1, 2};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d.get(), 5, pages.data(), pages.size(), -1)));
    // Both sides are connected and waiting for the prefill's chunks.
    ASSERT_EQ(wait_for(p.get(), 5, [](kvxfer_room_state s) { return s != KVXFER_ROOM_BOOTSTRAPPING; }),
              KVXFER_ROOM_WAITING_FOR_INPUT);
    ASSERT_EQ(wait_for(d.get(), 5, [](kvxfer_room_state s) { return s != KVXFER_ROOM_BOOTSTRAPPING; }),
              KVXFER_ROOM_WAITING_FOR_INPUT);

    p.reset();
    ASSERT_EQ(wait_terminal(d.get(), 5), KVXFER_ROOM_FAILED);
    Cause c = cause_of(d.get(), 5);
    std::string why = failure(d.get(), 5);
    if (c.cause == KVXFER_CAUSE_ABORTED) {
        EXPECT_TRUE(c.from_peer) << why;
        EXPECT_EQ(why, "peer: engine shut down");
    } else {
        EXPECT_EQ(c.cause, KVXFER_CAUSE_PEER_LOST) << why;
        EXPECT_TRUE(contains(why, "lost prefill " + peers.addrs[0])) << why;
    }
    // Drained in bounded time: over TCP at once; over RDMA once the stopping engine's
    // queue pairs are known quiet (its acknowledgement, or the closed connection), which
    // may come just after the Abort that failed the room.
    bool drained = false;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ok(kvxfer_room_drained(d.get(), 5, &drained)) && !drained &&
           std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_TRUE(drained);
}

TEST(Engine, ManyEnginesStartAndStopCleanly) {
    for (int i = 0; i < 20; ++i) {
        EnginePtr e = engine(i % 2 ? "prefill" : "decode");
        ASSERT_NE(e.get(), nullptr);
    }
}

// --- the same through kvxfer.hpp ---------------------------------------------------

TEST(EngineHpp, AddressMatchesTheCAbi) {
    kvxfer::Config c;
    c.set("role", "prefill");
    kvxfer::Engine e(c);
    std::string a = e.address();
    EXPECT_EQ(a, address(e.get()));
    EXPECT_GT(split_address(a).second, 0);
}

TEST(EngineHpp, EnginesAreMovableAndFreeOnce) {
    kvxfer::Config c;
    c.set("role", "decode");
    kvxfer::Engine a(c);
    kvxfer_engine *raw = a.get();
    kvxfer::Engine b(std::move(a));
    EXPECT_EQ(b.get(), raw);
    EXPECT_EQ(a.get(), nullptr); // NOLINT(bugprone-use-after-move): moved-from is empty
}

TEST(EngineHpp, LogSinkThroughTheWrapper) {
    LogCapture log;
    Memory mem(1, 4, 4096);
    {
        kvxfer::Config c;
        c.set("role", "prefill").set("log_level", "debug").set_log_sink(&LogCapture::sink, &log);
        kvxfer::Engine e(c);
        e.register_kv(mem.buffers());
        e.create_prefill_room(11);
        EXPECT_EQ(e.poll(11), kvxfer::RoomState::Bootstrapping);
    }
    EXPECT_TRUE(log.has(KVXFER_LOG_DEBUG, {"room 11 created"})) << log.dump();
    EXPECT_TRUE(log.has(KVXFER_LOG_WARN, {"room 11", "engine shut down"})) << log.dump();
    EXPECT_TRUE(log.has(KVXFER_LOG_INFO, {"stopped"})) << log.dump();
}

// --- a log sink the library owns (kvxfer_config_set_log_sink2) -----------------------

namespace {

/// A log context that counts its calls, its release, and any call after the release.
struct OwnedLog {
    std::atomic<int> calls{0};
    std::atomic<int> drops{0};
    std::atomic<int> calls_after_drop{0};
    std::mutex mu;
    std::thread::id dropped_on;

    static void sink(void *ctx, kvxfer_log_level, const char *) {
        auto *self = static_cast<OwnedLog *>(ctx);
        if (self->drops.load() > 0) {
            self->calls_after_drop++;
        }
        self->calls++;
    }
    static void drop(void *ctx) {
        auto *self = static_cast<OwnedLog *>(ctx);
        {
            std::lock_guard<std::mutex> g(self->mu);
            self->dropped_on = std::this_thread::get_id();
        }
        self->drops++;
    }
    std::thread::id drop_thread() {
        std::lock_guard<std::mutex> g(mu);
        return dropped_on;
    }
};

} // namespace

TEST(Engine, AnOwnedSinkIsReleasedOnceAfterTheLastEngineAndItsLastLine) {
    OwnedLog log;
    ConfigPtr c = config("prefill", {{"log_level", "info"}});
    ASSERT_TRUE(ok(kvxfer_config_set_log_sink2(c.get(), &OwnedLog::sink, &log, &OwnedLog::drop)));
    EnginePtr a = new_engine(c.get());
    EnginePtr b = new_engine(c.get());
    c.reset();
    EXPECT_EQ(log.drops.load(), 0) << "two engines still use the sink";
    int started = log.calls.load();
    EXPECT_GT(started, 0) << "the engines log their start at info";
    a.reset();
    EXPECT_EQ(log.drops.load(), 0) << "one engine still uses the sink";
    EXPECT_GT(log.calls.load(), started) << "the freed engine logged that it stopped";
    b.reset();
    EXPECT_EQ(log.drops.load(), 1);
    EXPECT_EQ(log.calls_after_drop.load(), 0);
    EXPECT_EQ(log.drop_thread(), std::this_thread::get_id())
        << "drop runs in the kvxfer_engine_free that released the last use";
}

TEST(Engine, AnOwnedSinkReplacedOrUnusedIsReleasedByTheConfig) {
    OwnedLog first, second, none;
    ConfigPtr c = config("prefill");
    ASSERT_TRUE(ok(kvxfer_config_set_log_sink2(c.get(), &OwnedLog::sink, &first, &OwnedLog::drop)));
    ASSERT_TRUE(
        ok(kvxfer_config_set_log_sink2(c.get(), &OwnedLog::sink, &second, &OwnedLog::drop)));
    EXPECT_EQ(first.drops.load(), 1) << "no engine used the replaced sink";
    EXPECT_EQ(second.drops.load(), 0);
    c.reset();
    EXPECT_EQ(second.drops.load(), 1);
    // A NULL sink keeps nothing: its context is released at once.
    c = new_config();
    ASSERT_TRUE(ok(kvxfer_config_set_log_sink2(c.get(), nullptr, &none, &OwnedLog::drop)));
    EXPECT_EQ(none.drops.load(), 1);
    // A NULL drop releases nothing, as with kvxfer_config_set_log_sink.
    ASSERT_TRUE(ok(kvxfer_config_set_log_sink2(c.get(), &OwnedLog::sink, &first, nullptr)));
    c.reset();
    EXPECT_EQ(first.drops.load(), 1);
    EXPECT_EQ(first.calls.load() + second.calls.load() + none.calls.load(), 0);
}

TEST(Engine, AnOwnedSinkOnANullConfigStaysTheCallers) {
    OwnedLog log;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_config_set_log_sink2(nullptr, &OwnedLog::sink, &log,
                                                       &OwnedLog::drop)));
    EXPECT_EQ(log.drops.load(), 0);
}

TEST(EngineHpp, AStdFunctionSinkGetsTheLinesAndIsDestroyedAfterTheLastEngine) {
    struct Lines {
        std::mutex mu;
        std::vector<std::pair<kvxfer::LogLevel, std::string>> lines;
    };
    auto seen = std::make_shared<Lines>();
    {
        kvxfer::Engine e = [&] {
            kvxfer::Config c;
            c.set("role", "prefill").set("log_level", "info");
            c.set_log_sink([seen](kvxfer::LogLevel level, std::string_view line) {
                std::lock_guard<std::mutex> g(seen->mu);
                seen->lines.emplace_back(level, std::string(line));
            });
            return kvxfer::Engine(c);
        }();
        EXPECT_GT(seen.use_count(), 1) << "the config is gone, the engine keeps the sink";
    }
    EXPECT_EQ(seen.use_count(), 1) << "the library destroyed its copy of the sink";
    bool stopped = false;
    for (const auto &l : seen->lines) {
        stopped = stopped || (l.first == kvxfer::LogLevel::Info && contains(l.second, "stopped"));
    }
    EXPECT_TRUE(stopped);
}

TEST(EngineHpp, AReplacedStdFunctionSinkIsDestroyedAtOnce) {
    auto token = std::make_shared<int>(0);
    kvxfer::Config c;
    c.set_log_sink([token](kvxfer::LogLevel, std::string_view) {});
    EXPECT_EQ(token.use_count(), 2);
    c.set_log_sink(nullptr); // stderr again
    EXPECT_EQ(token.use_count(), 1);
}

TEST(EngineHpp, AThrowingSinkLosesItsLinesNotTheProcess) {
    auto calls = std::make_shared<std::atomic<int>>(0);
    {
        kvxfer::Config c;
        c.set("role", "prefill").set("log_level", "info");
        c.set_log_sink([calls](kvxfer::LogLevel, std::string_view) {
            ++*calls;
            throw std::runtime_error("a sink that throws");
        });
        kvxfer::Engine e(c);
        EXPECT_FALSE(e.address().empty());
    }
    EXPECT_GE(calls->load(), 2) << "start and stop were logged, each call threw";
}

// --- register_kv_layers and the named room factories ---------------------------------

TEST(EngineHpp, RegisterKvLayersPassesTheLayerIdsAndChecksTheLengths) {
    Memory mem(2, 4, 4096);
    kvxfer::Config c;
    c.set("role", "prefill");
    kvxfer::Engine e(c);
    try {
        e.register_kv_layers(mem.buffers(), {0});
        FAIL() << "two buffers with one layer id were taken";
    } catch (const kvxfer::Error &err) {
        EXPECT_EQ(err.status(), kvxfer::Status::InvalidArgument);
        EXPECT_TRUE(contains(err.message(), "2 buffers but 1 layer ids")) << err.what();
    }
    try {
        e.register_kv_layers(mem.buffers(), {0, 0x80000000u});
        FAIL() << "a layer id above INT32_MAX was taken";
    } catch (const kvxfer::Error &err) {
        EXPECT_EQ(err.status(), kvxfer::Status::InvalidArgument) << err.what();
    }
    e.register_kv_layers(mem.buffers(), {7, 7});
    try {
        e.register_kv(mem.buffers());
        FAIL() << "registered twice";
    } catch (const kvxfer::Error &err) {
        EXPECT_EQ(err.status(), kvxfer::Status::WrongState) << err.what();
    }
}

TEST(EngineHpp, NamedRoomFactoriesCreateEachRolesRoomsAndRefuseTheOther) {
    SilentPeer silent;
    Memory mem(1, 4, 4096);
    kvxfer::Config pc, dc;
    pc.set("role", "prefill").set("transport", test_transport());
    dc.set("role", "decode").set("transport", test_transport());
    kvxfer::Engine prefill(pc), decode(dc);
    prefill.register_kv(mem.buffers());
    decode.register_kv(mem.buffers());
    prefill.create_prefill_room(1);
    prefill.create_prefill_room(2, 3);
    decode.create_decode_room(1, {silent.address()});
    EXPECT_EQ(prefill.poll(1), kvxfer::RoomState::Bootstrapping);
    EXPECT_EQ(prefill.poll(2), kvxfer::RoomState::Bootstrapping);
    EXPECT_EQ(decode.poll(1), kvxfer::RoomState::Bootstrapping);

    auto status_of = [](const std::function<void()> &f) {
        try {
            f();
        } catch (const kvxfer::Error &err) {
            return std::make_pair(err.status(), err.message());
        }
        return std::make_pair(kvxfer::Status::Ok, std::string());
    };
    auto r = status_of([&] { prefill.create_decode_room(3, {silent.address()}); });
    EXPECT_EQ(r.first, kvxfer::Status::InvalidArgument) << r.second;
    EXPECT_TRUE(contains(r.second, "prefill room takes no peer addresses")) << r.second;
    r = status_of([&] { decode.create_prefill_room(3); });
    EXPECT_EQ(r.first, kvxfer::Status::NullPointer) << r.second;
    EXPECT_TRUE(contains(r.second, "decode room needs the addresses")) << r.second;
    r = status_of([&] { decode.create_decode_room(3, {}); });
    EXPECT_EQ(r.first, kvxfer::Status::InvalidArgument) << r.second;
    EXPECT_TRUE(contains(r.second, "not 0")) << r.second;
}
