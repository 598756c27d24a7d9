//go:build cuda

package cuda

import (
	"math"
	"unsafe"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/vec"
)

// Gemm is one cublasGemmEx with fp32 accumulation (CUBLAS_COMPUTE_32F). cuBLAS is
// column-major, and a row-major matrix is its transpose in column-major order, so the
// row-major C = op(A)·op(B) is computed as the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands
// swap places and keep their transpose flags. A and B must have one type; C that type or f32.
// As in BLAS, C is not read when beta is 0.
func (d *Device) Gemm(transA, transB bool, m, n, k int, alpha float32, a, b engine.Buf, beta float32, c engine.Buf) {
	if !d.need(a.N == m*k && b.N == k*n && c.N == m*n, "Gemm",
		"a, b, c have %d, %d, %d elements; m, n, k = %d, %d, %d need %d, %d, %d", a.N, b.N, c.N, m, n, k, m*k, k*n, m*n) {
		return
	}
	lda, ldb := engine.ContiguousLDs(transA, transB, m, n, k)
	d.GemmLD(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, max(n, 1))
}

// GemmLD is cublasGemmEx on row-major matrices with leading dimensions: the row-major product
// C = op(A)·op(B) is the column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ, so B goes first.
func (d *Device) GemmLD(transA, transB bool, m, n, k int, alpha float32, a engine.Buf, lda int, b engine.Buf, ldb int, beta float32, c engine.Buf, ldc int) {
	const op = "Gemm"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, a, b, c) ||
		!d.need(m >= 0 && n >= 0 && k >= 0 && max(m, n, k, lda, ldb, ldc) <= math.MaxInt32, op, "invalid shape m, n, k = %d, %d, %d", m, n, k) ||
		!d.need(engine.GemmFits(transA, transB, m, n, k, a.N, lda, b.N, ldb, c.N, ldc), op,
			"a, b, c have %d, %d, %d elements; m, n, k = %d, %d, %d with leading dimensions %d, %d, %d", a.N, b.N, c.N, m, n, k, lda, ldb, ldc) ||
		!d.need(a.T.Float() && b.T == a.T && (c.T == a.T || c.T == engine.F32), op,
			"types %v·%v into %v: A and B need one floating-point type, C that type or f32", a.T, b.T, c.T) {
		return
	}
	if m == 0 || n == 0 {
		return
	}
	opA, opB := int32(cublasOpN), int32(cublasOpN)
	if transA {
		opA = cublasOpT
	}
	if transB {
		opB = cublasOpT
	}
	s := d.blas.gemmEx(d.blas.handle, opB, opA, int32(n), int32(m), int32(k), unsafe.Pointer(&alpha),
		uintptr(b.Addr()), cudaDataType(b.T), int32(ldb),
		uintptr(a.Addr()), cudaDataType(a.T), int32(lda),
		unsafe.Pointer(&beta), uintptr(c.Addr()), cudaDataType(c.T), int32(ldc),
		cublasCompute32F, cublasGemmDefault)
	d.fail(op, d.blas.status("cublasGemmEx", s))
}

// ConvWorkspace: the CUDA backend convolves the whole batch as one unfolding and one GEMM
// (convLayout), in an fp32 workspace: the GEMMs whose results are summed again or biased
// (the forward product, the columns' gradient) write fp32, so every output is rounded once,
// when it is stored, as the Device contract asks.
func (d *Device) ConvWorkspace(s engine.ConvShape, t engine.DType) (int, engine.DType) {
	if !s.Valid() || !t.Float() {
		return 0, engine.F32
	}
	return convLayout(s, t).elems, engine.F32
}

