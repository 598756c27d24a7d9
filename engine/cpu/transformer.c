#include "transformer.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

// Each kernel's body is an always-inline function compiled twice: for AVX2 with FMA (picked at
// load time where the CPU has both) and for baseline x86-64 (elsewhere: plain C). The bodies are
// branch-free loops GCC vectorises, with exp and erfc of their own (below) instead of libm's
// scalar calls. Which version runs depends only on the CPU, so every piece of a pass, on any
// thread, computes an element the same way.
#define BODY static inline __attribute__((always_inline))

// Floating-point exceptions are never read, so the selects below (v < 0 ? a : b, the mask of a
// dropout) may compute both sides: that lets GCC turn them into vector blends.
#pragma GCC optimize("no-trapping-math")

#if defined(__x86_64__) && defined(__GNUC__)
static int fast_ok;
__attribute__((constructor)) static void detect(void) {
	__builtin_cpu_init();
	fast_ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#define DISPATCH(name, params, args)                                                        \
	__attribute__((target("avx2,fma"))) static void name##_fast params { name##_body args; } \
	static void name##_base params { name##_body args; }                                    \
	void qvd_##name params {                                                                \
		if (fast_ok)                                                                        \
			name##_fast args;                                                               \
		else                                                                                \
			name##_base args;                                                               \
	}
#else
#define DISPATCH(name, params, args) \
	void qvd_##name params { name##_body args; }
#endif

// ---- Reductions: eight float64 partial sums, combined in a fixed order ----

