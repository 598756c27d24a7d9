package vec

import "fmt"

// lanes is the number of partial sums in SumSquares's definition (see doc.go), and also the
// block size of the vector kernels: they process len &^ (lanes-1) elements and leave the rest
// to the Go loops.
const lanes = 8

// Add sets dst[i] += src[i]. It panics if the lengths differ.
func Add(dst, src []float32) {
	mustSameLen(len(dst), len(src))
	add(dst, src)
}

// AddScale sets dst[i] = (dst[i] + src[i]) * s, rounding the sum to float32 before the
// multiply (two roundings, no fused operation): the averaging step of an all-reduce, with
// s = 1/ranks, folded into the last addition. It panics if the lengths differ.
func AddScale(dst, src []float32, s float32) {
	mustSameLen(len(dst), len(src))
	addScale(dst, src, s)
}

// Scale sets x[i] *= s.
func Scale(x []float32, s float32) {
	scale(x, s)
}

// Max sets dst[i] = max(dst[i], src[i]) with the builtin's semantics: a NaN in either wins and
// +0 is larger than -0. A NaN result has the same bits on every CPU (see the package
// documentation). It panics if the lengths differ.
func Max(dst, src []float32) {
	mustSameLen(len(dst), len(src))
	maxInto(dst, src)
}

// SumSquares returns the sum of x[i]², computed in float64 in the fixed order that doc.go
// defines, so that it returns the same bits on every CPU and build. If any x[i] is a NaN the
// result is math.NaN(); else if any is ±Inf it is +Inf.
func SumSquares(x []float32) float64 {
	var p [lanes]float64
	sumSquares(x, &p)
	return combineLanes(&p)
}

// EncodeF16 sets dst[i] to the IEEE binary16 encoding of src[i], bit-identical to
// half.F32ToF16. It panics if the lengths differ.
func EncodeF16(dst []uint16, src []float32) {
	mustSameLen(len(dst), len(src))
	encodeF16(dst, src)
}

// DecodeF16 sets dst[i] to the float32 value of the binary16 word src[i], bit-identical to
// half.F16ToF32. It panics if the lengths differ.
func DecodeF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	decodeF16(dst, src)
}

// AddDecodedF16 sets dst[i] += half.F16ToF32(src[i]): a reduction adding binary16 words
// received from a peer into its float32 sum. It panics if the lengths differ.
func AddDecodedF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	addDecodedF16(dst, src)
}

// EncodeBF16 sets dst[i] to the bfloat16 encoding of src[i], bit-identical to
// half.F32ToBF16. It panics if the lengths differ.
func EncodeBF16(dst []uint16, src []float32) {
	mustSameLen(len(dst), len(src))
	encodeBF16(dst, src)
}

// AddDecodedBF16 sets dst[i] += half.BF16ToF32(src[i]). It panics if the lengths differ.
func AddDecodedBF16(dst []float32, src []uint16) {
	mustSameLen(len(dst), len(src))
	addDecodedBF16(dst, src)
}

// Accelerated names the instruction sets the kernels use on this machine, "purego" when
// they are the plain Go loops. It is meant for logs and benchmark reports.
func Accelerated() string {
	return accelerated()
}

// mustSameLen panics on a length mismatch: callers size both buffers from one layout, so a
// mismatch is a bug in the caller, not bad input. It is small enough to inline.
func mustSameLen(dst, src int) {
	if dst != src {
		lengthPanic(dst, src)
	}
}

//go:noinline
func lengthPanic(dst, src int) {
	panic(fmt.Sprintf("vec: length mismatch: dst has %d elements, src has %d", dst, src))
}