// convViews are a convolution's views of its workspace, an fp32 buffer of elems elements
// in two regions used one after the other, as the compute stream orders them:
//
//   - A, C·K·K × pix fp32 elements (pix = N·OH·OW): the unfolded input cols, in x's type
//     (an unfolding copies elements, so it is exact in their own type, and half the bytes
//     in fp16 and bf16), and in the backward pass, once the weight gradient has read cols,
//     the columns' gradient dcols in fp32;
//   - B, Out × pix fp32 elements: the forward product in channel-major order, ycm (fp32),
//     or the backward pass's output gradient transposed to channel-major order, dycm (in
//     its own type: a transpose is exact).
//
// That is (C·K·K + Out)·pix·4 bytes, against (2·C·K·K + Out)·pix elements of the working type
// for engine.UnfoldConv2D's layout, which rounds the products to it.
type convViews struct {
	elems              int        // the workspace's fp32 elements
	cols, dcols        engine.Buf // region A
	ycm, dycm          engine.Buf // region B
	pix, ckk, ohw, ckp int        // ckp: region A's fp32 elements, C·K·K·pix
}

// convLayout is the layout of a convolution of shape s in working type t over ws (only
// elems when ws is not Valid).
func convLayout(s engine.ConvShape, t engine.DType, ws ...engine.Buf) convViews {
	ohw := s.OH() * s.OW()
	pix := s.N * ohw
	ckk := s.C * s.K * s.K
	v := convViews{pix: pix, ckk: ckk, ohw: ohw, ckp: ckk * pix, elems: (ckk + s.Out) * pix}
	if len(ws) == 0 || !ws[0].Valid() {
		return v
	}
	w := ws[0]
	// As views of w's allocation in other types: Off counts elements of the view's type.
	view := func(fromF32, n int, vt engine.DType) engine.Buf {
		return engine.Buf{Ptr: w.Ptr, Off: (w.Off + fromF32) * 4 / vt.Size(), N: n, T: vt}
	}
	v.cols = view(0, ckk*pix, t)
	v.dcols = view(0, ckk*pix, engine.F32)
	v.ycm = view(v.ckp, s.Out*pix, engine.F32)
	v.dycm = view(v.ckp, s.Out*pix, t)
	return v
}

// convArgs checks a convolution's shape, types and workspace; it returns the workspace's
// views.
func (d *Device) convArgs(op string, s engine.ConvShape, x, y, w, ws engine.Buf) (convViews, bool) {
	var v convViews
	if !d.need(s.Valid() && max(s.N, s.C, s.H, s.W, s.Out, s.K) <= math.MaxInt32, op, "invalid shape %v", s) {
		return v, false
	}
	nx, ny, nw := s.Elems()
	v = convLayout(s, x.T)
	if !d.need(x.N == nx && y.N == ny && w.N == nw, op, "x, y (or dy), w have %d, %d, %d elements; %v needs %d, %d, %d",
		x.N, y.N, w.N, s, nx, ny, nw) ||
		!d.need(x.T.Float() && y.T == x.T && w.T == x.T, op, "x, y (or dy), w are %v, %v, %v: one floating-point type", x.T, y.T, w.T) ||
		!d.need(ws.T == engine.F32 && ws.N >= v.elems, op, "workspace is %d×%v; %v needs %d×f32 (ConvWorkspace)", ws.N, ws.T, s, v.elems) {
		return v, false
	}
	return convLayout(s, x.T, ws), true
}

// Conv2D: the batch unfolded into cols (im2col, in x's type), one GEMM into ycm in fp32
// (cublasGemmEx with an fp32 C), then conv_out adds the bias, rounds once to y's type and
// puts the result in NCHW order.
func (d *Device) Conv2D(y, x, w, bias, ws engine.Buf, s engine.ConvShape) {
	const op = "Conv2D"
	v, ok := d.conv2DArgs(op, y, x, w, bias, ws, s)
	if !ok {
		return
	}
	d.Im2Col(v.cols, x, s.N, s.C, s.H, s.W, s.K, s.Pad)
	d.Gemm(false, false, s.Out, v.pix, v.ckk, 1, w, v.cols, 0, v.ycm)
	d.fromF32(op, "conv_out", y, ptr(y), ptr(v.ycm), ptr(bias), i64(s.N), i64(s.Out), i64(v.ohw))
}

// fromF32 launches kernel name_T_f32 over dst's elements: the step that rounds a
// convolution's fp32 GEMM result into dst's type once, queued after the GEMM.
func (d *Device) fromF32(op, name string, dst engine.Buf, args ...uint64) {
	ok := d.begin()
	defer d.exit()
	if !ok {
		return
	}
	if f, ok := d.kernel(op, name, dst.T, engine.F32); ok {
		d.launch(op, f, d.blocks(dst.N, threads), threads, 1, args...)
	}
}

