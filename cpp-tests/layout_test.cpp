// KV layouts through the C ABI and kvxfer.hpp: kvxfer_register_kv_layout's refusals
// (status and message), its struct_size rule, and a layout refused at the registration
// exchange as both sides' rooms see it.
#include "kvxfer.hpp"
#include "support.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace kvtest;

namespace {

/// GQA: 8 KV heads of 64 fp16 elements, 4-token HND pages, rank 2 of 4 (heads 4..6):
/// 4 x 2 x 64 x 2 = 1024-byte pages.
kvxfer_kv_layout gqa() {
    kvxfer_kv_layout l;
    l.struct_size = sizeof l;
    l.kv_heads = 8;
    l.head_dim = 64;
    l.dtype_bytes = 2;
    l.tp_rank = 2;
    l.tp_size = 4;
    l.page_tokens = 4;
    l.page_order = KVXFER_PAGE_HND;
    l.kind = KVXFER_KV_HEADS;
    return l;
}

/// MLA: a 128-element fp16 latent, 4-token pages (1024 bytes), on one rank.
kvxfer_kv_layout mla() {
    kvxfer_kv_layout l = gqa();
    l.kv_heads = 1;
    l.head_dim = 128;
    l.tp_rank = 0;
    l.tp_size = 1;
    l.kind = KVXFER_KV_LATENT;
    return l;
}

/// kvxfer_register_kv_layout of `mem` with `layout` (and `layer_ids`, if any) on a fresh
/// prefill engine: its status and message.
Result register_on_fresh_engine(const Memory &mem, const kvxfer_kv_layout *layout,
                                const uint32_t *layer_ids = nullptr) {
    EnginePtr e = engine("prefill");
    return result(kvxfer_register_kv_layout(e.get(), mem.data(), layer_ids, mem.size(), layout));
}

/// Asserts INVALID_ARGUMENT with a message containing `part`.
::testing::AssertionResult refused(const Result &r, const std::string &part) {
    if (r.status != KVXFER_ERR_INVALID_ARGUMENT || !contains(r.message, part)) {
        return ::testing::AssertionFailure() << r << ", want INVALID_ARGUMENT with \"" << part
                                             << "\"";
    }
    return ::testing::AssertionSuccess() << r;
}

} // namespace

TEST(KvLayout, AGoodLayoutRegistersOnceWithOrWithoutLayerIds) {
    Memory mem(2, 8, 1024);
    kvxfer_kv_layout l = gqa();
    EnginePtr e = engine("prefill");
    EXPECT_TRUE(ok(kvxfer_register_kv_layout(e.get(), mem.data(), nullptr, mem.size(), &l)));
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_register_kv_layout(e.get(), mem.data(), nullptr, mem.size(), &l)));
    EXPECT_TRUE(contains(last_error(), "already registered")) << last_error();
    EXPECT_TRUE(fails_with(KVXFER_ERR_WRONG_STATE,
                           kvxfer_register_kv(e.get(), mem.data(), mem.size())));
    const uint32_t ids[2] = {3, 3};
    EXPECT_EQ(register_on_fresh_engine(mem, &l, ids).status, KVXFER_OK);
    const uint32_t too_large[2] = {3, 0x80000000u};
    EXPECT_TRUE(refused(register_on_fresh_engine(mem, &l, too_large),
                        "kv buffer 1: layer id 2147483648 is too large"));
}

TEST(KvLayout, NullLayoutIsANullPointer) {
    Memory mem(1, 8, 1024);
    Result r = register_on_fresh_engine(mem, nullptr);
    EXPECT_EQ(r.status, KVXFER_ERR_NULL_POINTER) << r;
    EXPECT_TRUE(contains(r.message, "argument 'layout' is NULL")) << r;
}

