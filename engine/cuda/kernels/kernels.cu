// Kernels of qvd's CUDA backend (package gpu/cuda), one entry point per operation and element
// type: the semantics are those of the gpu.Device methods of the same name (gpu/device.go).
//
// Every kernel loads its operands as float, computes in float and rounds once, to nearest even,
// when it stores; reductions accumulate in float in a fixed order inside a block, so a result
// does not depend on scheduling (SumSquares' atomicAdd across blocks is the one exception).
// Elementwise kernels are grid-stride loops over 64-bit indices, launched with 256 threads.
//
// Entry points are extern "C" so that the names in the PTX are the ones gpu/cuda looks up:
// op_T for operations on one element type, op_D_S for those that read one type and write
// another (T, D, S one of f32, f16, bf16). Buffers that the interface lets alias (ReLU's y and
// x, SoftmaxXent's dlogits and logits) are never declared __restrict__.
//
// After editing, run `go generate ./gpu/cuda/kernels` (nvcc) and commit kernels.ptx with it.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;

// Loads and stores in a buffer's type; every half and bfloat16 value is exact in float.
__device__ __forceinline__ float tof(float x) { return x; }
__device__ __forceinline__ float tof(__half x) { return __half2float(x); }
__device__ __forceinline__ float tof(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ __half fromf<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Block sizes the Go side launches with (gpu/cuda/launch.go).
#define THREADS 256
#define TILE 32 // SumRows' column tile: a block is TILE × TILE threads

// Instantiation over the float types: X(suffix, C type) and X(suffix1, T1, suffix2, T2).
#define EACH_TYPE(X) X(f32, float) X(f16, __half) X(bf16, __nv_bfloat16)
#define EACH_PAIR_WITH(X, s, T) X(s, T, f32, float) X(s, T, f16, __half) X(s, T, bf16, __nv_bfloat16)
#define EACH_PAIR(X) \
    EACH_PAIR_WITH(X, f32, float) EACH_PAIR_WITH(X, f16, __half) EACH_PAIR_WITH(X, bf16, __nv_bfloat16)

// ---- Failure reports ----

// A kernel that finds an argument out of range in device memory (a label, a max-pool index)
// skips it and reports it, so that engine/cuda latches the error when it next waits for the
// stream: the first report claims report[0] with its code (REPORT_*), then stores the item
// (row or element), the value and its bound in report[1..3]. engine/cuda clears the words once
// it has read them (launch.go, readReport).
#define REPORT_LABEL 1ull      // SoftmaxXent: a label outside [0, classes)
#define REPORT_POOL_INDEX 2ull // MaxPool2Grad: an index outside dx

__device__ __forceinline__ void report_failure(unsigned long long *report, unsigned long long code, i64 item, i64 value,
                                               i64 bound) {
    if (atomicCAS(&report[0], 0ull, code) == 0ull) {
        report[1] = (unsigned long long)item;
        report[2] = (unsigned long long)value;
        report[3] = (unsigned long long)bound;
    }
}

// ---- Fill, Copy ----

template <typename T> __device__ __forceinline__ void fill(T *y, i64 n, float v) {
    T t = fromf<T>(v);
    GRID_STRIDE(i, n) { y[i] = t; }
}

template <typename D, typename S> __device__ __forceinline__ void convert(D *dst, const S *src, i64 n) {
    GRID_STRIDE(i, n) { dst[i] = fromf<D>(tof(src[i])); }
}

// ---- AddBias, SumRows ----

template <typename T>
__device__ __forceinline__ void add_bias(T *y, const T *bias, i64 rows, i64 cols, i64 perRow) {
    GRID_STRIDE(i, rows * cols) {
        i64 r = i / cols;
        i64 j = perRow ? r : i - r * cols;
        y[i] = fromf<T>(tof(y[i]) + tof(bias[j]));
    }
}

// dst[c] = beta·dst[c] + Σ_r src[r, c]: a TILE×TILE block owns TILE columns; thread (x, y) sums
// rows y, y+TILE, ... of column x, then row 0 of the block adds the TILE partial sums in order.
// dst is not read when beta is 0 (BLAS's convention: it may hold garbage, NaN included).
template <typename D, typename S>
__device__ __forceinline__ void sum_rows(D *dst, const S *src, i64 rows, i64 cols, float beta) {
    __shared__ float part[TILE][TILE + 1];
    for (i64 c0 = (i64)blockIdx.x * TILE; c0 < cols; c0 += (i64)gridDim.x * TILE) {
        i64 c = c0 + threadIdx.x;
        float s = 0.0f;
        if (c < cols) {
            for (i64 r = threadIdx.y; r < rows; r += TILE) s += tof(src[r * cols + c]);
        }
        part[threadIdx.y][threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.y == 0 && c < cols) {
            float t = 0.0f;
            for (int k = 0; k < TILE; k++) t += part[k][threadIdx.x];
            if (beta != 0.0f) t = beta * tof(dst[c]) + t;
            dst[c] = fromf<D>(t);
        }
        __syncthreads();
    }
}

// Sums the block's THREADS values v in a fixed tree order; the result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) warp[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < THREADS / 32 ? warp[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    __syncthreads(); // warp[] is reused by the caller's next iteration
    return v;
}

