package vec

import (
	"math"

	"github.com/qvd/qvd/internal/half"
)

// The plain Go kernels. They are the whole implementation under the purego tag and off amd64,
// they finish the tails (len % 8 elements) that the vector kernels leave, and they are the
// baseline the benchmarks compare against. Each must produce the bits its vector counterpart
// produces (see doc.go for the one NaN case left to the hardware); the tests check both
// against an element-by-element reference.
//
// Each takes slices of equal length, checked by its caller; re-slicing src to len(dst) lets
// the compiler drop the bounds checks in the loop bodies.

func addGeneric(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] += src[i]
	}
}

func addScaleGeneric(dst, src []float32, s float32) {
	src = src[:len(dst)]
	for i := range dst {
		// The parenthesised sum is rounded to float32 before the multiply; Go may only fuse
		// x*y + z, so no implementation turns this into one rounding.
		dst[i] = (dst[i] + src[i]) * s
	}
}

func scaleGeneric(x []float32, s float32) {
	for i := range x {
		x[i] *= s
	}
}

func maxGeneric(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] = max32(dst[i], src[i])
	}
}

// max32 is Go's max(x, y) with the NaN result pinned down: when the two are equal or either is
// a NaN, the result has the OR of their bits with the sign bit of their AND. That makes
// max(+0, -0) = +0 and any NaN input give a NaN, as the builtin does, and it is exactly the
// word that the builtin's amd64 lowering (max(x, y) = -min(-x, -y) with two MINSS and a POR)
// produces. The builtin itself leaves the NaN's bits to the hardware (arm64's FMAX returns a
// different one), so spelling the rule out keeps every build bit-identical.
func max32(x, y float32) float32 {
	if x > y {
		return x
	}
	if y > x {
		return y
	}
	bx, by := math.Float32bits(x), math.Float32bits(y)
	return math.Float32frombits((bx|by)&^signMask | bx&by&signMask)
}

const signMask = 0x80000000 // float32 sign bit

// sumSquaresGeneric adds the squares of x into the lane sums p as SumSquares defines them:
// element i goes to p[i%lanes], in index order within each lane.
func sumSquaresGeneric(x []float32, p *[lanes]float64) {
	p0, p1, p2, p3, p4, p5, p6, p7 := p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]
	n := len(x) &^ (lanes - 1)
	for i := 0; i < n; i += lanes {
		// The product of two float32 values is exact in float64 (24+24 < 53 significant
		// bits), so a fused multiply-add rounds the same as a multiply and an add: the Go
		// compiler may fuse these (it does on arm64) without changing the result.
		b := x[i : i+lanes : i+lanes]
		p0 += float64(b[0]) * float64(b[0])
		p1 += float64(b[1]) * float64(b[1])
		p2 += float64(b[2]) * float64(b[2])
		p3 += float64(b[3]) * float64(b[3])
		p4 += float64(b[4]) * float64(b[4])
		p5 += float64(b[5]) * float64(b[5])
		p6 += float64(b[6]) * float64(b[6])
		p7 += float64(b[7]) * float64(b[7])
	}
	*p = [lanes]float64{p0, p1, p2, p3, p4, p5, p6, p7}
	for i, v := range x[n:] {
		p[i] += float64(v) * float64(v)
	}
}

// combineLanes adds the lane sums in SumSquares's fixed tree.
func combineLanes(p *[lanes]float64) float64 {
	s := ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
	if s != s {
		// The lanes' NaN bits depend on which NaN an add propagates, which differs between
		// CPUs; one canonical NaN keeps the result identical everywhere.
		return math.NaN()
	}
	return s
}

// The conversions are internal/half's buffer loops, which are the reference by definition.

func encodeF16Generic(dst []uint16, src []float32)      { half.EncodeF16(dst, src) }
func decodeF16Generic(dst []float32, src []uint16)      { half.DecodeF16(dst, src) }
func addDecodedF16Generic(dst []float32, src []uint16)  { half.AddDecodedF16(dst, src) }
func encodeBF16Generic(dst []uint16, src []float32)     { half.EncodeBF16(dst, src) }
func addDecodedBF16Generic(dst []float32, src []uint16) { half.AddDecodedBF16(dst, src) }
