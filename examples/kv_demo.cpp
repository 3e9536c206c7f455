// libkvxfer demo: a prefill process and a decode process moving a realistically shaped
// KV cache over loopback TCP, with chunked prefill and client cancellations from either
// side, every delivered page verified byte for byte on the decode side.
//
//   kv_demo [--requests N] [--concurrency C] [--seed S] [--abort-pct P]
//
// The program is the decode process; it starts itself again as the prefill process
// (`--role prefill`). Both derive the same request plan from the seed, so the only thing
// they exchange outside libkvxfer is the prefill engine's address and, at the end, the
// prefill's own statistics.
#include "kvxfer.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

// Llama-3-8B-like KV layout at TP=1: 32 layers, separate K and V buffers, 8 KV heads,
// head dim 128, bf16, 16-token pages: 8 * 128 * 2 * 16 = 32 KiB per page per buffer.
constexpr std::size_t kLayers = 32;
constexpr std::size_t kBuffers = 2 * kLayers;
constexpr std::size_t kPageTokens = 16;
constexpr std::size_t kPageBytes = 8 * 128 * 2 * kPageTokens;
constexpr std::size_t kAuxSlots = 64;
constexpr std::size_t kAuxBytes = 256; // per-request metadata row (first token, logprobs...)
constexpr unsigned char kPoison = 0xEE;

using Clock = std::chrono::steady_clock;

struct Options {
    int requests = 240;
    int concurrency = 8;
    uint64_t seed = 42;
    int abort_pct = 10;
    int min_tokens = 64;
    int max_tokens = 1024;
    int chunk_tokens = 256;
};

enum class AbortBy { None, Decode, Prefill };

// One request, derived identically by both processes from (seed, index).
struct Plan {
    uint64_t room;
    std::size_t pages;
    std::size_t chunk_pages;
    AbortBy abort_by;
    std::size_t abort_after_chunks; // prefill: abort after this many chunks
};

Plan plan(const Options &o, int i) {
    std::mt19937_64 rng(o.seed * 1000003ULL + static_cast<uint64_t>(i));
    Plan p{};
    p.room = (o.seed << 32) ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(i + 1));
    std::uniform_int_distribution<int> tokens(o.min_tokens, o.max_tokens);
    p.pages = (static_cast<std::size_t>(tokens(rng)) + kPageTokens - 1) / kPageTokens;
    p.chunk_pages = std::max<std::size_t>(1, static_cast<std::size_t>(o.chunk_tokens) / kPageTokens);
    int r = static_cast<int>(rng() % 100);
    p.abort_by = r < o.abort_pct / 2 ? AbortBy::Decode
                 : r < o.abort_pct   ? AbortBy::Prefill
                                     : AbortBy::None;
    std::size_t chunks = (p.pages + p.chunk_pages - 1) / p.chunk_pages;
    p.abort_after_chunks = chunks > 1 ? 1 + rng() % (chunks - 1) : 0;
    return p;
}

// The byte pattern of page `j` of request `room` in buffer `b`: one of kBank random
// pages (the same in both processes), chosen by (room, b, j), whose first 16 bytes are
// replaced by (room, b, j) themselves. A page from another request, buffer or position,
// a page left unwritten (the decode side poisons pages between uses) or a shifted or
// partial write all differ from it; filling and checking are a memcpy and a memcmp.
constexpr std::size_t kBank = 61;
constexpr std::size_t kTag = 16;

const unsigned char *bank_page(uint64_t room, std::size_t b, std::size_t j) {
    static const std::vector<unsigned char> bank = [] {
        std::vector<unsigned char> v(kBank * kPageBytes);
        std::mt19937_64 rng(0x6b7678666572ULL);
        for (std::size_t i = 0; i < v.size(); i += 8) {
            uint64_t x = rng();
            std::memcpy(&v[i], &x, 8);
        }
        return v;
    }();
    uint64_t h = (room ^ (b * 0x9E3779B97F4A7C15ULL)) * 1000003ULL + j;
    return bank.data() + (h % kBank) * kPageBytes;
}

void tag_of(unsigned char *tag, uint64_t room, std::size_t b, std::size_t j) {
    uint64_t where = (static_cast<uint64_t>(b) << 32) | j;
    std::memcpy(tag, &room, 8);
    std::memcpy(tag + 8, &where, 8);
}

void fill_page(unsigned char *dst, uint64_t room, std::size_t b, std::size_t j) {
    std::memcpy(dst, bank_page(room, b, j), kPageBytes);
    tag_of(dst, room, b, j);
}

