//go:build cuda

package cuda

// The operations of the transformer layers (and BatchNorm): GemmBatched through
// cublasGemmStridedBatchedEx, the rest as kernels of kernels.cu. Row reductions run a group
// of threads per row, summing in fp32 in a fixed tree order: LayerNorm and Softmax (and
// their backward passes) a warp per row for rows of up to 512 elements (attention's rows of
// tens of tokens, a small model's features), a block of 256 threads through shared memory
// beyond; the BatchNorm statistics a block per channel. Elementwise ones are grid-stride
// loops.
// Buffers a method lets alias are never __restrict__ in the kernels.

import (
	"math"
	"unsafe"

	"github.com/qvd/qvd/engine"
)

// GemmBatched is one cublasGemmStridedBatchedEx (fp32 accumulation): as in GemmLD, the
// row-major product is computed as the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ. Strides are in
// elements and may be 0 for A and B; C's matrices must not share an element (cuBLAS runs the
// GEMMs concurrently: its result is undefined then), which also rules out strideC 0.
func (d *Device) GemmBatched(transA, transB bool, m, n, k int, alpha float32, a engine.Buf, lda, strideA int, b engine.Buf, ldb, strideB int, beta float32, c engine.Buf, ldc, strideC int, batch int) {
	const op = "GemmBatched"
	ok := d.begin()
	defer d.exit()
	// The views must cover the last matrix of the batch: GemmFits on what is left of each
	// view before it.
	last := func(x engine.Buf, stride int) int { return x.N - (batch-1)*stride }
	if !ok || !d.bufs(op, a, b, c) ||
		!d.need(m >= 0 && n >= 0 && k >= 0 && batch >= 0 && max(m, n, k, lda, ldb, ldc, batch) <= math.MaxInt32, op,
			"invalid shape m, n, k = %d, %d, %d, batch %d", m, n, k, batch) ||
		!d.need(strideA >= 0 && strideB >= 0 && strideC >= 0, op, "negative stride (%d, %d, %d)", strideA, strideB, strideC) ||
		!d.need(batch == 0 || engine.GemmFits(transA, transB, m, n, k, last(a, strideA), lda, last(b, strideB), ldb, last(c, strideC), ldc), op,
			"a, b, c have %d, %d, %d elements; %d GEMMs of m, n, k = %d, %d, %d with leading dimensions %d, %d, %d and strides %d, %d, %d",
			a.N, b.N, c.N, batch, m, n, k, lda, ldb, ldc, strideA, strideB, strideC) ||
		!d.need(a.T.Float() && b.T == a.T && (c.T == a.T || c.T == engine.F32), op,
			"types %v·%v into %v: A and B need one floating-point type, C that type or f32", a.T, b.T, c.T) {
		return
	}
	if m == 0 || n == 0 || batch == 0 {
		return
	}
	if i := overlapping(m, n, ldc, strideC, batch); !d.need(i == 0, op,
		"C matrices 0 and %d overlap (%d×%d, leading dimension %d, stride %d)", i, m, n, ldc, strideC) {
		return
	}
	opA, opB := int32(cublasOpN), int32(cublasOpN)
	if transA {
		opA = cublasOpT
	}
	if transB {
		opB = cublasOpT
	}
	s := d.blas.gemmStridedBatchedEx(d.blas.handle, opB, opA, int32(n), int32(m), int32(k), unsafe.Pointer(&alpha),
		uintptr(b.Addr()), cudaDataType(b.T), int32(ldb), int64(strideB),
		uintptr(a.Addr()), cudaDataType(a.T), int32(lda), int64(strideA),
		unsafe.Pointer(&beta), uintptr(c.Addr()), cudaDataType(c.T), int32(ldc), int64(strideC),
		int32(batch), cublasCompute32F, cublasGemmDefault)
	d.fail(op, d.blas.status("cublasGemmStridedBatchedEx", s))
}

// overlapping is the first i in [1, batch) for which the i-th of a batch of rows×cols
// row-major matrices (rows ld apart, each stride elements after the previous one) shares an
// element with the first, 0 if none does. Element (r, c) of matrix i is at i·stride + r·ld + c,
// so the two meet when i·stride = Δr·ld + Δc with |Δr| < rows and |Δc| < cols. Matrices side
// by side in the rows of a larger one (one attention head's columns) do not overlap.
func overlapping(rows, cols, ld, stride, batch int) int {
	for i := 1; i < batch; i++ {
		q := int64(i) * int64(stride)
		dr := q / int64(ld)
		rem := q - dr*int64(ld)
		if dr < int64(rows) && rem < int64(cols) || dr+1 < int64(rows) && int64(ld)-rem < int64(cols) {
			return i
		}
	}
	return 0
}

