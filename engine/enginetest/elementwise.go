package enginetest

import (
	"fmt"
	"math"
	"testing"
)

// matrixShapes are rows×cols shapes for the row and column operations: small, odd, and large
// enough in either direction for a backend to split the pass.
var matrixShapes = [][2]int{{1, 1}, {3, 7}, {64, 33}, {5, 20000}, {3000, 10}, {1, 40000}}

// TestAddBias checks AddBias per column and per row.
func TestAddBias(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range matrixShapes {
			for _, perRow := range []bool{false, true} {
				rows, cols := s[0], s[1]
				nb := cols
				if perRow {
					nb = rows
				}
				y, Y := h.random(rows*cols, dt, 2)
				bias, B := h.random(nb, dt, 1)
				h.d.AddBias(y, bias, rows, cols, perRow)
				want := make([]float64, len(Y))
				mag := make([]float64, len(Y))
				for i, v := range Y {
					var bv float32
					if perRow {
						bv = B[i/cols]
					} else {
						bv = B[i%cols]
					}
					want[i] = float64(v) + float64(bv)
					mag[i] = math.Abs(float64(v)) + math.Abs(float64(bv))
				}
				h.near(fmt.Sprintf("%v add_bias %dx%d perRow=%v", dt, rows, cols, perRow), dt, h.get(y), want, mag, 1)
			}
		}
	}
}

// TestSumRows checks SumRows both ways, with beta 0 (dst full of NaN, not read), 1 and 0.25.
func TestSumRows(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range matrixShapes {
			for _, perRow := range []bool{false, true} {
				for _, beta := range []float32{0, 1, 0.25} {
					rows, cols := s[0], s[1]
					nd, terms := cols, rows
					if perRow {
						nd, terms = rows, cols
					}
					src, S := h.random(rows*cols, dt, 1)
					dst := h.alloc(nd, dt)
					D := h.put(dst, h.cInit(beta)(nd))
					h.d.SumRows(dst, src, rows, cols, perRow, beta)
					want := make([]float64, nd)
					mag := make([]float64, nd)
					for i, v := range S {
						o := i % cols
						if perRow {
							o = i / cols
						}
						want[o] += float64(v)
						mag[o] += math.Abs(float64(v))
					}
					if beta != 0 {
						for i, v := range D {
							want[i] += float64(beta) * float64(v)
							mag[i] += math.Abs(float64(beta) * float64(v))
						}
					}
					h.near(fmt.Sprintf("%v sum_rows %dx%d perRow=%v beta=%v", dt, rows, cols, perRow, beta), dt, h.get(dst), want, mag, terms+1)
				}
			}
		}
	}
}

// signed returns n values, a third of them exact zeros, the rest N(0, 1) draws with negative
// zeros, infinities and NaNs among them.
func (h *harness) signed(n int) []float32 {
	x := h.normal(n, 1)
	for i := range x {
		switch h.rng.IntN(6) {
		case 0, 1:
			x[i] = 0
		case 2:
			switch h.rng.IntN(8) {
			case 0:
				x[i] = float32(math.Copysign(0, -1))
			case 1:
				x[i] = float32(math.NaN())
			case 2:
				x[i] = float32(math.Inf(1 - 2*h.rng.IntN(2)))
			}
		}
	}
	return x
}

// TestReLU checks ReLU into another buffer and in place. ReLU is Go's max(x, 0): a NaN
// stays NaN (as in PyTorch), so that a NaN activation reaches the loss instead of vanishing.
func TestReLU(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 1000, 40000} {
			x := h.alloc(n, dt)
			X := h.put(x, h.signed(n))
			want := make([]float32, n)
			for i, v := range X {
				want[i] = max(v, 0)
			}
			y := h.alloc(n, dt)
			h.d.Upload(y, nans(n))
			h.d.ReLU(y, x)
			h.exact(fmt.Sprintf("%v relu of %d", dt, n), h.get(y), want)
			h.exact(fmt.Sprintf("%v relu of %d: its input", dt, n), h.get(x), X)
			h.d.ReLU(x, x)
			h.exact(fmt.Sprintf("%v relu of %d in place", dt, n), h.get(x), want)
		}
	}
}

// TestReLUGrad checks ReLUGrad into another buffer and in place (dx = dy).
func TestReLUGrad(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 1000, 40000} {
			y := h.alloc(n, dt)
			Y := h.put(y, h.signed(n))
			dy := h.alloc(n, dt)
			DY := h.put(dy, h.signed(n))
			want := make([]float32, n)
			for i := range want {
				if Y[i] > 0 {
					want[i] = DY[i]
				}
			}
			dx := h.alloc(n, dt)
			h.d.Upload(dx, nans(n))
			h.d.ReLUGrad(dx, dy, y)
			h.exact(fmt.Sprintf("%v relu_grad of %d", dt, n), h.get(dx), want)
			h.d.ReLUGrad(dy, dy, y)
			h.exact(fmt.Sprintf("%v relu_grad of %d in place", dt, n), h.get(dy), want)
		}
	}
}

// TestTranspose01 checks Transpose01 against its definition.
func TestTranspose01(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][3]int{{1, 1, 1}, {3, 4, 5}, {7, 2, 1}, {1, 6, 3}, {16, 9, 33}} {
			a, b, r := s[0], s[1], s[2]
			src, S := h.random(a*b*r, dt, 1)
			dst := h.alloc(a*b*r, dt)
			h.d.Upload(dst, nans(a*b*r))
			h.d.Transpose01(dst, src, a, b, r)
			want := make([]float32, len(S))
			for i := range a {
				for j := range b {
					copy(want[(j*a+i)*r:(j*a+i+1)*r], S[(i*b+j)*r:(i*b+j+1)*r])
				}
			}
			h.exact(fmt.Sprintf("%v transpose01 %dx%dx%d", dt, a, b, r), h.get(dst), want)
		}
	}
}
