// Every error path of the engine and room calls returns its own status and leaves a
// non-empty message; none crashes, and a refused call leaves the room as it was.
#include "kvxfer.hpp"
#include "support.hpp"

#include <functional>
#include <limits>

using namespace kvtest;

namespace {

constexpr std::size_t kPages = 16;

class Errors : public ::testing::Test {
  protected:
    void SetUp() override {
        prefill_ = engine("prefill");
        decode_ = engine("decode");
        ASSERT_TRUE(ok(kvxfer_register_kv(prefill_.get(), kv_.data(), kv_.size())));
        ASSERT_TRUE(ok(kvxfer_register_kv(decode_.get(), kv_.data(), kv_.size())));
        ASSERT_TRUE(ok(kvxfer_register_aux(prefill_.get(), aux_.data(), aux_.size())));
        ASSERT_TRUE(ok(kvxfer_register_aux(decode_.get(), aux_.data(), aux_.size())));
        ASSERT_TRUE(ok(kvxfer_room_create(prefill_.get(), kRoom, nullptr, 1)));
        ASSERT_TRUE(
            ok(kvxfer_room_create(decode_.get(), kRoom, peers_.ptrs.data(), peers_.ptrs.size())));
    }

    static constexpr uint64_t kRoom = 1;
    // Four KV buffers of 16 pages, two aux buffers of 4 slots (real malloc'd memory,
    // declared before the engines so that it outlives them).
    Memory kv_{4, kPages, 2048};
    Memory aux_{2, 4, 256};
    // Decode rooms pull from a peer that never answers: they stay BOOTSTRAPPING.
    SilentPeer silent_;
    Peers peers_{{silent_.address()}};
    EnginePtr prefill_;
    EnginePtr decode_;
};

} // namespace

TEST_F(Errors, NullEngineIsNullPointerForEveryCall) {
    kvxfer_room_state s;
    char buf[32];
    std::size_t n;
    kvxfer_failure_cause c;
    bool b;
    uint32_t page = 0;
    const kvxfer_engine *null = nullptr;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_address(null, buf, 32, &n)));
    uint64_t count = 0;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_wait(null, 0, 0, &count)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_wake(null)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_id(null, &count)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_create_for(null, 2, &count, 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_register_kv(null, kv_.data(), 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_register_aux(null, aux_.data(), 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_create(null, 2, nullptr, 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_set_destination(null, kRoom, &page, 1, -1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_enqueue_chunk(null, kRoom, &page, 1, true, -1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_poll(null, kRoom, &s)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_abort(null, kRoom, "x")));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_failure(null, kRoom, buf, 32, &n)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_failure_cause(null, kRoom, &c, &b)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_drained(null, kRoom, &b)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_clear(null, kRoom)));
    Result r = result(kvxfer_room_poll(null, kRoom, &s));
    EXPECT_TRUE(contains(r.message, "'engine'")) << r;
}

TEST_F(Errors, NullOutputPointersAreNullPointer) {
    char buf[64];
    std::size_t n;
    kvxfer_failure_cause c;
    bool b;
    Result r = result(kvxfer_room_poll(decode_.get(), kRoom, nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "'state'")) << r;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_drained(decode_.get(), kRoom, nullptr)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_engine_address(decode_.get(), buf, sizeof buf, nullptr)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_wait(decode_.get(), 0, 0, nullptr)));
    // A NULL buffer with a nonzero length.
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_engine_address(decode_.get(), nullptr, 64, &n)));

    // The failure outputs, on a room that has a failure to report.
    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), kRoom, "x")));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_failure(decode_.get(), kRoom, buf, sizeof buf, nullptr)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_failure(decode_.get(), kRoom, nullptr, 64, &n)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_failure_cause(decode_.get(), kRoom, nullptr, &b)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_failure_cause(decode_.get(), kRoom, &c, nullptr)));
}

TEST_F(Errors, NullPagesWithANonzeroCountAreNullPointer) {
    Result r = result(kvxfer_room_set_destination(decode_.get(), kRoom, nullptr, 3, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "'pages'")) << r;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_enqueue_chunk(prefill_.get(), kRoom, nullptr, 3, false, -1)));
    // NULL with a count of 0 is an empty list, which is valid (an empty last chunk).
    EXPECT_TRUE(ok(kvxfer_enqueue_chunk(prefill_.get(), kRoom, nullptr, 0, true, -1)));
}