// sameFloat latches an error naming op unless every buffer has the type of the first, a
// floating-point type.
func (d *Device) sameFloat(op string, bs ...engine.Buf) bool {
	t := bs[0].T
	if !d.need(t.Float(), op, "buffer 1 is %v, not a floating-point type", t) {
		return false
	}
	for i, b := range bs[1:] {
		if !d.need(b.T == t, op, "buffer %d is %v but buffer 1 %v: they need one type", i+2, b.T, t) {
			return false
		}
	}
	return true
}

// stats latches an error naming op unless mean and rstd are n×f32 each.
func (d *Device) stats(op string, mean, rstd engine.Buf, n int) bool {
	return d.need(mean.N == n && mean.T == engine.F32 && rstd.N == n && rstd.T == engine.F32, op,
		"mean is %d×%v and rstd %d×%v, want %d×f32 each", mean.N, mean.T, rstd.N, rstd.T, n)
}

// optional is p's address, 0 (a null pointer, which the kernels skip) for an invalid Buf.
func optional(b engine.Buf) uint64 {
	if !b.Valid() {
		return 0
	}
	return b.Addr()
}

// Axpby sets y = a·x + b·y, each product and the sum rounded in fp32 (no fused multiply-add).
// As in BLAS, y is not read when b is 0.
func (d *Device) Axpby(y, x engine.Buf, a, b float32) {
	const op = "Axpby"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, x) || !d.need(y.N == x.N, op, "y has %d elements, x %d", y.N, x.N) ||
		!d.sameFloat(op, y, x) || y.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "axpby", y.T, 0); ok {
		d.launch(op, f, d.blocks(y.N, threads), threads, 1, ptr(y), ptr(x), i64(y.N), f32(a), f32(b))
	}
}

// CopyRows copies a rows×cols block between strided matrices, converting between
// floating-point types (copy_rows_D_S); ldSrc 0 repeats src's first row.
func (d *Device) CopyRows(dst engine.Buf, ldDst int, src engine.Buf, ldSrc int, rows, cols int) {
	const op = "CopyRows"
	ok := d.begin()
	defer d.exit()
	srcRows := rows
	if ldSrc == 0 {
		srcRows = min(rows, 1)
	}
	if !ok || !d.bufs(op, dst, src) ||
		!d.need(rows >= 0 && cols >= 0 && ldDst >= cols && (ldSrc == 0 || ldSrc >= cols), op,
			"invalid shape %d×%d with leading dimensions %d (dst), %d (src)", rows, cols, ldDst, ldSrc) ||
		!d.need(dst.N >= engine.StridedLen(rows, cols, ldDst) && src.N >= engine.StridedLen(srcRows, cols, ldSrc), op,
			"dst and src have %d and %d elements; %d×%d with leading dimensions %d and %d need %d and %d",
			dst.N, src.N, rows, cols, ldDst, ldSrc, engine.StridedLen(rows, cols, ldDst), engine.StridedLen(srcRows, cols, ldSrc)) ||
		rows == 0 || cols == 0 {
		return
	}
	if f, ok := d.kernel(op, "copy_rows", dst.T, src.T); ok {
		d.launch(op, f, d.blocks(rows*cols, threads), threads, 1, ptr(dst), i64(ldDst), ptr(src), i64(ldSrc), i64(rows), i64(cols))
	}
}

// rowBlocks is the grid of a kernel with a block per row (or channel) of rows.
func (d *Device) rowBlocks(rows int) int { return min(rows, d.maxBlocks) }

// rowThreads is the block of a kernel with a block per row of cols elements: a warp per 32
// elements, up to 256 threads, so that short rows do not leave most of the block idle at
// every barrier of its reductions.
func rowThreads(cols int) int { return min(threads, max(32, (cols+31)/32*32)) }

// warpRowMax is the longest row a warp reduces on its own (16 elements a lane); longer ones
// get a block.
const warpRowMax = 512

