// cuda_emu.h: what a CUDA C++ kernel source needs from nvcc, for g++ -std=c++20, so that
// engine/cuda/kernels/kernels.cu compiles unchanged into the emulated driver (libcuda/).
// It is force-included (g++ -include cuda_emu.h) before the source.
//
// Execution model (runtime in libcuda/exec.cc): a launch runs its blocks one after another
// on the stream's worker thread; the threads of a block are fibers on that thread, switched
// only at the synchronising intrinsics (__syncthreads*, __syncwarp, the __shfl_*_sync), so
// that a barrier is a real barrier: a fiber waits there until every thread of its block (of
// its warp) arrives, and a barrier that some thread never reaches is reported as an error
// instead of hanging. __shared__ variables are per OS thread (static thread_local), which is
// per block since a worker runs one block at a time.
//
// Half and bfloat16 come from CUDA 11.8's own headers (cuda_fp16.h, cuda_bf16.h), whose host
// conversions round to nearest even as the device's do.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <math.h>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Shared by the fibers of the running block, i.e. by the OS thread that runs it.
#define __shared__ static thread_local
#define __constant__ static const

namespace cudaemu {

struct u3 {
    unsigned x, y, z;
};

// The thread (fiber) being run and the launch it belongs to; set by the block scheduler on
// every switch.
struct ThreadState {
    u3 tid;
    u3 bid;
    u3 bdim;
    u3 gdim;
};

extern thread_local ThreadState *cur;

// Barriers and warp exchanges, implemented by the scheduler (they switch fibers).
void syncthreads();
int syncthreads_or(int pred);
int syncthreads_and(int pred);
int syncthreads_count(int pred);
void syncwarp(unsigned mask);
// Lane exchange: mode 0 idx (lane src), 1 up, 2 down, 3 xor.
uint32_t shfl(unsigned mask, uint32_t v, int mode, int arg, int width);

template <typename T> inline T shfl_t(unsigned mask, T v, int mode, int arg, int width) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    uint32_t b;
    __builtin_memcpy(&b, &v, 4);
    b = shfl(mask, b, mode, arg, width);
    T r;
    __builtin_memcpy(&r, &b, 4);
    return r;
}

} // namespace cudaemu

#define threadIdx (::cudaemu::cur->tid)
#define blockIdx (::cudaemu::cur->bid)
#define blockDim (::cudaemu::cur->bdim)
#define gridDim (::cudaemu::cur->gdim)
#define warpSize 32

inline void __syncthreads() { cudaemu::syncthreads(); }
inline int __syncthreads_or(int p) { return cudaemu::syncthreads_or(p); }
inline int __syncthreads_and(int p) { return cudaemu::syncthreads_and(p); }
inline int __syncthreads_count(int p) { return cudaemu::syncthreads_count(p); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cudaemu::syncwarp(mask); }

template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return cudaemu::shfl_t(mask, v, 0, src, width);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return cudaemu::shfl_t(mask, v, 1, (int)d, width);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return cudaemu::shfl_t(mask, v, 2, (int)d, width);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    return cudaemu::shfl_t(mask, v, 3, m, width);
}

// Atomics: blocks of one launch run in turn, but other streams' kernels run concurrently.
template <typename T> inline T atomicAdd(T *p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T> inline T atomicExch(T *p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <typename T> inline T atomicMax(T *p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
template <typename T> inline T atomicCAS(T *p, T cmp, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v);
    return cmp;
}

// The explicitly rounded intrinsics: x86-64's SSE arithmetic rounds each operation to nearest
// even, and the library is built with -ffp-contract=off so that no multiply and add fuse.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }

using std::isfinite;
using std::isinf;
using std::isnan;