BODY double combine8(const double p[8]) {
	return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

// Σ x[i].
BODY double sum_d(const float *x, long n) {
	double p[8] = {0};
	long i = 0;
	for (; i + 8 <= n; i += 8)
		for (int l = 0; l < 8; l++) p[l] += (double)x[i + l];
	double s = combine8(p);
	for (; i < n; i++) s += (double)x[i];
	return s;
}

// Σ (x[i] − mu)².
BODY double sumsq_d(const float *x, long n, double mu) {
	double p[8] = {0};
	long i = 0;
	for (; i + 8 <= n; i += 8)
		for (int l = 0; l < 8; l++) {
			const double d = (double)x[i + l] - mu;
			p[l] += d * d;
		}
	double s = combine8(p);
	for (; i < n; i++) {
		const double d = (double)x[i] - mu;
		s += d * d;
	}
	return s;
}

// Σ a[i]·b[i] (each product exact in float64).
BODY double dot_d(const float *a, const float *b, long n) {
	double p[8] = {0};
	long i = 0;
	for (; i + 8 <= n; i += 8)
		for (int l = 0; l < 8; l++) p[l] += (double)a[i + l] * (double)b[i + l];
	double s = combine8(p);
	for (; i < n; i++) s += (double)a[i] * (double)b[i];
	return s;
}

// ---- Elementary functions ----

// exp(x) for x ≤ 0 (and small positive x), within an ulp: x = n·ln2 + r, |r| ≤ ln2/2, exp(r)
// by its degree-7 Taylor polynomial (truncation below 0.1 ulp), times 2ⁿ built in the exponent
// bits. Below −87.34 (2⁻¹²⁶) it returns 0; a NaN stays NaN.
BODY float expneg(float x) {
	const float lo = -87.33654f;
	const float xc = x < lo ? lo : x;
	const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; // round(x/ln2)
	float r = xc - n * 0.693145751953125f;                                 // ln2's leading bits: n·them is exact
	r = r - n * 1.428606765330187045e-06f;
	float p = 1.0f / 5040;
	p = p * r + 1.0f / 720;
	p = p * r + 1.0f / 120;
	p = p * r + 1.0f / 24;
	p = p * r + 1.0f / 6;
	p = p * r + 0.5f;
	p = p * r + 1.0f;
	p = p * r + 1.0f;
	const int32_t e = ((int32_t)n + 127) << 23;
	float s;
	memcpy(&s, &e, sizeof s);
	return x < lo ? 0.0f : p * s;
}

// erfc(z) for z ≥ 0 with a relative error of a few ulps (plus that of exp's argument, −z²):
// Numerical Recipes' Chebyshev fit, t·exp(−z² + P(t)), t = 1/(1 + z/2), whose own error is
// below 1.2e-7 everywhere.
BODY float erfc_pos(float z) {
	const float t = 1.0f / (1.0f + 0.5f * z);
	float p = 0.17087277f;
	p = p * t - 0.82215223f;
	p = p * t + 1.48851587f;
	p = p * t - 1.13520398f;
	p = p * t + 0.27886807f;
	p = p * t - 0.18628806f;
	p = p * t + 0.09678418f;
	p = p * t + 0.37409196f;
	p = p * t + 1.00002368f;
	p = p * t - 1.26551223f;
	return t * expneg(p - z * z);
}

// Φ(v), the standard normal CDF: erfc(|v|/√2)/2 on the negative side, one minus it on the
// positive (relatively accurate far into the lower tail, where 1 + erf cancels).
BODY float gauss_cdf(float v) {
	const float e = 0.5f * erfc_pos(fabsf(v) * 0.70710678118654752f);
	return v < 0 ? e : 1.0f - e;
}

// ---- Element-wise kernels ----

BODY void axpby_body(float *y, const float *x, long n, float a, float b) {
	if (b == 0) {
		for (long i = 0; i < n; i++) y[i] = a * x[i];
		return;
	}
	for (long i = 0; i < n; i++) y[i] = a * x[i] + b * y[i];
}
DISPATCH(axpby, (float *y, const float *x, long n, float a, float b), (y, x, n, a, b))

BODY void gelu_body(float *y, const float *x, long n) {
	for (long i = 0; i < n; i++) {
		const float v = x[i];
		y[i] = v * gauss_cdf(v);
	}
}
DISPATCH(gelu, (float *y, const float *x, long n), (y, x, n))

BODY void gelu_grad_body(float *dx, const float *dy, const float *x, long n) {
	for (long i = 0; i < n; i++) {
		const float v = x[i];
		const float pdf = 0.3989422804014327f * expneg(-0.5f * v * v);
		dx[i] = dy[i] * (gauss_cdf(v) + v * pdf);
	}
}
DISPATCH(gelu_grad, (float *dx, const float *dy, const float *x, long n), (dx, dy, x, n))

// The mask is engine.DropoutKeep: SplitMix64 of (seed, index) as a 24-bit fraction against p.
BODY void dropout_body(float *y, const float *x, long n, float p, uint64_t seed, uint64_t base) {
	const float q = 1.0f - p;
	for (long i = 0; i < n; i++) {
		uint64_t z = seed + (base + (uint64_t)i + 1) * 0x9E3779B97F4A7C15ull;
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
		z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
		z ^= z >> 31;
		const float f = (float)(int32_t)(z >> 40) * (1.0f / 16777216.0f);
		y[i] = f >= p ? x[i] / q : 0.0f;
	}
}
DISPATCH(dropout, (float *y, const float *x, long n, float p, uint64_t seed, uint64_t base), (y, x, n, p, seed, base))

// ---- Row kernels ----

BODY void softmax_body(float *y, const float *x, long rows, long cols, float scale) {
	for (long r = 0; r < rows; r++) {
		const float *xr = x + r * cols;
		float *yr = y + r * cols;
		float m = scale * xr[0];
		for (long c = 1; c < cols; c++) {
			const float v = scale * xr[c];
			m = v > m ? v : m;
		}
		for (long c = 0; c < cols; c++) yr[c] = expneg(scale * xr[c] - m);
		const float inv = (float)(1.0 / sum_d(yr, cols));
		for (long c = 0; c < cols; c++) yr[c] *= inv;
	}
}
DISPATCH(softmax, (float *y, const float *x, long rows, long cols, float scale), (y, x, rows, cols, scale))

BODY void softmax_grad_body(float *dx, const float *dy, const float *y, long rows, long cols, float scale) {
	for (long r = 0; r < rows; r++) {
		const float *dyr = dy + r * cols, *yr = y + r * cols;
		float *dxr = dx + r * cols;
		const float dot = (float)dot_d(dyr, yr, cols);
		for (long c = 0; c < cols; c++) dxr[c] = scale * yr[c] * (dyr[c] - dot);
	}
}
DISPATCH(softmax_grad, (float *dx, const float *dy, const float *y, long rows, long cols, float scale),
         (dx, dy, y, rows, cols, scale))

BODY void layernorm_body(float *y, float *mean, float *rstd, const float *x, const float *gamma, const float *beta,
                         long rows, long cols, float eps) {
	for (long r = 0; r < rows; r++) {
		const float *xr = x + r * cols;
		float *yr = y + r * cols;
		const double mu = sum_d(xr, cols) / (double)cols;
		const double var = sumsq_d(xr, cols, mu) / (double)cols;
		const float mf = (float)mu, rf = (float)(1.0 / sqrt(var + (double)eps));
		mean[r] = mf;
		rstd[r] = rf;
		for (long c = 0; c < cols; c++) yr[c] = (xr[c] - mf) * rf * gamma[c] + beta[c];
	}
}
DISPATCH(layernorm,
         (float *y, float *mean, float *rstd, const float *x, const float *gamma, const float *beta, long rows, long cols, float eps),
         (y, mean, rstd, x, gamma, beta, rows, cols, eps))

// BLK is the block of a row the backward passes hold x̂ (and dy·gamma) for, on the stack.
enum { BLK = 256 };

BODY void layernorm_bwd_body(float *dx, double *dg, double *db, const float *dy, const float *x, const float *mean,
                             const float *rstd, const float *gamma, long rows, long cols) {
	float g[BLK], xh[BLK];
	for (long r = 0; r < rows; r++) {
		const float *dyr = dy + r * cols, *xr = x + r * cols;
		const float mf = mean[r], rf = rstd[r];
		// Every sum first: dx may be dy.
		double s1 = 0, s2 = 0;
		for (long c0 = 0; c0 < cols; c0 += BLK) {
			const long nb = cols - c0 < BLK ? cols - c0 : BLK;
			for (long c = 0; c < nb; c++) {
				xh[c] = (xr[c0 + c] - mf) * rf;
				g[c] = dyr[c0 + c] * gamma[c0 + c];
			}
			if (dg)
				for (long c = 0; c < nb; c++) dg[c0 + c] += (double)dyr[c0 + c] * (double)xh[c];
			if (db)
				for (long c = 0; c < nb; c++) db[c0 + c] += (double)dyr[c0 + c];
			if (dx) {
				s1 += sum_d(g, nb);
				s2 += dot_d(g, xh, nb);
			}
		}
		if (!dx) continue;
		const float m1 = (float)(s1 / (double)cols), m2 = (float)(s2 / (double)cols);
		float *dxr = dx + r * cols;
		for (long c = 0; c < cols; c++) dxr[c] = rf * (dyr[c] * gamma[c] - m1 - (xr[c] - mf) * rf * m2);
	}
}
DISPATCH(layernorm_bwd,
         (float *dx, double *dg, double *db, const float *dy, const float *x, const float *mean, const float *rstd,
          const float *gamma, long rows, long cols),
         (dx, dg, db, dy, x, mean, rstd, gamma, rows, cols))

// ---- Channel kernels (NCHW) ----

BODY void batchnorm_body(float *y, float *mean, float *rstd, const float *x, const float *gamma, const float *beta,
                         long n, long c, long hw, long c0, long c1, float eps, int train) {
	for (long ch = c0; ch < c1; ch++) {
		if (train) {
			double s = 0;
			for (long i = 0; i < n; i++) s += sum_d(x + (i * c + ch) * hw, hw);
			const double mu = s / (double)(n * hw > 0 ? n * hw : 1);
			double q = 0;
			for (long i = 0; i < n; i++) q += sumsq_d(x + (i * c + ch) * hw, hw, mu);
			const double var = q / (double)(n * hw > 0 ? n * hw : 1);
			mean[ch] = (float)mu;
			rstd[ch] = (float)(1.0 / sqrt(var + (double)eps));
		}
		const float mf = mean[ch], rf = rstd[ch], g = gamma[ch], b = beta[ch];
		for (long i = 0; i < n; i++) {
			const float *xs = x + (i * c + ch) * hw;
			float *ys = y + (i * c + ch) * hw;
			for (long j = 0; j < hw; j++) ys[j] = (xs[j] - mf) * rf * g + b;
		}
	}
}
DISPATCH(batchnorm,
         (float *y, float *mean, float *rstd, const float *x, const float *gamma, const float *beta, long n, long c, long hw,
          long c0, long c1, float eps, int train),
         (y, mean, rstd, x, gamma, beta, n, c, hw, c0, c1, eps, train))

BODY void batchnorm_bwd_body(float *dx, double *sums, const float *dy, const float *x, const float *mean, const float *rstd,
                             const float *gamma, long n, long c, long hw, long c0, long c1) {
	float xh[BLK];
	for (long ch = c0; ch < c1; ch++) {
		const float mf = mean[ch], rf = rstd[ch];
		double s1 = 0, s2 = 0;
		for (long i = 0; i < n; i++) {
			const float *dys = dy + (i * c + ch) * hw, *xs = x + (i * c + ch) * hw;
			for (long j0 = 0; j0 < hw; j0 += BLK) {
				const long nb = hw - j0 < BLK ? hw - j0 : BLK;
				for (long j = 0; j < nb; j++) xh[j] = (xs[j0 + j] - mf) * rf;
				s1 += sum_d(dys + j0, nb);
				s2 += dot_d(dys + j0, xh, nb);
			}
		}
		sums[ch] = s1;
		sums[c + ch] = s2;
		if (!dx) continue;
		const double count = (double)(n * hw > 0 ? n * hw : 1);
		const float m1 = (float)(s1 / count), m2 = (float)(s2 / count), gr = gamma[ch] * rf;
		for (long i = 0; i < n; i++) {
			const float *dys = dy + (i * c + ch) * hw, *xs = x + (i * c + ch) * hw;
			float *dxs = dx + (i * c + ch) * hw;
			for (long j = 0; j < hw; j++) dxs[j] = gr * (dys[j] - m1 - (xs[j] - mf) * rf * m2);
		}
	}
}
DISPATCH(batchnorm_bwd,
         (float *dx, double *sums, const float *dy, const float *x, const float *mean, const float *rstd, const float *gamma,
          long n, long c, long hw, long c0, long c1),
         (dx, sums, dy, x, mean, rstd, gamma, n, c, hw, c0, c1))

// ---- Batches of products (attention) ----

void qvd_gemm_batch(int transA, int transB, long m, long n, long k, float alpha, const float *a, long lda, long strideA,
                    const float *b, long ldb, long strideB, float beta, float *c, long ldc, long strideC, long count) {
	for (long i = 0; i < count; i++)
		cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans, (blasint)m,
		            (blasint)n, (blasint)k, alpha, a + i * strideA, (blasint)lda, b + i * strideB, (blasint)ldb, beta,
		            c + i * strideC, (blasint)ldc);
}