bool page_ok(const unsigned char *page, uint64_t room, std::size_t b, std::size_t j) {
    unsigned char tag[kTag];
    tag_of(tag, room, b, j);
    return std::memcmp(page, tag, kTag) == 0 &&
           std::memcmp(page + kTag, bank_page(room, b, j) + kTag, kPageBytes - kTag) == 0;
}

void fill_aux(unsigned char *dst, uint64_t room) {
    for (std::size_t i = 0; i < kAuxBytes; ++i) dst[i] = static_cast<unsigned char>(room >> (i % 8 * 8)) ^ static_cast<unsigned char>(i);
}

// Registered memory: kBuffers buffers of `pages` pages, plus one aux buffer, and a free
// list of page indices (the scheduler's page allocator).
struct Pool {
    Pool(std::size_t pages, unsigned char fill) : pages(pages) {
        for (std::size_t b = 0; b < kBuffers; ++b) {
            kv.emplace_back(new unsigned char[pages * kPageBytes]);
            std::memset(kv.back().get(), fill, pages * kPageBytes);
        }
        aux.reset(new unsigned char[kAuxSlots * kAuxBytes]);
        std::memset(aux.get(), fill, kAuxSlots * kAuxBytes);
        for (std::size_t p = 0; p < pages; ++p) free_pages.push_back(static_cast<uint32_t>(p));
        for (std::size_t s = 0; s < kAuxSlots; ++s) free_slots.push_back(static_cast<uint32_t>(s));
    }
    void register_with(kvxfer::Engine &e) {
        std::vector<kvxfer_buffer> bufs;
        for (auto &b : kv) bufs.push_back({b.get(), pages * kPageBytes, kPageBytes});
        e.register_kv(bufs);
        e.register_aux({{aux.get(), kAuxSlots * kAuxBytes, kAuxBytes}});
    }
    bool take(std::size_t n, std::vector<uint32_t> &out, uint32_t &slot) {
        if (free_pages.size() < n || free_slots.empty()) return false;
        out.assign(free_pages.begin(), free_pages.begin() + static_cast<std::ptrdiff_t>(n));
        free_pages.erase(free_pages.begin(), free_pages.begin() + static_cast<std::ptrdiff_t>(n));
        slot = free_slots.front();
        free_slots.pop_front();
        return true;
    }
    void give_back(const std::vector<uint32_t> &p, uint32_t slot) {
        free_pages.insert(free_pages.end(), p.begin(), p.end());
        free_slots.push_back(slot);
    }
    unsigned char *page(std::size_t b, uint32_t p) { return kv[b].get() + p * kPageBytes; }
    unsigned char *slot(uint32_t s) { return aux.get() + s * kAuxBytes; }

    std::size_t pages;
    std::vector<std::unique_ptr<unsigned char[]>> kv;
    std::unique_ptr<unsigned char[]> aux;
    std::deque<uint32_t> free_pages;
    std::deque<uint32_t> free_slots;
};

kvxfer::Config config(const char *role) {
    kvxfer::Config c;
    c.set("role", role);
    c.set("transport", "tcp");
    c.set("listen", "127.0.0.1:0");
    c.set("workers", "2");
    c.set("connections_per_peer", "2");
    c.set("log_level", "error");
    return c;
}

double ms_since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

