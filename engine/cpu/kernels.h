// Kernels of qvd's CPU backend (engine/cpu): fp32, row-major, one call per piece of a
// parallel pass. Go owns the threads (offload.Pool); every function here runs on the calling
// thread only, and OpenBLAS is set to one thread, so the cores are never oversubscribed.
#ifndef QVD_CPU_KERNELS_H
#define QVD_CPU_KERNELS_H

#include <stdint.h>

// cblas_sgemm on row-major matrices with explicit leading dimensions.
void qvd_sgemm(int transA, int transB, long m, long n, long k, float alpha, const float *a, long lda,
               const float *b, long ldb, float beta, float *c, long ldc);

// C (m×n) = beta·C + op(A)·op(B) with AVX-512 register-blocked kernels (gemm512.c), for the
// small products of convolutions and dense layers; alpha is 1, beta 0 or 1, and B is not
// transposed (the weight gradient transposes dy instead: qvd_conv_bwd; Gemm transposes B into
// scratch). Returns 0, touching nothing, where it does not apply (no AVX-512F, another beta,
// transB, QVD_GEMM=blas): the caller then uses qvd_sgemm.
int qvd_sgemm512(int transA, int transB, long m, long n, long k, const float *a, long lda, const float *b, long ldb,
                 float beta, float *c, long ldc);

// One sample of a "same"-padded stride-1 convolution, y (out × h·w) = wt · im2col(x) + bias
// (no bias where bias is NULL),
// with the unfolding never written: the AVX-512 product reads each row of it from x through a
// mask of the entries inside the image. scratch holds 16·c·k·k bytes. Returns 0, touching
// nothing, for other paddings or where qvd_sgemm512 would.
int qvd_conv_fwd512(float *y, const float *x, const float *wt, const float *bias, long c, long h, long w, long out,
                    long k, long pad, void *scratch);

// qvd_gemm512_on says whether qvd_sgemm512 runs (AVX-512F, and neither QVD_GEMM nor
// QVD_CONV_GEMM is "blas").
int qvd_gemm512_on(void);
// dst[j·ldd + i] = src[i·lds + j] for a rows × cols block (16 × 16 AVX-512 tiles where it can).
void qvd_transpose512(float *dst, long ldd, const float *src, long lds, long rows, long cols);

// C (m×n) = beta·C + op(A)·B with AVX2 register-blocked kernels (gemm256.c), for the dense
// layers' products on CPUs without AVX-512F; alpha is 1, beta 0 or 1. Returns 0, touching
// nothing, where it does not apply (no AVX2 and FMA, another beta, QVD_GEMM=blas).
int qvd_sgemm256(int transA, long m, long n, long k, const float *a, long lda, const float *b, long ldb, float beta,
                 float *c, long ldc);
// qvd_gemm256_on says whether qvd_sgemm256 runs (AVX2 and FMA, and QVD_GEMM is not "blas").
int qvd_gemm256_on(void);
// qvd_transpose512 in 8 × 8 AVX2 tiles.
void qvd_transpose256(float *dst, long ldd, const float *src, long lds, long rows, long cols);

// C (m×n) = A·B + bias[row] (a convolution's output with its bias), without a pass over C for
// the bias. Returns 0 where qvd_sgemm512 would.
int qvd_sgemm512_bias(long m, long n, long k, const float *a, long lda, const float *b, long ldb, const float *bias,
                      float *c, long ldc);

// One sample of a stride-1 convolution's unfolding (Caffe's im2col): cols is (c·k·k) rows of
// oh·ow output pixels, row (ch, ki, kj) starting ld elements after the one before; zero where
// the window hangs over the padding.
void qvd_im2col(float *cols, long ld, const float *x, long c, long h, long w, long k, long pad);
// Its adjoint for one sample: dx (c×h×w) = the sum of the column entries that read each
// input element (dx is overwritten).
void qvd_col2im(float *dx, const float *cols, long ld, long c, long h, long w, long k, long pad);

// Samples [0, n) of a convolution: y (n×out×oh×ow) = w (out × c·k·k) · im2col(x) + bias.
// cols is scratch of c·k·k·oh·ow floats.
void qvd_conv_fwd(float *y, const float *x, const float *wt, const float *bias, long n, long c,
                  long h, long w, long out, long k, long pad, float *cols);
// The backward pass of samples [0, n): dw = Σ dy_s · cols_sᵀ (dw, the caller's partial, comes
// zeroed) and db += Σ dy_s (either may be NULL), dx_s = col2im(wᵀ · dy_s) (dx may be NULL). cols and dcols are scratch of c·k·k·oh·ow,
// tws of out·(oh·ow + c·k·k) (dw's transposed products, with the AVX-512 kernels). With those
// kernels and "same" padding, dx is a convolution of dy with the flipped, transposed weights
// (held in dcols) instead of a product and col2im.
void qvd_conv_bwd(float *dx, float *dw, float *db, const float *dy, const float *x, const float *wt,
                  long n, long c, long h, long w, long out, long k, long pad, float *cols, float *dcols, float *tws);

// y[i] = max(x[i], 0); dx[i] = y[i] > 0 ? dy[i] : 0.
void qvd_relu(float *y, const float *x, long n);
void qvd_relu_grad(float *dx, const float *dy, const float *y, long n);

// y[r, c] += b[c] (perRow 0) or b[r] (perRow 1), rows × cols.
void qvd_add_bias(float *y, const float *b, long rows, long cols, int perRow);
// acc[c] += Σ_r x[r, c] (perRow 0), or acc[r] += Σ_c x[r, c] (perRow 1).
void qvd_sum_rows(float *acc, const float *x, long rows, long cols, int perRow);

// 2×2 stride-2 max-pool of planes [0, planes) of x (planes × h × w) into y; idx[i] is the
// flat index of the maximum in the whole buffer, counted from base. The first maximum in
// row-major order wins (strictly greater).
void qvd_maxpool2(float *y, int32_t *idx, const float *x, long planes, long h, long w, long base);
// dx[idx[i]] = dy[i] for i in [0, n) (dx, of ndx elements, is zeroed by the caller). Returns
// the first i whose index lies outside dx (the rest are not written), or -1.
long qvd_maxpool2_grad(float *dx, long ndx, const float *dy, const int32_t *idx, long n);

// Rows [0, rows) of softmax cross-entropy: loss[r] = logsumexp(z_r) − z_r[y_r] and
// d[r] = (softmax(z_r) − onehot(y_r))·scale (d may alias z). Returns the first row whose
// label is out of range, or -1.
long qvd_softmax_xent(float *d, float *loss, const float *z, const int32_t *labels, long rows,
                      long classes, float scale);

// dst[j, i, :] = src[i, j, :] for an a×b×r array.
void qvd_transpose01(float *dst, const float *src, long a, long b, long r);

// g[i] *= s; returns 1 if any g[i] was Inf or NaN before scaling.
int qvd_unscale_check(float *g, long n, float s);

#endif
