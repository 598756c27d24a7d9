// The emulated NCCL (libnccl.so.2, chosen with QVD_NCCL_LIBRARY): the calls collective/nccl
// binds (lib.go), run between the ranks of a communicator — goroutines of one process on the
// emulated driver's devices (QVD_CUDAEMU_DEVICES) or separate processes — over POSIX shared
// memory. It needs the emulated libcuda.so.1 (it queues its work there with cudaemu_enqueue).
//
//   - ncclGetUniqueId writes a magic, a random 64-bit token, the slot size and the name of a
//     shared-memory segment (/qvd-nccl-emu-<pid>-<random>) into the 128-byte id. Every rank's
//     ncclCommInitRankConfig opens that segment (the first creates it, mode 0600), checks the
//     token and the group size, claims its rank and waits, on a thread of its own, until all
//     ranks have attached; the last to attach unlinks the name, so nothing is left in
//     /dev/shm once the group exists (an abort before then unlinks it too). With blocking = 0
//     the call returns ncclInProgress and ncclCommGetAsyncError reports the rendezvous.
//   - A collective is checked (communicator, types, root, and every buffer inside a live
//     allocation of the emulated driver: a bad one is the sticky CUDA_ERROR_ILLEGAL_ADDRESS a
//     kernel would cause) and queued on the caller's stream, so it runs in stream order with
//     the kernels, copies and GEMMs queued there. On the stream's worker it moves the data in
//     chunks through one slot per rank of the segment: every rank writes its part into its
//     slot, all meet at a barrier, every rank computes its result from all slots, all meet
//     again. Reductions combine ranks 0, 1, … in that fixed order, rounding each partial
//     result to the element type as NCCL's 16-bit kernels do (acc = round(acc op x_r)), so
//     every rank ends bit-identical; ncclAvg on floating types pre-multiplies each input by
//     1/nranks (rounded to the type) as NCCL's PreMulSum does, on integers it divides the sum.
//   - The first chunk also publishes each rank's call (collective, count, type, op, root,
//     sequence number): ranks that disagree all stop with ncclInvalidUsage and a message
//     naming both calls, where real NCCL would corrupt data or hang.
//   - Waits are futexes on the segment, woken by the last rank to arrive; a waiter also gives
//     up when its own communicator is aborted, when a peer aborted (ncclRemoteError), and
//     when a peer's process no longer exists (ncclRemoteError, checked every 100 ms). Work
//     that gives up leaves its outputs unspecified and the CUDA context healthy, as NCCL's
//     kernels do after ncclCommAbort.
//   - ncclCommFinalize is ncclInProgress until the work queued on the communicator has run.
//   - Not emulated: ncclSend/Recv and groups, user reduction ops, fp8 types, and the ordering
//     of one communicator's calls queued on different streams (qvd uses one stream per
//     communicator; calls on two streams would share the slots concurrently).
//
// QVD_CUDAEMU_NCCL_SLOT_KIB (read by ncclGetUniqueId, carried in the id) sets each rank's slot,
// 4096 KiB by default; a small one makes every collective run in many chunks. Entry points
// are counted with the driver's coverage (QVD_CUDAEMU_COVERAGE, kind "nccl").
#include <cuda.h>

#include "../libcuda/hooks.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <linux/futex.h>
#include <map>
#include <memory>
#include <mutex>
#include <signal.h>
#include <string>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <thread>
#include <type_traits>
#include <unistd.h>