// dst[r] = beta·dst[r] + Σ_c src[r, c]: one block per row.
template <typename D, typename S>
__device__ __forceinline__ void sum_cols(D *dst, const S *src, i64 rows, i64 cols, float beta) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const S *row = src + r * cols;
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += THREADS) s += tof(row[c]);
        s = block_sum(s);
        if (threadIdx.x == 0) {
            if (beta != 0.0f) s = beta * tof(dst[r]) + s;
            dst[r] = fromf<D>(s);
        }
    }
}

// ---- ReLU ----

// Go's max(x, 0), as the reference device computes it: a NaN stays NaN, -0 becomes +0.
template <typename T> __device__ __forceinline__ void relu(T *y, const T *x, i64 n) {
    GRID_STRIDE(i, n) {
        float v = tof(x[i]);
        y[i] = fromf<T>(v > 0.0f || isnan(v) ? v : 0.0f);
    }
}

template <typename T> __device__ __forceinline__ void relu_grad(T *dx, const T *dy, const T *y, i64 n) {
    GRID_STRIDE(i, n) {
        float g = tof(dy[i]);
        dx[i] = fromf<T>(tof(y[i]) > 0.0f ? g : 0.0f);
    }
}

// ---- Transpose01 (a bit-exact move: no conversion) ----

template <typename T> __device__ __forceinline__ void transpose01(T *dst, const T *src, i64 a, i64 b, i64 r) {
    // dst is b × a × r; element (j, i, t) comes from src (i, j, t).
    GRID_STRIDE(o, a * b * r) {
        i64 t = o % r;
        i64 ji = o / r;
        i64 i = ji % a;
        i64 j = ji / a;
        dst[o] = src[(i * b + j) * r + t];
    }
}

// ---- Im2Col, Col2Im ----

// cols is (c·k·k) × (n·oh·ow): row (ci·k + ky)·k + kx, column (s·oh + oy)·ow + ox holds
// x[s, ci, oy+ky-pad, ox+kx-pad], or 0 outside x.
template <typename T>
__device__ __forceinline__ void im2col(T *cols, const T *x, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad) {
    i64 oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1;
    i64 ncol = n * oh * ow;
    GRID_STRIDE(e, c * k * k * ncol) {
        i64 row = e / ncol, col = e - row * ncol;
        i64 kx = row % k, ky = (row / k) % k, ci = row / (k * k);
        i64 ox = col % ow, oy = (col / ow) % oh, s = col / (ow * oh);
        i64 yy = oy + ky - pad, xx = ox + kx - pad;
        T v = fromf<T>(0.0f);
        if (yy >= 0 && yy < h && xx >= 0 && xx < w) v = x[((s * c + ci) * h + yy) * w + xx];
        cols[e] = v;
    }
}

// The adjoint as a gather: each dx element sums, in (ky, kx) order, the column entries that
// read it, so no two threads write one element and no atomics are needed. The columns are
// dx's type (Col2Im) or float (the convolution's backward pass: col2im_T_f32 reads the
// GEMM's fp32 result, so dx is rounded once).
template <typename T, typename C>
__device__ __forceinline__ void col2im(T *dx, const C *cols, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad) {
    i64 oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1;
    i64 ncol = n * oh * ow;
    GRID_STRIDE(e, n * c * h * w) {
        i64 xx = e % w, yy = (e / w) % h, ci = (e / (w * h)) % c, s = e / (w * h * c);
        float sum = 0.0f;
        for (i64 ky = 0; ky < k; ky++) {
            i64 oy = yy + pad - ky;
            if (oy < 0 || oy >= oh) continue;
            for (i64 kx = 0; kx < k; kx++) {
                i64 ox = xx + pad - kx;
                if (ox < 0 || ox >= ow) continue;
                i64 row = (ci * k + ky) * k + kx;
                sum += tof(cols[row * ncol + (s * oh + oy) * ow + ox]);
            }
        }
        dx[e] = fromf<T>(sum);
    }
}

// The convolution's output from its fp32 GEMM result: y (n × out × ohw, NCHW) = ycm (out ×
// n × ohw, channel-major) + bias, rounded once to y's type.
template <typename T>
__device__ __forceinline__ void conv_out(T *y, const float *ycm, const T *bias, i64 n, i64 out, i64 ohw) {
    GRID_STRIDE(e, n * out * ohw) {
        i64 p = e % ohw, o = (e / ohw) % out, s = e / (ohw * out);
        y[e] = fromf<T>(ycm[(o * n + s) * ohw + p] + tof(bias[o]));
    }
}

// ---- MaxPool2 ----

// The first maximum in the order (0,0), (0,1), (1,0), (1,1) wins; a NaN in the first place
// stays, later NaNs never win (v > best is false for them). idx is the flat index into x.
template <typename T>
__device__ __forceinline__ void maxpool2(T *y, int *idx, const T *x, i64 planes, i64 h, i64 w) {
    i64 oh = h / 2, ow = w / 2;
    GRID_STRIDE(o, planes * oh * ow) {
        i64 ox = o % ow, oy = (o / ow) % oh, p = o / (ow * oh);
        i64 base = (p * h + 2 * oy) * w + 2 * ox;
        i64 cand[4] = {base, base + 1, base + w, base + w + 1};
        i64 bi = base;
        float best = tof(x[base]);
        for (int q = 1; q < 4; q++) {
            float v = tof(x[cand[q]]);
            if (v > best) {
                best = v;
                bi = cand[q];
            }
        }
        y[o] = x[bi];
        idx[o] = (int)bi;
    }
}