TEST_F(Errors, NullBuffersWithANonzeroCountAreNullPointer) {
    EnginePtr e = engine("prefill");
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_register_kv(e.get(), nullptr, 2)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_register_aux(e.get(), nullptr, 2)));
}

TEST_F(Errors, NullPeerListOrPeerIsNullPointerOnDecode) {
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER,
                           kvxfer_room_create(decode_.get(), 2, nullptr, 1)));
    const char *peers[] = {"127.0.0.1:1", nullptr};
    Result r = result(kvxfer_room_create(decode_.get(), 2, peers, 2));
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "peers[1]")) << r;
    kvxfer_room_state s;
    EXPECT_TRUE(fails_with(KVXFER_ERR_NOT_FOUND, kvxfer_room_poll(decode_.get(), 2, &s)))
        << "a refused create leaves no room behind";
}

TEST_F(Errors, CallsForTheOtherRoleAreWrongRole) {
    uint32_t page = 0;
    bool drained;
    Result r = result(kvxfer_room_set_destination(prefill_.get(), kRoom, &page, 1, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_ROLE) << r;
    EXPECT_TRUE(contains(r.message, "kvxfer_room_set_destination")) << r;
    r = result(kvxfer_enqueue_chunk(decode_.get(), kRoom, &page, 1, true, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_ROLE) << r;
    EXPECT_TRUE(contains(r.message, "kvxfer_enqueue_chunk")) << r;
    // kvxfer_room_drained serves both roles (prefill: source pages no longer read).
    drained = true;
    EXPECT_TRUE(ok(kvxfer_room_drained(prefill_.get(), kRoom, &drained)));
    EXPECT_FALSE(drained) << "a live room is never drained";
    // The rooms are untouched.
    EXPECT_EQ(poll(prefill_.get(), kRoom), KVXFER_ROOM_BOOTSTRAPPING);
    EXPECT_EQ(poll(decode_.get(), kRoom), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Errors, PageOutOfRangeIsInvalidArgument) {
    std::vector<uint32_t> pages = {0, 1, static_cast<uint32_t>(kPages)};
    Result r = result(
        kvxfer_room_set_destination(decode_.get(), kRoom, pages.data(), pages.size(), -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "page 16")) << r;
    r = result(kvxfer_enqueue_chunk(prefill_.get(), kRoom, pages.data(), pages.size(), false, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    uint32_t huge = std::numeric_limits<uint32_t>::max();
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_enqueue_chunk(prefill_.get(), kRoom, &huge, 1, false, -1)));
}

TEST_F(Errors, DestinationPageListedTwiceIsInvalidArgument) {
    std::vector<uint32_t> pages = {3, 4, 3};
    Result r = result(
        kvxfer_room_set_destination(decode_.get(), kRoom, pages.data(), pages.size(), -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "twice")) << r;
}

TEST_F(Errors, AuxSlotWithoutIsLastOrOutOfRangeIsInvalidArgument) {
    uint32_t page = 0;
    Result r = result(kvxfer_enqueue_chunk(prefill_.get(), kRoom, &page, 1, false, 0));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "is_last")) << r;
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_enqueue_chunk(prefill_.get(), kRoom, &page, 1, true, 4)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_room_set_destination(decode_.get(), kRoom, &page, 1, 4)));
    // Beyond uint32_t.
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_room_set_destination(decode_.get(), kRoom, &page, 1,
                                                       int64_t{1} << 40)));
}

TEST_F(Errors, AuxSlotWithoutRegisteredAuxBuffersIsInvalidArgument) {
    Memory kv(1, 4, 4096);
    EnginePtr e = engine("prefill");
    ASSERT_TRUE(ok(kvxfer_register_kv(e.get(), kv.data(), kv.size())));
    ASSERT_TRUE(ok(kvxfer_room_create(e.get(), 1, nullptr, 1)));
    uint32_t page = 0;
    Result r = result(kvxfer_enqueue_chunk(e.get(), 1, &page, 1, true, 0));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "0 slots")) << r;
}

