#include "kernels.h"

#include <stdlib.h>
#include <string.h>

// Register-blocked AVX-512 products for the convolutions' per-sample GEMMs, and for the dense
// layers' products where k is moderate (gemm.go's useFast).
//
// The convolutions multiply small matrices that sit in the core's caches (the shipped CNN's
// second layer: 64×288 weights by 288×196 columns), and so do the MLP's layers at batch 64. OpenBLAS runs them with the kernels
// OPENBLAS_CORETYPE names, AVX2 where the environment pins Haswell, at about half of what
// the AVX-512 units give on such shapes; these kernels use AVX-512 whatever OpenBLAS was
// told. They need no packing: B's rows are read in place, the tiles small enough that a block
// of B stays in L1 while the rows of A stream by. A "same" convolution's forward pass reads
// its unfolding straight from the input (qvd_conv_fwd512), and its input gradient is that
// same kernel run over dy (qvd_conv_bwd). The weight gradient, dy·colsᵀ, is computed
// transposed, cols·dyᵀ: that transposes dy (out × oh·ow) rather than the unfolding (c·k·k ×
// oh·ow, 4.5× larger on the CNN's second layer), and gives the product the output channels as
// its columns (whole vectors for 32 and 64). The summation order depends on the shapes only,
// never on threads or alignment.

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define T512 __attribute__((target("avx512f")))
#define INL __attribute__((always_inline)) inline

static int gemm512_on(void) {
	static int v = -1;
	if (v < 0) {
		// QVD_GEMM=blas runs every product on OpenBLAS (QVD_CONV_GEMM, its first name, too).
		const char *e = getenv("QVD_GEMM"), *c = getenv("QVD_CONV_GEMM");
		v = __builtin_cpu_supports("avx512f") && !(e && strcmp(e, "blas") == 0) && !(c && strcmp(c, "blas") == 0);
	}
	return v;
}

T512 static INL __mmask16 mask16(long n) {
	return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// nn_tile: rows [0, mr) × columns [0, 32) of C (columns masked by m0, m1) += A·B, where A's
// element (i, kk) is a[i·si + kk·sk] (NN: si = lda, sk = 1; TN: si = 1, sk = lda) and B is
// row-major; bias, if not NULL, is added to each row (bias[r] to row r). Eight rows by two
// vectors: 16 accumulators, 2 loads and 8 broadcasts per 16 FMAs.
#define MR 8

// BY_ROWS calls TILE(mr, ...) with mr the constant n (1 to MR), so that each tile height is
// compiled with its loops unrolled and its accumulators in registers.
#define BY_ROWS(n, TILE, ...)                                                                                         \
	switch (n) {                                                                                                  \
	case 8: TILE(8, __VA_ARGS__); break;                                                                          \
	case 7: TILE(7, __VA_ARGS__); break;                                                                          \
	case 6: TILE(6, __VA_ARGS__); break;                                                                          \
	case 5: TILE(5, __VA_ARGS__); break;                                                                          \
	case 4: TILE(4, __VA_ARGS__); break;                                                                          \
	case 3: TILE(3, __VA_ARGS__); break;                                                                          \
	case 2: TILE(2, __VA_ARGS__); break;                                                                          \
	default: TILE(1, __VA_ARGS__); break;                                                                         \
	}

T512 static INL void nn_tile(const int mr, long k, const float *a, long si, long sk, const float *b, long ldb,
                             float *c, long ldc, __mmask16 m0, __mmask16 m1, int beta, const float *bias) {
	__m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
	for (int r = 0; r < MR; r++)
		if (r < mr) acc0[r] = acc1[r] = bias ? _mm512_set1_ps(bias[r]) : _mm512_setzero_ps();
	for (long kk = 0; kk < k; kk++) {
		const float *br = b + kk * ldb;
		const __m512 b0 = _mm512_maskz_loadu_ps(m0, br), b1 = _mm512_maskz_loadu_ps(m1, br + 16);
		const float *ak = a + kk * sk;
#pragma GCC unroll 8
		for (int r = 0; r < MR; r++)
			if (r < mr) {
				const __m512 av = _mm512_set1_ps(ak[r * si]);
				acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
				acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
			}
	}
#pragma GCC unroll 8
	for (int r = 0; r < MR; r++)
		if (r < mr) {
			float *cr = c + r * ldc;
			if (beta) {
				acc0[r] = _mm512_add_ps(acc0[r], _mm512_maskz_loadu_ps(m0, cr));
				acc1[r] = _mm512_add_ps(acc1[r], _mm512_maskz_loadu_ps(m1, cr + 16));
			}
			_mm512_mask_storeu_ps(cr, m0, acc0[r]);
			_mm512_mask_storeu_ps(cr + 16, m1, acc1[r]);
		}
}

T512 static void nn(long m, long n, long k, const float *a, long si, long sk, const float *b, long ldb, float *c,
                    long ldc, int beta, const float *bias) {
	for (long j = 0; j < n; j += 32) {
		const __mmask16 m0 = mask16(n - j), m1 = mask16(n - j - 16);
		for (long i = 0; i < m; i += MR) {
			const float *ai = a + i * si;
			float *ci = c + i * ldc + j;
			const float *bi = bias ? bias + i : NULL;
			BY_ROWS(m - i >= MR ? MR : m - i, nn_tile, k, ai, si, sk, b + j, ldb, ci, ldc, m0, m1, beta, bi)
		}
	}
}

// tr16 transposes one 16 × 16 tile: dst row j = src column j. Pairs of rows are interleaved
// by 32 and then 64 bits, which leaves each 128-bit lane holding one column of four rows; a
// 4 × 4 transpose of those lanes finishes it.
T512 static INL void tr16(float *dst, long ldd, const float *src, long lds) {
	__m512 r[16], t[16];
	for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
	for (int i = 0; i < 8; i++) {
		t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
		t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
	}
	// u[4g + c], lane L: column 4L + c of rows 4g .. 4g+3.
	__m512 u[16];
	for (int g = 0; g < 4; g++)
		for (int h = 0; h < 2; h++) {
			const __m512d x = _mm512_castps_pd(t[4 * g + h]), y = _mm512_castps_pd(t[4 * g + h + 2]);
			u[4 * g + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
			u[4 * g + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
		}
	for (int c = 0; c < 4; c++) {
		const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
		const __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
		const __m512 x2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
		const __m512 x3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
		_mm512_storeu_ps(dst + (0 + c) * ldd, _mm512_shuffle_f32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0)));
		_mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1)));
		_mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0)));
		_mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1)));
	}
}