TEST(KvLayout, AStructSizeOtherThanTheLibrarysIsRefused) {
    Memory mem(1, 8, 1024);
    const std::string ours = "not sizeof(kvxfer_kv_layout) = " + std::to_string(sizeof(kvxfer_kv_layout));
    for (std::size_t size : {std::size_t{0}, sizeof(std::size_t), sizeof(kvxfer_kv_layout) - 4}) {
        kvxfer_kv_layout l = gqa();
        l.struct_size = size;
        Result r = register_on_fresh_engine(mem, &l);
        EXPECT_TRUE(refused(r, "layout.struct_size is " + std::to_string(size) + ", " + ours));
        EXPECT_TRUE(contains(r.message, "set it to sizeof(kvxfer_kv_layout)")) << r;
    }
    // A caller built against a newer, longer struct: its size is read, nothing past it.
    struct Newer {
        kvxfer_kv_layout l;
        uint32_t appended[2];
    } newer{gqa(), {7, 7}};
    newer.l.struct_size = sizeof newer;
    Result r = register_on_fresh_engine(mem, &newer.l);
    EXPECT_TRUE(refused(r, "layout.struct_size is " + std::to_string(sizeof newer)));
    EXPECT_TRUE(contains(r.message, "newer kvxfer.h")) << r;
}

TEST(KvLayout, UnknownPageOrderAndKindAreRefusedByName) {
    Memory mem(1, 8, 1024);
    kvxfer_kv_layout l = gqa();
    l.page_order = 2;
    EXPECT_TRUE(refused(register_on_fresh_engine(mem, &l),
                        "layout.page_order 2 is neither KVXFER_PAGE_HND (0) nor "
                        "KVXFER_PAGE_NHD (1)"));
    l = gqa();
    l.kind = 9;
    EXPECT_TRUE(refused(register_on_fresh_engine(mem, &l),
                        "layout.kind 9 is neither KVXFER_KV_HEADS (0) nor KVXFER_KV_LATENT (1)"));
}

TEST(KvLayout, EachFailedCheckIsRefusedNamingTheFieldAndValue) {
    Memory mem(1, 8, 1024);
    struct Case {
        const char *what;
        void (*edit)(kvxfer_kv_layout &);
        const char *message;
    };
    const Case cases[] = {
        {"kv_heads 0", [](kvxfer_kv_layout &l) { l.kv_heads = 0; }, "kv layout: kv_heads is 0"},
        {"head_dim 0", [](kvxfer_kv_layout &l) { l.head_dim = 0; }, "kv layout: head_dim is 0"},
        {"dtype_bytes 0", [](kvxfer_kv_layout &l) { l.dtype_bytes = 0; },
         "kv layout: dtype_bytes is 0"},
        {"tp_size 0", [](kvxfer_kv_layout &l) { l.tp_size = 0; }, "kv layout: tp_size is 0"},
        {"page_tokens 0", [](kvxfer_kv_layout &l) { l.page_tokens = 0; },
         "kv layout: page_tokens is 0"},
        {"rank past size", [](kvxfer_kv_layout &l) { l.tp_rank = 4; },
         "kv layout: tp_rank 4 is not below tp_size 4"},
        {"heads not a multiple of the ranks",
         [](kvxfer_kv_layout &l) {
             l.kv_heads = 6;
             l.tp_rank = 0;
         },
         "kv layout: kv_heads 6 is not a multiple of tp_size 4"},
        {"ranks not a multiple of the heads",
         [](kvxfer_kv_layout &l) {
             l.kv_heads = 4;
             l.tp_size = 6;
         },
         "kv layout: tp_size 6 is not a multiple of kv_heads 4"},
        {"a latent of two heads",
         [](kvxfer_kv_layout &l) {
             l.kind = KVXFER_KV_LATENT;
             l.kv_heads = 2;
         },
         "kv layout: kv_heads 2 with kind latent"},
    };
    for (const Case &c : cases) {
        kvxfer_kv_layout l = gqa();
        c.edit(l);
        EXPECT_TRUE(refused(register_on_fresh_engine(mem, &l), c.message)) << c.what;
    }
}

