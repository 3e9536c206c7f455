// Authentication through the C ABI: the config keys auth, auth_key_file and auth_key
// (good values, and every error a host can meet, each naming what is wrong), the engine
// refusing auth=required without a key, and two engines that share a key or do not.
#include "kvxfer.hpp"
#include "support.hpp"

#include <sys/stat.h>

#include <cstddef>
#include <cstdio>

using namespace kvtest;

namespace {

const char kKeyHex[] = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
const char kOtherHex[] = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

// A temporary file holding `bytes` bytes, with mode `mode`; removed on destruction.
class KeyFile {
  public:
    KeyFile(std::size_t bytes, mode_t mode) {
        char tmpl[] = "/tmp/kvxfer-auth-test-XXXXXX";
        int fd = ::mkstemp(tmpl);
        EXPECT_GE(fd, 0);
        path_ = tmpl;
        std::vector<unsigned char> data(bytes);
        for (std::size_t i = 0; i < bytes; ++i) {
            data[i] = static_cast<unsigned char>(i * 37 + 11);
        }
        EXPECT_EQ(::write(fd, data.data(), data.size()), static_cast<ssize_t>(data.size()));
        ::close(fd);
        EXPECT_EQ(::chmod(tmpl, mode), 0);
    }
    ~KeyFile() { std::remove(path_.c_str()); }
    KeyFile(const KeyFile &) = delete;
    KeyFile &operator=(const KeyFile &) = delete;
    const std::string &path() const { return path_; }

  private:
    std::string path_;
};

} // namespace

TEST(ConfigAuth, AuthTakesAutoRequiredOrOffAndNamesABadValue) {
    ConfigPtr c = new_config();
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "auth", "off")));
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "auth", "required")));
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "auth", "auto")));
    for (const char *bad : {"on", "Required", "yes", ""}) {
        Result r = result(kvxfer_config_set(c.get(), "auth", bad));
        EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << bad << ": " << r;
        EXPECT_TRUE(contains(r.message, "'auth'")) << r;
        EXPECT_TRUE(contains(r.message, "'required' or 'off'")) << r;
    }
}

TEST(ConfigAuth, AKeyFileReadableByGroupOrOthersIsRefusedNamingPathAndMode) {
    for (mode_t mode : {0644, 0640, 0604, 0660, 0606}) {
        KeyFile f(32, mode);
        ConfigPtr c = new_config();
        Result r = result(kvxfer_config_set(c.get(), "auth_key_file", f.path().c_str()));
        EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
        char shown[8];
        std::snprintf(shown, sizeof shown, "%04o", static_cast<unsigned>(mode));
        EXPECT_TRUE(contains(r.message, "'auth_key_file'")) << r;
        EXPECT_TRUE(contains(r.message, f.path())) << r;
        EXPECT_TRUE(contains(r.message, shown)) << r;
        EXPECT_TRUE(contains(r.message, "only by its owner")) << r;
    }
    for (mode_t mode : {0600, 0400}) {
        KeyFile f(32, mode);
        ConfigPtr c = new_config();
        EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "auth_key_file", f.path().c_str())));
    }
}

TEST(ConfigAuth, AShortMissingOrNonRegularKeyFileIsRefusedNamingThePath) {
    KeyFile shorter(31, 0600);
    ConfigPtr c = new_config();
    Result r = result(kvxfer_config_set(c.get(), "auth_key_file", shorter.path().c_str()));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, shorter.path())) << r;
    EXPECT_TRUE(contains(r.message, "at least 32")) << r;

    r = result(kvxfer_config_set(c.get(), "auth_key_file", "/nonexistent/kvxfer.key"));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "/nonexistent/kvxfer.key")) << r;

    r = result(kvxfer_config_set(c.get(), "auth_key_file", "/tmp"));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "not a regular file")) << r;
}

TEST(ConfigAuth, AHexKeyIsCheckedAndNeverRepeatedInTheMessage) {
    ConfigPtr c = new_config();
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "auth_key", kKeyHex)));
    const std::string full(kKeyHex);
    const std::string bad[] = {
        full.substr(0, 62),                 // 31 bytes
        full.substr(0, 63),                 // odd number of digits
        full.substr(0, 60) + "zzzz",        // not hexadecimal
    };
    for (const std::string &v : bad) {
        Result r = result(kvxfer_config_set(c.get(), "auth_key", v.c_str()));
        EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
        EXPECT_TRUE(contains(r.message, "'auth_key'")) << r;
        EXPECT_FALSE(contains(r.message, v.substr(0, 16))) << "the key leaked: " << r;
    }
}