// transpose writes dst[j·ldd + i] = src[i·lds + j] for a rows × cols block: whole 16 × 16
// tiles in registers, the edges element by element.
T512 static void transpose(float *dst, long ldd, const float *src, long lds, long rows, long cols) {
	for (long i0 = 0; i0 < rows; i0 += 16)
		for (long j0 = 0; j0 < cols; j0 += 16) {
			if (i0 + 16 <= rows && j0 + 16 <= cols) {
				tr16(dst + j0 * ldd + i0, ldd, src + i0 * lds + j0, lds);
				continue;
			}
			const long i1 = i0 + 16 < rows ? i0 + 16 : rows, j1 = j0 + 16 < cols ? j0 + 16 : cols;
			for (long j = j0; j < j1; j++)
				for (long i = i0; i < i1; i++) dst[j * ldd + i] = src[i * lds + j];
		}
}

// A tap of an implicit unfolding: where row kk of a j-block of the columns starts in the
// input, and which of its 32 entries read inside the image (the rest are padding).
typedef struct {
	long off;
	__mmask16 m0, m1;
} tap;

// fwd_tile is nn_tile with B read straight from the input: row kk of the block is the input
// at t[kk].off, masked.
T512 static INL void fwd_tile(const int mr, long k, const float *a, long lda, const float *x, const tap *t, float *c,
                              long ldc, __mmask16 s0, __mmask16 s1, const float *bias) {
	__m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
	for (int r = 0; r < MR; r++)
		if (r < mr) acc0[r] = acc1[r] = bias ? _mm512_set1_ps(bias[r]) : _mm512_setzero_ps();
	for (long kk = 0; kk < k; kk++) {
		const float *br = x + t[kk].off;
		const __m512 b0 = _mm512_maskz_loadu_ps(t[kk].m0, br), b1 = _mm512_maskz_loadu_ps(t[kk].m1, br + 16);
#pragma GCC unroll 8
		for (int r = 0; r < MR; r++)
			if (r < mr) {
				const __m512 av = _mm512_set1_ps(a[r * lda + kk]);
				acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
				acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
			}
	}
#pragma GCC unroll 8
	for (int r = 0; r < MR; r++)
		if (r < mr) {
			_mm512_mask_storeu_ps(c + r * ldc, s0, acc0[r]);
			_mm512_mask_storeu_ps(c + r * ldc + 16, s1, acc1[r]);
		}
}

// tap_bits sets bit e of rows[ki] (cols[kj]) where row ki (column kj) of output pixel j + e's
// window is inside the image, for the n pixels of a block from j (fewer at the image's end).
// One division per block, where there were two per pixel and tap: on a 3×3 convolution of
// one channel (the CNN's first) those divisions cost more than the product.
static void tap_bits(unsigned long *rows, unsigned long *cols, long j, long n, long h, long w, long k, long pad) {
	for (long q = 0; q < k; q++) rows[q] = cols[q] = 0;
	long oy = j / w, ox = j % w;
	for (long e = 0; e < n && j + e < h * w; e++) {
		for (long q = 0; q < k; q++) {
			const long iy = oy + q - pad, ix = ox + q - pad;
			if (iy >= 0 && iy < h) rows[q] |= 1ul << e;
			if (ix >= 0 && ix < w) cols[q] |= 1ul << e;
		}
		if (++ox == w) ox = 0, oy++;
	}
}

