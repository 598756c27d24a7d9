//go:build cuda

package cuda

// The transformer layers' operations (transformer.go) against the reference device, every
// kernel in every type: exact where both move or compute elementwise in the same fp32
// operations, within a tolerance where a sum runs in another order or a libm function
// (erfcf, expf) may differ in its last bits.

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/enginetest"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
)

// TestConformance runs engine/enginetest's whole conformance suite (enginetest.TestDevice)
// on the CUDA device: a Device opened per test on GPU 0 (sharing its primary context with
// the package's dev) and closed by the suite.
func TestConformance(t *testing.T) {
	enginetest.TestDevice(t, func() engine.Device {
		d, err := Open(0)
		if err != nil {
			panic(fmt.Sprintf("opening a CUDA device for the conformance suite: %v", err))
		}
		return d
	})
}

// near checks b on both devices within ulps of its type plus rel times the reference's
// largest magnitude.
func (p *pair) near(what string, b twin, ulps, rel float64) {
	p.t.Helper()
	href, _ := p.get(b)
	p.same(what, b, ulps, rel*maxAbs(href))
}

// invalid is a frozen tensor's gradient: no buffer on either device.
var invalid = twin{}

// ulpsOf is a tolerance in units in the last place of ty: f32 for an fp32 result that may
// differ in its last bits (another summation order, a libm function), 1 for a half-precision
// one, whose fp32 values then round to the same or a neighbouring value.
func ulpsOf(ty engine.DType, f32 float64) float64 {
	if ty == engine.F32 {
		return f32
	}
	return 1
}

func TestGemmBatched(t *testing.T) {
	p := newPair(t)
	type shape struct {
		m, n, k, batch int
		zeroA, zeroB   bool // stride 0: every GEMM reads the same A (B)
		side           bool // C's matrices side by side in the rows of one (attention's heads)
		pad            int  // extra leading dimension of A and B
	}
	shapes := []shape{
		{1, 1, 1, 1, false, false, false, 0},
		{17, 9, 33, 4, false, false, false, 0},
		{65, 64, 16, 6, false, false, true, 0}, // scores of 6 heads
		{16, 65, 65, 3, false, true, false, 3},
		{8, 12, 5, 5, true, false, true, 2},
		{7, 5, 0, 2, false, false, false, 0}, // k = 0: C = beta·C
	}
	for _, ty := range floatTypes {
		cts := []engine.DType{ty}
		if ty != engine.F32 {
			cts = append(cts, engine.F32)
		}
		for _, ct := range cts {
			for _, s := range shapes {
				for tr := range 4 {
					transA, transB := tr&1 != 0, tr&2 != 0
					for _, beta := range []float32{0, 1} {
						ar, ac := s.m, s.k
						if transA {
							ar, ac = ac, ar
						}
						br, bc := s.k, s.n
						if transB {
							br, bc = bc, br
						}
						lda, ldb := max(ac, 1)+s.pad, max(bc, 1)+s.pad
						sa, sb := engine.StridedLen(ar, ac, lda), engine.StridedLen(br, bc, ldb)
						if s.zeroA {
							sa = 0
						}
						if s.zeroB {
							sb = 0
						}
						ldc, sc := s.n, s.m*s.n
						if s.side {
							ldc, sc = s.batch*s.n, s.n
						}
						na := max((s.batch-1)*sa+engine.StridedLen(ar, ac, lda), 1)
						nb := max((s.batch-1)*sb+engine.StridedLen(br, bc, ldb), 1)
						a, b := p.rand(ty, na, 1), p.rand(ty, nb, 1)
						c := p.rand(ct, s.batch*s.m*s.n, 1)
						p.h.GemmBatched(transA, transB, s.m, s.n, s.k, 0.75, a.h, lda, sa, b.h, ldb, sb, beta, c.h, ldc, sc, s.batch)
						p.d.GemmBatched(transA, transB, s.m, s.n, s.k, 0.75, a.d, lda, sa, b.d, ldb, sb, beta, c.d, ldc, sc, s.batch)
						p.same(fmt.Sprintf("GemmBatched %v→%v %+v transA=%v transB=%v beta=%g", ty, ct, s, transA, transB, beta),
							c, 1, 1e-6*float64(s.k+1))
					}
				}
			}
		}
	}
}

