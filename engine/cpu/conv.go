package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/vec"
)

// Convolutions run one sample at a time: the sample is unfolded into C·K·K × OH·OW columns
// (small enough to stay in the core's L2 cache: 113 KiB for the shipped CNN's second layer),
// multiplied by the weights straight into its NCHW output, and in the backward pass the
// unfolding is recomputed from the input instead of kept. There is no batch-wide unfolding
// and no transpose between layouts, which is what made the unfolded GEMM slow on the CPU
// (the batch's columns do not fit any cache, and NCHW ↔ channel-major costs a pass each way).
//
// Samples are cut into chunks by the batch size alone; each chunk's weight and bias gradients
// are summed into a partial of their own, and the partials are added in chunk order, so the
// gradients do not depend on the number of threads.

// convChunk is the number of samples per chunk: small enough to give a 2–16 thread pool
// several chunks each, large enough that the partial sums stay few.
func convChunks(n int) (chunks, per int) {
	chunks = min(n, 16)
	if chunks == 0 {
		return 0, 0
	}
	per = (n + chunks - 1) / chunks
	return (n + per - 1) / per, per
}

// convLayout is where a convolution's workspace parts lie, in fp32 elements.
type convLayout struct {
	chunks, per          int
	colsOff, threadCols  int // per thread: cols and dcols, threadCols elements each
	tOff, threadT        int // per thread: dyᵀ and the transposed weight gradient
	dwOff, dbOff         int // per chunk partials (backward)
	xOff, yOff, dxOff    int // fp32 copies for half-precision activations
	wOff, bOff, dwAllOff int
	total                int
}

func (d *Device) convLayout(s engine.ConvShape, t engine.DType) convLayout {
	var l convLayout
	l.chunks, l.per = convChunks(s.N)
	nx, ny, nw := s.Elems()
	ckk := s.C * s.K * s.K
	l.threadCols = ckk * s.OH() * s.OW()
	at := 0
	take := func(n int) int { o := at; at += n; return o }
	l.colsOff = take(2 * d.threads * l.threadCols)
	l.threadT = s.Out * (s.OH()*s.OW() + ckk)
	l.tOff = take(d.threads * l.threadT)
	l.dwOff = take(l.chunks * nw)
	l.dbOff = take(l.chunks * s.Out)
	if t != engine.F32 {
		l.xOff, l.yOff, l.dxOff = take(nx), take(ny), take(nx)
		l.wOff, l.bOff, l.dwAllOff = take(nw), take(s.Out), take(nw+s.Out)
	}
	l.total = at
	return l
}

// ConvWorkspace is fp32 scratch for the per-thread unfoldings and transposes, the per-chunk gradient
// partials and, with half-precision activations, fp32 copies of the operands.
func (d *Device) ConvWorkspace(s engine.ConvShape, t engine.DType) (int, engine.DType) {
	return d.convLayout(s, t).total, engine.F32
}

type convPass struct {
	s             engine.ConvShape
	backward      bool
	x, w, bias, y []float32 // forward: y = conv(x); backward: y is dy
	dx, dw, db    []float32 // backward outputs (nil where not wanted)
	ws            []float32
	l             convLayout
	free          chan int // thread slots for the unfolding scratch
}

func (p *convPass) Range(lo, hi int) {
	slot := <-p.free
	defer func() { p.free <- slot }()
	s, l := p.s, p.l
	cols := p.ws[l.colsOff+2*slot*l.threadCols:]
	dcols := cols[l.threadCols:]
	tws := p.ws[l.tOff+slot*l.threadT:]
	nx1, ny1 := s.C*s.H*s.W, s.Out*s.OH()*s.OW()
	nw := s.Out * s.C * s.K * s.K
	for ch := lo; ch < hi; ch++ {
		s0, s1 := ch*l.per, min((ch+1)*l.per, s.N)
		if s0 >= s1 {
			continue
		}
		n := C.long(s1 - s0)
		x := p.x[s0*nx1:]
		if !p.backward {
			C.qvd_conv_fwd(fptr(p.y[s0*ny1:]), fptr(x), fptr(p.w), fptr(p.bias), n, C.long(s.C), C.long(s.H), C.long(s.W),
				C.long(s.Out), C.long(s.K), C.long(s.Pad), fptr(cols))
			continue
		}
		var dw, db, dx *C.float
		if p.dw != nil {
			part := p.ws[l.dwOff+ch*nw : l.dwOff+(ch+1)*nw]
			clear(part)
			dw = fptr(part)
		}
		if p.db != nil {
			part := p.ws[l.dbOff+ch*s.Out : l.dbOff+(ch+1)*s.Out]
			clear(part)
			db = fptr(part)
		}
		if p.dx != nil {
			dx = fptr(p.dx[s0*nx1:])
		}
		C.qvd_conv_bwd(dx, dw, db, fptr(p.y[s0*ny1:]), fptr(x), fptr(p.w), n, C.long(s.C), C.long(s.H), C.long(s.W),
			C.long(s.Out), C.long(s.K), C.long(s.Pad), fptr(cols), fptr(dcols), fptr(tws))
	}
}

// convBufs resolves a convolution's operands to fp32 (copies in ws for half precision).
func (d *Device) convIn(b engine.Buf, ws []float32, off int) []float32 {
	if b.T == engine.F32 {
		return d.f32(b)
	}
	src := d.u16(b)
	if src == nil {
		if d.err == nil {
			d.fail("conv: bad operand")
		}
		return nil
	}
	dst := ws[off : off+b.N]
	decode(dst, src, b.T)
	return dst
}

