// Kernels of qvd's CPU backend for transformer layers (and BatchNorm): fp32, row-major, one
// call per piece of a parallel pass, on the calling thread only (see kernels.h). Reductions sum
// in float64 with eight partial sums in a fixed order, so a row's (or channel's) result has the
// same bits whichever piece of a pass computes it.
#ifndef QVD_CPU_TRANSFORMER_H
#define QVD_CPU_TRANSFORMER_H

#include <stdint.h>

// y[i] = a·x[i] + b·y[i] (b 0: y is not read; x may be y).
void qvd_axpby(float *y, const float *x, long n, float a, float b);

// Rows [0, rows) of a layer norm of x (rows × cols): mean[r], rstd[r] = 1/sqrt(σ² + eps) and
// y = (x − mean)·rstd·gamma + beta (y may be x).
void qvd_layernorm(float *y, float *mean, float *rstd, const float *x, const float *gamma, const float *beta,
                   long rows, long cols, float eps);
// The backward pass of rows [0, rows): dg[c] += Σ dy·x̂ and db[c] += Σ dy (either may be NULL),
// and dx (may be NULL, may be dy) = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·gamma.
void qvd_layernorm_bwd(float *dx, double *dg, double *db, const float *dy, const float *x, const float *mean,
                       const float *rstd, const float *gamma, long rows, long cols);

// y = x·Φ(x); dx = dy·(Φ(x) + x·φ(x)) (dx may be dy).
void qvd_gelu(float *y, const float *x, long n);
void qvd_gelu_grad(float *dx, const float *dy, const float *x, long n);

// y[i] = x[i]/(1−p) where engine.DropoutKeep(seed, base+i, p), else 0 (y may be x).
void qvd_dropout(float *y, const float *x, long n, float p, uint64_t seed, uint64_t base);

// Rows [0, rows): y = softmax(scale·x) (y may be x); dx = scale·y⊙(dy − Σ dy⊙y) (dx may be dy).
void qvd_softmax(float *y, const float *x, long rows, long cols, float scale);
void qvd_softmax_grad(float *dx, const float *dy, const float *y, long rows, long cols, float scale);

// Channels [c0, c1) of a batch norm of x (n × c × hw): with train, mean and rstd are computed
// and stored, else read; then y = (x − mean)·rstd·gamma + beta (y may be x).
void qvd_batchnorm(float *y, float *mean, float *rstd, const float *x, const float *gamma, const float *beta,
                   long n, long c, long hw, long c0, long c1, float eps, int train);
// The backward pass of channels [c0, c1): sums[ch] = Σ dy, sums[c + ch] = Σ dy·x̂, and dx (may
// be NULL, may be dy) = gamma·rstd·(dy − mean(dy) − x̂·mean(dy·x̂)).
void qvd_batchnorm_bwd(float *dx, double *sums, const float *dy, const float *x, const float *mean, const float *rstd,
                       const float *gamma, long n, long c, long hw, long c0, long c1);

// Products [0, count) of a GemmBatched: C_i = alpha·op(A_i)·op(B_i) + beta·C_i, the i-th
// matrices i·stride elements in, each one single-threaded cblas_sgemm on this thread (beta 0:
// C is not read).
void qvd_gemm_batch(int transA, int transB, long m, long n, long k, float alpha, const float *a, long lda, long strideA,
                    const float *b, long ldb, long strideB, float beta, float *c, long ldc, long strideC, long count);

#endif
