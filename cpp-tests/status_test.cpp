// Status names, the per-thread last error, fixed numeric values and the version.
#include "kvxfer.hpp"
#include "support.hpp"

#include <cstdio>
#include <cstring>

using namespace kvtest;

// The values are part of the ABI: never renumbered (DESIGN.md, section 2 and 5).
static_assert(KVXFER_OK == 0, "KVXFER_OK is zero");
static_assert(KVXFER_ERR_INVALID_ARGUMENT == 1 && KVXFER_ERR_NULL_POINTER == 2 &&
                  KVXFER_ERR_NOT_FOUND == 3 && KVXFER_ERR_ALREADY_EXISTS == 4 &&
                  KVXFER_ERR_WRONG_ROLE == 5 && KVXFER_ERR_WRONG_STATE == 6 &&
                  KVXFER_ERR_UNSUPPORTED == 7 && KVXFER_ERR_BUFFER_TOO_SMALL == 8 &&
                  KVXFER_ERR_UNKNOWN_KEY == 9 && KVXFER_ERR_BAD_VALUE == 10 &&
                  KVXFER_ERR_TRANSPORT_UNAVAILABLE == 11 && KVXFER_ERR_IO == 12 &&
                  KVXFER_ERR_PANIC == 13,
              "status values are fixed");
static_assert(KVXFER_ROOM_FAILED == 0 && KVXFER_ROOM_BOOTSTRAPPING == 1 &&
                  KVXFER_ROOM_WAITING_FOR_INPUT == 2 && KVXFER_ROOM_TRANSFERRING == 3 &&
                  KVXFER_ROOM_SUCCESS == 4,
              "room states keep the reference design's values (MIN-reducible)");
static_assert(static_cast<int>(kvxfer::RoomState::Failed) == 0 &&
                  static_cast<int>(kvxfer::RoomState::Bootstrapping) == 1 &&
                  static_cast<int>(kvxfer::RoomState::WaitingForInput) == 2 &&
                  static_cast<int>(kvxfer::RoomState::Transferring) == 3 &&
                  static_cast<int>(kvxfer::RoomState::Success) == 4,
              "kvxfer::RoomState mirrors kvxfer_room_state");
static_assert(KVXFER_CAUSE_ABORTED == 1 && KVXFER_CAUSE_INTERNAL == 10 &&
                  static_cast<int>(kvxfer::FailureCause::Aborted) == 1 &&
                  static_cast<int>(kvxfer::FailureCause::Shutdown) == 9 &&
                  static_cast<int>(kvxfer::FailureCause::Internal) == 10,
              "failure causes are fixed");
static_assert(sizeof(kvxfer_status) == 4, "kvxfer_status is 32 bits in C++ too");
static_assert(static_cast<int>(kvxfer::Status::Ok) == KVXFER_OK &&
                  static_cast<int>(kvxfer::Status::NotFound) == KVXFER_ERR_NOT_FOUND &&
                  static_cast<int>(kvxfer::Status::Panic) == KVXFER_ERR_PANIC,
              "kvxfer::Status mirrors kvxfer_status");
static_assert(static_cast<int>(kvxfer::LogLevel::Error) == KVXFER_LOG_ERROR &&
                  static_cast<int>(kvxfer::LogLevel::Trace) == KVXFER_LOG_TRACE,
              "kvxfer::LogLevel mirrors kvxfer_log_level");
static_assert(KVXFER_ROOM_STATES == 5 &&
                  sizeof(kvxfer_metrics{}.rooms_by_state) == KVXFER_ROOM_STATES * sizeof(uint64_t),
              "rooms_by_state has one entry per state");
static_assert(KVXFER_METRICS_CAUSES > KVXFER_CAUSE_INTEGRITY &&
                  sizeof(kvxfer_metrics{}.rooms_failed_by_cause) ==
                      KVXFER_METRICS_CAUSES * sizeof(uint64_t),
              "rooms_failed_by_cause has an entry for every cause value");