TEST(KvLayout, ABufferWhosePagesAreNotTheLayoutsIsRefusedNamingItAndTheProduct) {
    Memory good(1, 8, 1024), half(1, 16, 512);
    std::vector<kvxfer_buffer> bufs = {good.buffers()[0], half.buffers()[0]};
    kvxfer_kv_layout l = gqa();
    EnginePtr e = engine("decode");
    EXPECT_TRUE(fails_with(KVXFER_ERR_INVALID_ARGUMENT,
                           kvxfer_register_kv_layout(e.get(), bufs.data(), nullptr, bufs.size(), &l)));
    std::string msg = last_error();
    EXPECT_TRUE(contains(msg, "kv buffer 1: item_len 512 differs from the layout's page bytes "
                              "1024 (page_tokens 4 x 2 heads x head_dim 64 x dtype_bytes 2)"))
        << msg;
    // A refused registration registered nothing.
    EXPECT_TRUE(ok(kvxfer_register_kv_layout(e.get(), good.data(), nullptr, good.size(), &l)));
}

TEST(KvLayoutHpp, RegisterKvLayoutSetsTheStructSizeAndChecksTheLayerIds) {
    Memory mem(2, 8, 1024);
    kvxfer::Config c;
    c.set("role", "prefill");
    kvxfer::Engine e(c);
    kvxfer_kv_layout l = gqa();
    l.struct_size = 0; // the wrapper sets it
    try {
        e.register_kv_layout(mem.buffers(), l, {1});
        FAIL() << "two buffers with one layer id were taken";
    } catch (const kvxfer::Error &err) {
        EXPECT_EQ(err.status(), kvxfer::Status::InvalidArgument);
        EXPECT_TRUE(contains(err.message(), "2 buffers but 1 layer ids")) << err.what();
    }
    try {
        l.tp_rank = 7;
        e.register_kv_layout(mem.buffers(), l);
        FAIL() << "tp_rank 7 of 4 was taken";
    } catch (const kvxfer::Error &err) {
        EXPECT_EQ(err.status(), kvxfer::Status::InvalidArgument);
        EXPECT_TRUE(contains(err.message(), "tp_rank 7 is not below tp_size 4")) << err.what();
    }
    l.tp_rank = 3;
    e.register_kv_layout(mem.buffers(), l, {0, 0});
}

TEST(KvLayoutHpp, MlaAgainstMhaIsRefusedAtTheExchangeAndBothRoomsSayWhy) {
    // Both sides' pages are 1024 bytes: only the layouts differ.
    Memory pmem(2, 8, 1024), dmem(2, 8, 1024);
    kvxfer::Config pc, dc;
    pc.set("role", "prefill").set("transport", test_transport()).set("bootstrap_timeout_ms", "1000");
    dc.set("role", "decode").set("transport", test_transport());
    kvxfer::Engine prefill(pc), decode(dc);
    prefill.register_kv_layout(pmem.buffers(), gqa());
    decode.register_kv_layout(dmem.buffers(), mla());
    prefill.create_prefill_room(1);
    decode.create_decode_room(1, {prefill.address()});
    auto terminal = [](const kvxfer::Engine &e, uint64_t room) {
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        kvxfer::RoomState s = e.poll(room);
        while (!kvxfer::is_terminal(s) && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            s = e.poll(room);
        }
        return s;
    };
    const std::string want = "kv kind differs: MLA (latent) on decode, MHA/GQA heads on prefill";
    ASSERT_EQ(terminal(decode, 1), kvxfer::RoomState::Failed);
    EXPECT_EQ(decode.failure_cause(1), kvxfer::FailureCause::Mismatch);
    EXPECT_TRUE(contains(decode.failure(1), want)) << decode.failure(1);
    // The prefill room is named by no decode engine before the exchange: it fails at its
    // bootstrap deadline, quoting the refusal.
    ASSERT_EQ(terminal(prefill, 1), kvxfer::RoomState::Failed);
    EXPECT_EQ(prefill.failure_cause(1), kvxfer::FailureCause::BootstrapTimeout);
    EXPECT_TRUE(contains(prefill.failure(1), want)) << prefill.failure(1);
}

