#include "kernels.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

// The hot loops are compiled for AVX-512, AVX2 and baseline x86-64 and the loader picks the
// best the CPU has (GCC function multi-versioning); elsewhere they are plain C.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTI __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTI
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QVD_X86 1
// has512 says the CPU runs AVX-512F: the short-row kernels below then use masked loads and
// stores, one instruction for a row of up to 16 floats (an image row of a small feature map,
// which a vectorised loop never reaches the body of).
static int has512(void) {
	static int v = -1;
	if (v < 0) v = __builtin_cpu_supports("avx512f");
	return v;
}
__attribute__((target("avx512f"))) static inline __mmask16 tailmask(long n) {
	return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}
// copy512 and add512 copy or add n floats, 16 at a time with a masked tail.
__attribute__((target("avx512f"))) static inline void copy512(float *d, const float *s, long n) {
	for (long i = 0; i < n; i += 16) {
		__mmask16 m = tailmask(n - i);
		_mm512_mask_storeu_ps(d + i, m, _mm512_maskz_loadu_ps(m, s + i));
	}
}
__attribute__((target("avx512f"))) static inline void add512(float *d, const float *s, long n) {
	for (long i = 0; i < n; i += 16) {
		__mmask16 m = tailmask(n - i);
		_mm512_mask_storeu_ps(d + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, d + i), _mm512_maskz_loadu_ps(m, s + i)));
	}
}
#endif

