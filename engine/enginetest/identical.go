package enginetest

import (
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// TestBitIdentical runs the operations whose parallel passes cut work or add partial sums
// (GEMMs, convolutions, row sums, sums of squares, the transformer layers' operations) on one device from each constructor, on
// the same inputs and on shapes large enough for the passes to split, and checks that every
// result is the same bits on all of them: the CPU backend at different thread counts must
// agree exactly.
func TestBitIdentical(t *testing.T, newDevices ...NewDevice) {
	conv := engine.ConvShape{N: 64, C: 16, H: 14, W: 14, Out: 32, K: 3, Pad: 1}
	type gemm struct {
		transA, transB bool
		m, n, k        int
		ld             int // extra leading dimension (GemmLD when > 0)
	}
	gemms := []gemm{
		{false, false, 64, 1568, 128, 0},
		{true, false, 784, 256, 64, 0},
		{false, true, 64, 1568, 128, 0},
		{true, true, 784, 256, 64, 0},
		{false, false, 2000, 24, 300, 0}, // cut by rows
		{false, false, 64, 1568, 128, 7},
		{true, false, 784, 256, 64, 3},
	}
	var cases []struct {
		name string
		run  func(h *harness) []engine.Buf
	}
	add := func(name string, run func(h *harness) []engine.Buf) {
		cases = append(cases, struct {
			name string
			run  func(h *harness) []engine.Buf
		}{name, run})
	}
	for _, dt := range []engine.DType{engine.F32, engine.BF16} {
		for _, g := range gemms {
			for _, beta := range []float32{0, 1} {
				add(fmt.Sprintf("gemm %v %+v beta %v", dt, g, beta), func(h *harness) []engine.Buf {
					ar, ac := stored(g.m, g.k, g.transA)
					br, bc := stored(g.k, g.n, g.transB)
					lda, ldb, ldc := ac+g.ld, bc+g.ld, g.n+g.ld
					a, _ := h.strided(ar, ac, lda, dt, 0, nil)
					b, _ := h.strided(br, bc, ldb, dt, 0, nil)
					c, _ := h.strided(g.m, g.n, ldc, dt, 0, nil)
					if g.ld == 0 {
						h.d.Gemm(g.transA, g.transB, g.m, g.n, g.k, 0.5, a, b, beta, c)
					} else {
						h.d.GemmLD(g.transA, g.transB, g.m, g.n, g.k, 0.5, a, lda, b, ldb, beta, c, ldc)
					}
					return []engine.Buf{c}
				})
			}
		}
		add(fmt.Sprintf("conv2d %v %v", dt, conv), func(h *harness) []engine.Buf {
			o := h.convOperands(conv, dt)
			_, ny, _ := conv.Elems()
			y := h.alloc(ny, dt)
			h.d.Conv2D(y, o.x, o.w, o.b, h.workspace(conv, dt), conv)
			return []engine.Buf{y}
		})
		for _, beta := range []float32{0, 1} {
			add(fmt.Sprintf("conv2d_backward %v %v beta %v", dt, conv, beta), func(h *harness) []engine.Buf {
				o := h.convOperands(conv, dt)
				nx, _, nw := conv.Elems()
				dx := h.alloc(nx, dt)
				dw, _ := h.random(nw, dt, 1)
				db, _ := h.random(conv.Out, dt, 1)
				h.d.Conv2DBackward(dx, dw, db, o.dy, o.x, o.w, h.workspace(conv, dt), conv, beta)
				return []engine.Buf{dx, dw, db}
			})
		}
		add(fmt.Sprintf("sum_rows %v", dt), func(h *harness) []engine.Buf {
			src, _ := h.random(32*50000, dt, 1)
			cols, rows := h.alloc(50000, dt), h.alloc(32, dt)
			h.d.SumRows(cols, src, 32, 50000, false, 0)
			h.d.SumRows(rows, src, 32, 50000, true, 0)
			return []engine.Buf{cols, rows}
		})
		add(fmt.Sprintf("sum_squares %v", dt), func(h *harness) []engine.Buf {
			g, _ := h.random(1<<20+3, dt, 1)
			acc, _ := h.filled(1, engine.F32, 0)
			h.d.SumSquares(acc, g)
			return []engine.Buf{acc}
		})
		transformerIdentical(dt, add)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var first [][]float32
			for di, nd := range newDevices {
				h := newHarness(t, nd)
				var outs [][]float32
				for _, b := range c.run(h) {
					outs = append(outs, h.get(b))
				}
				if di == 0 {
					first = outs
					continue
				}
				for oi, out := range outs {
					for i, v := range out {
						if math.Float32bits(v) != math.Float32bits(first[oi][i]) {
							t.Errorf("device %d (%s), output %d: element %d is %v (%#x), device 0 made %v (%#x)",
								di, h.d.Name(), oi, i, v, math.Float32bits(v), first[oi][i], math.Float32bits(first[oi][i]))
							break
						}
					}
				}
			}
		})
	}
}

