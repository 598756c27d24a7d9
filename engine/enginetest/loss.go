package enginetest

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// xent64 is SoftmaxXent's definition in float64: each row's loss and dlogits, and the
// magnitudes their fp32 computation's error scales with.
func xent64(z []float32, labels []int32, rows, classes int, scale float32) (loss, lossMag, d, dMag []float64) {
	loss, lossMag = make([]float64, rows), make([]float64, rows)
	d, dMag = make([]float64, len(z)), make([]float64, len(z))
	for r := range rows {
		zr := f64(z[r*classes : (r+1)*classes])
		m, top := math.Inf(-1), 0.0
		for _, v := range zr {
			m = max(m, v)
			top = max(top, math.Abs(v))
		}
		var sum float64
		for _, v := range zr {
			sum += math.Exp(v - m)
		}
		lse := m + math.Log(sum)
		y := int(labels[r])
		loss[r] = lse - zr[y]
		// exp(z−m) is off by |z−m| ulps, the sum by classes more, lse by both; z_y and lse
		// are rounded once each.
		mag := 1 + 2*math.Abs(m) + top + math.Abs(lse) + math.Abs(zr[y])
		lossMag[r] = mag
		for c, v := range zr {
			p := math.Exp(v - lse)
			oh := 0.0
			if c == y {
				oh = 1
			}
			d[r*classes+c] = (p - oh) * float64(scale)
			dMag[r*classes+c] = math.Abs(float64(scale)) * (p*mag + 1)
		}
	}
	return loss, lossMag, d, dMag
}

// TestSoftmaxXent checks SoftmaxXent's losses and dlogits (into another buffer and into the
// logits themselves), on rows with large and equal logits, and that a label out of range
// is an error that Sync and Download return.
func TestSoftmaxXent(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, s := range [][2]int{{1, 1}, {1, 2}, {4, 10}, {7, 3}, {3, 1000}} {
			rows, classes := s[0], s[1]
			for _, scale := range []float32{1, 1 / float32(rows), 1024} {
				vals := h.normal(rows*classes, 3)
				labels := make([]int32, rows)
				for r := range labels {
					labels[r] = int32(h.rng.IntN(classes))
				}
				if rows > 1 {
					for c := range classes {
						vals[c] += 80 // exp would overflow without the max subtracted
						vals[classes+c] = 1.25
					}
				}
				z := h.alloc(len(vals), dt)
				Z := h.put(z, vals)
				lab := h.alloc(rows, engine.I32)
				h.d.UploadInt32(lab, labels)
				d := h.alloc(len(vals), dt)
				h.d.Upload(d, nans(len(vals)))
				loss := h.alloc(rows, engine.F32)
				h.d.Upload(loss, nans(rows))
				h.d.SoftmaxXent(d, loss, z, lab, rows, classes, scale)
				wantL, magL, wantD, magD := xent64(Z, labels, rows, classes, scale)
				tag := fmt.Sprintf("%v softmax_xent %dx%d scale %v", dt, rows, classes, scale)
				h.near(tag+": loss", engine.F32, h.get(loss), wantL, magL, classes+4)
				h.near(tag+": dlogits", dt, h.get(d), wantD, magD, classes+4)
				h.exact(tag+": logits", h.get(z), Z)

				h.d.Upload(loss, nans(rows))
				h.d.SoftmaxXent(z, loss, z, lab, rows, classes, scale)
				h.near(tag+" in place: loss", engine.F32, h.get(loss), wantL, magL, classes+4)
				h.near(tag+" in place: dlogits", dt, h.get(z), wantD, magD, classes+4)
			}
		}
	}
	// Labels out of range.
	const rows, classes = 3, 5
	z, _ := h.random(rows*classes, engine.F32, 1)
	d := h.alloc(rows*classes, engine.F32)
	loss := h.alloc(rows, engine.F32)
	lab := h.alloc(rows, engine.I32)
	for _, bad := range []int32{classes, -1, 1 << 30} {
		h.d.UploadInt32(lab, []int32{0, bad, 1})
		h.sync("labels")
		h.d.SoftmaxXent(d, loss, z, lab, rows, classes, 1)
		if err := h.d.Sync(); !errors.Is(err, engine.ErrDevice) {
			t.Errorf("label %d of %d classes: Sync returned %v, want an error wrapping engine.ErrDevice", bad, classes, err)
		}
		h.d.SoftmaxXent(d, loss, z, lab, rows, classes, 1)
		if err := h.d.Download(make([]float32, rows), loss); !errors.Is(err, engine.ErrDevice) {
			t.Errorf("label %d of %d classes: Download returned %v, want an error wrapping engine.ErrDevice", bad, classes, err)
		}
		h.sync("after the error was returned")
	}
}