func TestGemmBatchedErrors(t *testing.T) {
	p := newPair(t)
	a, b, c := p.rand(engine.F32, 64, 1), p.rand(engine.F32, 64, 1), p.rand(engine.F32, 64, 1)
	for _, tc := range []struct {
		name string
		run  func()
		want string
	}{
		{"strideC 0", func() { p.d.GemmBatched(false, false, 2, 2, 2, 1, a.d, 2, 4, b.d, 2, 4, 0, c.d, 2, 0, 3) }, "overlap"},
		{"overlapping C", func() { p.d.GemmBatched(false, false, 2, 4, 2, 1, a.d, 2, 4, b.d, 4, 8, 0, c.d, 4, 2, 2) }, "overlap"},
		{"past the end", func() { p.d.GemmBatched(false, false, 4, 4, 4, 1, a.d, 4, 16, b.d, 4, 16, 0, c.d, 4, 16, 5) }, "elements"},
	} {
		tc.run()
		if err := p.d.Sync(); !errors.Is(err, engine.ErrDevice) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
	// Heads side by side (ldc 8, strideC 2) do not overlap.
	p.d.GemmBatched(false, false, 2, 2, 2, 1, a.d, 2, 4, b.d, 2, 4, 0, c.d, 8, 2, 4)
	if err := p.d.Sync(); err != nil {
		t.Errorf("side-by-side C matrices: %v", err)
	}
	for i, want := range map[[5]int]int{
		{2, 2, 2, 4, 3}: 0, {2, 2, 8, 2, 4}: 0, {2, 2, 2, 0, 2}: 1, {3, 4, 4, 8, 3}: 1, {3, 4, 4, 4, 3}: 1, {3, 4, 5, 9, 3}: 1, {3, 4, 5, 11, 3}: 1, {3, 4, 5, 15, 3}: 0,
	} {
		if got := overlapping(i[0], i[1], i[2], i[3], i[4]); got != want {
			t.Errorf("overlapping(rows %d, cols %d, ld %d, stride %d, batch %d) = %d, want %d", i[0], i[1], i[2], i[3], i[4], got, want)
		}
	}
}

func TestAxpby(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, ab := range [][2]float32{{1, 1}, {0.125, 0}, {-2, 0.75}} {
			x, y := p.rand(ty, 5000, 3), p.rand(ty, 5000, 3)
			p.h.Axpby(y.h, x.h, ab[0], ab[1])
			p.d.Axpby(y.d, x.d, ab[0], ab[1])
			p.same(fmt.Sprintf("Axpby a=%g b=%g", ab[0], ab[1]), y, 1, 0)
			p.h.Axpby(x.h, x.h, ab[0], ab[1]) // x is y
			p.d.Axpby(x.d, x.d, ab[0], ab[1])
			p.same(fmt.Sprintf("Axpby in place a=%g b=%g", ab[0], ab[1]), x, 1, 0)
		}
		// b = 0 does not read y (NaN there stays out).
		x, y := p.rand(ty, 100, 1), p.buf(ty, 100, nil)
		p.h.Fill(y.h, float32(math.NaN()))
		p.d.Fill(y.d, float32(math.NaN()))
		p.h.Axpby(y.h, x.h, 2, 0)
		p.d.Axpby(y.d, x.d, 2, 0)
		if _, got := p.get(y); math.IsNaN(float64(got[0])) {
			t.Errorf("Axpby %v with b = 0 read y", ty)
		}
	}
}

