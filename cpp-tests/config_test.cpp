// Configuration through the C ABI and through kvxfer.hpp: every key's good and bad
// values, unknown keys, NULL arguments, and the errors engine creation reports.
#include "kvxfer.hpp"
#include "support.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace kvtest;

namespace {

struct KeyValue {
    const char *key;
    const char *value;
};

// One good value for every documented key.
const KeyValue kGood[] = {
    {"role", "decode"},
    {"listen", "127.0.0.1:0"},
    {"transport", "tcp"},
    {"workers", "8"},
    {"connections_per_peer", "3"},
    {"rdma_devices", "mlx5_0,rxe0"},
    {"rdma_slice_bytes", "65536"},
    {"rdma_queue_depth", "64"},
    {"bootstrap_timeout_ms", "100"},
    {"waiting_timeout_ms", "200"},
    {"transfer_timeout_ms", "300"},
    {"heartbeat_interval_ms", "50"},
    {"heartbeat_misses", "3"},
    {"drain_timeout_ms", "400"},
    {"log_level", "debug"},
    {"discovery", "etcd://127.0.0.1:2379,[::1]:2379"},
    {"discovery_prefix", "/kvxfer/"},
    {"instance", "prefill-a"},
    {"rank", "1"},
    {"instance_ranks", "2"},
    {"discovery_ttl_ms", "3000"},
};

// Bad values: at least one for every documented key, the range ends included.
const KeyValue kBad[] = {
    {"role", "both"},
    {"role", "Prefill"},
    {"listen", "nohost"},
    {"listen", "127.0.0.1:99999"},
    {"listen", ":80"},
    {"listen", "::1:80"},
    {"transport", "udp"},
    {"workers", "0"},
    {"workers", "257"},
    {"workers", "-1"},
    {"connections_per_peer", "0"},
    {"connections_per_peer", "65"},
    {"rdma_devices", "mlx5_0;rm -rf"},
    {"rdma_slice_bytes", "4095"},
    {"rdma_queue_depth", "4097"},
    {"bootstrap_timeout_ms", "0"},
    {"bootstrap_timeout_ms", "86400001"},
    {"waiting_timeout_ms", "-5"},
    {"transfer_timeout_ms", "ten"},
    {"heartbeat_interval_ms", "1.5"},
    {"heartbeat_misses", "0"},
    {"heartbeat_misses", "1001"},
    {"drain_timeout_ms", "0x10"},
    {"log_level", "loud"},
    {"discovery", "http://127.0.0.1:2379"},
    {"discovery_prefix", "no-slash"},
    {"instance", "a/b"},
    {"rank", "65536"},
    {"instance_ranks", "0"},
    {"discovery_ttl_ms", "1999"},
};

} // namespace

TEST(Config, EveryDocumentedKeyAcceptsAGoodValue) {
    ConfigPtr c = new_config();
    for (const KeyValue &kv : kGood) {
        EXPECT_TRUE(ok(kvxfer_config_set(c.get(), kv.key, kv.value)))
            << kv.key << "=" << kv.value;
    }
}

TEST(Config, EveryKeyRejectsBadValuesWithBadValueNamingKeyAndValue) {
    // Every key has at least one bad value in the table.
    for (const KeyValue &good : kGood) {
        bool covered = false;
        for (const KeyValue &bad : kBad) {
            covered = covered || std::string(bad.key) == good.key;
        }
        EXPECT_TRUE(covered) << "no bad value tested for " << good.key;
    }
    ConfigPtr c = new_config();
    for (const KeyValue &kv : kBad) {
        Result r = result(kvxfer_config_set(c.get(), kv.key, kv.value));
        EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << kv.key << "=" << kv.value << ": " << r;
        EXPECT_TRUE(contains(r.message, std::string("'") + kv.key + "'")) << r;
        EXPECT_TRUE(contains(r.message, kv.value)) << r;
    }
}

TEST(Config, UnknownKeyIsUnknownKeyAndNamesTheKey) {
    ConfigPtr c = new_config();
    Result r = result(kvxfer_config_set(c.get(), "wrokers", "2"));
    EXPECT_EQ(r.status, KVXFER_ERR_UNKNOWN_KEY) << r;
    EXPECT_TRUE(contains(r.message, "'wrokers'")) << r;
    // The message lists the keys that do exist.
    EXPECT_TRUE(contains(r.message, "workers")) << r;
    // Keys are case-sensitive.
    EXPECT_TRUE(fails_with(KVXFER_ERR_UNKNOWN_KEY, kvxfer_config_set(c.get(), "ROLE", "decode")));
}

TEST(Config, RejectedValueLeavesTheConfigUnchanged) {
    ConfigPtr c = config("decode");
    EXPECT_TRUE(fails_with(KVXFER_ERR_BAD_VALUE, kvxfer_config_set(c.get(), "role", "both")));
    // Still a decode engine: kvxfer_enqueue_chunk is prefill-only, so it is WRONG_ROLE.
    EnginePtr e = new_engine(c.get());
    uint32_t page = 0;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_ROLE,
                           kvxfer_enqueue_chunk(e.get(), 1, &page, 1, true, -1)));
}