func (d *Device) convCheck(op string, s engine.ConvShape, x, y, w, ws engine.Buf) (convLayout, []float32, bool) {
	if !d.check(s.Valid(), "%s: invalid shape %v", op, s) {
		return convLayout{}, nil, false
	}
	nx, ny, nw := s.Elems()
	l := d.convLayout(s, x.T)
	if !d.check(x.N == nx && y.N == ny && w.N == nw, "%s: buffers of %d, %d, %d for %v", op, x.N, y.N, w.N, s) ||
		!d.check(x.T.Float() && y.T == x.T && w.T == x.T, "%s: types %v, %v, %v", op, x.T, y.T, w.T) ||
		!d.check(ws.N >= l.total && ws.T == engine.F32, "%s: workspace of %d %v, needs %d f32", op, ws.N, ws.T, l.total) {
		return l, nil, false
	}
	W := d.f32(ws)
	return l, W, W != nil
}

func (d *Device) runConv(p *convPass) {
	if cap(d.conv.free) < d.threads {
		d.conv.free = make(chan int, d.threads)
	}
	free := d.conv.free
	for len(free) > 0 {
		<-free
	}
	for i := 0; i < d.threads; i++ {
		free <- i
	}
	p.free = free
	d.pool.Run(p.l.chunks, 1, p)
}

func (d *Device) Conv2D(y, x, w, bias, ws engine.Buf, s engine.ConvShape) {
	l, W, ok := d.convCheck("conv2d", s, x, y, w, ws)
	if !ok || !d.check(bias.N == s.Out && bias.T == x.T, "conv2d: %d %v biases for %d channels", bias.N, bias.T, s.Out) {
		return
	}
	p := &d.conv
	*p = convPass{s: s, l: l, ws: W, free: p.free}
	p.x, p.w, p.bias = d.convIn(x, W, l.xOff), d.convIn(w, W, l.wOff), d.convIn(bias, W, l.bOff)
	if y.T == engine.F32 {
		p.y = d.f32(y)
	} else {
		p.y = W[l.yOff : l.yOff+y.N]
	}
	if p.x == nil || p.w == nil || p.bias == nil || p.y == nil {
		return
	}
	if s.N > 0 {
		d.runConv(p)
	}
	if y.T != engine.F32 {
		encode(d.u16(y), p.y, y.T)
	}
	d.clearConv()
}

func (d *Device) Conv2DBackward(dx, dw, db, dy, x, w, ws engine.Buf, s engine.ConvShape, beta float32) {
	l, W, ok := d.convCheck("conv2d_backward", s, x, dy, w, ws)
	if !ok {
		return
	}
	nx, _, nw := s.Elems()
	if (dw.Valid() && !d.check(dw.N == nw && dw.T.Float(), "conv2d_backward: dw of %d %v for %d weights", dw.N, dw.T, nw)) ||
		(db.Valid() && !d.check(db.N == s.Out && db.T.Float(), "conv2d_backward: db of %d %v for %d channels", db.N, db.T, s.Out)) ||
		(dx.Valid() && !d.check(dx.N == nx && dx.T == x.T, "conv2d_backward: dx of %d %v for %d inputs", dx.N, dx.T, nx)) {
		return
	}
	p := &d.conv
	*p = convPass{s: s, l: l, ws: W, backward: true, free: p.free}
	p.x, p.w, p.y = d.convIn(x, W, l.xOff), d.convIn(w, W, l.wOff), d.convIn(dy, W, l.yOff)
	if p.x == nil || p.w == nil || p.y == nil {
		return
	}
	if dw.Valid() {
		p.dw = W[l.dwOff : l.dwOff+1] // marks "wanted"; the partials are per chunk
	}
	if db.Valid() {
		p.db = W[l.dbOff : l.dbOff+1]
	}
	if dx.Valid() {
		if dx.T == engine.F32 {
			p.dx = d.f32(dx)
		} else {
			p.dx = W[l.dxOff : l.dxOff+nx]
		}
		if p.dx == nil {
			return
		}
	}
	if s.N > 0 {
		d.runConv(p)
	}
	// The chunks' partial sums, added in chunk order into the first chunk's (a vector add per
	// chunk: the same sums, element by element, as a loop over the chunks would make).
	sum := func(dst engine.Buf, off, size int) {
		out := d.target(dst, 3, beta != 0)
		if out == nil {
			return
		}
		var acc []float32
		if l.chunks > 0 {
			acc = W[off : off+size]
			for ch := 1; ch < l.chunks; ch++ {
				vec.Add(acc, W[off+ch*size:off+(ch+1)*size])
			}
		}
		for i := range out {
			v := float32(0)
			if acc != nil {
				v = acc[i]
			}
			if beta != 0 {
				v += beta * out[i]
			}
			out[i] = v
		}
		roundTo(out, dst.T)
		d.commit(dst, out)
	}
	if dw.Valid() {
		sum(dw, l.dwOff, nw)
	}
	if db.Valid() {
		sum(db, l.dbOff, s.Out)
	}
	if dx.Valid() && dx.T != engine.F32 {
		encode(d.u16(dx), p.dx, dx.T)
	}
	d.clearConv()
}

// clearConv drops the pass's references to the buffers.
func (d *Device) clearConv() {
	free := d.conv.free
	d.conv = convPass{free: free}
}
