// Both headers in one C++ translation unit, compiled with -Wall -Wextra -Wpedantic
// -Wshadow -Wconversion -Werror (see CMakeLists.txt): kvxfer.hpp must include what it
// needs (it comes first) and be warning-clean for consumers who build strictly.
#include "kvxfer.hpp"
#include "kvxfer.h" // again: the include guard holds

#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>
#include <utility>

// The named structs can be forward-declared (cbindgen style = "both").
struct kvxfer_buffer;
struct kvxfer_metrics;
static_assert(std::is_same<struct kvxfer_metrics, kvxfer_metrics>::value,
              "the typedef names the struct");

// kvxfer::Engine has no room_create overloads any more, between which `{}` silently
// picked the prefill one: the factories name the role.
template <class E, class = void> struct has_room_create : std::false_type {};
template <class E>
struct has_room_create<E, decltype(void(std::declval<E &>().room_create(uint64_t{0}, {})))>
    : std::true_type {};
static_assert(!has_room_create<kvxfer::Engine>::value, "room_create(id, {}) is gone");

static_assert(std::is_base_of<std::runtime_error, kvxfer::Error>::value,
              "kvxfer::Error is a std::runtime_error");
static_assert(!std::is_copy_constructible<kvxfer::Engine>::value &&
                  std::is_nothrow_move_constructible<kvxfer::Engine>::value,
              "an Engine owns its handle: movable, not copyable");
static_assert(!std::is_copy_constructible<kvxfer::Config>::value &&
                  std::is_nothrow_move_constructible<kvxfer::Config>::value,
              "a Config owns its handle: movable, not copyable");
static_assert(std::is_same<std::underlying_type<kvxfer::RoomState>::type, int32_t>::value,
              "RoomState has the C type's width");

TEST(Headers, BothHeadersCompileTogetherInCxx) {
    EXPECT_EQ(kvxfer::version(), KVXFER_VERSION);
}
