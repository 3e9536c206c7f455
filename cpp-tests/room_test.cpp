// The room lifecycle through the C ABI and kvxfer.hpp: create, duplicate ids, abort and
// its sticky reason, clear and reuse, drained, and the bootstrap deadline.
//
// Decode rooms here pull from a SilentPeer (accepts TCP, never answers), so they stay
// BOOTSTRAPPING without racing a real handshake; prefill rooms stay BOOTSTRAPPING because
// no decode engine sends them a destination. transfer_test.cpp covers real peers.
#include "kvxfer.hpp"
#include "support.hpp"

using namespace kvtest;

namespace {

constexpr std::size_t kBuffers = 8;
constexpr std::size_t kPages = 16;
constexpr std::size_t kPageBytes = 4096;

// A prefill and a decode engine with registered KV memory.
class Rooms : public ::testing::Test {
  protected:
    void SetUp() override {
        prefill_ = engine("prefill");
        decode_ = engine("decode");
        ASSERT_TRUE(ok(kvxfer_register_kv(prefill_.get(), mem_p_.data(), mem_p_.size())));
        ASSERT_TRUE(ok(kvxfer_register_kv(decode_.get(), mem_d_.data(), mem_d_.size())));
        peer_ = std::make_unique<Peers>(std::vector<std::string>{silent_.address()});
    }

    kvxfer_status create_decode(uint64_t room) {
        return kvxfer_room_create(decode_.get(), room, peer_->ptrs.data(), peer_->ptrs.size());
    }
    kvxfer_status create_prefill(uint64_t room) {
        return kvxfer_room_create(prefill_.get(), room, nullptr, 1);
    }

    // Memory and the silent peer first: they outlive the engines (members are destroyed
    // in reverse order).
    SilentPeer silent_;
    Memory mem_p_{kBuffers, kPages, kPageBytes};
    Memory mem_d_{kBuffers, kPages, kPageBytes};
    EnginePtr prefill_;
    EnginePtr decode_;
    std::unique_ptr<Peers> peer_;
};

} // namespace

TEST_F(Rooms, CreateStartsBootstrappingOnBothSides) {
    ASSERT_TRUE(ok(create_prefill(1)));
    ASSERT_TRUE(ok(create_decode(1)));
    EXPECT_EQ(poll(prefill_.get(), 1), KVXFER_ROOM_BOOTSTRAPPING);
    EXPECT_EQ(poll(decode_.get(), 1), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Rooms, PrefillRoomTakesACountOfDecodersWhereZeroMeansOne) {
    ASSERT_TRUE(ok(kvxfer_room_create(prefill_.get(), 1, nullptr, 0)));
    ASSERT_TRUE(ok(kvxfer_room_create(prefill_.get(), 2, nullptr, 4)));
    EXPECT_EQ(poll(prefill_.get(), 1), KVXFER_ROOM_BOOTSTRAPPING);
    EXPECT_EQ(poll(prefill_.get(), 2), KVXFER_ROOM_BOOTSTRAPPING);
    Result r = result(kvxfer_room_create(prefill_.get(), 3, nullptr, 1025));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
}

TEST_F(Rooms, DecodeRoomMayPullFromSeveralPrefillEngines) {
    SilentPeer other;
    Peers two({silent_.address(), other.address()});
    ASSERT_TRUE(ok(kvxfer_room_create(decode_.get(), 9, two.ptrs.data(), two.ptrs.size())));
    EXPECT_EQ(poll(decode_.get(), 9), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Rooms, APrefillRoomBoundToDecodeEnginesTakesTheirDistinctIds) {
    uint64_t d_id = 0, p_id = 0;
    ASSERT_TRUE(ok(kvxfer_engine_id(decode_.get(), &d_id)));
    ASSERT_TRUE(ok(kvxfer_engine_id(prefill_.get(), &p_id)));
    EXPECT_NE(d_id, p_id);
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_id(decode_.get(), nullptr)));
    const uint64_t two[] = {d_id, d_id + 1};
    ASSERT_TRUE(ok(kvxfer_room_create_for(prefill_.get(), 1, two, 2)));
    EXPECT_EQ(poll(prefill_.get(), 1), KVXFER_ROOM_BOOTSTRAPPING);
    const uint64_t dup[] = {d_id, 7, d_id};
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_room_create_for(prefill_.get(), 2, dup, 3)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_room_create_for(prefill_.get(), 2, two, 0)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_create_for(prefill_.get(), 2, nullptr, 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_ALREADY_EXISTS,
                           kvxfer_room_create_for(prefill_.get(), 1, two, 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_ROLE,
                           kvxfer_room_create_for(decode_.get(), 2, &p_id, 1)));
    // Through kvxfer.hpp.
    kvxfer::Engine p(kvxfer::Config().set("role", "prefill"));
    EXPECT_NE(p.id(), p_id);
    try {
        p.create_prefill_room_for(3, {});
        FAIL() << "a room bound to no engine was created";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_INVALID_ARGUMENT);
    }
}

