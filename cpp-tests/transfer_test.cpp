// Real transfers between a prefill and a decode engine over loopback TCP, driven only
// through the C ABI (and one through kvxfer.hpp): bytes compared page by page, and the
// failure paths that reach both sides.
#include "kvxfer.hpp"
#include "support.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

using namespace kvtest;

namespace {

constexpr std::size_t kLayers = 4;
constexpr std::size_t kBuffers = 2 * kLayers; // K and V per layer
constexpr std::size_t kPages = 32;
constexpr std::size_t kPageBytes = 2048;
constexpr std::size_t kAuxSlots = 8;
constexpr std::size_t kAuxBytes = 128;
constexpr unsigned char kPoison = 0xEE;

// One side's registered memory, filled with a pattern naming (buffer, page, byte) on the
// prefill side and with kPoison on the decode side.
struct Side {
    explicit Side(bool source) : kv(kBuffers, kPages, kPageBytes), aux(1, kAuxSlots, kAuxBytes) {
        for (std::size_t b = 0; b < kBuffers; ++b) {
            auto *p = static_cast<unsigned char *>(kv.buffers()[b].base);
            for (std::size_t i = 0; i < kPages * kPageBytes; ++i) {
                p[i] = source ? static_cast<unsigned char>(b * 31 + i * 7 + i / kPageBytes)
                              : kPoison;
            }
        }
        auto *a = static_cast<unsigned char *>(aux.buffers()[0].base);
        for (std::size_t i = 0; i < kAuxSlots * kAuxBytes; ++i) {
            a[i] = source ? static_cast<unsigned char>(i * 13 + 1) : kPoison;
        }
    }
    const unsigned char *page(std::size_t b, uint32_t p) const {
        return static_cast<const unsigned char *>(kv.buffers()[b].base) + p * kPageBytes;
    }
    const unsigned char *slot(uint32_t s) const {
        return static_cast<const unsigned char *>(aux.buffers()[0].base) + s * kAuxBytes;
    }
    Memory kv;
    Memory aux;
};

class Transfer : public ::testing::Test {
  protected:
    void start(const std::vector<std::pair<std::string, std::string>> &keys = {}) {
        auto with = keys;
        with.emplace_back("workers", "2");
        p_ = engine("prefill", with);
        d_ = engine("decode", with);
        ASSERT_TRUE(ok(kvxfer_register_kv(p_.get(), src_.kv.data(), src_.kv.size())));
        ASSERT_TRUE(ok(kvxfer_register_aux(p_.get(), src_.aux.data(), src_.aux.size())));
        ASSERT_TRUE(ok(kvxfer_register_kv(d_.get(), dst_.kv.data(), dst_.kv.size())));
        ASSERT_TRUE(ok(kvxfer_register_aux(d_.get(), dst_.aux.data(), dst_.aux.size())));
        peers_ = std::make_unique<Peers>(std::vector<std::string>{address(p_.get())});
    }
    void SetUp() override { start(); }

    void create(uint64_t room) {
        ASSERT_TRUE(ok(kvxfer_room_create(p_.get(), room, nullptr, 1)));
        ASSERT_TRUE(ok(kvxfer_room_create(d_.get(), room, peers_->ptrs.data(), 1)));
    }

    ::testing::AssertionResult pages_equal(const std::vector<uint32_t> &src,
                                           const std::vector<uint32_t> &dst) const {
        for (std::size_t i = 0; i < src.size(); ++i) {
            for (std::size_t b = 0; b < kBuffers; ++b) {
                if (std::memcmp(dst_.page(b, dst[i]), src_.page(b, src[i]), kPageBytes) != 0) {
                    return ::testing::AssertionFailure()
                           << "buffer " << b << ": decode page " << dst[i]
                           << " differs from prefill page " << src[i];
                }
            }
        }
        return ::testing::AssertionSuccess();
    }

    ::testing::AssertionResult untouched(const std::vector<uint32_t> &dst) const {
        for (uint32_t d : dst) {
            for (std::size_t b = 0; b < kBuffers; ++b) {
                const unsigned char *p = dst_.page(b, d);
                for (std::size_t i = 0; i < kPageBytes; ++i) {
                    if (p[i] != kPoison) {
                        return ::testing::AssertionFailure()
                               << "buffer " << b << " page " << d << " was written";
                    }
                }
            }
        }
        return ::testing::AssertionSuccess();
    }