void qvd_sgemm(int transA, int transB, long m, long n, long k, float alpha, const float *a, long lda,
               const float *b, long ldb, float beta, float *c, long ldc) {
	cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans,
	            (blasint)m, (blasint)n, (blasint)k, alpha, a, (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

// With "same" padding (the output as large as the input), row (ch, ki, kj) of a sample's
// unfolding is the channel's plane shifted by d = (ki-pad)·w + (kj-pad): one long contiguous
// copy, then zeros where the shift reads outside the plane (whole rows at either end) or
// wraps round a row's edge (|kj-pad| columns per row). That is a few vector instructions per
// row of oh·ow values instead of a loop per image row, which is what dominated with small
// feature maps (rows of 7 to 28 values).
static inline void shift_bounds(long d, long n, long *lo, long *hi) {
	*lo = d < 0 ? -d : 0;
	*hi = n - d < n ? n - d : n;
	if (*lo > n) *lo = n;
	if (*hi < *lo) *hi = *lo;
}

// zero_columns zeroes columns [x0, x1) of rows × ld floats, column by column: the runs are a
// padding's width (one or two floats), and strided stores are not turned into memset calls.
static inline void zero_columns(float *m, long ld, long rows, long x0, long x1) {
	for (long x = x0; x < x1; x++)
		for (long y = 0; y < rows; y++) m[y * ld + x] = 0;
}

MULTI void qvd_im2col(float *cols, long ld, const float *x, long c, long h, long w, long k, long pad) {
	const long oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1;
	const int same = oh == h && ow == w;
	for (long ch = 0; ch < c; ch++) {
		const float *plane = x + ch * h * w;
		for (long ki = 0; ki < k; ki++) {
			for (long kj = 0; kj < k; kj++) {
				float *row = cols + ((ch * k + ki) * k + kj) * ld;
				// Output columns [x0, x1) read inside the image; the rest is padding.
				const long x0 = pad - kj > 0 ? pad - kj : 0;
				long x1 = w + pad - kj;
				if (x1 > ow) x1 = ow;
				const long shift = kj - pad;
				if (same) {
					const long n = h * w, d = (ki - pad) * w + shift;
					long lo, hi;
					shift_bounds(d, n, &lo, &hi);
					for (long t = 0; t < lo; t++) row[t] = 0;
					for (long t = lo; t < hi; t++) row[t] = plane[t + d];
					for (long t = hi; t < n; t++) row[t] = 0;
					// The wrapped columns, a column at a time: a row at a time the compiler made
					// each one- or two-float run a memset call (4% of the CNN's step on a Zen 3).
					zero_columns(row, ow, oh, 0, x0);
					zero_columns(row, ow, oh, x1, ow);
					continue;
				}
				for (long oy = 0; oy < oh; oy++) {
					const long iy = oy + ki - pad;
					float *r = row + oy * ow;
					if (iy < 0 || iy >= h || x1 <= x0) {
						for (long ox = 0; ox < ow; ox++) r[ox] = 0;
						continue;
					}
					const float *src = plane + iy * w;
					for (long ox = 0; ox < x0; ox++) r[ox] = 0;
#ifdef QVD_X86
					if (has512()) copy512(r + x0, src + x0 + shift, x1 - x0);
					else
#endif
						for (long ox = x0; ox < x1; ox++) r[ox] = src[ox + shift];
					for (long ox = x1; ox < ow; ox++) r[ox] = 0;
				}
			}
		}
	}
}

MULTI void qvd_col2im(float *dx, const float *cols, long ld, long c, long h, long w, long k, long pad) {
	const long oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1;
	int same = oh == h && ow == w;
	// Same padding: each row goes through tmp, with its wrapped columns zeroed.
	float small[4096];
	float *tmp = small;
	if (same && h * w > 4096) {
		tmp = malloc((size_t)(h * w) * sizeof(float));
		if (!tmp) same = 0; // fall back to the row loop: no memory to spare is no error here
	}
	memset(dx, 0, (size_t)(c * h * w) * sizeof(float));
	for (long ch = 0; ch < c; ch++) {
		float *plane = dx + ch * h * w;
		for (long ki = 0; ki < k; ki++) {
			for (long kj = 0; kj < k; kj++) {
				const float *row = cols + ((ch * k + ki) * k + kj) * ld;
				const long x0 = pad - kj > 0 ? pad - kj : 0;
				long x1 = w + pad - kj;
				if (x1 > ow) x1 = ow;
				if (same) {
					// The adjoint of the shifted copy: add the row back shifted, without the
					// entries that read padding (wrapped columns, rows outside the plane).
					const long n = h * w, d = (ki - pad) * w + (kj - pad);
					long lo, hi;
					shift_bounds(d, n, &lo, &hi);
					for (long t = lo; t < hi; t++) tmp[t] = row[t];
					if (hi > lo) {
						const long y0 = lo / ow, y1 = (hi - 1) / ow + 1;
						zero_columns(tmp + y0 * ow, ow, y1 - y0, 0, x0);
						zero_columns(tmp + y0 * ow, ow, y1 - y0, x1, ow);
					}
					for (long t = lo; t < hi; t++) plane[t + d] += tmp[t];
					continue;
				}
				for (long oy = 0; oy < oh; oy++) {
					const long iy = oy + ki - pad;
					if (iy < 0 || iy >= h || x1 <= x0) continue;
					float *d = plane + iy * w;
					const float *r = row + oy * ow;
#ifdef QVD_X86
					if (has512()) {
						add512(d + x0 + kj - pad, r + x0, x1 - x0);
						continue;
					}
#endif
					for (long ox = x0; ox < x1; ox++) d[ox + kj - pad] += r[ox];
				}
			}
		}
	}
	if (tmp != small) free(tmp);
}

// conv_gemm is a convolution's product: AVX-512 kernels where the CPU has them, else OpenBLAS.
static void conv_gemm(int transA, int transB, long m, long n, long k, const float *a, long lda, const float *b,
                      long ldb, float beta, float *c, long ldc) {
	if (!qvd_sgemm512(transA, transB, m, n, k, a, lda, b, ldb, beta, c, ldc))
		qvd_sgemm(transA, transB, m, n, k, 1, a, lda, b, ldb, beta, c, ldc);
}

void qvd_conv_fwd(float *y, const float *x, const float *wt, const float *bias, long n, long c,
                  long h, long w, long out, long k, long pad, float *cols) {
	const long oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1, ohw = oh * ow, ckk = c * k * k;
	for (long s = 0; s < n; s++) {
		float *ys = y + s * out * ohw;
		if (qvd_conv_fwd512(ys, x + s * c * h * w, wt, bias, c, h, w, out, k, pad, cols)) continue;
		qvd_im2col(cols, ohw, x + s * c * h * w, c, h, w, k, pad);
		if (qvd_sgemm512_bias(out, ohw, ckk, wt, ckk, cols, ohw, bias, ys, ohw)) continue;
		// The bias first, then the product added onto it (beta 1): one pass over y less.
		for (long o = 0; o < out; o++) {
			float *r = ys + o * ohw;
			const float b = bias[o];
			for (long p = 0; p < ohw; p++) r[p] = b;
		}
		qvd_sgemm(0, 0, out, ohw, ckk, 1, wt, ckk, cols, ohw, 1, ys, ohw);
	}
}

void qvd_conv_bwd(float *dx, float *dw, float *db, const float *dy, const float *x, const float *wt,
                  long n, long c, long h, long w, long out, long k, long pad, float *cols, float *dcols, float *tws) {
	const long oh = h + 2 * pad - k + 1, ow = w + 2 * pad - k + 1, ohw = oh * ow, ckk = c * k * k;
	// With the AVX-512 kernels dw is summed transposed, dwT (c·k·k × out) += cols · dyᵀ, and
	// transposed back once at the end (gemm512.c says why).
	const int t512 = dw && qvd_gemm512_on();
	float *dyT = tws, *dwT = tws + out * ohw;
	// dx_s = Σ_{o,ki,kj} w[o,ch,ki,kj]·dy_s[o, iy−ki+pad, ix−kj+pad]: the forward convolution
	// of dy_s (out channels) with wf[ch,o,ki',kj'] = w[o,ch,k−1−ki',k−1−kj'] and padding
	// k−1−pad, which for "same" padding is "same" again. It reads dy in place, where the
	// product and col2im write and then scatter the whole unfolding. wf lives in dcols (it
	// fits where out ≤ oh·ow), the taps of qvd_conv_fwd512 in cols once dw is done with it.
	float *wf = NULL;
	if (dx && qvd_gemm512_on() && oh == h && ow == w && out <= ohw && 4 * out <= c * h * w) {
		wf = dcols;
		for (long o = 0; o < out; o++)
			for (long ch = 0; ch < c; ch++)
				for (long ki = 0; ki < k; ki++)
					for (long kj = 0; kj < k; kj++)
						wf[((ch * out + o) * k + (k - 1 - ki)) * k + (k - 1 - kj)] = wt[((o * c + ch) * k + ki) * k + kj];
	}
	for (long s = 0; s < n; s++) {
		const float *dys = dy + s * out * ohw;
		if (dw) {
			qvd_im2col(cols, ohw, x + s * c * h * w, c, h, w, k, pad);
			if (t512) {
				qvd_transpose512(dyT, out, dys, ohw, out, ohw);
				qvd_sgemm512(0, 0, ckk, out, ohw, cols, ohw, dyT, out, s > 0, dwT, out);
			} else {
				qvd_sgemm(0, 1, out, ckk, ohw, 1, dys, ohw, cols, ohw, 1, dw, ckk);
			}
		}
		if (db) qvd_sum_rows(db, dys, out, ohw, 1);
		if (dx) {
			if (wf && qvd_conv_fwd512(dx + s * c * h * w, dys, wf, NULL, out, h, w, c, k, k - 1 - pad, cols)) continue;
			wf = NULL; // dcols is the product's again
			conv_gemm(1, 0, ckk, ohw, out, wt, ckk, dys, ohw, 0, dcols, ohw);
			qvd_col2im(dx + s * c * h * w, dcols, ohw, c, h, w, k, pad);
		}
	}
	if (t512 && n > 0) qvd_transpose512(dw, ckk, dwT, out, ckk, out);
}

MULTI void qvd_relu(float *y, const float *x, long n) {
	// x <= 0 is false for a NaN, which passes through (a diverged run must not look healthy),
	// and -0 becomes +0, as max(x, 0) does.
	for (long i = 0; i < n; i++) y[i] = x[i] <= 0 ? 0 : x[i];
}

MULTI void qvd_relu_grad(float *dx, const float *dy, const float *y, long n) {
	for (long i = 0; i < n; i++) dx[i] = y[i] > 0 ? dy[i] : 0;
}

MULTI void qvd_add_bias(float *y, const float *b, long rows, long cols, int perRow) {
	for (long r = 0; r < rows; r++) {
		float *yr = y + r * cols;
		if (perRow) {
			const float v = b[r];
			for (long c = 0; c < cols; c++) yr[c] += v;
		} else {
			for (long c = 0; c < cols; c++) yr[c] += b[c];
		}
	}
}

MULTI void qvd_sum_rows(float *acc, const float *x, long rows, long cols, int perRow) {
	for (long r = 0; r < rows; r++) {
		const float *xr = x + r * cols;
		if (perRow) {
			// Eight partial sums in a fixed order: vectorisable, and the same bits on every
			// machine that runs this code.
			float p[8] = {0};
			long c = 0;
			for (; c + 8 <= cols; c += 8)
				for (int l = 0; l < 8; l++) p[l] += xr[c + l];
			float s = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
			for (; c < cols; c++) s += xr[c];
			acc[r] += s;
		} else {
			for (long c = 0; c < cols; c++) acc[c] += xr[c];
		}
	}
}

#ifdef QVD_X86
// maxpool512 pools output rows of up to 16 windows: the two input rows are loaded as two
// vectors each, split into their even and odd columns, and compared in row-major order
// (strictly greater, so the first maximum wins, as the scalar code does).
__attribute__((target("avx512f"))) static void maxpool512(float *y, int32_t *idx, const float *x, long planes, long h, long w, long base) {
	const long oh = h / 2, ow = w / 2;
	const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
	const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
	const __m512i lane2 = _mm512_slli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
	for (long p = 0; p < planes; p++) {
		const float *xp = x + p * h * w;
		for (long oy = 0; oy < oh; oy++) {
			const float *r0 = xp + 2 * oy * w, *r1 = r0 + w;
			const int32_t at = (int32_t)(base + p * h * w + 2 * oy * w);
			for (long ox = 0; ox < ow; ox += 16) {
				const long n = ow - ox < 16 ? ow - ox : 16;
				const __mmask16 m = tailmask(n);
				const __mmask16 lo = tailmask(2 * n), hi = 2 * n > 16 ? tailmask(2 * n - 16) : 0;
				const long j = 2 * ox;
				__m512 a0 = _mm512_maskz_loadu_ps(lo, r0 + j), a1 = _mm512_maskz_loadu_ps(hi, r0 + j + 16);
				__m512 b0 = _mm512_maskz_loadu_ps(lo, r1 + j), b1 = _mm512_maskz_loadu_ps(hi, r1 + j + 16);
				__m512 v00 = _mm512_permutex2var_ps(a0, even, a1), v01 = _mm512_permutex2var_ps(a0, odd, a1);
				__m512 v10 = _mm512_permutex2var_ps(b0, even, b1), v11 = _mm512_permutex2var_ps(b0, odd, b1);
				__m512i base0 = _mm512_add_epi32(_mm512_set1_epi32(at + (int32_t)j), lane2);
				__m512 mx = v00;
				__m512i bi = base0;
				__mmask16 g = _mm512_cmp_ps_mask(v01, mx, _CMP_GT_OQ);
				mx = _mm512_mask_mov_ps(mx, g, v01);
				bi = _mm512_mask_add_epi32(bi, g, base0, _mm512_set1_epi32(1));
				g = _mm512_cmp_ps_mask(v10, mx, _CMP_GT_OQ);
				mx = _mm512_mask_mov_ps(mx, g, v10);
				bi = _mm512_mask_add_epi32(bi, g, base0, _mm512_set1_epi32((int32_t)w));
				g = _mm512_cmp_ps_mask(v11, mx, _CMP_GT_OQ);
				mx = _mm512_mask_mov_ps(mx, g, v11);
				bi = _mm512_mask_add_epi32(bi, g, base0, _mm512_set1_epi32((int32_t)w + 1));
				_mm512_mask_storeu_ps(y + (p * oh + oy) * ow + ox, m, mx);
				_mm512_mask_storeu_epi32(idx + (p * oh + oy) * ow + ox, m, bi);
			}
		}
	}
}
#endif

#ifdef QVD_X86
// has256 says the CPU runs AVX2.
static int has256(void) {
	static int v = -1;
	if (v < 0) v = __builtin_cpu_supports("avx2");
	return v;
}

// maxpool256 is maxpool512 for AVX2: output rows of up to 8 windows, the two input rows loaded
// as two vectors each (masked past the row's end), split into their even and odd columns, and
// compared in row-major order, strictly greater, so the first maximum wins. The scalar loop's
// branches were 5.6% of the CNN's step on a Zen 3, mispredicted on every other window.
__attribute__((target("avx2"))) static void maxpool256(float *y, int32_t *idx, const float *x, long planes, long h, long w, long base) {
	const long oh = h / 2, ow = w / 2;
	const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lane2 = _mm256_slli_epi32(lanes, 1);
	const __m256i one = _mm256_set1_epi32(1), down = _mm256_set1_epi32((int32_t)w), diag = _mm256_set1_epi32((int32_t)w + 1);
	for (long p = 0; p < planes; p++) {
		const float *xp = x + p * h * w;
		for (long oy = 0; oy < oh; oy++) {
			const float *r0 = xp + 2 * oy * w, *r1 = r0 + w;
			const int32_t at = (int32_t)(base + p * h * w + 2 * oy * w);
			for (long ox = 0; ox < ow; ox += 8) {
				const long n = ow - ox < 8 ? ow - ox : 8, j = 2 * ox;
				const __m256i mlo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(2 * n)), lanes);
				const __m256i mhi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(2 * n - 8)), lanes);
				const __m256 a0 = _mm256_maskload_ps(r0 + j, mlo), a1 = _mm256_maskload_ps(r0 + j + 8, mhi);
				const __m256 b0 = _mm256_maskload_ps(r1 + j, mlo), b1 = _mm256_maskload_ps(r1 + j + 8, mhi);
				// shuffle_ps takes lanes 0, 2 (or 1, 3) of each 128-bit half of a0 and a1: the
				// 64-bit permute puts the four halves' pairs in column order.
				const __m256 v00 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a0, a1, 0x88)), 0xD8));
				const __m256 v01 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a0, a1, 0xDD)), 0xD8));
				const __m256 v10 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(b0, b1, 0x88)), 0xD8));
				const __m256 v11 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(b0, b1, 0xDD)), 0xD8));
				const __m256i base0 = _mm256_add_epi32(_mm256_set1_epi32(at + (int32_t)j), lane2);
				__m256 mx = v00, g;
				__m256i bi = base0;
				g = _mm256_cmp_ps(v01, mx, _CMP_GT_OQ);
				mx = _mm256_blendv_ps(mx, v01, g);
				bi = _mm256_blendv_epi8(bi, _mm256_add_epi32(base0, one), _mm256_castps_si256(g));
				g = _mm256_cmp_ps(v10, mx, _CMP_GT_OQ);
				mx = _mm256_blendv_ps(mx, v10, g);
				bi = _mm256_blendv_epi8(bi, _mm256_add_epi32(base0, down), _mm256_castps_si256(g));
				g = _mm256_cmp_ps(v11, mx, _CMP_GT_OQ);
				mx = _mm256_blendv_ps(mx, v11, g);
				bi = _mm256_blendv_epi8(bi, _mm256_add_epi32(base0, diag), _mm256_castps_si256(g));
				float *yo = y + (p * oh + oy) * ow + ox;
				int32_t *io = idx + (p * oh + oy) * ow + ox;
				if (n == 8) {
					_mm256_storeu_ps(yo, mx);
					_mm256_storeu_si256((__m256i *)io, bi);
				} else {
					const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes);
					_mm256_maskstore_ps(yo, m, mx);
					_mm256_maskstore_epi32(io, m, bi);
				}
			}
		}
	}
}
#endif