namespace {

// ncclResult_t, ncclDataType_t, ncclRedOp_t (nccl.h).
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
enum { tInt8, tUint8, tInt32, tUint32, tInt64, tUint64, tFloat16, tFloat32, tFloat64, tBfloat16, tCount };
enum { opSum, opProd, opMax, opMin, opAvg, opCount };
enum Coll { cAllReduce = 1, cReduceScatter, cAllGather, cBroadcast, cReduce };

constexpr int kVersion = 22105;          // reported as NCCL 2.21.5: the emulator follows its API
constexpr uint64_t kIdMagic = 0x6c63636e756d6571; // "qemunccl"
constexpr uint32_t kConfigMagic = 0xcafebeef;
constexpr int kMaxRanks = 64;
constexpr long kPollNS = 10'000'000;    // a waiter re-checks aborts every 10 ms
constexpr int kPeerCheckPolls = 10;     // and the peers' processes every 100 ms
constexpr size_t kDefaultSlotKiB = 4096;

const char *collName(int c) {
    switch (c) {
    case cAllReduce: return "ncclAllReduce";
    case cReduceScatter: return "ncclReduceScatter";
    case cAllGather: return "ncclAllGather";
    case cBroadcast: return "ncclBroadcast";
    case cReduce: return "ncclReduce";
    }
    return "(no call)";
}

size_t typeSize(int t) {
    switch (t) {
    case tInt8: case tUint8: return 1;
    case tFloat16: case tBfloat16: return 2;
    case tInt32: case tUint32: case tFloat32: return 4;
    }
    return 8;
}

// The unique id's layout (ncclUniqueId is 128 opaque bytes).
struct Id {
    uint64_t magic;
    uint64_t token;
    uint32_t slotBytes;
    uint32_t pad;
    char name[96];
};
static_assert(sizeof(Id) <= 128);

// Desc is a rank's current call, published for the others to compare.
struct Desc {
    uint64_t seq;
    uint64_t count;
    int32_t coll, dtype, op, root;
};

struct alignas(64) RankSlot {
    int32_t pid; // claimed by the rank's process at attach
    int32_t pad;
    Desc desc;
};

// Shared is the head of the segment; the slots follow at headerBytes(). Fields that change
// are accessed with std::atomic_ref (the segment is zero-filled by ftruncate).
struct Shared {
    uint64_t token;
    uint32_t nranks;
    uint32_t slotBytes;
    uint32_t ready;    // 1 once the creator has written the above
    uint32_t attached; // ranks attached
    uint32_t failed;   // 0, or 1 + the rank that aborted or died: every wait gives up
    alignas(64) uint32_t barCount;
    uint32_t barGen;
    alignas(64) RankSlot ranks[kMaxRanks];
};

constexpr size_t headerBytes() { return (sizeof(Shared) + 4095) / 4096 * 4096; }

template <typename T> std::atomic_ref<T> at(T &x) { return std::atomic_ref<T>(x); }

void futexWait(uint32_t *addr, uint32_t seen, long ns) {
    timespec ts{0, ns};
    syscall(SYS_futex, addr, FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futexWake(uint32_t *addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

// ---- Errors.

std::mutex errMu;
std::string *lastError = new std::string();

void setLastError(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    std::lock_guard<std::mutex> l(errMu);
    *lastError = buf;
}

// ---- Communicators.

struct Comm {
    int rank = 0, nranks = 0, dev = 0;
    pid_t pid = 0;
    Id id{};
    size_t mapLen = 0;
    Shared *sh = nullptr; // set by the rendezvous thread before state leaves ncclInProgress
    std::atomic<int> state{ncclInProgress};
    std::atomic<bool> aborted{false};   // this rank's abort (or destroy with work queued)
    std::atomic<bool> rendezvousDone{false};
    std::atomic<int> pending{0};        // collectives queued and not yet run
    std::atomic<bool> finalizing{false};
    uint64_t seq = 0;                   // calls queued, under callMu
    std::mutex callMu;
    std::thread rendezvous;
    std::mutex rvMu;                    // guards the thread's join
    bool created = false, unlinked = false;
    std::mutex shMu;                    // guards sh's publication to abort

    char *slot(int r) const { return reinterpret_cast<char *>(sh) + headerBytes() + (size_t)r * sh->slotBytes; }

    ~Comm() {
        if (sh) munmap(sh, mapLen);
    }
};

std::mutex regMu;
std::map<Comm *, std::shared_ptr<Comm>> *live = new std::map<Comm *, std::shared_ptr<Comm>>();

std::shared_ptr<Comm> lookup(void *h) {
    std::lock_guard<std::mutex> l(regMu);
    auto it = live->find(static_cast<Comm *>(h));
    return it == live->end() ? nullptr : it->second;
}

// fail records that this communicator failed with r (the first failure stays).
void fail(Comm *c, int r, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    int want = ncclSuccess;
    if (!c->state.compare_exchange_strong(want, r)) {
        want = ncclInProgress;
        c->state.compare_exchange_strong(want, r);
    }
    std::lock_guard<std::mutex> l(errMu);
    *lastError = buf;
}

// markFailed tells every rank's waits that rank gave up, and wakes them.
void markFailed(Shared *sh, int rank) {
    uint32_t zero = 0;
    at(sh->failed).compare_exchange_strong(zero, (uint32_t)rank + 1);
    futexWake(&sh->barGen);
    futexWake(&sh->attached);
}

// exited reports whether process p has exited: it is gone, or a zombie its parent has not
// reaped yet (kill(p, 0) still succeeds on one).
bool exited(pid_t p) {
    if (kill(p, 0) != 0 && errno == ESRCH) return true;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)p);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return false;
    buf[n] = 0;
    const char *q = strrchr(buf, ')'); // "pid (comm) state ...": comm may hold spaces and parentheses
    return q && q[1] == ' ' && (q[2] == 'Z' || q[2] == 'X');
}

// peerGone returns the rank of a peer whose process has exited, or -1.
int peerGone(Comm *c) {
    for (int r = 0; r < c->nranks; r++) {
        pid_t p = at(c->sh->ranks[r].pid).load();
        if (p > 0 && p != c->pid && exited(p)) {
            return r;
        }
    }
    return -1;
}

// Why a wait ended without its condition.
enum Wait { kDone, kAborted, kPeerFailed };

// waitOn waits on the futex word until cond() holds, giving up on this rank's abort or a
// peer's failure (which it records in the communicator's state).
template <typename F> Wait waitOn(Comm *c, uint32_t *word, F cond) {
    for (int polls = 0;; polls++) {
        uint32_t seen = at(*word).load();
        if (cond()) return kDone;
        if (c->aborted.load()) return kAborted;
        if (uint32_t f = at(c->sh->failed).load()) {
            fail(c, ncclRemoteError, "rank %u of the communicator aborted or died", f - 1);
            return kPeerFailed;
        }
        if (polls % kPeerCheckPolls == kPeerCheckPolls - 1) {
            if (int r = peerGone(c); r >= 0) {
                markFailed(c->sh, r);
                fail(c, ncclRemoteError, "rank %d's process (pid %d) exited", r, (int)at(c->sh->ranks[r].pid).load());
                return kPeerFailed;
            }
        }
        futexWait(word, seen, kPollNS);
    }
}

Wait barrier(Comm *c) {
    Shared *sh = c->sh;
    uint32_t gen = at(sh->barGen).load(std::memory_order_acquire);
    if (at(sh->barCount).fetch_add(1, std::memory_order_acq_rel) + 1 == (uint32_t)c->nranks) {
        at(sh->barCount).store(0, std::memory_order_relaxed);
        at(sh->barGen).fetch_add(1, std::memory_order_release);
        futexWake(&sh->barGen);
        return kDone;
    }
    return waitOn(c, &sh->barGen, [&] { return at(sh->barGen).load(std::memory_order_acquire) != gen; });
}

// ---- Rendezvous (the thread ncclCommInitRankConfig starts).

void unlinkOnce(Comm *c) {
    if (!c->unlinked) {
        shm_unlink(c->id.name);
        c->unlinked = true;
    }
}

void sleepMS(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

void rendezvous(Comm *c) {
    size_t total = headerBytes() + (size_t)c->nranks * c->id.slotBytes;
    int fd = -1;
    while (fd < 0) {
        if (c->aborted.load()) return;
        fd = shm_open(c->id.name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
            c->created = true;
            if (ftruncate(fd, (off_t)total) != 0) {
                fail(c, ncclSystemError, "ncclCommInitRankConfig: sizing shared memory %s to %zu bytes: %s", c->id.name, total,
                     strerror(errno));
                close(fd);
                unlinkOnce(c);
                return;
            }
            break;
        }
        if (errno != EEXIST) {
            fail(c, ncclSystemError, "ncclCommInitRankConfig: creating shared memory %s: %s", c->id.name, strerror(errno));
            return;
        }
        fd = shm_open(c->id.name, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0 && errno != ENOENT) {
            fail(c, ncclSystemError, "ncclCommInitRankConfig: opening shared memory %s: %s", c->id.name, strerror(errno));
            return;
        }
        if (fd < 0) sleepMS(1); // unlinked between the two opens: try again
    }
    // A segment made by another rank is sized by it: wait for that, then check the size.
    for (;;) {
        struct stat st;
        if (fstat(fd, &st) != 0) {
            fail(c, ncclSystemError, "ncclCommInitRankConfig: fstat %s: %s", c->id.name, strerror(errno));
            close(fd);
            return;
        }
        if ((size_t)st.st_size == total) break;
        if (st.st_size != 0) {
            fail(c, ncclInvalidUsage,
                 "ncclCommInitRankConfig: rank %d was given nranks %d, but the rank that created the communicator another "
                 "(its shared memory is %lld bytes, not %zu)",
                 c->rank, c->nranks, (long long)st.st_size, total);
            close(fd);
            return;
        }
        if (c->aborted.load()) {
            close(fd);
            return;
        }
        sleepMS(1);
    }
    void *m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        fail(c, ncclSystemError, "ncclCommInitRankConfig: mapping %zu bytes of %s: %s", total, c->id.name, strerror(errno));
        if (c->created) unlinkOnce(c);
        return;
    }
    Shared *sh = static_cast<Shared *>(m);
    if (c->created) {
        sh->token = c->id.token;
        sh->nranks = (uint32_t)c->nranks;
        sh->slotBytes = c->id.slotBytes;
        at(sh->ready).store(1, std::memory_order_release);
    }
    {
        std::lock_guard<std::mutex> l(c->shMu);
        c->mapLen = total;
        c->sh = sh;
    }
    while (at(sh->ready).load(std::memory_order_acquire) == 0) {
        if (c->aborted.load()) return;
        sleepMS(1);
    }
    if (sh->token != c->id.token || sh->nranks != (uint32_t)c->nranks || sh->slotBytes != c->id.slotBytes) {
        fail(c, ncclInvalidUsage, "ncclCommInitRankConfig: rank %d: shared memory %s belongs to another communicator (nranks %u, not %d)",
             c->rank, c->id.name, sh->nranks, c->nranks);
        return;
    }
    int32_t zero = 0;
    if (!at(sh->ranks[c->rank].pid).compare_exchange_strong(zero, (int32_t)c->pid)) {
        fail(c, ncclInvalidUsage, "ncclCommInitRankConfig: rank %d joined the communicator twice (pids %d and %d)", c->rank,
             (int)zero, (int)c->pid);
        markFailed(sh, c->rank);
        return;
    }
    if (at(sh->attached).fetch_add(1) + 1 == (uint32_t)c->nranks) {
        // Every rank has the segment mapped: its name is no longer needed.
        shm_unlink(c->id.name);
        c->unlinked = true;
        futexWake(&sh->attached);
    }
    Wait w = waitOn(c, &sh->attached, [&] { return at(sh->attached).load() == (uint32_t)c->nranks; });
    if (w != kDone) return;
    if (c->created) c->unlinked = true; // by whichever rank attached last
    int want = ncclInProgress;
    c->state.compare_exchange_strong(want, ncclSuccess);
}

// ---- Element types and reductions.

template <typename T> struct Elem {
    using Acc = T;
    static Acc load(T x) { return x; }
    static T store(Acc x) { return x; }
};
template <> struct Elem<__half> {
    using Acc = float;
    static float load(__half x) { return __half2float(x); }
    static __half store(float x) { return __float2half_rn(x); }
};
template <> struct Elem<__nv_bfloat16> {
    using Acc = float;
    static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// reduceInto writes the reduction of the n ranks' srcs[r][0:len) into dst, combining rank 0,
// 1, … in order and rounding each partial result to T (exact for the 16-bit types: a float
// sum or product of two of them rounded once to 16 bits is the correctly rounded result).
template <typename T> void reduceInto(T *dst, const T *const *srcs, int n, size_t len, int op) {
    using E = Elem<T>;
    using A = typename E::Acc;
    constexpr bool floating = std::is_floating_point_v<A>;
    T scale{};
    if constexpr (floating) scale = E::store(A(1) / A(n));
    auto in = [&](int r, size_t i) -> T {
        if constexpr (floating) {
            if (op == opAvg) return E::store(E::load(srcs[r][i]) * E::load(scale));
        }
        return srcs[r][i];
    };
    for (size_t i = 0; i < len; i++) {
        T acc = in(0, i);
        for (int r = 1; r < n; r++) {
            A a = E::load(acc), b = E::load(in(r, i));
            switch (op) {
            case opSum: case opAvg: acc = E::store(a + b); break;
            case opProd: acc = E::store(a * b); break;
            case opMax: acc = E::store(a < b ? b : a); break;
            case opMin: acc = E::store(b < a ? b : a); break;
            }
        }
        if constexpr (!floating) {
            if (op == opAvg) acc = E::store(E::load(acc) / (A)n);
        }
        dst[i] = acc;
    }
}

void reduceAny(void *dst, const void *const *srcs, int n, size_t len, int dtype, int op) {
#define R(T) reduceInto<T>(static_cast<T *>(dst), reinterpret_cast<const T *const *>(srcs), n, len, op); return
    switch (dtype) {
    case tInt8: R(int8_t);
    case tUint8: R(uint8_t);
    case tInt32: R(int32_t);
    case tUint32: R(uint32_t);
    case tInt64: R(int64_t);
    case tUint64: R(uint64_t);
    case tFloat16: R(__half);
    case tFloat32: R(float);
    case tFloat64: R(double);
    case tBfloat16: R(__nv_bfloat16);
    }
#undef R
}

// ---- Collectives.

struct Call {
    std::shared_ptr<Comm> c;
    Desc d;
    const char *send;
    char *recv;
};

bool sameCall(const Desc &a, const Desc &b) {
    return a.seq == b.seq && a.count == b.count && a.coll == b.coll && a.dtype == b.dtype && a.op == b.op && a.root == b.root;
}

std::string describe(const Desc &d) {
    char b[256];
    snprintf(b, sizeof b, "call %llu: %s of %llu elements, type %d, op %d, root %d", (unsigned long long)d.seq, collName(d.coll),
             (unsigned long long)d.count, d.dtype, d.op, d.root);
    return b;
}

// runCall is a collective on the stream's worker. It returns a CUresult: always success,
// since NCCL's failures are the communicator's (ncclCommGetAsyncError), not the context's.
int runCall(void *arg, char *, size_t) {
    Call *k = static_cast<Call *>(arg);
    Comm *c = k->c.get();
    if (c->aborted.load() || c->state.load() != ncclSuccess) return CUDA_SUCCESS;
    const Desc &d = k->d;
    const int n = c->nranks, me = c->rank;
    const size_t e = typeSize(d.dtype), slot = c->sh->slotBytes;
    // Elements per chunk: reduce-scatter puts every rank's block of the chunk in one slot.
    size_t per = d.coll == cReduceScatter ? slot / (e * n) : slot / e;
    size_t chunks = d.count == 0 ? 1 : (d.count + per - 1) / per;
    const void *srcs[kMaxRanks];
    for (size_t ch = 0; ch < chunks; ch++) {
        size_t off = ch * per, len = d.count - off < per ? d.count - off : per;
        if (d.count == 0) len = 0;
        char *mine = c->slot(me);
        if (ch == 0) c->sh->ranks[me].desc = d;
        switch (d.coll) {
        case cAllReduce: case cReduce: case cAllGather:
            memcpy(mine, k->send + off * e, len * e);
            break;
        case cBroadcast:
            if (me == d.root) memcpy(mine, k->send + off * e, len * e);
            break;
        case cReduceScatter:
            for (int s = 0; s < n; s++) memcpy(mine + s * len * e, k->send + (s * d.count + off) * e, len * e);
            break;
        }
        if (barrier(c) != kDone) return CUDA_SUCCESS;
        if (ch == 0) {
            for (int r = 0; r < n; r++) {
                if (!sameCall(c->sh->ranks[r].desc, c->sh->ranks[0].desc)) {
                    // Every rank sees the same descriptions, so every rank stops here.
                    fail(c, ncclInvalidUsage, "the ranks' calls do not match: rank 0 made %s, rank %d %s",
                         describe(c->sh->ranks[0].desc).c_str(), r, describe(c->sh->ranks[r].desc).c_str());
                    return CUDA_SUCCESS;
                }
            }
        }
        switch (d.coll) {
        case cAllReduce: case cReduce:
            if (d.coll == cAllReduce || me == d.root) {
                for (int r = 0; r < n; r++) srcs[r] = c->slot(r);
                reduceAny(k->recv + off * e, srcs, n, len, d.dtype, d.op);
            }
            break;
        case cReduceScatter:
            for (int r = 0; r < n; r++) srcs[r] = c->slot(r) + me * len * e;
            reduceAny(k->recv + off * e, srcs, n, len, d.dtype, d.op);
            break;
        case cBroadcast:
            memmove(k->recv + off * e, c->slot(d.root), len * e);
            break;
        case cAllGather:
            for (int q = 0; q < n; q++) memmove(k->recv + (q * d.count + off) * e, c->slot(q), len * e);
            break;
        }
        if (barrier(c) != kDone) return CUDA_SUCCESS;
    }
    return CUDA_SUCCESS;
}

void deleteCall(void *arg) {
    Call *k = static_cast<Call *>(arg);
    k->c->pending.fetch_sub(1);
    delete k;
}

// inside checks that [p, p+n) is device (or pinned) memory of the emulated driver.
bool inside(const char *call, const char *what, const void *p, size_t n) {
    if (n == 0) return true;
    char why[512];
    if (cudaemu_check_range(reinterpret_cast<uintptr_t>(p), n, why, sizeof why)) return true;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s: %s (%zu bytes at %p): %s", call, what, n, p, why);
    setLastError("%s", msg);
    cudaemu_fail(CUDA_ERROR_ILLEGAL_ADDRESS, msg); // what NCCL's kernel reading it would cause
    return false;
}

int enqueueCall(int coll, const void *send, void *recv, size_t count, int dtype, int op, int root, void *comm, CUstream stream) {
    const char *name = collName(coll);
    cudaemu_count("nccl", name);
    auto c = lookup(comm);
    if (!c) {
        setLastError("%s: %p is not a live communicator", name, comm);
        return ncclInvalidArgument;
    }
    if (int st = c->state.load(); st != ncclSuccess) {
        setLastError("%s: the communicator is %s", name, st == ncclInProgress ? "still being initialised" : "in error");
        return st == ncclInProgress ? ncclInvalidUsage : st;
    }
    if (dtype < 0 || dtype >= tCount || op < 0 || op >= opCount) {
        setLastError("%s: invalid data type %d or reduction %d", name, dtype, op);
        return ncclInvalidArgument;
    }
    if ((coll == cBroadcast || coll == cReduce) && (root < 0 || root >= c->nranks)) {
        setLastError("%s: root %d of a communicator of %d ranks", name, root, c->nranks);
        return ncclInvalidArgument;
    }
    size_t e = typeSize(dtype), n = (size_t)c->nranks;
    size_t sendBytes = count * e, recvBytes = count * e;
    if (coll == cReduceScatter) sendBytes *= n;
    if (coll == cAllGather) recvBytes *= n;
    bool sends = coll != cBroadcast || c->rank == root, recvs = coll != cReduce || c->rank == root;
    if ((sends && !inside(name, "send buffer", send, sendBytes)) || (recvs && !inside(name, "receive buffer", recv, recvBytes))) {
        return ncclSuccess; // the stream has the fault, as after a kernel's illegal access
    }
    std::lock_guard<std::mutex> l(c->callMu);
    auto *k = new Call{c, Desc{c->seq, count, coll, dtype, op, root}, static_cast<const char *>(send), static_cast<char *>(recv)};
    c->pending.fetch_add(1);
    if (int r = cudaemu_enqueue(stream, runCall, k, deleteCall); r != 0) {
        deleteCall(k);
        setLastError("%s: queueing on stream %p: CUresult %d", name, (void *)stream, r);
        return ncclUnhandledCudaError;
    }
    c->seq++;
    return ncclSuccess;
}

// stopRendezvous makes the rendezvous thread give up (if it still runs) and waits for it.
void stopRendezvous(Comm *c) {
    std::lock_guard<std::mutex> l(c->rvMu);
    if (c->rendezvous.joinable()) c->rendezvous.join();
    if (c->created && !c->unlinked) unlinkOnce(c);
}

} // namespace

#define API extern "C" __attribute__((visibility("default")))

struct ncclUniqueId {
    char internal[128];
};

struct ncclConfig_t {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    // later fields are ignored
};

API int ncclGetVersion(int *v) {
    cudaemu_count("nccl", "ncclGetVersion");
    if (!v) return ncclInvalidArgument;
    *v = kVersion;
    return ncclSuccess;
}

API int ncclGetUniqueId(ncclUniqueId *out) {
    cudaemu_count("nccl", "ncclGetUniqueId");
    if (!out) return ncclInvalidArgument;
    Id id{};
    id.magic = kIdMagic;
    uint64_t rnd[2];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
        setLastError("ncclGetUniqueId: getrandom: %s", strerror(errno));
        return ncclSystemError;
    }
    id.token = rnd[0];
    const char *kib = getenv("QVD_CUDAEMU_NCCL_SLOT_KIB");
    long slot = kib && *kib ? strtol(kib, nullptr, 0) : (long)kDefaultSlotKiB;
    if (slot < 1 || slot > (1 << 20)) {
        setLastError("ncclGetUniqueId: QVD_CUDAEMU_NCCL_SLOT_KIB=%s: want 1 to 1048576", kib);
        return ncclInvalidArgument;
    }
    id.slotBytes = (uint32_t)slot << 10;
    snprintf(id.name, sizeof id.name, "/qvd-nccl-emu-%d-%016llx", (int)getpid(), (unsigned long long)rnd[1]);
    memset(out, 0, sizeof *out);
    memcpy(out->internal, &id, sizeof id);
    return ncclSuccess;
}

API int ncclCommInitRankConfig(void **out, int nranks, ncclUniqueId uid, int rank, ncclConfig_t *cfg) {
    cudaemu_count("nccl", "ncclCommInitRankConfig");
    if (!out) return ncclInvalidArgument;
    *out = nullptr;
    Id id;
    memcpy(&id, uid.internal, sizeof id);
    if (id.magic != kIdMagic || memchr(id.name, 0, sizeof id.name) == nullptr) {
        setLastError("ncclCommInitRankConfig: the unique id was not made by the emulated NCCL's ncclGetUniqueId");
        return ncclInvalidArgument;
    }
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks) {
        setLastError("ncclCommInitRankConfig: rank %d of %d (the emulator allows up to %d ranks)", rank, nranks, kMaxRanks);
        return ncclInvalidArgument;
    }
    bool blocking = true;
    if (cfg) {
        if (cfg->magic != kConfigMagic || cfg->size < offsetof(ncclConfig_t, blocking) + sizeof(int) || cfg->version < 21400) {
            setLastError("ncclCommInitRankConfig: config has magic %#x, size %zu, version %u: not an ncclConfig_t from "
                         "NCCL_CONFIG_INITIALIZER",
                         cfg->magic, cfg->size, cfg->version);
            return ncclInvalidArgument;
        }
        blocking = cfg->blocking != 0;
    }
    auto c = std::make_shared<Comm>();
    c->rank = rank;
    c->nranks = nranks;
    c->pid = getpid();
    c->id = id;
    CUdevice dev = 0;
    if (cuCtxGetDevice(&dev) == CUDA_SUCCESS) c->dev = dev;
    {
        std::lock_guard<std::mutex> l(regMu);
        (*live)[c.get()] = c;
    }
    {
        std::lock_guard<std::mutex> l(c->rvMu);
        c->rendezvous = std::thread(rendezvous, c.get());
    }
    *out = c.get();
    if (blocking) {
        stopRendezvous(c.get());
        return c->state.load();
    }
    return ncclInProgress;
}

