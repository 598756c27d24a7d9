#include "kernels.h"

#include <stdlib.h>
#include <string.h>

// Register-blocked AVX2 products for the dense layers where the CPU has no AVX-512F
// (gemm.go's useFast): gemm512.c's scheme in 256-bit registers. A tile of C, 6 rows × 16
// columns, stays in 12 registers over the whole of k while B's rows are read in place: no
// packing of either operand, and with beta 0 the tile is stored, never C zeroed first. At
// batch 64 the MLP's products are small enough (W: 784 × 256) that OpenBLAS spends a third of
// its time packing the weights again at every call and zeroing the weight gradients before
// accumulating into them. The summation order depends on the shapes only, never on threads
// or alignment.

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma")))
#define INL __attribute__((always_inline)) inline

static int gemm256_on(void) {
	static int v = -1;
	if (v < 0) {
		// QVD_GEMM=blas runs every product on OpenBLAS (QVD_CONV_GEMM, its first name, too).
		const char *e = getenv("QVD_GEMM"), *c = getenv("QVD_CONV_GEMM");
		v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !(e && strcmp(e, "blas") == 0) &&
		    !(c && strcmp(c, "blas") == 0);
	}
	return v;
}

// mask8 is the lane mask for the first n (clamped to 0..8) of 8 floats.
T256 static INL __m256i mask8(long n) {
	const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
	return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), idx);
}

#define MR 6

// BY_ROWS calls TILE(mr, ...) with mr the constant n (1 to MR), so that each tile height is
// compiled with its loops unrolled and its accumulators in registers.
#define BY_ROWS(n, TILE, ...)                                                                                         \
	switch (n) {                                                                                                  \
	case 6: TILE(6, __VA_ARGS__); break;                                                                          \
	case 5: TILE(5, __VA_ARGS__); break;                                                                          \
	case 4: TILE(4, __VA_ARGS__); break;                                                                          \
	case 3: TILE(3, __VA_ARGS__); break;                                                                          \
	case 2: TILE(2, __VA_ARGS__); break;                                                                          \
	default: TILE(1, __VA_ARGS__); break;                                                                         \
	}

// tile: rows [0, mr) × columns [0, 16) of C = beta·C + A·B, where A's element (i, kk) is
// a[i·si + kk·sk] (NN: si = lda, sk = 1; TN: si = 1, sk = lda) and B is row-major. Whole
// strips (full) load and store plainly; the last strip of a ragged n goes through masks m0
// and m1, so nothing past column n is read or written.
T256 static INL void tile(const int mr, long k, const float *a, long si, long sk, const float *b, long ldb, float *c,
                          long ldc, int full, __m256i m0, __m256i m1, int beta) {
	__m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
	for (int r = 0; r < MR; r++)
		if (r < mr) acc0[r] = acc1[r] = _mm256_setzero_ps();
	for (long kk = 0; kk < k; kk++) {
		const float *br = b + kk * ldb;
		__m256 b0, b1;
		if (full) {
			b0 = _mm256_loadu_ps(br);
			b1 = _mm256_loadu_ps(br + 8);
		} else {
			b0 = _mm256_maskload_ps(br, m0);
			b1 = _mm256_maskload_ps(br + 8, m1);
		}
		const float *ak = a + kk * sk;
#pragma GCC unroll 6
		for (int r = 0; r < MR; r++)
			if (r < mr) {
				const __m256 av = _mm256_broadcast_ss(ak + r * si);
				acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
				acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
			}
	}
#pragma GCC unroll 6
	for (int r = 0; r < MR; r++)
		if (r < mr) {
			float *cr = c + r * ldc;
			if (full) {
				if (beta) {
					acc0[r] = _mm256_add_ps(acc0[r], _mm256_loadu_ps(cr));
					acc1[r] = _mm256_add_ps(acc1[r], _mm256_loadu_ps(cr + 8));
				}
				_mm256_storeu_ps(cr, acc0[r]);
				_mm256_storeu_ps(cr + 8, acc1[r]);
			} else {
				if (beta) {
					acc0[r] = _mm256_add_ps(acc0[r], _mm256_maskload_ps(cr, m0));
					acc1[r] = _mm256_add_ps(acc1[r], _mm256_maskload_ps(cr + 8, m1));
				}
				_mm256_maskstore_ps(cr, m0, acc0[r]);
				_mm256_maskstore_ps(cr + 8, m1, acc1[r]);
			}
		}
}