void qvd_maxpool2(float *y, int32_t *idx, const float *x, long planes, long h, long w, long base) {
#ifdef QVD_X86
	if (has512()) {
		maxpool512(y, idx, x, planes, h, w, base);
		return;
	}
	if (has256()) {
		maxpool256(y, idx, x, planes, h, w, base);
		return;
	}
#endif
	const long oh = h / 2, ow = w / 2;
	for (long p = 0; p < planes; p++) {
		const float *xp = x + p * h * w;
		for (long oy = 0; oy < oh; oy++) {
			const float *r0 = xp + 2 * oy * w, *r1 = r0 + w;
			float *yo = y + (p * oh + oy) * ow;
			int32_t *io = idx + (p * oh + oy) * ow;
			const int32_t at = (int32_t)(base + p * h * w + 2 * oy * w);
			for (long ox = 0; ox < ow; ox++) {
				const long j = 2 * ox;
				float m = r0[j];
				int32_t b = at + (int32_t)j;
				if (r0[j + 1] > m) m = r0[j + 1], b = at + (int32_t)j + 1;
				if (r1[j] > m) m = r1[j], b = at + (int32_t)(w + j);
				if (r1[j + 1] > m) m = r1[j + 1], b = at + (int32_t)(w + j + 1);
				yo[ox] = m;
				io[ox] = b;
			}
		}
	}
}