T512 static void conv_fwd(float *y, const float *x, const float *wt, const float *bias, long c, long h, long w,
                          long out, long k, long pad, tap *t) {
	const long ohw = h * w, ckk = c * k * k;
	for (long j = 0; j < ohw; j += 32) {
		const __mmask16 s0 = mask16(ohw - j), s1 = mask16(ohw - j - 16);
		// The taps of this block: (ki, kj) decides which entries read padding (entry e reads
		// inside the image where row ki and column kj of its window do: rows[ki] & cols[kj]);
		// the channel only moves the start.
		unsigned long rows[k], cols[k];
		tap_bits(rows, cols, j, 32, h, w, k, pad);
		for (long q = 0; q < k * k; q++) {
			const long ki = q / k, kj = q % k;
			const unsigned long bits = rows[ki] & cols[kj];
			for (long ch = 0; ch < c; ch++) {
				tap *tp = t + ch * k * k + q;
				tp->off = ch * h * w + j + (ki - pad) * w + (kj - pad);
				tp->m0 = (__mmask16)(bits & 0xffff);
				tp->m1 = (__mmask16)(bits >> 16);
			}
		}
		for (long i = 0; i < out; i += MR) {
			const float *ai = wt + i * ckk;
			float *ci = y + i * ohw + j;
			const float *bi = bias ? bias + i : NULL;
			BY_ROWS(out - i >= MR ? MR : out - i, fwd_tile, ckk, ai, ckk, x, t, ci, ohw, s0, s1, bi)
		}
	}
}

int qvd_conv_fwd512(float *y, const float *x, const float *wt, const float *bias, long c, long h, long w, long out,
                    long k, long pad, void *scratch) {
	const long oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1;
	// (scratch is the unfolding's space, c·k·k·h·w floats: enough for the taps from 4 pixels on)
	if (!gemm512_on() || oh != h || ow != w || h * w < 4 || out <= 0 || c <= 0) return 0;
	conv_fwd(y, x, wt, bias, c, h, w, out, k, pad, scratch);
	return 1;
}

int qvd_gemm512_on(void) { return gemm512_on(); }

void qvd_transpose512(float *dst, long ldd, const float *src, long lds, long rows, long cols) {
	if (gemm512_on()) {
		transpose(dst, ldd, src, lds, rows, cols);
		return;
	}
	// A CPU without AVX-512F (the engine never calls this there; its tests do).
	for (long i = 0; i < rows; i++)
		for (long j = 0; j < cols; j++) dst[j * ldd + i] = src[i * lds + j];
}

int qvd_sgemm512_bias(long m, long n, long k, const float *a, long lda, const float *b, long ldb, const float *bias,
                      float *c, long ldc) {
	if (!gemm512_on() || m <= 0 || n <= 0 || k <= 0) return 0;
	nn(m, n, k, a, lda, 1, b, ldb, c, ldc, 0, bias);
	return 1;
}

int qvd_sgemm512(int transA, int transB, long m, long n, long k, const float *a, long lda, const float *b, long ldb,
                 float beta, float *c, long ldc) {
	if (!gemm512_on() || (beta != 0 && beta != 1) || transB || m <= 0 || n <= 0 || k <= 0) return 0;
	if (transA) nn(m, n, k, a, 1, lda, b, ldb, c, ldc, beta != 0, NULL);
	else nn(m, n, k, a, lda, 1, b, ldb, c, ldc, beta != 0, NULL);
	return 1;
}

#else

int qvd_sgemm512(int transA, int transB, long m, long n, long k, const float *a, long lda, const float *b, long ldb,
                 float beta, float *c, long ldc) {
	return 0;
}

int qvd_gemm512_on(void) { return 0; }

int qvd_conv_fwd512(float *y, const float *x, const float *wt, const float *bias, long c, long h, long w, long out,
                    long k, long pad, void *scratch) {
	return 0;
}

void qvd_transpose512(float *dst, long ldd, const float *src, long lds, long rows, long cols) {
	for (long i = 0; i < rows; i++)
		for (long j = 0; j < cols; j++) dst[j * ldd + i] = src[i * lds + j];
}

int qvd_sgemm512_bias(long m, long n, long k, const float *a, long lda, const float *b, long ldb, const float *bias,
                      float *c, long ldc) {
	return 0;
}

#endif
