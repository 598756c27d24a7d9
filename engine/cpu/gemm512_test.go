package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// The convolutions' AVX-512 products agree with OpenBLAS on every form they take, on the
// shipped CNN's shapes and on ragged ones (tails of rows, columns and k in every tile), with
// leading dimensions wider than the matrices, and write nothing outside C's block; so do the
// products with a bias per row (a convolution's forward pass).
func TestSgemm512MatchesBLAS(t *testing.T) {
	cases := []gemmCase{
		{false, false, 64, 196, 288}, // conv2 forward
		{true, false, 288, 196, 64},  // conv2 input gradient
		{false, true, 64, 288, 196},  // conv2 weight gradient
		{false, false, 32, 784, 9},   // conv1 forward
		{false, true, 32, 9, 784},    // conv1 weight gradient
		{false, false, 1, 1, 1},
		{false, false, 7, 33, 17},
		{false, false, 9, 16, 3},
		{false, false, 17, 47, 31},
		{true, false, 13, 31, 5},
		{true, false, 8, 32, 16},
		{false, true, 1, 1, 1},
		{false, true, 5, 7, 15},
		{false, true, 6, 3, 33},
		{false, true, 9, 13, 200},
		{false, true, 33, 40, 50},    // whole 16 × 16 tiles of the transpose and edges on both sides
		{false, false, 288, 64, 196}, // conv2 weight gradient, transposed: cols · dyᵀ
		{false, false, 9, 32, 784},   // conv1 weight gradient, transposed
	}
	kernel := gemmKernel{
		gemm: func(transA bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) bool {
			return sgemm512(transA, false, m, n, k, a, lda, b, ldb, beta, c, ldc)
		},
		transpose: transpose512,
		declined:  "no AVX-512F on this CPU (or QVD_GEMM=blas): the convolutions use OpenBLAS",
	}
	matchBLAS(t, rand.New(rand.NewPCG(1, 2)), cases, kernel, func(t *testing.T, c gemmCase, a []float32, lda int, b []float32, ldb int, c0 []float32, ldc int) {
		if c.transA || c.transB {
			return
		}
		// With a bias per row: A·B + bias.
		fill := normals(rand.New(rand.NewPCG(uint64(c.m), uint64(c.n))))
		bias := fill(c.m)
		got, want := append([]float32(nil), c0...), append([]float32(nil), c0...)
		if !sgemm512Bias(c.m, c.n, c.k, a, lda, b, ldb, bias, got, ldc) {
			t.Fatal("sgemm512Bias declined a product sgemm512 ran")
		}
		sgemmBLAS(false, false, c.m, c.n, c.k, a, lda, b, ldb, 0, want, ldc)
		for i := range c.m {
			for j := range c.n {
				want[i*ldc+j] += bias[i]
			}
		}
		check(t, c.m, c.n, c.k, ldc, got, want, c0)
	})
}

// gemmCase is one product a kernel is checked on: op(A) m×k times op(B) k×n.
type gemmCase struct {
	transA, transB bool
	m, n, k        int
}

// gemmKernel is one of qvd's kernels as the tests drive it: the product of A (op'd) and B
// as stored k × n, the transpose the engine gives it B through for NT, and why it may
// decline on this CPU.
type gemmKernel struct {
	gemm      func(transA bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) bool
	transpose func(dst []float32, ldd int, src []float32, lds, rows, cols int)
	declined  string
}