// dx[idx[i]] = dy[i] after dx was zeroed (gpu/cuda does that with a memset first). Indices
// outside dx (MaxPool2's never are) are skipped rather than written, and reported.
template <typename T>
__device__ __forceinline__ void maxpool2_scatter(T *dx, const T *dy, const int *idx, i64 n, i64 ndx,
                                                 unsigned long long *report) {
    GRID_STRIDE(i, n) {
        i64 j = idx[i];
        if (j >= 0 && j < ndx)
            dx[j] = dy[i];
        else
            report_failure(report, REPORT_POOL_INDEX, i, j, ndx);
    }
}

// ---- SoftmaxXent ----

// One warp per row. loss[r] = log Σ exp(x - max) - (x[label] - max); dlogits = (softmax -
// onehot)·scale. A label outside [0, classes) gives a NaN loss and no one-hot term, so it
// never reads out of bounds, and is reported (report_failure). x[label] is read before any
// lane stores, as dlogits may alias logits.
template <typename T>
__device__ __forceinline__ void softmax_xent(T *dlogits, float *loss, const T *logits, const int *labels, i64 rows,
                                             i64 classes, float scale, unsigned long long *report) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (THREADS / 32);
    for (i64 r = (i64)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5); r < rows; r += warps) {
        const T *x = logits + r * classes;
        T *d = dlogits + r * classes;
        float mx = -INFINITY;
        for (i64 c = lane; c < classes; c += 32) mx = fmaxf(mx, tof(x[c]));
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.0f;
        for (i64 c = lane; c < classes; c += 32) sum += expf(tof(x[c]) - mx);
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const i64 label = labels[r];
        const bool ok = label >= 0 && label < classes;
        const float xl = ok ? tof(x[label]) : NAN;
        __syncwarp();
        if (lane == 0) {
            loss[r] = logf(sum) - (xl - mx);
            if (!ok) report_failure(report, REPORT_LABEL, r, label, classes);
        }
        const float inv = 1.0f / sum;
        for (i64 c = lane; c < classes; c += 32) {
            float p = expf(tof(x[c]) - mx) * inv;
            if (c == label) p -= 1.0f;
            d[c] = fromf<T>(p * scale);
        }
    }
}

// ---- AdamW ----

// vec.AdamW's arithmetic (internal/vec/adam.go, adamWGeneric), operation for operation, each
// one an explicitly rounded intrinsic so nvcc cannot contract a multiply and an add into an
// FMA: the result is bit-identical to the CPU optimizer's for finite inputs.
template <typename G, typename W>
__device__ __forceinline__ void adamw(float *p, float *m, float *v, const G *g, W *w, i64 n, float b1, float c1,
                                      float b2, float c2, float eps, float scale, float negStep, float bc2Sqrt,
                                      float decay) {
    GRID_STRIDE(i, n) {
        float pi = __fmul_rn(p[i], decay);
        float gi = __fmul_rn(tof(g[i]), scale);
        float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(c1, gi));
        float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(c2, gi), gi));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2Sqrt), eps);
        float pn = __fadd_rn(pi, __fdiv_rn(__fmul_rn(negStep, mi), denom));
        p[i] = pn;
        m[i] = mi;
        v[i] = vi;
        if (w) w[i] = fromf<W>(pn);
    }
}

// ---- UnscaleCheck, SumSquares ----

// g *= s; found[0] = 1 if an element of g was Inf or NaN before scaling (as PyTorch's
// unscale checks). One store per block that saw one; found is never cleared.
template <typename T> __device__ __forceinline__ void unscale_check(T *g, float *found, i64 n, float s) {
    int bad = 0;
    GRID_STRIDE(i, n) {
        float v = tof(g[i]);
        bad |= !isfinite(v);
        g[i] = fromf<T>(v * s);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) found[0] = 1.0f;
}

// acc[0] += Σ g², in float per block, one atomicAdd per block.
template <typename T> __device__ __forceinline__ void sum_squares(float *acc, const T *g, i64 n) {
    float s = 0.0f;
    GRID_STRIDE(i, n) {
        float x = tof(g[i]);
        s += x * x;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) atomicAdd(acc, s);
}

// ---- Transformer layers: GemmBatched is cuBLAS's; the rest are these kernels ----

// The block's values reduced in a fixed tree order (a sum, or a maximum with fmaxf), returned
// to every thread of the block: every thread must call it (it has barriers). The row kernels
// below run blocks of any multiple of 32 threads up to THREADS (the Go side sizes them to the
// row: a block of 32 for attention's short rows), so the loops stride by blockDim.x.
template <bool Max> __device__ __forceinline__ float block_reduce_all(float v) {
    __shared__ float warp[THREADS / 32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_down_sync(0xffffffffu, v, o);
        v = Max ? fmaxf(v, w) : v + w;
    }
    if ((threadIdx.x & 31) == 0) warp[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x >> 5) ? warp[threadIdx.x] : (Max ? -INFINITY : 0.0f);
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_down_sync(0xffffffffu, v, o);
            v = Max ? fmaxf(v, w) : v + w;
        }
        if (threadIdx.x == 0) total = v;
    }
    __syncthreads();
    v = total;
    __syncthreads(); // warp[] and total are reused by the next call
    return v;
}

__device__ __forceinline__ float block_sum_all(float v) { return block_reduce_all<false>(v); }

// The threads that share a row of a row kernel (LayerNorm, Softmax and their backward
// passes): a warp (warp true: each warp of the block takes rows of its own, for rows short
// enough that a larger group would idle at its barriers) or the whole block. Rows first,
// first + step, ... belong to the group; its threads take the row's elements tid, tid + size, ...
struct RowGroup {
    bool warp;
    int tid, size;
    i64 first, step;
};