TEST_F(Errors, DestinationIsAcceptedOnceAndASecondIsWrongState) {
    std::vector<uint32_t> pages = {0, 1, 2, static_cast<uint32_t>(kPages - 1)};
    EXPECT_TRUE(ok(kvxfer_room_set_destination(decode_.get(), kRoom, pages.data(), pages.size(), 3)));
    Result r = result(kvxfer_room_set_destination(decode_.get(), kRoom, pages.data(), 1, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, "already has its destination")) << r;
    // The room waits for its peer (which never answers), undisturbed.
    EXPECT_EQ(poll(decode_.get(), kRoom), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Errors, ChunksAreQueuedUntilTheLastAndMoreAreWrongState) {
    std::vector<uint32_t> pages = {0, 1, 2, 3};
    // Before any destination arrived: the chunks are held, never refused.
    EXPECT_TRUE(ok(kvxfer_enqueue_chunk(prefill_.get(), kRoom, pages.data(), 2, false, -1)));
    EXPECT_TRUE(ok(kvxfer_enqueue_chunk(prefill_.get(), kRoom, pages.data() + 2, 2, true, 3)));
    Result r = result(kvxfer_enqueue_chunk(prefill_.get(), kRoom, pages.data(), 1, true, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, "last chunk")) << r;
    EXPECT_EQ(poll(prefill_.get(), kRoom), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Errors, TransferCallsOnATerminalRoomAreWrongState) {
    ASSERT_TRUE(ok(kvxfer_room_abort(prefill_.get(), kRoom, "x")));
    ASSERT_TRUE(ok(kvxfer_room_abort(decode_.get(), kRoom, "x")));
    uint32_t page = 0;
    Result r = result(kvxfer_room_set_destination(decode_.get(), kRoom, &page, 1, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, "failed")) << r;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_enqueue_chunk(prefill_.get(), kRoom, &page, 1, true, -1)));
}

TEST_F(Errors, RoomCreateBeforeRegisterKvIsWrongState) {
    EnginePtr p = engine("prefill");
    EnginePtr d = engine("decode");
    Result r = result(kvxfer_room_create(p.get(), 1, nullptr, 1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, "kvxfer_register_kv")) << r;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_room_create(d.get(), 1, peers_.ptrs.data(), 1)));
    // Registering aux buffers is not enough.
    ASSERT_TRUE(ok(kvxfer_register_aux(p.get(), aux_.data(), aux_.size())));
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE, kvxfer_room_create(p.get(), 1, nullptr, 1)));
}

TEST_F(Errors, PrefillRoomWithPeerAddressesIsInvalidArgument) {
    Result r = result(kvxfer_room_create(prefill_.get(), 2, peers_.ptrs.data(), 1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "NULL")) << r;
}

TEST_F(Errors, DecodeRoomWithoutPeersOrWithBadAddressesIsInvalidArgument) {
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_room_create(decode_.get(), 2, peers_.ptrs.data(), 0)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_room_create(decode_.get(), 2, nullptr, 0)));
    const char *twice[] = {silent_.address().c_str(), silent_.address().c_str()};
    Result dup = result(kvxfer_room_create(decode_.get(), 2, twice, 2));
    EXPECT_EQ(dup.status, KVXFER_ERR_INVALID_ARGUMENT) << dup;
    EXPECT_TRUE(contains(dup.message, "twice")) << dup;
    for (const char *bad : {"nohost", "127.0.0.1:port", ":5000", "::1:5000", ""}) {
        const char *peers[] = {bad};
        Result r = result(kvxfer_room_create(decode_.get(), 2, peers, 1));
        EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << bad << ": " << r;
        EXPECT_TRUE(contains(r.message, std::string("'") + bad + "'")) << r;
    }
}

TEST_F(Errors, RegisteringTwiceIsWrongState) {
    Result r = result(kvxfer_register_kv(prefill_.get(), kv_.data(), kv_.size()));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, "already registered")) << r;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_register_aux(decode_.get(), aux_.data(), aux_.size())));
}

