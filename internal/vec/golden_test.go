package vec

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// goldenInput is built from integer operations only (no math functions whose last bit might
// differ between architectures), so every build sees the same words: finite values with
// exponents over a wide range, so that the summation order shows in the result's low bits.
func goldenInput(n int) []float32 {
	rng := rand.New(rand.NewPCG(2024, 7))
	x := make([]float32, n)
	for i := range x {
		r := rng.Uint32()
		exp := 127 - 12 + r>>24%24 // 2^-12 .. 2^11
		x[i] = math.Float32frombits(r&signMask | exp<<23 | r&0x7fffff)
	}
	return x
}

// TestSumSquaresGolden pins SumSquares's definition across CPUs and versions: the constants
// were computed once (on amd64) and every build, vector or Go, amd64 or arm64, must return
// exactly these bits. A change here means ranks on different builds would disagree on a
// gradient norm.
func TestSumSquaresGolden(t *testing.T) {
	for _, c := range []struct {
		n    int
		want uint64
	}{
		{7, 0x40a5679d5fd02ef2},
		{8, 0x40dfdec8dfb3f41e},
		{1000, 0x41c01dc1840deb3a},
		{100003, 0x4227b8f1fa8afc32},
	} {
		x := goldenInput(c.n)
		t.Run(fmt.Sprintf("n=%d", c.n), func(t *testing.T) {
			forEachImpl(t, func(t *testing.T) {
				if got := math.Float64bits(SumSquares(x)); got != c.want {
					t.Errorf("SumSquares(goldenInput(%d)) = %#016x, want %#016x", c.n, got, c.want)
				}
			})
		})
		// A plain left-to-right sum rounds differently on the longer inputs, so these
		// constants do pin the order, not just the value.
		if c.n >= 1000 {
			var seq float64
			for _, v := range x {
				seq += float64(v) * float64(v)
			}
			if math.Float64bits(seq) == c.want {
				t.Errorf("n=%d: the sequential sum has the same bits; the input does not test the order", c.n)
			}
		}
	}
}

// TestMaxGolden pins Max's result bits where the builtin leaves them to the CPU: equal
// operands and NaNs give the OR of the two words, with the sign bit of their AND.
func TestMaxGolden(t *testing.T) {
	cases := [][3]uint32{ // dst, src, want
		{0x7f800001, 0x00000006, 0x7f800007}, // NaN in dst keeps its payload bits, ORed
		{0x00000006, 0x7f800001, 0x7f800007}, // the same with the NaN in src
		{0xffc00000, 0x80000001, 0xffc00001}, // both negative: the sign stays
		{0xffc00000, 0x00000001, 0x7fc00001}, // one positive: the sign goes
		{0x7fc00000, 0xff812345, 0x7fc12345}, // two NaNs
		{0x80000000, 0x00000000, 0x00000000}, // max(-0, +0) = +0
		{0x80000000, 0x80000000, 0x80000000},
		{0xff800000, 0x80000000, 0x80000000}, // -Inf < -0
		{0x3f800000, 0x3f800001, 0x3f800001},
	}
	forEachImpl(t, func(t *testing.T) {
		// Repeat the cases so that they run through the vector kernel and the tail.
		var dst, src []float32
		for range 3 {
			for _, c := range cases {
				dst = append(dst, math.Float32frombits(c[0]))
				src = append(src, math.Float32frombits(c[1]))
			}
		}
		Max(dst, src)
		for i, v := range dst {
			c := cases[i%len(cases)]
			if math.Float32bits(v) != c[2] {
				t.Errorf("Max(%#08x, %#08x) = %#08x, want %#08x", c[0], c[1], math.Float32bits(v), c[2])
			}
		}
	})
}
