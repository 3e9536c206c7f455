// Runs the calls made from the C translation unit c_abi_smoke.c.
#include <gtest/gtest.h>

#include <cstddef>

extern "C" int c_abi_smoke(char *why, std::size_t len);

TEST(CHeader, CallsFromACTranslationUnitWork) {
    char why[512];
    EXPECT_EQ(c_abi_smoke(why, sizeof why), 0) << why;
}
