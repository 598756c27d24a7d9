// The emulated cuBLAS (libcublas.so.13, chosen with QVD_CUBLAS_LIBRARY): the handle calls and
// cublasGemmEx/cublasSgemm/cublasGemmStridedBatchedEx that engine/cuda/blas.go binds, on
// OpenBLAS's sgemm (a strided batch is one queued operation running its GEMMs in order).
//
// Arguments are checked as cuBLAS checks them (status INVALID_VALUE for a bad transpose,
// a negative size or a leading dimension below the matrix's rows; NOT_SUPPORTED for a type
// combination or compute type cuBLAS has no kernel for), and then as a GPU would find out:
// every matrix must lie inside a live allocation of the emulated driver for the leading
// dimensions given, else the context gets the sticky CUDA_ERROR_ILLEGAL_ADDRESS a kernel
// reading past its buffer would cause. The product runs in order on the handle's stream:
// half and bfloat16 operands are widened to float exactly, multiplied in float (fp32
// accumulation, CUBLAS_COMPUTE_32F) and C is rounded once to its type, to nearest even.
#include <cuda.h>

#include "../libcuda/hooks.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <vector>

extern "C" {
void cblas_sgemm(int order, int transA, int transB, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc);
}

namespace {

// cublasStatus_t, cublasOperation_t, cudaDataType, cublasComputeType_t (cublas_api.h,
// library_types.h).
enum {
    kSuccess = 0,
    kNotInitialized = 1,
    kAllocFailed = 3,
    kInvalidValue = 7,
    kExecutionFailed = 13,
    kNotSupported = 15,
};
enum { kOpN = 0, kOpT = 1, kOpC = 2 };
enum { kR32F = 0, kR16F = 2, kR16BF = 14 };
enum { kCompute16F = 64, kCompute32F = 68, kCompute32FFast16F = 74, kCompute32FFast16BF = 75, kCompute32FFastTF32 = 77 };
constexpr int kCblasColMajor = 102, kCblasNoTrans = 111, kCblasTrans = 112;

struct Handle {
    CUcontext ctx;
    CUstream stream = nullptr;
    int mathMode = 0;
};

size_t typeSize(int t) { return t == kR32F ? 4 : 2; }

float load(int t, const void *p, size_t i) {
    switch (t) {
    case kR16F: return __half2float(static_cast<const __half *>(p)[i]);
    case kR16BF: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    }
    return static_cast<const float *>(p)[i];
}

void store(int t, void *p, size_t i, float v) {
    switch (t) {
    case kR16F: static_cast<__half *>(p)[i] = __float2half_rn(v); return;
    case kR16BF: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); return;
    }
    static_cast<float *>(p)[i] = v;
}

// span is the number of elements a column-major rows×cols matrix with leading dimension ld
// covers.
size_t span(int rows, int cols, int ld) { return rows == 0 || cols == 0 ? 0 : (size_t)(cols - 1) * ld + rows; }

struct Gemm {
    int opA, opB, m, n, k;
    float alpha, beta;
    const void *a, *b;
    void *c;
    int ta, tb, tc, lda, ldb, ldc;
    // A strided batch (cublasGemmStridedBatchedEx): GEMM i reads and writes the matrices
    // i·stride elements further on. One GEMM: batch 1.
    long long strideA = 0, strideB = 0, strideC = 0;
    int batch = 1;
};

// widen copies the span of a matrix into float (the padding between columns included).
std::vector<float> widen(int t, const void *p, size_t n) {
    std::vector<float> out(n);
    for (size_t i = 0; i < n; i++) out[i] = load(t, p, i);
    return out;
}

// QVD_CUDAEMU_GEMM=sequential sums every dot product in k order in fp32, skipping the terms
// whose op(B) factor is 0, then applies alpha and beta: engine.Reference's GemmLD order for
// the row-major product engine/cuda asks for (its B is the row-major A), so fp32 results are
// bit-identical to the reference device's. A debugging aid that separates summation-order
// effects (a ReLU input within rounding of 0 flipping sign) from bugs; the default is
// OpenBLAS's blocked order, as foreign to the reference's as cuBLAS's is.
bool sequential() {
    static const bool on = [] {
        const char *v = getenv("QVD_CUDAEMU_GEMM");
        return v && strcmp(v, "sequential") == 0;
    }();
    return on;
}

