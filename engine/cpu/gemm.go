package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"unsafe"

	"github.com/qvd/qvd/engine"
)

// GEMMs are OpenBLAS's sgemm, one thread per call, parallel across the pool: C is cut into
// blocks of columns (or of rows, when it has few columns), and each block is one sgemm call
// on the matching block of A or B. How C is cut depends only on the shape, never on the number
// of threads, and a block's elements are computed exactly as in the whole product (OpenBLAS
// blocks only the k dimension, the same way whatever the block's width), so the result does not
// depend on the thread count.

const (
	// gemmMinFlops is the least work a block gets: below ~1 MFLOP the call and the hand-off
	// cost more than they save.
	gemmMinFlops = 1 << 20
	// gemmMaxBlocks caps the blocks of one product: enough to balance 2–16 threads.
	gemmMaxBlocks = 16
	// gemmAlign keeps block edges on whole 64-byte lines (16 floats) of C.
	gemmAlign = 16
)

type gemmPass struct {
	transA, transB bool
	m, n, k        int
	alpha, beta    float32
	a, b, c        []float32
	lda, ldb, ldc  int
	kernel         int  // qvd's kernels (512: qvd_sgemm512, 256: qvd_sgemm256), 0: OpenBLAS
	byRows         bool // blocks of rows of C (else of columns)
	block          int  // rows or columns per block
	extent         int  // m or n
}

// plan cuts the product into blocks by its shape alone.
func (g *gemmPass) plan() int {
	flops := 2 * g.m * g.n * g.k
	blocks := min(gemmMaxBlocks, max(1, flops/gemmMinFlops))
	g.byRows = g.n < 2*gemmAlign && g.m > g.n
	g.extent = g.n
	if g.byRows {
		g.extent = g.m
	}
	g.block = (g.extent + blocks - 1) / blocks
	if !g.byRows || g.block > gemmAlign {
		g.block = (g.block + gemmAlign - 1) / gemmAlign * gemmAlign
	}
	g.block = max(g.block, 1)
	return (g.extent + g.block - 1) / g.block
}

// Range runs blocks [lo, hi): on qvd's kernels as one call (an element's sum does not
// depend on the tile it falls in), on OpenBLAS one call per block.
func (g *gemmPass) Range(lo, hi int) {
	if g.kernel != 0 {
		g.run(lo*g.block, min(hi*g.block, g.extent))
		return
	}
	for i := lo; i < hi; i++ {
		g.run(i*g.block, min((i+1)*g.block, g.extent))
	}
}

// run computes rows (byRows) or columns [s, e) of C.
func (g *gemmPass) run(s, e int) {
	if s >= e {
		return
	}
	a, b, c := g.a, g.b, g.c
	m, n := g.m, g.n
	if g.byRows {
		// Rows [s, e) of C and of op(A).
		m = e - s
		if g.transA {
			a = a[s:] // A is k×m: columns s..e
		} else {
			a = a[s*g.lda:]
		}
		c = c[s*g.ldc:]
	} else {
		// Columns [s, e) of C and of op(B).
		n = e - s
		if g.transB {
			b = b[s*g.ldb:] // B is n×k: rows s..e
		} else {
			b = b[s:]
		}
		c = c[s:]
	}
	switch {
	case g.kernel == 512 && C.qvd_sgemm512(cbool(g.transA), 0, C.long(m), C.long(n), C.long(g.k), fptr(a), C.long(g.lda),
		fptr(b), C.long(g.ldb), C.float(g.beta), fptr(c), C.long(g.ldc)) != 0:
		return
	case g.kernel == 256 && C.qvd_sgemm256(cbool(g.transA), C.long(m), C.long(n), C.long(g.k), fptr(a), C.long(g.lda),
		fptr(b), C.long(g.ldb), C.float(g.beta), fptr(c), C.long(g.ldc)) != 0:
		return
	}
	C.qvd_sgemm(cbool(g.transA), cbool(g.transB), C.long(m), C.long(n), C.long(g.k), C.float(g.alpha),
		fptr(a), C.long(g.lda), fptr(b), C.long(g.ldb), C.float(g.beta), fptr(c), C.long(g.ldc))
}

