package enginetest

// The operations of transformer layers (and BatchNorm): GemmBatched, Axpby, CopyRows,
// LayerNorm, GELU, Dropout, Softmax, Patchify and BatchNorm with their backward passes, each
// checked against its definition computed in float64 from the values the device holds, with
// tolerances that bound an fp32 computation's error (as the rest of the suite does), never one
// backend's particular rounding. The backward passes are also checked against central finite
// differences of a float64 forward pass.

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// ---- GemmBatched ----

// batchedCase is one GemmBatched call: batch products of gemmCase's shape (its lda, ldb and
// ldc are the leading dimensions, each at least its stored row length), the i-th reading and
// writing the matrices that start i·stride elements into the views.
type batchedCase struct {
	gemmCase
	strideA, strideB, strideC, batch int
	layout                           string
}

func (g batchedCase) String() string {
	return fmt.Sprintf("%v batch %d %s (strides %d, %d, %d; ld %d, %d, %d)", g.gemmCase, g.batch, g.layout,
		g.strideA, g.strideB, g.strideC, g.lda, g.ldb, g.ldc)
}

// batchedExtent is the length of a view of batch rows×cols matrices whose rows lie ld apart,
// the i-th starting i·stride in: what GemmBatched's views must cover.
func batchedExtent(batch, stride, rows, cols, ld int) int {
	if batch == 0 {
		return 0
	}
	return (batch-1)*stride + stridedLen(rows, cols, ld)
}

// batchedCover marks the elements of a view that belong to one of its batch matrices.
func batchedCover(batch, stride, rows, cols, ld int) []bool {
	in := make([]bool, batchedExtent(batch, stride, rows, cols, ld))
	for i := range batch {
		for r := range rows {
			for c := range cols {
				in[i*stride+r*ld+c] = true
			}
		}
	}
	return in
}

// batchedOperand allocates a view of batch matrices (see batchedExtent), their elements set
// from vals (N(0, 1) draws when nil) and every other element to gap; it returns the view and
// what it holds.
func (h *harness) batchedOperand(batch, stride, rows, cols, ld int, t engine.DType, gap float32, vals func(int) []float32) (engine.Buf, []float32) {
	h.t.Helper()
	in := batchedCover(batch, stride, rows, cols, ld)
	var fill []float32
	if vals != nil {
		fill = vals(len(in))
	} else {
		fill = h.normal(len(in), 1)
	}
	for i := range fill {
		if !in[i] {
			fill[i] = gap
		}
	}
	b := h.alloc(len(in), t)
	return b, h.put(b, fill)
}

// runGemmBatched runs one case on fresh buffers and checks every product, and that the
// elements of C outside them (gaps, other heads' columns) are not written.
func (h *harness) runGemmBatched(g batchedCase, cInit func(int) []float32) {
	h.t.Helper()
	ar, ac := stored(g.m, g.k, g.transA)
	br, bc := stored(g.k, g.n, g.transB)
	nan := float32(math.NaN())
	a, A := h.batchedOperand(g.batch, g.strideA, ar, ac, g.lda, g.ab, nan, nil)
	b, B := h.batchedOperand(g.batch, g.strideB, br, bc, g.ldb, g.ab, nan, nil)
	c, C0 := h.batchedOperand(g.batch, g.strideC, g.m, g.n, g.ldc, g.c, gapValue, cInit)
	h.d.GemmBatched(g.transA, g.transB, g.m, g.n, g.k, g.alpha, a, g.lda, g.strideA, b, g.ldb, g.strideB,
		g.beta, c, g.ldc, g.strideC, g.batch)
	got := h.get(c)
	written := batchedCover(g.batch, g.strideC, g.m, g.n, g.ldc)
	gaps := h.check("gemm_batched %v: elements of C outside the products", g)
	for i, w := range written {
		if !w && got[i] != gapValue {
			gaps.add("element %d is %v", i, got[i])
		}
	}
	gaps.done()
	var gotC []float32
	var want, mag []float64
	for i := range g.batch {
		at := func(r, p int) float64 {
			if g.transA {
				return float64(A[i*g.strideA+p*g.lda+r])
			}
			return float64(A[i*g.strideA+r*g.lda+p])
		}
		bt := func(p, j int) float64 {
			if g.transB {
				return float64(B[i*g.strideB+j*g.ldb+p])
			}
			return float64(B[i*g.strideB+p*g.ldb+j])
		}
		for r := range g.m {
			for j := range g.n {
				var s, sa float64
				for p := range g.k {
					v := at(r, p) * bt(p, j)
					s += v
					sa += math.Abs(v)
				}
				o := i*g.strideC + r*g.ldc + j
				w, mg := float64(g.alpha)*s, math.Abs(float64(g.alpha))*sa
				if g.beta != 0 {
					w += float64(g.beta) * float64(C0[o])
					mg += math.Abs(float64(g.beta) * float64(C0[o]))
				}
				gotC = append(gotC, got[o])
				want = append(want, w)
				mag = append(mag, mg)
			}
		}
	}
	h.near(fmt.Sprintf("gemm_batched %v", g), g.c, gotC, want, mag, g.k+1)
}

// batchedLayouts are the ways GemmBatched's matrices lie: one after the other, one A (or B)
// for every product (stride 0), rows and matrices with gaps between them, and interleaved as
// attention heads are (the i-th matrix is columns [i·cols, (i+1)·cols) of a wider one, so the
// products' extents overlap while their elements do not).
var batchedLayouts = []string{"contiguous", "shared A", "shared B", "padded", "interleaved"}

// batchedLayout fills in a case's leading dimensions and strides for a layout.
func batchedLayout(g batchedCase, layout string) batchedCase {
	ar, ac := stored(g.m, g.k, g.transA)
	br, bc := stored(g.k, g.n, g.transB)
	g.layout = layout
	g.lda, g.ldb, g.ldc = max(ac, 1), max(bc, 1), max(g.n, 1)
	g.strideA, g.strideB, g.strideC = ar*ac, br*bc, g.m*g.n
	switch layout {
	case "shared A":
		g.strideA = 0
	case "shared B":
		g.strideB = 0
	case "padded":
		g.lda, g.ldb, g.ldc = ac+3, bc+1, g.n+2
		g.strideA = stridedLen(ar, ac, g.lda) + 5
		g.strideB = stridedLen(br, bc, g.ldb) + 1
		g.strideC = stridedLen(g.m, g.n, g.ldc) + 3
	case "interleaved":
		g.lda, g.ldb, g.ldc = max(g.batch*ac, 1), max(g.batch*bc, 1), max(g.batch*g.n, 1)
		g.strideA, g.strideB, g.strideC = ac, bc, g.n
	}
	g.strideC = max(g.strideC, 1)
	return g
}

