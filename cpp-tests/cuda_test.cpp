// CUDA device memory at registration without a GPU, through the C ABI and kvxfer.hpp: a
// missing driver library, a failing cuInit and a driver without devices each give a
// clear status and message (no crash), host memory is unaffected, and the descriptor's
// struct_size and kind are checked. The failing driver is the test double
// tests/fakecuda/fakecuda.c (KVXFER_FAKECUDA_LIBRARY, built by CMake); it stands in for
// the driver's entry points only, and says nothing about GPU behaviour.
//
// ctest runs each test in a process of its own, so setting KVXFER_CUDA_LIBRARY here
// touches no other test.
#include "kvxfer.hpp"
#include "support.hpp"

#include <cstdlib>
#include <vector>

using namespace kvtest;

namespace {

kvxfer_buffer_desc desc(uint32_t kind, uint32_t device, void *base) {
    kvxfer_buffer_desc d{};
    d.struct_size = sizeof d;
    d.kind = kind;
    d.device = device;
    d.base = base;
    d.len = 4096;
    d.item_len = 1024;
    return d;
}

void *device_address() { return reinterpret_cast<void *>(uintptr_t{0x7000000000}); }

/// An engine on TCP, whatever the suite's default transport (RDMA in the soft-RoCE
/// guest): GPU memory is refused over RDMA before the driver is asked.
EnginePtr tcp_engine(const char *role) { return engine(role, {{"transport", "tcp"}}); }

} // namespace

TEST(Cuda, AMissingDriverLibraryIsTransportUnavailableNamingIt) {
    setenv("KVXFER_CUDA_LIBRARY", "/nonexistent/libcuda-gtest.so.1", 1);
    EnginePtr e = tcp_engine("decode");
    kvxfer_buffer_desc d = desc(KVXFER_MEMORY_CUDA, 0, device_address());
    Result r = result(kvxfer_register_kv_desc(e.get(), &d, nullptr, 1, nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_TRANSPORT_UNAVAILABLE) << r;
    EXPECT_TRUE(contains(r.message, "/nonexistent/libcuda-gtest.so.1")) << r;
    EXPECT_TRUE(contains(r.message, "KVXFER_CUDA_LIBRARY")) << r;
    // Host memory registers as ever, through the same call.
    std::vector<unsigned char> host(4096);
    kvxfer_buffer_desc h = desc(KVXFER_MEMORY_HOST, 0, host.data());
    EXPECT_TRUE(ok(kvxfer_register_kv_desc(e.get(), &h, nullptr, 1, nullptr)));
}

TEST(Cuda, TheDescriptorsStructSizeKindAndDeviceAreChecked) {
    EnginePtr e = tcp_engine("prefill");
    std::vector<unsigned char> host(4096);
    kvxfer_buffer_desc d = desc(KVXFER_MEMORY_HOST, 0, host.data());
    d.struct_size = sizeof d - 8;
    Result r = result(kvxfer_register_kv_desc(e.get(), &d, nullptr, 1, nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "bufs[0].struct_size")) << r;
    d = desc(9, 0, host.data());
    r = result(kvxfer_register_aux_desc(e.get(), &d, 1));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "bufs[0].kind 9")) << r;
    d = desc(KVXFER_MEMORY_HOST, 2, host.data());
    r = result(kvxfer_register_kv_desc(e.get(), &d, nullptr, 1, nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_EQ(kvxfer_register_kv_desc(e.get(), nullptr, nullptr, 0, nullptr),
              KVXFER_ERR_INVALID_ARGUMENT);
}

TEST(Cuda, AFailingCuInitAndADriverWithoutDevicesAreNamed) {
    setenv("KVXFER_CUDA_LIBRARY", KVXFER_FAKECUDA_LIBRARY, 1);
    setenv("FAKECUDA_INIT_ERROR", "100", 1);
    {
        EnginePtr e = tcp_engine("decode");
        kvxfer_buffer_desc d = desc(KVXFER_MEMORY_CUDA, 0, device_address());
        Result r = result(kvxfer_register_kv_desc(e.get(), &d, nullptr, 1, nullptr));
        EXPECT_EQ(r.status, KVXFER_ERR_TRANSPORT_UNAVAILABLE) << r;
        EXPECT_TRUE(contains(r.message, "cuInit")) << r;
        EXPECT_TRUE(contains(r.message, "no CUDA-capable device")) << r;
    }
    unsetenv("FAKECUDA_INIT_ERROR");
    setenv("FAKECUDA_DEVICES", "0", 1);
    EnginePtr e = tcp_engine("decode");
    kvxfer_buffer_desc d = desc(KVXFER_MEMORY_CUDA, 0, device_address());
    Result r = result(kvxfer_register_kv_desc(e.get(), &d, nullptr, 1, nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_TRANSPORT_UNAVAILABLE) << r;
    EXPECT_TRUE(contains(r.message, "sees no CUDA device")) << r;
    // Memory the driver does not know, with a device present.
    setenv("FAKECUDA_DEVICES", "1", 1);
    EnginePtr e2 = tcp_engine("decode");
    r = result(kvxfer_register_kv_desc(e2.get(), &d, nullptr, 1, nullptr));
    EXPECT_EQ(r.status, KVXFER_ERR_INVALID_ARGUMENT) << r;
    EXPECT_TRUE(contains(r.message, "not memory the CUDA driver knows")) << r;
}

TEST(CudaHpp, RegisterKvDescThrowsTheStatusAndMessage) {
    setenv("KVXFER_CUDA_LIBRARY", "/nonexistent/libcuda-hpp.so.1", 1);
    kvxfer::Config c;
    c.set("role", "decode");
    c.set("transport", "tcp");
    kvxfer::Engine e(c);
    try {
        e.register_kv_desc({kvxfer::cuda_buffer(0, device_address(), 4096, 1024)});
        FAIL() << "registered device memory without a driver";
    } catch (const kvxfer::Error &err) {
        EXPECT_EQ(err.code(), KVXFER_ERR_TRANSPORT_UNAVAILABLE);
        EXPECT_TRUE(contains(err.message(), "/nonexistent/libcuda-hpp.so.1")) << err.what();
    }
    std::vector<unsigned char> host(4096);
    e.register_kv_desc({kvxfer::host_buffer(host.data(), host.size(), 1024)});
}