// rowLaunch is the launch of a row kernel (layer_norm, layer_norm_grad, softmax,
// softmax_grad) over rows×cols, and its last argument: a warp per row (8 rows a block, warp
// 1) for rows up to warpRowMax elements, else a block per row (warp 0).
func (d *Device) rowLaunch(rows, cols int) (grid, block int, warp uint64) {
	if cols <= warpRowMax {
		const per = threads / 32
		return min((rows+per-1)/per, d.maxBlocks), threads, 1
	}
	return d.rowBlocks(rows), rowThreads(cols), 0
}

// LayerNorm runs a warp or a block per row (rowLaunch): the mean, then the variance about it
// (two passes, fp32), rstd = 1/sqrt(σ² + eps) correctly rounded, then y = (x − μ)·rstd·γ + β.
func (d *Device) LayerNorm(y, mean, rstd, x, gamma, beta engine.Buf, rows, cols int, eps float32) {
	const op = "LayerNorm"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, mean, rstd, x, gamma, beta) ||
		!d.need(rows >= 0 && cols >= 1 && x.N == rows*cols && y.N == x.N, op,
			"x and y have %d and %d elements, not rows×cols = %d×%d", x.N, y.N, rows, cols) ||
		!d.need(gamma.N == cols && beta.N == cols, op, "gamma and beta have %d and %d elements, want %d", gamma.N, beta.N, cols) ||
		!d.sameFloat(op, x, y, gamma, beta) || !d.stats(op, mean, rstd, rows) || rows == 0 {
		return
	}
	if f, ok := d.kernel(op, "layer_norm", x.T, 0); ok {
		grid, block, warp := d.rowLaunch(rows, cols)
		d.launch(op, f, grid, block, 1, ptr(y), ptr(mean), ptr(rstd), ptr(x), ptr(gamma), ptr(beta),
			i64(rows), i64(cols), f32(eps), warp)
	}
}

// LayerNormBackward: dgamma and dbeta as column sums (a 32×32 block per 32 columns, like
// SumRows), queued first because dx may alias dy; then dx with a warp or a block per row.
func (d *Device) LayerNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma engine.Buf, rows, cols int, b float32) {
	const op = "LayerNormBackward"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dy, x, mean, rstd, gamma) || !d.bufs(op, valid(dx, dgamma, dbeta)...) ||
		!d.need(rows >= 0 && cols >= 1 && x.N == rows*cols && dy.N == x.N, op,
			"x and dy have %d and %d elements, not rows×cols = %d×%d", x.N, dy.N, rows, cols) ||
		!d.need(!dx.Valid() || dx.N == x.N, op, "dx has %d elements, x %d", dx.N, x.N) ||
		!d.need(gamma.N == cols, op, "gamma has %d elements, want %d", gamma.N, cols) ||
		!d.need(!dgamma.Valid() || dgamma.N == cols, op, "dgamma has %d elements, want %d", dgamma.N, cols) ||
		!d.need(!dbeta.Valid() || dbeta.N == cols, op, "dbeta has %d elements, want %d", dbeta.N, cols) ||
		!d.sameFloat(op, valid(x, dy, gamma, dx, dgamma, dbeta)...) || !d.stats(op, mean, rstd, rows) || rows == 0 {
		return
	}
	if dgamma.Valid() || dbeta.Valid() {
		if f, ok := d.kernel(op, "layer_norm_params", x.T, 0); ok {
			d.launch(op, f, d.blocks(cols, tile), tile, tile, optional(dgamma), optional(dbeta), ptr(dy), ptr(x),
				ptr(mean), ptr(rstd), i64(rows), i64(cols), f32(b))
		}
	}
	if dx.Valid() {
		if f, ok := d.kernel(op, "layer_norm_grad", x.T, 0); ok {
			grid, block, warp := d.rowLaunch(rows, cols)
			d.launch(op, f, grid, block, 1, ptr(dx), ptr(dy), ptr(x), ptr(mean), ptr(rstd), ptr(gamma),
				i64(rows), i64(cols), warp)
		}
	}
}

// valid is the Valid ones of bs, in order.
func valid(bs ...engine.Buf) []engine.Buf {
	out := bs[:0:0]
	for _, b := range bs {
		if b.Valid() {
			out = append(out, b)
		}
	}
	return out
}

