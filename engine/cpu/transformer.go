package cpu

/*
#include "kernels.h"
#include "transformer.h"
*/
import "C"

import (
	"unsafe"

	"github.com/qvd/qvd/engine"
)

// The operations of transformer layers (and BatchNorm) on the CPU. Each runs in the pool,
// split by elements, rows, channels or the products of a batch; a piece computes its elements
// exactly as the whole would (the kernels' reductions are per row or channel, in a fixed
// order), and the sums across rows (LayerNorm's parameter gradients) are kept per chunk of rows
// cut by the shape alone and added in chunk order, so no result depends on the thread count.
// Half-precision buffers go through fp32 scratch as everywhere in this package (half.go).

const (
	// batchedBigFlops is the work per product above which a small batch (at most
	// batchedFewItems products) runs one product at a time, each cut into blocks as Gemm cuts
	// it, instead of whole products per piece of the pool.
	batchedBigFlops = 2 * gemmMinFlops
	batchedFewItems = 4
	// batchedPieceFlops is the least work a piece of a batch gets: a product of attention's
	// shapes (17×17×32, 18 kFLOP) takes OpenBLAS about 0.6 µs, waking a worker a few.
	batchedPieceFlops = 1 << 18
)

// batchPass runs products [lo, hi) of a GemmBatched, each whole, by a single-threaded sgemm
// (one cgo call per piece: qvd_gemm_batch).
type batchPass struct {
	transA, transB           bool
	m, n, k                  int
	alpha, beta              float32
	a, b, c                  []float32
	lda, ldb, ldc            int
	strideA, strideB, stride int
}

func (p *batchPass) Range(lo, hi int) {
	C.qvd_gemm_batch(cbool(p.transA), cbool(p.transB), C.long(p.m), C.long(p.n), C.long(p.k), C.float(p.alpha),
		fptr(p.a[lo*p.strideA:]), C.long(p.lda), C.long(p.strideA), fptr(p.b[lo*p.strideB:]), C.long(p.ldb), C.long(p.strideB),
		C.float(p.beta), fptr(p.c[lo*p.stride:]), C.long(p.ldc), C.long(p.stride), C.long(hi-lo))
}

// batchedIn returns the fp32 values of a GemmBatched operand holding batch rows×cols matrices
// (rows ld apart, stride between them): b's own memory for F32; for half types scratch slot
// i, which holds (with load) the matrices' elements decoded, and garbage between them. When
// the matrices are a small part of the view (an attention head's columns of a wider matrix)
// only their rows are decoded.
func (d *Device) batchedIn(b engine.Buf, slot, batch, stride, rows, cols, ld int, load bool) []float32 {
	if b.T == engine.F32 {
		return d.f32(b)
	}
	ext := (batch-1)*stride + engine.StridedLen(rows, cols, ld)
	if !load {
		return d.scratch(slot, ext)
	}
	items := batch
	if stride == 0 {
		items = 1
	}
	if 2*items*rows*cols >= ext {
		return d.floats(b.Slice(0, ext), slot)
	}
	src := d.u16(b)
	dst := d.scratch(slot, ext)
	if src == nil || dst == nil {
		return nil
	}
	for i := 0; i < items; i++ {
		for r := 0; r < rows; r++ {
			o := i*stride + r*ld
			decode(dst[o:o+cols], src[o:o+cols], b.T)
		}
	}
	return dst
}

