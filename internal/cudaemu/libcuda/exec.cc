// The block executor: the threads of a block are fibers on the stream's worker thread,
// switched at the synchronising intrinsics only, so __syncthreads and the warp shuffles are
// real barriers across the block's (warp's) threads. A fault inside a kernel (a guard page of
// a device allocation, a fiber's stack guard, an integer division by zero) is caught by a
// signal handler that jumps back here with the kernel, block and thread that faulted.
#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

#include "../include/cuda_emu.h"
#include "emu.h"

namespace cudaemu {

thread_local ThreadState *cur;

namespace {

// ---- Context switch (x86-64 System V): callee-saved registers, MXCSR and the x87 control
// word on the old stack, the stack pointer into *save.
extern "C" void cudaemu_swap(void **save, void *to);
extern "C" void cudaemu_fiber_start();
asm(R"(
    .text
    .globl cudaemu_swap
    .hidden cudaemu_swap
    .type cudaemu_swap,@function
cudaemu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudaemu_swap,.-cudaemu_swap

    .globl cudaemu_fiber_start
    .hidden cudaemu_fiber_start
    .type cudaemu_fiber_start,@function
cudaemu_fiber_start:
    movq %r13, %rdi
    callq *%r12
    ud2
    .size cudaemu_fiber_start,.-cudaemu_fiber_start
)");

constexpr size_t kStack = 64 << 10; // per fiber; kernels are shallow
constexpr size_t kPage = 4096;

struct Fiber {
    void *sp;
    ThreadState ts;
    int linear;
    bool done;
    const unsigned *waitGen; // waiting at a barrier until *waitGen != waitVal
    unsigned waitVal;
    const char *waitWhat;
};

struct Warp {
    int size;
    int arrived;
    unsigned gen;
    uint32_t slot[32];
};

struct Exec {
    void *schedSP;
    std::vector<char *> stacks;
    std::vector<Fiber> fibers;
    Fiber *running;
    const KernelInfo *k;
    void **params;
    int n;
    // The block barrier and its reductions (__syncthreads_or/and/count).
    int arrived;
    unsigned gen;
    int accOr, accAnd, accCount, resOr, resAnd, resCount;
    Warp warps[32];
    // Faults.
    sigjmp_buf jmp;
    volatile sig_atomic_t inKernel;
    int sig;
    uintptr_t addr;
    bool write;
    char altstack[64 << 10];
    bool altInstalled;
};

thread_local Exec *ex;

Exec &exec() {
    if (!ex) {
        ex = new Exec(); // one per worker thread, kept for its life
    }
    if (!ex->altInstalled) {
        stack_t ss{};
        ss.ss_sp = ex->altstack;
        ss.ss_size = sizeof ex->altstack;
        sigaltstack(&ss, nullptr);
        ex->altInstalled = true;
    }
    return *ex;
}

char *newStack() {
    void *p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        perror("cudaemu: fiber stack");
        abort();
    }
    mprotect(p, kPage, PROT_NONE); // overflow faults instead of corrupting a neighbour
    return static_cast<char *>(p);
}

void yield() {
    Exec &e = exec();
    cudaemu_swap(&e.running->sp, e.schedSP);
}

[[noreturn]] void fiberMain(Fiber *f) {
    Exec &e = exec();
    cur = &f->ts;
    e.k->run(e.params);
    f->done = true;
    cudaemu_swap(&f->sp, e.schedSP);
    abort(); // a finished fiber is never resumed
}

// arrive waits at a barrier of count threads whose state is (arrived, gen); the last to
// arrive releases it and runs release first.
template <typename F> void arrive(int &arrived, unsigned &gen, int count, const char *what, F release) {
    if (++arrived == count) {
        arrived = 0;
        release();
        gen++;
        return;
    }
    Fiber *f = exec().running;
    f->waitGen = &gen;
    f->waitVal = gen;
    f->waitWhat = what;
    yield();
}

int blockBarrier(int pred, const char *what) {
    Exec &e = exec();
    e.accOr |= pred != 0;
    e.accAnd &= pred != 0;
    e.accCount += pred != 0;
    arrive(e.arrived, e.gen, e.n, what, [&] {
        e.resOr = e.accOr, e.resAnd = e.accAnd, e.resCount = e.accCount;
        e.accOr = 0, e.accAnd = 1, e.accCount = 0;
    });
    return 0;
}

void warpBarrier(unsigned mask, const char *what) {
    Exec &e = exec();
    Warp &w = e.warps[e.running->linear / 32];
    unsigned full = w.size == 32 ? 0xffffffffu : (1u << w.size) - 1;
    int count = __builtin_popcount(mask & full);
    arrive(w.arrived, w.gen, count, what, [] {});
}

// ---- Fault handling.

struct sigaction oldSegv, oldBus, oldFpe, oldIll;

void onFault(int sig, siginfo_t *info, void *uc) {
    Exec *e = ex;
    if (e && e->inKernel) {
        e->inKernel = 0;
        e->sig = sig;
        e->addr = reinterpret_cast<uintptr_t>(info->si_addr);
#if defined(__x86_64__)
        e->write = sig == SIGSEGV && (static_cast<ucontext_t *>(uc)->uc_mcontext.gregs[REG_ERR] & 2);
#endif
        siglongjmp(e->jmp, 1);
    }
    struct sigaction *old = sig == SIGSEGV ? &oldSegv : sig == SIGBUS ? &oldBus : sig == SIGFPE ? &oldFpe : &oldIll;
    if (old->sa_flags & SA_SIGINFO) {
        old->sa_sigaction(sig, info, uc);
        return;
    }
    if (old->sa_handler == SIG_DFL || old->sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    old->sa_handler(sig);
}

std::string faultMessage(Exec &e, Dim grid, Dim block) {
    char head[256];
    const Fiber *f = e.running;
    snprintf(head, sizeof head, "kernel %s (grid %ux%ux%u, block %ux%ux%u): block (%u,%u,%u) thread (%u,%u,%u): ",
             e.k->name, grid.x, grid.y, grid.z, block.x, block.y, block.z, f->ts.bid.x, f->ts.bid.y, f->ts.bid.z,
             f->ts.tid.x, f->ts.tid.y, f->ts.tid.z);
    std::string m = head;
    char buf[128];
    switch (e.sig) {
    case SIGFPE:
        return m + "arithmetic exception (an integer division by zero)";
    case SIGSEGV:
    case SIGBUS: {
        // The fiber's own stack guard?
        for (char *s : e.stacks) {
            uintptr_t lo = reinterpret_cast<uintptr_t>(s);
            if (e.addr >= lo && e.addr < lo + kPage) {
                return m + "fiber stack overflow";
            }
        }
        snprintf(buf, sizeof buf, "illegal %s at address 0x%lx: ", e.write ? "write" : "read", (unsigned long)e.addr);
        return m + buf + describeAddress(e.addr);
    }
    }
    snprintf(buf, sizeof buf, "signal %d", e.sig);
    return m + buf;
}

} // namespace

void installFaultHandlers() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa{};
        sa.sa_sigaction = onFault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &oldSegv);
        sigaction(SIGBUS, &sa, &oldBus);
        sigaction(SIGFPE, &sa, &oldFpe);
        sigaction(SIGILL, &sa, &oldIll);
    });
}

