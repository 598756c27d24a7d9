package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"math"
	"slices"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/vec"
)

// elemGrain is the fewest elements a piece of an element-wise pass gets (64 KiB of fp32):
// below it, handing work to another goroutine costs more than it saves.
const elemGrain = 1 << 14

func (d *Device) Upload(dst engine.Buf, src []float32) {
	if !d.check(len(src) == dst.N, "upload of %d values into %d", len(src), dst.N) {
		return
	}
	switch dst.T {
	case engine.F32:
		if D := d.f32(dst); D != nil {
			copy(D, src)
		}
	case engine.F16, engine.BF16:
		if D := d.u16(dst); D != nil || dst.N == 0 {
			encode(D, src, dst.T)
		}
	default:
		d.fail("upload of floats into a %v buffer", dst.T)
	}
}

func (d *Device) UploadInt32(dst engine.Buf, src []int32) {
	if D := d.i32(dst); D != nil && d.check(len(src) == dst.N, "upload of %d ints into %d", len(src), dst.N) {
		copy(D, src)
	}
}

func (d *Device) Download(dst []float32, src engine.Buf) error {
	if d.check(len(dst) == src.N, "download of %d values into %d", src.N, len(dst)) {
		switch src.T {
		case engine.I32:
			if S := d.i32(src); S != nil {
				for i, v := range S {
					dst[i] = float32(v)
				}
			}
		case engine.F32:
			if S := d.f32(src); S != nil {
				copy(dst, S)
			}
		default:
			if S := d.u16(src); S != nil {
				decode(dst, S, src.T)
			}
		}
	}
	return d.Sync()
}

func (d *Device) Fill(b engine.Buf, v float32) {
	switch b.T {
	case engine.I32:
		if D := d.i32(b); D != nil {
			for i := range D {
				D[i] = int32(v)
			}
		}
	case engine.F32:
		if D := d.f32(b); D != nil {
			for i := range D {
				D[i] = v
			}
		}
	default:
		if D := d.u16(b); D != nil {
			var w [1]uint16
			encode(w[:], []float32{v}, b.T)
			for i := range D {
				D[i] = w[0]
			}
		}
	}
}

func (d *Device) Copy(dst, src engine.Buf) {
	if !d.check(dst.N == src.N && dst.T.Float() && src.T.Float(), "copy of %d %v into %d %v", src.N, src.T, dst.N, dst.T) {
		return
	}
	if dst.T == src.T {
		if D, S := d.raw(dst), d.raw(src); D != nil && S != nil {
			copy(D, S)
		}
		return
	}
	S := d.floats(src, 0)
	if S == nil {
		return
	}
	if dst.T == engine.F32 {
		if D := d.f32(dst); D != nil {
			copy(D, S)
		}
		return
	}
	if D := d.u16(dst); D != nil {
		encode(D, S, dst.T)
	}
}

// unaryPass is the element-wise passes over rows or elements.
type unaryPass struct {
	op      int
	y, x, g []float32
	b       []float32
	cols    int
	perRow  bool
	s       float32
	bad     [gemmMaxBlocks * 4]int32 // UnscaleCheck: one flag per piece start
	grain   int
	idx     []int32 // opScatter: where each gradient goes
}

const (
	opReLU = iota
	opReLUGrad
	opBiasRows
	opUnscale
	opClear
	opScatter
)

