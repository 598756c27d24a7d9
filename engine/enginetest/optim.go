package enginetest

import (
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/vec"
)

// adamConsts are the constants of AdamW step t (PyTorch's defaults, lr 1e-3, weight decay
// 0.01) with gradients scaled by scale.
func adamConsts(t int, scale float32) vec.AdamConsts {
	const lr, b1, b2, wd = 1e-3, 0.9, 0.999, 0.01
	return vec.AdamConsts{
		B1: b1, C1: 1 - b1, B2: b2, C2: 1 - b2, Eps: 1e-8, Scale: scale,
		NegStep: float32(-lr / (1 - math.Pow(b1, float64(t)))),
		BC2Sqrt: float32(math.Sqrt(1 - math.Pow(b2, float64(t)))),
		Decay:   float32(1 - lr*wd),
	}
}

// TestAdamW checks that AdamW leaves the same bits in p, m and v as vec.AdamW (the CPU
// optimizer) over several steps, for gradients of every type, and stores p rounded to the
// working type into w when w is Valid.
func TestAdamW(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, gt := range FloatTypes {
		for _, n := range []int{1, 1000, 40000} {
			for _, wt := range append([]engine.DType{0}, FloatTypes...) {
				p, P := h.random(n, engine.F32, 1)
				m, M := h.filled(n, engine.F32, 0)
				v, V := h.filled(n, engine.F32, 0)
				g := h.alloc(n, gt)
				var w engine.Buf
				if wt != 0 {
					w = h.alloc(n, wt)
					h.d.Upload(w, nans(n))
				}
				for step := 1; step <= 3; step++ {
					G := h.put(g, h.normal(n, 512))
					if step == 2 {
						h.d.Fill(g, 0)
						G = h.get(g)
					}
					c := adamConsts(step, 1.0/512)
					h.d.AdamW(p, m, v, g, w, c)
					vec.AdamW(P, G, M, V, &c)
					tag := fmt.Sprintf("adamw of %d, %v gradients, step %d", n, gt, step)
					h.exact(tag+": p", h.get(p), P)
					h.exact(tag+": m", h.get(m), M)
					h.exact(tag+": v", h.get(v), V)
					if wt != 0 {
						want := make([]float32, n)
						for i, x := range P {
							want[i] = roundTo(wt, x)
						}
						h.exact(tag+": "+wt.String()+" working weights", h.get(w), want)
					}
				}
			}
		}
	}
}

// TestUnscaleCheck checks that UnscaleCheck multiplies by s and sets found when any element
// was Inf or NaN, wherever it lies in a buffer large enough to be split, and never clears it.
func TestUnscaleCheck(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 100, 3<<14 + 5} {
			for _, c := range []struct {
				name  string
				at    []int // positions of bad, relative to n when negative
				bad   float32
				found float32 // found before the call
			}{
				{"finite", nil, 0, 0},
				{"finite, found already set", nil, 0, 1},
				{"+Inf first", []int{0}, inf, 0},
				{"-Inf last", []int{-1}, -inf, 0},
				{"NaN in the middle", []int{n / 2}, nan, 0},
				{"NaN and Inf at the end of the first piece", []int{n / 3, 1<<14 - 1}, nan, 0},
				{"Inf with found set", []int{-1}, inf, 1},
			} {
				vals := h.normal(n, 100)
				for _, i := range c.at {
					if i < 0 {
						i += n
					}
					if i < n {
						vals[i] = c.bad
					}
				}
				g := h.alloc(n, dt)
				G := h.put(g, vals)
				found, _ := h.filled(1, engine.F32, c.found)
				const s = 1.0 / 1024
				h.d.UnscaleCheck(g, found, s)
				wantFound := c.found
				want := make([]float64, n)
				for i, v := range G {
					if math.IsInf(float64(v), 0) || math.IsNaN(float64(v)) {
						wantFound = 1
					}
					want[i] = float64(v) * s
				}
				tag := fmt.Sprintf("%v unscale_check of %d, %s", dt, n, c.name)
				if got := h.get(found)[0]; got != wantFound {
					t.Errorf("%s: found = %v, want %v", tag, got, wantFound)
				}
				got := h.get(g)
				for i, v := range want { // Inf·s and NaN·s are themselves: compare them exactly
					if math.IsInf(v, 0) || math.IsNaN(v) {
						if !same(got[i], float32(v)) {
							t.Errorf("%s: element %d is %v, want %v", tag, i, got[i], v)
						}
						got[i], want[i] = 0, 0
					}
				}
				h.near(tag, dt, got, want, nil, 1)
			}
		}
	}
}

// TestSumSquares checks that SumSquares adds Σ g² into its accumulator, for every gradient
// type: random values, a large buffer of ones (whose sum is exact: no element may be lost),
// and an Inf, which makes the accumulator non-finite.
func TestSumSquares(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, 7, 1000, 100003} {
			g, G := h.random(n, dt, 3)
			acc, _ := h.filled(1, engine.F32, 2.5)
			h.d.SumSquares(acc, g)
			want, mag := 2.5, 2.5
			for _, v := range G {
				want += float64(v) * float64(v)
				mag += float64(v) * float64(v)
			}
			h.near(fmt.Sprintf("%v sum_squares of %d", dt, n), engine.F32, h.get(acc), []float64{want}, []float64{mag}, n+1)

			h.d.Fill(g, 1)
			h.d.Fill(acc, 0.5)
			h.d.SumSquares(acc, g)
			h.d.SumSquares(acc, g.Slice(0, n/2))
			if got, want := h.get(acc)[0], float32(n+n/2)+0.5; got != want {
				t.Errorf("%v sum_squares of %d ones and %d more: %v, want %v", dt, n, n/2, got, want)
			}

			h.d.Upload(g.Slice(n-1, n), []float32{float32(math.Inf(-1))})
			h.d.SumSquares(acc, g)
			if got := h.get(acc)[0]; !math.IsInf(float64(got), 1) && !math.IsNaN(float64(got)) {
				t.Errorf("%v sum_squares of %d with an Inf: %v, want +Inf or NaN", dt, n, got)
			}
		}
	}
}