TEST(Status, StatusStrNamesEveryStatus) {
    const std::pair<kvxfer_status, const char *> names[] = {
        {KVXFER_OK, "KVXFER_OK"},
        {KVXFER_ERR_INVALID_ARGUMENT, "KVXFER_ERR_INVALID_ARGUMENT"},
        {KVXFER_ERR_NULL_POINTER, "KVXFER_ERR_NULL_POINTER"},
        {KVXFER_ERR_NOT_FOUND, "KVXFER_ERR_NOT_FOUND"},
        {KVXFER_ERR_ALREADY_EXISTS, "KVXFER_ERR_ALREADY_EXISTS"},
        {KVXFER_ERR_WRONG_ROLE, "KVXFER_ERR_WRONG_ROLE"},
        {KVXFER_ERR_WRONG_STATE, "KVXFER_ERR_WRONG_STATE"},
        {KVXFER_ERR_UNSUPPORTED, "KVXFER_ERR_UNSUPPORTED"},
        {KVXFER_ERR_BUFFER_TOO_SMALL, "KVXFER_ERR_BUFFER_TOO_SMALL"},
        {KVXFER_ERR_UNKNOWN_KEY, "KVXFER_ERR_UNKNOWN_KEY"},
        {KVXFER_ERR_BAD_VALUE, "KVXFER_ERR_BAD_VALUE"},
        {KVXFER_ERR_TRANSPORT_UNAVAILABLE, "KVXFER_ERR_TRANSPORT_UNAVAILABLE"},
        {KVXFER_ERR_IO, "KVXFER_ERR_IO"},
        {KVXFER_ERR_PANIC, "KVXFER_ERR_PANIC"},
    };
    for (const auto &n : names) {
        const char *s = kvxfer_status_str(n.first);
        ASSERT_NE(s, nullptr);
        EXPECT_STREQ(s, n.second);
        EXPECT_STREQ(kvxfer::status_name(n.first), n.second);
    }
    for (int32_t unknown : {-1, 14, 99, INT32_MIN, INT32_MAX}) {
        EXPECT_STREQ(kvxfer_status_str(unknown), "KVXFER_UNKNOWN_STATUS") << unknown;
    }
}

TEST(Status, LastErrorIsPerThreadAndClearedBySuccess) {
    ConfigPtr c = new_config();
    EXPECT_TRUE(fails_with(KVXFER_ERR_UNKNOWN_KEY, kvxfer_config_set(c.get(), "nope", "1")));
    std::string here = last_error();
    ASSERT_FALSE(here.empty());

    // Another thread has its own (empty) message and its failures do not touch ours.
    std::string there_before, there_after;
    std::thread t([&] {
        there_before = last_error();
        kvxfer_status st = kvxfer_config_set(c.get(), "role", "neither");
        (void)st;
        there_after = last_error();
    });
    t.join();
    EXPECT_EQ(there_before, "");
    EXPECT_TRUE(contains(there_after, "'role'")) << there_after;
    EXPECT_EQ(last_error(), here);

    // Reading a status name does not change it; a success empties it.
    (void)kvxfer_status_str(KVXFER_ERR_IO);
    EXPECT_EQ(last_error(), here);
    EXPECT_TRUE(ok(kvxfer_config_set(c.get(), "workers", "2")));
    EXPECT_EQ(kvxfer_last_error(nullptr, 0), 0u);
}

TEST(Status, LastErrorTruncatesLikeSnprintfAndReturnsTheFullLength) {
    ConfigPtr c = new_config();
    kvxfer_status st = kvxfer_config_set(c.get(), "wrokers", "2");
    ASSERT_EQ(st, KVXFER_ERR_UNKNOWN_KEY);
    std::string full = last_error();
    ASSERT_GT(full.size(), 8u);
    char buf[8];
    std::memset(buf, 'x', sizeof buf);
    EXPECT_EQ(kvxfer_last_error(buf, sizeof buf), full.size());
    EXPECT_EQ(std::string(buf), full.substr(0, 7));
    // A zero-length buffer is not written.
    buf[0] = 'q';
    EXPECT_EQ(kvxfer_last_error(buf, 0), full.size());
    EXPECT_EQ(buf[0], 'q');
}

TEST(Version, LibraryVersionEqualsTheHeaderMacros) {
    ASSERT_NE(kvxfer_version(), nullptr);
    EXPECT_STREQ(kvxfer_version(), KVXFER_VERSION);
    char parts[64];
    std::snprintf(parts, sizeof parts, "%d.%d.%d", KVXFER_VERSION_MAJOR, KVXFER_VERSION_MINOR,
                  KVXFER_VERSION_PATCH);
    EXPECT_STREQ(KVXFER_VERSION, parts);
    EXPECT_EQ(kvxfer::version(), KVXFER_VERSION);
}

TEST(Version, CMakeReadTheSameVersionFromCargoToml) {
    // KVXFER_CMAKE_VERSION is PROJECT_VERSION, which CMakeLists.txt parsed from
    // Cargo.toml; the header's macro comes from cargo itself.
    EXPECT_STREQ(KVXFER_CMAKE_VERSION, KVXFER_VERSION);
}

TEST(Hpp, LastErrorAndCheckAgreeWithTheCAbi) {
    EXPECT_NO_THROW(kvxfer::check(KVXFER_OK));
    ConfigPtr c = new_config();
    kvxfer_status st = kvxfer_config_set(c.get(), "transport", "carrier-pigeon");
    std::string msg = kvxfer::last_error();
    EXPECT_EQ(msg, last_error());
    try {
        kvxfer::check(st);
        FAIL() << "check did not throw";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_BAD_VALUE);
        EXPECT_EQ(e.message(), msg);
        EXPECT_EQ(std::string(e.what()), "KVXFER_ERR_BAD_VALUE: " + msg);
    }
}

