// room_lifecycle: a prefill and a decode engine in one process, over loopback TCP, with a
// realistic KV layout, driving rooms through every ending a scheduler meets: completed
// transfers (bytes checked), cancellations from either side, a stalled prefill and a
// decode engine that never shows up. Prints what happened to every room, by count, and
// exits nonzero if any room ended other than the way its scenario says it must.
//
// Uses only kvxfer.hpp, as an inference server's C++ scheduler would.
#include "kvxfer.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// The layout: MHA with one K and one V buffer per layer.
constexpr std::size_t kLayers = 32;
constexpr std::size_t kKvBuffers = 2 * kLayers;
constexpr std::size_t kPages = 64;
constexpr std::size_t kPageBytes = 16 * 1024;
constexpr std::size_t kAuxSlots = 64;
constexpr std::size_t kAuxBytes = 1024;
constexpr const char *kDeadlineMs = "800";

// One engine's registered memory. Freed only after the engine (declared first).
struct Memory {
    Memory(std::size_t n, std::size_t items, std::size_t item_len, bool fill) {
        for (std::size_t b = 0; b < n; ++b) {
            auto *p = static_cast<unsigned char *>(std::calloc(items, item_len));
            if (p == nullptr) {
                std::fprintf(stderr, "out of memory\n");
                std::exit(2);
            }
            for (std::size_t i = 0; fill && i < items * item_len; ++i) {
                p[i] = static_cast<unsigned char>(b * 131 + i * 7 + i / item_len);
            }
            bufs.push_back(kvxfer_buffer{p, items * item_len, item_len});
        }
    }
    ~Memory() {
        for (auto &b : bufs) {
            std::free(b.base);
        }
    }
    Memory(const Memory &) = delete;
    Memory &operator=(const Memory &) = delete;
    const unsigned char *item(std::size_t b, uint32_t i) const {
        return static_cast<const unsigned char *>(bufs[b].base) + i * bufs[b].item_len;
    }
    std::vector<kvxfer_buffer> bufs;
};

enum class Scenario { Complete, DecodeCancels, PrefillAborts, PrefillStalls, NoDecode };

struct ScenarioInfo {
    Scenario s;
    const char *name;
    int rooms;
    const char *what;
};

const ScenarioInfo kScenarios[] = {
    {Scenario::Complete, "complete", 8,
     "decode grants pages + an aux slot; prefill sends 1-3 chunks, the last with its aux row"},
    {Scenario::DecodeCancels, "client cancels", 4,
     "decode aborts after both sides connected (a client went away)"},
    {Scenario::PrefillAborts, "prefill aborts", 4,
     "prefill aborts after both sides connected (preempted)"},
    {Scenario::PrefillStalls, "prefill stalls", 3,
     "both sides connected, prefill never sends a chunk: waiting deadline"},
    {Scenario::NoDecode, "no decode", 3,
     "prefill creates the room, no decode engine ever asks for it: bootstrap deadline"},
};

struct Ending {
    kvxfer::RoomState state = kvxfer::RoomState::Bootstrapping;
    kvxfer::FailureCause cause = kvxfer::FailureCause::Internal;
    bool from_peer = false;
    std::string reason;
};

struct Room {
    uint64_t id;
    Scenario scenario;
    std::vector<uint32_t> src, dst; // pages
    int64_t src_aux = -1, dst_aux = -1;
    bool on_prefill = true, on_decode = true;
    Ending prefill, decode;
};

Ending ending_of(const kvxfer::Engine &e, uint64_t id) {
    Ending out;
    out.state = e.poll(id);
    if (out.state == kvxfer::RoomState::Failed) {
        out.cause = e.failure_cause(id, &out.from_peer);
        out.reason = e.failure(id);
    }
    return out;
}

