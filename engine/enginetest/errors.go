package enginetest

import (
	"errors"
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/vec"
)

// TestErrors checks the error latching of the Device contract, for each kind of failure an
// operation can meet: the operation latches an error wrapping engine.ErrDevice, the
// operations after it are skipped, the next Sync (or Download) returns the error and clears
// it, and the device then works again.
func TestErrors(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	good, _ := h.filled(64, engine.F32, 1) // untouched by the failing operations
	work, _ := h.random(64, engine.F32, 1)
	half := h.alloc(64, engine.F16)
	ints := h.alloc(8, engine.I32)
	one := h.alloc(1, engine.F32)
	s := engine.ConvShape{N: 1, C: 1, H: 4, W: 4, Out: 1, K: 3, Pad: 0}
	ws := h.workspace(s, engine.F32)
	// Released last: a later Malloc may return the same memory.
	released, err := h.d.Malloc(64, engine.F32)
	if err != nil {
		t.Fatal(err)
	}
	h.d.Release(released)
	foreign := engine.Buf{Ptr: 0x7ead_0000_0000, N: 64, T: engine.F32}
	whole := h.allocs[0].whole
	past := engine.Buf{Ptr: whole.Ptr, Off: whole.N - 4, N: 5, T: engine.F32} // one element past the allocation
	for _, c := range []struct {
		name string
		op   func()
	}{
		{"fill of the zero Buf", func() { h.d.Fill(engine.Buf{}, 1) }},
		{"fill of a released buffer", func() { h.d.Fill(released, 1) }},
		{"fill of a buffer the device never allocated", func() { h.d.Fill(foreign, 1) }},
		{"fill of a view past its allocation's end", func() { h.d.Fill(past, 1) }},
		{"copy from a released buffer", func() { h.d.Copy(work, released) }},
		{"relu of a foreign buffer", func() { h.d.ReLU(work, foreign) }},
		{"upload of the wrong length", func() { h.d.Upload(work, make([]float32, 63)) }},
		{"upload of floats into an i32 buffer", func() { h.d.Upload(ints, make([]float32, 8)) }},
		{"copy of different lengths", func() { h.d.Copy(work.Slice(0, 10), half.Slice(0, 11)) }},
		{"gemm with buffers too small", func() { h.d.Gemm(false, false, 8, 8, 2, 1, work.Slice(0, 16), work.Slice(0, 15), 0, half) }},
		{"gemm_ld with a leading dimension below the row length", func() {
			h.d.GemmLD(false, false, 4, 4, 4, 1, work.Slice(0, 16), 3, work.Slice(16, 32), 4, 0, half.Slice(0, 16), 4)
		}},
		{"gemm_ld with a view shorter than its strided extent", func() {
			h.d.GemmLD(false, false, 4, 4, 4, 1, work.Slice(0, 16), 4, work.Slice(16, 32), 4, 0, half.Slice(0, 20), 6)
		}},
		{"add_bias with the wrong bias length", func() { h.d.AddBias(work, work.Slice(0, 7), 8, 8, false) }},
		{"sum_rows into the wrong length", func() { h.d.SumRows(work.Slice(0, 7), work, 8, 8, true, 0) }},
		{"transpose01 of the wrong size", func() { h.d.Transpose01(half, work, 4, 4, 5) }},
		{"maxpool2_grad with an index out of range", func() {
			h.d.UploadInt32(ints, []int32{0, 1, 2, 64, 3, 4, 5, 6})
			h.d.MaxPool2Grad(work, work.Slice(0, 8), ints)
		}},
		{"softmax_xent with an f16 loss", func() {
			h.d.UploadInt32(ints, make([]int32, 8))
			h.d.SoftmaxXent(half, half.Slice(0, 8), work, ints, 8, 8, 1)
		}},
		{"conv2d of an invalid shape", func() {
			bad := engine.ConvShape{N: 1, C: 1, H: 2, W: 2, Out: 1, K: 5, Pad: 0}
			h.d.Conv2D(work.Slice(0, 1), work.Slice(0, 4), work.Slice(0, 25), one, ws, bad)
		}},
		{"conv2d with the wrong input size", func() {
			h.d.Conv2D(work.Slice(0, 4), work.Slice(0, 15), work.Slice(16, 25), one, ws, s)
		}},
		{"adamw of f16 master weights", func() {
			h.d.AdamW(half.Slice(0, 8), work.Slice(0, 8), work.Slice(8, 16), work.Slice(16, 24), engine.Buf{}, adamConsts(1, 1))
		}},
		{"sum_squares into two elements", func() { h.d.SumSquares(work.Slice(0, 2), work) }},
	} {
		h.d.Fill(good, 1)
		h.sync("before " + c.name)
		c.op()
		h.d.Fill(good, 2) // must be skipped
		h.d.AdamW(good.Slice(0, 8), good.Slice(8, 16), good.Slice(16, 24), good.Slice(24, 32), engine.Buf{}, vec.AdamConsts{})
		if err := h.d.Sync(); !errors.Is(err, engine.ErrDevice) {
			t.Errorf("%s: Sync returned %v, want an error wrapping engine.ErrDevice", c.name, err)
			continue
		}
		if err := h.d.Sync(); err != nil {
			t.Errorf("%s: the second Sync returned %v, want nil", c.name, err)
		}
		for i, v := range h.get(good) {
			if v != 1 {
				t.Errorf("%s: the operations after the error ran (element %d is %v)", c.name, i, v)
				break
			}
		}
		h.d.Fill(good, 3)
		if v := h.get(good)[0]; v != 3 {
			t.Errorf("%s: after Sync, fill did not run (%v)", c.name, v)
		}
	}
	// Download returns the pending error and clears it, and reports its own.
	h.d.Fill(foreign, 1)
	if err := h.d.Download(make([]float32, 64), good); !errors.Is(err, engine.ErrDevice) {
		t.Errorf("download after a failed operation returned %v", err)
	}
	h.sync("after download returned the error")
	if err := h.d.Download(make([]float32, 3), good); !errors.Is(err, engine.ErrDevice) {
		t.Errorf("download of 64 elements into 3 returned %v", err)
	}
	h.sync("after download returned its error")
	h.d.Fill(good, 1)
}