// TestGemmBatched checks GemmBatched in every layout, transpose combination and type pair,
// with beta 0 (C full of NaN, not read), 1 and 0.5; many small products (attention's shapes)
// and a few large ones, which a backend may split differently.
func TestGemmBatched(t *testing.T, newDevice NewDevice) {
	for _, ty := range gemmTypes {
		t.Run(ty[0].String()+"-"+ty[1].String(), func(t *testing.T) {
			h := newHarness(t, newDevice)
			i := 0
			for _, s := range [][4]int{{1, 1, 1, 1}, {17, 17, 16, 3}, {17, 16, 17, 4}, {5, 3, 7, 6}, {2, 9, 1, 2}} {
				for tr := range 4 {
					for _, layout := range batchedLayouts {
						beta := []float32{0, 1, 0.5}[i%3]
						alpha := []float32{1, -0.75, 0.125}[(i/3)%3]
						i++
						g := batchedCase{gemmCase: gemmCase{transA: tr&1 != 0, transB: tr&2 != 0, m: s[0], n: s[1], k: s[2],
							alpha: alpha, beta: beta, ab: ty[0], c: ty[1]}, batch: s[3]}
						h.runGemmBatched(batchedLayout(g, layout), h.cInit(beta))
					}
				}
			}
			// m, n, k, batch, transposes, beta: large products, many small ones, and middling
			// ones (a backend may compute each kind its own way).
			for _, s := range [][6]int{{128, 64, 128, 2, 3, 1}, {16, 16, 32, 200, 1, 0}, {17, 17, 32, 64, 2, 1},
				{40, 70, 100, 3, 1, 1}} {
				beta := float32(s[5])
				g := batchedCase{gemmCase: gemmCase{transA: s[4]&1 != 0, transB: s[4]&2 != 0, m: s[0], n: s[1], k: s[2],
					alpha: 0.5, beta: beta, ab: ty[0], c: ty[1]}, batch: s[3]}
				h.runGemmBatched(batchedLayout(g, "contiguous"), h.cInit(beta))
			}
		})
	}
}

// TestGemmBatchedEmpty checks the degenerate calls: no products (nothing is written), and
// products with k = 0 (C = beta·C, zeros for beta 0 whatever C held) or m = 0.
func TestGemmBatchedEmpty(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, ty := range gemmTypes {
		for _, s := range [][4]int{{3, 4, 2, 0}, {3, 4, 0, 3}, {0, 4, 3, 2}, {1, 1, 0, 1}} {
			for tr := range 4 {
				for _, beta := range []float32{0, 1, -2} {
					for _, layout := range []string{"contiguous", "padded"} {
						g := batchedCase{gemmCase: gemmCase{transA: tr&1 != 0, transB: tr&2 != 0, m: s[0], n: s[1], k: s[2],
							alpha: 1, beta: beta, ab: ty[0], c: ty[1]}, batch: s[3]}
						g = batchedLayout(g, layout)
						h.runGemmBatched(g, h.cInit(beta))
						h.sync(g.String())
					}
				}
			}
		}
	}
}

// ---- Axpby, CopyRows ----

// TestAxpby checks Axpby into another buffer (b 0 on a y full of NaN, which must not be read)
// and in place (x is y).
func TestAxpby(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 1000, 40000} {
			for _, ab := range [][2]float32{{1, 1}, {0.25, 0}, {-1.5, 0.5}} {
				a, b := ab[0], ab[1]
				x, X := h.random(n, dt, 1)
				y := h.alloc(n, dt)
				Y := h.put(y, h.cInit(b)(n))
				h.d.Axpby(y, x, a, b)
				want, mag := make([]float64, n), make([]float64, n)
				for i := range want {
					want[i] = float64(a) * float64(X[i])
					mag[i] = math.Abs(want[i])
					if b != 0 {
						want[i] += float64(b) * float64(Y[i])
						mag[i] += math.Abs(float64(b) * float64(Y[i]))
					}
				}
				h.near(fmt.Sprintf("%v axpby of %d, a %v, b %v", dt, n, a, b), dt, h.get(y), want, mag, 2)
				h.exact(fmt.Sprintf("%v axpby of %d: its input", dt, n), h.get(x), X)
			}
			for _, ab := range [][2]float32{{0.5, 1}, {0.125, 0}} {
				a, b := ab[0], ab[1]
				y, Y := h.random(n, dt, 1)
				h.d.Axpby(y, y, a, b)
				want, mag := make([]float64, n), make([]float64, n)
				for i, v := range Y {
					want[i] = float64(a+b) * float64(v)
					mag[i] = math.Abs(float64(a)*float64(v)) + math.Abs(float64(b)*float64(v))
				}
				h.near(fmt.Sprintf("%v axpby of %d in place, a %v, b %v", dt, n, a, b), dt, h.get(y), want, mag, 2)
			}
		}
	}
}

// TestCopyRows checks CopyRows between every pair of types: contiguous and strided rows (the
// gaps of src hold NaN, never read; those of dst a value that must survive), and ldSrc 0,
// which repeats src's first row.
func TestCopyRows(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dst := range FloatTypes {
		for _, src := range FloatTypes {
			for _, s := range [][4]int{{1, 1, 1, 1}, {4, 7, 7, 7}, {4, 7, 9, 10}, {5, 33, 40, 0}, {64, 8, 8, 0}, {0, 5, 5, 5}, {17, 64, 192, 70}} {
				rows, cols, ldd, lds := s[0], s[1], s[2], s[3]
				var sb engine.Buf
				var S []float32
				if lds == 0 {
					sb, S = h.strided(1, cols, cols, src, 0, nil)
				} else {
					sb, S = h.strided(rows, cols, lds, src, float32(math.NaN()), nil)
				}
				db, D := h.strided(rows, cols, ldd, dst, gapValue, nans(rows*cols))
				h.d.CopyRows(db, ldd, sb, lds, rows, cols)
				want := append([]float32(nil), D...)
				for r := range rows {
					for c := range cols {
						want[r*ldd+c] = roundTo(dst, S[r*lds+c])
					}
				}
				h.exact(fmt.Sprintf("copy_rows %dx%d %v (ld %d) into %v (ld %d)", rows, cols, src, lds, dst, ldd), h.get(db), want)
			}
		}
	}
}

// ---- LayerNorm, BatchNorm ----

// normGroup is the float64 statistics of one normalised group (a row of a layer norm, a
// channel of a batch norm).
type normGroup struct {
	mu, rs  float64 // mean, 1/sqrt(σ² + eps)
	absMean float64 // mean |x|: the scale of the mean's rounding error
	// q is E[x²]/(σ² + eps): how much larger than σ² the error of an fp32 variance may be
	// (a one-pass E[x²] − μ² loses that much to cancellation; a two-pass one does better).
	q float64
}

func groupStats(x []float64, eps float64) normGroup {
	n := float64(len(x))
	var s, sa, s2 float64
	for _, v := range x {
		s += v
		sa += math.Abs(v)
		s2 += v * v
	}
	mu := s / n
	var q float64
	for _, v := range x {
		q += (v - mu) * (v - mu)
	}
	vr := q / n
	return normGroup{mu: mu, rs: 1 / math.Sqrt(vr+eps), absMean: sa / n, q: (s2 / n) / (vr + eps)}
}

// normProblem is a normalisation (layer norm or batch norm) in float64: x in groups, element
// i of group g at flat index groups[g][i], scaled by gamma[param(index)] and shifted by
// beta[param(index)].
type normProblem struct {
	x, gamma, beta, dy []float64
	groups             [][]int
	param              func(i int) int
	eps                float64
}