API int ncclCommInitRank(void **out, int nranks, ncclUniqueId uid, int rank) {
    cudaemu_count("nccl", "ncclCommInitRank");
    return ncclCommInitRankConfig(out, nranks, uid, rank, nullptr);
}

API int ncclCommGetAsyncError(void *comm, int *state) {
    cudaemu_count("nccl", "ncclCommGetAsyncError");
    auto c = lookup(comm);
    if (!c || !state) return ncclInvalidArgument;
    int s = c->state.load();
    if (s == ncclSuccess && c->finalizing.load() && c->pending.load() > 0) s = ncclInProgress;
    *state = s;
    return ncclSuccess;
}

API int ncclCommFinalize(void *comm) {
    cudaemu_count("nccl", "ncclCommFinalize");
    auto c = lookup(comm);
    if (!c) return ncclInvalidArgument;
    if (c->state.load() == ncclInProgress) {
        setLastError("ncclCommFinalize: the communicator is still being initialised");
        return ncclInvalidUsage;
    }
    c->finalizing.store(true);
    return c->pending.load() > 0 ? ncclInProgress : ncclSuccess;
}

// release drops comm from the live set; work still queued gives up, and the peers with it
// (peers waiting on this rank would otherwise wait for ever).
static int release(void *comm, bool abort) {
    std::shared_ptr<Comm> c;
    {
        std::lock_guard<std::mutex> l(regMu);
        auto it = live->find(static_cast<Comm *>(comm));
        if (it == live->end()) return ncclInvalidArgument;
        c = it->second;
        live->erase(it);
    }
    if (abort || c->pending.load() > 0 || c->state.load() == ncclInProgress) {
        c->aborted.store(true);
        std::lock_guard<std::mutex> l(c->shMu);
        if (c->sh) markFailed(c->sh, c->rank);
    }
    stopRendezvous(c.get());
    return ncclSuccess; // the mapping goes with the last reference (queued work holds one)
}

