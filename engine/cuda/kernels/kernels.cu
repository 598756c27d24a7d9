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
// read it, so no two threads write one element and no atomics are needed.
template <typename T>
__device__ __forceinline__ void col2im(T *dx, const T *cols, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad) {
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
// outside dx are skipped rather than written: MaxPool2's never are.
template <typename T> __device__ __forceinline__ void maxpool2_scatter(T *dx, const T *dy, const int *idx, i64 n, i64 ndx) {
    GRID_STRIDE(i, n) {
        i64 j = idx[i];
        if (j >= 0 && j < ndx) dx[j] = dy[i];
    }
}

// ---- SoftmaxXent ----

// One warp per row. loss[r] = log Σ exp(x - max) - (x[label] - max); dlogits = (softmax -
// onehot)·scale. A label outside [0, classes) gives a NaN loss and no one-hot term, so it
// shows instead of reading out of bounds. x[label] is read before any lane stores, as dlogits
// may alias logits.
template <typename T>
__device__ __forceinline__ void softmax_xent(T *dlogits, float *loss, const T *logits, const int *labels, i64 rows,
                                             i64 classes, float scale) {
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
        if (lane == 0) loss[r] = logf(sum) - (xl - mx);
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

// ---- Entry points ----

#define KERNEL extern "C" __global__ void __launch_bounds__(THREADS)

#define ONE_TYPE(s, T)                                                                                      \
    KERNEL fill_##s(T *y, i64 n, float v) { fill<T>(y, n, v); }                                             \
    KERNEL add_bias_##s(T *y, const T *bias, i64 rows, i64 cols, i64 perRow) {                              \
        add_bias<T>(y, bias, rows, cols, perRow);                                                           \
    }                                                                                                       \
    KERNEL relu_##s(T *y, const T *x, i64 n) { relu<T>(y, x, n); }                                          \
    KERNEL relu_grad_##s(T *dx, const T *dy, const T *y, i64 n) { relu_grad<T>(dx, dy, y, n); }             \
    KERNEL transpose01_##s(T *dst, const T *src, i64 a, i64 b, i64 r) { transpose01<T>(dst, src, a, b, r); } \
    KERNEL im2col_##s(T *cols, const T *x, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad) {                    \
        im2col<T>(cols, x, n, c, h, w, k, pad);                                                             \
    }                                                                                                       \
    KERNEL col2im_##s(T *dx, const T *cols, i64 n, i64 c, i64 h, i64 w, i64 k, i64 pad) {                   \
        col2im<T>(dx, cols, n, c, h, w, k, pad);                                                            \
    }                                                                                                       \
    KERNEL maxpool2_##s(T *y, int *idx, const T *x, i64 planes, i64 h, i64 w) {                             \
        maxpool2<T>(y, idx, x, planes, h, w);                                                               \
    }                                                                                                       \
    KERNEL maxpool2_scatter_##s(T *dx, const T *dy, const int *idx, i64 n, i64 ndx) {                       \
        maxpool2_scatter<T>(dx, dy, idx, n, ndx);                                                           \
    }                                                                                                       \
    KERNEL softmax_xent_##s(T *dlogits, float *loss, const T *logits, const int *labels, i64 rows,          \
                            i64 classes, float scale) {                                                     \
        softmax_xent<T>(dlogits, loss, logits, labels, rows, classes, scale);                               \
    }                                                                                                       \
    KERNEL unscale_check_##s(T *g, float *found, i64 n, float sc) { unscale_check<T>(g, found, n, sc); }    \
    KERNEL sum_squares_##s(float *acc, const T *g, i64 n) { sum_squares<T>(acc, g, n); }

#define TWO_TYPES(s1, T1, s2, T2)                                                                         \
    KERNEL convert_##s1##_##s2(T1 *dst, const T2 *src, i64 n) { convert<T1, T2>(dst, src, n); }           \
    KERNEL sum_cols_##s1##_##s2(T1 *dst, const T2 *src, i64 rows, i64 cols, float beta) {                 \
        sum_cols<T1, T2>(dst, src, rows, cols, beta);                                                     \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(TILE * TILE)                                             \
        sum_rows_##s1##_##s2(T1 *dst, const T2 *src, i64 rows, i64 cols, float beta) {                    \
        sum_rows<T1, T2>(dst, src, rows, cols, beta);                                                     \
    }                                                                                                     \
    KERNEL adamw_##s1##_##s2(float *p, float *m, float *v, const T1 *g, T2 *w, i64 n, float b1, float c1, \
                             float b2, float c2, float eps, float scale, float negStep, float bc2Sqrt,    \
                             float decay) {                                                               \
        adamw<T1, T2>(p, m, v, g, w, n, b1, c1, b2, c2, eps, scale, negStep, bc2Sqrt, decay);             \
    }

EACH_TYPE(ONE_TYPE)
EACH_PAIR(TWO_TYPES)
