package enginetest

import (
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// TestMaxPool2 checks MaxPool2 and MaxPool2Grad: the values and indices of the maxima, the
// first in row-major order winning ties (and a NaN only in first place), odd sizes dropping the last row and column, and the
// gradient routed to the maxima with every other element zeroed.
func TestMaxPool2(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	levels := []float32{-1, 0, 0.5, 1, 2}
	for _, dt := range FloatTypes {
		for si, s := range [][3]int{{1, 2, 2}, {3, 4, 6}, {2, 5, 7}, {6, 9, 9}, {5, 3, 2}, {600, 8, 8}} {
			planes, hh, w := s[0], s[1], s[2]
			oh, ow := hh/2, w/2
			n, no := planes*hh*w, planes*oh*ow
			var vals []float32
			if si%2 == 0 {
				// Few distinct values: ties in most windows; and NaNs, which never win (v > best
				// is false for them) unless they come first, and then stay.
				vals = make([]float32, n)
				for i := range vals {
					vals[i] = levels[h.rng.IntN(len(levels))]
					if h.rng.IntN(10) == 0 {
						vals[i] = float32(math.NaN())
					}
				}
			} else {
				vals = h.normal(n, 1)
			}
			x := h.alloc(n, dt)
			X := h.put(x, vals)
			y := h.alloc(no, dt)
			h.d.Upload(y, nans(no))
			idx, _ := h.filled(no, engine.I32, -1)
			h.d.MaxPool2(y, idx, x, planes, hh, w)
			wantY, wantI := make([]float32, no), make([]float32, no)
			for p := range planes {
				for oy := range oh {
					for ox := range ow {
						at := p*hh*w + 2*oy*w + 2*ox
						best := at
						for _, d := range []int{1, w, w + 1} { // row-major order; strictly greater
							if X[at+d] > X[best] {
								best = at + d
							}
						}
						o := (p*oh+oy)*ow + ox
						wantY[o], wantI[o] = X[best], float32(best)
					}
				}
			}
			tag := fmt.Sprintf("%v maxpool2 %dx%dx%d", dt, planes, hh, w)
			h.exact(tag+": values", h.get(y), wantY)
			h.exact(tag+": indices", h.get(idx), wantI)

			dy, DY := h.random(no, dt, 1)
			dx := h.alloc(n, dt)
			h.d.Upload(dx, nans(n))
			h.d.MaxPool2Grad(dx, dy, idx)
			wantDX := make([]float32, n)
			for i, j := range wantI {
				wantDX[int(j)] = DY[i]
			}
			h.exact(tag+": gradient", h.get(dx), wantDX)
		}
		// Indices made by hand, the first and last elements among them.
		const n = 50
		ints := []int32{0, 49, 7, 8, 30, 31}
		idx := h.alloc(len(ints), engine.I32)
		h.d.UploadInt32(idx, ints)
		dy, DY := h.random(len(ints), dt, 1)
		dx := h.alloc(n, dt)
		h.d.Upload(dx, nans(n))
		h.d.MaxPool2Grad(dx, dy, idx)
		want := make([]float32, n)
		for i, j := range ints {
			want[j] = DY[i]
		}
		h.exact(dt.String()+" maxpool2_grad with given indices", h.get(dx), want)
	}
}