func (d *Device) GemmBatched(transA, transB bool, m, n, k int, alpha float32, a engine.Buf, lda, strideA int, b engine.Buf, ldb, strideB int, beta float32, c engine.Buf, ldc, strideC int, batch int) {
	if !d.check(engine.GemmBatchedFits(transA, transB, m, n, k, a.N, lda, strideA, b.N, ldb, strideB, c.N, ldc, strideC, batch),
		"gemm_batched %d × %dx%dx%d (ld %d, %d, %d; strides %d, %d, %d) on buffers of %d, %d, %d",
		batch, m, n, k, lda, ldb, ldc, strideA, strideB, strideC, a.N, b.N, c.N) ||
		!d.check(a.T.Float() && b.T.Float() && c.T.Float(), "gemm_batched of %v·%v into %v", a.T, b.T, c.T) {
		return
	}
	if batch == 0 || m == 0 || n == 0 {
		return
	}
	Cm := d.batchedIn(c, 2, batch, strideC, m, n, ldc, beta != 0)
	if Cm == nil {
		return
	}
	if k == 0 {
		// C = beta·C; beta 0 must not read C.
		for i := 0; i < batch; i++ {
			for r := 0; r < m; r++ {
				row := Cm[i*strideC+r*ldc : i*strideC+r*ldc+n]
				for j := range row {
					if beta == 0 {
						row[j] = 0
					} else {
						row[j] *= beta
					}
				}
			}
		}
	} else {
		ar, ac := m, k
		if transA {
			ar, ac = k, m
		}
		br, bc := k, n
		if transB {
			br, bc = n, k
		}
		A := d.batchedIn(a, 0, batch, strideA, ar, ac, lda, true)
		B := d.batchedIn(b, 1, batch, strideB, br, bc, ldb, true)
		if A == nil || B == nil {
			return
		}
		flops := 2 * m * n * k
		if flops >= batchedBigFlops && batch <= batchedFewItems {
			g := &d.gemm
			for i := 0; i < batch; i++ {
				*g = gemmPass{transA: transA, transB: transB, m: m, n: n, k: k, alpha: alpha, beta: beta,
					a: A[i*strideA:], b: B[i*strideB:], c: Cm[i*strideC:], lda: lda, ldb: ldb, ldc: ldc}
				d.pool.Run(g.plan(), 1, g)
			}
			g.a, g.b, g.c = nil, nil, nil
		} else {
			// Each product is computed whole by one call whichever piece runs it, so how the
			// batch is cut does not change the result: cut it evenly among the threads the
			// work pays for.
			pieces := min(d.threads, max(1, flops*batch/batchedPieceFlops))
			p := &batchPass{transA: transA, transB: transB, m: m, n: n, k: k, alpha: alpha, beta: beta,
				a: A, b: B, c: Cm, lda: lda, ldb: ldb, ldc: ldc, strideA: strideA, strideB: strideB, stride: strideC}
			d.pool.Run(batch, (batch+pieces-1)/pieces, p)
		}
	}
	if c.T != engine.F32 {
		// Store the products' rows, and only them: between them the scratch holds garbage
		// (and, in an interleaved layout, other heads' columns that are not ours to write).
		dst := d.u16(c)
		if dst == nil {
			return
		}
		if ldc == n && strideC == m*n {
			encode(dst[:batch*m*n], Cm[:batch*m*n], c.T)
			return
		}
		for i := 0; i < batch; i++ {
			for r := 0; r < m; r++ {
				o := i*strideC + r*ldc
				encode(dst[o:o+n], Cm[o:o+n], c.T)
			}
		}
	}
}

// ewPass is an element-wise pass: pieces of [0, n).
type ewPass struct {
	op      int
	y, x, g []float32
	a, b    float32
	seed    uint64
}

const (
	ewAxpby = iota
	ewGELU
	ewGELUGrad
	ewDropout
)

func (p *ewPass) Range(lo, hi int) {
	n := C.long(hi - lo)
	switch p.op {
	case ewAxpby:
		C.qvd_axpby(fptr(p.y[lo:hi]), fptr(p.x[lo:hi]), n, C.float(p.a), C.float(p.b))
	case ewGELU:
		C.qvd_gelu(fptr(p.y[lo:hi]), fptr(p.x[lo:hi]), n)
	case ewGELUGrad:
		C.qvd_gelu_grad(fptr(p.y[lo:hi]), fptr(p.g[lo:hi]), fptr(p.x[lo:hi]), n)
	case ewDropout:
		C.qvd_dropout(fptr(p.y[lo:hi]), fptr(p.x[lo:hi]), n, C.float(p.a), C.uint64_t(p.seed), C.uint64_t(lo))
	}
}