TEST_F(Rooms, DuplicateCreateIsAlreadyExistsWhileLiveAndAfterFailing) {
    ASSERT_TRUE(ok(create_decode(5)));
    Result r = result(create_decode(5));
    EXPECT_EQ(r.status, KVXFER_ERR_ALREADY_EXISTS) << r;
    EXPECT_TRUE(contains(r.message, "room 5")) << r;
    EXPECT_TRUE(contains(r.message, "live")) << r;

    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), 5, "x")));
    r = result(create_decode(5));
    EXPECT_EQ(r.status, KVXFER_ERR_ALREADY_EXISTS) << r;
    EXPECT_TRUE(contains(r.message, "clear")) << r;
    // The failed room is untouched by the refused create.
    EXPECT_EQ(poll(decode_.get(), 5), KVXFER_ROOM_FAILED);
}

TEST_F(Rooms, AbortFailsTheRoomWithTheCallersReason) {
    for (kvxfer_engine *e : {prefill_.get(), decode_.get()}) {
        ASSERT_TRUE(ok(e == prefill_.get() ? create_prefill(3) : create_decode(3)));
        ASSERT_TRUE(ok(kvxfer_room_abort(e, 3, "client went away")));
        EXPECT_EQ(poll(e, 3), KVXFER_ROOM_FAILED);
        EXPECT_EQ(failure(e, 3), "room 3 aborted: client went away");

        kvxfer_failure_cause cause = KVXFER_CAUSE_INTERNAL;
        bool from_peer = true;
        ASSERT_TRUE(ok(kvxfer_room_failure_cause(e, 3, &cause, &from_peer)));
        EXPECT_EQ(cause, KVXFER_CAUSE_ABORTED);
        EXPECT_FALSE(from_peer);
    }
}

TEST_F(Rooms, AbortWithoutReasonRecordsADefaultText) {
    ASSERT_TRUE(ok(create_prefill(4)));
    ASSERT_TRUE(ok(kvxfer_room_abort(prefill_.get(), 4, nullptr)));
    EXPECT_EQ(failure(prefill_.get(), 4), "room 4 aborted by the local scheduler");
}

TEST_F(Rooms, SecondAbortIsOkAndKeepsTheFirstReason) {
    ASSERT_TRUE(ok(create_decode(6)));
    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), 6, "first")));
    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), 6, "second")));
    EXPECT_EQ(poll(decode_.get(), 6), KVXFER_ROOM_FAILED);
    EXPECT_EQ(failure(decode_.get(), 6), "room 6 aborted: first");
}

TEST_F(Rooms, FailureBufferTooSmallReportsTheLengthNeeded) {
    ASSERT_TRUE(ok(create_decode(8)));
    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), 8, "a fairly long reason text")));
    std::string full = failure(decode_.get(), 8);
    char small[8];
    std::size_t n = 0;
    EXPECT_TRUE(fails_with(KVXFER_ERR_BUFFER_TOO_SMALL,
                           kvxfer_room_failure(decode_.get(), 8, small, sizeof small, &n)));
    EXPECT_EQ(n, full.size());
}