// conv2DArgs checks Conv2D's arguments before anything is queued.
func (d *Device) conv2DArgs(op string, y, x, w, bias, ws engine.Buf, s engine.ConvShape) (convViews, bool) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, x, w, bias, ws) {
		return convViews{}, false
	}
	v, ok := d.convArgs(op, s, x, y, w, ws)
	return v, ok && d.need(bias.N == s.Out && bias.T == x.T, op, "bias is %d×%v, want %d×%v", bias.N, bias.T, s.Out, x.T)
}

// Conv2DBackward: dy transposed to channel-major dycm (exact), then the weight gradient as
// one GEMM of dycm and the unfolded input (recomputed into cols), stored into dw with beta;
// the bias gradient as dycm's row sums; and the input gradient as one GEMM into dcols in fp32
// (over cols, which the weight gradient has read), folded back by col2im_T_f32, which sums
// in fp32 and rounds once into dx.
func (d *Device) Conv2DBackward(dx, dw, db, dy, x, w, ws engine.Buf, s engine.ConvShape, beta float32) {
	const op = "Conv2DBackward"
	v, ok := d.conv2DBackwardArgs(op, dx, dw, db, dy, x, w, ws, s)
	if !ok {
		return
	}
	d.Transpose01(v.dycm, dy, s.N, s.Out, v.ohw)
	if dw.Valid() {
		d.Im2Col(v.cols, x, s.N, s.C, s.H, s.W, s.K, s.Pad)
		d.Gemm(false, true, s.Out, v.ckk, v.pix, 1, v.dycm, v.cols, beta, dw)
	}
	if db.Valid() {
		d.SumRows(db, v.dycm, s.Out, v.pix, true, beta)
	}
	if !dx.Valid() {
		return
	}
	d.Gemm(true, false, v.ckk, v.pix, s.Out, 1, w, v.dycm, 0, v.dcols)
	d.fromF32(op, "col2im", dx, ptr(dx), ptr(v.dcols), i64(s.N), i64(s.C), i64(s.H), i64(s.W), i64(s.K), i64(s.Pad))
}

// conv2DBackwardArgs checks Conv2DBackward's arguments before anything is queued.
func (d *Device) conv2DBackwardArgs(op string, dx, dw, db, dy, x, w, ws engine.Buf, s engine.ConvShape) (convViews, bool) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dy, x, w, ws) || !d.bufs(op, valid(dx, dw, db)...) {
		return convViews{}, false
	}
	v, ok := d.convArgs(op, s, x, dy, w, ws)
	return v, ok &&
		d.need(!dx.Valid() || dx.N == x.N && dx.T == x.T, op, "dx is %d×%v, x %d×%v", dx.N, dx.T, x.N, x.T) &&
		d.need(!dw.Valid() || dw.N == w.N && (dw.T == x.T || dw.T == engine.F32), op, "dw is %d×%v, w %d×%v", dw.N, dw.T, w.N, x.T) &&
		d.need(!db.Valid() || db.N == s.Out && db.T.Float(), op, "db is %d×%v, want %d floating-point elements", db.N, db.T, s.Out)
}

// AddBias adds bias to every row of y (perRow false) or bias[r] to row r (perRow true).
func (d *Device) AddBias(y, bias engine.Buf, rows, cols int, perRow bool) {
	const op = "AddBias"
	nb := cols
	if perRow {
		nb = rows
	}
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, bias) ||
		!d.need(rows >= 0 && cols >= 0 && y.N == rows*cols, op, "y has %d elements, not rows×cols = %d×%d", y.N, rows, cols) ||
		!d.need(bias.N == nb, op, "bias has %d elements, want %d", bias.N, nb) ||
		!d.need(bias.T == y.T, op, "y is %v but bias %v", y.T, bias.T) || y.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "add_bias", y.T, 0); ok {
		d.launch(op, f, d.blocks(y.N, threads), threads, 1, ptr(y), ptr(bias), i64(rows), i64(cols), flag(perRow))
	}
}

