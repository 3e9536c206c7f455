/* fakecuda: a test double of the CUDA driver API, over host memory.
 *
 * It implements the subset of driver entry points libkvxfer loads (src/cuda/driver.rs)
 * so that the engine's real CUDA code path (loading the driver, checking registered
 * device buffers against pointer attributes, pinned staging, async copies and events)
 * runs on a machine without a GPU. Point the engine at it with
 * KVXFER_CUDA_LIBRARY=/path/to/libfakecuda.so.
 *
 * What it proves: the engine's use of the driver API and its pipelines. What it does not:
 * anything about GPU behaviour or speed. "Device" memory here is host memory (memfd-backed
 * mappings registered in a table, so cuPointerGetAttribute knows them); async copies are
 * done synchronously at issue time; events are always complete.
 *
 * Knobs, read at each call: FAKECUDA_INIT_ERROR=<CUresult> makes cuInit fail with that
 * code; FAKECUDA_DEVICES=<n> is the device count (default 1).
 *
 * Test API (not CUDA): fakecuda_alloc(device, size) and fakecuda_alloc_vmm(device,
 * chunk, n_chunks) return "device" memory (the VMM form reserves one range and maps n
 * chunks of their own memfd into it, each its own allocation, as cuMemCreate + cuMemMap
 * of several physical allocations); fakecuda_free(ptr) releases either.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;

enum {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
};

struct alloc {
    uintptr_t base;
    size_t size;
    int device;
    uintptr_t reservation; /* first byte of the VMM reservation it belongs to, or 0 */
    size_t reservation_size;
    int fd;
};

#define MAX_ALLOCS 4096
static struct alloc allocs[MAX_ALLOCS];
static int n_allocs;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int contexts[64];
static __thread void *ctx_stack[16];
static __thread int ctx_depth;

static int device_count(void) {
    const char *s = getenv("FAKECUDA_DEVICES");
    int n = s ? atoi(s) : 1;
    return n < 0 ? 0 : (n > 64 ? 64 : n);
}

CUresult cuInit(unsigned flags) {
    const char *e = getenv("FAKECUDA_INIT_ERROR");
    if (flags != 0) {
        return INVALID_VALUE;
    }
    if (e && *e) {
        initialized = 0;
        return atoi(e);
    }
    initialized = 1;
    return SUCCESS;
}

CUresult cuDeviceGetCount(int *n) {
    if (!initialized) {
        return NOT_INITIALIZED;
    }
    *n = device_count();
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!initialized) {
        return NOT_INITIALIZED;
    }
    if (ordinal < 0 || ordinal >= device_count()) {
        return INVALID_DEVICE;
    }
    *d = ordinal;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    if (d < 0 || d >= device_count()) {
        return INVALID_DEVICE;
    }
    *ctx = &contexts[d];
    return SUCCESS;
}

CUresult cuCtxPushCurrent_v2(void *ctx) {
    if (ctx_depth == 16 || ctx == NULL) {
        return INVALID_CONTEXT;
    }
    ctx_stack[ctx_depth++] = ctx;
    return SUCCESS;
}

CUresult cuCtxPopCurrent_v2(void **ctx) {
    if (ctx_depth == 0) {
        return INVALID_CONTEXT;
    }
    void *c = ctx_stack[--ctx_depth];
    if (ctx) {
        *ctx = c;
    }
    return SUCCESS;
}

static const struct alloc *find(uintptr_t p) {
    for (int i = 0; i < n_allocs; i++) {
        if (allocs[i].size && p >= allocs[i].base && p - allocs[i].base < allocs[i].size) {
            return &allocs[i];
        }
    }
    return NULL;
}

CUresult cuPointerGetAttribute(void *data, unsigned attr, CUdeviceptr ptr) {
    if (!initialized) {
        return NOT_INITIALIZED;
    }
    if (ctx_depth == 0) {
        return INVALID_CONTEXT;
    }
    pthread_mutex_lock(&lock);
    const struct alloc *a = find((uintptr_t)ptr);
    struct alloc copy = a ? *a : (struct alloc){0};
    pthread_mutex_unlock(&lock);
    if (!a) {
        return INVALID_VALUE;
    }
    switch (attr) {
    case 2: /* MEMORY_TYPE */
        *(unsigned *)data = 2; /* CU_MEMORYTYPE_DEVICE */
        return SUCCESS;
    case 9: /* DEVICE_ORDINAL */
        *(int *)data = copy.device;
        return SUCCESS;
    case 11: /* RANGE_START_ADDR */
        *(CUdeviceptr *)data = copy.base;
        return SUCCESS;
    case 12: /* RANGE_SIZE */
        *(size_t *)data = copy.size;
        return SUCCESS;
    default:
        return INVALID_VALUE;
    }
}