__device__ __forceinline__ RowGroup row_group(i64 warp) {
    if (warp) {
        const int per = blockDim.x >> 5;
        return {true, (int)(threadIdx.x & 31), 32, (i64)blockIdx.x * per + (threadIdx.x >> 5), (i64)gridDim.x * per};
    }
    return {false, (int)threadIdx.x, (int)blockDim.x, (i64)blockIdx.x, (i64)gridDim.x};
}

// The group's values reduced (a sum, or a maximum) and returned to each of its threads: in a
// warp by a butterfly of shuffles (every lane ends with the same bits, as a + b == b + a), in
// a block by block_reduce_all. Every thread of the group must call it.
template <bool Max> __device__ __forceinline__ float group_reduce(const RowGroup &g, float v) {
    if (!g.warp) return block_reduce_all<Max>(v);
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = Max ? fmaxf(v, w) : v + w;
    }
    return v;
}

// y = a·x + b·y (x may be y); y is not read when b is 0 (BLAS's convention). Each operation
// is rounded on its own (no fused multiply-add), as the reference device computes it.
template <typename T> __device__ __forceinline__ void axpby(T *y, const T *x, i64 n, float a, float b) {
    GRID_STRIDE(i, n) {
        float v = __fmul_rn(a, tof(x[i]));
        if (b != 0.0f) v = __fadd_rn(v, __fmul_rn(b, tof(y[i])));
        y[i] = fromf<T>(v);
    }
}

// dst[r·ldDst + c] = src[r·ldSrc + c], converted; ldSrc 0 repeats src's first row.
template <typename D, typename S>
__device__ __forceinline__ void copy_rows(D *dst, i64 ldDst, const S *src, i64 ldSrc, i64 rows, i64 cols) {
    GRID_STRIDE(e, rows * cols) {
        i64 r = e / cols, c = e - r * cols;
        dst[r * ldDst + c] = fromf<D>(tof(src[r * ldSrc + c]));
    }
}

// 1/sqrt(var + eps), correctly rounded at each step (not rsqrtf's approximation).
__device__ __forceinline__ float inv_std(float var, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
}

// (v − μ)·rstd·γ + β, each operation rounded on its own.
__device__ __forceinline__ float normalize(float v, float mu, float rs, float g, float b) {
    return __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(v, mu), rs), g), b);
}

// LayerNorm: a row per group (RowGroup: a warp or a block). μ = Σx / cols, σ² = Σ(x − μ)² / cols (two passes over the
// row, so no cancellation), rstd = 1/sqrt(σ² + eps). The sums' reads come before their
// reductions, which every thread of the group must reach, and the last pass reads each
// element just before the same thread stores it, so y may alias x.
template <typename T>
__device__ __forceinline__ void layer_norm(T *y, float *mean, float *rstd, const T *x, const T *gamma, const T *beta,
                                           i64 rows, i64 cols, float eps, i64 warp) {
    const RowGroup g = row_group(warp);
    for (i64 r = g.first; r < rows; r += g.step) {
        const T *xr = x + r * cols;
        float s = 0.0f;
        for (i64 c = g.tid; c < cols; c += g.size) s += tof(xr[c]);
        const float mu = group_reduce<false>(g, s) / (float)cols;
        float q = 0.0f;
        for (i64 c = g.tid; c < cols; c += g.size) {
            float d = tof(xr[c]) - mu;
            q += d * d;
        }
        const float rs = inv_std(group_reduce<false>(g, q) / (float)cols, eps);
        if (g.tid == 0) {
            mean[r] = mu;
            rstd[r] = rs;
        }
        T *yr = y + r * cols;
        for (i64 c = g.tid; c < cols; c += g.size)
            yr[c] = fromf<T>(normalize(tof(xr[c]), mu, rs, tof(gamma[c]), tof(beta[c])));
    }
}

// LayerNormBackward's input gradient, a row per group: with g = dy·γ and x̂ = (x − μ)·rstd,
// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)). dy is read in full before the two sums'
// reductions and then element by element just before dx's element is stored, so dx may alias
// dy.
template <typename T>
__device__ __forceinline__ void layer_norm_grad(T *dx, const T *dy, const T *x, const float *mean, const float *rstd,
                                                const T *gamma, i64 rows, i64 cols, i64 warp) {
    const RowGroup grp = row_group(warp);
    for (i64 r = grp.first; r < rows; r += grp.step) {
        const T *xr = x + r * cols, *dyr = dy + r * cols;
        const float mu = mean[r], rs = rstd[r];
        float sg = 0.0f, sgx = 0.0f;
        for (i64 c = grp.tid; c < cols; c += grp.size) {
            float g = tof(dyr[c]) * tof(gamma[c]);
            sg += g;
            sgx += g * ((tof(xr[c]) - mu) * rs);
        }
        const float mg = group_reduce<false>(grp, sg) / (float)cols;
        const float mgx = group_reduce<false>(grp, sgx) / (float)cols;
        T *dxr = dx + r * cols;
        for (i64 c = grp.tid; c < cols; c += grp.size) {
            float g = tof(dyr[c]) * tof(gamma[c]);
            float xh = (tof(xr[c]) - mu) * rs;
            dxr[c] = fromf<T>(rs * (g - mg - xh * mgx));
        }
    }
}