// elementwise checks the buffers of an elementwise operation: one float type, one length.
func (d *Device) elementwise(op string, bs ...engine.Buf) bool {
	if !d.bufs(op, bs...) || !d.sameFloat(op, bs...) {
		return false
	}
	for i, b := range bs[1:] {
		if !d.need(b.N == bs[0].N, op, "buffer %d has %d elements, buffer 1 %d", i+2, b.N, bs[0].N) {
			return false
		}
	}
	return true
}

// GELU is the exact form, x·(1 + erf(x/√2))/2 with the device's erff.
func (d *Device) GELU(y, x engine.Buf) {
	const op = "GELU"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.elementwise(op, y, x) || y.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "gelu", y.T, 0); ok {
		d.launch(op, f, d.blocks(y.N, threads), threads, 1, ptr(y), ptr(x), i64(y.N))
	}
}

// GELUGrad sets dx = dy·(Φ(x) + x·φ(x)).
func (d *Device) GELUGrad(dx, dy, x engine.Buf) {
	const op = "GELUGrad"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.elementwise(op, dx, dy, x) || dx.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "gelu_grad", dx.T, 0); ok {
		d.launch(op, f, d.blocks(dx.N, threads), threads, 1, ptr(dx), ptr(dy), ptr(x), i64(dx.N))
	}
}

// Dropout keeps element i where engine.DropoutKeep(seed, i, p), computed by the kernel in
// 64-bit integer arithmetic, and stores x/(1−p) there, +0 elsewhere.
func (d *Device) Dropout(y, x engine.Buf, p float32, seed uint64) {
	const op = "Dropout"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.elementwise(op, y, x) || !d.need(p >= 0 && p <= 1, op, "p = %v is not a probability", p) || y.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "dropout", y.T, 0); ok {
		d.launch(op, f, d.blocks(y.N, threads), threads, 1, ptr(y), ptr(x), i64(y.N), f32(p), seed)
	}
}

// rowwise checks the buffers of a row operation on rows×cols matrices.
func (d *Device) rowwise(op string, rows, cols int, bs ...engine.Buf) bool {
	return d.elementwise(op, bs...) &&
		d.need(rows >= 0 && cols >= 1 && bs[0].N == rows*cols, op, "buffer 1 has %d elements, not rows×cols = %d×%d", bs[0].N, rows, cols)
}

// Softmax runs a warp or a block per row: the maximum of scale·x, Σ exp(scale·x − max), then y, all in
// fp32.
func (d *Device) Softmax(y, x engine.Buf, rows, cols int, scale float32) {
	const op = "Softmax"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.rowwise(op, rows, cols, y, x) || rows == 0 {
		return
	}
	if f, ok := d.kernel(op, "softmax", y.T, 0); ok {
		grid, block, warp := d.rowLaunch(rows, cols)
		d.launch(op, f, grid, block, 1, ptr(y), ptr(x), i64(rows), i64(cols), f32(scale), warp)
	}
}

// SoftmaxGrad runs a warp or a block per row: Σ dy⊙y, then dx = scale·y⊙(dy − Σ).
func (d *Device) SoftmaxGrad(dx, dy, y engine.Buf, rows, cols int, scale float32) {
	const op = "SoftmaxGrad"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.rowwise(op, rows, cols, dx, dy, y) || rows == 0 {
		return
	}
	if f, ok := d.kernel(op, "softmax_grad", dx.T, 0); ok {
		grid, block, warp := d.rowLaunch(rows, cols)
		d.launch(op, f, grid, block, 1, ptr(dx), ptr(dy), ptr(y), i64(rows), i64(cols), f32(scale), warp)
	}
}

// patchShape checks the arguments of Patchify and Unpatchify.
func (d *Device) patchShape(op string, cols, x engine.Buf, n, c, h, w, p int) bool {
	return d.bufs(op, cols, x) &&
		d.need(n >= 0 && c >= 0 && h >= 0 && w >= 0 && p >= 1 && h%p == 0 && w%p == 0, op,
			"invalid shape n, c, h, w = %d, %d, %d, %d with patch %d (h and w must be multiples of it)", n, c, h, w, p) &&
		d.need(x.N == n*c*h*w && cols.N == x.N, op, "x and cols have %d and %d elements, want n×c×h×w = %d each", x.N, cols.N, n*c*h*w) &&
		d.need(cols.T == x.T, op, "cols is %v but x %v", cols.T, x.T)
}

