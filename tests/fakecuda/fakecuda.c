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
 * code; FAKECUDA_DEVICES=<n> is the device count (default 1); FAKECUDA_EXPORT_ERROR=
 * <CUresult> makes cuIpcGetMemHandle and cuMemExportToShareableHandle fail with it;
 * FAKECUDA_UUID_SEED=<n> gives the devices other UUIDs (another GPU namespace).
 *
 * CUDA IPC between two processes, over the same memfds: a legacy IPC handle
 * (cuIpcGetMemHandle, cudaMalloc-style allocations only) is (magic, pid, memfd number,
 * size, device), opened by the other process through /proc/<pid>/fd/<n> and mmap; a VMM
 * allocation's handle (cuMemRetainAllocationHandle, VMM allocations only) exports as a
 * dup of its memfd (cuMemExportToShareableHandle, POSIX file descriptors only), and an
 * import maps that fd into a reserved range (cuMemImportFromShareableHandle,
 * cuMemAddressReserve, cuMemMap) that is PROT_NONE until cuMemSetAccess grants read and
 * write, as on a GPU. What this proves is the protocol around the handles and the
 * engine's use of the driver API; nothing about GPU IPC itself (peer mappings, fabric,
 * containers, speed).
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
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
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
    INVALID_HANDLE = 400,
};

struct alloc {
    uintptr_t base;
    size_t size;
    int device;
    uintptr_t reservation; /* first byte of the VMM reservation it belongs to, or 0 */
    size_t reservation_size;
    int fd;      /* its memfd, or -1 for memory imported from another process */
    int imported;
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
    case INVALID_HANDLE: *s = "invalid resource handle"; return SUCCESS;
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

static int add(uintptr_t base, size_t size, int device, uintptr_t res, size_t res_size,
               int fd);
static void mark_imported(uintptr_t base);

/* Copies are checked against the table (every byte of the device side must lie in a
 * live allocation: a copy may span the allocations mapped one after the other in a VMM
 * range, as on a GPU) and done at once. */
static CUresult copy_checked_range(uintptr_t dev, size_t n) {
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
    return ok ? SUCCESS : INVALID_VALUE;
}

static CUresult copy_checked(void *dst, const void *src, size_t n, uintptr_t dev) {
    CUresult r = copy_checked_range(dev, n);
    if (r == SUCCESS) {
        memcpy(dst, src, n);
    }
    return r;
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


CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    (void)stream;
    /* Both sides must be device memory the table knows (imported memory included). */
    CUresult r = copy_checked_range((uintptr_t)src, n);
    if (r == SUCCESS) {
        r = copy_checked_range((uintptr_t)dst, n);
    }
    if (r == SUCCESS) {
        memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    }
    return r;
}

/* ---- IPC ---- */

static CUresult export_error(void) {
    const char *e = getenv("FAKECUDA_EXPORT_ERROR");
    return e && *e ? atoi(e) : SUCCESS;
}

#define IPC_MAGIC 0x6b76786670637566ull /* "fucpfxvk" */

struct ipc_handle {
    uint64_t magic;
    int64_t pid;
    int64_t fd;
    uint64_t size;
    int64_t device;
    char pad[24];
};

typedef struct {
    char reserved[64];
} CUipcMemHandle;

_Static_assert(sizeof(struct ipc_handle) == 64, "a CUipcMemHandle is 64 bytes");

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    CUresult e = export_error();
    if (e != SUCCESS) {
        return e;
    }
    pthread_mutex_lock(&lock);
    const struct alloc *a = find((uintptr_t)p);
    /* Only the base of a cudaMalloc-style allocation of this process: not VMM memory,
     * not memory this process imported. */
    int ok = a && a->base == p && a->reservation == 0 && a->fd >= 0 && !a->imported;
    struct ipc_handle out = {0};
    if (ok) {
        out = (struct ipc_handle){IPC_MAGIC, getpid(), a->fd, a->size, a->device, {0}};
    }
    pthread_mutex_unlock(&lock);
    if (!ok) {
        return INVALID_VALUE;
    }
    memcpy(h, &out, sizeof out);
    return SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle handle, unsigned flags) {
    struct ipc_handle h;
    memcpy(&h, &handle, sizeof h);
    if (h.magic != IPC_MAGIC || flags > 1 || ctx_depth == 0) {
        return ctx_depth == 0 ? INVALID_CONTEXT : INVALID_VALUE;
    }
    if (h.pid == getpid()) {
        return INVALID_CONTEXT; /* CUDA refuses to open a handle in its own process */
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)h.pid, (long long)h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        return INVALID_HANDLE;
    }
    void *m = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        return OUT_OF_MEMORY;
    }
    if (add((uintptr_t)m, h.size, (int)h.device, 0, 0, -1) != 0) {
        munmap(m, h.size);
        return OUT_OF_MEMORY;
    }
    mark_imported((uintptr_t)m);
    *p = (uintptr_t)m;
    return SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    size_t size = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_allocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->size && a->base == p && a->imported && a->reservation == 0) {
            size = a->size;
            a->size = 0;
        }
    }
    pthread_mutex_unlock(&lock);
    if (!size) {
        return INVALID_VALUE;
    }
    munmap((void *)(uintptr_t)p, size);
    return SUCCESS;
}