// LayerNormBackward's parameter gradients, sums over the rows as sum_rows does: a TILE×TILE
// block owns TILE columns, thread (x, y) sums rows y, y+TILE, ... of column x, then row 0 of
// the block adds the TILE partial sums in order. dgamma = b·dgamma + Σ dy·x̂, dbeta = b·dbeta
// + Σ dy; a null one is skipped, and neither is read when b is 0.
template <typename T>
__device__ __forceinline__ void layer_norm_params(T *dgamma, T *dbeta, const T *dy, const T *x, const float *mean,
                                                  const float *rstd, i64 rows, i64 cols, float b) {
    __shared__ float pg[TILE][TILE + 1];
    __shared__ float pb[TILE][TILE + 1];
    for (i64 c0 = (i64)blockIdx.x * TILE; c0 < cols; c0 += (i64)gridDim.x * TILE) {
        i64 c = c0 + threadIdx.x;
        float sg = 0.0f, sb = 0.0f;
        if (c < cols) {
            for (i64 r = threadIdx.y; r < rows; r += TILE) {
                float g = tof(dy[r * cols + c]);
                sb += g;
                sg += g * ((tof(x[r * cols + c]) - mean[r]) * rstd[r]);
            }
        }
        pg[threadIdx.y][threadIdx.x] = sg;
        pb[threadIdx.y][threadIdx.x] = sb;
        __syncthreads();
        if (threadIdx.y == 0 && c < cols) {
            float tg = 0.0f, tb = 0.0f;
            for (int k = 0; k < TILE; k++) {
                tg += pg[k][threadIdx.x];
                tb += pb[k][threadIdx.x];
            }
            if (dgamma) {
                if (b != 0.0f) tg = b * tof(dgamma[c]) + tg;
                dgamma[c] = fromf<T>(tg);
            }
            if (dbeta) {
                if (b != 0.0f) tb = b * tof(dbeta[c]) + tb;
                dbeta[c] = fromf<T>(tb);
            }
        }
        __syncthreads();
    }
}

// GELU, the exact form: y = x·Φ(x), Φ the standard normal CDF. Φ(x) = (1 + erf(x/√2))/2 =
// erfc(−x/√2)/2, computed as the latter: the same function, without the cancellation of
// 1 + erf in the left tail (at x = −3 it keeps ~15 of fp32's 24 bits, at x = −5 ~3).
#define QVD_SQRT1_2 0.70710678118654752440f
#define QVD_INV_SQRT_2PI 0.39894228040143267794f

__device__ __forceinline__ float normal_cdf(float v) { return 0.5f * erfcf(-v * QVD_SQRT1_2); }

template <typename T> __device__ __forceinline__ void gelu(T *y, const T *x, i64 n) {
    GRID_STRIDE(i, n) {
        float v = tof(x[i]);
        y[i] = fromf<T>(v * normal_cdf(v));
    }
}

// dx = dy·(Φ(x) + x·φ(x)), φ(x) = exp(−x²/2)/√(2π); dx may alias dy.
template <typename T> __device__ __forceinline__ void gelu_grad(T *dx, const T *dy, const T *x, i64 n) {
    GRID_STRIDE(i, n) {
        float v = tof(x[i]);
        float cdf = normal_cdf(v);
        float pdf = expf(-0.5f * v * v) * QVD_INV_SQRT_2PI;
        dx[i] = fromf<T>(tof(dy[i]) * (cdf + v * pdf));
    }
}

// engine.DropoutKeep in 64-bit integer arithmetic: SplitMix64 of (seed, i), its top 24 bits
// as a fraction in [0, 1) (exact in float), kept when not below p.
__device__ __forceinline__ bool dropout_keep(unsigned long long seed, unsigned long long i, float p) {
    unsigned long long z = seed + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) >= p;
}

// y = x/(1−p) where kept, +0 elsewhere (whatever x holds); y may alias x.
template <typename T> __device__ __forceinline__ void dropout(T *y, const T *x, i64 n, float p, unsigned long long seed) {
    const float keep = __fsub_rn(1.0f, p);
    GRID_STRIDE(i, n) {
        y[i] = fromf<T>(dropout_keep(seed, (unsigned long long)i, p) ? __fdiv_rn(tof(x[i]), keep) : 0.0f);
    }
}

// Softmax of scale·x over each row, a row per group: the maximum, then Σ exp(v − max), then
// y; every read of the row but the last pass's (one element, just before it is stored)
// comes before a reduction the whole group must reach, so y may alias x.
template <typename T>
__device__ __forceinline__ void softmax(T *y, const T *x, i64 rows, i64 cols, float scale, i64 warp) {
    const RowGroup g = row_group(warp);
    for (i64 r = g.first; r < rows; r += g.step) {
        const T *xr = x + r * cols;
        float mx = -INFINITY;
        for (i64 c = g.tid; c < cols; c += g.size) mx = fmaxf(mx, scale * tof(xr[c]));
        mx = group_reduce<true>(g, mx);
        float s = 0.0f;
        for (i64 c = g.tid; c < cols; c += g.size) s += expf(scale * tof(xr[c]) - mx);
        s = group_reduce<false>(g, s);
        T *yr = y + r * cols;
        for (i64 c = g.tid; c < cols; c += g.size) yr[c] = fromf<T>(expf(scale * tof(xr[c]) - mx) / s);
    }
}