void syncthreads() { blockBarrier(0, "__syncthreads"); }
int syncthreads_or(int p) {
    blockBarrier(p, "__syncthreads_or");
    return exec().resOr;
}
int syncthreads_and(int p) {
    blockBarrier(p, "__syncthreads_and");
    return exec().resAnd;
}
int syncthreads_count(int p) {
    blockBarrier(p, "__syncthreads_count");
    return exec().resCount;
}
void syncwarp(unsigned mask) { warpBarrier(mask, "__syncwarp"); }

uint32_t shfl(unsigned mask, uint32_t v, int mode, int arg, int width) {
    Exec &e = exec();
    int lane = e.running->linear % 32;
    Warp &w = e.warps[e.running->linear / 32];
    w.slot[lane] = v;
    warpBarrier(mask, "__shfl_sync"); // every lane has written its value
    int seg = lane & ~(width - 1);
    int src = lane;
    switch (mode) {
    case 0:
        src = seg + (arg & (width - 1));
        break;
    case 1:
        src = lane - arg >= seg ? lane - arg : lane;
        break;
    case 2:
        src = lane + arg < seg + width ? lane + arg : lane;
        break;
    case 3:
        src = (lane ^ arg) < seg + width ? lane ^ arg : lane;
        break;
    }
    uint32_t r = src < w.size && (mask >> src & 1) ? w.slot[src] : v;
    warpBarrier(mask, "__shfl_sync"); // every lane has read before the slots are reused
    return r;
}