// Patchify moves x's p×p patches into the rows of cols (no conversion: the bits are kept).
func (d *Device) Patchify(cols, x engine.Buf, n, c, h, w, p int) {
	const op = "Patchify"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.patchShape(op, cols, x, n, c, h, w, p) || x.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "patchify", x.T, 0); ok {
		d.launch(op, f, d.blocks(x.N, threads), threads, 1, ptr(cols), ptr(x), i64(n), i64(c), i64(h), i64(w), i64(p))
	}
}

// Unpatchify is Patchify's inverse, a gather per element of dx.
func (d *Device) Unpatchify(dx, cols engine.Buf, n, c, h, w, p int) {
	const op = "Unpatchify"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.patchShape(op, cols, dx, n, c, h, w, p) || dx.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "unpatchify", dx.T, 0); ok {
		d.launch(op, f, d.blocks(dx.N, threads), threads, 1, ptr(dx), ptr(cols), i64(n), i64(c), i64(h), i64(w), i64(p))
	}
}

// batchNormArgs checks the buffers every BatchNorm operation shares.
func (d *Device) batchNormArgs(op string, x, y, mean, rstd, gamma engine.Buf, n, c, hw int) bool {
	return d.need(n >= 0 && c >= 0 && hw >= 0 && x.N == n*c*hw && y.N == x.N, op,
		"x and y have %d and %d elements, not n×c×hw = %d×%d×%d", x.N, y.N, n, c, hw) &&
		d.need(gamma.N == c, op, "gamma has %d elements, want %d", gamma.N, c) &&
		d.stats(op, mean, rstd, c)
}

// BatchNorm: in training, a block per channel computes μ and σ² over its n·hw elements (two
// passes, fp32) into mean and rstd; then, in both modes, an elementwise kernel sets
// y = (x − μ)·rstd·γ + β.
func (d *Device) BatchNorm(y, mean, rstd, x, gamma, beta engine.Buf, n, c, hw int, eps float32, train bool) {
	const op = "BatchNorm"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, mean, rstd, x, gamma, beta) || !d.batchNormArgs(op, x, y, mean, rstd, gamma, n, c, hw) ||
		!d.need(beta.N == c, op, "beta has %d elements, want %d", beta.N, c) ||
		!d.sameFloat(op, x, y, gamma, beta) || c == 0 {
		return
	}
	if train {
		if !d.need(n*hw >= 1, op, "training statistics of %d×%d elements per channel", n, hw) {
			return
		}
		if f, ok := d.kernel(op, "batch_norm_stats", x.T, 0); ok {
			d.launch(op, f, d.rowBlocks(c), rowThreads(n*hw), 1, ptr(mean), ptr(rstd), ptr(x), i64(n), i64(c), i64(hw), f32(eps))
		}
	}
	if x.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "batch_norm_apply", x.T, 0); ok {
		d.launch(op, f, d.blocks(x.N, threads), threads, 1, ptr(y), ptr(x), ptr(mean), ptr(rstd), ptr(gamma), ptr(beta),
			i64(n), i64(c), i64(hw))
	}
}

// BatchNormBackward runs a block per channel: Σ dy and Σ dy·x̂ over the channel, the
// parameter gradients from them, then dx.
func (d *Device) BatchNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma engine.Buf, n, c, hw int, b float32) {
	const op = "BatchNormBackward"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dy, x, mean, rstd, gamma) || !d.bufs(op, valid(dx, dgamma, dbeta)...) || !d.batchNormArgs(op, x, dy, mean, rstd, gamma, n, c, hw) ||
		!d.need(!dx.Valid() || dx.N == x.N, op, "dx has %d elements, x %d", dx.N, x.N) ||
		!d.need(!dgamma.Valid() || dgamma.N == c, op, "dgamma has %d elements, want %d", dgamma.N, c) ||
		!d.need(!dbeta.Valid() || dbeta.N == c, op, "dbeta has %d elements, want %d", dbeta.N, c) ||
		!d.sameFloat(op, valid(x, dy, gamma, dx, dgamma, dbeta)...) || c == 0 ||
		!dx.Valid() && !dgamma.Valid() && !dbeta.Valid() {
		return
	}
	if f, ok := d.kernel(op, "batch_norm_grad", x.T, 0); ok {
		d.launch(op, f, d.rowBlocks(c), rowThreads(n*hw), 1, optional(dx), optional(dgamma), optional(dbeta), ptr(dy), ptr(x),
			ptr(mean), ptr(rstd), ptr(gamma), i64(n), i64(c), i64(hw), f32(b))
	}
}