// transformerIdentical adds the transformer layers' operations on a ViT's shapes (micro-batch
// 64, 17 tokens, dim 192, 6 heads) to TestBitIdentical's cases.
func transformerIdentical(dt engine.DType, add func(string, func(h *harness) []engine.Buf)) {
	const batch, tokens, dim, heads = 64, 17, 192, 6
	const rows, dh = batch * tokens, dim / heads
	for _, beta := range []float32{0, 1} {
		add(fmt.Sprintf("gemm_batched %v attention beta %v", dt, beta), func(h *harness) []engine.Buf {
			// Scores of head 0 (Q·Kᵀ over the samples), then its output P·V into the heads'
			// interleaved columns.
			qkv, _ := h.random(rows*3*dim, dt, 1)
			s, _ := h.random(batch*tokens*tokens, dt, 1)
			h.d.GemmBatched(false, true, tokens, tokens, dh, 0.17, qkv, 3*dim, tokens*3*dim, qkv.Slice(dim, qkv.N), 3*dim, tokens*3*dim,
				beta, s, tokens, tokens*tokens, batch)
			o, _ := h.random(rows*dim, dt, 1)
			h.d.GemmBatched(false, false, tokens, dh, tokens, 1, s, tokens, tokens*tokens, qkv.Slice(2*dim, qkv.N), 3*dim, tokens*3*dim,
				beta, o, dim, tokens*dim, batch)
			return []engine.Buf{s, o}
		})
		add(fmt.Sprintf("gemm_batched %v large products beta %v", dt, beta), func(h *harness) []engine.Buf {
			a, _ := h.random(2*128*128, dt, 1)
			b, _ := h.random(128*64, dt, 1)
			c, _ := h.random(2*128*64, dt, 1)
			h.d.GemmBatched(false, false, 128, 64, 128, 1, a, 128, 128*128, b, 64, 0, beta, c, 64, 128*64, 2)
			return []engine.Buf{c}
		})
	}
	add(fmt.Sprintf("element-wise %v", dt), func(h *harness) []engine.Buf {
		const n = 1<<18 + 5
		x, _ := h.random(n, dt, 2)
		g, _ := h.random(n, dt, 1)
		y, dx, dr := h.alloc(n, dt), h.alloc(n, dt), h.alloc(n, dt)
		h.d.GELU(y, x)
		h.d.GELUGrad(dx, g, x)
		h.d.Dropout(dr, x, 0.1, 42)
		h.d.Axpby(g, x, 0.5, 1)
		return []engine.Buf{y, dx, dr, g}
	})
	add(fmt.Sprintf("softmax %v", dt), func(h *harness) []engine.Buf {
		n := batch * heads * tokens
		x, _ := h.random(n*tokens, dt, 2)
		dy, _ := h.random(n*tokens, dt, 1)
		y, dx := h.alloc(n*tokens, dt), h.alloc(n*tokens, dt)
		h.d.Softmax(y, x, n, tokens, 0.17)
		h.d.SoftmaxGrad(dx, dy, y, n, tokens, 0.17)
		return []engine.Buf{y, dx}
	})
	for _, b := range []float32{0, 1} {
		add(fmt.Sprintf("layer_norm %v b %v", dt, b), func(h *harness) []engine.Buf {
			x, _ := h.random(rows*dim, dt, 1)
			g, _ := h.random(dim, dt, 1)
			bt, _ := h.random(dim, dt, 1)
			dy, _ := h.random(rows*dim, dt, 1)
			y, dx := h.alloc(rows*dim, dt), h.alloc(rows*dim, dt)
			mean, rstd := h.alloc(rows, engine.F32), h.alloc(rows, engine.F32)
			dg, _ := h.random(dim, dt, 1)
			db, _ := h.random(dim, dt, 1)
			h.d.LayerNorm(y, mean, rstd, x, g, bt, rows, dim, 1e-5)
			h.d.LayerNormBackward(dx, dg, db, dy, x, mean, rstd, g, rows, dim, b)
			return []engine.Buf{y, mean, rstd, dx, dg, db}
		})
		add(fmt.Sprintf("batch_norm %v b %v", dt, b), func(h *harness) []engine.Buf {
			const n, c, hw = 64, 16, 196
			x, _ := h.random(n*c*hw, dt, 1)
			g, _ := h.random(c, dt, 1)
			bt, _ := h.random(c, dt, 1)
			dy, _ := h.random(n*c*hw, dt, 1)
			y, dx := h.alloc(n*c*hw, dt), h.alloc(n*c*hw, dt)
			mean, rstd := h.alloc(c, engine.F32), h.alloc(c, engine.F32)
			dg, _ := h.random(c, dt, 1)
			db, _ := h.random(c, dt, 1)
			h.d.BatchNorm(y, mean, rstd, x, g, bt, n, c, hw, 1e-5, true)
			h.d.BatchNormBackward(dx, dg, db, dy, x, mean, rstd, g, n, c, hw, b)
			return []engine.Buf{y, mean, rstd, dx, dg, db}
		})
	}
}