// SumRows reduces src (rows × cols) over its rows into dst[c] (perRow false: sum_rows, a
// 32×32 block per 32 columns) or over its columns into dst[r] (perRow true: sum_cols, a
// block per row), dst = beta·dst + Σ in fp32 in a fixed order. dst may be f32 while src is
// the working type. As in BLAS, dst is not read when beta is 0.
func (d *Device) SumRows(dst, src engine.Buf, rows, cols int, perRow bool, beta float32) {
	const op = "SumRows"
	nd := cols
	if perRow {
		nd = rows
	}
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dst, src) ||
		!d.need(rows >= 0 && cols >= 0 && src.N == rows*cols, op, "src has %d elements, not rows×cols = %d×%d", src.N, rows, cols) ||
		!d.need(dst.N == nd, op, "dst has %d elements, want %d", dst.N, nd) || nd == 0 {
		return
	}
	if perRow {
		if f, ok := d.kernel(op, "sum_cols", dst.T, src.T); ok {
			d.launch(op, f, min(rows, d.maxBlocks), threads, 1, ptr(dst), ptr(src), i64(rows), i64(cols), f32(beta))
		}
		return
	}
	if f, ok := d.kernel(op, "sum_rows", dst.T, src.T); ok {
		d.launch(op, f, d.blocks(cols, tile), tile, tile, ptr(dst), ptr(src), i64(rows), i64(cols), f32(beta))
	}
}

// ReLU sets y = max(x, 0) with Go's max: a NaN stays NaN.
func (d *Device) ReLU(y, x engine.Buf) {
	const op = "ReLU"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, x) || !d.need(y.N == x.N && y.T == x.T, op, "y is %d×%v, x %d×%v", y.N, y.T, x.N, x.T) || y.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "relu", y.T, 0); ok {
		d.launch(op, f, d.blocks(y.N, threads), threads, 1, ptr(y), ptr(x), i64(y.N))
	}
}

// ReLUGrad sets dx = dy where y > 0, else 0.
func (d *Device) ReLUGrad(dx, dy, y engine.Buf) {
	const op = "ReLUGrad"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dx, dy, y) || !d.need(dx.N == dy.N && dx.N == y.N && dx.T == dy.T && dx.T == y.T, op,
		"dx is %d×%v, dy %d×%v, y %d×%v", dx.N, dx.T, dy.N, dy.T, y.N, y.T) || dx.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "relu_grad", dx.T, 0); ok {
		d.launch(op, f, d.blocks(dx.N, threads), threads, 1, ptr(dx), ptr(dy), ptr(y), i64(dx.N))
	}
}

// Transpose01 moves elements without converting them, so their bits are kept (i32 too,
// through the f32 kernel).
func (d *Device) Transpose01(dst, src engine.Buf, a, b, r int) {
	const op = "Transpose01"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dst, src) || !d.need(a >= 0 && b >= 0 && r >= 0 && src.N == a*b*r && dst.N == src.N, op,
		"dst has %d elements, src %d, not a×b×r = %d×%d×%d", dst.N, src.N, a, b, r) ||
		!d.need(dst.T == src.T, op, "dst is %v but src %v", dst.T, src.T) || dst.N == 0 {
		return
	}
	t := dst.T
	if t == engine.I32 {
		t = engine.F32
	}
	if f, ok := d.kernel(op, "transpose01", t, 0); ok {
		d.launch(op, f, d.blocks(dst.N, threads), threads, 1, ptr(dst), ptr(src), i64(a), i64(b), i64(r))
	}
}

// convShape checks the arguments of Im2Col and Col2Im.
func (d *Device) convShape(op string, cols, x engine.Buf, n, c, h, w, k, pad int) bool {
	oh, ow := h+2*pad-k+1, w+2*pad-k+1
	return d.need(n >= 0 && c >= 0 && h >= 0 && w >= 0 && k >= 1 && pad >= 0 && oh >= 1 && ow >= 1, op,
		"invalid shape n, c, h, w = %d, %d, %d, %d with k = %d, pad = %d", n, c, h, w, k, pad) &&
		d.need(x.N == n*c*h*w, op, "x has %d elements, not n×c×h×w = %d", x.N, n*c*h*w) &&
		d.need(cols.N == c*k*k*n*oh*ow, op, "cols has %d elements, not (c·k·k)×(n·oh·ow) = %d", cols.N, c*k*k*n*oh*ow) &&
		d.need(cols.T == x.T, op, "cols is %v but x %v", cols.T, x.T)
}