// matchBLAS checks kernel against OpenBLAS on every case, beta 0 and 1, with leading
// dimensions wider than the matrices and C's columns past n watched; more, if not nil, runs
// further checks on each beta-0 case's operands.
func matchBLAS(t *testing.T, rng *rand.Rand, cases []gemmCase, kernel gemmKernel,
	more func(t *testing.T, c gemmCase, a []float32, lda int, b []float32, ldb int, c0 []float32, ldc int)) {
	fill := normals(rng)
	for _, c := range cases {
		for _, beta := range []float32{0, 1} {
			name := fmt.Sprintf("transA=%v,transB=%v,%dx%dx%d,beta=%v", c.transA, c.transB, c.m, c.n, c.k, beta)
			t.Run(name, func(t *testing.T) {
				ar, ac, br, bc := operands(c.transA, c.transB, c.m, c.n, c.k)
				lda, ldb, ldc := ac+3, bc+5, c.n+7
				a, b := fill(ar*lda), fill(br*ldb)
				c0 := fill(c.m * ldc)
				got, want := append([]float32(nil), c0...), append([]float32(nil), c0...)
				bb, ldbb := b, ldb
				if c.transB { // the kernels take B itself: through Bᵀ, as the engine gives it
					bb, ldbb = make([]float32, c.k*c.n), c.n
					kernel.transpose(bb, ldbb, b, ldb, c.n, c.k)
				}
				if !kernel.gemm(c.transA, c.m, c.n, c.k, a, lda, bb, ldbb, beta, got, ldc) {
					t.Skip(kernel.declined)
				}
				sgemmBLAS(c.transA, c.transB, c.m, c.n, c.k, a, lda, b, ldb, beta, want, ldc)
				check(t, c.m, c.n, c.k, ldc, got, want, c0)
				if more != nil && beta == 0 {
					more(t, c, a, lda, b, ldb, c0, ldc)
				}
			})
		}
	}
}

// check compares C's m×n block (leading dimension ldc) with OpenBLAS's, and the columns
// past n with what they held before.
func check(t *testing.T, m, n, k, ldc int, got, want, c0 []float32) {
	t.Helper()
	for i := range m {
		for j := range ldc {
			g, w := got[i*ldc+j], want[i*ldc+j]
			if j >= n {
				if g != c0[i*ldc+j] {
					t.Fatalf("C[%d,%d] outside the %d columns was written: %v, was %v", i, j, n, g, c0[i*ldc+j])
				}
				continue
			}
			// Summation orders differ: allow a few ulps of the sum of |terms|.
			tol := 1e-5 * (math.Sqrt(float64(k))*2 + 1)
			if d := math.Abs(float64(g - w)); d > tol {
				t.Fatalf("C[%d,%d] = %v, OpenBLAS gives %v (|diff| %.3g > %.3g)", i, j, g, w, d, tol)
			}
		}
	}
}

// A wrong kernel does not pass: the comparison catches a product with one term left out.
func TestSgemm512ComparisonCatches(t *testing.T) {
	checkCatches(t, func(m, n, k int, a, b, c []float32) bool { return sgemm512(false, false, m, n, k, a, k, b, n, 0, c, n) },
		"no AVX-512F on this CPU (or QVD_GEMM=blas)", 8, 32, 16, []int{5}, []int{4})
}

// checkCatches runs gemm (C = A·B, A m×k, B k×n, contiguous) on all-ones operands, checks
// every element is k, then zeroes B[3, j] for each j of dropped and checks that C[0, j]
// loses that one term while C[0, j] for each j of intact keeps k.
func checkCatches(t *testing.T, gemm func(m, n, k int, a, b, c []float32) bool, declined string, m, n, k int, dropped, intact []int) {
	t.Helper()
	a, b := make([]float32, m*k), make([]float32, k*n)
	for i := range a {
		a[i] = 1
	}
	for i := range b {
		b[i] = 1
	}
	got := make([]float32, m*n)
	if !gemm(m, n, k, a, b, got) {
		t.Skip(declined)
	}
	for i, v := range got {
		if v != float32(k) {
			t.Fatalf("C[%d] = %v, want %d", i, v, k)
		}
	}
	for _, j := range dropped {
		b[3*n+j] = 0
	}
	gemm(m, n, k, a, b, got)
	for _, j := range dropped {
		if got[j] != float32(k-1) {
			t.Fatalf("with B[3,%d] = 0: C[0,%d] = %v, want %d", j, j, got[j], k-1)
		}
	}
	for _, j := range intact {
		if got[j] != float32(k) {
			t.Fatalf("with terms of other columns gone: C[0,%d] = %v, want %d", j, got[j], k)
		}
	}
}