// normResult is a normalisation's forward and backward passes in float64 (the backward with
// b 0), each output with the magnitudes its fp32 computation's error scales with.
type normResult struct {
	st                                     []normGroup
	mean, meanMag, rstd, rstdMag           []float64 // per group
	y, yMag                                []float64
	dx, dxMag, dgamma, dgMag, dbeta, dbMag []float64
}

func (p *normProblem) forward() (y []float64) {
	y = make([]float64, len(p.x))
	for _, idx := range p.groups {
		xs := make([]float64, len(idx))
		for j, i := range idx {
			xs[j] = p.x[i]
		}
		st := groupStats(xs, p.eps)
		for _, i := range idx {
			y[i] = (p.x[i]-st.mu)*st.rs*p.gamma[p.param(i)] + p.beta[p.param(i)]
		}
	}
	return y
}

// loss is Σ dy·y: its gradients are the backward pass's results.
func (p *normProblem) loss() float64 {
	var l float64
	for i, v := range p.forward() {
		l += p.dy[i] * v
	}
	return l
}

func (p *normProblem) solve() normResult {
	np := len(p.gamma)
	ng := len(p.groups)
	r := normResult{st: make([]normGroup, ng), mean: make([]float64, ng), meanMag: make([]float64, ng),
		rstd: make([]float64, ng), rstdMag: make([]float64, ng),
		y: make([]float64, len(p.x)), yMag: make([]float64, len(p.x)), dx: make([]float64, len(p.x)), dxMag: make([]float64, len(p.x)),
		dgamma: make([]float64, np), dgMag: make([]float64, np), dbeta: make([]float64, np), dbMag: make([]float64, np)}
	for g, idx := range p.groups {
		xs := make([]float64, len(idx))
		for j, i := range idx {
			xs[j] = p.x[i]
		}
		st := groupStats(xs, p.eps)
		r.st[g] = st
		r.mean[g], r.meanMag[g] = st.mu, st.absMean
		r.rstd[g], r.rstdMag[g] = st.rs, st.rs*(1+st.q)
		n := float64(len(idx))
		xh := make([]float64, len(idx)) // x̂
		ex := make([]float64, len(idx)) // the scale of x̂'s error
		var m1, m2, mg, mgx float64
		for j, i := range idx {
			pi := p.param(i)
			xh[j] = (p.x[i] - st.mu) * st.rs
			ex[j] = st.rs*(math.Abs(p.x[i])+st.absMean) + math.Abs(xh[j])*st.q
			r.y[i] = xh[j]*p.gamma[pi] + p.beta[pi]
			r.yMag[i] = math.Abs(p.gamma[pi])*(math.Abs(xh[j])+ex[j]) + math.Abs(p.beta[pi])
			g := p.dy[i] * p.gamma[pi]
			m1 += g / n
			m2 += g * xh[j] / n
			mg += math.Abs(g) / n
			mgx += math.Abs(g) * (math.Abs(xh[j]) + ex[j]) / n
			r.dgamma[pi] += p.dy[i] * xh[j]
			r.dgMag[pi] += math.Abs(p.dy[i]) * (math.Abs(xh[j]) + ex[j])
			r.dbeta[pi] += p.dy[i]
			r.dbMag[pi] += math.Abs(p.dy[i])
		}
		for j, i := range idx {
			g := p.dy[i] * p.gamma[p.param(i)]
			r.dx[i] = st.rs * (g - m1 - xh[j]*m2)
			r.dxMag[i] = st.rs * (1 + st.q) * (math.Abs(g) + mg + (math.Abs(xh[j])+ex[j])*mgx)
		}
	}
	return r
}

// fdGrad is ∂f/∂v[i] for every i, by the five-point central difference (its error is of
// order step⁴ times f's fifth derivative: far below an fp32 computation's).
func fdGrad(v []float64, f func() float64, step float64) []float64 {
	g := make([]float64, len(v))
	for i := range v {
		v0 := v[i]
		d := step * max(1, math.Abs(v0))
		at := func(x float64) float64 {
			v[i] = x
			return f()
		}
		g[i] = (-at(v0+2*d) + 8*at(v0+d) - 8*at(v0-d) + at(v0-2*d)) / (12 * d)
		v[i] = v0
	}
	return g
}

// fdLimit is the most elements a problem is differentiated numerically for (each partial
// derivative costs four forward passes).
const fdLimit = 600

// finiteDifferences replaces r's gradients by the finite differences of p's loss: the check
// of the backward pass against the forward pass's definition, not against another formula.
func (p *normProblem) finiteDifferences(r *normResult) {
	r.dx = fdGrad(p.x, p.loss, 1e-3)
	r.dgamma = fdGrad(p.gamma, p.loss, 1e-3)
	r.dbeta = fdGrad(p.beta, p.loss, 1e-3)
}

// normInput returns rows groups of cols values, each group with its own offset and scale
// (the offsets make a one-pass variance lose digits).
func (h *harness) normInput(groups, per int) []float32 {
	x := make([]float32, groups*per)
	for g := range groups {
		off := h.rng.NormFloat64()
		sc := math.Exp2(h.rng.Float64()*4 - 2)
		for i := range per {
			x[g*per+i] = float32(off + sc*h.rng.NormFloat64())
		}
	}
	return x
}

// affine returns gamma ~ N(1, 0.5²) and beta ~ N(0, 0.5²) draws.
func (h *harness) affine(n int) (gamma, beta []float32) {
	gamma, beta = h.normal(n, 0.5), h.normal(n, 0.5)
	for i := range gamma {
		gamma[i]++
	}
	return gamma, beta
}

// normBackwardCheck runs the checks both normalisations share: their backward pass for every
// subset of dx, dgamma and dbeta, b 0 (the parameter gradients full of NaN, not read) and 1,
// and dx in place of dy with b 0.5. run calls the device's backward pass; dxTerms and dpTerms
// are the numbers of fp32 operations dx and the parameter gradients accumulate.
func (h *harness) normBackwardCheck(what string, dt engine.DType, r normResult, dy engine.Buf, DY []float32, nparams, dxTerms, dpTerms int,
	run func(dx, dgamma, dbeta, dy engine.Buf, b float32)) {
	h.t.Helper()
	n := len(DY)
	dx, dg, db := h.alloc(n, dt), h.alloc(nparams, dt), h.alloc(nparams, dt)
	for mask := range 8 {
		for _, b := range []float32{0, 1} {
			h.d.Upload(dx, nans(n))
			DG := h.put(dg, h.cInit(b)(nparams))
			DB := h.put(db, h.cInit(b)(nparams))
			useX, useG, useB := mask&1 != 0, mask&2 != 0, mask&4 != 0
			run(optional(dx, useX), optional(dg, useG), optional(db, useB), dy, b)
			h.sync(what)
			tag := fmt.Sprintf("%s backward (dx %v, dgamma %v, dbeta %v, b %v)", what, useX, useG, useB, b)
			if useX {
				h.near(tag+": dx", dt, h.get(dx), r.dx, r.dxMag, dxTerms)
			}
			if useG {
				g, m := withBeta(r.dgamma, r.dgMag, b, DG)
				h.near(tag+": dgamma", dt, h.get(dg), g, m, dpTerms)
			}
			if useB {
				g, m := withBeta(r.dbeta, r.dbMag, b, DB)
				h.near(tag+": dbeta", dt, h.get(db), g, m, dpTerms)
			}
			h.exact(tag+": dy", h.get(dy), DY)
		}
	}
	// dx in place of dy (the parameter gradients read dy before dx overwrites it).
	dy2 := h.alloc(n, dt)
	h.d.Upload(dy2, DY)
	DG := h.put(dg, h.normal(nparams, 1))
	DB := h.put(db, h.normal(nparams, 1))
	run(dy2, dg, db, dy2, 0.5)
	h.sync(what)
	tag := what + " backward with dx in place of dy, b 0.5"
	h.near(tag+": dx", dt, h.get(dy2), r.dx, r.dxMag, dxTerms)
	g, m := withBeta(r.dgamma, r.dgMag, 0.5, DG)
	h.near(tag+": dgamma", dt, h.get(dg), g, m, dpTerms)
	g, m = withBeta(r.dbeta, r.dbMag, 0.5, DB)
	h.near(tag+": dbeta", dt, h.get(db), g, m, dpTerms)
}