    // Memory first: it outlives the engines.
    Side src_{true};
    Side dst_{false};
    EnginePtr p_;
    EnginePtr d_;
    std::unique_ptr<Peers> peers_;
};

} // namespace

TEST_F(Transfer, ChunksArriveInTheGrantedPagesWithTheAuxRowAndBothSidesSucceed) {
    create(1);
    // Scattered destination pages, consecutive source pages, in two chunks.
    std::vector<uint32_t> dst = {20, 21, 22, 5, 6, 30, 7, 8};
    std::vector<uint32_t> src = {0, 1, 2, 3, 4, 5, 6, 7};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 1, dst.data(), dst.size(), 3)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 1, src.data(), 5, false, -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 1, src.data() + 5, 3, true, 2)));

    ASSERT_EQ(wait_terminal(d_.get(), 1), KVXFER_ROOM_SUCCESS) << failure(d_.get(), 1);
    ASSERT_EQ(wait_terminal(p_.get(), 1), KVXFER_ROOM_SUCCESS);
    EXPECT_TRUE(pages_equal(src, dst));
    EXPECT_EQ(std::memcmp(dst_.slot(3), src_.slot(2), kAuxBytes), 0) << "aux row";
    EXPECT_EQ(dst_.slot(2)[0], kPoison) << "only the granted aux slot is written";
    std::vector<uint32_t> others;
    for (uint32_t p = 0; p < kPages; ++p) {
        if (std::find(dst.begin(), dst.end(), p) == dst.end()) {
            others.push_back(p);
        }
    }
    EXPECT_TRUE(untouched(others));

    bool drained = false;
    ASSERT_TRUE(ok(kvxfer_room_drained(d_.get(), 1, &drained)));
    EXPECT_TRUE(drained);
    char buf[16];
    std::size_t n;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_room_failure(d_.get(), 1, buf, sizeof buf, &n)))
        << "a successful room has no failure";
    // SUCCESS is sticky: an abort afterwards changes nothing.
    ASSERT_TRUE(ok(kvxfer_room_abort(d_.get(), 1, "late")));
    EXPECT_EQ(poll(d_.get(), 1), KVXFER_ROOM_SUCCESS);
}

// integrity=verify on both engines over TCP (also in the soft-RoCE guest, where the
// default transport is RDMA): the room succeeds verified, the path is TCP, and the
// metrics count the bytes verified.
TEST_F(Transfer, AVerifiedRoomSaysSoAndItsPathIsReported) {
    start({{"integrity", "verify"}, {"same_host", "off"}, {"transport", "tcp"}});
    create(2);
    std::vector<uint32_t> dst = {9, 10}, src = {3, 4};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 2, dst.data(), dst.size(), -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 2, src.data(), src.size(), true, -1)));
    ASSERT_EQ(wait_terminal(d_.get(), 2), KVXFER_ROOM_SUCCESS) << failure(d_.get(), 2);
    EXPECT_TRUE(pages_equal(src, dst));
    bool verified = false;
    ASSERT_TRUE(ok(kvxfer_room_verified(d_.get(), 2, &verified)));
    EXPECT_TRUE(verified);
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_ROLE, kvxfer_room_verified(p_.get(), 2, &verified)));
    kvxfer_path path = KVXFER_PATH_UNKNOWN;
    ASSERT_TRUE(ok(kvxfer_room_path(d_.get(), 2, &path)));
    EXPECT_EQ(path, KVXFER_PATH_TCP);
    kvxfer_metrics m{};
    ASSERT_TRUE(ok(kvxfer_engine_metrics(d_.get(), &m, sizeof m)));
    EXPECT_EQ(m.bytes_verified, 2 * kBuffers * kPageBytes);
    EXPECT_EQ(m.pairings_tcp, 1u);
}

