// The emulated CUDA driver (libcuda.so.1): the part of the driver API that gorgonia.org/cu,
// engine/cuda, internal/pinned and collective/nccl call, on the CPU.
//
//   - Device memory is host memory the kernels run on: each allocation is mapped between two
//     PROT_NONE guard pages, 256-byte aligned with its end as near the upper guard as that
//     allows; the slack around it holds a canary checked after every kernel. New memory is
//     filled with 0xff bytes (NaN in every float type) unless QVD_CUDAEMU_FILL says otherwise,
//     so a read of memory nothing wrote shows.
//   - Each stream is a worker thread running its queue in order, asynchronously to the host,
//     so a missing synchronisation shows as a wrong result; QVD_CUDAEMU_DELAY_US delays every
//     queued operation to make such races certain. The legacy default stream synchronises with
//     the blocking streams as on a GPU. An error of queued work (a fault in a kernel) is
//     sticky, as a lost context is: every later call returns it.
//   - cuModuleLoadData takes the PTX of engine/cuda/kernels only to check that it was made
//     from the kernels.cu compiled into this library; cuLaunchKernel runs the compiled
//     kernel, after the checks a GPU makes (block and grid limits, __launch_bounds__, shared
//     memory) and one it does not: every pointer argument must be null or inside a live
//     allocation.
//
// What went wrong in detail (a kernel's out-of-bounds access with its block and thread) is
// printed to stderr and kept for cudaemu_last_error. QVD_CUDAEMU_COVERAGE names a file to
// which each driver entry point and kernel is appended the first time it is used.
#include <cuda.h>

#include "hooks.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "emu.h"

using namespace cudaemu;

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kAlign = 256; // cuMemAlloc's alignment
constexpr unsigned char kCanary = 0xa5;

// ---- Configuration (environment, read once).

long envLong(const char *name, long def) {
    const char *v = getenv(name);
    if (!v || !*v) {
        return def;
    }
    return strtol(v, nullptr, 0);
}

struct Config {
    int devices = (int)envLong("QVD_CUDAEMU_DEVICES", 1);
    int sms = (int)envLong("QVD_CUDAEMU_SMS", 4);
    size_t memory = (size_t)envLong("QVD_CUDAEMU_MEMORY_MIB", 16384) << 20;
    int fill = (int)envLong("QVD_CUDAEMU_FILL", 0xff);
    std::atomic<long> delayUS{envLong("QVD_CUDAEMU_DELAY_US", 0)};
    bool quiet = envLong("QVD_CUDAEMU_QUIET", 0) != 0;
    bool sync = envLong("QVD_CUDAEMU_SYNC", 0) != 0; // every queued operation completes before the call returns
};

Config &cfg() {
    static Config *c = new Config();
    return *c;
}

// ---- Diagnostics and coverage.

std::mutex diagMu;
std::string *lastDetail = new std::string();

void detail(const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    {
        std::lock_guard<std::mutex> l(diagMu);
        *lastDetail = buf;
    }
    if (!cfg().quiet) {
        fprintf(stderr, "cudaemu: %s\n", buf);
    }
}

std::mutex covMu;
std::set<std::string> *covSeen = new std::set<std::string>();

// count records that kind/name was used; the first use is appended to $QVD_CUDAEMU_COVERAGE
// (Go exits without running atexit handlers, so nothing waits for exit).
void count(const char *kind, const char *name) {
    static const char *path = getenv("QVD_CUDAEMU_COVERAGE");
    if (!path || !*path) {
        return;
    }
    std::string key = std::string(kind) + " " + name;
    std::lock_guard<std::mutex> l(covMu);
    if (!covSeen->insert(key).second) {
        return;
    }
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        key += "\n";
        ssize_t w = write(fd, key.data(), key.size());
        (void)w;
        close(fd);
    }
}

#define ENTER(name)                                                                                         \
    count("api", name);                                                                                     \
    if (!initialized.load()) return CUDA_ERROR_NOT_INITIALIZED

std::atomic<bool> initialized{false};

// ---- Objects.

struct Stream;

struct Ctx {
    int dev;
    bool primary;
    unsigned flags = 0;
    std::atomic<int> sticky{0};
    std::mutex mu; // guards streams, legacy
    std::vector<std::weak_ptr<Stream>> streams;
    std::shared_ptr<Stream> legacy;
};

struct Op {
    std::function<CUresult(std::string &msg)> fn;
};

struct Stream : std::enable_shared_from_this<Stream> {
    Ctx *ctx;
    unsigned flags;
    int priority = 0;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Op> q;
    uint64_t submitted = 0, completed = 0;
    bool stop = false;
};

struct Event {
    unsigned flags;
    std::shared_ptr<Stream> s;
    uint64_t seq = 0;
    bool recorded = false;
    std::shared_ptr<std::atomic<int64_t>> when; // ns, set when the record is executed
};

struct Module {
    Ctx *ctx;
    std::set<std::string> entries;
};

struct Func {
    const KernelInfo *k;
    Module *m;
};

struct Alloc {
    uintptr_t base;
    size_t size;     // as asked
    uintptr_t mapLo; // the mapping: guard page, data pages, guard page
    size_t mapLen;
    bool host;       // cuMemAllocHost
    Ctx *ctx;
};

struct Registry {
    std::mutex mu;
    std::map<uintptr_t, Alloc> allocs; // by base
    std::vector<Alloc> freed;          // the latest frees, for "use after free" reports
    std::vector<size_t> used;          // device memory per device
    std::vector<Ctx *> primary;        // per device, created on first retain
    std::vector<int> primaryRefs;
    std::set<Ctx *> ctxs;
    std::map<CUstream, std::shared_ptr<Stream>> streams;
    std::set<Event *> events;
    std::set<Module *> modules;
    std::set<Func *> funcs;
};

Registry &reg() {
    static Registry *r = new Registry(); // never destroyed: workers may outlive static destructors
    return *r;
}

thread_local std::vector<Ctx *> ctxStack;

Ctx *current() { return ctxStack.empty() ? nullptr : ctxStack.back(); }

// ---- Streams.

void worker(std::shared_ptr<Stream> s) {
    sigset_t set;
    sigfillset(&set);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) {
        sigdelset(&set, sig);
    }
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    for (;;) {
        Op op;
        {
            std::unique_lock<std::mutex> l(s->mu);
            s->cv.wait(l, [&] { return !s->q.empty() || s->stop; });
            if (s->q.empty()) {
                break;
            }
            op = std::move(s->q.front());
        }
        if (cfg().delayUS > 0) {
            std::this_thread::sleep_for(std::chrono::microseconds(cfg().delayUS));
        }
        if (s->ctx->sticky.load() == 0) {
            std::string msg;
            CUresult r = op.fn(msg);
            if (r != CUDA_SUCCESS) {
                int zero = 0;
                s->ctx->sticky.compare_exchange_strong(zero, r);
                detail("%s", msg.c_str());
            }
        }
        op.fn = nullptr; // what it holds (cudaemu_enqueue's argument) goes before the op counts as done
        {
            std::lock_guard<std::mutex> l(s->mu);
            s->q.pop_front();
            s->completed++;
        }
        s->cv.notify_all();
    }
}