func (u *unaryPass) Range(lo, hi int) {
	switch u.op {
	case opReLU:
		C.qvd_relu(fptr(u.y[lo:hi]), fptr(u.x[lo:hi]), C.long(hi-lo))
	case opReLUGrad:
		C.qvd_relu_grad(fptr(u.y[lo:hi]), fptr(u.g[lo:hi]), fptr(u.x[lo:hi]), C.long(hi-lo))
	case opBiasRows:
		// Rows [lo, hi) of y.
		b := u.b
		if u.perRow {
			b = u.b[lo:hi]
		}
		C.qvd_add_bias(fptr(u.y[lo*u.cols:hi*u.cols]), fptr(b), C.long(hi-lo), C.long(u.cols), C.int(boolInt(u.perRow)))
	case opClear:
		clear(u.y[lo:hi])
	case opScatter:
		if C.qvd_maxpool2_grad(fptr(u.y), C.long(len(u.y)), fptr(u.g[lo:hi]), iptr(u.idx[lo:hi]), C.long(hi-lo)) >= 0 {
			u.bad[(lo/u.grain)%len(u.bad)] = 1
		}
	case opUnscale:
		if C.qvd_unscale_check(fptr(u.y[lo:hi]), C.long(hi-lo), C.float(u.s)) != 0 {
			u.bad[(lo/u.grain)%len(u.bad)] = 1
		}
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (d *Device) run(u *unaryPass, n, grain int) {
	u.grain = grain
	d.pool.Run(n, grain, u)
	*u = unaryPass{}
}

// biasLen is the length of a per-column (or, perRow, per-row) vector of a rows×cols matrix.
func biasLen(rows, cols int, perRow bool) int {
	if perRow {
		return rows
	}
	return cols
}

func (d *Device) AddBias(y, bias engine.Buf, rows, cols int, perRow bool) {
	if !d.check(y.N == rows*cols && bias.N == biasLen(rows, cols, perRow), "add_bias %dx%d with %d biases", rows, cols, bias.N) {
		return
	}
	Y, B := d.target(y, 0, true), d.floats(bias, 1)
	if Y == nil || B == nil {
		return
	}
	d.run(&unaryPass{op: opBiasRows, y: Y, b: B, cols: cols, perRow: perRow}, rows, max(1, elemGrain/max(cols, 1)))
	roundTo(Y, y.T)
	d.commit(y, Y)
}

func (d *Device) SumRows(dst, src engine.Buf, rows, cols int, perRow bool, beta float32) {
	if !d.check(src.N == rows*cols && dst.N == biasLen(rows, cols, perRow), "sum_rows %dx%d into %d", rows, cols, dst.N) {
		return
	}
	S := d.floats(src, 0)
	D := d.target(dst, 1, beta != 0)
	if S == nil || D == nil {
		return
	}
	acc := d.scratch(2, len(D))
	if acc == nil {
		return
	}
	clear(acc)
	C.qvd_sum_rows(fptr(acc), fptr(S), C.long(rows), C.long(cols), C.int(boolInt(perRow)))
	for i, v := range acc {
		if beta != 0 {
			v += beta * D[i]
		}
		D[i] = v
	}
	roundTo(D, dst.T)
	d.commit(dst, D)
}

func (d *Device) ReLU(y, x engine.Buf) {
	if !d.check(y.N == x.N, "relu of %d into %d", x.N, y.N) {
		return
	}
	X := d.floats(x, 0)
	Y := d.target(y, 1, false)
	if X == nil || Y == nil {
		return
	}
	d.unary = unaryPass{op: opReLU, y: Y, x: X}
	d.run(&d.unary, len(Y), elemGrain)
	d.commit(y, Y) // max(x, 0) of a value of x's type is exact in y's type when they match
}

func (d *Device) ReLUGrad(dx, dy, y engine.Buf) {
	if !d.check(dx.N == dy.N && dy.N == y.N, "relu_grad lengths %d, %d, %d", dx.N, dy.N, y.N) {
		return
	}
	DY, Y := d.floats(dy, 0), d.floats(y, 1)
	DX := d.target(dx, 2, false)
	if DX == nil || DY == nil || Y == nil {
		return
	}
	d.unary = unaryPass{op: opReLUGrad, y: DX, g: DY, x: Y}
	d.run(&d.unary, len(DX), elemGrain)
	roundTo(DX, dx.T)
	d.commit(dx, DX)
}

func (d *Device) Transpose01(dst, src engine.Buf, a, b, r int) {
	if !d.check(dst.N == a*b*r && src.N == a*b*r, "transpose01 %dx%dx%d on %d and %d", a, b, r, src.N, dst.N) {
		return
	}
	S := d.floats(src, 0)
	D := d.target(dst, 1, false)
	if S == nil || D == nil {
		return
	}
	C.qvd_transpose01(fptr(D), fptr(S), C.long(a), C.long(b), C.long(r))
	roundTo(D, dst.T)
	d.commit(dst, D)
}

// convShapes checks a batch-wide unfolding's buffers.
func (d *Device) convShapes(op string, cols, x engine.Buf, n, c, h, w, k, pad int) (oh, ow int, ok bool) {
	oh, ow = h+2*pad-k+1, w+2*pad-k+1
	return oh, ow, d.check(x.N == n*c*h*w && cols.N == c*k*k*n*oh*ow && oh > 0 && ow > 0, "%s shapes", op)
}

// Im2Col is the batch-wide unfolding of the Device interface (sample-major columns); the
// engine's convolutions use Conv2D, which never builds it.
func (d *Device) Im2Col(cols, x engine.Buf, n, c, h, w, k, pad int) {
	oh, ow, ok := d.convShapes("im2col", cols, x, n, c, h, w, k, pad)
	if !ok {
		return
	}
	X := d.floats(x, 0)
	Cl := d.target(cols, 1, false)
	if X == nil || Cl == nil {
		return
	}
	ohw := oh * ow
	for s := 0; s < n; s++ {
		C.qvd_im2col(fptr(Cl[s*ohw:]), C.long(n*ohw), fptr(X[s*c*h*w:]), C.long(c), C.long(h), C.long(w), C.long(k), C.long(pad))
	}
	d.commit(cols, Cl)
}

// Col2Im is Im2Col's adjoint.
func (d *Device) Col2Im(dx, cols engine.Buf, n, c, h, w, k, pad int) {
	oh, ow, ok := d.convShapes("col2im", cols, dx, n, c, h, w, k, pad)
	if !ok {
		return
	}
	Cl := d.floats(cols, 0)
	DX := d.target(dx, 1, false)
	if Cl == nil || DX == nil {
		return
	}
	ohw := oh * ow
	for s := 0; s < n; s++ {
		C.qvd_col2im(fptr(DX[s*c*h*w:]), fptr(Cl[s*ohw:]), C.long(n*ohw), C.long(c), C.long(h), C.long(w), C.long(k), C.long(pad))
	}
	roundTo(DX, dx.T)
	d.commit(dx, DX)
}

type poolPass struct {
	y, x    []float32
	idx     []int32
	h, w    int
	planeIn int
}

// Range pools planes [lo, hi).
func (p *poolPass) Range(lo, hi int) {
	oh, ow := p.h/2, p.w/2
	in, out := p.h*p.w, oh*ow
	C.qvd_maxpool2(fptr(p.y[lo*out:hi*out]), iptr(p.idx[lo*out:hi*out]), fptr(p.x[lo*in:hi*in]), C.long(hi-lo), C.long(p.h), C.long(p.w), C.long(lo*in))
}

func (d *Device) MaxPool2(y, idx, x engine.Buf, planes, h, w int) {
	oh, ow := h/2, w/2
	if !d.check(x.N == planes*h*w && y.N == planes*oh*ow && idx.N == y.N, "maxpool2 shapes") {
		return
	}
	X, I := d.floats(x, 0), d.i32(idx)
	Y := d.target(y, 1, false)
	if X == nil || Y == nil || (I == nil && idx.N > 0) {
		return
	}
	d.pool2 = poolPass{y: Y, x: X, idx: I, h: h, w: w}
	d.pool.Run(planes, max(1, elemGrain/max(h*w, 1)), &d.pool2)
	d.pool2 = poolPass{}
	d.commit(y, Y)
}

// MaxPool2Grad routes dy to the maxima: dx is zeroed, then dx[idx[i]] = dy[i].
func (d *Device) MaxPool2Grad(dx, dy, idx engine.Buf) {
	if !d.check(dy.N == idx.N, "maxpool2_grad: %d gradients, %d indices", dy.N, idx.N) {
		return
	}
	DY, I := d.floats(dy, 0), d.i32(idx)
	DX := d.target(dx, 1, false)
	if DX == nil || DY == nil || I == nil {
		if DX != nil {
			clear(DX)
			d.commit(dx, DX)
		}
		return
	}
	// Each input is the maximum of at most one 2×2 window, so the scatter writes every
	// element at most once: both passes split freely across the pool. The scatter checks the
	// indices as it goes; the error names the first bad one.
	d.unary = unaryPass{op: opClear, y: DX}
	d.run(&d.unary, len(DX), elemGrain)
	u := &d.unary
	*u = unaryPass{op: opScatter, y: DX, g: DY, idx: I, grain: elemGrain}
	d.pool.Run(len(I), elemGrain, u)
	bad := slices.Contains(u.bad[:], 1)
	*u = unaryPass{}
	if bad {
		for i, j := range I {
			if j < 0 || int(j) >= len(DX) {
				d.fail("maxpool2_grad: index %d of gradient %d outside %d inputs", j, i, len(DX))
				return
			}
		}
	}
	roundTo(DX, dx.T)
	d.commit(dx, DX)
}

func (d *Device) SoftmaxXent(dlogits, loss, logits, labels engine.Buf, rows, classes int, scale float32) {
	if !d.check(logits.N == rows*classes && dlogits.N == logits.N && loss.N == rows && labels.N == rows && loss.T == engine.F32, "softmax_xent shapes") {
		return
	}
	Z := d.floats(logits, 0)
	L, Y := d.f32(loss), d.i32(labels)
	D := d.target(dlogits, 1, false)
	if Z == nil || L == nil || Y == nil || D == nil {
		return
	}
	if r := C.qvd_softmax_xent(fptr(D), fptr(L), fptr(Z), iptr(Y), C.long(rows), C.long(classes), C.float(scale)); r >= 0 {
		d.fail("softmax_xent: label %d of row %d outside [0, %d)", Y[r], r, classes)
		return
	}
	roundTo(D, dlogits.T)
	d.commit(dlogits, D)
}

type adamPass struct {
	p, m, v, g []float32
	c          vec.AdamConsts
}

func (a *adamPass) Range(lo, hi int) { vec.AdamW(a.p[lo:hi], a.g[lo:hi], a.m[lo:hi], a.v[lo:hi], &a.c) }

func (d *Device) AdamW(p, m, v, g, w engine.Buf, c vec.AdamConsts) {
	P, M, V := d.f32(p), d.f32(m), d.f32(v)
	G := d.floats(g, 0)
	if P == nil || M == nil || V == nil || G == nil || !d.check(len(M) == len(P) && len(V) == len(P) && len(G) == len(P), "adamw: shapes") {
		return
	}
	d.adam = adamPass{p: P, m: M, v: V, g: G, c: c}
	d.pool.Run(len(P), elemGrain, &d.adam)
	d.adam = adamPass{}
	if w.Valid() {
		if !d.check(w.N == len(P), "adamw: %d working weights for %d", w.N, len(P)) {
			return
		}
		if w.T == engine.F32 {
			if W := d.f32(w); W != nil {
				copy(W, P)
			}
		} else if W := d.u16(w); W != nil {
			encode(W, P, w.T)
		}
	}
}

func (d *Device) UnscaleCheck(g, found engine.Buf, s float32) {
	F := d.f32(found)
	G := d.target(g, 0, true)
	if G == nil || F == nil || !d.check(len(F) == 1, "unscale_check: found has %d elements", len(F)) {
		return
	}
	u := &d.unary
	*u = unaryPass{op: opUnscale, y: G, s: s}
	u.grain = elemGrain
	d.pool.Run(len(G), elemGrain, u)
	for _, b := range u.bad {
		if b != 0 {
			F[0] = 1
		}
	}
	*u = unaryPass{}
	roundTo(G, g.T)
	d.commit(g, G)
}

func (d *Device) SumSquares(acc, g engine.Buf) {
	A := d.f32(acc)
	G := d.floats(g, 0)
	if A == nil || G == nil || !d.check(len(A) == 1, "sum_squares: accumulator must be one f32") {
		return
	}
	s := d.pool.SumSquares(G)
	if math.IsNaN(s) || math.IsInf(s, 0) {
		A[0] = float32(math.Inf(1))
		return
	}
	A[0] += float32(s)
}