// integrity=verify over the test transport: RDMA in the soft-RoCE guest, whose writes
// are verified from the digests their progress carries, TCP elsewhere.
TEST_F(Transfer, AVerifiedRoomOverTheTestTransportSaysSo) {
    start({{"integrity", "verify"}, {"same_host", "off"}});
    create(3);
    std::vector<uint32_t> dst = {20, 21, 22}, src = {5, 6, 7};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 3, dst.data(), dst.size(), -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 3, src.data(), src.size(), true, -1)));
    ASSERT_EQ(wait_terminal(d_.get(), 3), KVXFER_ROOM_SUCCESS) << failure(d_.get(), 3);
    EXPECT_TRUE(pages_equal(src, dst));
    bool verified = false;
    ASSERT_TRUE(ok(kvxfer_room_verified(d_.get(), 3, &verified)));
    EXPECT_TRUE(verified);
    kvxfer_path path = KVXFER_PATH_UNKNOWN;
    ASSERT_TRUE(ok(kvxfer_room_path(d_.get(), 3, &path)));
    EXPECT_EQ(path, rdma_device_present() ? KVXFER_PATH_RDMA : KVXFER_PATH_TCP);
    kvxfer_metrics m{};
    ASSERT_TRUE(ok(kvxfer_engine_metrics(d_.get(), &m, sizeof m)));
    EXPECT_EQ(m.bytes_verified, 3 * kBuffers * kPageBytes);
    EXPECT_EQ(m.integrity_failures, 0u);
}

TEST_F(Transfer, ChunksEnqueuedBeforeTheDestinationAreSentWhenItArrives) {
    create(2);
    std::vector<uint32_t> src = {10, 11, 12, 13};
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 2, src.data(), src.size(), true, -1)));
    std::vector<uint32_t> dst = {0, 1, 2, 3};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 2, dst.data(), dst.size(), -1)));
    ASSERT_EQ(wait_terminal(d_.get(), 2), KVXFER_ROOM_SUCCESS) << failure(d_.get(), 2);
    ASSERT_EQ(wait_terminal(p_.get(), 2), KVXFER_ROOM_SUCCESS);
    EXPECT_TRUE(pages_equal(src, dst));
}

TEST_F(Transfer, AnEmptyTransferSucceeds) {
    create(3);
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 3, nullptr, 0, -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 3, nullptr, 0, true, -1)));
    EXPECT_EQ(wait_terminal(d_.get(), 3), KVXFER_ROOM_SUCCESS);
    EXPECT_EQ(wait_terminal(p_.get(), 3), KVXFER_ROOM_SUCCESS);
}

TEST_F(Transfer, ManyRoomsShareOneConnectionAndAllSucceed) {
    const uint64_t n = 16;
    for (uint64_t r = 100; r < 100 + n; ++r) {
        create(r);
        std::vector<uint32_t> dst = {static_cast<uint32_t>(2 * (r - 100)),
                                     static_cast<uint32_t>(2 * (r - 100) + 1)};
        std::vector<uint32_t> src = {static_cast<uint32_t>(r - 100), 31};
        ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), r, dst.data(), dst.size(), -1)));
        ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), r, src.data(), src.size(), true, -1)));
    }
    for (uint64_t r = 100; r < 100 + n; ++r) {
        ASSERT_EQ(wait_terminal(d_.get(), r), KVXFER_ROOM_SUCCESS) << r << ": " << failure(d_.get(), r);
        ASSERT_EQ(wait_terminal(p_.get(), r), KVXFER_ROOM_SUCCESS) << r;
        std::vector<uint32_t> dst = {static_cast<uint32_t>(2 * (r - 100)),
                                     static_cast<uint32_t>(2 * (r - 100) + 1)};
        EXPECT_TRUE(pages_equal({static_cast<uint32_t>(r - 100), 31}, dst)) << r;
    }
}

TEST_F(Transfer, ADecodeAbortReachesThePrefillWithItsReason) {
    create(4);
    std::vector<uint32_t> dst = {0, 1};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 4, dst.data(), dst.size(), -1)));
    ASSERT_EQ(wait_for(p_.get(), 4, [](kvxfer_room_state s) { return s != KVXFER_ROOM_BOOTSTRAPPING; }),
              KVXFER_ROOM_WAITING_FOR_INPUT);
    ASSERT_TRUE(ok(kvxfer_room_abort(d_.get(), 4, "client went away")));

    ASSERT_EQ(wait_terminal(p_.get(), 4), KVXFER_ROOM_FAILED);
    Cause c = cause_of(p_.get(), 4);
    EXPECT_EQ(c.cause, KVXFER_CAUSE_ABORTED);
    EXPECT_TRUE(c.from_peer);
    EXPECT_EQ(failure(p_.get(), 4), "peer: room 4 aborted: client went away");
    // The decode side keeps its own, local reason.
    EXPECT_EQ(failure(d_.get(), 4), "room 4 aborted: client went away");
    EXPECT_FALSE(cause_of(d_.get(), 4).from_peer);

    // Chunks for the failed room are refused and nothing lands in the pages.
    std::vector<uint32_t> src = {0, 1};
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_enqueue_chunk(p_.get(), 4, src.data(), 2, true, -1)));
    EXPECT_TRUE(untouched(dst));
}

