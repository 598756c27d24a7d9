// The emulated cuBLAS (libcublas.so.13, chosen with QVD_CUBLAS_LIBRARY): the handle calls and
// cublasGemmEx/cublasSgemm that engine/cuda/blas.go binds, on OpenBLAS's sgemm.
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

int run(void *arg, char *, size_t) {
    const Gemm &g = *static_cast<Gemm *>(arg);
    int ra = g.opA == kOpN ? g.m : g.k, ca = g.opA == kOpN ? g.k : g.m;
    int rb = g.opB == kOpN ? g.k : g.n, cb = g.opB == kOpN ? g.n : g.k;
    int tA = g.opA == kOpN ? kCblasNoTrans : kCblasTrans, tB = g.opB == kOpN ? kCblasNoTrans : kCblasTrans;
    if (sequential()) {
        runSequential(g);
        return 0;
    }
    if (g.ta == kR32F && g.tc == kR32F) {
        cblas_sgemm(kCblasColMajor, tA, tB, g.m, g.n, g.k, g.alpha, static_cast<const float *>(g.a), g.lda,
                    static_cast<const float *>(g.b), g.ldb, g.beta, static_cast<float *>(g.c), g.ldc);
        return 0;
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
    return 0;
}

// inside checks that a matrix lies inside one live allocation, as a GPU's reads would find.
bool inside(const char *what, const void *p, int t, int rows, int cols, int ld, char *msg, size_t cap) {
    size_t n = span(rows, cols, ld) * typeSize(t);
    if (n == 0) return true;
    char why[512];
    if (cudaemu_check_range(reinterpret_cast<uintptr_t>(p), n, why, sizeof why)) return true;
    snprintf(msg, cap, "cublasGemmEx: %s (%d×%d, leading dimension %d, %zu bytes at %p): %s", what, rows, cols, ld, n, p, why);
    return false;
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
    if (!h) return kNotInitialized;
    auto validOp = [](int op) { return op == kOpN || op == kOpT || op == kOpC; };
    if (!validOp(opA) || !validOp(opB) || m < 0 || n < 0 || k < 0 || !alpha || !beta) return kInvalidValue;
    int ra = opA == kOpN ? m : k, rb = opB == kOpN ? k : n;
    if (lda < (ra > 1 ? ra : 1) || ldb < (rb > 1 ? rb : 1) || ldc < (m > 1 ? m : 1)) return kInvalidValue;
    if (!((algo >= -1 && algo <= 23) || (algo >= 99 && algo <= 115))) return kInvalidValue;
    bool fp32 = compute == kCompute32F || compute == kCompute32FFast16F || compute == kCompute32FFast16BF ||
                compute == kCompute32FFastTF32 || compute == kR32F /* the legacy cudaDataType form */;
    if (!fp32) return kNotSupported; // CUBLAS_COMPUTE_16F and the integer and double types are not emulated
    bool types = ta == tb && ((ta == kR32F && tc == kR32F) || ((ta == kR16F || ta == kR16BF) && (tc == ta || tc == kR32F)));
    if (!types) return kNotSupported;
    if (m == 0 || n == 0) return kSuccess;
    CUcontext cur = nullptr;
    cuCtxGetCurrent(&cur);
    if (cur != h->ctx) return kNotInitialized;

    auto *g = new Gemm{opA == kOpN ? kOpN : kOpT, opB == kOpN ? kOpN : kOpT, m, n, k,
                       *static_cast<const float *>(alpha), *static_cast<const float *>(beta), a, b, c, ta, tb, tc,
                       lda, ldb, ldc};
    char msg[1024];
    int ca = opA == kOpN ? k : m, cb = opB == kOpN ? n : k;
    if ((k > 0 && (!inside("A", a, ta, ra, ca, lda, msg, sizeof msg) || !inside("B", b, tb, rb, cb, ldb, msg, sizeof msg))) ||
        !inside("C", c, tc, m, n, ldc, msg, sizeof msg)) {
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

API int cublasSgemm_v2(Handle *h, int opA, int opB, int m, int n, int k, const float *alpha, const float *a, int lda,
                       const float *b, int ldb, const float *beta, float *c, int ldc) {
    cudaemu_count("cublas", "cublasSgemm_v2");
    return cublasGemmEx(h, opA, opB, m, n, k, alpha, a, kR32F, lda, b, kR32F, ldb, beta, c, kR32F, ldc, kCompute32F, -1);
}