// elementwise runs p over n elements (pieces on whole 64-byte lines, so that a piece's
// elements take the same vector path as the whole's).
func (d *Device) elementwise(p *ewPass, n int) { d.pool.Run(n, elemGrain, p) }

func (d *Device) Axpby(y, x engine.Buf, a, b float32) {
	if !d.check(y.N == x.N && x.T.Float() && y.T.Float(), "axpby of %d %v into %d %v", x.N, x.T, y.N, y.T) {
		return
	}
	X := d.floats(x, 0)
	Y := d.target(y, 1, b != 0)
	if X == nil || Y == nil {
		return
	}
	d.elementwise(&ewPass{op: ewAxpby, y: Y, x: X, a: a, b: b}, len(Y))
	d.commit(y, Y)
}

func (d *Device) GELU(y, x engine.Buf) {
	if !d.check(y.N == x.N && x.T.Float() && y.T.Float(), "gelu of %d %v into %d %v", x.N, x.T, y.N, y.T) {
		return
	}
	X := d.floats(x, 0)
	Y := d.target(y, 1, false)
	if X == nil || Y == nil {
		return
	}
	d.elementwise(&ewPass{op: ewGELU, y: Y, x: X}, len(Y))
	d.commit(y, Y)
}

func (d *Device) GELUGrad(dx, dy, x engine.Buf) {
	if !d.check(dx.N == dy.N && dy.N == x.N && dx.T.Float() && dy.T.Float() && x.T.Float(), "gelu_grad lengths %d, %d, %d", dx.N, dy.N, x.N) {
		return
	}
	DY, X := d.floats(dy, 0), d.floats(x, 1)
	DX := d.target(dx, 2, false)
	if DY == nil || X == nil || DX == nil {
		return
	}
	d.elementwise(&ewPass{op: ewGELUGrad, y: DX, g: DY, x: X}, len(DX))
	d.commit(dx, DX)
}

func (d *Device) Dropout(y, x engine.Buf, p float32, seed uint64) {
	if !d.check(y.N == x.N && x.T.Float() && y.T.Float(), "dropout of %d %v into %d %v", x.N, x.T, y.N, y.T) {
		return
	}
	X := d.floats(x, 0)
	Y := d.target(y, 1, false)
	if X == nil || Y == nil {
		return
	}
	d.elementwise(&ewPass{op: ewDropout, y: Y, x: X, a: p, seed: seed}, len(Y))
	d.commit(y, Y)
}

// CopyRows copies row by row: raw memory between buffers of one type, through the vector
// conversions between types.
func (d *Device) CopyRows(dst engine.Buf, ldDst int, src engine.Buf, ldSrc int, rows, cols int) {
	if !d.check(engine.CopyRowsFits(dst.N, ldDst, src.N, ldSrc, rows, cols) && dst.T.Float() && src.T.Float(),
		"copy_rows %dx%d (ld %d into ld %d) from %d %v into %d %v", rows, cols, ldSrc, ldDst, src.N, src.T, dst.N, dst.T) {
		return
	}
	D, S := d.raw(dst), d.raw(src)
	if D == nil || S == nil || rows == 0 || cols == 0 {
		return
	}
	if dst.T == src.T {
		sz := dst.T.Size()
		for r := 0; r < rows; r++ {
			copy(D[r*ldDst*sz:(r*ldDst+cols)*sz], S[r*ldSrc*sz:(r*ldSrc+cols)*sz])
		}
		return
	}
	var tmp []float32
	if src.T != engine.F32 && dst.T != engine.F32 {
		if tmp = d.scratch(0, cols); tmp == nil {
			return
		}
	}
	for r := 0; r < rows; r++ {
		do, so := r*ldDst, r*ldSrc
		switch {
		case src.T == engine.F32:
			encode(u16s(D)[do:do+cols], f32s(S)[so:so+cols], dst.T)
		case dst.T == engine.F32:
			decode(f32s(D)[do:do+cols], u16s(S)[so:so+cols], src.T)
		default:
			decode(tmp, u16s(S)[so:so+cols], src.T)
			encode(u16s(D)[do:do+cols], tmp, dst.T)
		}
	}
}