TEST_F(Transfer, APrefillAbortReachesTheDecodeSide) {
    create(5);
    std::vector<uint32_t> dst = {0, 1};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 5, dst.data(), dst.size(), -1)));
    ASSERT_EQ(wait_for(p_.get(), 5, [](kvxfer_room_state s) { return s != KVXFER_ROOM_BOOTSTRAPPING; }),
              KVXFER_ROOM_WAITING_FOR_INPUT);
    ASSERT_TRUE(ok(kvxfer_room_abort(p_.get(), 5, "prefill preempted")));
    ASSERT_EQ(wait_terminal(d_.get(), 5), KVXFER_ROOM_FAILED);
    EXPECT_EQ(failure(d_.get(), 5), "peer: room 5 aborted: prefill preempted");
    EXPECT_TRUE(cause_of(d_.get(), 5).from_peer);
    EXPECT_TRUE(wait_drained(d_.get(), 5));
}

TEST_F(Transfer, ALastChunkThatLeavesPagesUnfilledFailsBothSides) {
    create(6);
    std::vector<uint32_t> dst = {0, 1, 2, 3};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 6, dst.data(), dst.size(), -1)));
    std::vector<uint32_t> src = {0, 1};
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 6, src.data(), src.size(), true, -1)));
    ASSERT_EQ(wait_terminal(p_.get(), 6), KVXFER_ROOM_FAILED);
    EXPECT_EQ(cause_of(p_.get(), 6).cause, KVXFER_CAUSE_MISMATCH);
    std::string why = failure(p_.get(), 6);
    EXPECT_TRUE(contains(why, "leaves 2 of 4 destination pages")) << why;
    // The decode side hears of it and fails too: nothing stays live.
    ASSERT_EQ(wait_terminal(d_.get(), 6), KVXFER_ROOM_FAILED);
    EXPECT_TRUE(cause_of(d_.get(), 6).from_peer) << failure(d_.get(), 6);
}

TEST_F(Transfer, MorePagesThanTheDestinationHoldsFailsWithMismatch) {
    create(7);
    std::vector<uint32_t> dst = {0, 1};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 7, dst.data(), dst.size(), -1)));
    std::vector<uint32_t> src = {0, 1, 2};
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 7, src.data(), src.size(), false, -1)));
    ASSERT_EQ(wait_terminal(p_.get(), 7), KVXFER_ROOM_FAILED);
    EXPECT_EQ(cause_of(p_.get(), 7).cause, KVXFER_CAUSE_MISMATCH);
    EXPECT_TRUE(contains(failure(p_.get(), 7), "overflows the destination")) << failure(p_.get(), 7);
    EXPECT_EQ(wait_terminal(d_.get(), 7), KVXFER_ROOM_FAILED);
}

TEST_F(Transfer, ClearedIdsCanBeUsedForANewTransfer) {
    create(8);
    ASSERT_TRUE(ok(kvxfer_room_abort(d_.get(), 8, "first use")));
    // As a scheduler does: clear each side once it has seen the room terminal.
    ASSERT_EQ(wait_terminal(d_.get(), 8), KVXFER_ROOM_FAILED);
    ASSERT_EQ(wait_terminal(p_.get(), 8), KVXFER_ROOM_FAILED);
    ASSERT_TRUE(ok(kvxfer_room_clear(d_.get(), 8)));
    ASSERT_TRUE(ok(kvxfer_room_clear(p_.get(), 8)));

    create(8);
    std::vector<uint32_t> dst = {9, 10};
    std::vector<uint32_t> src = {1, 2};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 8, dst.data(), dst.size(), -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 8, src.data(), src.size(), true, -1)));
    ASSERT_EQ(wait_terminal(d_.get(), 8), KVXFER_ROOM_SUCCESS) << failure(d_.get(), 8);
    ASSERT_EQ(wait_terminal(p_.get(), 8), KVXFER_ROOM_SUCCESS);
    EXPECT_TRUE(pages_equal(src, dst));
}