void runSequential(const Gemm &g) {
    auto a = [&](int i, int p) { return g.opA == kOpN ? load(g.ta, g.a, (size_t)p * g.lda + i) : load(g.ta, g.a, (size_t)i * g.lda + p); };
    auto b = [&](int p, int j) { return g.opB == kOpN ? load(g.tb, g.b, (size_t)j * g.ldb + p) : load(g.tb, g.b, (size_t)p * g.ldb + j); };
    for (int j = 0; j < g.n; j++) {
        for (int i = 0; i < g.m; i++) {
            float s = 0.0f;
            for (int p = 0; p < g.k; p++) {
                float bv = b(p, j);
                if (bv == 0.0f) continue;
                s += a(i, p) * bv;
            }
            float v = g.alpha * s;
            if (g.beta != 0.0f) v += g.beta * load(g.tc, g.c, (size_t)j * g.ldc + i);
            store(g.tc, g.c, (size_t)j * g.ldc + i, v);
        }
    }
}

void runOne(const Gemm &g) {
    int ra = g.opA == kOpN ? g.m : g.k, ca = g.opA == kOpN ? g.k : g.m;
    int rb = g.opB == kOpN ? g.k : g.n, cb = g.opB == kOpN ? g.n : g.k;
    int tA = g.opA == kOpN ? kCblasNoTrans : kCblasTrans, tB = g.opB == kOpN ? kCblasNoTrans : kCblasTrans;
    if (sequential()) {
        runSequential(g);
        return;
    }
    if (g.ta == kR32F && g.tc == kR32F) {
        cblas_sgemm(kCblasColMajor, tA, tB, g.m, g.n, g.k, g.alpha, static_cast<const float *>(g.a), g.lda,
                    static_cast<const float *>(g.b), g.ldb, g.beta, static_cast<float *>(g.c), g.ldc);
        return;
    }
    std::vector<float> a = widen(g.ta, g.a, span(ra, ca, g.lda));
    std::vector<float> b = widen(g.tb, g.b, span(rb, cb, g.ldb));
    std::vector<float> c((size_t)g.m * g.n, 0.0f);
    if (g.beta != 0.0f) { // as in BLAS, C is not read when beta is 0
        for (int j = 0; j < g.n; j++)
            for (int i = 0; i < g.m; i++) c[(size_t)j * g.m + i] = load(g.tc, g.c, (size_t)j * g.ldc + i);
    }
    const float *pa = a.empty() ? nullptr : a.data(), *pb = b.empty() ? nullptr : b.data();
    float dummy = 0;
    cblas_sgemm(kCblasColMajor, tA, tB, g.m, g.n, g.k, g.alpha, pa ? pa : &dummy, g.lda, pb ? pb : &dummy, g.ldb, g.beta,
                c.data(), g.m);
    for (int j = 0; j < g.n; j++)
        for (int i = 0; i < g.m; i++) store(g.tc, g.c, (size_t)j * g.ldc + i, c[(size_t)j * g.m + i]);
}

// run is the queued operation: the batch's GEMMs in order.
int run(void *arg, char *, size_t) {
    const Gemm &g = *static_cast<Gemm *>(arg);
    for (int i = 0; i < g.batch; i++) {
        Gemm one = g;
        one.a = static_cast<const char *>(g.a) + (size_t)(i * g.strideA) * typeSize(g.ta);
        one.b = static_cast<const char *>(g.b) + (size_t)(i * g.strideB) * typeSize(g.tb);
        one.c = static_cast<char *>(g.c) + (size_t)(i * g.strideC) * typeSize(g.tc);
        runOne(one);
    }
    return 0;
}

// inside checks that a matrix, or a strided batch of them (the batch's last matrix starts
// (batch−1)·stride elements on), lies inside one live allocation, as a GPU's reads would find.
bool inside(const char *call, const char *what, const void *p, int t, int rows, int cols, int ld, char *msg, size_t cap,
            int batch = 1, long long stride = 0) {
    size_t n = span(rows, cols, ld);
    if (n == 0 || batch == 0) return true;
    n = (n + (size_t)(batch - 1) * stride) * typeSize(t);
    char why[512];
    if (cudaemu_check_range(reinterpret_cast<uintptr_t>(p), n, why, sizeof why)) return true;
    if (batch == 1) {
        snprintf(msg, cap, "%s: %s (%d×%d, leading dimension %d, %zu bytes at %p): %s", call, what, rows, cols, ld, n, p, why);
    } else {
        snprintf(msg, cap, "%s: %s (%d matrices %d×%d, leading dimension %d, stride %lld, %zu bytes at %p): %s", call, what,
                 batch, rows, cols, ld, stride, n, p, why);
    }
    return false;
}