// dx = scale·y⊙(dy − Σ dy⊙y) per row, a row per group; dx may alias dy.
template <typename T>
__device__ __forceinline__ void softmax_grad(T *dx, const T *dy, const T *y, i64 rows, i64 cols, float scale,
                                             i64 warp) {
    const RowGroup g = row_group(warp);
    for (i64 r = g.first; r < rows; r += g.step) {
        const T *dyr = dy + r * cols, *yr = y + r * cols;
        float s = 0.0f;
        for (i64 c = g.tid; c < cols; c += g.size) s += tof(dyr[c]) * tof(yr[c]);
        s = group_reduce<false>(g, s);
        T *dxr = dx + r * cols;
        for (i64 c = g.tid; c < cols; c += g.size) dxr[c] = fromf<T>(scale * tof(yr[c]) * (tof(dyr[c]) - s));
    }
}

// Patchify (a bit-exact move): cols is (n·(h/p)·(w/p)) × (c·p·p); row (s·ph + py)·pw + px,
// column (ci·p + ky)·p + kx holds x[s, ci, py·p + ky, px·p + kx].
template <typename T>
__device__ __forceinline__ void patchify(T *cols, const T *x, i64 n, i64 c, i64 h, i64 w, i64 p) {
    const i64 ph = h / p, pw = w / p, width = c * p * p;
    GRID_STRIDE(e, n * c * h * w) {
        i64 row = e / width, col = e - row * width;
        i64 kx = col % p, ky = (col / p) % p, ci = col / (p * p);
        i64 px = row % pw, py = (row / pw) % ph, s = row / (pw * ph);
        cols[e] = x[((s * c + ci) * h + py * p + ky) * w + px * p + kx];
    }
}

// Unpatchify: Patchify's inverse, a gather per element of dx.
template <typename T>
__device__ __forceinline__ void unpatchify(T *dx, const T *cols, i64 n, i64 c, i64 h, i64 w, i64 p) {
    const i64 ph = h / p, pw = w / p, width = c * p * p;
    GRID_STRIDE(e, n * c * h * w) {
        i64 xx = e % w, yy = (e / w) % h, ci = (e / (w * h)) % c, s = e / (w * h * c);
        i64 row = (s * ph + yy / p) * pw + xx / p;
        i64 col = (ci * p + yy % p) * p + xx % p;
        dx[e] = cols[row * width + col];
    }
}

// BatchNorm's training statistics, one block per channel of x (n × c × hw): μ and σ² over
// the n·hw elements (two passes), stored as mean and rstd = 1/sqrt(σ² + eps).
template <typename T>
__device__ __forceinline__ void batch_norm_stats(float *mean, float *rstd, const T *x, i64 n, i64 c, i64 hw, float eps) {
    const i64 m = n * hw;
    for (i64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        float s = 0.0f;
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 smp = e / hw;
            s += tof(x[(smp * c + ch) * hw + (e - smp * hw)]);
        }
        const float mu = block_sum_all(s) / (float)m;
        float q = 0.0f;
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 smp = e / hw;
            float d = tof(x[(smp * c + ch) * hw + (e - smp * hw)]) - mu;
            q += d * d;
        }
        const float rs = inv_std(block_sum_all(q) / (float)m, eps);
        if (threadIdx.x == 0) {
            mean[ch] = mu;
            rstd[ch] = rs;
        }
    }
}

// y = (x − μ)·rstd·γ + β per channel, elementwise (training after batch_norm_stats, and
// evaluation with the running statistics); y may alias x.
template <typename T>
__device__ __forceinline__ void batch_norm_apply(T *y, const T *x, const float *mean, const float *rstd, const T *gamma,
                                                 const T *beta, i64 n, i64 c, i64 hw) {
    GRID_STRIDE(e, n * c * hw) {
        i64 ch = (e / hw) % c;
        y[e] = fromf<T>(normalize(tof(x[e]), mean[ch], rstd[ch], tof(gamma[ch]), tof(beta[ch])));
    }
}

// BatchNormBackward, one block per channel: Σ dy and Σ dy·x̂ over the channel's n·hw
// elements, dbeta = b·dbeta + Σ dy and dgamma = b·dgamma + Σ dy·x̂ (null: skipped; not read
// when b is 0), and, if dx is not null, dx = γ·rstd·(dy − mean(dy) − x̂·mean(dy·x̂)). dy is
// read in full before the sums' barriers, so dx may alias dy.
template <typename T>
__device__ __forceinline__ void batch_norm_grad(T *dx, T *dgamma, T *dbeta, const T *dy, const T *x, const float *mean,
                                                const float *rstd, const T *gamma, i64 n, i64 c, i64 hw, float b) {
    const i64 m = n * hw;
    for (i64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        const float mu = mean[ch], rs = rstd[ch];
        float sd = 0.0f, sdx = 0.0f;
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 smp = e / hw, k = (smp * c + ch) * hw + (e - smp * hw);
            float g = tof(dy[k]);
            sd += g;
            sdx += g * ((tof(x[k]) - mu) * rs);
        }
        sd = block_sum_all(sd);
        sdx = block_sum_all(sdx);
        if (threadIdx.x == 0) {
            if (dgamma) dgamma[ch] = fromf<T>(b != 0.0f ? b * tof(dgamma[ch]) + sdx : sdx);
            if (dbeta) dbeta[ch] = fromf<T>(b != 0.0f ? b * tof(dbeta[ch]) + sd : sd);
        }
        if (!dx) continue;
        const float md = sd / (float)m, mdx = sdx / (float)m, gr = tof(gamma[ch]) * rs;
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 smp = e / hw, k = (smp * c + ch) * hw + (e - smp * hw);
            float xh = (tof(x[k]) - mu) * rs;
            dx[k] = fromf<T>(gr * (tof(dy[k]) - md - xh * mdx));
        }
    }
}