TEST_F(Transfer, MetricsCountRoomsAndBytesOnBothSides) {
    create(10);
    create(11);
    std::vector<uint32_t> dst = {0, 1, 2};
    std::vector<uint32_t> src = {3, 4, 5};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 10, dst.data(), dst.size(), 1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 10, src.data(), src.size(), true, 0)));
    ASSERT_EQ(wait_terminal(d_.get(), 10), KVXFER_ROOM_SUCCESS);
    ASSERT_EQ(wait_terminal(p_.get(), 10), KVXFER_ROOM_SUCCESS);
    ASSERT_TRUE(ok(kvxfer_room_abort(p_.get(), 11, "x")));

    const uint64_t payload = 3 * kBuffers * kPageBytes + kAuxBytes;
    kvxfer_metrics pm{}, dm{};
    ASSERT_TRUE(ok(kvxfer_engine_metrics(p_.get(), &pm, sizeof pm)));
    ASSERT_TRUE(ok(kvxfer_engine_metrics(d_.get(), &dm, sizeof dm)));
    EXPECT_EQ(pm.rooms_created, 2u);
    EXPECT_EQ(pm.rooms_succeeded, 1u);
    EXPECT_EQ(pm.rooms_failed, 1u);
    EXPECT_EQ(pm.rooms_failed_by_cause[KVXFER_CAUSE_ABORTED], 1u);
    EXPECT_EQ(pm.rooms_by_state[KVXFER_ROOM_SUCCESS], 1u);
    EXPECT_EQ(pm.rooms_by_state[KVXFER_ROOM_FAILED], 1u);
    EXPECT_EQ(pm.inflight, 0u);
    EXPECT_EQ(pm.bytes_sent, payload);
    EXPECT_EQ(dm.rooms_succeeded, 1u);
    EXPECT_EQ(dm.bytes_received, payload);

    // Through the wrapper, and as Prometheus text.
    kvxfer::Config c;
    c.set("role", "prefill");
    kvxfer::Engine e(c);
    EXPECT_EQ(e.metrics().rooms_created, 0u);
    std::string text = e.metrics_text();
    EXPECT_TRUE(contains(text, "kvxfer_rooms_created_total{role=\"prefill\"} 0")) << text;
}

TEST_F(Transfer, MetricsArgumentsAreChecked) {
    kvxfer_metrics m{};
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_metrics(nullptr, &m, sizeof m)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_engine_metrics(p_.get(), nullptr, sizeof m)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT, kvxfer_engine_metrics(p_.get(), &m, 0)));

    // A caller built against a shorter struct gets only the fields it knows.
    ASSERT_TRUE(ok(kvxfer_room_create(p_.get(), 1, nullptr, 1)));
    std::memset(&m, 0x5a, sizeof m);
    ASSERT_TRUE(ok(kvxfer_engine_metrics(p_.get(), &m, sizeof m.rooms_created)));
    EXPECT_EQ(m.rooms_created, 1u);
    EXPECT_EQ(m.rooms_succeeded, 0x5a5a5a5a5a5a5a5aull) << "written past the given size";

    std::size_t n = 0;
    char small[16];
    EXPECT_TRUE(fails_with(KVXFER_ERR_BUFFER_TOO_SMALL,
                           kvxfer_engine_metrics_text(p_.get(), small, sizeof small, &n)));
    EXPECT_GT(n, sizeof small);
    std::vector<char> buf(n + 1);
    std::size_t n2 = 0;
    ASSERT_TRUE(ok(kvxfer_engine_metrics_text(p_.get(), buf.data(), buf.size(), &n2)));
    EXPECT_EQ(n2, n);
}

class TransferDeadlines : public Transfer {
  protected:
    void SetUp() override { start({{"waiting_timeout_ms", "150"}}); }
};