// BenchmarkConvGEMM compares the AVX-512 kernels with OpenBLAS (the kernels
// OPENBLAS_CORETYPE selects) on the shipped CNN's per-sample products, one thread.
func BenchmarkConvGEMM(b *testing.B) {
	shapes := []gemmShape{
		{"conv2-forward", false, false, 64, 196, 288},
		{"conv2-input-grad", true, false, 288, 196, 64},
		{"conv2-weight-grad", false, true, 64, 288, 196},
		{"conv2-weight-grad-transposed", false, false, 288, 64, 196}, // what the kernels run
		{"conv1-weight-grad-transposed", false, false, 9, 32, 784},
		{"conv1-forward", false, false, 32, 784, 9},
		{"conv1-weight-grad", false, true, 32, 9, 784},
	}
	benchGEMMShapes(b, shapes)
}

// BenchmarkDenseGEMM is the same comparison on the shipped MLP's (784-256-128-10) products at
// batch 64, whole (the engine cuts each across its threads): forward x·W (NN), the weight
// gradient xᵀ·dy (TN) and the input gradient dy·Wᵀ (NT).
func BenchmarkDenseGEMM(b *testing.B) {
	benchGEMMShapes(b, []gemmShape{
		{"fc1-forward", false, false, 64, 256, 784},
		{"fc1-weight-grad", true, false, 784, 256, 64},
		{"fc2-forward", false, false, 64, 128, 256},
		{"fc2-weight-grad", true, false, 256, 128, 64},
		{"fc2-input-grad", false, true, 64, 256, 128},
		{"fc3-forward", false, false, 64, 10, 128},
		{"fc3-weight-grad", true, false, 128, 10, 64},
		{"fc3-input-grad", false, true, 64, 128, 10},
	})
}

// BenchmarkCNNDenseGEMM: the shipped CNN's dense layer over the flattened convolutions
// (3136 → 128) at batch 64: k of the forward product is past the kernels' bound, the
// gradients' are not.
func BenchmarkCNNDenseGEMM(b *testing.B) {
	benchGEMMShapes(b, []gemmShape{
		{"fc1-forward", false, false, 64, 128, 3136},
		{"fc1-weight-grad", true, false, 3136, 128, 64},
		{"fc1-input-grad", false, true, 64, 3136, 128},
	})
}

// gemmShape is one product of a benchmark: op(A) m×k times op(B) k×n.
type gemmShape struct {
	name           string
	transA, transB bool
	m, n, k        int
}