TEST_F(Rooms, UnknownRoomIsNotFoundForEveryRoomCall) {
    const uint64_t id = 999;
    kvxfer_room_state s;
    char buf[64];
    std::size_t n;
    kvxfer_failure_cause cause;
    bool b;
    for (kvxfer_engine *e : {prefill_.get(), decode_.get()}) {
        Result r = result(kvxfer_room_poll(e, id, &s));
        EXPECT_EQ(r.status, KVXFER_ERR_NOT_FOUND) << r;
        EXPECT_EQ(r.message, "room 999 not found");
        EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND, kvxfer_room_abort(e, id, "x")));
        EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND, kvxfer_room_clear(e, id)));
        EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND,
                               kvxfer_room_failure(e, id, buf, sizeof buf, &n)));
        EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND,
                               kvxfer_room_failure_cause(e, id, &cause, &b)));
    }
    EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND, kvxfer_room_drained(decode_.get(), id, &b)));
    uint32_t page = 0;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND,
                           kvxfer_room_set_destination(decode_.get(), id, &page, 1, -1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND,
                           kvxfer_enqueue_chunk(prefill_.get(), id, &page, 1, false, -1)));
}

TEST_F(Rooms, ClearReleasesTheIdForReuse) {
    ASSERT_TRUE(ok(create_prefill(12)));
    ASSERT_TRUE(ok(kvxfer_room_abort(prefill_.get(), 12, "first use")));
    ASSERT_TRUE(ok(kvxfer_room_clear(prefill_.get(), 12)));
    kvxfer_room_state s;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND, kvxfer_room_poll(prefill_.get(), 12, &s)));
    // Clearing twice: nothing left to clear.
    EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND, kvxfer_room_clear(prefill_.get(), 12)));

    // The id starts afresh: live, with no failure from its first use.
    ASSERT_TRUE(ok(create_prefill(12)));
    EXPECT_EQ(poll(prefill_.get(), 12), KVXFER_ROOM_BOOTSTRAPPING);
    char buf[64];
    std::size_t n;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_room_failure(prefill_.get(), 12, buf, sizeof buf, &n)));
}

TEST_F(Rooms, ClearOfALiveRoomAbortsItFirst) {
    LogCapture log;
    Memory mem(1, 4, 4096);
    ConfigPtr c = config("decode");
    ASSERT_TRUE(ok(kvxfer_config_set_log_sink(c.get(), &LogCapture::sink, &log)));
    EnginePtr e = new_engine(c.get());
    ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), mem.data(), mem.size())));
    ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 21, peer_->ptrs.data(), 1)));
    ASSERT_TRUE(ok(kvxfer_room_clear(e.get(), 21)));
    EXPECT_TRUE(log.has(KVXFER_LOG_WARN, {"room 21", "cleared while live"})) << log.dump();
    ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 21, peer_->ptrs.data(), 1)));
    EXPECT_EQ(poll(e.get(), 21), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Rooms, FailureOfALiveRoomIsWrongState) {
    ASSERT_TRUE(ok(create_decode(13)));
    char buf[64];
    std::size_t n = 77;
    Result r = result(kvxfer_room_failure(decode_.get(), 13, buf, sizeof buf, &n));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, "bootstrapping")) << r;
    EXPECT_EQ(n, 77u) << "outputs are written only on success";
    kvxfer_failure_cause cause;
    bool from_peer;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_room_failure_cause(decode_.get(), 13, &cause, &from_peer)));
}

TEST_F(Rooms, DrainedIsFalseWhileLiveAndTrueOnceTerminal) {
    ASSERT_TRUE(ok(create_decode(14)));
    bool drained = true;
    ASSERT_TRUE(ok(kvxfer_room_drained(decode_.get(), 14, &drained)));
    EXPECT_FALSE(drained);
    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), 14, "stop")));
    ASSERT_TRUE(ok(kvxfer_room_drained(decode_.get(), 14, &drained)));
    EXPECT_TRUE(drained);
}

