//go:build amd64 && !purego

package vec

import (
	"golang.org/x/sys/cpu"

	"github.com/qvd/qvd/internal/half"
)

// useAVX2 selects the assembly kernels (vec_amd64.s). They need AVX2 for the float and
// integer lanes and F16C for the binary16 conversions; every x86 CPU with AVX2 (Haswell and
// Zen 1 on) has F16C too. cpu.X86.HasAVX2 also checks that the OS saves the YMM registers.
// The kernels use no FMA: see sumSquaresAVX2. Tests clear useAVX2 to run the Go loops on the
// same machine.
var useAVX2 = cpu.X86.HasAVX2 && cpu.X86.HasF16C

// The kernels process n elements, a multiple of lanes (possibly zero), from the given
// pointers; the wrappers below call them chunk by chunk and finish the remaining
// len % lanes elements in Go.

//go:noescape
func addAVX2(dst, src *float32, n int)

//go:noescape
func addScaleAVX2(dst, src *float32, n int, s float32)

//go:noescape
func scaleAVX2(x *float32, n int, s float32)

//go:noescape
func maxAVX2(dst, src *float32, n int)

//go:noescape
func sumSquaresAVX2(x *float32, n int, p *[lanes]float64)

//go:noescape
func encodeF16F16C(dst *uint16, src *float32, n int)

//go:noescape
func decodeF16F16C(dst *float32, src *uint16, n int)

//go:noescape
func addDecodedF16F16C(dst *float32, src *uint16, n int)

//go:noescape
func encodeBF16AVX2(dst *uint16, src *float32, n int)

//go:noescape
func addDecodedBF16AVX2(dst *float32, src *uint16, n int)

//go:noescape
func adamWAVX2(p, grad, m, v *float32, n int, c *AdamConsts)

//go:noescape
func adamL2AVX2(p, grad, m, v *float32, n int, c *AdamConsts)

func accelerated() string {
	if useAVX2 {
		return "avx2+f16c"
	}
	return "purego"
}

// vecLen is the number of leading elements of an n-element buffer that the next kernel call
// handles: a multiple of lanes, at most maxChunk, and zero when the kernels are not in use.
func vecLen(n int) int {
	if !useAVX2 {
		return 0
	}
	return min(n, maxChunk) &^ (lanes - 1)
}

// maxChunk bounds the elements one kernel call handles. Go cannot preempt a goroutine inside
// assembly, so one call over a 100M-element buffer would hold off every stop-the-world (and
// with it all goroutines) for tens of milliseconds; the loops below are preemption points
// between chunks. A chunk takes 5 to 50 µs, against about 5 ns for the extra call.
const maxChunk = 1 << 16

func add(dst, src []float32) {
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		addAVX2(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	addGeneric(dst, src)
}

func addScale(dst, src []float32, s float32) {
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		addScaleAVX2(&dst[0], &src[0], n, s)
		dst, src = dst[n:], src[n:]
	}
	addScaleGeneric(dst, src, s)
}

func scale(x []float32, s float32) {
	for n := vecLen(len(x)); n > 0; n = vecLen(len(x)) {
		scaleAVX2(&x[0], n, s)
		x = x[n:]
	}
	scaleGeneric(x, s)
}

func maxInto(dst, src []float32) {
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		maxAVX2(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	maxGeneric(dst, src)
}

func sumSquares(x []float32, p *[lanes]float64) {
	// Every chunk is a multiple of lanes long, so element i of what is left still belongs to
	// lane i%lanes, as the definition requires.
	for n := vecLen(len(x)); n > 0; n = vecLen(len(x)) {
		sumSquaresAVX2(&x[0], n, p)
		x = x[n:]
	}
	sumSquaresGeneric(x, p)
}

// The binary16 tails use internal/half's scalar functions rather than its buffer loops:
// DecodeF16's loop builds a 256 KiB table on first use, which a few tail words do not justify.

func encodeF16(dst []uint16, src []float32) {
	if !useAVX2 {
		encodeF16Generic(dst, src)
		return
	}
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		encodeF16F16C(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	src = src[:len(dst)]
	for i, v := range src {
		dst[i] = half.F32ToF16(v)
	}
}

func decodeF16(dst []float32, src []uint16) {
	if !useAVX2 {
		decodeF16Generic(dst, src)
		return
	}
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		decodeF16F16C(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	src = src[:len(dst)]
	for i, h := range src {
		dst[i] = half.F16ToF32(h)
	}
}

func addDecodedF16(dst []float32, src []uint16) {
	if !useAVX2 {
		addDecodedF16Generic(dst, src)
		return
	}
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		addDecodedF16F16C(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	src = src[:len(dst)]
	for i, h := range src {
		dst[i] += half.F16ToF32(h)
	}
}

func encodeBF16(dst []uint16, src []float32) {
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		encodeBF16AVX2(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	encodeBF16Generic(dst, src)
}

func addDecodedBF16(dst []float32, src []uint16) {
	for n := vecLen(len(dst)); n > 0; n = vecLen(len(dst)) {
		addDecodedBF16AVX2(&dst[0], &src[0], n)
		dst, src = dst[n:], src[n:]
	}
	addDecodedBF16Generic(dst, src)
}

func adamW(p, g, m, v []float32, c *AdamConsts) {
	for n := vecLen(len(p)); n > 0; n = vecLen(len(p)) {
		adamWAVX2(&p[0], &g[0], &m[0], &v[0], n, c)
		p, g, m, v = p[n:], g[n:], m[n:], v[n:]
	}
	adamWGeneric(p, g, m, v, c)
}

func adamL2(p, g, m, v []float32, c *AdamConsts) {
	for n := vecLen(len(p)); n > 0; n = vecLen(len(p)) {
		adamL2AVX2(&p[0], &g[0], &m[0], &v[0], n, c)
		p, g, m, v = p[n:], g[n:], m[n:], v[n:]
	}
	adamL2Generic(p, g, m, v, c)
}
