package enginetest

import (
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// convShapes cover pad 0, 1 and 2, kernels 1, 3 and 5, one channel and several, one sample
// and sample counts the CPU backend's chunking (at most 16 chunks of ⌈N/16⌉ samples) does not
// divide evenly, kernels larger than the image and outputs larger than the input.
var convShapes = []engine.ConvShape{
	{N: 1, C: 1, H: 5, W: 5, Out: 1, K: 1, Pad: 0},
	{N: 2, C: 3, H: 6, W: 7, Out: 4, K: 3, Pad: 1},
	{N: 5, C: 2, H: 8, W: 6, Out: 3, K: 5, Pad: 2},
	{N: 17, C: 3, H: 8, W: 8, Out: 5, K: 3, Pad: 1}, // CPU: 9 chunks, the last of one sample
	{N: 35, C: 1, H: 4, W: 4, Out: 2, K: 3, Pad: 2}, // CPU: 12 chunks, the last of two; 6×6 out of 4×4
	{N: 3, C: 2, H: 3, W: 3, Out: 2, K: 5, Pad: 2},  // kernel larger than the image
	{N: 2, C: 4, H: 5, W: 5, Out: 3, K: 5, Pad: 0},  // 1×1 output
	{N: 4, C: 1, H: 1, W: 9, Out: 2, K: 1, Pad: 0},  // one row
}

// taps calls f for every (sample, output channel, output pixel, input channel, kernel tap)
// whose input pixel lies inside the image: the terms of a convolution's sums.
func taps(s engine.ConvShape, f func(xi, wi, yi int)) {
	oh, ow := s.OH(), s.OW()
	for n := range s.N {
		for o := range s.Out {
			for oy := range oh {
				for ox := range ow {
					yi := ((n*s.Out+o)*oh+oy)*ow + ox
					for c := range s.C {
						for ki := range s.K {
							iy := oy + ki - s.Pad
							if iy < 0 || iy >= s.H {
								continue
							}
							for kj := range s.K {
								ix := ox + kj - s.Pad
								if ix < 0 || ix >= s.W {
									continue
								}
								f(((n*s.C+c)*s.H+iy)*s.W+ix, ((o*s.C+c)*s.K+ki)*s.K+kj, yi)
							}
						}
					}
				}
			}
		}
	}
}

// conv64 is Conv2D's definition in float64, with each output's sum of magnitudes.
func conv64(s engine.ConvShape, x, w, b []float32) (y, mag []float64) {
	_, ny, _ := s.Elems()
	y, mag = make([]float64, ny), make([]float64, ny)
	ohw := s.OH() * s.OW()
	for i := range y {
		bv := float64(b[(i/ohw)%s.Out])
		y[i], mag[i] = bv, math.Abs(bv)
	}
	taps(s, func(xi, wi, yi int) {
		v := float64(x[xi]) * float64(w[wi])
		y[yi] += v
		mag[yi] += math.Abs(v)
	})
	return y, mag
}

// convGrads are Conv2DBackward's results in float64, each with its sums of magnitudes.
type convGrads struct {
	dx, dxMag, dw, dwMag, db, dbMag []float64
}

// convBackward64 is Conv2DBackward's definition in float64 (beta 0).
func convBackward64(s engine.ConvShape, x, w, dy []float32) convGrads {
	nx, _, nw := s.Elems()
	g := convGrads{dx: make([]float64, nx), dxMag: make([]float64, nx), dw: make([]float64, nw), dwMag: make([]float64, nw),
		db: make([]float64, s.Out), dbMag: make([]float64, s.Out)}
	taps(s, func(xi, wi, yi int) {
		v := float64(dy[yi]) * float64(x[xi])
		g.dw[wi] += v
		g.dwMag[wi] += math.Abs(v)
		v = float64(dy[yi]) * float64(w[wi])
		g.dx[xi] += v
		g.dxMag[xi] += math.Abs(v)
	})
	ohw := s.OH() * s.OW()
	for i, v := range dy {
		o := (i / ohw) % s.Out
		g.db[o] += float64(v)
		g.dbMag[o] += math.Abs(float64(v))
	}
	return g
}

// withBeta adds beta·old to a gradient and its magnitudes (nothing for beta 0).
func withBeta(g, mag []float64, beta float32, old []float32) ([]float64, []float64) {
	if beta == 0 {
		return g, mag
	}
	g, mag = append([]float64(nil), g...), append([]float64(nil), mag...)
	for i, v := range old {
		g[i] += float64(beta) * float64(v)
		mag[i] += math.Abs(float64(beta) * float64(v))
	}
	return g, mag
}

// convOperands allocates and fills a convolution's x, w, bias and dy.
type convOperands struct {
	x, w, b, dy engine.Buf
	X, W, B, DY []float32
}

func (h *harness) convOperands(s engine.ConvShape, dt engine.DType) convOperands {
	h.t.Helper()
	nx, ny, nw := s.Elems()
	var o convOperands
	o.x, o.X = h.random(nx, dt, 1)
	o.w, o.W = h.random(nw, dt, 1/math.Sqrt(float64(s.C*s.K*s.K)))
	o.b, o.B = h.random(s.Out, dt, 0.5)
	o.dy, o.DY = h.random(ny, dt, 1)
	return o
}

// workspace allocates the workspace the device asks for (an invalid Buf when none).
func (h *harness) workspace(s engine.ConvShape, dt engine.DType) engine.Buf {
	h.t.Helper()
	n, wt := h.d.ConvWorkspace(s, dt)
	if n == 0 {
		return engine.Buf{}
	}
	return h.alloc(n, wt)
}

// TestConv2D checks Conv2D against its definition.
func TestConv2D(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range convShapes {
			o := h.convOperands(s, dt)
			_, ny, _ := s.Elems()
			y := h.alloc(ny, dt)
			h.d.Upload(y, nans(ny))
			h.d.Conv2D(y, o.x, o.w, o.b, h.workspace(s, dt), s)
			want, mag := conv64(s, o.X, o.W, o.B)
			h.near(fmt.Sprintf("%v %v", dt, s), dt, h.get(y), want, mag, s.C*s.K*s.K+1)
		}
	}
}