// The AVX-512 kernels read B's rows in place, unpacked and without blocking k, and keep an
// 8 × 32 tile of C in registers over the whole of k. That beats OpenBLAS (here pinned to its
// AVX2 kernels) 1.2–2.9× where a 32-column strip of B (k × 128 bytes) stays near the core and
// k is long enough to pay for loading and storing the tile: the MLP's and ViT's products
// (BenchmarkDenseGEMM). At k 4096 (a 512 KiB strip) OpenBLAS's packing wins 4×, at k 16 its
// kernel 1.3×.
const (
	fastMinK = 32
	fastMaxK = 1024
	// fastMinRows is the fewest rows of C for which B is transposed to use the kernels: each
	// element transposed then serves 2·m flops.
	fastMinRows = 16
	// fastMaxSide256 bounds m and n for the AVX2 kernels, which have half the registers and
	// width of the AVX-512 ones and keep up with OpenBLAS's own AVX2 kernels only on small
	// products: the MLP's at batch 64 (fc2's products 76–89 GFLOP/s against 53–84, one
	// thread), and above all as the engine runs them, cut in blocks across threads, where
	// OpenBLAS packs the shared operand again for every block (the MLP trains 25–29% faster
	// on them). Where one side reaches the thousands OpenBLAS's blocking wins: 47–63 against
	// 99–101 GFLOP/s on the CNN's 3136-wide dense layer (BenchmarkCNNDenseGEMM).
	fastMaxSide256 = 1024
)

// fastKernel says which of qvd's kernels a product runs on: 512 (AVX-512F), 256 (AVX2 and
// FMA, where AVX-512F is absent), 0 for OpenBLAS. It depends on the shape and the CPU only,
// never on the thread count, so the bits do not either.
func fastKernel(transB bool, m, n, k int, alpha, beta float32) int {
	if alpha != 1 || (beta != 0 && beta != 1) || k < fastMinK || k > fastMaxK || (transB && m < fastMinRows) {
		return 0
	}
	switch {
	case C.qvd_gemm512_on() != 0:
		return 512
	case C.qvd_gemm256_on() != 0 && m <= fastMaxSide256 && n <= fastMaxSide256:
		return 256
	}
	return 0
}

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

func (d *Device) Gemm(transA, transB bool, m, n, k int, alpha float32, a, b engine.Buf, beta float32, c engine.Buf) {
	if !d.check(a.N == m*k && b.N == k*n && c.N == m*n, "gemm %dx%dx%d on buffers of %d, %d, %d", m, n, k, a.N, b.N, c.N) {
		return
	}
	lda, ldb := engine.ContiguousLDs(transA, transB, m, n, k)
	d.GemmLD(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, max(n, 1))
}

func (d *Device) GemmLD(transA, transB bool, m, n, k int, alpha float32, a engine.Buf, lda int, b engine.Buf, ldb int, beta float32, c engine.Buf, ldc int) {
	if !d.check(engine.GemmFits(transA, transB, m, n, k, a.N, lda, b.N, ldb, c.N, ldc),
		"gemm %dx%dx%d (ld %d, %d, %d) on buffers of %d, %d, %d", m, n, k, lda, ldb, ldc, a.N, b.N, c.N) ||
		!d.check(a.T.Float() && b.T.Float() && c.T.Float(), "gemm of %v·%v into %v", a.T, b.T, c.T) {
		return
	}
	if m == 0 || n == 0 {
		return
	}
	A, B := d.floats(a, 0), d.floats(b, 1)
	C := d.target(c, 2, beta != 0)
	if A == nil || B == nil || C == nil {
		return
	}
	kernel := 0
	if k > 0 {
		kernel = fastKernel(transB, m, n, k, alpha, beta)
	}
	if kernel != 0 && transB {
		// The kernels take B as stored k × n: transpose it into scratch (the MLP's input
		// gradients, dy·Wᵀ with W stored in × out).
		bt := d.scratch(3, k*n)
		if bt == nil {
			return
		}
		if kernel == 512 {
			C.qvd_transpose512(fptr(bt), C.long(n), fptr(B), C.long(ldb), C.long(n), C.long(k))
		} else {
			C.qvd_transpose256(fptr(bt), C.long(n), fptr(B), C.long(ldb), C.long(n), C.long(k))
		}
		B, ldb, transB = bt, n, false
	}
	g := &d.gemm
	*g = gemmPass{transA: transA, transB: transB, m: m, n: n, k: k, alpha: alpha, beta: beta,
		a: A, b: B, c: C, lda: lda, ldb: ldb, ldc: ldc, kernel: kernel}
	if k == 0 {
		// sgemm with k 0 is C = beta·C; do it here, where beta 0 must not read C.
		for i := 0; i < m; i++ {
			row := C[i*ldc : i*ldc+n]
			for j := range row {
				if beta == 0 {
					row[j] = 0
				} else {
					row[j] *= beta
				}
			}
		}
	} else {
		d.pool.Run(g.plan(), 1, g)
	}
	if c.T != engine.F32 {
		// Store the rows of C the product wrote, and only them: the scratch holds garbage in
		// the gaps between rows (and past the last) unless beta made us load C.
		if dst := d.u16(c); dst != nil {
			if ldc == n {
				encode(dst[:m*n], C[:m*n], c.T)
			} else {
				for i := 0; i < m; i++ {
					encode(dst[i*ldc:i*ldc+n], C[i*ldc:i*ldc+n], c.T)
				}
			}
		}
	}
	g.a, g.b, g.c = nil, nil, nil
}