std::shared_ptr<Stream> newStream(Ctx *c, unsigned flags) {
    auto s = std::make_shared<Stream>();
    s->ctx = c;
    s->flags = flags;
    std::thread(worker, s).detach();
    return s;
}

void waitFor(Stream *s, uint64_t seq) {
    std::unique_lock<std::mutex> l(s->mu);
    s->cv.wait(l, [&] { return s->completed >= seq; });
}

std::shared_ptr<Stream> legacyOf(Ctx *c) {
    std::lock_guard<std::mutex> l(c->mu);
    if (!c->legacy) {
        c->legacy = newStream(c, 0);
    }
    return c->legacy;
}

// enqueue appends op to s; the legacy stream and the blocking streams wait for each other's
// earlier work. It returns the operation's sequence number (done when completed >= it).
uint64_t enqueue(const std::shared_ptr<Stream> &s, std::function<CUresult(std::string &)> fn) {
    Ctx *c = s->ctx;
    std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> deps;
    if (!(s->flags & CU_STREAM_NON_BLOCKING)) {
        std::lock_guard<std::mutex> l(c->mu);
        if (s == c->legacy) {
            for (auto &w : c->streams) {
                if (auto b = w.lock(); b && !(b->flags & CU_STREAM_NON_BLOCKING)) {
                    std::lock_guard<std::mutex> bl(b->mu);
                    deps.emplace_back(b, b->submitted);
                }
            }
        } else if (c->legacy) {
            std::lock_guard<std::mutex> ll(c->legacy->mu);
            deps.emplace_back(c->legacy, c->legacy->submitted);
        }
    }
    if (!deps.empty()) {
        fn = [deps, inner = std::move(fn)](std::string &msg) {
            for (auto &[d, seq] : deps) {
                waitFor(d.get(), seq);
            }
            return inner(msg);
        };
    }
    uint64_t seq;
    {
        std::lock_guard<std::mutex> l(s->mu);
        s->q.push_back(Op{std::move(fn)});
        seq = ++s->submitted;
    }
    s->cv.notify_all();
    if (cfg().sync) {
        waitFor(s.get(), seq);
    }
    return seq;
}

void drain(Stream *s) {
    uint64_t seq;
    {
        std::lock_guard<std::mutex> l(s->mu);
        seq = s->submitted;
    }
    waitFor(s, seq);
}

// syncCtx waits for every stream of c (cuCtxSynchronize, and what cuMemFree implies).
void syncCtx(Ctx *c) {
    std::vector<std::shared_ptr<Stream>> all;
    {
        std::lock_guard<std::mutex> l(c->mu);
        for (auto &w : c->streams) {
            if (auto s = w.lock()) {
                all.push_back(s);
            }
        }
        if (c->legacy) {
            all.push_back(c->legacy);
        }
    }
    for (auto &s : all) {
        drain(s.get());
    }
}

// resolve maps a CUstream handle to a stream of the current context: 0, CU_STREAM_LEGACY and
// CU_STREAM_PER_THREAD are the legacy default stream.
std::shared_ptr<Stream> resolve(CUstream h) {
    Ctx *c = current();
    if (!c) {
        return nullptr;
    }
    if (h == nullptr || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        return legacyOf(c);
    }
    std::lock_guard<std::mutex> l(reg().mu);
    auto it = reg().streams.find(h);
    return it == reg().streams.end() ? nullptr : it->second;
}

// ---- Memory.

// find returns the live allocation holding [p, p+n) (p+n may be its end), or nullptr.
const Alloc *findLocked(uintptr_t p, size_t n) {
    auto &a = reg().allocs;
    auto it = a.upper_bound(p);
    if (it == a.begin()) {
        return nullptr;
    }
    --it;
    const Alloc &al = it->second;
    if (p >= al.base && p - al.base <= al.size && n <= al.size - (p - al.base)) {
        return &al;
    }
    return nullptr;
}

bool find(uintptr_t p, size_t n, Alloc *out) {
    std::lock_guard<std::mutex> l(reg().mu);
    const Alloc *a = findLocked(p, n);
    if (a && out) {
        *out = *a;
    }
    return a != nullptr;
}

std::string hex(uintptr_t p) {
    char b[32];
    snprintf(b, sizeof b, "0x%lx", (unsigned long)p);
    return b;
}

// rangeError describes why [p, p+n) is not inside one live allocation.
std::string rangeError(uintptr_t p, size_t n) {
    std::lock_guard<std::mutex> l(reg().mu);
    auto &a = reg().allocs;
    auto it = a.upper_bound(p);
    if (it != a.begin()) {
        --it;
        const Alloc &al = it->second;
        if (p >= al.base && p <= al.base + al.size) {
            char b[256];
            snprintf(b, sizeof b, "%zu bytes at offset %zu of the %zu-byte %s allocation at %s run %zu bytes past its end", n,
                     (size_t)(p - al.base), al.size, al.host ? "pinned host" : "device", hex(al.base).c_str(),
                     (size_t)(p - al.base) + n - al.size);
            return b;
        }
    }
    for (auto &f : reg().freed) {
        if (p >= f.base && p < f.base + std::max<size_t>(f.size, 1)) {
            return "address " + hex(p) + " is in a freed allocation (" + std::to_string(f.size) + " bytes at " +
                   hex(f.base) + ")";
        }
    }
    return "address " + hex(p) + " is not in any live allocation";
}

size_t roundUp(size_t n, size_t m) { return (n + m - 1) / m * m; }