TEST(Status, RoomStateAndCauseNamesAreTheirCConstants) {
    const std::pair<int32_t, const char *> states[] = {
        {KVXFER_ROOM_FAILED, "KVXFER_ROOM_FAILED"},
        {KVXFER_ROOM_BOOTSTRAPPING, "KVXFER_ROOM_BOOTSTRAPPING"},
        {KVXFER_ROOM_WAITING_FOR_INPUT, "KVXFER_ROOM_WAITING_FOR_INPUT"},
        {KVXFER_ROOM_TRANSFERRING, "KVXFER_ROOM_TRANSFERRING"},
        {KVXFER_ROOM_SUCCESS, "KVXFER_ROOM_SUCCESS"},
    };
    for (const auto &s : states) {
        EXPECT_STREQ(kvxfer_room_state_str(s.first), s.second);
    }
    const std::pair<int32_t, const char *> causes[] = {
        {KVXFER_CAUSE_ABORTED, "KVXFER_CAUSE_ABORTED"},
        {KVXFER_CAUSE_PEER_LOST, "KVXFER_CAUSE_PEER_LOST"},
        {KVXFER_CAUSE_BOOTSTRAP_TIMEOUT, "KVXFER_CAUSE_BOOTSTRAP_TIMEOUT"},
        {KVXFER_CAUSE_WAITING_TIMEOUT, "KVXFER_CAUSE_WAITING_TIMEOUT"},
        {KVXFER_CAUSE_TRANSFER_TIMEOUT, "KVXFER_CAUSE_TRANSFER_TIMEOUT"},
        {KVXFER_CAUSE_PROTOCOL, "KVXFER_CAUSE_PROTOCOL"},
        {KVXFER_CAUSE_MISMATCH, "KVXFER_CAUSE_MISMATCH"},
        {KVXFER_CAUSE_TRANSFER, "KVXFER_CAUSE_TRANSFER"},
        {KVXFER_CAUSE_SHUTDOWN, "KVXFER_CAUSE_SHUTDOWN"},
        {KVXFER_CAUSE_INTERNAL, "KVXFER_CAUSE_INTERNAL"},
        {KVXFER_CAUSE_INTEGRITY, "KVXFER_CAUSE_INTEGRITY"},
    };
    for (const auto &c : causes) {
        EXPECT_STREQ(kvxfer_failure_cause_str(c.first), c.second);
    }
    for (int32_t unknown : {-1, 5, INT32_MIN, INT32_MAX}) {
        EXPECT_STREQ(kvxfer_room_state_str(unknown), "KVXFER_UNKNOWN_ROOM_STATE") << unknown;
    }
    for (int32_t unknown : {-1, 0, 12, KVXFER_METRICS_CAUSES}) {
        EXPECT_STREQ(kvxfer_failure_cause_str(unknown), "KVXFER_UNKNOWN_CAUSE") << unknown;
    }
}

TEST(Hpp, NamesComeFromTheCTables) {
    EXPECT_STREQ(kvxfer::to_string(kvxfer::RoomState::Success), "SUCCESS");
    EXPECT_EQ(kvxfer::to_string(kvxfer::RoomState::Transferring),
              kvxfer_room_state_str(KVXFER_ROOM_TRANSFERRING) + std::strlen("KVXFER_ROOM_"))
        << "the same static string, past its prefix";
    EXPECT_STREQ(kvxfer::to_string(static_cast<kvxfer::RoomState>(9)),
                 "KVXFER_UNKNOWN_ROOM_STATE");
    EXPECT_STREQ(kvxfer::to_string(kvxfer::FailureCause::Internal), "INTERNAL");
    EXPECT_STREQ(kvxfer::to_string(static_cast<kvxfer::FailureCause>(0)), "KVXFER_UNKNOWN_CAUSE");
    EXPECT_STREQ(kvxfer::to_string(kvxfer::Status::BadValue), "KVXFER_ERR_BAD_VALUE");
    kvxfer::Error e(KVXFER_ERR_WRONG_ROLE, "m");
    EXPECT_EQ(e.status(), kvxfer::Status::WrongRole);
    EXPECT_EQ(e.code(), KVXFER_ERR_WRONG_ROLE);
}

TEST(Hpp, EnumNamesMatchTheCNames) {
    EXPECT_STREQ(kvxfer::to_string(kvxfer::RoomState::WaitingForInput), "WAITING_FOR_INPUT");
    EXPECT_STREQ(kvxfer::to_string(kvxfer::FailureCause::BootstrapTimeout), "BOOTSTRAP_TIMEOUT");
    EXPECT_TRUE(kvxfer::is_terminal(kvxfer::RoomState::Success));
    EXPECT_TRUE(kvxfer::is_terminal(kvxfer::RoomState::Failed));
    EXPECT_FALSE(kvxfer::is_terminal(kvxfer::RoomState::Transferring));
}