/// Each refusal of the registration exchange, through the C ABI: the decode room fails
/// as MISMATCH with a message naming the field and both values (decode's first). The
/// layouts differ from gqa() in one field each; both sides' buffers fit their own layout.
TEST(KvLayout, EachExchangeRefusalNamesTheFieldAndBothValues) {
    struct Case {
        const char *what;
        kvxfer_kv_layout decode;
        bool decode_has_layout;
        std::string want;
    };
    auto with = [](auto change) {
        kvxfer_kv_layout l = gqa();
        change(l);
        return l;
    };
    const std::vector<Case> cases = {
        {"kv_heads", with([](kvxfer_kv_layout &l) { l.kv_heads = 16; l.tp_size = 8; l.tp_rank = 4; }), true,
         "kv layout kv_heads differs: 16 on decode, 8 on prefill"},
        {"head_dim", with([](kvxfer_kv_layout &l) { l.head_dim = 32; }), true,
         "kv layout head_dim differs: 32 on decode, 64 on prefill"},
        {"dtype_bytes", with([](kvxfer_kv_layout &l) { l.dtype_bytes = 1; }), true,
         "kv layout dtype_bytes differs: 1 on decode, 2 on prefill"},
        {"page_tokens", with([](kvxfer_kv_layout &l) { l.page_tokens = 6; }), true,
         "kv layout page_tokens 6 on decode and 4 on prefill: neither divides the other"},
        {"no layout", gqa(), false, "decode engine registered no kv layout; prefill did"},
    };
    for (const Case &c : cases) {
        SCOPED_TRACE(c.what);
        const uint64_t page_bytes = static_cast<uint64_t>(c.decode.page_tokens) *
                                    (c.decode.kv_heads / c.decode.tp_size) * c.decode.head_dim *
                                    c.decode.dtype_bytes;
        Memory pmem(2, 8, 1024), dmem(2, 8, page_bytes);
        EnginePtr p = engine("prefill"), d = engine("decode");
        kvxfer_kv_layout pl = gqa();
        ASSERT_TRUE(ok(kvxfer_register_kv_layout(p.get(), pmem.data(), nullptr, pmem.size(), &pl)));
        if (c.decode_has_layout) {
            ASSERT_TRUE(ok(kvxfer_register_kv_layout(d.get(), dmem.data(), nullptr, dmem.size(),
                                                     &c.decode)));
        } else {
            ASSERT_TRUE(ok(kvxfer_register_kv(d.get(), dmem.data(), dmem.size())));
        }
        Peers peers({address(p.get())});
        ASSERT_TRUE(ok(kvxfer_room_create(d.get(), 1, peers.ptrs.data(), 1)));
        ASSERT_EQ(wait_terminal(d.get(), 1), KVXFER_ROOM_FAILED);
        EXPECT_EQ(cause_of(d.get(), 1).cause, KVXFER_CAUSE_MISMATCH);
        EXPECT_TRUE(contains(failure(d.get(), 1), c.want)) << failure(d.get(), 1);
    }
}

namespace {

/// The byte at element byte `k` of head `h` of token `t` in buffer `b`: odd, so never
/// the decode side's poison.
unsigned char value(std::size_t b, uint32_t t, uint32_t h, uint32_t k) {
    return static_cast<unsigned char>((b * 131 + t * 31 + h * 7 + k * 3) | 1);
}

/// Offset of byte `k` of head `h` (a model head the rank holds from `h0`, `n` of them)
/// of the token in `slot`, in an HND page of `page_tokens` tokens and `e`-byte heads.
std::size_t hnd(uint32_t slot, uint32_t h, uint32_t k, uint32_t h0, uint32_t page_tokens,
                uint32_t e) {
    return (static_cast<std::size_t>(h - h0) * page_tokens + slot) * e + k;
}

} // namespace