TEST_F(TransferDeadlines, AConnectedRoomWithoutDataFailsItsWaitingDeadline) {
    create(1);
    std::vector<uint32_t> dst = {0};
    // Its waiting deadline may already have failed the room (a stall of 150 ms here):
    // then the call is refused for the room's state, which is checked next.
    const kvxfer_status set =
        kvxfer_room_set_destination(d_.get(), 1, dst.data(), dst.size(), -1);
    EXPECT_TRUE(set == KVXFER_OK || set == KVXFER_ERR_WRONG_STATE)
        << kvxfer_status_str(set) << ": " << last_error();
    // The prefill scheduler never enqueues a chunk.
    ASSERT_EQ(wait_terminal(d_.get(), 1), KVXFER_ROOM_FAILED);
    Cause c = cause_of(d_.get(), 1);
    std::string why = failure(d_.get(), 1);
    // Whichever side's deadline fires first, both end FAILED and say which deadline.
    if (c.from_peer) {
        EXPECT_EQ(c.cause, KVXFER_CAUSE_ABORTED) << why;
    } else {
        EXPECT_EQ(c.cause, KVXFER_CAUSE_WAITING_TIMEOUT) << why;
    }
    EXPECT_TRUE(contains(why, "waiting_timeout_ms=150")) << why;
    ASSERT_EQ(wait_terminal(p_.get(), 1), KVXFER_ROOM_FAILED);
    EXPECT_TRUE(contains(failure(p_.get(), 1), "waiting_timeout_ms=150")) << failure(p_.get(), 1);
}

TEST(TransferPeers, AnUnreachablePrefillFailsTheDecodeRoomAsPeerLost) {
    Memory mem(2, 4, 4096);
    EnginePtr d = engine("decode");
    ASSERT_TRUE(ok(kvxfer_register_kv(d.get(), mem.data(), mem.size())));
    Peers peers({closed_address()});
    ASSERT_TRUE(ok(kvxfer_room_create(d.get(), 1, peers.ptrs.data(), 1)));
    ASSERT_EQ(wait_terminal(d.get(), 1), KVXFER_ROOM_FAILED);
    EXPECT_EQ(cause_of(d.get(), 1).cause, KVXFER_CAUSE_PEER_LOST);
    std::string why = failure(d.get(), 1);
    EXPECT_TRUE(contains(why, peers.addrs[0])) << why;
}

TEST(TransferPeers, MismatchedBufferLayoutsFailTheRoomNamingTheBuffer) {
    Memory pmem(2, 4, 4096);
    Memory dmem(2, 8, 2048); // same bytes, different page size
    EnginePtr p = engine("prefill");
    EnginePtr d = engine("decode");
    ASSERT_TRUE(ok(kvxfer_register_kv(p.get(), pmem.data(), pmem.size())));
    ASSERT_TRUE(ok(kvxfer_register_kv(d.get(), dmem.data(), dmem.size())));
    Peers peers({address(p.get())});
    ASSERT_TRUE(ok(kvxfer_room_create(d.get(), 1, peers.ptrs.data(), 1)));
    ASSERT_EQ(wait_terminal(d.get(), 1), KVXFER_ROOM_FAILED);
    std::string why = failure(d.get(), 1);
    EXPECT_TRUE(contains(why, "kv buffer 0")) << why;
    EXPECT_TRUE(contains(why, "item_len")) << why;
}