// TestConv2DBackward checks Conv2DBackward against its definition with every subset of dx,
// dw and db requested, and beta 0 (dw and db full of NaN, not read) and 1.
func TestConv2DBackward(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range convShapes {
			o := h.convOperands(s, dt)
			ws := h.workspace(s, dt)
			want := convBackward64(s, o.X, o.W, o.DY)
			h.checkConvBackward(fmt.Sprintf("%v %v", dt, s), s, dt, o, 0, func(dx, dw, db engine.Buf, beta float32) {
				h.d.Conv2DBackward(dx, dw, db, o.dy, o.x, o.w, ws, s, beta)
			}, want)
		}
	}
}

// checkConvBackward runs a backward pass for every subset of outputs and both betas and
// checks the results; rel is extra relative slack for paths that round intermediates.
func (h *harness) checkConvBackward(what string, s engine.ConvShape, dt engine.DType, o convOperands, rel float64,
	run func(dx, dw, db engine.Buf, beta float32), want convGrads) {
	h.t.Helper()
	nx, _, nw := s.Elems()
	dx, dw, db := h.alloc(nx, dt), h.alloc(nw, dt), h.alloc(s.Out, dt)
	for mask := range 8 {
		for _, beta := range []float32{0, 1} {
			h.d.Upload(dx, nans(nx))
			DW := h.put(dw, h.cInit(beta)(nw))
			DB := h.put(db, h.cInit(beta)(s.Out))
			useX, useW, useB := mask&1 != 0, mask&2 != 0, mask&4 != 0
			run(optional(dx, useX), optional(dw, useW), optional(db, useB), beta)
			h.sync(what)
			tag := fmt.Sprintf("%s backward (dx %v, dw %v, db %v, beta %v)", what, useX, useW, useB, beta)
			if useX {
				h.nearRel(tag+": dx", dt, h.get(dx), want.dx, want.dxMag, s.Out*s.K*s.K, rel)
			}
			if useW {
				g, m := withBeta(want.dw, want.dwMag, beta, DW)
				h.nearRel(tag+": dw", dt, h.get(dw), g, m, s.N*s.OH()*s.OW()+1, rel)
			}
			if useB {
				g, m := withBeta(want.db, want.dbMag, beta, DB)
				h.nearRel(tag+": db", dt, h.get(db), g, m, s.N*s.OH()*s.OW()+1, rel)
			}
		}
	}
}

// halfRel is the relative error one rounding to t may add (half a unit in the last place,
// doubled for safety): the slack for a path that stores an intermediate in t.
func halfRel(t engine.DType) float64 {
	switch t {
	case engine.F16:
		return 1.0 / (1 << 10)
	case engine.BF16:
		return 1.0 / (1 << 7)
	}
	return 0
}