// TLS through the C ABI: the three tls_* keys go together, and encrypt_data needs them;
// kvxfer_engine_new names what is missing or unreadable (tests/tls.rs runs TLS engines).
TEST(ConfigTls, APartialTlsConfigurationFailsEngineNewNamingTheMissingKeys) {
    ConfigPtr c = config("prefill", {{"tls_cert_file", "/nonexistent/engine.pem"}});
    kvxfer_engine *e = nullptr;
    Result r = result(kvxfer_engine_new(c.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "'tls_key_file' and 'tls_ca_file' missing")) << r;
    EXPECT_EQ(e, nullptr);
    ConfigPtr all = config("prefill", {{"tls_cert_file", "/nonexistent/engine.pem"},
                                       {"tls_key_file", "/nonexistent/engine.key"},
                                       {"tls_ca_file", "/nonexistent/ca.pem"}});
    r = result(kvxfer_engine_new(all.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "/nonexistent/engine.pem")) << r;
    ConfigPtr sealed = config("prefill", {{"encrypt_data", "true"}});
    r = result(kvxfer_engine_new(sealed.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "encrypt_data")) << r;
    EXPECT_EQ(e, nullptr);
    ConfigPtr bad = config("prefill", {});
    r = result(kvxfer_config_set(bad.get(), "encrypt_data", "yes"));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
}

TEST(ConfigAuth, AuthRequiredWithoutAKeyFailsEngineNewNamingTheKeys) {
    ConfigPtr c = config("prefill", {{"auth", "required"}});
    kvxfer_engine *e = nullptr;
    Result r = result(kvxfer_engine_new(c.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "'auth'")) << r;
    EXPECT_TRUE(contains(r.message, "auth_key_file")) << r;
    EXPECT_EQ(e, nullptr);
    // auth=off with a key is allowed: the key is then unused.
    ConfigPtr off = config("prefill", {{"auth_key", kKeyHex}, {"auth", "off"}});
    EnginePtr ok_engine = new_engine(off.get());
    EXPECT_NE(ok_engine.get(), nullptr);
}

// Protected by default: without a key (or TLS), an engine keeps to loopback unless
// auth=off says otherwise.
TEST(ConfigAuth, WithoutAKeyAListenBeyondLoopbackFailsEngineNewUnlessAuthIsOff) {
    ConfigPtr c = config("prefill", {{"listen", "0.0.0.0:0"}});
    kvxfer_engine *e = nullptr;
    Result r = result(kvxfer_engine_new(c.get(), &e));
    EXPECT_EQ(r.status, KVXFER_ERR_BAD_VALUE) << r;
    EXPECT_TRUE(contains(r.message, "'listen'")) << r;
    EXPECT_TRUE(contains(r.message, "'auth'")) << r;
    EXPECT_EQ(e, nullptr);
    ConfigPtr off = config("prefill", {{"listen", "0.0.0.0:0"}, {"auth", "off"}});
    EXPECT_NE(new_engine(off.get()).get(), nullptr);
    ConfigPtr keyed = config("prefill", {{"listen", "0.0.0.0:0"}, {"auth_key", kKeyHex}});
    EXPECT_NE(new_engine(keyed.get()).get(), nullptr);
}

namespace {

// A prefill and a decode engine with the given extra keys, registered, and one room.
struct Pair {
    Pair(const std::vector<std::pair<std::string, std::string>> &p_keys,
         const std::vector<std::pair<std::string, std::string>> &d_keys)
        : pmem(2, 8, 1024), dmem(2, 8, 1024) {
        for (const kvxfer_buffer &b : dmem.buffers()) {
            std::memset(b.base, 0xEE, b.len);
        }
        p = engine("prefill", p_keys);
        d = engine("decode", d_keys);
        EXPECT_TRUE(ok(kvxfer_register_kv(p.get(), pmem.data(), pmem.size())));
        EXPECT_TRUE(ok(kvxfer_register_kv(d.get(), dmem.data(), dmem.size())));
        peers = std::make_unique<Peers>(std::vector<std::string>{address(p.get())});
        std::vector<uint32_t> src = {1, 2}, dst = {5, 6};
        EXPECT_TRUE(ok(kvxfer_room_create(p.get(), 1, nullptr, 1)));
        EXPECT_TRUE(ok(kvxfer_room_create(d.get(), 1, peers->ptrs.data(), 1)));
        // Where the engines refuse each other, the refusal may fail the decode room
        // before its destination is set: the call is then refused for the room's state
        // (the tests check the room's failure next).
        const kvxfer_status set =
            kvxfer_room_set_destination(d.get(), 1, dst.data(), dst.size(), -1);
        EXPECT_TRUE(set == KVXFER_OK || set == KVXFER_ERR_WRONG_STATE)
            << kvxfer_status_str(set) << ": " << last_error();
        // Likewise the prefill room, should its bootstrap deadline already have passed.
        const kvxfer_status enq =
            kvxfer_enqueue_chunk(p.get(), 1, src.data(), src.size(), true, -1);
        EXPECT_TRUE(enq == KVXFER_OK || enq == KVXFER_ERR_WRONG_STATE)
            << kvxfer_status_str(enq) << ": " << last_error();
    }
    bool decode_untouched() const {
        for (const kvxfer_buffer &b : dmem.buffers()) {
            const auto *x = static_cast<const unsigned char *>(b.base);
            for (std::size_t i = 0; i < b.len; ++i) {
                if (x[i] != 0xEE) {
                    return false;
                }
            }
        }
        return true;
    }
    uint64_t auth_failures(const kvxfer_engine *e) const {
        kvxfer_metrics m{};
        EXPECT_TRUE(ok(kvxfer_engine_metrics(e, &m, sizeof m)));
        return m.auth_failures;
    }
    Memory pmem, dmem; // outlive the engines
    EnginePtr p, d;
    std::unique_ptr<Peers> peers;
};

} // namespace

