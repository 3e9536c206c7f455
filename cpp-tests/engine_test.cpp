// Engine lifecycle through the C ABI and kvxfer.hpp: start and stop, the listening
// address, the log sink, and what stopping does to live rooms.
#include "kvxfer.hpp"
#include "support.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

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
    bool drained = false;
    ASSERT_TRUE(ok(kvxfer_room_drained(d.get(), 5, &drained)));
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
        e.room_create(11);
        EXPECT_EQ(e.poll(11), kvxfer::RoomState::Bootstrapping);
    }
    EXPECT_TRUE(log.has(KVXFER_LOG_DEBUG, {"room 11 created"})) << log.dump();
    EXPECT_TRUE(log.has(KVXFER_LOG_WARN, {"room 11", "engine shut down"})) << log.dump();
    EXPECT_TRUE(log.has(KVXFER_LOG_INFO, {"stopped"})) << log.dump();
}
