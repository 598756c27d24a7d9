package half

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/x448/float16"
)

// refF16 is the reference binary16 encoder: github.com/x448/float16, verified by its authors
// over all 2^32 inputs.
func refF16(f float32) uint16 { return float16.Fromfloat32(f).Bits() }

func isNaN16(h uint16) bool { return h&0x7c00 == 0x7c00 && h&0x03ff != 0 }

func TestF16ToF32AllValues(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		got := math.Float32bits(F16ToF32(h))
		want := math.Float32bits(float16.Frombits(h).Float32())
		if got != want {
			t.Fatalf("F16ToF32(%#04x) = %#08x, want %#08x", h, got, want)
		}
	}
}

func TestF16ToF32NaNIsQuiet(t *testing.T) {
	for _, h := range []uint16{0x7c01, 0x7dff, 0x7e00, 0xfc01, 0xffff} {
		b := math.Float32bits(F16ToF32(h))
		if b&0x7f800000 != 0x7f800000 || b&quiet32 == 0 {
			t.Errorf("F16ToF32(%#04x) = %#08x, want a quiet NaN", h, b)
		}
		if b>>31 != uint32(h>>15) {
			t.Errorf("F16ToF32(%#04x) = %#08x: sign lost", h, b)
		}
	}
}

// f16EdgeBits are float32 inputs at the places binary16 conversion gets wrong most easily.
var f16EdgeBits = []uint32{
	0x00000000, 0x80000000, // ±0
	0x00000001, 0x007fffff, 0x00800000, // float32 subnormals and min normal: all round to 0
	0x33000000,             // 2^-25: tie between 0 and the smallest subnormal, goes to 0 (even)
	0x33000001,             // just above 2^-25: smallest subnormal
	0x32ffffff,             // just below 2^-25: 0
	0x33800000,             // 2^-24: smallest subnormal, exact
	0x33c00000,             // 1.5 * 2^-24: tie between subnormals 1 and 2, goes to 2 (even)
	0x34200000,             // 2.5 * 2^-24: tie between 2 and 3, goes to 2 (even)
	0x387fc000,             // largest subnormal 1023 * 2^-24, exact
	0x387fe000,             // 1023.5 * 2^-24: tie, rounds up to the smallest normal
	0x387fdfff, 0x387fe001, // either side of that tie
	0x38800000,             // 2^-14: smallest normal
	0x3f800000, 0xbf800000, // ±1
	0x3f801000, // 1 + 2^-11: tie between 1 and 1+2^-10, goes to 1 (even)
	0x3f803000, // 1 + 3*2^-11: tie, goes up to 1 + 2^-9 (even)
	0x3f800fff, 0x3f801001,
	0x477fe000, 0xc77fe000, // ±65504: largest finite
	0x477fefff,             // just below 65512: 65504
	0x477ff000, 0xc77ff000, // ±65520: tie with 2^16, goes to ±Inf
	0x477fefff, 0x477ff001, // either side of the overflow threshold
	0x47800000,             // 65536
	0x7f7fffff, 0xff7fffff, // ±float32 max: ±Inf
	0x7f800000, 0xff800000, // ±Inf
	0x7fc00000, 0xffc00000, // quiet NaNs
	0x7f800001, 0xff800001, // signalling NaNs whose payload is only in the dropped bits
	0x7fa00000, 0x7fffffff, 0x7fbfffff,
}

func TestF32ToF16Edges(t *testing.T) {
	for _, b := range f16EdgeBits {
		f := math.Float32frombits(b)
		got, want := F32ToF16(f), refF16(f)
		if got != want {
			t.Errorf("F32ToF16(%#08x = %g) = %#04x, want %#04x", b, f, got, want)
		}
		if f != f && (!isNaN16(got) || got&quiet16 == 0) {
			t.Errorf("F32ToF16(%#08x) = %#04x, want a quiet NaN", b, got)
		}
	}
	// Spot-check the table against the expected encodings, so a shared misreading of the
	// standard by the reference could not hide.
	for _, c := range []struct {
		b    uint32
		want uint16
	}{
		{0x80000000, 0x8000}, {0x33000000, 0x0000}, {0x33000001, 0x0001}, {0x33c00000, 0x0002},
		{0x34200000, 0x0002}, {0x387fe000, 0x0400}, {0x3f801000, 0x3c00}, {0x3f803000, 0x3c02},
		{0x477fe000, 0x7bff}, {0x477ff000, 0x7c00}, {0xc77ff000, 0xfc00}, {0x477fefff, 0x7bff},
	} {
		if got := F32ToF16(math.Float32frombits(c.b)); got != c.want {
			t.Errorf("F32ToF16(%#08x) = %#04x, want %#04x", c.b, got, c.want)
		}
	}
}

// TestF32ToF16Midpoints checks, for every finite binary16 value, the value itself, the
// midpoint to its upper neighbour (a tie) and the float32 values one ulp either side of both.
func TestF32ToF16Midpoints(t *testing.T) {
	check := func(b uint32) {
		f := math.Float32frombits(b)
		if got, want := F32ToF16(f), refF16(f); got != want {
			t.Fatalf("F32ToF16(%#08x = %g) = %#04x, want %#04x", b, f, got, want)
		}
	}
	for i := range 0x7c00 {
		for _, sign := range []uint16{0, 0x8000} {
			h := uint16(i) | sign
			lo := float64(F16ToF32(h))
			hi := float64(F16ToF32(h + 1)) // 0x7bff+1 is Inf; its midpoint is handled below
			if i == 0x7bff {
				hi = math.Copysign(65536, lo)
			}
			mid := math.Float32bits(float32((lo + hi) / 2)) // exact: binary16 midpoints fit float32
			v := math.Float32bits(float32(lo))
			for _, b := range []uint32{v - 1, v, v + 1, mid - 1, mid, mid + 1} {
				if b&0x7fffffff < 0x7f800000 { // v-1 of +0 wraps; skip it
					check(b)
				}
			}
		}
	}
}