func f32s(b []byte) []float32 { return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4) }
func u16s(b []byte) []uint16  { return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2) }

// rowPass is a pass over rows [0, rows) of a rows×cols matrix.
type rowPass struct {
	op                   int
	y, x, g, gamma, beta []float32
	mean, rstd           []float32
	cols                 int
	scale                float32
}

const (
	rowSoftmax = iota
	rowSoftmaxGrad
	rowLayerNorm
)

func (p *rowPass) Range(lo, hi int) {
	a, b := lo*p.cols, hi*p.cols
	rows, cols := C.long(hi-lo), C.long(p.cols)
	switch p.op {
	case rowSoftmax:
		C.qvd_softmax(fptr(p.y[a:b]), fptr(p.x[a:b]), rows, cols, C.float(p.scale))
	case rowSoftmaxGrad:
		C.qvd_softmax_grad(fptr(p.y[a:b]), fptr(p.g[a:b]), fptr(p.x[a:b]), rows, cols, C.float(p.scale))
	case rowLayerNorm:
		C.qvd_layernorm(fptr(p.y[a:b]), fptr(p.mean[lo:hi]), fptr(p.rstd[lo:hi]), fptr(p.x[a:b]), fptr(p.gamma), fptr(p.beta),
			rows, cols, C.float(p.scale))
	}
}

// runRows runs p over rows, pieces of at least elemGrain elements.
func (d *Device) runRows(p *rowPass, rows int) { d.pool.Run(rows, max(1, elemGrain/max(p.cols, 1)), p) }

func (d *Device) Softmax(y, x engine.Buf, rows, cols int, scale float32) {
	if !d.check(rows >= 0 && cols > 0 && x.N == rows*cols && y.N == x.N && x.T.Float() && y.T.Float(),
		"softmax %dx%d on buffers of %d %v and %d %v", rows, cols, x.N, x.T, y.N, y.T) {
		return
	}
	X := d.floats(x, 0)
	Y := d.target(y, 1, false)
	if X == nil || Y == nil {
		return
	}
	d.runRows(&rowPass{op: rowSoftmax, y: Y, x: X, cols: cols, scale: scale}, rows)
	d.commit(y, Y)
}

func (d *Device) SoftmaxGrad(dx, dy, y engine.Buf, rows, cols int, scale float32) {
	if !d.check(rows >= 0 && cols > 0 && y.N == rows*cols && dy.N == y.N && dx.N == y.N && dx.T.Float() && dy.T.Float() && y.T.Float(),
		"softmax_grad %dx%d on buffers of %d, %d, %d", rows, cols, dx.N, dy.N, y.N) {
		return
	}
	DY, Y := d.floats(dy, 0), d.floats(y, 1)
	DX := d.target(dx, 2, false)
	if DY == nil || Y == nil || DX == nil {
		return
	}
	d.runRows(&rowPass{op: rowSoftmaxGrad, y: DX, g: DY, x: Y, cols: cols, scale: scale}, rows)
	d.commit(dx, DX)
}

func (d *Device) LayerNorm(y, mean, rstd, x, gamma, beta engine.Buf, rows, cols int, eps float32) {
	if !d.check(rows >= 0 && cols > 0 && x.N == rows*cols && y.N == x.N && gamma.N == cols && beta.N == cols &&
		mean.N == rows && rstd.N == rows && mean.T == engine.F32 && rstd.T == engine.F32 &&
		x.T.Float() && y.T.Float() && gamma.T.Float() && beta.T.Float(),
		"layer_norm %dx%d: buffers of %d, %d (gamma %d, beta %d, mean %d %v, rstd %d %v)",
		rows, cols, x.N, y.N, gamma.N, beta.N, mean.N, mean.T, rstd.N, rstd.T) {
		return
	}
	M, R := d.f32(mean), d.f32(rstd)
	X, G, B := d.floats(x, 0), d.floats(gamma, 1), d.floats(beta, 2)
	Y := d.target(y, 3, false)
	if M == nil || R == nil || X == nil || G == nil || B == nil || Y == nil {
		return
	}
	d.runRows(&rowPass{op: rowLayerNorm, y: Y, x: X, gamma: G, beta: B, mean: M, rstd: R, cols: cols, scale: eps}, rows)
	d.commit(y, Y)
}