/* Generic allocation handles: each owns a dup of its memory's memfd. */
struct handle {
    int fd; /* -1: free */
    size_t size;
    int device;
};
#define MAX_HANDLES 4096
static struct handle handles[MAX_HANDLES];
static int handles_init;

static unsigned long long new_handle(int fd, size_t size, int device) {
    pthread_mutex_lock(&lock);
    if (!handles_init) {
        for (int i = 0; i < MAX_HANDLES; i++) {
            handles[i].fd = -1;
        }
        handles_init = 1;
    }
    int i = 0;
    while (i < MAX_HANDLES && handles[i].fd >= 0) {
        i++;
    }
    if (i < MAX_HANDLES) {
        handles[i] = (struct handle){fd, size, device};
    }
    pthread_mutex_unlock(&lock);
    return i < MAX_HANDLES ? (unsigned long long)i + 1 : 0;
}

static struct handle *get_handle(unsigned long long h) {
    if (h == 0 || h > MAX_HANDLES || !handles_init || handles[h - 1].fd < 0) {
        return NULL;
    }
    return &handles[h - 1];
}

CUresult cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
    pthread_mutex_lock(&lock);
    const struct alloc *a = find((uintptr_t)addr);
    int ok = a && a->reservation != 0 && a->fd >= 0;
    int fd = ok ? dup(a->fd) : -1;
    size_t size = ok ? a->size : 0;
    int device = ok ? a->device : 0;
    pthread_mutex_unlock(&lock);
    if (!ok || fd < 0) {
        return INVALID_VALUE; /* not VMM memory of this process */
    }
    *h = new_handle(fd, size, device);
    return *h ? SUCCESS : OUT_OF_MEMORY;
}

CUresult cuMemRelease(unsigned long long h) {
    pthread_mutex_lock(&lock);
    struct handle *x = get_handle(h);
    int fd = x ? x->fd : -1;
    if (x) {
        x->fd = -1;
    }
    pthread_mutex_unlock(&lock);
    if (fd < 0) {
        return INVALID_VALUE;
    }
    close(fd);
    return SUCCESS;
}

CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type,
                                      unsigned long long flags) {
    CUresult e = export_error();
    if (e != SUCCESS) {
        return e;
    }
    if (type != 1 /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */ || flags != 0) {
        return INVALID_VALUE;
    }
    pthread_mutex_lock(&lock);
    struct handle *x = get_handle(h);
    int fd = x ? fcntl(x->fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&lock);
    if (fd < 0) {
        return INVALID_VALUE;
    }
    *(int *)out = fd;
    return SUCCESS;
}

CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os_handle, int type) {
    if (type != 1) {
        return INVALID_VALUE;
    }
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) {
        if (fd >= 0) {
            close(fd);
        }
        return INVALID_HANDLE;
    }
    *h = new_handle(fd, (size_t)st.st_size, 0);
    return *h ? SUCCESS : OUT_OF_MEMORY;
}

CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    (void)align;
    if (size == 0 || addr != 0 || flags != 0) {
        return INVALID_VALUE;
    }
    void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        return OUT_OF_MEMORY;
    }
    *p = (uintptr_t)m;
    return SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    return munmap((void *)(uintptr_t)p, size) == 0 ? SUCCESS : INVALID_VALUE;
}