func TestCopyRows(t *testing.T) {
	p := newPair(t)
	for _, dt := range floatTypes {
		for _, st := range floatTypes {
			for _, s := range [][4]int{{5, 7, 9, 11}, {64, 300, 300, 310}, {3, 4, 6, 0}, {1, 1, 1, 1}} {
				rows, cols, ldDst, ldSrc := s[0], s[1], s[2], s[3]
				srcRows := rows
				if ldSrc == 0 {
					srcRows = 1
				}
				src := p.rand(st, engine.StridedLen(srcRows, cols, ldSrc)+3, 10)
				dst := p.rand(dt, engine.StridedLen(rows, cols, ldDst)+2, 10)
				p.h.CopyRows(dst.h, ldDst, src.h, ldSrc, rows, cols)
				p.d.CopyRows(dst.d, ldDst, src.d, ldSrc, rows, cols)
				p.exact(fmt.Sprintf("CopyRows %v→%v %v", st, dt, s), dst)
			}
		}
	}
}

// rowShapes are rows×cols for the row operations: one element, odd, more rows than the grid
// has warps (128 blocks of 8 on the emulator's 4 SMs), the longest rows a warp takes
// (warpRowMax) and the shortest a block does, rows longer than a block.
var rowShapes = [][2]int{{1, 1}, {3, 7}, {1100, 33}, {20, warpRowMax}, {9, warpRowMax + 1}, {5, 1000}}

func TestLayerNorm(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range rowShapes {
			rows, cols := s[0], s[1]
			what := fmt.Sprintf("LayerNorm %dx%d", rows, cols)
			x := p.buf(ty, rows*cols, p.shifted(rows*cols, 2, 3))
			gamma, beta := p.rand(ty, cols, 2), p.rand(ty, cols, 1)
			y := p.buf(ty, rows*cols, nil)
			mean, rstd := p.buf(engine.F32, rows, nil), p.buf(engine.F32, rows, nil)
			p.h.LayerNorm(y.h, mean.h, rstd.h, x.h, gamma.h, beta.h, rows, cols, 1e-5)
			p.d.LayerNorm(y.d, mean.d, rstd.d, x.d, gamma.d, beta.d, rows, cols, 1e-5)
			p.same(what+" mean", mean, 64, 1e-6)
			p.same(what+" rstd", rstd, 64, 0)
			p.near(what+" y", y, 2, 2e-6)

			for _, b := range []float32{0, 0.5} {
				for _, frozen := range []bool{false, true} {
					dy := p.rand(ty, rows*cols, 1)
					dx := p.buf(ty, rows*cols, nil)
					dgamma, dbeta := p.rand(ty, cols, 1), p.rand(ty, cols, 1)
					dg := dgamma
					if frozen {
						dg = invalid
					}
					what := fmt.Sprintf("%s backward b=%g frozen gamma=%v", what, b, frozen)
					p.h.LayerNormBackward(dx.h, dg.h, dbeta.h, dy.h, x.h, mean.h, rstd.h, gamma.h, rows, cols, b)
					p.d.LayerNormBackward(dx.d, dg.d, dbeta.d, dy.d, x.d, mean.d, rstd.d, gamma.d, rows, cols, b)
					p.near(what+" dx", dx, 2, 2e-5)
					p.near(what+" dgamma", dgamma, 2, 2e-6*math.Sqrt(float64(rows)))
					p.near(what+" dbeta", dbeta, 2, 2e-6*math.Sqrt(float64(rows)))
				}
			}
			// dx aliasing dy, parameters frozen; then only the parameters' gradients.
			dy := p.rand(ty, rows*cols, 1)
			p.h.LayerNormBackward(dy.h, invalid.h, invalid.h, dy.h, x.h, mean.h, rstd.h, gamma.h, rows, cols, 0)
			p.d.LayerNormBackward(dy.d, invalid.d, invalid.d, dy.d, x.d, mean.d, rstd.d, gamma.d, rows, cols, 0)
			p.near(what+" backward in place", dy, 2, 2e-5)
			dgamma, dbeta := p.rand(ty, cols, 1), p.rand(ty, cols, 1)
			p.h.LayerNormBackward(invalid.h, dgamma.h, dbeta.h, dy.h, x.h, mean.h, rstd.h, gamma.h, rows, cols, 1)
			p.d.LayerNormBackward(invalid.d, dgamma.d, dbeta.d, dy.d, x.d, mean.d, rstd.d, gamma.d, rows, cols, 1)
			p.near(what+" backward without dx: dgamma", dgamma, 2, 2e-6*math.Sqrt(float64(rows)))
			p.near(what+" backward without dx: dbeta", dbeta, 2, 2e-6*math.Sqrt(float64(rows)))
		}
	}
}