// TestLayerNorm checks LayerNorm's statistics and output against their float64 definitions,
// into another buffer (full of NaN) and in place (y aliasing x).
func TestLayerNorm(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range []struct {
			rows, cols int
			eps        float32
		}{{1, 1, 1e-5}, {3, 7, 1e-5}, {17, 64, 1e-5}, {64, 33, 1e-6}, {5, 768, 1e-5}, {1088, 64, 1e-5}, {9, 16, 0.5}} {
			rows, cols := s.rows, s.cols
			tag := fmt.Sprintf("%v layer_norm %dx%d eps %v", dt, rows, cols, s.eps)
			x := h.alloc(rows*cols, dt)
			X := h.put(x, h.normInput(rows, cols))
			gv, bv := h.affine(cols)
			gamma, beta := h.alloc(cols, dt), h.alloc(cols, dt)
			G, B := h.put(gamma, gv), h.put(beta, bv)
			p := layerNormProblem(X, G, B, nil, rows, cols, s.eps)
			want := p.solve()
			y := h.alloc(rows*cols, dt)
			h.d.Upload(y, nans(rows*cols))
			mean, rstd := h.alloc(rows, engine.F32), h.alloc(rows, engine.F32)
			h.d.Upload(mean, nans(rows))
			h.d.Upload(rstd, nans(rows))
			h.d.LayerNorm(y, mean, rstd, x, gamma, beta, rows, cols, s.eps)
			h.near(tag+": mean", engine.F32, h.get(mean), want.mean, want.meanMag, cols)
			h.near(tag+": rstd", engine.F32, h.get(rstd), want.rstd, want.rstdMag, cols+4)
			h.near(tag+": y", dt, h.get(y), want.y, want.yMag, cols+4)
			h.exact(tag+": x", h.get(x), X)

			h.d.Upload(mean, nans(rows))
			h.d.LayerNorm(x, mean, rstd, x, gamma, beta, rows, cols, s.eps)
			h.near(tag+" in place: mean", engine.F32, h.get(mean), want.mean, want.meanMag, cols)
			h.near(tag+" in place: y", dt, h.get(x), want.y, want.yMag, cols+4)
		}
	}
}

// layerNormProblem is a layer norm of rows×cols values in float64.
func layerNormProblem(x, gamma, beta, dy []float32, rows, cols int, eps float32) *normProblem {
	p := &normProblem{x: f64(x), gamma: f64(gamma), beta: f64(beta), dy: f64(dy), eps: float64(eps),
		param: func(i int) int { return i % cols }}
	if dy == nil {
		p.dy = make([]float64, len(x))
	}
	for r := range rows {
		idx := make([]int, cols)
		for c := range idx {
			idx[c] = r*cols + c
		}
		p.groups = append(p.groups, idx)
	}
	return p
}

// TestLayerNormBackward checks LayerNormBackward, from the statistics the device's LayerNorm
// stored, against the finite differences of a float64 layer norm (small shapes) and its
// analytic gradients (all shapes).
func TestLayerNormBackward(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][2]int{{1, 1}, {2, 5}, {3, 7}, {8, 32}, {17, 33}, {300, 48}, {4, 768}} {
			rows, cols := s[0], s[1]
			const eps = 1e-5
			x := h.alloc(rows*cols, dt)
			X := h.put(x, h.normInput(rows, cols))
			gv, bv := h.affine(cols)
			gamma, beta := h.alloc(cols, dt), h.alloc(cols, dt)
			G, B := h.put(gamma, gv), h.put(beta, bv)
			dy, DY := h.random(rows*cols, dt, 1)
			y := h.alloc(rows*cols, dt)
			mean, rstd := h.alloc(rows, engine.F32), h.alloc(rows, engine.F32)
			h.d.LayerNorm(y, mean, rstd, x, gamma, beta, rows, cols, eps)
			h.sync("layer_norm")
			p := layerNormProblem(X, G, B, DY, rows, cols, eps)
			want := p.solve()
			tag := fmt.Sprintf("%v layer_norm %dx%d", dt, rows, cols)
			if rows*cols <= fdLimit {
				p.finiteDifferences(&want)
				tag += " (finite differences)"
			}
			h.normBackwardCheck(tag, dt, want, dy, DY, cols, cols+8, rows+cols+8, func(dx, dg, db, dy engine.Buf, b float32) {
				h.d.LayerNormBackward(dx, dg, db, dy, x, mean, rstd, gamma, rows, cols, b)
			})
		}
	}
}

// batchNormProblem is a batch norm of n×c×hw values in float64.
func batchNormProblem(x, gamma, beta, dy []float32, n, c, hw int, eps float32) *normProblem {
	p := &normProblem{x: f64(x), gamma: f64(gamma), beta: f64(beta), dy: f64(dy), eps: float64(eps),
		param: func(i int) int { return (i / hw) % c }}
	if dy == nil {
		p.dy = make([]float64, len(x))
	}
	for ch := range c {
		var idx []int
		for s := range n {
			for i := range hw {
				idx = append(idx, (s*c+ch)*hw+i)
			}
		}
		p.groups = append(p.groups, idx)
	}
	return p
}

// bnInput returns n×c×hw values, each channel with its own offset and scale.
func (h *harness) bnInput(n, c, hw int) []float32 {
	per := h.normInput(c, n*hw) // channel-major
	x := make([]float32, n*c*hw)
	for ch := range c {
		for s := range n {
			copy(x[(s*c+ch)*hw:(s*c+ch+1)*hw], per[ch*n*hw+s*hw:])
		}
	}
	return x
}