// A scheduler asleep in kvxfer_engine_wait is woken by the room's changes through to
// SUCCESS, by kvxfer_engine_wake, and by kvxfer_engine_free: each wait returns a count
// past the one it was given, which a wait that ran to its (minute-long) timeout would not.
TEST_F(Transfer, AWaitingSchedulerIsWokenByChangesByWakeAndByFree) {
    create(9);
    auto until_success = [](kvxfer_engine *e) {
        for (;;) {
            uint64_t seen = 0, now = 0;
            ASSERT_TRUE(ok(kvxfer_engine_wait(e, 0, 0, &seen)));
            kvxfer_room_state s = poll(e, 9);
            if (s == KVXFER_ROOM_SUCCESS) {
                return;
            }
            ASSERT_NE(s, KVXFER_ROOM_FAILED) << failure(e, 9);
            ASSERT_TRUE(ok(kvxfer_engine_wait(e, seen, 60000, &now)));
            ASSERT_GT(now, seen) << "a wait ran to its timeout";
        }
    };
    std::thread dw([&] { until_success(d_.get()); });
    std::thread pw([&] { until_success(p_.get()); });
    std::vector<uint32_t> src = {0, 1}, dst = {4, 9};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 9, dst.data(), dst.size(), -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_chunk(p_.get(), 9, src.data(), src.size(), true, -1)));
    dw.join();
    pw.join();
    EXPECT_TRUE(pages_equal(src, dst));

    uint64_t seen = 0, woken = 0;
    ASSERT_TRUE(ok(kvxfer_engine_wait(d_.get(), 0, 0, &seen)));
    std::thread w([&] { EXPECT_TRUE(ok(kvxfer_engine_wait(d_.get(), seen, 60000, &woken))); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(ok(kvxfer_engine_wake(d_.get())));
    w.join();
    EXPECT_GT(woken, seen) << "wake did not wake the wait";

    ASSERT_TRUE(ok(kvxfer_engine_wait(d_.get(), 0, 0, &seen)));
    woken = 0;
    kvxfer_engine *d = d_.release();
    std::thread f([&] { EXPECT_TRUE(ok(kvxfer_engine_wait(d, seen, 60000, &woken))); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    kvxfer_engine_free(d);
    f.join();
    EXPECT_GT(woken, seen) << "free did not wake the wait";
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE, kvxfer_engine_wait(d, 0, 0, &woken)));
}

TEST(TransferHpp, ARoundTripThroughTheWrapper) {
    Side src(true), dst(false);
    kvxfer::Config pc, dc;
    pc.set("role", "prefill").set("workers", "1");
    dc.set("role", "decode");
    kvxfer::Engine p(pc), d(dc);
    p.register_kv(src.kv.buffers());
    d.register_kv(dst.kv.buffers());
    p.register_aux(src.aux.buffers());
    d.register_aux(dst.aux.buffers());
    p.create_prefill_room(42);
    d.create_decode_room(42, {p.address()});
    d.set_destination(42, {3, 4, 5}, 1);
    p.enqueue_chunk(42, {7, 8}, false);
    p.enqueue_chunk(42, {9}, true, 0);
    // The scheduler's loop without a timer: poll, then sleep until something changes.
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
        uint64_t ds = d.changes(), ps = p.changes();
        if (kvxfer::is_terminal(d.poll(42)) && kvxfer::is_terminal(p.poll(42))) {
            break;
        }
        if (!kvxfer::is_terminal(d.poll(42))) {
            d.wait(ds, 1000);
        } else {
            p.wait(ps, 1000);
        }
    }
    ASSERT_EQ(d.poll(42), kvxfer::RoomState::Success);
    ASSERT_EQ(p.poll(42), kvxfer::RoomState::Success);
    EXPECT_TRUE(d.drained(42));
    // One process, default settings: the same-host path (same_host=auto), or RDMA where
    // a device is up (transport=auto; the soft-RoCE guest); the same on both sides, and
    // not verified (integrity=off).
    EXPECT_TRUE(d.path(42) == kvxfer::Path::SameHost || d.path(42) == kvxfer::Path::Rdma)
        << static_cast<int>(d.path(42));
    EXPECT_EQ(p.path(42), d.path(42));
    EXPECT_FALSE(d.verified(42));
    for (std::size_t b = 0; b < kBuffers; ++b) {
        EXPECT_EQ(std::memcmp(dst.page(b, 5), src.page(b, 9), kPageBytes), 0) << b;
    }
    EXPECT_EQ(std::memcmp(dst.slot(1), src.slot(0), kAuxBytes), 0);
    d.clear(42);
    p.clear(42);
}