func benchGEMMShapes(b *testing.B, shapes []gemmShape) {
	for _, s := range shapes {
		ar, ac, br, bc := operands(s.transA, s.transB, s.m, s.n, s.k)
		a, bm, c := make([]float32, ar*ac), make([]float32, br*bc), make([]float32, s.m*s.n)
		for i := range a {
			a[i] = float32(i%7) * 0.1
		}
		for i := range bm {
			bm[i] = float32(i%5) * 0.1
		}
		flops := 2 * float64(s.m*s.n*s.k)
		b.Run(s.name+"/avx512", func(b *testing.B) {
			if s.transB {
				b.Skip("the kernels have no NT form")
			}
			if !sgemm512(s.transA, s.transB, s.m, s.n, s.k, a, ac, bm, bc, 0, c, s.n) {
				b.Skip("no AVX-512F")
			}
			for b.Loop() {
				sgemm512(s.transA, s.transB, s.m, s.n, s.k, a, ac, bm, bc, 0, c, s.n)
			}
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		b.Run(s.name+"/avx2", func(b *testing.B) {
			// NT pays for its transpose of B, as the engine does.
			bt := make([]float32, s.k*s.n)
			run := func() bool {
				bb, ldbb := bm, bc
				if s.transB {
					transpose256(bt, s.n, bm, bc, s.n, s.k)
					bb, ldbb = bt, s.n
				}
				return sgemm256(s.transA, s.m, s.n, s.k, a, ac, bb, ldbb, 0, c, s.n)
			}
			if !run() {
				b.Skip("no AVX2 and FMA")
			}
			for b.Loop() {
				run()
			}
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
		b.Run(s.name+"/openblas", func(b *testing.B) {
			for b.Loop() {
				sgemmBLAS(s.transA, s.transB, s.m, s.n, s.k, a, ac, bm, bc, 0, c, s.n)
			}
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}

// transpose512 matches the definition on ragged shapes: whole tiles, edges and both.
func TestTranspose512(t *testing.T) {
	checkTranspose(t, transpose512, [][2]int{{1, 1}, {16, 16}, {17, 33}, {32, 7}, {64, 196}, {5, 40}})
}

// checkTranspose checks tr on each rows × cols shape, with leading dimensions wider than
// the blocks and the padding of dst watched.
func checkTranspose(t *testing.T, tr func(dst []float32, ldd int, src []float32, lds, rows, cols int), shapes [][2]int) {
	t.Helper()
	for _, sh := range shapes {
		rows, cols := sh[0], sh[1]
		lds, ldd := cols+3, rows+5
		src := make([]float32, rows*lds)
		for i := range src {
			src[i] = float32(i)
		}
		dst := make([]float32, cols*ldd)
		for i := range dst {
			dst[i] = -1
		}
		tr(dst, ldd, src, lds, rows, cols)
		for j := range cols {
			for i := range ldd {
				want := float32(-1)
				if i < rows {
					want = src[i*lds+j]
				}
				if got := dst[j*ldd+i]; got != want {
					t.Fatalf("%dx%d: dst[%d,%d] = %v, want %v", rows, cols, j, i, got, want)
				}
			}
		}
	}
}

// The implicit-unfolding forward pass equals im2col followed by OpenBLAS's product plus the
// bias, on "same"-padded shapes with image edges in every position of a 32-column block.
func TestConvFwd512MatchesIm2col(t *testing.T) {
	fill := normals(rand.New(rand.NewPCG(3, 4)))
	for _, s := range []struct{ c, h, w, out, k int }{
		{1, 28, 28, 32, 3}, {32, 14, 14, 64, 3}, {3, 7, 7, 5, 3}, {2, 5, 9, 9, 5}, {4, 2, 2, 3, 1}, {1, 1, 5, 2, 3}, {6, 33, 3, 17, 3},
	} {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			pad := (s.k - 1) / 2
			ckk, hw := s.c*s.k*s.k, s.h*s.w
			x, w, bias := fill(s.c*hw), fill(s.out*ckk), fill(s.out)
			got, cols := fill(s.out*hw), make([]float32, ckk*hw)
			if !convFwd512(got, x, w, bias, s.c, s.h, s.w, s.out, s.k, pad, cols) {
				t.Skip("no AVX-512F on this CPU (or QVD_GEMM=blas)")
			}
			im2col(cols, x, s.c, s.h, s.w, s.k, pad)
			want := make([]float32, s.out*hw)
			for o := range s.out {
				for p := range hw {
					want[o*hw+p] = bias[o]
				}
			}
			sgemmBLAS(false, false, s.out, hw, ckk, w, ckk, cols, hw, 1, want, hw)
			check(t, s.out, hw, ckk, hw, got, want, nil)
		})
	}
}

// BenchmarkConvForward is one sample of each of the shipped CNN's convolutions (1 → 32
// channels, 28 × 28; 32 → 64, 14 × 14; 3 × 3): the implicit unfolding against im2col and the
// product.
func BenchmarkConvForward(b *testing.B) {
	for _, s := range []struct {
		name            string
		c, h, w, out, k int
	}{{"conv1", 1, 28, 28, 32, 3}, {"conv2", 32, 14, 14, 64, 3}} {
		c, h, w, out, k, pad := s.c, s.h, s.w, s.out, s.k, (s.k-1)/2
		ckk, hw := c*k*k, h*w
		x, wt, bias := make([]float32, c*hw), make([]float32, out*ckk), make([]float32, out)
		y, cols := make([]float32, out*hw), make([]float32, ckk*hw)
		for i := range x {
			x[i] = float32(i%9) * 0.1
		}
		b.Run(s.name+"/implicit", func(b *testing.B) {
			if !convFwd512(y, x, wt, bias, c, h, w, out, k, pad, cols) {
				b.Skip("no AVX-512F")
			}
			for b.Loop() {
				convFwd512(y, x, wt, bias, c, h, w, out, k, pad, cols)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "samples/s")
		})
		b.Run(s.name+"/im2col", func(b *testing.B) {
			for b.Loop() {
				im2col(cols, x, c, h, w, k, pad)
				if !sgemm512Bias(out, hw, ckk, wt, ckk, cols, hw, bias, y, hw) {
					sgemmBLAS(false, false, out, hw, ckk, wt, ckk, cols, hw, 0, y, hw)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "samples/s")
		})
	}
}

// normals returns a maker of slices of standard normal values drawn from rng.
func normals(rng *rand.Rand) func(n int) []float32 {
	return func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64())
		}
		return x
	}
}

// operands gives the rows and columns of A and B as stored for an m×n×k product.
func operands(transA, transB bool, m, n, k int) (ar, ac, br, bc int) {
	ar, ac, br, bc = m, k, k, n
	if transA {
		ar, ac = k, m
	}
	if transB {
		br, bc = n, k
	}
	return ar, ac, br, bc
}

// The dense layers' AVX2 products agree with OpenBLAS on the MLP's shapes and on ragged ones
// (tails of rows and of the 16-column strips, k of 1), NN and TN, beta 0 and 1, NT through
// the transpose, with leading dimensions wider than the matrices, and write nothing outside
// C's block. They run on AVX-512 machines too (the engine uses them only without AVX-512F).
func TestSgemm256MatchesBLAS(t *testing.T) {
	cases := []gemmCase{
		{false, false, 64, 256, 784}, // fc1 forward
		{true, false, 784, 256, 64},  // fc1 weight gradient
		{false, true, 64, 256, 128},  // fc2 input gradient
		{false, false, 64, 10, 128},  // fc3 forward: one ragged strip
		{false, false, 1, 1, 1},
		{false, false, 7, 33, 17},
		{false, false, 5, 8, 3},
		{false, false, 13, 47, 31},
		{true, false, 13, 31, 5},
		{true, false, 6, 16, 16},
		{false, true, 5, 7, 15},
		{false, true, 9, 13, 200},
		{false, true, 17, 40, 50}, // whole 8 × 8 tiles of the transpose and edges on both sides
	}
	matchBLAS(t, rand.New(rand.NewPCG(3, 4)), cases,
		gemmKernel{gemm: sgemm256, transpose: transpose256, declined: "no AVX2 and FMA on this CPU (or QVD_GEMM=blas)"}, nil)
}

// The AVX2 comparison catches a product with one term left out, in a whole strip and in a
// ragged one.
func TestSgemm256ComparisonCatches(t *testing.T) {
	checkCatches(t, func(m, n, k int, a, b, c []float32) bool { return sgemm256(false, m, n, k, a, k, b, n, 0, c, n) },
		"no AVX2 and FMA on this CPU (or QVD_GEMM=blas)", 6, 20, 16, []int{5, 18}, []int{4, 19})
}

// transpose256 matches the definition on ragged shapes: whole tiles, edges and both.
func TestTranspose256(t *testing.T) {
	checkTranspose(t, transpose256, [][2]int{{1, 1}, {8, 8}, {9, 17}, {16, 7}, {64, 196}, {5, 40}})
}