// sgemm512 runs qvd_sgemm512 (the convolutions' AVX-512 products) on row-major slices; false
// where it does not apply. For its tests, which compare it with OpenBLAS.
func sgemm512(transA, transB bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) bool {
	return C.qvd_sgemm512(cbool(transA), cbool(transB), C.long(m), C.long(n), C.long(k), fptr(a), C.long(lda),
		fptr(b), C.long(ldb), C.float(beta), fptr(c), C.long(ldc)) != 0
}

// sgemm256 runs qvd_sgemm256 (the dense layers' AVX2 products) on row-major slices; false
// where it does not apply.
func sgemm256(transA bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) bool {
	return C.qvd_sgemm256(cbool(transA), C.long(m), C.long(n), C.long(k), fptr(a), C.long(lda),
		fptr(b), C.long(ldb), C.float(beta), fptr(c), C.long(ldc)) != 0
}

// transpose256 is qvd_transpose256.
func transpose256(dst []float32, ldd int, src []float32, lds, rows, cols int) {
	C.qvd_transpose256(fptr(dst), C.long(ldd), fptr(src), C.long(lds), C.long(rows), C.long(cols))
}

// sgemmBLAS is OpenBLAS's product on the same operands (alpha 1).
func sgemmBLAS(transA, transB bool, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	C.qvd_sgemm(cbool(transA), cbool(transB), C.long(m), C.long(n), C.long(k), 1, fptr(a), C.long(lda),
		fptr(b), C.long(ldb), C.float(beta), fptr(c), C.long(ldc))
}

// transpose512 is qvd_transpose512: dst[j·ldd + i] = src[i·lds + j] for a rows × cols block.
func transpose512(dst []float32, ldd int, src []float32, lds, rows, cols int) {
	C.qvd_transpose512(fptr(dst), C.long(ldd), fptr(src), C.long(lds), C.long(rows), C.long(cols))
}

// sgemm512Bias is qvd_sgemm512_bias (C = A·B + bias per row).
func sgemm512Bias(m, n, k int, a []float32, lda int, b []float32, ldb int, bias, c []float32, ldc int) bool {
	return C.qvd_sgemm512_bias(C.long(m), C.long(n), C.long(k), fptr(a), C.long(lda), fptr(b), C.long(ldb), fptr(bias),
		fptr(c), C.long(ldc)) != 0
}

// convFwd512 is qvd_conv_fwd512 for one sample; false where it does not apply.
func convFwd512(y, x, w, bias []float32, c, h, wd, out, k, pad int, scratch []float32) bool {
	return C.qvd_conv_fwd512(fptr(y), fptr(x), fptr(w), fptr(bias), C.long(c), C.long(h), C.long(wd), C.long(out),
		C.long(k), C.long(pad), unsafe.Pointer(&scratch[0])) != 0
}

// im2col is qvd_im2col for one sample (cols: c·k·k rows of oh·ow).
func im2col(cols, x []float32, c, h, w, k, pad int) {
	oh, ow := h+2*pad-k+1, w+2*pad-k+1
	C.qvd_im2col(fptr(cols), C.long(oh*ow), fptr(x), C.long(c), C.long(h), C.long(w), C.long(k), C.long(pad))
}