// TestBatchNorm checks BatchNorm in training (statistics over each channel, stored) and in
// evaluation (the given statistics, left unchanged; y in place of x).
func TestBatchNorm(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][3]int{{1, 1, 1}, {2, 3, 5}, {3, 2, 1}, {17, 5, 12}, {4, 16, 49}, {64, 8, 196}} {
			n, c, hw := s[0], s[1], s[2]
			const eps = 1e-5
			tag := fmt.Sprintf("%v batch_norm %dx%dx%d", dt, n, c, hw)
			x := h.alloc(n*c*hw, dt)
			X := h.put(x, h.bnInput(n, c, hw))
			gv, bv := h.affine(c)
			gamma, beta := h.alloc(c, dt), h.alloc(c, dt)
			G, B := h.put(gamma, gv), h.put(beta, bv)
			want := batchNormProblem(X, G, B, nil, n, c, hw, eps).solve()
			y := h.alloc(n*c*hw, dt)
			h.d.Upload(y, nans(n*c*hw))
			mean, rstd := h.alloc(c, engine.F32), h.alloc(c, engine.F32)
			h.d.Upload(mean, nans(c))
			h.d.Upload(rstd, nans(c))
			h.d.BatchNorm(y, mean, rstd, x, gamma, beta, n, c, hw, eps, true)
			h.near(tag+" (train): mean", engine.F32, h.get(mean), want.mean, want.meanMag, n*hw)
			h.near(tag+" (train): rstd", engine.F32, h.get(rstd), want.rstd, want.rstdMag, n*hw+4)
			h.near(tag+" (train): y", dt, h.get(y), want.y, want.yMag, n*hw+4)
			h.exact(tag+" (train): x", h.get(x), X)

			// Evaluation: the running statistics are inputs.
			M := h.put(mean, h.normal(c, 1))
			R := make([]float32, c)
			for i := range R {
				R[i] = float32(0.5 + 1.5*h.rng.Float64())
			}
			R = h.put(rstd, R)
			ev, evMag := make([]float64, len(X)), make([]float64, len(X))
			for i, v := range X {
				ch := (i / hw) % c
				xh := (float64(v) - float64(M[ch])) * float64(R[ch])
				ev[i] = xh*float64(G[ch]) + float64(B[ch])
				evMag[i] = math.Abs(float64(G[ch]))*float64(R[ch])*(math.Abs(float64(v))+math.Abs(float64(M[ch]))) + math.Abs(float64(B[ch])) + math.Abs(ev[i])
			}
			h.d.Upload(y, nans(n*c*hw))
			h.d.BatchNorm(y, mean, rstd, x, gamma, beta, n, c, hw, eps, false)
			h.near(tag+" (eval): y", dt, h.get(y), ev, evMag, 4)
			h.exact(tag+" (eval): mean", h.get(mean), M)
			h.exact(tag+" (eval): rstd", h.get(rstd), R)
			h.d.BatchNorm(x, mean, rstd, x, gamma, beta, n, c, hw, eps, false)
			h.near(tag+" (eval) in place: y", dt, h.get(x), ev, evMag, 4)
		}
	}
}

// TestBatchNormBackward checks BatchNormBackward (training mode), from the statistics the
// device's BatchNorm stored, against the finite differences of a float64 batch norm (small
// shapes) and its analytic gradients (all shapes).
func TestBatchNormBackward(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][3]int{{1, 1, 2}, {2, 3, 5}, {5, 2, 9}, {3, 4, 16}, {17, 5, 12}, {16, 8, 196}} {
			n, c, hw := s[0], s[1], s[2]
			const eps = 1e-5
			x := h.alloc(n*c*hw, dt)
			X := h.put(x, h.bnInput(n, c, hw))
			gv, bv := h.affine(c)
			gamma, beta := h.alloc(c, dt), h.alloc(c, dt)
			G, B := h.put(gamma, gv), h.put(beta, bv)
			dy, DY := h.random(n*c*hw, dt, 1)
			y := h.alloc(n*c*hw, dt)
			mean, rstd := h.alloc(c, engine.F32), h.alloc(c, engine.F32)
			h.d.BatchNorm(y, mean, rstd, x, gamma, beta, n, c, hw, eps, true)
			h.sync("batch_norm")
			p := batchNormProblem(X, G, B, DY, n, c, hw, eps)
			want := p.solve()
			tag := fmt.Sprintf("%v batch_norm %dx%dx%d", dt, n, c, hw)
			if n*c*hw <= fdLimit {
				p.finiteDifferences(&want)
				tag += " (finite differences)"
			}
			h.normBackwardCheck(tag, dt, want, dy, DY, c, n*hw+8, n*hw+8, func(dx, dg, db, dy engine.Buf, b float32) {
				h.d.BatchNormBackward(dx, dg, db, dy, x, mean, rstd, gamma, n, c, hw, b)
			})
		}
	}
}

// ---- GELU, Dropout ----

// geluInput returns n values: N(0, 3²) draws with zeros, tiny and large values among them.
func (h *harness) geluInput(n int) []float32 {
	x := h.normal(n, 3)
	special := []float32{0, float32(math.Copysign(0, -1)), 1e-3, -1e-3, 10, -10, 5, -5, 30, -30}
	for i := range x {
		if h.rng.IntN(8) == 0 {
			x[i] = special[h.rng.IntN(len(special))]
		}
	}
	return x
}

func phi64(x float64) (cdf, pdf float64) {
	return 0.5 * math.Erfc(-x/math.Sqrt2), math.Exp(-x*x/2) / math.Sqrt(2*math.Pi)
}

// TestGELU checks GELU against x·Φ(x) in float64. The error of an fp32 x·Φ(x) is bounded by a
// few units of |x|'s roundoff (Φ computed as (1 + erf(x/√2))/2 is absolutely, not relatively,
// accurate far out on the negative side), so the tolerance scales with |x|.
func TestGELU(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 1000, 40000} {
			x := h.alloc(n, dt)
			X := h.put(x, h.geluInput(n))
			y := h.alloc(n, dt)
			h.d.Upload(y, nans(n))
			h.d.GELU(y, x)
			want, mag := make([]float64, n), make([]float64, n)
			for i, v := range X {
				cdf, _ := phi64(float64(v))
				want[i] = float64(v) * cdf
				mag[i] = math.Abs(float64(v)) + math.Abs(want[i])
			}
			h.near(fmt.Sprintf("%v gelu of %d", dt, n), dt, h.get(y), want, mag, 16)
			h.exact(fmt.Sprintf("%v gelu of %d: its input", dt, n), h.get(x), X)
		}
	}
}

// TestGELUGrad checks GELUGrad against dy·(Φ(x) + x·φ(x)) in float64, into another buffer and
// in place of dy.
func TestGELUGrad(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 1000, 40000} {
			x := h.alloc(n, dt)
			X := h.put(x, h.geluInput(n))
			dy, DY := h.random(n, dt, 1)
			want, mag := make([]float64, n), make([]float64, n)
			for i, v := range X {
				xv := float64(v)
				cdf, pdf := phi64(xv)
				want[i] = float64(DY[i]) * (cdf + xv*pdf)
				mag[i] = math.Abs(float64(DY[i])) * (1 + cdf + math.Abs(xv)*pdf*(1+xv*xv))
			}
			dx := h.alloc(n, dt)
			h.d.Upload(dx, nans(n))
			h.d.GELUGrad(dx, dy, x)
			tag := fmt.Sprintf("%v gelu_grad of %d", dt, n)
			h.near(tag, dt, h.get(dx), want, mag, 16)
			h.exact(tag+": dy", h.get(dy), DY)
			h.d.GELUGrad(dy, dy, x)
			h.near(tag+" in place", dt, h.get(dy), want, mag, 16)
		}
	}
}