CUresult cuGetErrorString(CUresult r, const char **s) {
    switch (r) {
    case SUCCESS: *s = "no error"; return SUCCESS;
    case INVALID_VALUE: *s = "invalid argument"; return SUCCESS;
    case OUT_OF_MEMORY: *s = "out of memory"; return SUCCESS;
    case NOT_INITIALIZED: *s = "initialization error"; return SUCCESS;
    case NO_DEVICE: *s = "no CUDA-capable device is detected"; return SUCCESS;
    case INVALID_DEVICE: *s = "invalid device ordinal"; return SUCCESS;
    case INVALID_CONTEXT: *s = "invalid device context"; return SUCCESS;
    default: return INVALID_VALUE;
    }
}

CUresult cuMemHostAlloc(void **p, size_t size, unsigned flags) {
    (void)flags;
    void *m = NULL;
    if (posix_memalign(&m, 4096, size ? size : 1) != 0) {
        return OUT_OF_MEMORY;
    }
    *p = m;
    return SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    free(p);
    return SUCCESS;
}

CUresult cuStreamCreate(void **s, unsigned flags) {
    (void)flags;
    *s = malloc(1);
    return *s ? SUCCESS : OUT_OF_MEMORY;
}

CUresult cuStreamDestroy_v2(void *s) {
    free(s);
    return SUCCESS;
}

/* Copies are checked against the table (every byte of the device side must lie in a
 * live allocation: a copy may span the allocations mapped one after the other in a VMM
 * range, as on a GPU) and done at once. */
static CUresult copy_checked(void *dst, const void *src, size_t n, uintptr_t dev) {
    pthread_mutex_lock(&lock);
    int ok = 1;
    uintptr_t at = dev, end = dev + n;
    while (ok && at < end) {
        const struct alloc *a = find(at);
        ok = a != NULL;
        if (ok) {
            at = a->base + a->size;
        }
    }
    pthread_mutex_unlock(&lock);
    if (!ok) {
        return INVALID_VALUE;
    }
    memcpy(dst, src, n);
    return SUCCESS;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    (void)stream;
    return copy_checked(dst, (const void *)(uintptr_t)src, n, (uintptr_t)src);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    (void)stream;
    return copy_checked((void *)(uintptr_t)dst, src, n, (uintptr_t)dst);
}

CUresult cuEventCreate(void **e, unsigned flags) {
    (void)flags;
    *e = malloc(1);
    return *e ? SUCCESS : OUT_OF_MEMORY;
}

CUresult cuEventDestroy_v2(void *e) {
    free(e);
    return SUCCESS;
}

CUresult cuEventRecord(void *e, void *stream) {
    (void)stream;
    return e ? SUCCESS : INVALID_VALUE;
}

CUresult cuEventQuery(void *e) {
    return e ? SUCCESS : INVALID_VALUE;
}

CUresult cuEventSynchronize(void *e) {
    return e ? SUCCESS : INVALID_VALUE;
}

/* ---- test API ---- */

static int add(uintptr_t base, size_t size, int device, uintptr_t res, size_t res_size,
               int fd) {
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < n_allocs && allocs[i].size) {
        i++;
    }
    if (i == MAX_ALLOCS) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    allocs[i] = (struct alloc){base, size, device, res, res_size, fd};
    if (i == n_allocs) {
        n_allocs++;
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

static void *map_chunk(void *at, size_t size, int *fd_out) {
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    void *p = mmap(at, size, PROT_READ | PROT_WRITE, MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return NULL;
    }
    *fd_out = fd;
    return p;
}

void *fakecuda_alloc(int device, size_t size) {
    int fd;
    void *p = map_chunk(NULL, size, &fd);
    if (p && add((uintptr_t)p, size, device, 0, 0, fd) != 0) {
        munmap(p, size);
        close(fd);
        return NULL;
    }
    return p;
}

void *fakecuda_alloc_vmm(int device, size_t chunk, int n_chunks) {
    size_t total = chunk * (size_t)n_chunks;
    void *res = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED) {
        return NULL;
    }
    for (int i = 0; i < n_chunks; i++) {
        int fd;
        char *at = (char *)res + (size_t)i * chunk;
        if (!map_chunk(at, chunk, &fd) ||
            add((uintptr_t)at, chunk, device, (uintptr_t)res, total, fd) != 0) {
            munmap(res, total);
            return NULL;
        }
    }
    return res;
}

void fakecuda_free(void *p) {
    uintptr_t base = (uintptr_t)p;
    size_t unmap = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_allocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->size && (a->base == base || a->reservation == base)) {
            unmap = a->reservation ? a->reservation_size : a->size;
            close(a->fd);
            a->size = 0;
        }
    }
    pthread_mutex_unlock(&lock);
    if (unmap) {
        munmap(p, unmap);
    }
}