// ---- Entry points ----

#define KERNEL extern "C" __global__ void __launch_bounds__(THREADS)

// Every entry point takes the failure report (report_failure) as its last parameter and does
// nothing once a failure is reported, so that, as the Device contract asks, the kernels queued
// after a failure that only the device could find are skipped until engine/cuda has read and
// cleared the report (at Sync or Download). Within a kernel that reports, the word may change
// while it runs: those kernels (maxpool2_scatter, softmax_xent) have no block-wide barrier,
// and softmax_xent reports only after its warp's shuffles, so no barrier waits on a thread
// that returned.
#define SKIP_AFTER_FAILURE(report) \
    if (*(volatile const unsigned long long *)(report) != 0ull) return

#define ONE_TYPE(s, T)                                                                                                               \
    KERNEL fill_##s(T *y, i64 n, float v, unsigned long long *report) {                                                              \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        fill<T>(y, n, v);                                                                                                            \
    }                                                                                                                                \
    KERNEL add_bias_##s(T *y, const T *bias, i64 rows, i64 cols, i64 perRow, unsigned long long *report) {                           \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        add_bias<T>(y, bias, rows, cols, perRow);                                                                                    \
    }                                                                                                                                \
    KERNEL relu_##s(T *y, const T *x, i64 n, unsigned long long *report) {                                                           \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        relu<T>(y, x, n);                                                                                                            \
    }                                                                                                                                \
    KERNEL relu_grad_##s(T *dx, const T *dy, const T *y, i64 n, unsigned long long *report) {                                        \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        relu_grad<T>(dx, dy, y, n);                                                                                                  \
    }                                                                                                                                \
    KERNEL transpose01_##s(T *dst, const T *src, i64 a, i64 b, i64 r, unsigned long long *report) {                                  \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        transpose01<T>(dst, src, a, b, r);                                                                                           \
    }                                                                                                                                \
    KERNEL im2col_##s(T *cols, const T *x, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad, unsigned long long *report) {                 \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        im2col<T>(cols, x, n, c, h, w, k, pad);                                                                                      \
    }                                                                                                                                \
    KERNEL col2im_##s(T *dx, const T *cols, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad, unsigned long long *report) {                \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        col2im<T, T>(dx, cols, n, c, h, w, k, pad);                                                                                  \
    }                                                                                                                                \
    KERNEL col2im_##s##_f32(T *dx, const float *cols, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad, unsigned long long *report) {      \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        col2im<T, float>(dx, cols, n, c, h, w, k, pad);                                                                              \
    }                                                                                                                                \
    KERNEL conv_out_##s##_f32(T *y, const float *ycm, const T *bias, i64 n, i64 out, i64 ohw, unsigned long long *report) {          \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        conv_out<T>(y, ycm, bias, n, out, ohw);                                                                                      \
    }                                                                                                                                \
    KERNEL maxpool2_##s(T *y, int *idx, const T *x, i64 planes, i64 h, i64 w, unsigned long long *report) {                          \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        maxpool2<T>(y, idx, x, planes, h, w);                                                                                        \
    }                                                                                                                                \
    KERNEL maxpool2_scatter_##s(T *dx, const T *dy, const int *idx, i64 n, i64 ndx,                                                  \
                                unsigned long long *report) {                                                                        \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        maxpool2_scatter<T>(dx, dy, idx, n, ndx, report);                                                                            \
    }                                                                                                                                \
    KERNEL softmax_xent_##s(T *dlogits, float *loss, const T *logits, const int *labels, i64 rows,                                   \
                            i64 classes, float scale, unsigned long long *report) {                                                  \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        softmax_xent<T>(dlogits, loss, logits, labels, rows, classes, scale, report);                                                \
    }                                                                                                                                \
    KERNEL unscale_check_##s(T *g, float *found, i64 n, float sc, unsigned long long *report) {                                      \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        unscale_check<T>(g, found, n, sc);                                                                                           \
    }                                                                                                                                \
    KERNEL sum_squares_##s(float *acc, const T *g, i64 n, unsigned long long *report) {                                              \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        sum_squares<T>(acc, g, n);                                                                                                   \
    }

#define TWO_TYPES(s1, T1, s2, T2)                                                                                                    \
    KERNEL convert_##s1##_##s2(T1 *dst, const T2 *src, i64 n, unsigned long long *report) {                                          \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        convert<T1, T2>(dst, src, n);                                                                                                \
    }                                                                                                                                \
    KERNEL sum_cols_##s1##_##s2(T1 *dst, const T2 *src, i64 rows, i64 cols, float beta, unsigned long long *report) {                \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        sum_cols<T1, T2>(dst, src, rows, cols, beta);                                                                                \
    }                                                                                                                                \
    extern "C" __global__ void __launch_bounds__(TILE * TILE)                                                                        \
        sum_rows_##s1##_##s2(T1 *dst, const T2 *src, i64 rows, i64 cols, float beta, unsigned long long *report) {                   \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        sum_rows<T1, T2>(dst, src, rows, cols, beta);                                                                                \
    }                                                                                                                                \
    KERNEL adamw_##s1##_##s2(float *p, float *m, float *v, const T1 *g, T2 *w, i64 n, float b1, float c1,                            \
                             float b2, float c2, float eps, float scale, float negStep, float bc2Sqrt,                               \
                             float decay, unsigned long long *report) {                                                              \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        adamw<T1, T2>(p, m, v, g, w, n, b1, c1, b2, c2, eps, scale, negStep, bc2Sqrt, decay);                                        \
    }