// TestDropout checks Dropout's mask (engine.DropoutKeep of each element's index in the view,
// so every backend draws the same), the kept elements' scaling by 1/(1−p) and the kept
// fraction; that the backward pass (Dropout of dy with the same seed) drops the same
// elements; and Dropout in place. p 0 keeps everything unchanged and p 1 zeroes everything.
func TestDropout(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 1000, 40001} {
			whole := h.alloc(n+3, dt)
			x := whole.Slice(3, n+3) // the mask is of the index in the view, not the allocation
			y, dy, dx := h.alloc(n, dt), h.alloc(n, dt), h.alloc(n, dt)
			for _, p := range []float32{0, 0.1, 0.5, 1} {
				for _, seed := range []uint64{1, 0x9e3779b97f4a7c15 ^ uint64(n)} {
					tag := fmt.Sprintf("%v dropout of %d, p %v, seed %#x", dt, n, p, seed)
					// Values away from zero: a zero in y is a dropped element.
					vals := h.normal(n, 1)
					for i, v := range vals {
						vals[i] = float32(math.Copysign(0.5+math.Abs(float64(v)), float64(v)))
					}
					h.d.Upload(whole, append([]float32{1, 2, 3}, vals...))
					X := h.get(x)
					h.d.Upload(y, nans(n))
					h.d.Dropout(y, x, p, seed)
					Y := h.get(y)
					var want, mag []float64
					var kept []float32
					m := h.check("%s: mask", tag)
					count := 0
					for i, v := range Y {
						if !engine.DropoutKeep(seed, uint64(i), p) {
							if v != 0 {
								m.add("[%d] = %v, dropped", i, v)
							}
							continue
						}
						count++
						kept = append(kept, v)
						want = append(want, float64(X[i])/(1-float64(p)))
						mag = append(mag, 2*math.Abs(float64(X[i])/(1-float64(p))))
					}
					m.done()
					if p == 0 {
						h.exact(tag+": y", Y, X)
					}
					h.near(tag+": kept elements", dt, kept, want, mag, 2)
					if n > 1000 {
						frac, sd := float64(count)/float64(n), math.Sqrt(float64(p)*(1-float64(p))/float64(n))
						if math.Abs(frac-(1-float64(p))) > 5*sd+1.0/float64(n) {
							t.Errorf("%s: kept %d of %d (%.4f), want a fraction of about %.4f", tag, count, n, frac, 1-p)
						}
					}
					// The backward pass drops the same elements.
					dyv := h.normal(n, 1)
					for i, v := range dyv {
						dyv[i] = float32(math.Copysign(0.25+math.Abs(float64(v)), float64(v)))
					}
					h.d.Upload(dy, dyv)
					h.d.Upload(dx, nans(n))
					h.d.Dropout(dx, dy, p, seed)
					DX := h.get(dx)
					same := h.check("%s: backward mask", tag)
					for i := range DX {
						if (DX[i] == 0) != (Y[i] == 0) {
							same.add("[%d]: forward %v, backward %v", i, Y[i], DX[i])
						}
					}
					same.done()
					// In place.
					h.d.Dropout(x, x, p, seed)
					h.exact(tag+" in place", h.get(x), Y)
				}
			}
		}
	}
	// Different seeds draw different masks.
	const n = 4096
	x, _ := h.filled(n, engine.F32, 1)
	y1, y2 := h.alloc(n, engine.F32), h.alloc(n, engine.F32)
	h.d.Dropout(y1, x, 0.5, 7)
	h.d.Dropout(y2, x, 0.5, 8)
	a, b := h.get(y1), h.get(y2)
	differ := 0
	for i := range a {
		if (a[i] == 0) != (b[i] == 0) {
			differ++
		}
	}
	if differ < n/4 {
		t.Errorf("seeds 7 and 8: the masks differ in %d of %d elements", differ, n)
	}
}

// ---- Softmax ----

// softmax64 is softmax(scale·x) of each row in float64, with the magnitudes an fp32
// computation's error scales with (the exponentials' arguments, the row's sum).
func softmax64(x []float32, rows, cols int, scale float32) (y, mag []float64) {
	y, mag = make([]float64, len(x)), make([]float64, len(x))
	for r := range rows {
		z := make([]float64, cols)
		m, top := math.Inf(-1), 0.0
		for c := range z {
			z[c] = float64(scale) * float64(x[r*cols+c])
			m = max(m, z[c])
			top = max(top, math.Abs(z[c]))
		}
		var sum float64
		for _, v := range z {
			sum += math.Exp(v - m)
		}
		for c, v := range z {
			p := math.Exp(v-m) / sum
			y[r*cols+c] = p
			mag[r*cols+c] = p * (4 + math.Abs(v) + math.Abs(v-m) + 2*top + math.Abs(m))
		}
	}
	return y, mag
}

// TestSoftmax checks Softmax against its float64 definition, that each row sums to 1, into
// another buffer (full of NaN) and in place, on rows with large logits (exp overflows unless
// the row's maximum is subtracted) and equal ones.
func TestSoftmax(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][2]int{{1, 1}, {1, 2}, {5, 17}, {7, 33}, {3, 1000}, {1632, 17}} {
			rows, cols := s[0], s[1]
			for _, scale := range []float32{1, 0.125, 0.17677669} {
				vals := h.normal(rows*cols, 3)
				if rows > 1 {
					for c := range cols {
						vals[c] += 80
						vals[cols+c] = 1.25
					}
				}
				x := h.alloc(len(vals), dt)
				X := h.put(x, vals)
				y := h.alloc(len(vals), dt)
				h.d.Upload(y, nans(len(vals)))
				h.d.Softmax(y, x, rows, cols, scale)
				want, mag := softmax64(X, rows, cols, scale)
				tag := fmt.Sprintf("%v softmax %dx%d scale %v", dt, rows, cols, scale)
				Y := h.get(y)
				h.near(tag, dt, Y, want, mag, cols+4)
				h.exact(tag+": x", h.get(x), X)
				sums := h.check("%s: row sums", tag)
				for r := range rows {
					var s, bound float64
					for c := range cols {
						i := r*cols + c
						s += float64(Y[i])
						bound += tol(dt, want[i], mag[i], cols+4)
					}
					if math.Abs(s-1) > bound {
						sums.add("row %d sums to %v (bound %.3g)", r, s, bound)
					}
				}
				sums.done()
				h.d.Softmax(x, x, rows, cols, scale)
				h.near(tag+" in place", dt, h.get(x), want, mag, cols+4)
			}
		}
	}
}