API int ncclCommDestroy(void *comm) {
    cudaemu_count("nccl", "ncclCommDestroy");
    return release(comm, false);
}

API int ncclCommAbort(void *comm) {
    cudaemu_count("nccl", "ncclCommAbort");
    return release(comm, true);
}

API int ncclCommCount(void *comm, int *n) {
    cudaemu_count("nccl", "ncclCommCount");
    auto c = lookup(comm);
    if (!c || !n) return ncclInvalidArgument;
    *n = c->nranks;
    return ncclSuccess;
}

API int ncclCommUserRank(void *comm, int *r) {
    cudaemu_count("nccl", "ncclCommUserRank");
    auto c = lookup(comm);
    if (!c || !r) return ncclInvalidArgument;
    *r = c->rank;
    return ncclSuccess;
}

API int ncclCommCuDevice(void *comm, int *d) {
    cudaemu_count("nccl", "ncclCommCuDevice");
    auto c = lookup(comm);
    if (!c || !d) return ncclInvalidArgument;
    *d = c->dev;
    return ncclSuccess;
}

API const char *ncclGetErrorString(int r) {
    cudaemu_count("nccl", "ncclGetErrorString");
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

API const char *ncclGetLastError(void *) {
    cudaemu_count("nccl", "ncclGetLastError");
    thread_local std::string copy;
    std::lock_guard<std::mutex> l(errMu);
    copy = *lastError;
    return copy.c_str();
}

API int ncclAllReduce(const void *s, void *r, size_t count, int dt, int op, void *comm, CUstream st) {
    return enqueueCall(cAllReduce, s, r, count, dt, op, 0, comm, st);
}

API int ncclReduceScatter(const void *s, void *r, size_t recvcount, int dt, int op, void *comm, CUstream st) {
    return enqueueCall(cReduceScatter, s, r, recvcount, dt, op, 0, comm, st);
}

API int ncclAllGather(const void *s, void *r, size_t sendcount, int dt, void *comm, CUstream st) {
    return enqueueCall(cAllGather, s, r, sendcount, dt, opSum, 0, comm, st);
}

API int ncclBroadcast(const void *s, void *r, size_t count, int dt, int root, void *comm, CUstream st) {
    return enqueueCall(cBroadcast, s, r, count, dt, opSum, root, comm, st);
}

API int ncclReduce(const void *s, void *r, size_t count, int dt, int op, int root, void *comm, CUstream st) {
    return enqueueCall(cReduce, s, r, count, dt, op, root, comm, st);
}