// shifted is n values uniform in [offset − scale, offset + scale): a mean far from 0, so that
// a one-pass variance would cancel.
func (p *pair) shifted(n int, scale, offset float32) []float32 {
	v := p.vals(n, scale)
	for i := range v {
		v[i] += offset
	}
	return v
}

func TestGELU(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		v := p.vals(20000, 6)
		copy(v, []float32{0, float32(math.Copysign(0, -1)), 1, -1, 10, -10, 30, -30, 1e-20, -1e-20})
		x, y := p.buf(ty, len(v), v), p.buf(ty, len(v), nil)
		p.h.GELU(y.h, x.h)
		p.d.GELU(y.d, x.d)
		// Relative to the largest value: fp32's rounding of x/√2 alone moves Φ's left tail
		// by 2·(x²/2)·2⁻²⁴ relative (1e-6 at x = −4).
		p.near("GELU", y, ulpsOf(ty, 8), 1e-7)
		dy := p.rand(ty, len(v), 2)
		dx := p.buf(ty, len(v), nil)
		p.h.GELUGrad(dx.h, dy.h, x.h)
		p.d.GELUGrad(dx.d, dy.d, x.d)
		// Φ(x) + x·φ(x) cancels near x = −0.75: an absolute tolerance.
		p.near("GELUGrad", dx, ulpsOf(ty, 8), 1e-6)
		p.h.GELUGrad(dy.h, dy.h, x.h) // dx is dy
		p.d.GELUGrad(dy.d, dy.d, x.d)
		p.near("GELUGrad in place", dy, ulpsOf(ty, 8), 1e-6)
	}
}

func TestDropout(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, pr := range []float32{0, 0.1, 0.5, 1} {
			for _, seed := range []uint64{0, 42, 1 << 63} {
				n := 70001
				x := p.rand(ty, n+5, 2)
				y := p.buf(ty, n, nil)
				// A view 5 elements into x: the mask is indexed from the view's start.
				xv := twin{x.h.Slice(5, 5+n), x.d.Slice(5, 5+n), n, ty}
				p.h.Dropout(y.h, xv.h, pr, seed)
				p.d.Dropout(y.d, xv.d, pr, seed)
				what := fmt.Sprintf("Dropout p=%g seed=%d", pr, seed)
				p.exact(what, y)
				_, got := p.get(y)
				_, in := p.get(xv)
				kept := 0
				for i, g := range got {
					keep := engine.DropoutKeep(seed, uint64(i), pr)
					if keep {
						kept++
					}
					if keep != (g != 0 || in[i] == 0) {
						t.Fatalf("%s [%v]: element %d is %v (x %v), DropoutKeep says %v", what, ty, i, g, in[i], keep)
					}
				}
				if frac := float64(kept) / float64(n); math.Abs(frac-(1-float64(pr))) > 0.01 {
					t.Errorf("%s [%v]: kept %.4f of the elements", what, ty, frac)
				}
				p.h.Dropout(x.h, x.h, pr, seed) // y is x
				p.d.Dropout(x.d, x.d, pr, seed)
				p.exact(what+" in place", x)
			}
		}
	}
}

func TestSoftmax(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range rowShapes {
			for _, scale := range []float32{1, 0.125, -3} {
				rows, cols := s[0], s[1]
				what := fmt.Sprintf("Softmax %dx%d scale=%g", rows, cols, scale)
				x, y := p.rand(ty, rows*cols, 8), p.buf(ty, rows*cols, nil)
				p.h.Softmax(y.h, x.h, rows, cols, scale)
				p.d.Softmax(y.d, x.d, rows, cols, scale)
				// Σ exp in another order: relative to each value, as the small ones matter.
				p.same(what, y, ulpsOf(ty, 64), 1e-30)
				dy, dx := p.rand(ty, rows*cols, 1), p.buf(ty, rows*cols, nil)
				p.h.SoftmaxGrad(dx.h, dy.h, y.h, rows, cols, scale)
				p.d.SoftmaxGrad(dx.d, dy.d, y.d, rows, cols, scale)
				p.near(what+" grad", dx, 2, 1e-6)
				p.h.SoftmaxGrad(dy.h, dy.h, y.h, rows, cols, scale) // dx is dy
				p.d.SoftmaxGrad(dy.d, dy.d, y.d, rows, cols, scale)
				p.near(what+" grad in place", dy, 2, 1e-6)
				p.h.Softmax(x.h, x.h, rows, cols, scale) // y is x
				p.d.Softmax(x.d, x.d, rows, cols, scale)
				p.same(what+" in place", x, ulpsOf(ty, 64), 1e-30)
			}
		}
	}
}