TEST(KvLayoutHpp, FourPrefillRanksFillTwoDecodeRanksHeadByHead) {
    // 8 KV heads of 64 fp16 elements (128 bytes), 4-token HND pages: a prefill rank of
    // TP 4 holds 2 heads (1024-byte pages), a decode rank of TP 2 holds 4 (2048).
    constexpr uint32_t kHeads = 8, kE = 128, kPt = 4, kPages = 8;
    constexpr std::size_t kBufs = 2;
    const std::vector<uint32_t> src = {5, 2, 7}, dst = {6, 1, 3};
    std::vector<std::unique_ptr<Memory>> pmem, dmem;
    std::vector<std::unique_ptr<kvxfer::Engine>> prefills, decodes;
    auto layout = [&](uint32_t rank, uint32_t tp) {
        kvxfer_kv_layout l = gqa();
        l.kv_heads = kHeads;
        l.tp_rank = rank;
        l.tp_size = tp;
        return l;
    };
    auto config = [](const char *role) {
        kvxfer::Config c;
        c.set("role", role).set("transport", test_transport());
        return c;
    };
    std::vector<std::string> addrs;
    for (uint32_t r = 0; r < 4; ++r) {
        pmem.push_back(std::make_unique<Memory>(kBufs, kPages, kPt * 2 * kE));
        for (std::size_t b = 0; b < kBufs; ++b) {
            auto *p = static_cast<unsigned char *>(pmem[r]->buffers()[b].base);
            for (std::size_t i = 0; i < src.size(); ++i) {
                for (uint32_t slot = 0; slot < kPt; ++slot) {
                    for (uint32_t h = 2 * r; h < 2 * r + 2; ++h) {
                        for (uint32_t k = 0; k < kE; ++k) {
                            p[src[i] * kPt * 2 * kE + hnd(slot, h, k, 2 * r, kPt, kE)] =
                                value(b, static_cast<uint32_t>(i) * kPt + slot, h, k);
                        }
                    }
                }
            }
        }
        prefills.push_back(std::make_unique<kvxfer::Engine>(config("prefill")));
        prefills[r]->register_kv_layout(pmem[r]->buffers(), layout(r, 4));
        addrs.push_back(prefills[r]->address());
    }
    for (uint32_t r = 0; r < 2; ++r) {
        dmem.push_back(std::make_unique<Memory>(kBufs, kPages, kPt * 4 * kE));
        for (const auto &buf : dmem[r]->buffers()) {
            std::memset(buf.base, 0xEE, buf.len);
        }
        decodes.push_back(std::make_unique<kvxfer::Engine>(config("decode")));
        decodes[r]->register_kv_layout(dmem[r]->buffers(), layout(r, 2));
        decodes[r]->create_decode_room(1, addrs);
        decodes[r]->set_destination(1, dst);
    }
    for (auto &p : prefills) {
        p->create_prefill_room(1, 2);
        p->enqueue_chunk(1, {src[0], src[1]}, false);
        p->enqueue_chunk(1, {src[2]}, true);
    }
    auto terminal = [](const kvxfer::Engine &e, uint64_t room) {
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        kvxfer::RoomState s = e.poll(room);
        while (!kvxfer::is_terminal(s) && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
            s = e.poll(room);
        }
        return s;
    };
    for (auto &e : decodes) {
        ASSERT_EQ(terminal(*e, 1), kvxfer::RoomState::Success) << e->failure(1);
    }
    for (auto &e : prefills) {
        ASSERT_EQ(terminal(*e, 1), kvxfer::RoomState::Success) << e->failure(1);
    }
    // Each decode rank holds its 4 heads of every token at their place; every other
    // page is untouched.
    for (uint32_t r = 0; r < 2; ++r) {
        for (std::size_t b = 0; b < kBufs; ++b) {
            const auto *p = static_cast<const unsigned char *>(dmem[r]->buffers()[b].base);
            for (uint32_t page = 0; page < kPages; ++page) {
                auto at = std::find(dst.begin(), dst.end(), page);
                for (uint32_t slot = 0; slot < kPt; ++slot) {
                    for (uint32_t h = 4 * r; h < 4 * r + 4; ++h) {
                        for (uint32_t k = 0; k < kE; ++k) {
                            unsigned char want = 0xEE;
                            if (at != dst.end()) {
                                auto j = static_cast<uint32_t>(at - dst.begin());
                                want = value(b, j * kPt + slot, h, k);
                            }
                            const unsigned char got =
                                p[page * kPt * 4 * kE + hnd(slot, h, k, 4 * r, kPt, kE)];
                            ASSERT_EQ(got, want) << "decode rank " << r << " buffer " << b
                                                 << " page " << page << " token slot " << slot
                                                 << " head " << h << " byte " << k;
                        }
                    }
                }
            }
        }
    }
}