TEST(TransferAuth, EnginesWithOneKeyTransferAndCountNoRefusal) {
    // One side reads the key from a file, the other has the same bytes in hex.
    KeyFile f(32, 0600);
    std::string hex;
    for (std::size_t i = 0; i < 32; ++i) {
        char two[3];
        std::snprintf(two, sizeof two, "%02x", static_cast<unsigned>((i * 37 + 11) & 0xff));
        hex += two;
    }
    Pair t({{"auth_key_file", f.path()}}, {{"auth_key", hex}});
    ASSERT_EQ(wait_terminal(t.d.get(), 1), KVXFER_ROOM_SUCCESS) << failure(t.d.get(), 1);
    ASSERT_EQ(wait_terminal(t.p.get(), 1), KVXFER_ROOM_SUCCESS);
    EXPECT_FALSE(t.decode_untouched());
    EXPECT_EQ(t.auth_failures(t.p.get()), 0u);
    EXPECT_EQ(t.auth_failures(t.d.get()), 0u);
}

TEST(TransferAuth, DifferentKeysFailBothSidesNamingAuthenticationAndWriteNothing) {
    Pair t({{"auth_key", kKeyHex}, {"bootstrap_timeout_ms", "1000"}}, {{"auth_key", kOtherHex}});
    ASSERT_EQ(wait_terminal(t.d.get(), 1), KVXFER_ROOM_FAILED);
    EXPECT_EQ(cause_of(t.d.get(), 1).cause, KVXFER_CAUSE_MISMATCH);
    std::string why = failure(t.d.get(), 1);
    EXPECT_TRUE(contains(why, "authentication failed (wrong key)")) << why;
    ASSERT_EQ(wait_terminal(t.p.get(), 1), KVXFER_ROOM_FAILED);
    why = failure(t.p.get(), 1);
    EXPECT_TRUE(contains(why, "authentication")) << why;
    EXPECT_TRUE(t.decode_untouched());
    EXPECT_GE(t.auth_failures(t.p.get()), 1u);
    EXPECT_GE(t.auth_failures(t.d.get()), 1u);
    // The refusals reach the Prometheus text as well.
    char buf[16384];
    std::size_t n = 0;
    ASSERT_TRUE(ok(kvxfer_engine_metrics_text(t.p.get(), buf, sizeof buf, &n)));
    EXPECT_TRUE(contains(std::string(buf, n), "kvxfer_auth_failures_total{role=\"prefill\"}"));
}

TEST(TransferAuth, OneSideWithoutAKeyIsAMismatchNamingBothSettings) {
    Pair t({{"bootstrap_timeout_ms", "1000"}}, {{"auth_key", kKeyHex}});
    ASSERT_EQ(wait_terminal(t.d.get(), 1), KVXFER_ROOM_FAILED);
    EXPECT_EQ(cause_of(t.d.get(), 1).cause, KVXFER_CAUSE_MISMATCH);
    std::string why = failure(t.d.get(), 1);
    EXPECT_TRUE(contains(why, "auth=off")) << why;
    EXPECT_TRUE(contains(why, "auth=required")) << why;
    ASSERT_EQ(wait_terminal(t.p.get(), 1), KVXFER_ROOM_FAILED);
    why = failure(t.p.get(), 1);
    EXPECT_TRUE(contains(why, "auth=off") && contains(why, "auth=required")) << why;
    EXPECT_TRUE(t.decode_untouched());
}

TEST(TransferAuth, ACallerBuiltBeforeAuthFailuresGetsEveryEarlierField) {
    EnginePtr p = engine("prefill");
    kvxfer_metrics m{};
    std::memset(&m, 0x5a, sizeof m);
    ASSERT_TRUE(ok(kvxfer_engine_metrics(p.get(), &m, offsetof(kvxfer_metrics, auth_failures))));
    EXPECT_EQ(m.held_expired, 0u);
    EXPECT_EQ(m.auth_failures, 0x5a5a5a5a5a5a5a5aull) << "written past the given size";
    ASSERT_TRUE(ok(kvxfer_engine_metrics(p.get(), &m, sizeof m)));
    EXPECT_EQ(m.auth_failures, 0u);
}