#define FULL_TILE(mr, ...) tile(mr, __VA_ARGS__, 1, m0, m1, beta)
#define EDGE_TILE(mr, ...) tile(mr, __VA_ARGS__, 0, m0, m1, beta)

T256 static void nn(long m, long n, long k, const float *a, long si, long sk, const float *b, long ldb, float *c,
                    long ldc, int beta) {
	for (long j = 0; j < n; j += 16) {
		const __m256i m0 = mask8(n - j), m1 = mask8(n - j - 8);
		const int full = n - j >= 16;
		for (long i = 0; i < m; i += MR) {
			const float *ai = a + i * si;
			float *ci = c + i * ldc + j;
			if (full) {
				BY_ROWS(m - i >= MR ? MR : m - i, FULL_TILE, k, ai, si, sk, b + j, ldb, ci, ldc)
			} else {
				BY_ROWS(m - i >= MR ? MR : m - i, EDGE_TILE, k, ai, si, sk, b + j, ldb, ci, ldc)
			}
		}
	}
}

// tr8 transposes one 8 × 8 tile: dst row j = src column j.
T256 static INL void tr8(float *dst, long ldd, const float *src, long lds) {
	__m256 r[8], t[8], u[8];
	for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
	for (int i = 0; i < 4; i++) {
		t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
		t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
	}
	// u[4g + c], each 128-bit lane L: column 4L + c of rows 4g .. 4g+3.
	for (int g = 0; g < 2; g++)
		for (int h = 0; h < 2; h++) {
			const __m256d x = _mm256_castps_pd(t[4 * g + h]), y = _mm256_castps_pd(t[4 * g + h + 2]);
			u[4 * g + 2 * h] = _mm256_castpd_ps(_mm256_unpacklo_pd(x, y));
			u[4 * g + 2 * h + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(x, y));
		}
	for (int c = 0; c < 4; c++) {
		_mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
		_mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
	}
}

T256 static void transpose(float *dst, long ldd, const float *src, long lds, long rows, long cols) {
	for (long i0 = 0; i0 < rows; i0 += 8)
		for (long j0 = 0; j0 < cols; j0 += 8) {
			if (i0 + 8 <= rows && j0 + 8 <= cols) {
				tr8(dst + j0 * ldd + i0, ldd, src + i0 * lds + j0, lds);
				continue;
			}
			const long i1 = i0 + 8 < rows ? i0 + 8 : rows, j1 = j0 + 8 < cols ? j0 + 8 : cols;
			for (long j = j0; j < j1; j++)
				for (long i = i0; i < i1; i++) dst[j * ldd + i] = src[i * lds + j];
		}
}

int qvd_gemm256_on(void) { return gemm256_on(); }

int qvd_sgemm256(int transA, long m, long n, long k, const float *a, long lda, const float *b, long ldb, float beta,
                 float *c, long ldc) {
	if (!gemm256_on() || (beta != 0 && beta != 1) || m <= 0 || n <= 0 || k <= 0) return 0;
	if (transA) nn(m, n, k, a, 1, lda, b, ldb, c, ldc, beta != 0);
	else nn(m, n, k, a, lda, 1, b, ldb, c, ldc, beta != 0);
	return 1;
}

void qvd_transpose256(float *dst, long ldd, const float *src, long lds, long rows, long cols) {
	if (gemm256_on()) {
		transpose(dst, ldd, src, lds, rows, cols);
		return;
	}
	for (long i = 0; i < rows; i++)
		for (long j = 0; j < cols; j++) dst[j * ldd + i] = src[i * lds + j];
}

#else

int qvd_gemm256_on(void) { return 0; }

int qvd_sgemm256(int transA, long m, long n, long k, const float *a, long lda, const float *b, long ldb, float beta,
                 float *c, long ldc) {
	return 0;
}

void qvd_transpose256(float *dst, long ldd, const float *src, long lds, long rows, long cols) {
	for (long i = 0; i < rows; i++)
		for (long j = 0; j < cols; j++) dst[j * ldd + i] = src[i * lds + j];
}

#endif