TEST(Config, NullArgumentsAreNullPointerErrorsNamingTheArgument) {
    ConfigPtr c = new_config();
    Result r = result(kvxfer_config_new(nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "'out'")) << r;

    r = result(kvxfer_config_set(nullptr, "role", "decode"));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "'cfg'")) << r;

    r = result(kvxfer_config_set(c.get(), nullptr, "decode"));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "'key'")) << r;

    r = result(kvxfer_config_set(c.get(), "role", nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "'value'")) << r;

    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_config_set_log_sink(nullptr, &LogCapture::sink, nullptr)));

    kvxfer_engine *e = nullptr;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_new(nullptr, &e)));
    EXPECT_EQ(e, nullptr);
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "role", "prefill")));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_new(c.get(), nullptr)));
}

TEST(Config, ConfigFreeOfNullIsANoOp) {
    kvxfer_config_free(nullptr);
    SUCCEED();
}

TEST(Config, EngineWithoutRoleIsBadValueNamingRole) {
    ConfigPtr c = new_config();
    kvxfer_engine *e = nullptr;
    Result r = result(kvxfer_engine_new(c.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "'role'")) << r;
    EXPECT_EQ(e, nullptr) << "the output is written only on success";
}

TEST(Config, RdmaTransportWithoutADeviceIsTransportUnavailable) {
    if (rdma_device_present()) {
        GTEST_SKIP() << "this run has an RDMA device";
    }
    ConfigPtr c = config("prefill", {{"transport", "rdma"}});
    kvxfer_engine *e = nullptr;
    Result r = result(kvxfer_engine_new(c.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_TRANSPORT_UNAVAILABLE) << r;
    EXPECT_TRUE(contains(r.message, "no usable RDMA device")) << r;
    EXPECT_EQ(e, nullptr);
}

TEST(Config, AutoAndTcpTransportsStartAnEngine) {
    for (const char *t : {"auto", "tcp"}) {
        EnginePtr e = engine("prefill", {{"transport", t}});
        EXPECT_NE(e.get(), nullptr) << t;
    }
}

TEST(Config, ListenAddressAlreadyInUseIsIo) {
    // A socket of our own holds a port; the engine cannot listen on it.
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = 0;
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa), 0);
    ASSERT_EQ(::listen(fd, 1), 0);
    socklen_t len = sizeof sa;
    ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr *>(&sa), &len), 0);
    std::string listen = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));

    ConfigPtr c = config("decode", {{"listen", listen}});
    kvxfer_engine *e = nullptr;
    Result r = result(kvxfer_engine_new(c.get(), &e));
    ::close(fd);
    EXPECT_EQ(r.status, KVXFER_ERR_IO) << r;
    EXPECT_TRUE(contains(r.message, listen)) << r;
    EXPECT_EQ(e, nullptr);
}

TEST(Config, EngineKeepsWorkingAfterItsConfigIsFreed) {
    ConfigPtr c = config("prefill");
    EnginePtr e = new_engine(c.get());
    c.reset();
    EXPECT_FALSE(address(e.get()).empty());
}

// --- the same through kvxfer.hpp ---------------------------------------------------

TEST(ConfigHpp, UnknownKeyThrowsErrorWithCodeAndMessage) {
    kvxfer::Config c;
    try {
        c.set("wrokers", "2");
        FAIL() << "no exception";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_UNKNOWN_KEY);
        EXPECT_TRUE(contains(e.message(), "'wrokers'")) << e.message();
        EXPECT_EQ(std::string(e.what()), "KVXFER_ERR_UNKNOWN_KEY: " + e.message());
    }
}

TEST(ConfigHpp, BadValueThrowsBadValueAndIsARuntimeError) {
    kvxfer::Config c;
    for (const KeyValue &kv : kBad) {
        try {
            c.set(kv.key, kv.value);
            ADD_FAILURE() << kv.key << "=" << kv.value << " was accepted";
        } catch (const std::runtime_error &e) {
            const auto *err = dynamic_cast<const kvxfer::Error *>(&e);
            ASSERT_NE(err, nullptr);
            EXPECT_EQ(err->code(), KVXFER_ERR_BAD_VALUE) << e.what();
            EXPECT_TRUE(contains(err->message(), kv.key)) << e.what();
        }
    }
}

TEST(ConfigHpp, SetChainsAndGoodValuesStartAnEngine) {
    kvxfer::Config c;
    c.set("role", "decode").set("workers", "2").set("log_level", "error");
    kvxfer::Engine e(c);
    EXPECT_FALSE(e.address().empty());
}

TEST(ConfigHpp, EngineErrorsThrowTheirStatus) {
    kvxfer::Config none;
    try {
        kvxfer::Engine e(none);
        FAIL() << "an engine without a role started";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_BAD_VALUE);
        EXPECT_TRUE(contains(e.message(), "role")) << e.what();
    }
    if (rdma_device_present()) {
        return; // transport=rdma starts here
    }
    kvxfer::Config rdma;
    rdma.set("role", "prefill").set("transport", "rdma");
    try {
        kvxfer::Engine e(rdma);
        FAIL() << "an rdma engine started";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_TRANSPORT_UNAVAILABLE);
    }
}