func TestF32ToF16RandomBits(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 2_000_000 {
		b := rng.Uint32()
		if i%2 == 1 {
			// Half the draws keep the exponent near binary16's range, where the work is.
			b = b&0x807fffff | (100+rng.Uint32N(45))<<23
		}
		f := math.Float32frombits(b)
		if got, want := F32ToF16(f), refF16(f); got != want {
			t.Fatalf("F32ToF16(%#08x = %g) = %#04x, want %#04x", b, f, got, want)
		}
	}
}

func TestF16RoundTripEveryFinite(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		if h&0x7c00 == 0x7c00 {
			continue
		}
		if got := F32ToF16(F16ToF32(h)); got != h {
			t.Fatalf("F32ToF16(F16ToF32(%#04x)) = %#04x", h, got)
		}
	}
	for _, h := range []uint16{0x7c00, 0xfc00} {
		if got := F32ToF16(F16ToF32(h)); got != h {
			t.Errorf("Inf round trip %#04x -> %#04x", h, got)
		}
	}
}

// refBF16 is an independent bfloat16 encoder: it rounds by comparing distances in float64
// rather than by bit arithmetic. Candidates are the truncated bfloat16 t (toward zero) and the
// next one up in magnitude; the 2^128 that follows the largest finite value is what IEEE
// rounding compares against before it overflows to Inf.
func refBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if f != f {
		return uint16(b>>16) | 0x0040
	}
	t := uint16(b >> 16)
	mag := math.Abs(float64(f))
	lo := math.Abs(float64(math.Float32frombits(uint32(t) << 16)))
	if t&0x7fff == 0x7f80 { // ±Inf stays
		return t
	}
	hi := math.Abs(float64(math.Float32frombits(uint32(t+1) << 16)))
	if t&0x7fff == 0x7f7f {
		hi = math.Ldexp(1, 128)
	}
	dlo, dhi := mag-lo, hi-mag // exact: all three are within a factor of two
	switch {
	case dlo < dhi:
		return t
	case dhi < dlo:
		return t + 1
	case t&1 == 0:
		return t
	}
	return t + 1
}

func TestF32ToBF16AgainstReference(t *testing.T) {
	// Every upper half with the lower halves that decide rounding: exact, just above zero,
	// just below, at and either side of the tie, and the top.
	lows := []uint32{0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff}
	rng := rand.New(rand.NewPCG(3, 4))
	for hi := range uint32(1 << 16) {
		for _, lo := range append(lows, rng.Uint32N(1<<16)) {
			b := hi<<16 | lo
			f := math.Float32frombits(b)
			if got, want := F32ToBF16(f), refBF16(f); got != want {
				t.Fatalf("F32ToBF16(%#08x) = %#04x, want %#04x", b, got, want)
			}
		}
	}
	for _, c := range []struct {
		b    uint32
		want uint16
	}{
		{0x3f808000, 0x3f80}, // 1 + 2^-8: tie, down to even
		{0x3f818000, 0x3f82}, // tie, up to even
		{0x3f808001, 0x3f81},
		{0x7f7f8000, 0x7f80}, // tie between max finite (odd) and 2^128: Inf
		{0x7f7f7fff, 0x7f7f},
		{0x80000000, 0x8000},
	} {
		if got := F32ToBF16(math.Float32frombits(c.b)); got != c.want {
			t.Errorf("F32ToBF16(%#08x) = %#04x, want %#04x", c.b, got, c.want)
		}
	}
}

func TestF32ToBF16KeepsNaN(t *testing.T) {
	// 0x7fffffff and 0xffffffff would carry out of the exponent if rounded; 0x7f800001 would
	// truncate to Inf without the quiet bit.
	for _, b := range []uint32{0x7f800001, 0x7f80ffff, 0x7f808000, 0x7fffffff, 0xffffffff, 0xff800001, 0x7fc00000} {
		h := F32ToBF16(math.Float32frombits(b))
		if h&0x7f80 != 0x7f80 || h&0x007f == 0 || h&quietBF16 == 0 {
			t.Errorf("F32ToBF16(%#08x) = %#04x, want a quiet NaN", b, h)
		}
		if h>>15 != uint16(b>>31) {
			t.Errorf("F32ToBF16(%#08x) = %#04x: sign lost", b, h)
		}
	}
}

func TestBF16RoundTrip(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		f := BF16ToF32(h)
		if math.Float32bits(f) != uint32(h)<<16 {
			t.Fatalf("BF16ToF32(%#04x) = %#08x", h, math.Float32bits(f))
		}
		got := F32ToBF16(f)
		if h&0x7f80 == 0x7f80 && h&0x7f != 0 {
			if got != h|quietBF16 {
				t.Fatalf("NaN %#04x round trip = %#04x, want %#04x", h, got, h|quietBF16)
			}
			continue
		}
		if got != h {
			t.Fatalf("F32ToBF16(BF16ToF32(%#04x)) = %#04x", h, got)
		}
	}
}