/* Mapped without access: cuMemSetAccess grants it, as on a GPU. */
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long h,
                  unsigned long long flags) {
    pthread_mutex_lock(&lock);
    struct handle *x = get_handle(h);
    int fd = x ? x->fd : -1;
    size_t hsize = x ? x->size : 0;
    int device = x ? x->device : 0;
    pthread_mutex_unlock(&lock);
    if (fd < 0 || offset != 0 || flags != 0 || size == 0 || size > hsize) {
        return INVALID_VALUE;
    }
    void *m = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED) {
        return OUT_OF_MEMORY;
    }
    /* The mapping keeps a descriptor of its own, so that cuMemRetainAllocationHandle
     * finds the allocation again (as CUDA does for a mapping of an imported handle). */
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0 || add(p, size, device, p, size, own) != 0) {
        if (own >= 0) {
            close(own);
        }
        return OUT_OF_MEMORY;
    }
    mark_imported(p);
    return SUCCESS;
}

struct access_desc {
    int location_type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int location_id;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
};

CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const struct access_desc *d, size_t n) {
    if (n != 1 || d->location_type != 1 || d->flags != 3) {
        return INVALID_VALUE;
    }
    return mprotect((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE) == 0 ? SUCCESS
                                                                           : INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_allocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->size && a->imported && a->reservation && a->base >= p &&
            a->base - p < size) {
            a->size = 0;
            if (a->fd >= 0) {
                close(a->fd);
            }
        }
    }
    pthread_mutex_unlock(&lock);
    void *m = mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                   -1, 0);
    return m == MAP_FAILED ? INVALID_VALUE : SUCCESS;
}


/* Device UUIDs: 'f','a','k','e', then FAKECUDA_UUID_SEED (default 0: another value is
 * another GPU namespace, whose devices the default one does not see), then the ordinal. */
CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) {
    if (d < 0 || d >= device_count()) {
        return INVALID_DEVICE;
    }
    const char *s = getenv("FAKECUDA_UUID_SEED");
    memset(uuid, 0, 16);
    memcpy(uuid, "fake", 4);
    uuid[4] = (unsigned char)(s ? atoi(s) : 0);
    uuid[5] = (unsigned char)d;
    return SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    if (d < 0 || d >= device_count() || peer < 0 || peer >= device_count()) {
        return INVALID_DEVICE;
    }
    *can = 1;
    return SUCCESS;
}

/* For scripts/gpu (the IPC check's own allocations): cudaMalloc-style memory, VMM
 * allocations (cuMemCreate: a memfd behind a handle, mapped with cuMemMap), and
 * synchronous copies. */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    void *fakecuda_alloc(int device, size_t size);
    void *m = fakecuda_alloc(0, size);
    if (!m) {
        return OUT_OF_MEMORY;
    }
    *p = (uintptr_t)m;
    return SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    void fakecuda_free(void *p);
    fakecuda_free((void *)(uintptr_t)p);
    return SUCCESS;
}

struct alloc_prop {
    int type;            /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int handle_types;    /* requested shareable handle types */
    int location_type;   /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int location_id;
    void *win32;
    unsigned char flags[8];
};

CUresult cuMemGetAllocationGranularity(size_t *g, const struct alloc_prop *prop, int option) {
    (void)prop;
    (void)option;
    *g = 2 << 20;
    return SUCCESS;
}

CUresult cuMemCreate(unsigned long long *h, size_t size, const struct alloc_prop *prop,
                     unsigned long long flags) {
    if (prop->type != 1 || prop->location_type != 1 || flags != 0 || size == 0) {
        return INVALID_VALUE;
    }
    int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return OUT_OF_MEMORY;
    }
    *h = new_handle(fd, size, prop->location_id);
    return *h ? SUCCESS : OUT_OF_MEMORY;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, NULL);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    return cuMemcpyDtoHAsync_v2(dst, src, n, NULL);
}

CUresult cuStreamSynchronize(void *stream) {
    return stream ? SUCCESS : INVALID_VALUE;
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
    allocs[i] = (struct alloc){base, size, device, res, res_size, fd, 0};
    if (i == n_allocs) {
        n_allocs++;
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

static void mark_imported(uintptr_t base) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_allocs; i++) {
        if (allocs[i].size && allocs[i].base == base) {
            allocs[i].imported = 1;
        }
    }
    pthread_mutex_unlock(&lock);
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