// Im2Col unfolds x for a k×k, stride-1 convolution.
func (d *Device) Im2Col(cols, x engine.Buf, n, c, h, w, k, pad int) {
	const op = "Im2Col"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, cols, x) || !d.convShape(op, cols, x, n, c, h, w, k, pad) || cols.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "im2col", cols.T, 0); ok {
		d.launch(op, f, d.blocks(cols.N, threads), threads, 1, ptr(cols), ptr(x),
			i64(n), i64(c), i64(h), i64(w), i64(k), i64(pad))
	}
}

// Col2Im is Im2Col's adjoint, a gather per element of dx (no atomics, a fixed order).
func (d *Device) Col2Im(dx, cols engine.Buf, n, c, h, w, k, pad int) {
	const op = "Col2Im"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dx, cols) || !d.convShape(op, cols, dx, n, c, h, w, k, pad) || dx.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "col2im", dx.T, 0); ok {
		d.launch(op, f, d.blocks(dx.N, threads), threads, 1, ptr(dx), ptr(cols),
			i64(n), i64(c), i64(h), i64(w), i64(k), i64(pad))
	}
}

// MaxPool2 is a 2×2, stride-2 max-pool; ties and NaNs go to the first element of the window
// in row-major order (v > best).
func (d *Device) MaxPool2(y, idx, x engine.Buf, planes, h, w int) {
	const op = "MaxPool2"
	ny := planes * (h / 2) * (w / 2)
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, y, idx, x) ||
		!d.need(planes >= 0 && h >= 0 && w >= 0 && x.N == planes*h*w, op, "x has %d elements, not planes×h×w = %d×%d×%d", x.N, planes, h, w) ||
		!d.need(x.N <= math.MaxInt32, op, "x has %d elements; i32 indices address at most 2³¹-1", x.N) ||
		!d.need(y.N == ny && y.T == x.T, op, "y is %d×%v, want %d×%v", y.N, y.T, ny, x.T) ||
		!d.need(idx.N == ny && idx.T == engine.I32, op, "idx is %d×%v, want %d×i32", idx.N, idx.T, ny) || ny == 0 {
		return
	}
	if f, ok := d.kernel(op, "maxpool2", x.T, 0); ok {
		d.launch(op, f, d.blocks(ny, threads), threads, 1, ptr(y), ptr(idx), ptr(x), i64(planes), i64(h), i64(w))
	}
}

// MaxPool2Grad zeroes dx (a memset) and scatters dy to idx; an index outside dx (in device
// memory) is skipped and reported (readReport): the next Sync or Download returns the error.
func (d *Device) MaxPool2Grad(dx, dy, idx engine.Buf) {
	const op = "MaxPool2Grad"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dx, dy, idx) || !d.need(dx.T == dy.T, op, "dx is %v but dy %v", dx.T, dy.T) ||
		!d.need(idx.N == dy.N && idx.T == engine.I32, op, "idx is %d×%v for %d gradients", idx.N, idx.T, dy.N) ||
		!d.need(dy.N <= dx.N, op, "dy has %d elements, dx only %d", dy.N, dx.N) || dx.N == 0 {
		return
	}
	if !d.check(op+": cuMemsetD8Async", d.zero(dx)) || dy.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "maxpool2_scatter", dx.T, 0); ok {
		d.launch(op, f, d.blocks(dy.N, threads), threads, 1, ptr(dx), ptr(dy), ptr(idx), i64(dy.N), i64(dx.N))
		d.reportCheck = true
	}
}