TEST_F(Rooms, ManyRoomsLiveIndependently) {
    for (uint64_t id = 1000; id < 1256; ++id) {
        ASSERT_TRUE(ok(create_decode(id))) << id;
    }
    for (uint64_t id = 1000; id < 1256; id += 2) {
        ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), id, "even")));
    }
    for (uint64_t id = 1000; id < 1256; ++id) {
        EXPECT_EQ(poll(decode_.get(), id),
                  id % 2 ? KVXFER_ROOM_BOOTSTRAPPING : KVXFER_ROOM_FAILED)
            << id;
    }
}

TEST_F(Rooms, ExtremeRoomIdsAreOrdinaryIds) {
    for (uint64_t id : {uint64_t{0}, ~uint64_t{0}}) {
        ASSERT_TRUE(ok(create_prefill(id))) << id;
        EXPECT_EQ(poll(prefill_.get(), id), KVXFER_ROOM_BOOTSTRAPPING);
        ASSERT_TRUE(ok(kvxfer_room_clear(prefill_.get(), id)));
    }
}

TEST(RoomDeadline, BootstrapTimeoutFailsTheRoomNamingTheDeadline) {
    // A prefill room whose decode engine never sends its destination. (On the decode
    // side the handshake's own timeout, also bootstrap_timeout_ms, may fire first and
    // report the peer lost instead; transfer_test.cpp covers that side's deadline.)
    Memory mem(2, 4, 4096);
    EnginePtr e = engine("prefill", {{"bootstrap_timeout_ms", "100"}});
    ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), mem.data(), mem.size())));
    auto created = std::chrono::steady_clock::now();
    ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 77, nullptr, 1)));
    kvxfer_room_state s = wait_terminal(e.get(), 77, std::chrono::seconds(5));
    auto waited = std::chrono::steady_clock::now() - created;
    ASSERT_EQ(s, KVXFER_ROOM_FAILED) << "no deadline fired within 5 s";
    // Not before the deadline (the upper bound is a timing claim, so none is made).
    EXPECT_GE(waited, std::chrono::milliseconds(100));

    kvxfer_failure_cause cause = KVXFER_CAUSE_INTERNAL;
    bool from_peer = true;
    ASSERT_TRUE(ok(kvxfer_room_failure_cause(e.get(), 77, &cause, &from_peer)));
    EXPECT_EQ(cause, KVXFER_CAUSE_BOOTSTRAP_TIMEOUT);
    EXPECT_FALSE(from_peer);
    std::string why = failure(e.get(), 77);
    EXPECT_TRUE(contains(why, "bootstrap_timeout_ms=100")) << why;
    EXPECT_TRUE(contains(why, "room 77")) << why;

    // A terminal room stays terminal: a later abort changes nothing.
    ASSERT_TRUE(ok(kvxfer_room_abort(e.get(), 77, "too late")));
    EXPECT_EQ(failure(e.get(), 77), why);
}

TEST(RoomDeadline, AnAbortedRoomIsNotFailedAgainByItsDeadline) {
    Memory mem(1, 4, 4096);
    EnginePtr e = engine("prefill", {{"bootstrap_timeout_ms", "50"}});
    ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), mem.data(), mem.size())));
    ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 1, nullptr, 1)));
    ASSERT_TRUE(ok(kvxfer_room_abort(e.get(), 1, "first")));
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    kvxfer_failure_cause cause;
    bool from_peer;
    ASSERT_TRUE(ok(kvxfer_room_failure_cause(e.get(), 1, &cause, &from_peer)));
    EXPECT_EQ(cause, KVXFER_CAUSE_ABORTED);
    EXPECT_EQ(failure(e.get(), 1), "room 1 aborted: first");
}

// --- the same through kvxfer.hpp ---------------------------------------------------