// overlap is the first d in [1, batch) for which C matrix d (starting d·stride elements on)
// shares an element with matrix 0, 0 if none does: element (i, j) of matrix d is at d·stride
// + j·ld + i, so they meet when d·stride = Δj·ld + Δi for some |Δj| < n, |Δi| < m. Matrices
// side by side with the same ld (a head's columns in a row of heads) do not overlap.
int overlap(int m, int n, int ld, long long stride, int batch) {
    for (int d = 1; d < batch; d++) {
        long long q = d * stride, dj = q / ld, r = q - dj * ld;
        if ((dj < n && r < m) || (dj + 1 < n && ld - r < m)) return d;
    }
    return 0;
}

// gemm checks a GEMM (or a strided batch) as cuBLAS does and queues it on the handle's stream.
int gemm(const char *call, Handle *h, int opA, int opB, int m, int n, int k, const void *alpha, const void *a, int ta,
         int lda, long long strideA, const void *b, int tb, int ldb, long long strideB, const void *beta, void *c, int tc,
         int ldc, long long strideC, int batch, int compute, int algo) {
    if (!h) return kNotInitialized;
    auto validOp = [](int op) { return op == kOpN || op == kOpT || op == kOpC; };
    if (!validOp(opA) || !validOp(opB) || m < 0 || n < 0 || k < 0 || batch < 0 || !alpha || !beta) return kInvalidValue;
    int ra = opA == kOpN ? m : k, rb = opB == kOpN ? k : n;
    if (lda < (ra > 1 ? ra : 1) || ldb < (rb > 1 ? rb : 1) || ldc < (m > 1 ? m : 1)) return kInvalidValue;
    if (!((algo >= -1 && algo <= 23) || (algo >= 99 && algo <= 115))) return kInvalidValue;
    bool fp32 = compute == kCompute32F || compute == kCompute32FFast16F || compute == kCompute32FFast16BF ||
                compute == kCompute32FFastTF32 || compute == kR32F /* the legacy cudaDataType form */;
    if (!fp32) return kNotSupported; // CUBLAS_COMPUTE_16F and the integer and double types are not emulated
    bool types = ta == tb && ((ta == kR32F && tc == kR32F) || ((ta == kR16F || ta == kR16BF) && (tc == ta || tc == kR32F)));
    if (!types) return kNotSupported;
    // Negative strides are not emulated; a stride of 0 for A or B reuses one matrix.
    if (strideA < 0 || strideB < 0 || strideC < 0) return kInvalidValue;
    if (m == 0 || n == 0 || batch == 0) return kSuccess;
    CUcontext cur = nullptr;
    cuCtxGetCurrent(&cur);
    if (cur != h->ctx) return kNotInitialized;

    char msg[1024];
    // cuBLAS's result is undefined when two of the batch's C matrices share an element (the
    // GEMMs run concurrently on a GPU): a fault here, as a race would be a wrong answer there.
    if (int d = overlap(m, n, ldc, strideC, batch)) {
        snprintf(msg, sizeof msg,
                 "%s: C matrices 0 and %d of the batch overlap (%d×%d, leading dimension %d, strideC %lld): the GEMMs "
                 "race on a GPU",
                 call, d, m, n, ldc, strideC);
        cudaemu_fail(CUDA_ERROR_ILLEGAL_ADDRESS, msg);
        return kSuccess;
    }
    auto *g = new Gemm{opA == kOpN ? kOpN : kOpT, opB == kOpN ? kOpN : kOpT, m, n, k,
                       *static_cast<const float *>(alpha), *static_cast<const float *>(beta), a, b, c, ta, tb, tc,
                       lda, ldb, ldc, strideA, strideB, strideC, batch};
    int ca = opA == kOpN ? k : m, cb = opB == kOpN ? n : k;
    if ((k > 0 && (!inside(call, "A", a, ta, ra, ca, lda, msg, sizeof msg, batch, strideA) ||
                   !inside(call, "B", b, tb, rb, cb, ldb, msg, sizeof msg, batch, strideB))) ||
        !inside(call, "C", c, tc, m, n, ldc, msg, sizeof msg, batch, strideC)) {
        delete g;
        cudaemu_fail(CUDA_ERROR_ILLEGAL_ADDRESS, msg); // what the GEMM kernel's reads would cause
        return kSuccess;
    }
    int r = cudaemu_enqueue(h->stream, run, g, [](void *p) { delete static_cast<Gemm *>(p); });
    if (r != 0) {
        delete g;
        return kExecutionFailed;
    }
    return kSuccess;
}

} // namespace