// SoftmaxXent runs one warp per row. The labels are on the device, so one outside [0,
// classes) is found by the kernel: it gives a NaN loss and a gradient without the one-hot
// term, and is reported (readReport): the next Sync or Download returns the error.
func (d *Device) SoftmaxXent(dlogits, loss, logits, labels engine.Buf, rows, classes int, scale float32) {
	const op = "SoftmaxXent"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, dlogits, loss, logits, labels) ||
		!d.need(rows >= 0 && classes >= 1 && logits.N == rows*classes, op,
			"logits has %d elements, not rows×classes = %d×%d", logits.N, rows, classes) ||
		!d.need(dlogits.N == logits.N && dlogits.T == logits.T, op, "dlogits is %d×%v, logits %d×%v",
			dlogits.N, dlogits.T, logits.N, logits.T) ||
		!d.need(loss.N == rows && loss.T == engine.F32, op, "loss is %d×%v, want %d×f32", loss.N, loss.T, rows) ||
		!d.need(labels.N == rows && labels.T == engine.I32, op, "labels is %d×%v, want %d×i32", labels.N, labels.T, rows) ||
		rows == 0 {
		return
	}
	if f, ok := d.kernel(op, "softmax_xent", logits.T, 0); ok {
		d.launch(op, f, d.blocks(rows, threads/32), threads, 1, ptr(dlogits), ptr(loss), ptr(logits), ptr(labels),
			i64(rows), i64(classes), f32(scale))
		d.reportCheck = true
	}
}

// AdamW is vec.AdamW on the device, bit for bit (see kernels.cu), then w = p rounded to w.T
// when w is Valid.
func (d *Device) AdamW(p, m, v, g, w engine.Buf, c vec.AdamConsts) {
	const op = "AdamW"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, p, m, v, g) ||
		!d.need(p.T == engine.F32 && m.T == engine.F32 && v.T == engine.F32, op, "p, m, v are %v, %v, %v; they must be f32", p.T, m.T, v.T) ||
		!d.need(m.N == p.N && v.N == p.N && g.N == p.N, op, "p, m, v, g have %d, %d, %d, %d elements", p.N, m.N, v.N, g.N) ||
		!d.need(!w.Valid() || w.N == p.N, op, "w has %d elements, p %d", w.N, p.N) || p.N == 0 {
		return
	}
	wt, wp := engine.F32, uint64(0)
	if w.Valid() {
		wt, wp = w.T, ptr(w)
	}
	if f, ok := d.kernel(op, "adamw", g.T, wt); ok {
		d.launch(op, f, d.blocks(p.N, threads), threads, 1, ptr(p), ptr(m), ptr(v), ptr(g), wp, i64(p.N),
			f32(c.B1), f32(c.C1), f32(c.B2), f32(c.C2), f32(c.Eps), f32(c.Scale), f32(c.NegStep), f32(c.BC2Sqrt), f32(c.Decay))
	}
}

// UnscaleCheck multiplies g by s and sets found[0] = 1 if an element was Inf or NaN.
func (d *Device) UnscaleCheck(g, found engine.Buf, s float32) {
	const op = "UnscaleCheck"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, g, found) || !d.need(found.N == 1 && found.T == engine.F32, op, "found is %d×%v, want 1×f32", found.N, found.T) || g.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "unscale_check", g.T, 0); ok {
		d.launch(op, f, d.blocks(g.N, threads), threads, 1, ptr(g), ptr(found), i64(g.N), f32(s))
	}
}

// SumSquares adds Σ g² to acc[0]: fp32 per block, one atomicAdd per block (so the last bits
// depend on the blocks' order).
func (d *Device) SumSquares(acc, g engine.Buf) {
	const op = "SumSquares"
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs(op, acc, g) || !d.need(acc.N == 1 && acc.T == engine.F32, op, "acc is %d×%v, want 1×f32", acc.N, acc.T) || g.N == 0 {
		return
	}
	if f, ok := d.kernel(op, "sum_squares", g.T, 0); ok {
		// One wave of blocks (8 of 256 threads fill an SM): fewer atomicAdds of block sums.
		d.launch(op, f, min(d.blocks(g.N, threads), d.maxBlocks/4), threads, 1, ptr(acc), ptr(g), i64(g.N))
	}
}
