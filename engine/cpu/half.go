package cpu

import (
	"math"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/vec"
)

// Half precision on the CPU: buffers of type F16 and BF16 hold 2-byte words (half the memory
// of fp32 activations, parameters and gradients), and every operation computes in fp32 and
// rounds once when it stores, as the CUDA backend does. An operation on half buffers decodes
// its inputs into fp32 scratch, runs the fp32 kernel, and encodes its output (the conversions
// are the AVX2/F16C kernels of internal/vec, bit-identical to internal/half).

// halfScratch is grow-only fp32 scratch for the conversions, one slot per operand.
type halfScratch struct {
	slots [6]struct {
		blk *arena.Block
		f   []float32
	}
}

// get returns slot i with at least n elements.
func (h *halfScratch) get(i, n int) ([]float32, error) {
	s := &h.slots[i]
	if len(s.f) < n || s.f == nil { // never nil, even for n 0: callers take nil for a failure
		s.blk.Free()
		s.blk, s.f = nil, nil
		blk, f, err := arena.Float32s(max(n, 1024), arena.Activations)
		if err != nil {
			return nil, err
		}
		s.blk, s.f = blk, f
	}
	return s.f[:n], nil
}

func (h *halfScratch) free() {
	for i := range h.slots {
		h.slots[i].blk.Free()
		h.slots[i].blk, h.slots[i].f = nil, nil
	}
}

// scratch returns slot i of n elements (nil, with the error latched, on failure).
func (d *Device) scratch(i, n int) []float32 {
	f, err := d.halves.get(i, n)
	if err != nil {
		d.fail("conversion scratch: %v", err)
		return nil
	}
	return f
}

// floats returns b's values as fp32: its own memory for F32, decoded into scratch slot i
// for F16/BF16 (nil, with the error latched, for a bad buffer).
func (d *Device) floats(b engine.Buf, slot int) []float32 {
	switch b.T {
	case engine.F32:
		return d.f32(b)
	case engine.F16, engine.BF16:
		src := d.u16(b)
		if src == nil && b.N > 0 {
			return nil
		}
		dst := d.scratch(slot, b.N)
		if dst == nil {
			return nil
		}
		decode(dst, src, b.T)
		return dst
	}
	d.fail("%v buffer where a floating-point one is needed", b.T)
	return nil
}

// target returns where an operation writes b's new values: b's own memory for F32, scratch
// slot i for F16/BF16, which commit then encodes into b. With load, the scratch starts with
// b's current values (an operation that reads its output: beta ≠ 0).
func (d *Device) target(b engine.Buf, slot int, load bool) []float32 {
	if b.T == engine.F32 {
		return d.f32(b)
	}
	if load {
		return d.floats(b, slot)
	}
	if !b.T.Float() {
		d.fail("%v buffer where a floating-point one is needed", b.T)
		return nil
	}
	return d.scratch(slot, b.N)
}

// commit stores v, computed by target's caller, into b rounded to b's type.
func (d *Device) commit(b engine.Buf, v []float32) {
	if b.T == engine.F32 || v == nil {
		return
	}
	if dst := d.u16(b); dst != nil {
		encode(dst, v, b.T)
	}
}

func decode(dst []float32, src []uint16, t engine.DType) {
	if t == engine.F16 {
		vec.DecodeF16(dst, src)
		return
	}
	for i, w := range src {
		dst[i] = math.Float32frombits(uint32(w) << 16)
	}
}

func encode(dst []uint16, src []float32, t engine.DType) {
	if t == engine.F16 {
		vec.EncodeF16(dst, src)
		return
	}
	vec.EncodeBF16(dst, src)
}

// roundTo rounds x in place to t's precision (nothing for F32).
func roundTo(x []float32, t engine.DType) {
	if t != engine.F32 {
		vec.Round(x, t.Format())
	}
}

func accelerated() string { return "kernels " + vec.Accelerated() }