// What each scenario must end in, per side. Some endings race by design (two deadlines
// of the same length, one on each side), and both results are correct: the side whose
// deadline fires first fails locally and tells the other, which fails "from the peer".
bool acceptable(Scenario s, bool prefill_side, const Ending &e) {
    using kvxfer::FailureCause;
    using kvxfer::RoomState;
    bool failed = e.state == RoomState::Failed;
    switch (s) {
    case Scenario::Complete:
        return e.state == RoomState::Success;
    case Scenario::DecodeCancels:
        return failed && e.cause == FailureCause::Aborted && e.from_peer == prefill_side;
    case Scenario::PrefillAborts:
        return failed && e.cause == FailureCause::Aborted && e.from_peer == !prefill_side;
    case Scenario::PrefillStalls:
        return failed && e.reason.find("waiting_timeout_ms=") != std::string::npos &&
               (e.from_peer ? e.cause == FailureCause::Aborted
                            : e.cause == FailureCause::WaitingTimeout);
    case Scenario::NoDecode:
        return failed && !e.from_peer && e.cause == FailureCause::BootstrapTimeout;
    }
    return false;
}

std::string template_of(const std::string &reason) {
    static const std::regex room("room [0-9]+");
    static const std::regex addr("[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+:[0-9]+");
    return std::regex_replace(std::regex_replace(reason, room, "room #"), addr, "<addr>");
}

std::string cause_text(const Ending &e) {
    if (e.state != kvxfer::RoomState::Failed) {
        return "-";
    }
    return std::string(kvxfer::to_string(e.cause)) + (e.from_peer ? " (from peer)" : "");
}

