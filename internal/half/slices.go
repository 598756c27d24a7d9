package half

import (
	"fmt"
	"math"
	"sync"
)

// The buffer functions re-slice src to len(dst) after the length check so the compiler can
// prove every index in range and drop the bounds checks from the loop bodies.

// EncodeF16 writes the binary16 encoding of src[i] into dst[i]. It panics if the lengths
// differ.
func EncodeF16(dst []uint16, src []float32) {
	mustSameLen(len(dst), len(src))
	src = src[:len(dst)]
	for i, v := range src {
		// F32ToF16 is too big to inline; its common case is spelled out here instead.
		b := math.Float32bits(v)
		if f16IsNormal(b) {
			dst[i] = f16Normal(b)
		} else {
			dst[i] = f32ToF16Rare(b)
		}
	}
}

// DecodeF16 writes the float32 value of the binary16 word src[i] into dst[i]. It panics if the
// lengths differ.
func DecodeF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	src = src[:len(dst)]
	t := f16Table()
	for i, h := range src {
		dst[i] = math.Float32frombits(t[h])
	}
}

// EncodeBF16 writes the bfloat16 encoding of src[i] into dst[i]. It panics if the lengths
// differ.
func EncodeBF16(dst []uint16, src []float32) {
	mustSameLen(len(dst), len(src))
	src = src[:len(dst)]
	for i, v := range src {
		dst[i] = F32ToBF16(v)
	}
}

// DecodeBF16 writes the float32 value of the bfloat16 word src[i] into dst[i]. It panics if
// the lengths differ.
func DecodeBF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	src = src[:len(dst)]
	for i, h := range src {
		dst[i] = BF16ToF32(h)
	}
}

// AddDecodedF16 adds the float32 value of the binary16 word src[i] to dst[i]. Reductions use
// it to keep their running sum in fp32 while the wire carries 16-bit words, so rounding error
// does not grow with the number of ranks. It panics if the lengths differ.
func AddDecodedF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	src = src[:len(dst)]
	t := f16Table()
	for i, h := range src {
		dst[i] += math.Float32frombits(t[h])
	}
}

// AddDecodedBF16 adds the float32 value of the bfloat16 word src[i] to dst[i]; see
// AddDecodedF16. It panics if the lengths differ.
func AddDecodedBF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	src = src[:len(dst)]
	for i, h := range src {
		dst[i] += BF16ToF32(h)
	}
}

// f16Table maps every binary16 word to its float32 bits. One load per element decodes about
// twice as fast as the bit arithmetic of F16ToF32 (measured on 16M-element buffers), and the
// 256 KiB table stays in L2: gradients occupy few exponents, so few of its lines are hot. It
// is built on first use so that programs that never decode fp16 do not pay for it.
var f16Table = sync.OnceValue(func() *[1 << 16]uint32 {
	t := new([1 << 16]uint32)
	for i := range t {
		t[i] = math.Float32bits(F16ToF32(uint16(i)))
	}
	return t
})

// mustSameLen panics on a length mismatch: callers size both buffers from the same layout, so
// a mismatch is a bug in the caller, not bad input. The check is kept small so it inlines.
func mustSameLen(dst, src int) {
	if dst != src {
		lengthPanic(dst, src)
	}
}

//go:noinline
func lengthPanic(dst, src int) {
	panic(fmt.Sprintf("half: length mismatch: dst has %d elements, src has %d", dst, src))
}