EACH_TYPE(ONE_TYPE)
EACH_PAIR(TWO_TYPES)

// The transformer layers' operations (GemmBatched is cuBLAS's).
#define ONE_TYPE_NN(s, T)                                                                                                            \
    KERNEL axpby_##s(T *y, const T *x, i64 n, float a, float b, unsigned long long *report) {                                        \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        axpby<T>(y, x, n, a, b);                                                                                                     \
    }                                                                                                                                \
    KERNEL layer_norm_##s(T *y, float *mean, float *rstd, const T *x, const T *gamma, const T *beta, i64 rows,                       \
                          i64 cols, float eps, i64 warp, unsigned long long *report) {                                               \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        layer_norm<T>(y, mean, rstd, x, gamma, beta, rows, cols, eps, warp);                                                         \
    }                                                                                                                                \
    KERNEL layer_norm_grad_##s(T *dx, const T *dy, const T *x, const float *mean, const float *rstd,                                 \
                               const T *gamma, i64 rows, i64 cols, i64 warp, unsigned long long *report) {                           \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        layer_norm_grad<T>(dx, dy, x, mean, rstd, gamma, rows, cols, warp);                                                          \
    }                                                                                                                                \
    extern "C" __global__ void __launch_bounds__(TILE * TILE)                                                                        \
        layer_norm_params_##s(T *dgamma, T *dbeta, const T *dy, const T *x, const float *mean,                                       \
                              const float *rstd, i64 rows, i64 cols, float b, unsigned long long *report) {                          \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        layer_norm_params<T>(dgamma, dbeta, dy, x, mean, rstd, rows, cols, b);                                                       \
    }                                                                                                                                \
    KERNEL gelu_##s(T *y, const T *x, i64 n, unsigned long long *report) {                                                           \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        gelu<T>(y, x, n);                                                                                                            \
    }                                                                                                                                \
    KERNEL gelu_grad_##s(T *dx, const T *dy, const T *x, i64 n, unsigned long long *report) {                                        \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        gelu_grad<T>(dx, dy, x, n);                                                                                                  \
    }                                                                                                                                \
    KERNEL dropout_##s(T *y, const T *x, i64 n, float p, unsigned long long seed, unsigned long long *report) {                      \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        dropout<T>(y, x, n, p, seed);                                                                                                \
    }                                                                                                                                \
    KERNEL softmax_##s(T *y, const T *x, i64 rows, i64 cols, float scale, i64 warp, unsigned long long *report) {                    \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        softmax<T>(y, x, rows, cols, scale, warp);                                                                                   \
    }                                                                                                                                \
    KERNEL softmax_grad_##s(T *dx, const T *dy, const T *y, i64 rows, i64 cols, float scale, i64 warp, unsigned long long *report) { \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        softmax_grad<T>(dx, dy, y, rows, cols, scale, warp);                                                                         \
    }                                                                                                                                \
    KERNEL patchify_##s(T *cols, const T *x, i64 n, i64 c, i64 h, i64 w, i64 p, unsigned long long *report) {                        \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        patchify<T>(cols, x, n, c, h, w, p);                                                                                         \
    }                                                                                                                                \
    KERNEL unpatchify_##s(T *dx, const T *cols, i64 n, i64 c, i64 h, i64 w, i64 p, unsigned long long *report) {                     \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        unpatchify<T>(dx, cols, n, c, h, w, p);                                                                                      \
    }                                                                                                                                \
    KERNEL batch_norm_stats_##s(float *mean, float *rstd, const T *x, i64 n, i64 c, i64 hw, float eps, unsigned long long *report) { \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        batch_norm_stats<T>(mean, rstd, x, n, c, hw, eps);                                                                           \
    }                                                                                                                                \
    KERNEL batch_norm_apply_##s(T *y, const T *x, const float *mean, const float *rstd, const T *gamma,                              \
                                const T *beta, i64 n, i64 c, i64 hw, unsigned long long *report) {                                   \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        batch_norm_apply<T>(y, x, mean, rstd, gamma, beta, n, c, hw);                                                                \
    }                                                                                                                                \
    KERNEL batch_norm_grad_##s(T *dx, T *dgamma, T *dbeta, const T *dy, const T *x, const float *mean,                               \
                               const float *rstd, const T *gamma, i64 n, i64 c, i64 hw, float b, unsigned long long *report) {       \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        batch_norm_grad<T>(dx, dgamma, dbeta, dy, x, mean, rstd, gamma, n, c, hw, b);                                                \
    }

#define TWO_TYPES_NN(s1, T1, s2, T2)                                                                                                 \
    KERNEL copy_rows_##s1##_##s2(T1 *dst, i64 ldDst, const T2 *src, i64 ldSrc, i64 rows, i64 cols, unsigned long long *report) {     \
        SKIP_AFTER_FAILURE(report);                                                                                                  \
        copy_rows<T1, T2>(dst, ldDst, src, ldSrc, rows, cols);                                                                       \
    }

EACH_TYPE(ONE_TYPE_NN)
EACH_PAIR(TWO_TYPES_NN)