bool wait_until(const std::function<bool()> &done, std::chrono::milliseconds limit) {
    auto until = Clock::now() + limit;
    while (!done()) {
        if (Clock::now() >= until) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return true;
}

int run() {
    std::printf("libkvxfer %s (header %s): room lifecycle demo\n\n", kvxfer::version().c_str(),
                KVXFER_VERSION);

    // What this build can move bytes over.
    std::string rdma;
    try {
        kvxfer::Config c;
        c.set("role", "prefill").set("transport", "rdma");
        kvxfer::Engine e(c);
        rdma = "available";
    } catch (const kvxfer::Error &e) {
        rdma = std::string(kvxfer::status_name(e.code())) + " (" + e.message() + ")";
    }
    std::printf("transport   tcp over loopback; transport=rdma -> %s\n", rdma.c_str());

    Memory pkv(kKvBuffers, kPages, kPageBytes, true), paux(1, kAuxSlots, kAuxBytes, true);
    Memory dkv(kKvBuffers, kPages, kPageBytes, false), daux(1, kAuxSlots, kAuxBytes, false);

    kvxfer::Config pc, dc;
    for (kvxfer::Config *c : {&pc, &dc}) {
        c->set("transport", "tcp")
            .set("bootstrap_timeout_ms", kDeadlineMs)
            .set("waiting_timeout_ms", kDeadlineMs)
            .set("log_level", "error");
    }
    pc.set("role", "prefill").set("workers", "2");
    dc.set("role", "decode");
    kvxfer::Engine prefill(pc), decode(dc);
    prefill.register_kv(pkv.bufs);
    prefill.register_aux(paux.bufs);
    decode.register_kv(dkv.bufs);
    decode.register_aux(daux.bufs);

    std::printf("layout      %zu layers x (K, V) = %zu KV buffers x %zu pages x %zu KiB "
                "(%zu MiB per engine); aux 1 buffer x %zu slots x %zu B\n",
                kLayers, kKvBuffers, kPages, kPageBytes / 1024,
                kKvBuffers * kPages * kPageBytes >> 20, kAuxSlots, kAuxBytes);
    std::printf("engines     prefill %s, decode %s\n", prefill.address().c_str(),
                decode.address().c_str());
    std::printf("deadlines   bootstrap_timeout_ms=%s waiting_timeout_ms=%s\n\n", kDeadlineMs,
                kDeadlineMs);

    std::printf("%-16s %5s  %s\n", "scenario", "rooms", "what happens");
    for (const ScenarioInfo &si : kScenarios) {
        std::printf("%-16s %5d  %s\n", si.name, si.rooms, si.what);
    }

    // Plan the rooms: ids from 1, destination pages from a decode-side pool, source
    // pages from the other end of the prefill's pool.
    std::vector<Room> rooms;
    uint32_t next_dst = 0, next_src = kPages - 1;
    int64_t next_slot = 0;
    uint64_t id = 1;
    for (const ScenarioInfo &si : kScenarios) {
        for (int i = 0; i < si.rooms; ++i, ++id) {
            Room r{id, si.s, {}, {}};
            std::size_t n = si.s == Scenario::Complete ? 1 + i % 3 : 2;
            for (std::size_t k = 0; k < n; ++k) {
                r.dst.push_back(next_dst++);
                r.src.push_back(next_src--);
            }
            if (si.s == Scenario::Complete) {
                r.src_aux = next_slot;
                r.dst_aux = kAuxSlots - 1 - next_slot++;
            }
            r.on_decode = si.s != Scenario::NoDecode;
            rooms.push_back(r);
        }
    }

    const std::string peer = prefill.address();
    for (Room &r : rooms) {
        if (r.on_prefill) {
            prefill.create_prefill_room(r.id);
        }
        if (r.on_decode) {
            decode.create_decode_room(r.id, {peer});
            decode.set_destination(r.id, r.dst, r.dst_aux);
        }
        if (r.scenario == Scenario::Complete) {
            // One chunk per page; the aux row travels with the last.
            for (std::size_t k = 0; k < r.src.size(); ++k) {
                bool last = k + 1 == r.src.size();
                prefill.enqueue_chunk(r.id, {r.src[k]}, last, last ? r.src_aux : -1);
            }
        }
    }

    // Cancellations once both sides are connected, so that the other side hears of them.
    for (Room &r : rooms) {
        if (r.scenario != Scenario::DecodeCancels && r.scenario != Scenario::PrefillAborts) {
            continue;
        }
        bool connected = wait_until(
            [&] { return prefill.poll(r.id) == kvxfer::RoomState::WaitingForInput; },
            std::chrono::seconds(5));
        if (!connected) {
            std::printf("room %llu: prefill never received its destination\n",
                        static_cast<unsigned long long>(r.id));
            return 1;
        }
        if (r.scenario == Scenario::DecodeCancels) {
            decode.abort(r.id, "client cancelled");
        } else {
            prefill.abort(r.id, "prefill preempted");
        }
    }

    // Every room on both sides reaches a terminal state.
    auto t0 = Clock::now();
    bool all_terminal = wait_until(
        [&] {
            for (const Room &r : rooms) {
                if ((r.on_prefill && !kvxfer::is_terminal(prefill.poll(r.id))) ||
                    (r.on_decode && !kvxfer::is_terminal(decode.poll(r.id)))) {
                    return false;
                }
            }
            return true;
        },
        std::chrono::seconds(10));
    auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();

    int unexpected = 0;
    std::size_t bytes_checked = 0;
    for (Room &r : rooms) {
        if (r.on_prefill) {
            r.prefill = ending_of(prefill, r.id);
            if (!acceptable(r.scenario, true, r.prefill)) {
                ++unexpected;
                std::printf("UNEXPECTED  room %llu prefill: %s %s %s\n",
                            static_cast<unsigned long long>(r.id),
                            kvxfer::to_string(r.prefill.state), cause_text(r.prefill).c_str(),
                            r.prefill.reason.c_str());
            }
        }
        if (r.on_decode) {
            r.decode = ending_of(decode, r.id);
            if (!acceptable(r.scenario, false, r.decode)) {
                ++unexpected;
                std::printf("UNEXPECTED  room %llu decode: %s %s %s\n",
                            static_cast<unsigned long long>(r.id),
                            kvxfer::to_string(r.decode.state), cause_text(r.decode).c_str(),
                            r.decode.reason.c_str());
            }
            if (kvxfer::is_terminal(r.decode.state) && !decode.drained(r.id)) {
                ++unexpected;
                std::printf("UNEXPECTED  room %llu decode: terminal but not drained\n",
                            static_cast<unsigned long long>(r.id));
            }
        }
        if (r.scenario == Scenario::Complete && r.decode.state == kvxfer::RoomState::Success) {
            for (std::size_t k = 0; k < r.src.size(); ++k) {
                for (std::size_t b = 0; b < kKvBuffers; ++b) {
                    if (std::memcmp(dkv.item(b, r.dst[k]), pkv.item(b, r.src[k]), kPageBytes) !=
                        0) {
                        ++unexpected;
                        std::printf("UNEXPECTED  room %llu: buffer %zu page %u differs\n",
                                    static_cast<unsigned long long>(r.id), b, r.dst[k]);
                    }
                    bytes_checked += kPageBytes;
                }
            }
            if (std::memcmp(daux.item(0, static_cast<uint32_t>(r.dst_aux)),
                            paux.item(0, static_cast<uint32_t>(r.src_aux)), kAuxBytes) != 0) {
                ++unexpected;
                std::printf("UNEXPECTED  room %llu: aux row differs\n",
                            static_cast<unsigned long long>(r.id));
            }
            bytes_checked += kAuxBytes;
        }
    }

    // The table: one line per (scenario, side, ending), with the reason's shape.
    using Key = std::tuple<int, std::string, std::string, std::string, std::string>;
    std::map<Key, int> table;
    for (const Room &r : rooms) {
        int order = static_cast<int>(r.scenario);
        if (r.on_decode) {
            ++table[Key{order, "decode", kvxfer::to_string(r.decode.state), cause_text(r.decode),
                        template_of(r.decode.reason)}];
        }
        if (r.on_prefill) {
            ++table[Key{order, "prefill", kvxfer::to_string(r.prefill.state),
                        cause_text(r.prefill), template_of(r.prefill.reason)}];
        }
    }
    std::printf("\noutcomes (rooms by scenario, side and ending; %s after %lld ms)\n",
                all_terminal ? "every room terminal" : "NOT every room terminal",
                static_cast<long long>(waited));
    std::printf("%-16s %-8s %5s  %-8s %-28s %s\n", "scenario", "side", "rooms", "state", "cause",
                "reason");
    for (const auto &row : table) {
        const Key &k = row.first;
        std::printf("%-16s %-8s %5d  %-8s %-28s %s\n", kScenarios[std::get<0>(k)].name,
                    std::get<1>(k).c_str(), row.second, std::get<2>(k).c_str(),
                    std::get<3>(k).c_str(), std::get<4>(k).empty() ? "-" : std::get<4>(k).c_str());
    }
    std::printf("\nbytes       %zu KiB compared, decode pages against prefill pages\n",
                bytes_checked / 1024);

    // Clear every room on both sides; the ids are then unknown, and free for reuse.
    int cleared = 0;
    for (const Room &r : rooms) {
        if (r.on_prefill) {
            prefill.clear(r.id);
            ++cleared;
        }
        if (r.on_decode) {
            decode.clear(r.id);
            ++cleared;
        }
    }
    std::string after_clear = "no error";
    try {
        (void)decode.poll(rooms.front().id);
    } catch (const kvxfer::Error &e) {
        after_clear = kvxfer::status_name(e.code());
    }
    if (after_clear != "KVXFER_ERR_NOT_FOUND") {
        ++unexpected;
    }
    std::printf("cleared     %d rooms; polling a cleared room gives %s\n", cleared,
                after_clear.c_str());

    // Reuse id 1 for a fresh transfer.
    const Room &first = rooms.front();
    prefill.create_prefill_room(first.id);
    decode.create_decode_room(first.id, {peer});
    decode.set_destination(first.id, first.dst);
    prefill.enqueue_chunk(first.id, first.src, true);
    wait_until([&] { return kvxfer::is_terminal(decode.poll(first.id)) &&
                            kvxfer::is_terminal(prefill.poll(first.id)); },
               std::chrono::seconds(5));
    kvxfer::RoomState reused = decode.poll(first.id);
    if (reused != kvxfer::RoomState::Success ||
        prefill.poll(first.id) != kvxfer::RoomState::Success) {
        ++unexpected;
    }
    std::printf("reuse       room %llu created again after the clear: %s\n",
                static_cast<unsigned long long>(first.id), kvxfer::to_string(reused));

    if (!all_terminal) {
        ++unexpected;
    }
    if (unexpected != 0) {
        std::printf("\nresult      %d unexpected outcome(s)\n", unexpected);
        return 1;
    }
    std::printf("\nresult      every room ended as its scenario requires\n");
    return 0;
}

} // namespace

int main() {
    try {
        return run();
    } catch (const kvxfer::Error &e) {
        std::fprintf(stderr, "room_lifecycle: %s\n", e.what());
        return 1;
    }
}