CUresult allocate(Ctx *c, size_t size, bool host, uintptr_t *out) {
    size_t data = roundUp(size, kAlign);
    size_t span = roundUp(data, kPage);
    size_t mapLen = span + 2 * kPage;
    {
        std::lock_guard<std::mutex> l(reg().mu);
        if (!host && reg().used[c->dev] + span > cfg().memory) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (!host) {
            reg().used[c->dev] += span;
        }
    }
    void *m = mmap(nullptr, mapLen, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED || mprotect(static_cast<char *>(m) + kPage, span, PROT_READ | PROT_WRITE) != 0) {
        if (m != MAP_FAILED) {
            munmap(m, mapLen);
        }
        std::lock_guard<std::mutex> l(reg().mu);
        if (!host) {
            reg().used[c->dev] -= span;
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uintptr_t lo = reinterpret_cast<uintptr_t>(m);
    uintptr_t end = lo + kPage + span;
    uintptr_t base = end - data;
    if (!host) {
        memset(reinterpret_cast<void *>(lo + kPage), kCanary, base - (lo + kPage));
        memset(reinterpret_cast<void *>(base), cfg().fill, size);
        memset(reinterpret_cast<void *>(base + size), kCanary, end - (base + size));
    }
    std::lock_guard<std::mutex> l(reg().mu);
    reg().allocs[base] = Alloc{base, size, lo, mapLen, host, c};
    *out = base;
    return CUDA_SUCCESS;
}

CUresult release(uintptr_t p, bool host) {
    Alloc a;
    {
        std::lock_guard<std::mutex> l(reg().mu);
        auto it = reg().allocs.find(p);
        if (it == reg().allocs.end() || it->second.host != host) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        a = it->second;
    }
    // As on a GPU, freeing waits for the device: queued work may still use the memory.
    syncCtx(a.ctx);
    std::lock_guard<std::mutex> l(reg().mu);
    reg().allocs.erase(p);
    munmap(reinterpret_cast<void *>(a.mapLo), a.mapLen);
    if (!host) {
        reg().used[a.ctx->dev] -= a.mapLen - 2 * kPage;
    }
    reg().freed.push_back(a);
    if (reg().freed.size() > 4096) {
        reg().freed.erase(reg().freed.begin(), reg().freed.begin() + 2048);
    }
    return CUDA_SUCCESS;
}

// canary checks the slack around a device allocation; it returns "" or what was overwritten.
std::string canary(const Alloc &a) {
    if (a.host) {
        return "";
    }
    const unsigned char *lo = reinterpret_cast<const unsigned char *>(a.mapLo + kPage);
    const unsigned char *base = reinterpret_cast<const unsigned char *>(a.base);
    const unsigned char *end = reinterpret_cast<const unsigned char *>(a.mapLo + a.mapLen - kPage);
    for (const unsigned char *q = base + a.size; q < end; q++) {
        if (*q != kCanary) {
            return "wrote " + std::to_string(q - base - a.size) + " bytes past the end of the " + std::to_string(a.size) +
                   "-byte device allocation at " + hex(a.base) + " (byte " + std::to_string(q - base) + ")";
        }
    }
    for (const unsigned char *q = lo; q < base; q++) {
        if (*q != kCanary) {
            return "wrote " + std::to_string(base - q) + " bytes before the start of the " + std::to_string(a.size) +
                   "-byte device allocation at " + hex(a.base);
        }
    }
    return "";
}

// Host memory of a copy: pinned (cuMemAllocHost), checked to hold the range, or pageable.
enum HostKind { kPageable, kPinned, kBadPinned };

HostKind hostKind(const void *p, size_t n) {
    std::lock_guard<std::mutex> l(reg().mu);
    uintptr_t u = reinterpret_cast<uintptr_t>(p);
    auto &a = reg().allocs;
    auto it = a.upper_bound(u);
    if (it == a.begin()) {
        return kPageable;
    }
    --it;
    const Alloc &al = it->second;
    if (!al.host || u >= al.base + al.size + (al.size == 0)) {
        return kPageable;
    }
    return n <= al.size - (u - al.base) ? kPinned : kBadPinned;
}

CUresult checkDev(const char *call, CUdeviceptr p, size_t n) {
    if (find(p, n, nullptr)) {
        return CUDA_SUCCESS;
    }
    detail("%s: device range [%s, +%zu): %s", call, hex(p).c_str(), n, rangeError(p, n).c_str());
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult checkHost(const char *call, const void *p, size_t n, HostKind *k) {
    *k = hostKind(p, n);
    if (*k == kBadPinned) {
        detail("%s: host range [%p, +%zu): %s", call, p, n, rangeError(reinterpret_cast<uintptr_t>(p), n).c_str());
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult ready(Ctx **c) {
    *c = current();
    if (!*c) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    return (CUresult)(*c)->sticky.load();
}

// copyOn queues a copy of n bytes on s (null: the legacy stream) and, if wait, waits for it.
CUresult copyOn(CUstream h, void *dst, const void *src, size_t n, bool wait) {
    auto s = resolve(h);
    if (!s) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t seq = enqueue(s, [=](std::string &) {
        memmove(dst, src, n);
        return CUDA_SUCCESS;
    });
    if (wait) {
        waitFor(s.get(), seq);
        return (CUresult)s->ctx->sticky.load();
    }
    return CUDA_SUCCESS;
}

CUresult htod(const char *call, CUdeviceptr dst, const void *src, size_t n, CUstream h, bool async) {
    Ctx *c;
    if (CUresult r = ready(&c)) {
        return r;
    }
    if (n == 0) {
        return CUDA_SUCCESS;
    }
    HostKind k;
    if (CUresult r = checkDev(call, dst, n); r != CUDA_SUCCESS) {
        return r;
    }
    if (CUresult r = checkHost(call, src, n, &k); r != CUDA_SUCCESS) {
        return r;
    }
    if (async && k == kPageable) {
        // The driver stages pageable memory before it returns; the copy itself is queued.
        auto s = resolve(h);
        if (!s) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        auto tmp = std::make_shared<std::vector<char>>(static_cast<const char *>(src), static_cast<const char *>(src) + n);
        enqueue(s, [=](std::string &) {
            memcpy(reinterpret_cast<void *>(dst), tmp->data(), n);
            return CUDA_SUCCESS;
        });
        return CUDA_SUCCESS;
    }
    return copyOn(async ? h : nullptr, reinterpret_cast<void *>(dst), src, n, !async);
}

CUresult dtoh(const char *call, void *dst, CUdeviceptr src, size_t n, CUstream h, bool async) {
    Ctx *c;
    if (CUresult r = ready(&c)) {
        return r;
    }
    if (n == 0) {
        return CUDA_SUCCESS;
    }
    HostKind k;
    if (CUresult r = checkDev(call, src, n); r != CUDA_SUCCESS) {
        return r;
    }
    if (CUresult r = checkHost(call, dst, n, &k); r != CUDA_SUCCESS) {
        return r;
    }
    // Into pageable memory even the asynchronous copy completes before the call returns.
    return copyOn(async ? h : nullptr, dst, reinterpret_cast<void *>(src), n, !async || k == kPageable);
}

CUresult dtod(const char *call, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h, bool async) {
    Ctx *c;
    if (CUresult r = ready(&c)) {
        return r;
    }
    if (n == 0) {
        return CUDA_SUCCESS;
    }
    if (CUresult r = checkDev(call, dst, n); r != CUDA_SUCCESS) {
        return r;
    }
    if (CUresult r = checkDev(call, src, n); r != CUDA_SUCCESS) {
        return r;
    }
    return copyOn(async ? h : nullptr, reinterpret_cast<void *>(dst), reinterpret_cast<void *>(src), n, false);
}

template <typename T> CUresult memsetN(const char *call, CUdeviceptr dst, T v, size_t n, CUstream h, bool async) {
    Ctx *c;
    if (CUresult r = ready(&c)) {
        return r;
    }
    if (n == 0) {
        return CUDA_SUCCESS;
    }
    if (dst % sizeof(T) != 0) {
        detail("%s: %s is not aligned to %zu bytes", call, hex(dst).c_str(), sizeof(T));
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (CUresult r = checkDev(call, dst, n * sizeof(T)); r != CUDA_SUCCESS) {
        return r;
    }
    auto s = resolve(async ? h : nullptr);
    if (!s) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t seq = enqueue(s, [=](std::string &) {
        T *p = reinterpret_cast<T *>(dst);
        for (size_t i = 0; i < n; i++) {
            p[i] = v;
        }
        return CUDA_SUCCESS;
    });
    if (!async) {
        waitFor(s.get(), seq);
    }
    return CUDA_SUCCESS;
}

// ---- Modules.

// parseEntries lists the .entry directives of PTX text.
std::set<std::string> parseEntries(const char *ptx) {
    std::set<std::string> out;
    for (const char *p = strstr(ptx, ".entry"); p; p = strstr(p + 6, ".entry")) {
        const char *q = p + 6;
        if (*q != ' ' && *q != '\t') {
            continue;
        }
        while (*q == ' ' || *q == '\t') {
            q++;
        }
        const char *e = q;
        while (*e && (isalnum((unsigned char)*e) || *e == '_' || *e == '$')) {
            e++;
        }
        if (e > q) {
            out.insert(std::string(q, e));
        }
    }
    return out;
}

CUresult loadModule(CUmodule *out, const void *image, std::string &log) {
    Ctx *c;
    if (CUresult r = ready(&c)) {
        return r;
    }
    if (!out || !image) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    const char *ptx = static_cast<const char *>(image);
    if (memcmp(ptx, "\x7f" "ELF", 4) == 0 || strstr(ptx, ".version") == nullptr) {
        log = "cudaemu: the emulated driver loads PTX text only";
        return CUDA_ERROR_INVALID_IMAGE;
    }
    static const char shaLine[] = "// qvd-source-sha256: ";
    if (strncmp(ptx, shaLine, sizeof shaLine - 1) == 0) {
        std::string sum(ptx + sizeof shaLine - 1, strcspn(ptx + sizeof shaLine - 1, "\r\n"));
        if (sum != kernelsSHA256) {
            log = "cudaemu: this PTX was made from kernels.cu sha256 " + sum + " but the emulated driver runs kernels.cu sha256 " +
                  kernelsSHA256 + ": rebuild the emulator (internal/cudaemu) from the same source";
            return CUDA_ERROR_INVALID_PTX;
        }
    }
    auto *m = new Module{c, parseEntries(ptx)};
    for (auto &e : m->entries) {
        if (!findKernel(e.c_str())) {
            log = "cudaemu: the PTX defines entry point " + e + ", which the emulated driver was not built with";
            delete m;
            return CUDA_ERROR_INVALID_PTX;
        }
    }
    {
        std::lock_guard<std::mutex> l(reg().mu);
        reg().modules.insert(m);
    }
    *out = reinterpret_cast<CUmodule>(m);
    return CUDA_SUCCESS;
}

bool liveModule(CUmodule h) {
    std::lock_guard<std::mutex> l(reg().mu);
    return reg().modules.count(reinterpret_cast<Module *>(h)) != 0;
}

Func *liveFunc(CUfunction h) {
    std::lock_guard<std::mutex> l(reg().mu);
    Func *f = reinterpret_cast<Func *>(h);
    return reg().funcs.count(f) ? f : nullptr;
}

Event *liveEvent(CUevent h) {
    std::lock_guard<std::mutex> l(reg().mu);
    Event *e = reinterpret_cast<Event *>(h);
    return reg().events.count(e) ? e : nullptr;
}

int64_t nowNS() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool validDevice(CUdevice d) { return d >= 0 && d < cfg().devices; }

} // namespace

namespace cudaemu {

const KernelInfo *findKernel(const char *name) {
    for (int i = 0; i < kernelCount; i++) {
        if (strcmp(kernelTable[i].name, name) == 0) {
            return &kernelTable[i];
        }
    }
    return nullptr;
}

std::string describeAddress(uintptr_t addr) {
    std::lock_guard<std::mutex> l(reg().mu);
    for (auto &[base, a] : reg().allocs) {
        if (addr >= a.mapLo && addr < a.mapLo + a.mapLen) {
            char b[256];
            if (addr >= a.base + a.size) {
                snprintf(b, sizeof b, "%zu bytes past the end of the %zu-byte device allocation at %s",
                         (size_t)(addr - a.base - a.size), a.size, hex(a.base).c_str());
            } else if (addr < a.base) {
                snprintf(b, sizeof b, "%zu bytes before the start of the %zu-byte device allocation at %s",
                         (size_t)(a.base - addr), a.size, hex(a.base).c_str());
            } else {
                snprintf(b, sizeof b, "offset %zu of the %zu-byte device allocation at %s", (size_t)(addr - a.base), a.size,
                         hex(a.base).c_str());
            }
            return b;
        }
    }
    for (auto &f : reg().freed) {
        if (addr >= f.mapLo && addr < f.mapLo + f.mapLen) {
            return "inside the freed " + std::to_string(f.size) + "-byte allocation at " + hex(f.base);
        }
    }
    return "not near any device allocation";
}

} // namespace cudaemu

// ---- The driver API.

#define API extern "C" __attribute__((visibility("default")))

API CUresult cuInit(unsigned int flags) {
    count("api", "cuInit");
    if (flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!initialized.exchange(true)) {
        installFaultHandlers();
        auto &r = reg();
        std::lock_guard<std::mutex> l(r.mu);
        r.used.assign(cfg().devices, 0);
        r.primary.assign(cfg().devices, nullptr);
        r.primaryRefs.assign(cfg().devices, 0);
    }
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *v) {
    count("api", "cuDriverGetVersion");
    if (!v) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *v = CUDA_VERSION;
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorString(CUresult e, const char **s) {
    count("api", "cuGetErrorString");
    switch (e) {
    case CUDA_SUCCESS: *s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "initialization error"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found"; break;
    case CUDA_ERROR_NOT_READY: *s = "device not ready"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: *s = "too many resources requested for launch"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *s = "unspecified launch failure"; break;
    case CUDA_ERROR_INVALID_PTX: *s = "a PTX JIT compilation failed"; break;
    case CUDA_ERROR_INVALID_IMAGE: *s = "device kernel image is invalid"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    default: *s = nullptr; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult e, const char **s) {
    count("api", "cuGetErrorName");
    switch (e) {
#define N(x) case x: *s = #x; break;
    N(CUDA_SUCCESS) N(CUDA_ERROR_INVALID_VALUE) N(CUDA_ERROR_OUT_OF_MEMORY) N(CUDA_ERROR_NOT_INITIALIZED)
    N(CUDA_ERROR_INVALID_CONTEXT) N(CUDA_ERROR_INVALID_HANDLE) N(CUDA_ERROR_NOT_FOUND) N(CUDA_ERROR_NOT_READY)
    N(CUDA_ERROR_ILLEGAL_ADDRESS) N(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES) N(CUDA_ERROR_LAUNCH_FAILED)
    N(CUDA_ERROR_INVALID_PTX) N(CUDA_ERROR_INVALID_IMAGE) N(CUDA_ERROR_NOT_SUPPORTED) N(CUDA_ERROR_INVALID_DEVICE)
#undef N
    default: *s = nullptr; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

// ---- Devices.

API CUresult cuDeviceGetCount(int *n) {
    ENTER("cuDeviceGetCount");
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = cfg().devices;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    ENTER("cuDeviceGet");
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    ENTER("cuDeviceGetName");
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, len, "qvd emulated GPU (CPU)");
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    ENTER("cuDeviceGetUuid");
    if (!u) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0x51 + i * 7 + d);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem(size_t *b, CUdevice d) {
    ENTER("cuDeviceTotalMem_v2");
    if (!b) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    *b = cfg().memory;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
    ENTER("cuDeviceGetAttribute");
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 166912; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = 167936; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *v = 1410000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *v = 1215000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 40 << 20; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: *v = 512; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = cfg().sms; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 8; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *v = 2; break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *v = 0x10 + d; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: *v = CU_COMPUTEMODE_DEFAULT; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDeviceCanAccessPeer(int *can, CUdevice d, CUdevice peer) {
    ENTER("cuDeviceCanAccessPeer");
    if (!can) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d) || !validDevice(peer)) return CUDA_ERROR_INVALID_DEVICE;
    *can = d != peer; // one address space
    return CUDA_SUCCESS;
}

// ---- Contexts.

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> l(reg().mu);
    if (!reg().primary[d]) {
        Ctx *c = new Ctx();
        c->dev = d;
        c->primary = true;
        reg().primary[d] = c;
        reg().ctxs.insert(c);
    }
    reg().primaryRefs[d]++;
    *pctx = reinterpret_cast<CUcontext>(reg().primary[d]);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease(CUdevice d) {
    ENTER("cuDevicePrimaryCtxRelease_v2");
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    Ctx *c;
    {
        std::lock_guard<std::mutex> l(reg().mu);
        if (reg().primaryRefs[d] == 0) return CUDA_ERROR_INVALID_CONTEXT;
        if (--reg().primaryRefs[d] > 0) return CUDA_SUCCESS;
        c = reg().primary[d];
    }
    // The last release deactivates the context: its work is finished first. Its objects stay
    // valid for the emulator's bookkeeping; a new retain gets the same context back, its
    // sticky error cleared (a real driver would have destroyed and recreated it).
    syncCtx(c);
    c->sticky.store(0);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active) {
    ENTER("cuDevicePrimaryCtxGetState");
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> l(reg().mu);
    *active = reg().primaryRefs[d] > 0;
    *flags = reg().primary[d] ? reg().primary[d]->flags : 0;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxSetFlags(CUdevice d, unsigned int flags) {
    ENTER("cuDevicePrimaryCtxSetFlags_v2");
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> l(reg().mu);
    if (reg().primary[d]) reg().primary[d]->flags = flags;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxReset(CUdevice d) {
    ENTER("cuDevicePrimaryCtxReset_v2");
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    Ctx *c;
    {
        std::lock_guard<std::mutex> l(reg().mu);
        c = reg().primary[d];
    }
    if (c) {
        syncCtx(c);
        c->sticky.store(0);
    }
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice d) {
    ENTER("cuCtxCreate_v2");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!validDevice(d)) return CUDA_ERROR_INVALID_DEVICE;
    Ctx *c = new Ctx();
    c->dev = d;
    c->primary = false;
    c->flags = flags;
    {
        std::lock_guard<std::mutex> l(reg().mu);
        reg().ctxs.insert(c);
    }
    ctxStack.push_back(c);
    *pctx = reinterpret_cast<CUcontext>(c);
    return CUDA_SUCCESS;
}

bool liveCtx(Ctx *c) {
    std::lock_guard<std::mutex> l(reg().mu);
    return reg().ctxs.count(c) != 0;
}

API CUresult cuCtxDestroy(CUcontext h) {
    ENTER("cuCtxDestroy_v2");
    Ctx *c = reinterpret_cast<Ctx *>(h);
    if (!c || !liveCtx(c) || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
    syncCtx(c);
    {
        std::lock_guard<std::mutex> l(reg().mu);
        reg().ctxs.erase(c);
    }
    ctxStack.erase(std::remove(ctxStack.begin(), ctxStack.end(), c), ctxStack.end());
    return CUDA_SUCCESS; // c is leaked: workers of its streams may still hold it
}

API CUresult cuCtxSetCurrent(CUcontext h) {
    ENTER("cuCtxSetCurrent");
    Ctx *c = reinterpret_cast<Ctx *>(h);
    if (c && !liveCtx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (!c) {
        if (!ctxStack.empty()) ctxStack.pop_back();
        return CUDA_SUCCESS;
    }
    if (ctxStack.empty()) {
        ctxStack.push_back(c);
    } else {
        ctxStack.back() = c;
    }
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx) {
    ENTER("cuCtxGetCurrent");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = reinterpret_cast<CUcontext>(current());
    return CUDA_SUCCESS;
}

API CUresult cuCtxPushCurrent(CUcontext h) {
    ENTER("cuCtxPushCurrent_v2");
    Ctx *c = reinterpret_cast<Ctx *>(h);
    if (!c || !liveCtx(c)) return CUDA_ERROR_INVALID_CONTEXT;
    ctxStack.push_back(c);
    return CUDA_SUCCESS;
}

API CUresult cuCtxPopCurrent(CUcontext *pctx) {
    ENTER("cuCtxPopCurrent_v2");
    if (ctxStack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx) *pctx = reinterpret_cast<CUcontext>(ctxStack.back());
    ctxStack.pop_back();
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *d) {
    ENTER("cuCtxGetDevice");
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    Ctx *c = current();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetFlags(unsigned int *flags) {
    ENTER("cuCtxGetFlags");
    Ctx *c = current();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetApiVersion(CUcontext h, unsigned int *v) {
    ENTER("cuCtxGetApiVersion");
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 3020;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    Ctx *c = current();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    syncCtx(c);
    return (CUresult)c->sticky.load();
}

API CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    ENTER("cuCtxGetStreamPriorityRange");
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetLimit(size_t *v, CUlimit limit) {
    ENTER("cuCtxGetLimit");
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = limit == CU_LIMIT_STACK_SIZE ? 1024 : 0;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetLimit(CUlimit, size_t) {
    ENTER("cuCtxSetLimit");
    return CUDA_SUCCESS;
}

// ---- Memory.

API CUresult cuMemAlloc(CUdeviceptr *p, size_t n) {
    ENTER("cuMemAlloc_v2");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    if (!p || n == 0) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t u;
    if (CUresult r = allocate(c, n, false, &u)) return r;
    *p = u;
    return CUDA_SUCCESS;
}

API CUresult cuMemFree(CUdeviceptr p) {
    ENTER("cuMemFree_v2");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    if (p == 0) return CUDA_SUCCESS;
    if (CUresult r = release(p, false)) {
        detail("cuMemFree(%s): %s", hex(p).c_str(), rangeError(p, 0).c_str());
        return r;
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemAllocHost(void **p, size_t n) {
    ENTER("cuMemAllocHost_v2");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    if (!p || n == 0) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t u;
    if (CUresult r = allocate(c, n, true, &u)) return r;
    *p = reinterpret_cast<void *>(u);
    return CUDA_SUCCESS;
}

API CUresult cuMemFreeHost(void *p) {
    ENTER("cuMemFreeHost");
    if (!p) return CUDA_SUCCESS;
    if (CUresult r = release(reinterpret_cast<uintptr_t>(p), true)) {
        detail("cuMemFreeHost(%p): not a live cuMemAllocHost allocation", p);
        return r;
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemGetInfo(size_t *free, size_t *total) {
    ENTER("cuMemGetInfo_v2");
    Ctx *c = current();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> l(reg().mu);
    *total = cfg().memory;
    *free = cfg().memory - reg().used[c->dev];
    return CUDA_SUCCESS;
}

API CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    ENTER("cuMemGetAddressRange_v2");
    Alloc a;
    if (!find(p, 0, &a) || a.host) return CUDA_ERROR_NOT_FOUND;
    if (base) *base = a.base;
    if (size) *size = a.size;
    return CUDA_SUCCESS;
}

API CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr p) {
    ENTER("cuPointerGetAttribute");
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    Alloc a;
    if (!find(p, 0, &a)) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *static_cast<CUcontext *>(data) = reinterpret_cast<CUcontext>(a.ctx); break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned *>(data) = a.host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *static_cast<CUdeviceptr *>(data) = p; break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (!a.host) return CUDA_ERROR_INVALID_VALUE;
        *static_cast<void **>(data) = reinterpret_cast<void *>(p);
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<unsigned *>(data) = 0; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int *>(data) = a.ctx->dev; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *static_cast<CUdeviceptr *>(data) = a.base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t *>(data) = a.size; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
    ENTER("cuMemcpyHtoD_v2");
    return htod("cuMemcpyHtoD", dst, src, n, nullptr, false);
}

API CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoH_v2");
    return dtoh("cuMemcpyDtoH", dst, src, n, nullptr, false);
}

API CUresult cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoD_v2");
    return dtod("cuMemcpyDtoD", dst, src, n, nullptr, false);
}

API CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    ENTER("cuMemcpyHtoDAsync_v2");
    return htod("cuMemcpyHtoDAsync", dst, src, n, s, true);
}

API CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyDtoHAsync_v2");
    return dtoh("cuMemcpyDtoHAsync", dst, src, n, s, true);
}

API CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyDtoDAsync_v2");
    return dtod("cuMemcpyDtoDAsync", dst, src, n, s, true);
}

// cuMemcpy and cuMemcpyAsync infer each side's kind from the address (unified addressing).
CUresult unified(const char *call, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, bool async) {
    Alloc a;
    bool dDev = find(dst, 0, &a) && !a.host;
    bool sDev = find(src, 0, &a) && !a.host;
    if (dDev && sDev) return dtod(call, dst, src, n, s, async);
    if (dDev) return htod(call, dst, reinterpret_cast<const void *>(src), n, s, async);
    if (sDev) return dtoh(call, reinterpret_cast<void *>(dst), src, n, s, async);
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    return copyOn(async ? s : nullptr, reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), n, true);
}

API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpy");
    return unified("cuMemcpy", dst, src, n, nullptr, false);
}

API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    ENTER("cuMemcpyAsync");
    return unified("cuMemcpyAsync", dst, src, n, s, true);
}

API CUresult cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) {
    ENTER("cuMemsetD8_v2");
    return memsetN<uint8_t>("cuMemsetD8", p, v, n, nullptr, false);
}
API CUresult cuMemsetD16(CUdeviceptr p, unsigned short v, size_t n) {
    ENTER("cuMemsetD16_v2");
    return memsetN<uint16_t>("cuMemsetD16", p, v, n, nullptr, false);
}
API CUresult cuMemsetD32(CUdeviceptr p, unsigned int v, size_t n) {
    ENTER("cuMemsetD32_v2");
    return memsetN<uint32_t>("cuMemsetD32", p, v, n, nullptr, false);
}
API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    ENTER("cuMemsetD8Async");
    return memsetN<uint8_t>("cuMemsetD8Async", p, v, n, s, true);
}
API CUresult cuMemsetD16Async(CUdeviceptr p, unsigned short v, size_t n, CUstream s) {
    ENTER("cuMemsetD16Async");
    return memsetN<uint16_t>("cuMemsetD16Async", p, v, n, s, true);
}
API CUresult cuMemsetD32Async(CUdeviceptr p, unsigned int v, size_t n, CUstream s) {
    ENTER("cuMemsetD32Async");
    return memsetN<uint32_t>("cuMemsetD32Async", p, v, n, s, true);
}

// ---- Streams and events.

API CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int priority) {
    ENTER("cuStreamCreateWithPriority");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    if (!ph || (flags & ~CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    auto s = newStream(c, flags);
    s->priority = priority;
    {
        std::lock_guard<std::mutex> l(c->mu);
        c->streams.push_back(s);
    }
    std::lock_guard<std::mutex> l(reg().mu);
    CUstream h = reinterpret_cast<CUstream>(s.get());
    reg().streams[h] = s;
    *ph = h;
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreate(CUstream *ph, unsigned int flags) {
    ENTER("cuStreamCreate");
    return cuStreamCreateWithPriority(ph, flags, 0);
}

API CUresult cuStreamDestroy(CUstream h) {
    ENTER("cuStreamDestroy_v2");
    std::shared_ptr<Stream> s;
    {
        std::lock_guard<std::mutex> l(reg().mu);
        auto it = reg().streams.find(h);
        if (it == reg().streams.end()) return CUDA_ERROR_INVALID_HANDLE;
        s = it->second;
        reg().streams.erase(it);
    }
    // Queued work still runs; the worker exits once it has.
    {
        std::lock_guard<std::mutex> l(s->mu);
        s->stop = true;
    }
    s->cv.notify_all();
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(CUstream h) {
    ENTER("cuStreamSynchronize");
    if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
    auto s = resolve(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    drain(s.get());
    return (CUresult)s->ctx->sticky.load();
}

API CUresult cuStreamQuery(CUstream h) {
    ENTER("cuStreamQuery");
    if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
    auto s = resolve(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    if (int e = s->ctx->sticky.load()) return (CUresult)e;
    std::lock_guard<std::mutex> l(s->mu);
    return s->completed == s->submitted ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuStreamGetFlags(CUstream h, unsigned int *flags) {
    ENTER("cuStreamGetFlags");
    auto s = resolve(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

API CUresult cuStreamGetPriority(CUstream h, int *p) {
    ENTER("cuStreamGetPriority");
    auto s = resolve(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    *p = s->priority;
    return CUDA_SUCCESS;
}

API CUresult cuEventCreate(CUevent *ph, unsigned int flags) {
    ENTER("cuEventCreate");
    if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!ph || (flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS))) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    Event *e = new Event();
    e->flags = flags;
    e->when = std::make_shared<std::atomic<int64_t>>(0);
    std::lock_guard<std::mutex> l(reg().mu);
    reg().events.insert(e);
    *ph = reinterpret_cast<CUevent>(e);
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy(CUevent h) {
    ENTER("cuEventDestroy_v2");
    std::lock_guard<std::mutex> l(reg().mu);
    Event *e = reinterpret_cast<Event *>(h);
    if (!reg().events.erase(e)) return CUDA_ERROR_INVALID_HANDLE;
    delete e; // a queued record holds only the shared timestamp
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent h, CUstream sh) {
    ENTER("cuEventRecord");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    Event *e = liveEvent(h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    auto s = resolve(sh);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    auto when = std::make_shared<std::atomic<int64_t>>(0);
    uint64_t seq = enqueue(s, [when](std::string &) {
        when->store(nowNS());
        return CUDA_SUCCESS;
    });
    e->s = s;
    e->seq = seq;
    e->when = when;
    e->recorded = true;
    return CUDA_SUCCESS;
}

API CUresult cuEventSynchronize(CUevent h) {
    ENTER("cuEventSynchronize");
    Event *e = liveEvent(h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded) return CUDA_SUCCESS;
    waitFor(e->s.get(), e->seq);
    return (CUresult)e->s->ctx->sticky.load();
}

API CUresult cuEventQuery(CUevent h) {
    ENTER("cuEventQuery");
    Event *e = liveEvent(h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded) return CUDA_SUCCESS;
    if (int r = e->s->ctx->sticky.load()) return (CUresult)r;
    std::lock_guard<std::mutex> l(e->s->mu);
    return e->s->completed >= e->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    ENTER("cuEventElapsedTime");
    Event *a = liveEvent(start), *b = liveEvent(end);
    if (!a || !b || !ms) return CUDA_ERROR_INVALID_HANDLE;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (!a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
    int64_t ta = a->when->load(), tb = b->when->load();
    if (ta == 0 || tb == 0) return CUDA_ERROR_NOT_READY;
    *ms = (float)((tb - ta) / 1e6);
    return CUDA_SUCCESS;
}

API CUresult cuStreamWaitEvent(CUstream sh, CUevent h, unsigned int flags) {
    ENTER("cuStreamWaitEvent");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    Event *e = liveEvent(h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    auto s = resolve(sh);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded) return CUDA_SUCCESS;
    auto on = e->s;
    uint64_t seq = e->seq;
    enqueue(s, [on, seq](std::string &) {
        waitFor(on.get(), seq);
        return CUDA_SUCCESS;
    });
    return CUDA_SUCCESS;
}

// ---- Modules and launches.

API CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    ENTER("cuModuleLoadData");
    std::string log;
    CUresult r = loadModule(m, image, log);
    if (r != CUDA_SUCCESS && !log.empty()) detail("cuModuleLoadData: %s", log.c_str());
    return r;
}

API CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, CUjit_option *opts, void **vals) {
    ENTER("cuModuleLoadDataEx");
    std::string log;
    CUresult r = loadModule(m, image, log);
    char *buf = nullptr;
    size_t size = 0;
    for (unsigned i = 0; i < n && opts && vals; i++) {
        if (opts[i] == CU_JIT_ERROR_LOG_BUFFER) buf = static_cast<char *>(vals[i]);
        if (opts[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) size = reinterpret_cast<size_t>(vals[i]);
    }
    if (buf && size > 0) {
        snprintf(buf, size, "%s", log.c_str());
        for (unsigned i = 0; i < n; i++) {
            if (opts[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) vals[i] = reinterpret_cast<void *>(std::min(size, log.size() + 1));
        }
    }
    return r;
}

API CUresult cuModuleLoad(CUmodule *m, const char *fname) {
    ENTER("cuModuleLoad");
    FILE *f = fopen(fname, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    std::string s;
    char buf[65536];
    for (size_t k; (k = fread(buf, 1, sizeof buf, f)) > 0;) s.append(buf, k);
    fclose(f);
    std::string log;
    CUresult r = loadModule(m, s.c_str(), log);
    if (r != CUDA_SUCCESS && !log.empty()) detail("cuModuleLoad(%s): %s", fname, log.c_str());
    return r;
}

API CUresult cuModuleUnload(CUmodule h) {
    ENTER("cuModuleUnload");
    std::lock_guard<std::mutex> l(reg().mu);
    Module *m = reinterpret_cast<Module *>(h);
    if (!reg().modules.erase(m)) return CUDA_ERROR_INVALID_HANDLE;
    for (auto it = reg().funcs.begin(); it != reg().funcs.end();) {
        if ((*it)->m == m) {
            it = reg().funcs.erase(it); // leaked: a queued launch may still name it
        } else {
            ++it;
        }
    }
    delete m;
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(CUfunction *pf, CUmodule h, const char *name) {
    ENTER("cuModuleGetFunction");
    if (!pf || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!liveModule(h)) return CUDA_ERROR_INVALID_HANDLE;
    Module *m = reinterpret_cast<Module *>(h);
    const KernelInfo *k = m->entries.count(name) ? findKernel(name) : nullptr;
    if (!k) return CUDA_ERROR_NOT_FOUND;
    Func *f = new Func{k, m};
    std::lock_guard<std::mutex> l(reg().mu);
    reg().funcs.insert(f);
    *pf = reinterpret_cast<CUfunction>(f);
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetGlobal(CUdeviceptr *, size_t *, CUmodule h, const char *) {
    ENTER("cuModuleGetGlobal_v2");
    if (!liveModule(h)) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_ERROR_NOT_FOUND; // kernels.cu has no __device__ globals
}

API CUresult cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction h) {
    ENTER("cuFuncGetAttribute");
    Func *f = liveFunc(h);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = (int)f->k->maxThreads; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *v = 80; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *v = 80; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = 49152; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

API CUresult cuFuncSetCacheConfig(CUfunction h, CUfunc_cache) {
    ENTER("cuFuncSetCacheConfig");
    return liveFunc(h) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction h, int blockSize, size_t) {
    ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessor");
    if (!liveFunc(h)) return CUDA_ERROR_INVALID_HANDLE;
    if (!n || blockSize <= 0) return CUDA_ERROR_INVALID_VALUE;
    *n = std::min(32, 2048 / blockSize);
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction h, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shmem, CUstream sh, void **params, void **extra) {
    ENTER("cuLaunchKernel");
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    Func *f = liveFunc(h);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    const KernelInfo *k = f->k;
    auto s = resolve(sh);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t threads = (uint64_t)bx * by * bz;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 || bz > 64 ||
        threads > 1024 || gx > 2147483647u || gy > 65535 || gz > 65535) {
        detail("cuLaunchKernel(%s): invalid grid %ux%ux%u or block %ux%ux%u", k->name, gx, gy, gz, bx, by, bz);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (threads > k->maxThreads) {
        detail("cuLaunchKernel(%s): a block of %llu threads exceeds the kernel's __launch_bounds__(%u)", k->name,
               (unsigned long long)threads, k->maxThreads);
        return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    }
    if (shmem > 49152) {
        detail("cuLaunchKernel(%s): %u bytes of dynamic shared memory exceed 48 KiB without the opt-in attribute", k->name,
               shmem);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (extra != nullptr || (k->nparams > 0 && params == nullptr)) {
        detail("cuLaunchKernel(%s): kernelParams must hold the %d arguments (extra is not supported)", k->name, k->nparams);
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The arguments are copied now, as the driver does: the caller may reuse its memory.
    auto slots = std::make_shared<std::vector<uint64_t>>(k->nparams, 0);
    for (int i = 0; i < k->nparams; i++) {
        if (!params[i]) return CUDA_ERROR_INVALID_VALUE;
        memcpy(&(*slots)[i], params[i], k->params[i].size);
    }
    count("kernel", k->name);
    Dim grid{gx, gy, gz}, block{bx, by, bz};
    enqueue(s, [k, slots, grid, block](std::string &msg) {
        std::vector<void *> p(k->nparams);
        std::vector<Alloc> used;
        for (int i = 0; i < k->nparams; i++) {
            p[i] = &(*slots)[i];
            const ParamInfo &pi = k->params[i];
            if (!pi.ptr || (*slots)[i] == 0) continue;
            Alloc a;
            if (!find((*slots)[i], 0, &a)) {
                char b[512];
                snprintf(b, sizeof b, "kernel %s: parameter %d (%s %s) = %s: %s; the kernel was not run", k->name, i + 1,
                         pi.type, pi.name, hex((*slots)[i]).c_str(), rangeError((*slots)[i], 0).c_str());
                msg = b;
                return CUDA_ERROR_ILLEGAL_ADDRESS;
            }
            used.push_back(a);
        }
        if (!runLaunch(k, grid, block, p.data(), msg)) {
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        for (size_t i = 0; i < used.size(); i++) {
            if (std::string w = canary(used[i]); !w.empty()) {
                msg = std::string("kernel ") + k->name + ": " + w;
                return CUDA_ERROR_ILLEGAL_ADDRESS;
            }
        }
        return CUDA_SUCCESS;
    });
    return CUDA_SUCCESS;
}

// ---- For the emulated cuBLAS and NCCL, and for tests.

// cudaemu_enqueue runs fn(arg) in order on stream h of the current context; a non-zero
// CUresult from fn, with msg, becomes the context's sticky error. del(arg) runs once the
// operation is over, before it counts as complete, also when a sticky error skipped fn. On a
// non-zero return nothing was queued and del was not called.
API int cudaemu_enqueue(CUstream h, int (*fn)(void *arg, char *msg, size_t n), void *arg, void (*del)(void *)) {
    Ctx *c;
    if (CUresult r = ready(&c)) return r;
    auto s = resolve(h);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    std::shared_ptr<void> owned(arg, [del](void *p) {
        if (del) del(p);
    });
    enqueue(s, [fn, owned](std::string &msg) {
        char buf[1024] = "";
        int r = fn(owned.get(), buf, sizeof buf);
        msg = buf;
        return (CUresult)r;
    });
    return CUDA_SUCCESS;
}

// cudaemu_check_range reports whether [p, p+n) lies inside one live allocation (device, or
// pinned host); if not, why, in msg.
API int cudaemu_check_range(uintptr_t p, size_t n, char *msg, size_t cap) {
    if (find(p, n, nullptr)) return 1;
    if (msg && cap) snprintf(msg, cap, "%s", rangeError(p, n).c_str());
    return 0;
}

// cudaemu_fail makes code the current context's sticky error, as a fault would.
API void cudaemu_fail(int code, const char *msg) {
    if (Ctx *c = current()) {
        int zero = 0;
        c->sticky.compare_exchange_strong(zero, code);
    }
    detail("%s", msg);
}

API void cudaemu_count(const char *kind, const char *name) { count(kind, name); }

// cudaemu_set_delay_us sets QVD_CUDAEMU_DELAY_US's delay before each queued operation.
API void cudaemu_set_delay_us(long us) { cfg().delayUS.store(us); }

// cudaemu_last_error copies the latest detailed diagnostic into buf; it returns its length.
API int cudaemu_last_error(char *buf, size_t cap) {
    std::lock_guard<std::mutex> l(diagMu);
    if (buf && cap) snprintf(buf, cap, "%s", lastDetail->c_str());
    return (int)lastDetail->size();
}

// cudaemu_kernels lists the compiled kernels, one name per line, into buf.
API int cudaemu_kernels(char *buf, size_t cap) {
    std::string s;
    for (int i = 0; i < kernelCount; i++) {
        s += kernelTable[i].name;
        s += "\n";
    }
    if (buf && cap) snprintf(buf, cap, "%s", s.c_str());
    return (int)s.size();
}