long qvd_maxpool2_grad(float *dx, long ndx, const float *dy, const int32_t *idx, long n) {
	for (long i = 0; i < n; i++) {
		const int32_t j = idx[i];
		if (j < 0 || j >= ndx) return i;
		dx[j] = dy[i];
	}
	return -1;
}

long qvd_softmax_xent(float *d, float *loss, const float *z, const int32_t *labels, long rows,
                      long classes, float scale) {
	for (long r = 0; r < rows; r++) {
		const float *zr = z + r * classes;
		float *dr = d + r * classes;
		const long y = labels[r];
		if (y < 0 || y >= classes) return r;
		float m = zr[0];
		for (long c = 1; c < classes; c++) m = zr[c] > m ? zr[c] : m;
		double sum = 0;
		for (long c = 0; c < classes; c++) sum += exp((double)(zr[c] - m));
		const float lse = m + (float)log(sum);
		loss[r] = lse - zr[y];
		for (long c = 0; c < classes; c++) {
			float p = (float)exp((double)(zr[c] - lse));
			if (c == y) p -= 1;
			dr[c] = p * scale;
		}
	}
	return -1;
}

void qvd_transpose01(float *dst, const float *src, long a, long b, long r) {
	for (long i = 0; i < a; i++)
		for (long j = 0; j < b; j++) memcpy(dst + (j * a + i) * r, src + (i * b + j) * r, (size_t)r * sizeof(float));
}

MULTI int qvd_unscale_check(float *g, long n, float s) {
	int bad = 0;
	for (long i = 0; i < n; i++) {
		const float v = g[i];
		bad |= (v - v) != 0; // Inf − Inf and NaN − NaN are NaN; finite − itself is 0
		g[i] = v * s;
	}
	return bad;
}