// lnBackPass runs chunks [lo, hi) of a LayerNormBackward's rows; each chunk's parameter
// gradients go to partials of its own.
type lnBackPass struct {
	dx, dy, x, gamma, mean, rstd []float32
	part                         []float64 // per chunk: dgamma (cols), dbeta (cols)
	wantG, wantB                 bool
	rows, cols, per              int
}

func (p *lnBackPass) Range(lo, hi int) {
	for ch := lo; ch < hi; ch++ {
		r0, r1 := ch*p.per, min((ch+1)*p.per, p.rows)
		if r0 >= r1 {
			continue
		}
		var dx *C.float
		if p.dx != nil {
			dx = fptr(p.dx[r0*p.cols:])
		}
		var dg, db *C.double
		if p.wantG {
			dg = dptr(p.part[2*ch*p.cols:])
		}
		if p.wantB {
			db = dptr(p.part[(2*ch+1)*p.cols:])
		}
		C.qvd_layernorm_bwd(dx, dg, db, fptr(p.dy[r0*p.cols:]), fptr(p.x[r0*p.cols:]), fptr(p.mean[r0:]), fptr(p.rstd[r0:]),
			fptr(p.gamma), C.long(r1-r0), C.long(p.cols))
	}
}

func dptr(x []float64) *C.double {
	if len(x) == 0 {
		return nil
	}
	return (*C.double)(unsafe.Pointer(&x[0]))
}

// storeParamGrad sets dst = b·dst + sum (sums in float64, rounded once) for a parameter
// gradient of a normalisation, through scratch slot for half types.
func (d *Device) storeParamGrad(dst engine.Buf, slot int, sum func(i int) float64, b float32) {
	out := d.target(dst, slot, b != 0)
	if out == nil {
		return
	}
	for i := range out {
		v := sum(i)
		if b != 0 {
			v += float64(b * out[i])
		}
		out[i] = float32(v)
	}
	d.commit(dst, out)
}

func (d *Device) LayerNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma engine.Buf, rows, cols int, b float32) {
	if !d.check(rows >= 0 && cols > 0 && x.N == rows*cols && dy.N == x.N && gamma.N == cols && mean.N == rows && rstd.N == rows &&
		mean.T == engine.F32 && rstd.T == engine.F32 && x.T.Float() && dy.T.Float() && gamma.T.Float(),
		"layer_norm_backward %dx%d: buffers of %d, %d (gamma %d, mean %d %v, rstd %d %v)", rows, cols, x.N, dy.N, gamma.N, mean.N, mean.T, rstd.N, rstd.T) ||
		(dx.Valid() && !d.check(dx.N == x.N && dx.T.Float(), "layer_norm_backward: dx of %d %v for %d", dx.N, dx.T, x.N)) ||
		(dgamma.Valid() && !d.check(dgamma.N == cols && dgamma.T.Float(), "layer_norm_backward: dgamma of %d %v for %d", dgamma.N, dgamma.T, cols)) ||
		(dbeta.Valid() && !d.check(dbeta.N == cols && dbeta.T.Float(), "layer_norm_backward: dbeta of %d %v for %d", dbeta.N, dbeta.T, cols)) {
		return
	}
	M, R := d.f32(mean), d.f32(rstd)
	DY, X, G := d.floats(dy, 0), d.floats(x, 1), d.floats(gamma, 2)
	if M == nil || R == nil || DY == nil || X == nil || G == nil {
		return
	}
	if !dx.Valid() && !dgamma.Valid() && !dbeta.Valid() {
		return
	}
	chunks, per := convChunks(rows)
	p := &lnBackPass{dy: DY, x: X, gamma: G, mean: M, rstd: R, rows: rows, cols: cols, per: per,
		wantG: dgamma.Valid(), wantB: dbeta.Valid()}
	if dx.Valid() {
		if p.dx = d.target(dx, 3, false); p.dx == nil {
			return
		}
	}
	if p.wantG || p.wantB {
		p.part = make([]float64, 2*chunks*cols)
	}
	d.pool.Run(chunks, 1, p)
	partial := func(off int) func(i int) float64 {
		return func(i int) float64 {
			var s float64
			for ch := 0; ch < chunks; ch++ {
				s += p.part[(2*ch+off)*cols+i]
			}
			return s
		}
	}
	if p.wantG {
		d.storeParamGrad(dgamma, 4, partial(0), b)
	}
	if p.wantB {
		d.storeParamGrad(dbeta, 5, partial(1), b)
	}
	if p.dx != nil {
		d.commit(dx, p.dx)
	}
}