func TestPatchify(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range [][5]int{{2, 3, 8, 12, 4}, {1, 1, 5, 5, 1}, {3, 2, 6, 6, 6}, {4, 3, 32, 32, 8}} {
			n, c, h, w, ps := s[0], s[1], s[2], s[3], s[4]
			x, cols := p.rand(ty, n*c*h*w, 5), p.buf(ty, n*c*h*w, nil)
			p.h.Patchify(cols.h, x.h, n, c, h, w, ps)
			p.d.Patchify(cols.d, x.d, n, c, h, w, ps)
			p.exact(fmt.Sprintf("Patchify %v", s), cols)
			dx := p.buf(ty, n*c*h*w, nil)
			p.h.Unpatchify(dx.h, cols.h, n, c, h, w, ps)
			p.d.Unpatchify(dx.d, cols.d, n, c, h, w, ps)
			p.exact(fmt.Sprintf("Unpatchify %v", s), dx)
			href, got := p.get(x)
			_, back := p.get(dx)
			for i := range got {
				if back[i] != got[i] || href[i] != got[i] {
					t.Fatalf("Unpatchify(Patchify(x)) [%v] %v: element %d is %v, x %v", ty, s, i, back[i], got[i])
				}
			}
		}
	}
}

func TestBatchNorm(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range [][3]int{{4, 3, 49}, {2, 200, 1}, {1, 1, 1000}, {64, 16, 64}, {1, 2, 1}} {
			n, c, hw := s[0], s[1], s[2]
			what := fmt.Sprintf("BatchNorm %v", s)
			x := p.buf(ty, n*c*hw, p.shifted(n*c*hw, 2, -3))
			gamma, beta := p.rand(ty, c, 2), p.rand(ty, c, 1)
			y := p.buf(ty, n*c*hw, nil)
			mean, rstd := p.buf(engine.F32, c, nil), p.buf(engine.F32, c, nil)
			p.h.BatchNorm(y.h, mean.h, rstd.h, x.h, gamma.h, beta.h, n, c, hw, 1e-5, true)
			p.d.BatchNorm(y.d, mean.d, rstd.d, x.d, gamma.d, beta.d, n, c, hw, 1e-5, true)
			p.same(what+" mean", mean, 64, 1e-6)
			p.same(what+" rstd", rstd, 64, 0)
			p.near(what+" y", y, 2, 1e-5)

			for _, b := range []float32{0, 0.5} {
				for _, frozen := range []bool{false, true} {
					dy := p.rand(ty, n*c*hw, 1)
					dx := p.buf(ty, n*c*hw, nil)
					dgamma, dbeta := p.rand(ty, c, 1), p.rand(ty, c, 1)
					db := dbeta
					if frozen {
						db = invalid
					}
					what := fmt.Sprintf("%s backward b=%g frozen beta=%v", what, b, frozen)
					p.h.BatchNormBackward(dx.h, dgamma.h, db.h, dy.h, x.h, mean.h, rstd.h, gamma.h, n, c, hw, b)
					p.d.BatchNormBackward(dx.d, dgamma.d, db.d, dy.d, x.d, mean.d, rstd.d, gamma.d, n, c, hw, b)
					p.near(what+" dx", dx, 2, 1e-4)
					p.near(what+" dgamma", dgamma, 2, 2e-6*math.Sqrt(float64(n*hw)))
					p.near(what+" dbeta", dbeta, 2, 2e-6*math.Sqrt(float64(n*hw)))
				}
			}
			dy := p.rand(ty, n*c*hw, 1)
			p.h.BatchNormBackward(dy.h, invalid.h, invalid.h, dy.h, x.h, mean.h, rstd.h, gamma.h, n, c, hw, 0)
			p.d.BatchNormBackward(dy.d, invalid.d, invalid.d, dy.d, x.d, mean.d, rstd.d, gamma.d, n, c, hw, 0)
			p.near(what+" backward in place", dy, 2, 1e-4)

			// Evaluation: the statistics are inputs; y may alias x.
			p.h.BatchNorm(x.h, mean.h, rstd.h, x.h, gamma.h, beta.h, n, c, hw, 1e-5, false)
			p.d.BatchNorm(x.d, mean.d, rstd.d, x.d, gamma.d, beta.d, n, c, hw, 1e-5, false)
			p.near(what+" evaluation in place", x, 2, 1e-5)
		}
	}
}