// TestSoftmaxGrad checks SoftmaxGrad against its formula in float64 on the y the device holds
// and, with y rounded to its type, against the finite differences of Σ dy·softmax(scale·x) in
// float64; into another buffer (full of NaN) and in place of dy.
func TestSoftmaxGrad(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][2]int{{1, 1}, {1, 2}, {5, 17}, {7, 33}, {3, 1000}, {1632, 17}} {
			rows, cols := s[0], s[1]
			for _, scale := range []float32{1, 0.17677669} {
				tag := fmt.Sprintf("%v softmax_grad %dx%d scale %v", dt, rows, cols, scale)
				xv := h.normal(rows*cols, 2)
				p, _ := softmax64(xv, rows, cols, scale)
				yv := make([]float32, len(p))
				for i, v := range p {
					yv[i] = float32(v)
				}
				y := h.alloc(len(p), dt)
				Y := h.put(y, yv)
				dy, DY := h.random(len(p), dt, 1)
				want, mag := make([]float64, len(p)), make([]float64, len(p))
				for r := range rows {
					var dot, dotMag float64
					for c := range cols {
						i := r*cols + c
						dot += float64(DY[i]) * float64(Y[i])
						dotMag += math.Abs(float64(DY[i]) * float64(Y[i]))
					}
					for c := range cols {
						i := r*cols + c
						want[i] = float64(scale) * float64(Y[i]) * (float64(DY[i]) - dot)
						mag[i] = math.Abs(float64(scale)) * float64(Y[i]) * (math.Abs(float64(DY[i])) + dotMag)
					}
				}
				dx := h.alloc(len(p), dt)
				h.d.Upload(dx, nans(len(p)))
				h.d.SoftmaxGrad(dx, dy, y, rows, cols, scale)
				DX := h.get(dx)
				h.near(tag, dt, DX, want, mag, cols+3)
				h.exact(tag+": dy", h.get(dy), DY)
				if rows*cols <= 4*fdLimit {
					// The finite differences of the loss Σ dy·softmax(scale·x), row by row: the
					// device's dx differs from them by y's rounding to its type.
					fd := make([]float64, len(p))
					for r := range rows {
						x := f64(xv[r*cols : (r+1)*cols])
						loss := func() float64 {
							m := math.Inf(-1)
							for _, v := range x {
								m = max(m, float64(scale)*v)
							}
							var sum, l float64
							for _, v := range x {
								sum += math.Exp(float64(scale)*v - m)
							}
							for c, v := range x {
								l += float64(DY[r*cols+c]) * math.Exp(float64(scale)*v-m) / sum
							}
							return l
						}
						copy(fd[r*cols:], fdGrad(x, loss, 1e-3))
					}
					h.nearRel(tag+" (finite differences)", dt, DX, fd, mag, cols+3, 2*halfRel(dt)+4*u32)
				}
				h.d.SoftmaxGrad(dy, dy, y, rows, cols, scale)
				h.near(tag+" in place", dt, h.get(dy), want, mag, cols+3)
			}
		}
	}
}

// ---- Patchify ----

// TestPatchify checks Patchify and Unpatchify against their definitions (exactly: they only
// move values), that Unpatchify inverts Patchify, and that Patchify followed by a Gemm with a
// Conv2d weight [out, c, p, p] is the stride-p convolution (a ViT's patch embedding).
func TestPatchify(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][5]int{{1, 1, 4, 4, 2}, {2, 3, 6, 9, 3}, {3, 1, 28, 28, 7}, {2, 2, 5, 5, 5}, {1, 2, 3, 3, 1}, {2, 3, 8, 4, 4}} {
			n, c, hh, w, p := s[0], s[1], s[2], s[3], s[4]
			tag := fmt.Sprintf("%v patchify %dx%dx%dx%d by %d", dt, n, c, hh, w, p)
			ph, pw := hh/p, w/p
			rows, cpp := n*ph*pw, c*p*p
			x, X := h.random(n*c*hh*w, dt, 1)
			cols := h.alloc(rows*cpp, dt)
			h.d.Upload(cols, nans(rows*cpp))
			h.d.Patchify(cols, x, n, c, hh, w, p)
			// Element (s, ch, iy, ix) of x lands in row s·ph·pw + (iy/p)·pw + ix/p (the patch in
			// raster order), column ch·p·p + (iy%p)·p + ix%p.
			where := make([]int, len(X))
			want := make([]float32, len(X))
			for sm := range n {
				for ch := range c {
					for iy := range hh {
						for ix := range w {
							xi := ((sm*c+ch)*hh+iy)*w + ix
							ci := (sm*ph*pw+(iy/p)*pw+ix/p)*cpp + ch*p*p + (iy%p)*p + ix%p
							where[xi] = ci
							want[ci] = X[xi]
						}
					}
				}
			}
			got := h.get(cols)
			h.exact(tag, got, want)
			dx := h.alloc(len(X), dt)
			h.d.Upload(dx, nans(len(X)))
			h.d.Unpatchify(dx, cols, n, c, hh, w, p)
			h.exact(tag+": unpatchify(patchify(x))", h.get(dx), X)

			cv := h.put(cols, h.normal(rows*cpp, 1))
			h.d.Upload(dx, nans(len(X)))
			h.d.Unpatchify(dx, cols, n, c, hh, w, p)
			back := make([]float32, len(X))
			for xi, ci := range where {
				back[xi] = cv[ci]
			}
			h.exact(tag+": unpatchify", h.get(dx), back)

			// The patch embedding: tokens = patchify(x) · Wᵀ, W = [out, c, p, p].
			const out = 5
			wt, W := h.random(out*cpp, dt, 1/math.Sqrt(float64(cpp)))
			h.d.Patchify(cols, x, n, c, hh, w, p)
			tok := h.alloc(rows*out, dt)
			h.d.Gemm(false, true, rows, out, cpp, 1, cols, wt, 0, tok)
			conv, mag := make([]float64, rows*out), make([]float64, rows*out)
			for sm := range n {
				for o := range out {
					for py := range ph {
						for px := range pw {
							ti := (sm*ph*pw+py*pw+px)*out + o
							for ch := range c {
								for i := range p {
									for j := range p {
										v := float64(X[((sm*c+ch)*hh+py*p+i)*w+px*p+j]) * float64(W[((o*c+ch)*p+i)*p+j])
										conv[ti] += v
										mag[ti] += math.Abs(v)
									}
								}
							}
						}
					}
				}
			}
			h.near(tag+": patch embedding against a stride-p convolution", dt, h.get(tok), conv, mag, cpp+1)
		}
	}
}

// ---- Errors ----

