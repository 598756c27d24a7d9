package enginetest

import (
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// gapValue fills the gaps between the rows of a strided C, which GemmLD must not write.
const gapValue = 5.5

// gemmCase is one product: C (m×n) = alpha·op(A)·op(B) + beta·C.
type gemmCase struct {
	transA, transB bool
	m, n, k        int
	alpha, beta    float32
	ab, c          engine.DType // A and B's type, C's
	lda, ldb, ldc  int          // 0: contiguous (Gemm); else GemmLD with these
}

func (g gemmCase) String() string {
	s := fmt.Sprintf("%dx%dx%d transA=%v transB=%v alpha=%v beta=%v %v·%v→%v", g.m, g.n, g.k, g.transA, g.transB, g.alpha, g.beta, g.ab, g.ab, g.c)
	if g.ldc > 0 {
		s += fmt.Sprintf(" ld=%d,%d,%d", g.lda, g.ldb, g.ldc)
	}
	return s
}

// stored is the shape of a matrix as it lies in memory: op(X) is rows×cols, X is stored
// transposed when trans.
func stored(rows, cols int, trans bool) (r, c int) {
	if trans {
		return cols, rows
	}
	return rows, cols
}

// stridedLen is engine.StridedLen.
var stridedLen = engine.StridedLen

// strided allocates a rows×cols matrix of type t whose rows lie ld apart (ld 0: cols), with
// the gaps set to gap and the rows to N(0, 1) draws (nil vals) or vals; it returns the view
// (exactly its strided extent) and what it holds.
func (h *harness) strided(rows, cols, ld int, t engine.DType, gap float32, vals []float32) (engine.Buf, []float32) {
	h.t.Helper()
	if ld == 0 {
		ld = max(cols, 1)
	}
	n := stridedLen(rows, cols, ld)
	all := make([]float32, n)
	if vals == nil {
		vals = h.normal(rows*cols, 1)
	}
	for i := range all {
		r, c := i/ld, i%ld
		if c < cols {
			all[i] = vals[r*cols+c]
		} else {
			all[i] = gap
		}
	}
	b := h.alloc(n, t)
	return b, h.put(b, all)
}

// runGemm runs one case on fresh buffers and checks C, including that its gaps are not
// written.
func (h *harness) runGemm(g gemmCase, cInit func(n int) []float32) {
	h.t.Helper()
	ar, ac := stored(g.m, g.k, g.transA)
	br, bc := stored(g.k, g.n, g.transB)
	nan := float32(math.NaN())
	a, A := h.strided(ar, ac, g.lda, g.ab, nan, nil)
	b, B := h.strided(br, bc, g.ldb, g.ab, nan, nil)
	c, C0 := h.strided(g.m, g.n, g.ldc, g.c, gapValue, cInit(g.m*g.n))
	lda, ldb, ldc := max(g.lda, ac, 1), max(g.ldb, bc, 1), max(g.ldc, g.n, 1)
	if g.ldc == 0 {
		h.d.Gemm(g.transA, g.transB, g.m, g.n, g.k, g.alpha, a, b, g.beta, c)
	} else {
		h.d.GemmLD(g.transA, g.transB, g.m, g.n, g.k, g.alpha, a, lda, b, ldb, g.beta, c, ldc)
	}
	got := h.get(c)
	at := func(i, p int) float64 {
		if g.transA {
			return float64(A[p*lda+i])
		}
		return float64(A[i*lda+p])
	}
	bt := func(p, j int) float64 {
		if g.transB {
			return float64(B[j*ldb+p])
		}
		return float64(B[p*ldb+j])
	}
	var gotRows []float32
	var want, mag []float64
	gaps := h.check("gemm %v: gaps of C", g)
	for i := range got {
		r, j := i/ldc, i%ldc
		if j >= g.n {
			if got[i] != gapValue {
				gaps.add("element %d (row %d, column %d) is %v", i, r, j, got[i])
			}
			continue
		}
		var s, sa float64
		for p := 0; p < g.k; p++ {
			v := at(r, p) * bt(p, j)
			s += v
			sa += math.Abs(v)
		}
		w := float64(g.alpha) * s
		mg := math.Abs(float64(g.alpha)) * sa
		if g.beta != 0 {
			w += float64(g.beta) * float64(C0[i])
			mg += math.Abs(float64(g.beta) * float64(C0[i]))
		}
		gotRows = append(gotRows, got[i])
		want = append(want, w)
		mag = append(mag, mg)
	}
	gaps.done()
	h.near(fmt.Sprintf("gemm %v", g), g.c, gotRows, want, mag, g.k+1)
}

// cInit is what C holds before a product: NaNs when beta is 0 (C must not be read), N(0, 1)
// draws otherwise.
func (h *harness) cInit(beta float32) func(int) []float32 {
	if beta == 0 {
		return nans
	}
	return func(n int) []float32 { return h.normal(n, 1) }
}

// gemmTypes are the (A and B, C) type pairs: one type throughout, or half inputs into an
// fp32 C (what cublasGemmEx accepts).
var gemmTypes = [][2]engine.DType{
	{engine.F32, engine.F32}, {engine.F16, engine.F16}, {engine.BF16, engine.BF16},
	{engine.F16, engine.F32}, {engine.BF16, engine.F32},
}

var gemmShapes = [][3]int{
	{1, 1, 1}, {2, 3, 4}, {7, 5, 3}, {16, 16, 16}, {33, 17, 65}, {5, 40, 129}, {64, 31, 9},
	{1500, 8, 200}, // tall and narrow: the CPU backend cuts it by rows
	{40, 300, 200}, // wide: by columns
}

// TestGemm checks Gemm for the four transpose combinations, several shapes and betas
// (beta 0 on a C full of NaN, which must not be read), in every type pair.
func TestGemm(t *testing.T, newDevice NewDevice) {
	for _, ty := range gemmTypes {
		t.Run(ty[0].String()+"-"+ty[1].String(), func(t *testing.T) {
			h := newHarness(t, newDevice)
			for _, s := range gemmShapes {
				for tr := range 4 {
					for bi, beta := range []float32{0, 1, 0.5} {
						if s[0]*s[1]*s[2] > 1<<20 && bi != tr%3 {
							continue // the large shapes once per transpose combination
						}
						alpha := []float32{1, -0.75}[(tr+bi)%2]
						h.runGemm(gemmCase{transA: tr&1 != 0, transB: tr&2 != 0, m: s[0], n: s[1], k: s[2],
							alpha: alpha, beta: beta, ab: ty[0], c: ty[1]}, h.cInit(beta))
					}
				}
			}
		})
	}
}

// TestGemmLD checks GemmLD on blocks of larger matrices: rows lie further apart than their
// length, views end exactly at their strided extent, the gaps of A and B hold NaN (never
// read) and those of C a value that must survive.
func TestGemmLD(t *testing.T, newDevice NewDevice) {
	for _, ty := range gemmTypes {
		t.Run(ty[0].String()+"-"+ty[1].String(), func(t *testing.T) {
			h := newHarness(t, newDevice)
			for si, s := range gemmShapes[:7] {
				for tr := range 4 {
					for bi, beta := range []float32{0, 1, 0.5} {
						ta, tb := tr&1 != 0, tr&2 != 0
						_, ac := stored(s[0], s[2], ta)
						_, bc := stored(s[2], s[1], tb)
						pad := []int{0, 1, 5}[(si+bi)%3]
						alpha := []float32{1, 1.5}[(tr+bi)%2] // 1: the CPU backend's own kernels can run
						h.runGemm(gemmCase{transA: ta, transB: tb, m: s[0], n: s[1], k: s[2], alpha: alpha, beta: beta,
							ab: ty[0], c: ty[1], lda: ac + pad, ldb: bc + (pad+3)%4, ldc: s[1] + 1 + pad}, h.cInit(beta))
					}
				}
			}
		})
	}
}

// TestGemmEmpty checks the degenerate products on fresh devices: k = 0 (C = beta·C, and zeros
// for beta 0 whatever C held), and m = 0 or n = 0 (nothing happens), through Gemm and GemmLD.
func TestGemmEmpty(t *testing.T, newDevice NewDevice) {
	for _, ty := range gemmTypes {
		for _, ld := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v-%v-ld=%v", ty[0], ty[1], ld), func(t *testing.T) {
				h := newHarness(t, newDevice)
				for _, s := range [][3]int{{3, 4, 0}, {0, 4, 3}, {3, 0, 4}, {0, 0, 0}, {1, 1, 0}} {
					for tr := range 4 {
						for _, beta := range []float32{0, 1, -2} {
							g := gemmCase{transA: tr&1 != 0, transB: tr&2 != 0, m: s[0], n: s[1], k: s[2],
								alpha: 1, beta: beta, ab: ty[0], c: ty[1]}
							if ld {
								_, ac := stored(g.m, g.k, g.transA)
								_, bc := stored(g.k, g.n, g.transB)
								g.lda, g.ldb, g.ldc = ac+2, bc+1, g.n+3
							}
							h.runGemm(g, h.cInit(beta))
							h.sync(g.String())
						}
					}
				}
			})
		}
	}
}