TEST_F(Errors, BadBufferDescriptionsAreInvalidArgumentAndRegisterNothing) {
    EnginePtr e = engine("prefill");
    Memory one(1, 4, 1024);
    kvxfer_buffer b = one.buffers()[0];

    kvxfer_buffer zero_item = b;
    zero_item.item_len = 0;
    Result r = result(kvxfer_register_kv(e.get(), &zero_item, 1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "item_len")) << r;

    kvxfer_buffer null_base = b;
    null_base.base = nullptr;
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_register_kv(e.get(), &null_base, 1)));

    kvxfer_buffer short_len = b;
    short_len.len = b.item_len - 1;
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_register_kv(e.get(), &short_len, 1)));

    kvxfer_buffer wraps = b;
    wraps.len = std::numeric_limits<std::size_t>::max();
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_register_kv(e.get(), &wraps, 1)));

    kvxfer_buffer huge_item = b;
    huge_item.item_len = std::size_t{1} << 31; // larger than one data frame
    huge_item.len = huge_item.item_len;
    r = result(kvxfer_register_kv(e.get(), &huge_item, 1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "item_len")) << r;

    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_register_kv(e.get(), &b, 0)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_register_kv(e.get(), nullptr, 0)));

    // The message names the buffer at fault.
    kvxfer_buffer two[] = {b, zero_item};
    r = result(kvxfer_register_kv(e.get(), two, 2));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "buffer 1")) << r;

    // Nothing was registered by the refused calls: a good registration still works.
    EXPECT_TRUE(ok(kvxfer_register_kv(e.get(), &b, 1)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_register_aux(e.get(), &zero_item, 1)));
    EXPECT_TRUE(ok(kvxfer_register_aux(e.get(), &b, 1)));
}

TEST_F(Errors, TooManyBuffersIsInvalidArgument) {
    EnginePtr e = engine("prefill");
    Memory one(1, 1, 64);
    std::vector<kvxfer_buffer> many(4097, one.buffers()[0]);
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_register_kv(e.get(), many.data(), many.size())));
    many.resize(4096);
    EXPECT_TRUE(ok(kvxfer_register_kv(e.get(), many.data(), many.size())));
}

TEST_F(Errors, AbortReasonThatIsNotUtf8IsInvalidArgument) {
    const char bad[] = {'\xff', '\xfe', 'x', '\0'};
    Result r = result(kvxfer_room_abort(decode_.get(), kRoom, bad));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "UTF-8")) << r;
    EXPECT_EQ(poll(decode_.get(), kRoom), KVXFER_ROOM_BOOTSTRAPPING);
}

TEST_F(Errors, ErrorsThroughTheWrapperCarryTheSameStatus) {
    kvxfer::Config c;
    c.set("role", "prefill");
    kvxfer::Engine e(c);
    auto code_of = [](const std::function<void()> &f) {
        try {
            f();
        } catch (const kvxfer::Error &err) {
            EXPECT_FALSE(err.message().empty());
            return err.code();
        }
        return KVXFER_OK;
    };
    EXPECT_EQ(code_of([&] { e.create_prefill_room(1); }), KVXFER_ERR_WRONG_STATE);
    e.register_kv(kv_.buffers());
    EXPECT_EQ(code_of([&] { e.register_kv(kv_.buffers()); }), KVXFER_ERR_WRONG_STATE);
    EXPECT_EQ(code_of([&] { e.register_aux({}); }), KVXFER_ERR_INVALID_ARGUMENT);
    e.create_prefill_room(1);
    EXPECT_EQ(code_of([&] { e.create_decode_room(2, {"127.0.0.1:1"}); }),
              KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(code_of([&] { e.set_destination(1, {0}); }), KVXFER_ERR_WRONG_ROLE);
    EXPECT_EQ(code_of([&] { (void)e.drained(1); }), KVXFER_OK); // both roles
    EXPECT_EQ(code_of([&] { e.enqueue_chunk(1, {0, 1}, false, 0); }),
              KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(code_of([&] { e.enqueue_chunk(1, {0, 1}, true); }), KVXFER_OK);
    EXPECT_EQ(code_of([&] { e.enqueue_chunk(1, {2}, true); }), KVXFER_ERR_WRONG_STATE);
    EXPECT_EQ(code_of([&] { e.clear(2); }), KVXFER_ERR_NOT_FOUND);
    EXPECT_EQ(code_of([&] { (void)e.failure_cause(1); }), KVXFER_ERR_WRONG_STATE);
    EXPECT_EQ(e.poll(1), kvxfer::RoomState::Bootstrapping);
}