// TestTransformerErrors: the arguments are checked before anything is queued.
func TestTransformerErrors(t *testing.T) {
	p := newPair(t)
	x, y := p.rand(engine.F32, 12, 1), p.rand(engine.F32, 12, 1)
	h := p.rand(engine.F16, 12, 1)
	st := p.buf(engine.F32, 3, nil)
	for _, tc := range []struct {
		name, want string
		run        func()
	}{
		{"Axpby lengths", "elements", func() { p.d.Axpby(y.d, x.d.Slice(0, 11), 1, 1) }},
		{"Axpby types", "one type", func() { p.d.Axpby(y.d, h.d, 1, 1) }},
		{"CopyRows extent", "need", func() { p.d.CopyRows(y.d, 4, x.d, 4, 4, 4) }},
		{"LayerNorm shape", "rows×cols", func() { p.d.LayerNorm(y.d, st.d, st.d, x.d, x.d.Slice(0, 4), x.d.Slice(0, 4), 3, 5, 1e-5) }},
		{"LayerNorm stats", "f32", func() { p.d.LayerNorm(y.d, h.d.Slice(0, 3), st.d, x.d, x.d.Slice(0, 4), x.d.Slice(0, 4), 3, 4, 1e-5) }},
		{"Dropout p", "probability", func() { p.d.Dropout(y.d, x.d, 1.5, 1) }},
		{"Softmax shape", "rows×cols", func() { p.d.Softmax(y.d, x.d, 5, 2, 1) }},
		{"Patchify shape", "multiples", func() { p.d.Patchify(y.d, x.d, 1, 3, 2, 2, 3) }},
		{"BatchNorm gamma", "gamma", func() { p.d.BatchNorm(y.d, st.d, st.d, x.d, x.d, x.d.Slice(0, 3), 2, 3, 2, 1e-5, true) }},
	} {
		tc.run()
		if err := p.d.Sync(); !errors.Is(err, engine.ErrDevice) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

// TestNetMatchesReferenceViT is TestNetMatchesReference for a small Vision Transformer (patch
// embedding, class token, pre-norm blocks with attention and a GELU MLP, residual adds).
func TestNetMatchesReferenceViT(t *testing.T) {
	vit := model.Config{Type: model.TypeViT, Patch: 7, Dim: 32, Depth: 2, Heads: 4, MLPRatio: 2}
	for _, tc := range []netCase{{"vit/fp32", vit, half.FP32, 1e-4}, {"vit/bf16", vit, half.BF16, 5e-2}} {
		t.Run(tc.name, func(t *testing.T) {
			r := compareNets(t, tc, dev)
			t.Logf("loss relative error %.3g, gradient relative error %.3g; device peak %d B", r.loss, r.grad, r.peak)
			if r.loss > tc.tol {
				t.Errorf("loss or evaluation differ: relative error %.3g > %.3g", r.loss, tc.tol)
			}
			if r.grad > tc.tol {
				t.Errorf("gradients differ: relative error %.3g > %.3g", r.grad, tc.tol)
			}
		})
	}
}