// bnPass runs channels [lo, hi) of a BatchNorm or its backward pass.
type bnPass struct {
	backward              bool
	y, x, dy, gamma, beta []float32
	mean, rstd            []float32
	sums                  []float64
	n, c, hw              int
	eps                   float32
	train                 bool
}

func (p *bnPass) Range(lo, hi int) {
	n, c, hw := C.long(p.n), C.long(p.c), C.long(p.hw)
	if p.backward {
		var dx *C.float
		if p.y != nil {
			dx = fptr(p.y)
		}
		C.qvd_batchnorm_bwd(dx, dptr(p.sums), fptr(p.dy), fptr(p.x), fptr(p.mean), fptr(p.rstd), fptr(p.gamma), n, c, hw, C.long(lo), C.long(hi))
		return
	}
	C.qvd_batchnorm(fptr(p.y), fptr(p.mean), fptr(p.rstd), fptr(p.x), fptr(p.gamma), fptr(p.beta), n, c, hw, C.long(lo), C.long(hi),
		C.float(p.eps), C.int(boolInt(p.train)))
}

// runChannels runs p over its channels, pieces of at least elemGrain elements.
func (d *Device) runChannels(p *bnPass) { d.pool.Run(p.c, max(1, elemGrain/max(p.n*p.hw, 1)), p) }

// bnCheck checks a BatchNorm's shapes and types.
func (d *Device) bnCheck(op string, x, y, mean, rstd, gamma engine.Buf, n, c, hw int) bool {
	return d.check(n >= 0 && c > 0 && hw > 0 && x.N == n*c*hw && y.N == x.N && gamma.N == c && mean.N == c && rstd.N == c &&
		mean.T == engine.F32 && rstd.T == engine.F32 && x.T.Float() && y.T.Float() && gamma.T.Float(),
		"%s %dx%dx%d: buffers of %d, %d (gamma %d, mean %d %v, rstd %d %v)", op, n, c, hw, x.N, y.N, gamma.N, mean.N, mean.T, rstd.N, rstd.T)
}

func (d *Device) BatchNorm(y, mean, rstd, x, gamma, beta engine.Buf, n, c, hw int, eps float32, train bool) {
	if !d.bnCheck("batch_norm", x, y, mean, rstd, gamma, n, c, hw) ||
		!d.check(beta.N == c && beta.T.Float(), "batch_norm: %d %v biases for %d channels", beta.N, beta.T, c) {
		return
	}
	M, R := d.f32(mean), d.f32(rstd)
	X, G, B := d.floats(x, 0), d.floats(gamma, 1), d.floats(beta, 2)
	Y := d.target(y, 3, false)
	if M == nil || R == nil || X == nil || G == nil || B == nil || Y == nil {
		return
	}
	d.runChannels(&bnPass{y: Y, x: X, gamma: G, beta: B, mean: M, rstd: R, n: n, c: c, hw: hw, eps: eps, train: train})
	d.commit(y, Y)
}