#define API extern "C" __attribute__((visibility("default")))

API int cublasCreate_v2(Handle **h) {
    cudaemu_count("cublas", "cublasCreate_v2");
    if (!h) return kInvalidValue;
    CUcontext ctx = nullptr;
    if (cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return kNotInitialized;
    *h = new Handle{ctx};
    return kSuccess;
}

API int cublasDestroy_v2(Handle *h) {
    cudaemu_count("cublas", "cublasDestroy_v2");
    if (!h) return kNotInitialized;
    delete h;
    return kSuccess;
}

API int cublasGetVersion_v2(Handle *h, int *v) {
    cudaemu_count("cublas", "cublasGetVersion_v2");
    if (!v) return kInvalidValue;
    *v = 130000;
    return kSuccess;
}

API int cublasSetStream_v2(Handle *h, CUstream s) {
    cudaemu_count("cublas", "cublasSetStream_v2");
    if (!h) return kNotInitialized;
    h->stream = s;
    return kSuccess;
}

API int cublasGetStream_v2(Handle *h, CUstream *s) {
    cudaemu_count("cublas", "cublasGetStream_v2");
    if (!h) return kNotInitialized;
    if (!s) return kInvalidValue;
    *s = h->stream;
    return kSuccess;
}

API int cublasSetMathMode(Handle *h, int mode) {
    cudaemu_count("cublas", "cublasSetMathMode");
    if (!h) return kNotInitialized;
    int base = mode & ~16; // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
    if (base < 0 || base > 3) return kInvalidValue;
    h->mathMode = mode;
    return kSuccess;
}

API int cublasGetMathMode(Handle *h, int *mode) {
    cudaemu_count("cublas", "cublasGetMathMode");
    if (!h) return kNotInitialized;
    if (!mode) return kInvalidValue;
    *mode = h->mathMode;
    return kSuccess;
}

API int cublasGemmEx(Handle *h, int opA, int opB, int m, int n, int k, const void *alpha, const void *a, int ta, int lda,
                     const void *b, int tb, int ldb, const void *beta, void *c, int tc, int ldc, int compute, int algo) {
    cudaemu_count("cublas", "cublasGemmEx");
    return gemm("cublasGemmEx", h, opA, opB, m, n, k, alpha, a, ta, lda, 0, b, tb, ldb, 0, beta, c, tc, ldc, 0, 1, compute,
                algo);
}

API int cublasGemmStridedBatchedEx(Handle *h, int opA, int opB, int m, int n, int k, const void *alpha, const void *a,
                                   int ta, int lda, long long strideA, const void *b, int tb, int ldb, long long strideB,
                                   const void *beta, void *c, int tc, int ldc, long long strideC, int batch, int compute,
                                   int algo) {
    cudaemu_count("cublas", "cublasGemmStridedBatchedEx");
    return gemm("cublasGemmStridedBatchedEx", h, opA, opB, m, n, k, alpha, a, ta, lda, strideA, b, tb, ldb, strideB, beta,
                c, tc, ldc, strideC, batch, compute, algo);
}

API int cublasSgemm_v2(Handle *h, int opA, int opB, int m, int n, int k, const float *alpha, const float *a, int lda,
                       const float *b, int ldb, const float *beta, float *c, int ldc) {
    cudaemu_count("cublas", "cublasSgemm_v2");
    return cublasGemmEx(h, opA, opB, m, n, k, alpha, a, kR32F, lda, b, kR32F, ldb, beta, c, kR32F, ldc, kCompute32F, -1);
}