// TestUnfoldConv2D checks engine.UnfoldConv2D and UnfoldConv2DBackward, the convolution as a
// device without kernels of its own computes it (Im2Col, Gemm, AddBias, Transpose01, SumRows,
// Col2Im), against the same definitions. With half-precision buffers the intermediates are
// rounded to the working type, so the results may be off by one more rounding of each term.
func TestUnfoldConv2D(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range convShapes {
			o := h.convOperands(s, dt)
			ws := h.alloc(engine.UnfoldWorkspace(s), dt)
			_, ny, _ := s.Elems()
			y := h.alloc(ny, dt)
			h.d.Upload(y, nans(ny))
			engine.UnfoldConv2D(h.d, y, o.x, o.w, o.b, ws, s)
			want, mag := conv64(s, o.X, o.W, o.B)
			h.nearRel(fmt.Sprintf("unfolded %v %v", dt, s), dt, h.get(y), want, mag, s.C*s.K*s.K+1, 2*halfRel(dt))
			grads := convBackward64(s, o.X, o.W, o.DY)
			h.checkConvBackward(fmt.Sprintf("unfolded %v %v", dt, s), s, dt, o, halfRel(dt), func(dx, dw, db engine.Buf, beta float32) {
				engine.UnfoldConv2DBackward(h.d, dx, dw, db, o.dy, o.x, o.w, ws, s, beta)
			}, grads)
		}
	}
}

// TestIm2ColCol2Im checks Im2Col (exactly) and Col2Im against their definitions, and that
// they are adjoint: <Im2Col(x), c> = <x, Col2Im(c)>.
func TestIm2ColCol2Im(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range convShapes {
			n, c, hh, w, k, pad := s.N, s.C, s.H, s.W, s.K, s.Pad
			oh, ow := s.OH(), s.OW()
			npix := n * oh * ow
			nx := n * c * hh * w
			ncols := c * k * k * npix
			x, X := h.random(nx, dt, 1)
			cols := h.alloc(ncols, dt)
			h.d.Upload(cols, nans(ncols))
			h.d.Im2Col(cols, x, n, c, hh, w, k, pad)
			// want: column (n, oy, ox) of row (c, ki, kj) reads x[n, c, oy+ki−pad, ox+kj−pad].
			want := make([]float32, ncols)
			src := make([]int, ncols) // the x index each column entry reads, -1 for padding
			for ch := range c {
				for ki := range k {
					for kj := range k {
						for sm := range n {
							for oy := range oh {
								for ox := range ow {
									i := ((ch*k+ki)*k+kj)*npix + (sm*oh+oy)*ow + ox
									iy, ix := oy+ki-pad, ox+kj-pad
									src[i] = -1
									if iy >= 0 && iy < hh && ix >= 0 && ix < w {
										src[i] = ((sm*c+ch)*hh+iy)*w + ix
										want[i] = X[src[i]]
									}
								}
							}
						}
					}
				}
			}
			tag := fmt.Sprintf("%v %v", dt, s)
			got := h.get(cols)
			h.exact(tag+": im2col", got, want)

			cv := h.put(cols, h.normal(ncols, 1))
			dx := h.alloc(nx, dt)
			h.d.Upload(dx, nans(nx))
			h.d.Col2Im(dx, cols, n, c, hh, w, k, pad)
			sum, mag := make([]float64, nx), make([]float64, nx)
			for i, j := range src {
				if j >= 0 {
					sum[j] += float64(cv[i])
					mag[j] += math.Abs(float64(cv[i]))
				}
			}
			DX := h.get(dx)
			h.near(tag+": col2im", dt, DX, sum, mag, k*k)

			// The adjoint identity, from the two results: Im2Col is exact, so the only error is
			// Col2Im's, bounded element by element as above.
			var lhs, rhs, bound float64
			for i, v := range got {
				lhs += float64(v) * float64(cv[i])
			}
			for i, v := range X {
				rhs += float64(v) * float64(DX[i])
				bound += math.Abs(float64(v)) * tol(dt, sum[i], mag[i], k*k)
			}
			if d := math.Abs(lhs - rhs); d > bound+1e-12*math.Abs(lhs) {
				t.Errorf("%s: <im2col(x), c> = %v, <x, col2im(c)> = %v (off by %.3g, bound %.3g)", tag, lhs, rhs, d, bound)
			}
		}
	}
}