// TestTransformerErrors checks that the new operations latch an error for inconsistent
// arguments (wrong lengths, strides or types): the operation and those after it are skipped,
// Sync returns an error wrapping engine.ErrDevice and clears it.
func TestTransformerErrors(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	good, _ := h.filled(64, engine.F32, 1)
	work, _ := h.random(256, engine.F32, 1)
	hf := h.alloc(64, engine.F16)
	st := h.alloc(16, engine.F32)
	gm := h.alloc(16, engine.F32)
	gemmB := func(a, b, c engine.Buf, sa, sb, sc, batch int) func() {
		return func() { h.d.GemmBatched(false, false, 2, 2, 2, 1, a, 2, sa, b, 2, sb, 0, c, 2, sc, batch) }
	}
	for _, c := range []struct {
		name string
		op   func()
	}{
		{"gemm_batched with strideC 0", gemmB(work.Slice(0, 8), work.Slice(8, 16), hf.Slice(0, 8), 4, 4, 0, 2)},
		{"gemm_batched with C shorter than its last product", gemmB(work.Slice(0, 8), work.Slice(8, 16), hf.Slice(0, 7), 4, 4, 4, 2)},
		{"gemm_batched with A shorter than its last product", gemmB(work.Slice(0, 11), work.Slice(16, 28), hf.Slice(0, 12), 4, 4, 4, 3)},
		{"gemm_batched with a negative stride", gemmB(work.Slice(0, 8), work.Slice(8, 16), hf.Slice(0, 8), -4, 4, 4, 2)},
		{"gemm_batched with a negative batch", gemmB(work.Slice(0, 8), work.Slice(8, 16), hf.Slice(0, 8), 4, 4, 4, -1)},
		{"gemm_batched with lda below the row length", func() {
			h.d.GemmBatched(false, false, 2, 2, 2, 1, work.Slice(0, 8), 1, 4, work.Slice(8, 16), 2, 4, 0, hf.Slice(0, 8), 2, 4, 2)
		}},
		{"axpby of different lengths", func() { h.d.Axpby(work.Slice(0, 10), work.Slice(10, 19), 1, 1) }},
		{"copy_rows with ldDst below cols", func() { h.d.CopyRows(work.Slice(0, 16), 3, work.Slice(100, 116), 4, 2, 4) }},
		{"copy_rows from a view shorter than its rows", func() { h.d.CopyRows(hf.Slice(0, 16), 8, work.Slice(0, 10), 8, 2, 8) }},
		{"copy_rows into a view shorter than its rows", func() { h.d.CopyRows(hf.Slice(0, 15), 8, work.Slice(0, 8), 0, 2, 8) }},
		{"layer_norm with gamma of the wrong length", func() {
			h.d.LayerNorm(work.Slice(0, 32), st.Slice(0, 4), st.Slice(4, 8), work.Slice(32, 64), gm.Slice(0, 7), gm.Slice(8, 16), 4, 8, 1e-5)
		}},
		{"layer_norm with f16 statistics", func() {
			h.d.LayerNorm(work.Slice(0, 32), hf.Slice(0, 4), st.Slice(4, 8), work.Slice(32, 64), gm.Slice(0, 8), gm.Slice(8, 16), 4, 8, 1e-5)
		}},
		{"layer_norm with rows·cols not the length of x", func() {
			h.d.LayerNorm(work.Slice(0, 32), st.Slice(0, 4), st.Slice(4, 8), work.Slice(32, 63), gm.Slice(0, 8), gm.Slice(8, 16), 4, 8, 1e-5)
		}},
		{"layer_norm_backward with dx of the wrong length", func() {
			h.d.LayerNormBackward(work.Slice(0, 31), gm.Slice(0, 8), gm.Slice(8, 16), work.Slice(32, 64), work.Slice(64, 96), st.Slice(0, 4), st.Slice(4, 8), gm.Slice(0, 8), 4, 8, 0)
		}},
		{"layer_norm_backward with dgamma of the wrong length", func() {
			h.d.LayerNormBackward(engine.Buf{}, gm.Slice(0, 9), engine.Buf{}, work.Slice(32, 64), work.Slice(64, 96), st.Slice(0, 4), st.Slice(4, 8), gm.Slice(0, 8), 4, 8, 0)
		}},
		{"layer_norm_backward with rstd of the wrong length", func() {
			h.d.LayerNormBackward(work.Slice(0, 32), engine.Buf{}, engine.Buf{}, work.Slice(32, 64), work.Slice(64, 96), st.Slice(0, 4), st.Slice(4, 7), gm.Slice(0, 8), 4, 8, 0)
		}},
		{"gelu of different lengths", func() { h.d.GELU(work.Slice(0, 10), work.Slice(10, 21)) }},
		{"gelu_grad of different lengths", func() { h.d.GELUGrad(work.Slice(0, 10), work.Slice(10, 20), work.Slice(20, 29)) }},
		{"dropout of different lengths", func() { h.d.Dropout(work.Slice(0, 10), hf.Slice(0, 11), 0.5, 1) }},
		{"softmax with rows·cols not the length", func() { h.d.Softmax(work.Slice(0, 12), work.Slice(12, 24), 3, 5, 1) }},
		{"softmax_grad with y of the wrong length", func() {
			h.d.SoftmaxGrad(work.Slice(0, 12), work.Slice(12, 24), work.Slice(24, 35), 3, 4, 1)
		}},
		{"patchify with h not a multiple of p", func() { h.d.Patchify(work.Slice(0, 30), work.Slice(30, 60), 1, 1, 5, 6, 2) }},
		{"patchify into the wrong length", func() { h.d.Patchify(work.Slice(0, 35), work.Slice(40, 76), 1, 1, 6, 6, 2) }},
		{"unpatchify into the wrong length", func() { h.d.Unpatchify(work.Slice(0, 35), work.Slice(40, 76), 1, 1, 6, 6, 3) }},
		{"batch_norm with rstd of the wrong length", func() {
			h.d.BatchNorm(work.Slice(0, 24), st.Slice(0, 3), st.Slice(3, 5), work.Slice(24, 48), gm.Slice(0, 3), gm.Slice(3, 6), 2, 3, 4, 1e-5, true)
		}},
		{"batch_norm in evaluation with f16 statistics", func() {
			h.d.BatchNorm(work.Slice(0, 24), hf.Slice(0, 3), st.Slice(3, 6), work.Slice(24, 48), gm.Slice(0, 3), gm.Slice(3, 6), 2, 3, 4, 1e-5, false)
		}},
		{"batch_norm_backward with dbeta of the wrong length", func() {
			h.d.BatchNormBackward(work.Slice(0, 24), gm.Slice(0, 3), gm.Slice(3, 7), work.Slice(24, 48), work.Slice(48, 72), st.Slice(0, 3), st.Slice(3, 6), gm.Slice(0, 3), 2, 3, 4, 0)
		}},
	} {
		h.d.Fill(good, 1)
		h.sync("before " + c.name)
		c.op()
		h.d.Fill(good, 2) // must be skipped
		h.d.Axpby(good, good, 3, 0)
		if err := h.d.Sync(); !errors.Is(err, engine.ErrDevice) {
			t.Errorf("%s: Sync returned %v, want an error wrapping engine.ErrDevice", c.name, err)
			continue
		}
		if err := h.d.Sync(); err != nil {
			t.Errorf("%s: the second Sync returned %v, want nil", c.name, err)
		}
		for i, v := range h.get(good) {
			if v != 1 {
				t.Errorf("%s: the operations after the error ran (element %d is %v)", c.name, i, v)
				break
			}
		}
		h.d.Fill(good, 3)
		if v := h.get(good)[0]; v != 3 {
			t.Errorf("%s: after Sync, fill did not run (%v)", c.name, v)
		}
	}
}