double percentile(std::vector<double> v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    std::size_t i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

std::size_t pool_pages(const Options &o) {
    return static_cast<std::size_t>(o.concurrency) *
           ((static_cast<std::size_t>(o.max_tokens) + kPageTokens - 1) / kPageTokens);
}

// ------------------------------------------------------------------ prefill process ---

int run_prefill(const Options &o) {
    Pool pool(pool_pages(o), 0);
    kvxfer::Engine e(config("prefill"));
    pool.register_with(e);
    std::printf("ADDR %s\n", e.address().c_str());
    std::fflush(stdout);

    struct Live {
        Plan p;
        std::vector<uint32_t> src;
        uint32_t slot;
        std::size_t sent = 0;
        Clock::time_point created;
        // When a poll first saw the room past BOOTSTRAPPING: the decode side's destination
        // had arrived (the decode process creates its room only once it has a free slot,
        // so a prefill room can wait seconds for it).
        Clock::time_point ready;
        bool seen_ready = false;
        bool aborted = false;
    };
    std::deque<Live> live;
    // Per request that succeeded: the destination's arrival to SUCCESS (the transfer as
    // the prefill side sees it), and the wait before it for the decode side.
    std::vector<double> latency, waited;
    int next = 0, ok = 0, failed = 0;
    while (next < o.requests || !live.empty()) {
        while (next < o.requests && static_cast<int>(live.size()) < o.concurrency) {
            Live l{plan(o, next), {}, 0, 0, Clock::now()};
            if (!pool.take(l.p.pages, l.src, l.slot)) break;
            ++next;
            for (std::size_t j = 0; j < l.p.pages; ++j)
                for (std::size_t b = 0; b < kBuffers; ++b) fill_page(pool.page(b, l.src[j]), l.p.room, b, j);
            fill_aux(pool.slot(l.slot), l.p.room);
            e.create_prefill_room(l.p.room, 1);
            l.created = Clock::now();
            live.push_back(std::move(l));
        }
        // One chunk per live room per pass: chunked prefill interleaves requests.
        for (auto &l : live) {
            if (l.aborted || l.sent * l.p.chunk_pages >= l.p.pages) continue;
            if (kvxfer::is_terminal(e.poll(l.p.room))) {
                l.sent = l.p.pages; // the decode side aborted: stop computing this request
                continue;
            }
            if (l.p.abort_by == AbortBy::Prefill && l.sent == l.p.abort_after_chunks) {
                e.abort(l.p.room, "prefill scheduler preempted the request");
                l.aborted = true;
                continue;
            }
            std::size_t from = l.sent * l.p.chunk_pages;
            std::size_t to = std::min(l.p.pages, from + l.p.chunk_pages);
            std::vector<uint32_t> chunk(l.src.begin() + static_cast<std::ptrdiff_t>(from),
                                        l.src.begin() + static_cast<std::ptrdiff_t>(to));
            bool last = to == l.p.pages;
            try {
                e.enqueue_chunk(l.p.room, chunk, last, last ? static_cast<int64_t>(l.slot) : -1);
            } catch (const kvxfer::Error &err) {
                if (err.code() != KVXFER_ERR_WRONG_STATE) throw; // the room ended meanwhile
            }
            ++l.sent;
        }
        for (auto it = live.begin(); it != live.end();) {
            kvxfer::RoomState s = e.poll(it->p.room);
            if (s != kvxfer::RoomState::Bootstrapping && !it->seen_ready) {
                it->ready = Clock::now();
                it->seen_ready = true;
            }
            if (!kvxfer::is_terminal(s)) { ++it; continue; }
            if (s == kvxfer::RoomState::Success) {
                ++ok;
                latency.push_back(ms_since(it->ready));
                waited.push_back(std::chrono::duration<double, std::milli>(it->ready - it->created).count());
            } else {
                ++failed;
            }
            e.clear(it->p.room);
            pool.give_back(it->src, it->slot);
            it = live.erase(it);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    kvxfer_metrics m = e.metrics();
    std::printf("PREFILL ok=%d failed=%d, destination -> success p50=%.2f p99=%.2f ms "
                "(before it, waiting for the decode's destination p50=%.2f p99=%.2f ms), bytes_sent=%" PRIu64 "\n",
                ok, failed, percentile(latency, 0.5), percentile(latency, 0.99), percentile(waited, 0.5),
                percentile(waited, 0.99), m.bytes_sent);
    std::fflush(stdout);
    // Stay up until the decode process has seen everything it needs.
    char buf[16];
    while (read(STDIN_FILENO, buf, sizeof buf) > 0) {
    }
    return 0;
}

// ------------------------------------------------------------------- decode process ---

struct Child {
    pid_t pid = -1;
    FILE *out = nullptr;
    int in = -1;
};

Child start_prefill(const char *self, const Options &o) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) { std::perror("pipe"); std::exit(2); }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(to_child[0], STDIN_FILENO);
        dup2(from_child[1], STDOUT_FILENO);
        close(to_child[1]);
        close(from_child[0]);
        std::string n = std::to_string(o.requests), c = std::to_string(o.concurrency),
                    s = std::to_string(o.seed), a = std::to_string(o.abort_pct);
        execl("/proc/self/exe", self, "--role", "prefill", "--requests", n.c_str(), "--concurrency", c.c_str(),
              "--seed", s.c_str(), "--abort-pct", a.c_str(), static_cast<char *>(nullptr));
        std::perror("exec");
        _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    return Child{pid, fdopen(from_child[0], "r"), to_child[1]};
}

std::string read_line(FILE *f, const char *prefix) {
    char line[512];
    while (std::fgets(line, sizeof line, f) != nullptr) {
        if (std::strncmp(line, prefix, std::strlen(prefix)) == 0) {
            std::string s(line + std::strlen(prefix));
            while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
            return s;
        }
    }
    return {};
}

int run_decode(const char *self, const Options &o) {
    Child child = start_prefill(self, o);
    std::string addr = read_line(child.out, "ADDR ");
    if (addr.empty()) { std::fprintf(stderr, "prefill process did not start\n"); return 2; }

    Pool pool(pool_pages(o), kPoison);
    kvxfer::Engine e(config("decode"));
    pool.register_with(e);

    struct Live {
        Plan p;
        std::vector<uint32_t> dst;
        uint32_t slot;
        Clock::time_point start;
        bool aborted = false;
    };
    std::deque<Live> live;
    std::vector<double> latency;
    std::map<std::string, int> reasons;
    int next = 0, ok = 0, failed = 0, expected_failed = 0, bad_pages = 0, unexpected = 0;
    uint64_t verified_bytes = 0;
    std::vector<unsigned char> expect_aux(kAuxBytes);
    auto t0 = Clock::now();
    // The transfer window: the intervals between two polling passes after which a room
    // was TRANSFERRING or had just reached SUCCESS (bytes moved in it). Checking one
    // room's pages while others move is inside it, so the figure from it is if anything
    // too low; the end-to-end figure includes everything.
    double window = 0, check_secs = 0;
    auto pass = Clock::now();
    while (next < o.requests || !live.empty()) {
        auto now = Clock::now();
        bool moving = false;
        // Read before polling: a room that changes state after it wakes the wait below.
        uint64_t seen = e.changes();
        while (next < o.requests && static_cast<int>(live.size()) < o.concurrency) {
            Live l{plan(o, next), {}, 0, Clock::now()};
            if (!pool.take(l.p.pages, l.dst, l.slot)) break;
            ++next;
            // Scatter the destination: reverse every other request's page list.
            if (next % 2 == 0) std::reverse(l.dst.begin(), l.dst.end());
            e.create_decode_room(l.p.room, {addr});
            e.set_destination(l.p.room, l.dst, l.slot);
            l.start = Clock::now();
            live.push_back(std::move(l));
        }
        for (auto it = live.begin(); it != live.end();) {
            Live &l = *it;
            kvxfer::RoomState s = e.poll(l.p.room);
            if (s == kvxfer::RoomState::Transferring || s == kvxfer::RoomState::Success) moving = true;
            if (l.p.abort_by == AbortBy::Decode && !l.aborted && s == kvxfer::RoomState::Transferring) {
                e.abort(l.p.room, "client cancelled the request");
                l.aborted = true;
                continue;
            }
            if (!kvxfer::is_terminal(s)) { ++it; continue; }
            bool should_fail = l.p.abort_by != AbortBy::None;
            auto checked = Clock::now();
            if (s == kvxfer::RoomState::Success) {
                ++ok;
                latency.push_back(ms_since(l.start));
                for (std::size_t j = 0; j < l.p.pages; ++j) {
                    for (std::size_t b = 0; b < kBuffers; ++b) {
                        if (!page_ok(pool.page(b, l.dst[j]), l.p.room, b, j)) ++bad_pages;
                        else verified_bytes += kPageBytes;
                    }
                }
                fill_aux(expect_aux.data(), l.p.room);
                if (std::memcmp(pool.slot(l.slot), expect_aux.data(), kAuxBytes) != 0) ++bad_pages;
                // A planned abort may lose the race against completion: that is allowed.
            } else {
                ++failed;
                if (should_fail) ++expected_failed; else ++unexpected;
                bool peer = false;
                kvxfer::FailureCause c = e.failure_cause(l.p.room, &peer);
                reasons[std::string(kvxfer::to_string(c)) + (peer ? " (from prefill)" : " (local)")]++;
                if (!should_fail) std::fprintf(stderr, "room %" PRIu64 " failed: %s\n", l.p.room, e.failure(l.p.room).c_str());
                // Pages may be reused only once no write can still land.
                while (!e.drained(l.p.room)) std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
            for (uint32_t p : l.dst)
                for (std::size_t b = 0; b < kBuffers; ++b) std::memset(pool.page(b, p), kPoison, kPageBytes);
            std::memset(pool.slot(l.slot), kPoison, kAuxBytes);
            check_secs += std::chrono::duration<double>(Clock::now() - checked).count();
            e.clear(l.p.room);
            pool.give_back(l.dst, l.slot);
            it = live.erase(it);
        }
        if (moving) window += std::chrono::duration<double>(now - pass).count();
        pass = now;
        // Nothing to do until a room changes state: sleep until one does.
        e.wait(seen, 100);
    }
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    std::string prefill = read_line(child.out, "PREFILL ");
    close(child.in);
    int status = 0;
    waitpid(child.pid, &status, 0);
    kvxfer_metrics m = e.metrics();

    std::printf("\nlibkvxfer demo: prefill -> decode over loopback TCP (two processes)\n");
    std::printf("  model: %zu layers x K,V = %zu buffers, %zu-token pages, %zu KiB per page per buffer\n",
                kLayers, kBuffers, kPageTokens, kPageBytes / 1024);
    std::printf("  requests: %d, %d-%d tokens, %d-token chunks, %d in flight, %d%% aborted by plan\n\n",
                o.requests, o.min_tokens, o.max_tokens, o.chunk_tokens, o.concurrency, o.abort_pct);
    std::printf("  %-34s %12s\n", "outcome", "requests");
    std::printf("  %-34s %12d\n", "success (every page verified)", ok);
    std::printf("  %-34s %12d\n", "failed as planned (aborts)", expected_failed);
    std::printf("  %-34s %12d\n", "failed unexpectedly", unexpected);
    std::printf("  %-34s %12d\n", "pages with wrong bytes", bad_pages);
    std::printf("\n  %-34s %12.2f GiB\n", "KV bytes delivered and verified", static_cast<double>(verified_bytes) / (1 << 30));
    std::printf("  %-34s %12.2f GiB\n", "bytes received (incl. aborted)", static_cast<double>(m.bytes_received) / (1 << 30));
    std::printf("  %-34s %12.2f s\n", "wall time", secs);
    std::printf("  %-34s %12.2f s\n", "  of it checking and resetting pages", check_secs);
    std::printf("  %-34s %12.2f GB/s\n", "end to end (verified bytes / wall)", static_cast<double>(verified_bytes) / secs / 1e9);
    std::printf("  %-34s %12.2f GB/s\n", "transfer (received / time moving)",
                window > 0 ? static_cast<double>(m.bytes_received) / window / 1e9 : 0.0);
    std::printf("  %-34s %12.2f ms\n", "decode latency p50 (dest->success)", percentile(latency, 0.5));
    std::printf("  %-34s %12.2f ms\n", "decode latency p99", percentile(latency, 0.99));
    std::printf("  %-34s %s\n", "prefill side", prefill.c_str());
    std::printf("\n  %-34s %12s\n", "failure reason", "count");
    for (auto &r : reasons) std::printf("  %-34s %12d\n", r.first.c_str(), r.second);
    std::printf("\n  decode engine: rooms created %" PRIu64 ", succeeded %" PRIu64 ", failed %" PRIu64
                ", in flight %" PRIu64 ", dropped frames %" PRIu64 "\n",
                m.rooms_created, m.rooms_succeeded, m.rooms_failed, m.inflight, m.dropped_frames);
    bool good = bad_pages == 0 && unexpected == 0 && ok + failed == o.requests && m.inflight == 0 &&
                WIFEXITED(status) && WEXITSTATUS(status) == 0;
    std::printf("\n  %s\n", good ? "OK: every request reached a terminal state; every delivered page verified"
                                 : "FAILED: see above");
    return good ? 0 : 1;
}

} // namespace

int main(int argc, char **argv) {
    Options o;
    std::string role = "decode";
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string k = argv[i], v = argv[i + 1];
        if (k == "--role") role = v;
        else if (k == "--requests") o.requests = std::atoi(v.c_str());
        else if (k == "--concurrency") o.concurrency = std::max(1, std::atoi(v.c_str()));
        else if (k == "--seed") o.seed = std::strtoull(v.c_str(), nullptr, 10);
        else if (k == "--abort-pct") o.abort_pct = std::atoi(v.c_str());
        else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
    }
    try {
        return role == "prefill" ? run_prefill(o) : run_decode(argv[0], o);
    } catch (const kvxfer::Error &e) {
        std::fprintf(stderr, "%s: %s\n", role.c_str(), e.what());
        return 1;
    }
}