func (d *Device) BatchNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma engine.Buf, n, c, hw int, b float32) {
	if !d.bnCheck("batch_norm_backward", x, dy, mean, rstd, gamma, n, c, hw) ||
		(dx.Valid() && !d.check(dx.N == x.N && dx.T.Float(), "batch_norm_backward: dx of %d %v for %d", dx.N, dx.T, x.N)) ||
		(dgamma.Valid() && !d.check(dgamma.N == c && dgamma.T.Float(), "batch_norm_backward: dgamma of %d %v for %d channels", dgamma.N, dgamma.T, c)) ||
		(dbeta.Valid() && !d.check(dbeta.N == c && dbeta.T.Float(), "batch_norm_backward: dbeta of %d %v for %d channels", dbeta.N, dbeta.T, c)) {
		return
	}
	M, R := d.f32(mean), d.f32(rstd)
	DY, X, G := d.floats(dy, 0), d.floats(x, 1), d.floats(gamma, 2)
	if M == nil || R == nil || DY == nil || X == nil || G == nil {
		return
	}
	if !dx.Valid() && !dgamma.Valid() && !dbeta.Valid() {
		return
	}
	p := &bnPass{backward: true, x: X, dy: DY, gamma: G, mean: M, rstd: R, n: n, c: c, hw: hw, sums: make([]float64, 2*c)}
	if dx.Valid() {
		if p.y = d.target(dx, 3, false); p.y == nil {
			return
		}
	}
	d.runChannels(p)
	if dgamma.Valid() {
		d.storeParamGrad(dgamma, 4, func(i int) float64 { return p.sums[c+i] }, b)
	}
	if dbeta.Valid() {
		d.storeParamGrad(dbeta, 5, func(i int) float64 { return p.sums[i] }, b)
	}
	if p.y != nil {
		d.commit(dx, p.y)
	}
}

// Patchify cuts x into patches (see engine.Device); it only moves values, one row of p
// pixels at a time.
func (d *Device) Patchify(cols, x engine.Buf, n, c, h, w, p int) {
	if !d.check(engine.PatchifyFits(cols.N, x.N, n, c, h, w, p) && cols.T.Float() && x.T.Float(),
		"patchify %dx%dx%dx%d by %d: buffers of %d %v and %d %v", n, c, h, w, p, cols.N, cols.T, x.N, x.T) {
		return
	}
	X := d.floats(x, 0)
	Cl := d.target(cols, 1, false)
	if X == nil || Cl == nil {
		return
	}
	patches(n, c, h, w, p, func(ci, xi int) { copy(Cl[ci:ci+p], X[xi:xi+p]) })
	d.commit(cols, Cl)
}

// Unpatchify is Patchify's inverse.
func (d *Device) Unpatchify(dx, cols engine.Buf, n, c, h, w, p int) {
	if !d.check(engine.PatchifyFits(cols.N, dx.N, n, c, h, w, p) && cols.T.Float() && dx.T.Float(),
		"unpatchify %dx%dx%dx%d by %d: buffers of %d %v and %d %v", n, c, h, w, p, cols.N, cols.T, dx.N, dx.T) {
		return
	}
	Cl := d.floats(cols, 0)
	DX := d.target(dx, 1, false)
	if Cl == nil || DX == nil {
		return
	}
	patches(n, c, h, w, p, func(ci, xi int) { copy(DX[xi:xi+p], Cl[ci:ci+p]) })
	d.commit(dx, DX)
}

// patches calls f for every row of p pixels of every patch: ci its start in the patch matrix,
// xi in the image.
func patches(n, c, h, w, p int, f func(ci, xi int)) {
	ph, pw := h/p, w/p
	ci := 0
	for s := 0; s < n; s++ {
		for py := 0; py < ph; py++ {
			for px := 0; px < pw; px++ {
				for ch := 0; ch < c; ch++ {
					for i := 0; i < p; i++ {
						f(ci, ((s*c+ch)*h+py*p+i)*w+px*p)
						ci += p
					}
				}
			}
		}
	}
}