bool runLaunch(const KernelInfo *k, Dim grid, Dim block, void **params, std::string &msg) {
    Exec &e = exec();
    int n = block.x * block.y * block.z;
    while ((int)e.stacks.size() < n) {
        e.stacks.push_back(newStack());
    }
    e.fibers.assign(n, Fiber{});
    e.k = k;
    e.params = params;
    e.n = n;
    if (sigsetjmp(e.jmp, 1)) {
        msg = faultMessage(e, grid, block);
        cur = nullptr;
        return false;
    }
    for (unsigned bz = 0; bz < grid.z; bz++) {
        for (unsigned by = 0; by < grid.y; by++) {
            for (unsigned bx = 0; bx < grid.x; bx++) {
                e.arrived = 0, e.gen = 0, e.accOr = 0, e.accAnd = 1, e.accCount = 0;
                for (int w = 0; w < 32; w++) {
                    e.warps[w] = Warp{};
                    e.warps[w].size = std::max(0, std::min(32, n - 32 * w));
                }
                for (int i = 0; i < n; i++) {
                    Fiber &f = e.fibers[i];
                    f = Fiber{};
                    f.linear = i;
                    f.ts.tid = {unsigned(i) % block.x, unsigned(i) / block.x % block.y, unsigned(i) / (block.x * block.y)};
                    f.ts.bid = {bx, by, bz};
                    f.ts.bdim = {block.x, block.y, block.z};
                    f.ts.gdim = {grid.x, grid.y, grid.z};
                    // The first switch pops the frame cudaemu_swap pushes, with r12 = fiberMain
                    // and r13 = &f, and returns into cudaemu_fiber_start.
                    uintptr_t top = (reinterpret_cast<uintptr_t>(e.stacks[i]) + kStack) & ~uintptr_t(15);
                    uint64_t *sp = reinterpret_cast<uint64_t *>(top - 16);
                    *--sp = reinterpret_cast<uint64_t>(&cudaemu_fiber_start);
                    *--sp = 0;                                    // rbp
                    *--sp = 0;                                    // rbx
                    *--sp = reinterpret_cast<uint64_t>(&fiberMain); // r12
                    *--sp = reinterpret_cast<uint64_t>(&f);       // r13
                    *--sp = 0;                                    // r14
                    *--sp = 0;                                    // r15
                    *--sp = 0x037f00001f80ull;                    // MXCSR 0x1f80, x87 CW 0x037f
                    f.sp = sp;
                }
                e.inKernel = 1;
                for (;;) {
                    bool ran = false;
                    int done = 0;
                    for (int i = 0; i < n; i++) {
                        Fiber &f = e.fibers[i];
                        if (f.done) {
                            done++;
                            continue;
                        }
                        if (f.waitGen && *f.waitGen == f.waitVal) {
                            continue;
                        }
                        f.waitGen = nullptr;
                        e.running = &f;
                        cur = &f.ts;
                        cudaemu_swap(&e.schedSP, f.sp);
                        ran = true;
                        done += f.done;
                    }
                    if (done == n) {
                        break;
                    }
                    if (!ran) {
                        e.inKernel = 0;
                        int waiting = 0;
                        const char *what = "a barrier";
                        for (auto &f : e.fibers) {
                            if (!f.done) {
                                waiting++;
                                what = f.waitWhat;
                            }
                        }
                        char buf[512];
                        snprintf(buf, sizeof buf,
                                 "kernel %s (grid %ux%ux%u, block %ux%ux%u): block (%u,%u,%u): %s can never complete: %d "
                                 "of the block's %d threads wait there, %d have exited (a barrier in divergent code)",
                                 k->name, grid.x, grid.y, grid.z, block.x, block.y, block.z, bx, by, bz, what,
                                 waiting, n, n - waiting);
                        msg = buf;
                        cur = nullptr;
                        return false;
                    }
                }
                e.inKernel = 0;
            }
        }
    }
    cur = nullptr;
    return true;
}

} // namespace cudaemu