TEST(RoomHpp, LifecycleThroughTheWrapper) {
    SilentPeer silent;
    Memory mem(4, 8, 4096);
    kvxfer::Config pc;
    pc.set("role", "prefill");
    kvxfer::Engine prefill(pc);
    kvxfer::Config dc;
    dc.set("role", "decode");
    kvxfer::Engine decode(dc);
    prefill.register_kv(mem.buffers());
    decode.register_kv(mem.buffers());

    prefill.create_prefill_room(1);
    decode.create_decode_room(1, {silent.address()});
    EXPECT_EQ(prefill.poll(1), kvxfer::RoomState::Bootstrapping);
    EXPECT_EQ(decode.poll(1), kvxfer::RoomState::Bootstrapping);
    EXPECT_FALSE(decode.drained(1));

    decode.abort(1, "client went away");
    EXPECT_EQ(decode.poll(1), kvxfer::RoomState::Failed);
    EXPECT_TRUE(kvxfer::is_terminal(decode.poll(1)));
    EXPECT_EQ(decode.failure(1), "room 1 aborted: client went away");
    bool from_peer = true;
    EXPECT_EQ(decode.failure_cause(1, &from_peer), kvxfer::FailureCause::Aborted);
    EXPECT_FALSE(from_peer);
    EXPECT_TRUE(decode.drained(1));
    decode.clear(1);
    try {
        decode.poll(1);
        FAIL() << "a cleared room polled";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_NOT_FOUND);
        EXPECT_EQ(e.message(), "room 1 not found");
    }
    decode.create_decode_room(1, {silent.address()});
    EXPECT_EQ(decode.poll(1), kvxfer::RoomState::Bootstrapping);

    try {
        prefill.create_prefill_room(1);
        FAIL() << "duplicate room created";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_ALREADY_EXISTS);
    }
    try {
        (void)prefill.failure(1);
        FAIL() << "a live room had a failure";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_WRONG_STATE);
    }
}

// Rooms by instance name need the registry (config key `discovery`; the discovery
// suite, tests/discovery.rs, runs them against a real etcd): without it the call is
// refused without creating anything, on a prefill engine it is the wrong role.
TEST(RoomHpp, ARoomByInstanceWithoutARegistryIsWrongStateAndCreatesNothing) {
    Memory mem(1, 4, 4096);
    kvxfer::Config dc;
    dc.set("role", "decode");
    kvxfer::Engine decode(dc);
    decode.register_kv(mem.buffers());
    try {
        decode.create_decode_room_from(1, "prefill-a");
        FAIL() << "a room by instance without a registry";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_WRONG_STATE);
        EXPECT_TRUE(contains(e.message(), "'discovery'")) << e.message();
    }
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_create_from(decode.get(), 1, nullptr)));
    try {
        (void)decode.poll(1);
        FAIL() << "the refused room exists";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_NOT_FOUND);
    }
    kvxfer::Config pc;
    pc.set("role", "prefill");
    kvxfer::Engine prefill(pc);
    prefill.register_kv(mem.buffers());
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_ROLE,
                           kvxfer_room_create_from(prefill.get(), 1, "prefill-a")));
}

TEST(RoomHpp, FailureReadsReasonsLongerThanTheFirstBuffer) {
    Memory mem(1, 4, 4096);
    kvxfer::Config c;
    c.set("role", "prefill");
    kvxfer::Engine e(c);
    e.register_kv(mem.buffers());
    e.create_prefill_room(2);
    std::string reason(1000, 'r');
    e.abort(2, reason);
    EXPECT_EQ(e.failure(2), "room 2 aborted: " + reason);
}

TEST(RoomHpp, BootstrapDeadlineThroughTheWrapper) {
    Memory mem(1, 4, 4096);
    kvxfer::Config c;
    c.set("role", "prefill").set("bootstrap_timeout_ms", "100");
    kvxfer::Engine e(c);
    e.register_kv(mem.buffers());
    e.create_prefill_room(3);
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!kvxfer::is_terminal(e.poll(3)) && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(e.poll(3), kvxfer::RoomState::Failed);
    EXPECT_EQ(e.failure_cause(3), kvxfer::FailureCause::BootstrapTimeout);
    EXPECT_TRUE(contains(e.failure(3), "bootstrap_timeout_ms=100")) << e.failure(3);
}