// Layer-wise enqueueing through the C ABI: each layer (a buffer, without layer ids) of
// two chunks handed over in reverse lands as whole chunks would, the aux row with the
// closing call; every refusal with its status and message.
TEST_F(Transfer, LayersEnqueuedInReverseLandAndEveryRefusalSaysWhy) {
    create(1);
    std::vector<uint32_t> dst = {20, 21, 22, 5}, src = {0, 1, 2, 3};
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 1, dst.data(), dst.size(), 3)));
    for (int c = 0; c < 2; ++c) {
        for (uint32_t l = kBuffers; l-- > 0;) {
            const bool last = c == 1 && l == 0;
            ASSERT_TRUE(ok(kvxfer_enqueue_layers(p_.get(), 1, src.data() + 2 * c, 2, l, 1, last,
                                                 last ? 2 : -1)));
        }
    }
    ASSERT_EQ(wait_terminal(d_.get(), 1), KVXFER_ROOM_SUCCESS) << failure(d_.get(), 1);
    ASSERT_EQ(wait_terminal(p_.get(), 1), KVXFER_ROOM_SUCCESS);
    EXPECT_TRUE(pages_equal(src, dst));
    EXPECT_EQ(std::memcmp(dst_.slot(3), src_.slot(2), kAuxBytes), 0) << "aux row";

    // Arguments that name no layer: the call fails, the room lives.
    create(2);
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 2, dst.data(), dst.size(), -1)));
    Result r = result(kvxfer_enqueue_layers(p_.get(), 2, src.data(), 2, 0, 0, false, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "layer_count is 0")) << r;
    r = result(kvxfer_enqueue_layers(p_.get(), 2, src.data(), 2, kBuffers - 1, 2, false, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "layer 8 is out of range")) << r;
    r = result(kvxfer_enqueue_layers(p_.get(), 2, src.data(), 2, 0, 1, false, 1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "only come with the last chunk")) << r;
    r = result(kvxfer_enqueue_layers(d_.get(), 2, src.data(), 2, 0, 1, false, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_ROLE) << r;
    EXPECT_NE(poll(p_.get(), 2), KVXFER_ROOM_FAILED);
    // A layer twice fails the room, naming the chunk and the layer, on both sides.
    ASSERT_TRUE(ok(kvxfer_enqueue_layers(p_.get(), 2, src.data(), 2, 0, 2, false, -1)));
    r = result(kvxfer_enqueue_layers(p_.get(), 2, src.data(), 2, 1, 1, false, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    const std::string want = "chunk 0 (2 pages from source page 0): layer 1 was already enqueued";
    EXPECT_TRUE(contains(r.message, want)) << r;
    ASSERT_EQ(wait_terminal(p_.get(), 2), KVXFER_ROOM_FAILED);
    ASSERT_EQ(wait_terminal(d_.get(), 2), KVXFER_ROOM_FAILED);
    EXPECT_TRUE(contains(failure(p_.get(), 2), want)) << failure(p_.get(), 2);
    EXPECT_TRUE(contains(failure(d_.get(), 2), want)) << failure(d_.get(), 2);
    // After the room failed, a layer is refused with the reason.
    r = result(kvxfer_enqueue_layers(p_.get(), 2, src.data() + 2, 2, 0, 1, false, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_WRONG_STATE) << r;
    EXPECT_TRUE(contains(r.message, want)) << r;
    // Closing the room while a chunk misses a layer fails it naming both.
    create(3);
    ASSERT_TRUE(ok(kvxfer_room_set_destination(d_.get(), 3, dst.data(), dst.size(), -1)));
    ASSERT_TRUE(ok(kvxfer_enqueue_layers(p_.get(), 3, src.data(), 2, 0, kBuffers - 1, false, -1)));
    r = result(kvxfer_enqueue_layers(p_.get(), 3, src.data() + 2, 2, 0, kBuffers, true, -1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "while chunk 0 (2 pages from source page 0) misses layer 7"))
        << r;
    ASSERT_EQ(wait_terminal(p_.get(), 3), KVXFER_ROOM_FAILED);
}

TEST_F(Transfer, LayersThroughTheCppHeader) {
    kvxfer::Config pc, dc;
    pc.set("role", "prefill").set("transport", test_transport());
    dc.set("role", "decode").set("transport", test_transport());
    Side src(true), dst(false);
    kvxfer::Engine p(pc), d(dc);
    p.register_kv(src.kv.buffers());
    d.register_kv(dst.kv.buffers());
    p.create_prefill_room(1);
    d.create_decode_room(1, {p.address()});
    d.set_destination(1, {9, 4});
    p.enqueue_layers(1, {1, 2}, 4, kBuffers - 4, false);
    // Layers 4.. may land, but layer 0 has not been sent: none counts yet.
    EXPECT_EQ(d.layers_landed(1), 0u);
    p.enqueue_layers(1, {1, 2}, 0, 4, true);
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!kvxfer::is_terminal(d.poll(1)) && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(d.poll(1), kvxfer::RoomState::Success);
    EXPECT_EQ(d.layers_landed(1), kBuffers);
    uint32_t n = 0;
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_ROLE, kvxfer_room_layers_landed(p.get(), 1, &n)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_NULL_POINTER, kvxfer_room_layers_landed(d.get(), 1, nullptr)));
    for (std::size_t b = 0; b < kBuffers; ++b) {
        EXPECT_EQ(std::memcmp(dst.page(b, 9), src.page(b, 1), kPageBytes), 0) << b;
        EXPECT_EQ(std::memcmp(dst.page(b, 4), src.page(b, 2), kPageBytes), 0) << b;
    }
    try {
        p.enqueue_layers(1, {1}, 0, 1, true);
        FAIL() << "a closed room takes no layer";
    } catch (const kvxfer::Error &e) {
        EXPECT_EQ(e.code(), KVXFER_ERR_WRONG_STATE) << e.what();
    }
}
