package vec

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

// impl names one implementation of the kernels; see impl_*_test.go.
type impl struct {
	name string
	asm  bool
}

// forEachImpl runs f once per implementation available here, as subtests.
func forEachImpl(t *testing.T, f func(t *testing.T)) {
	for _, im := range impls {
		t.Run(im.name, func(t *testing.T) {
			defer use(im)()
			f(t)
		})
	}
}

// specialBits are float32 words at the edges of every branch of the conversions and of the
// arithmetic: zeros, infinities, NaNs with payloads in the kept and the dropped bits
// (signalling and quiet), float32 subnormals, binary16's normal, subnormal and overflow
// thresholds and their neighbours, rounding ties for binary16 (13 dropped bits) and bfloat16
// (16 dropped bits) with even and odd kept bits, and the largest finite float32, which
// bfloat16 rounds to Inf.
var specialBits = []uint32{
	0x00000000, 0x80000000, 0x7f800000, 0xff800000,
	0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fbfffff, 0x7fffffff, 0xffffffff,
	0x7f801fff, 0x7f802000, 0x7fa00000, 0x7fc00001, 0x7fe01234, 0xffd5a5a5, 0x7f810000,
	0x7f80ffff, 0x7fff0000, 0xff808000,
	0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00400000, 0x00800000, 0x80800000,
	0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0x477fffff, 0x47800000, 0xc77ff000, 0xc77fefff,
	0x38800000, 0x387fffff, 0x38800001, 0xb8800000, 0x387ff000, 0x387fe000,
	0x33800000, 0x337fffff, 0x33800001, 0x33000000, 0x33000001, 0x32ffffff, 0xb3000001,
	0x33c00000, 0x33a00000, 0x35000000, 0x35001000, 0x35003000,
	0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001, 0xbf803000,
	0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0xbf818000,
	0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7f7fff, 0x7f7e8000,
	0x3f800000, 0xbf800000, 0x40490fdb, 0x3eaaaaab,
}

// testValues returns n float32 values: the special words first (as many as fit), then a mix
// of random bit patterns, gradient-like values, values near binary16's range limits and words
// whose dropped bits sit on or next to a rounding tie.
func testValues(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		if i < len(specialBits) {
			v[i] = math.Float32frombits(specialBits[i])
			continue
		}
		v[i] = randomValue(rng)
	}
	return v
}

func randomValue(rng *rand.Rand) float32 {
	switch rng.IntN(6) {
	case 0:
		return math.Float32frombits(rng.Uint32())
	case 1:
		return float32(rng.NormFloat64() * 1e-3)
	case 2:
		return math.Float32frombits(specialBits[rng.IntN(len(specialBits))])
	case 3:
		// Around binary16's overflow threshold and smallest subnormal.
		base := []uint32{0x477ff000, 0x33000000, 0x38800000}[rng.IntN(3)]
		return math.Float32frombits(base + uint32(rng.IntN(64)) - 32 | rng.Uint32()&signMask)
	case 4:
		// Binary16 ties: the 13 dropped bits are 0x1000, or one off it.
		b := rng.Uint32()&^0x1fff | 0x1000
		return math.Float32frombits(b + uint32(rng.IntN(3)) - 1)
	default:
		// Bfloat16 ties: the 16 dropped bits are 0x8000, or one off it.
		b := rng.Uint32()&^0xffff | 0x8000
		return math.Float32frombits(b + uint32(rng.IntN(3)) - 1)
	}
}

// testWords returns n 16-bit words: all 65536 once n reaches that, random otherwise, with the
// binary16 NaNs, infinities and zeros first.
func testWords(rng *rand.Rand, n int) []uint16 {
	first := []uint16{0x7c00, 0xfc00, 0x7c01, 0x7e00, 0x7fff, 0xfe01, 0x0000, 0x8000, 0x0001, 0x03ff,
		0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffff}
	w := make([]uint16, n)
	for i := range w {
		switch {
		case i < len(first):
			w[i] = first[i]
		case n >= 1<<16:
			w[i] = uint16(i)
		default:
			w[i] = uint16(rng.Uint32())
		}
	}
	return w
}

func isNaN32(f float32) bool { return f != f }

// sameArith reports whether got is the result want of float32 arithmetic: the same bits, or
// both NaN. Which of two NaN operands an add or a multiply returns is the hardware's choice
// (x86 returns the first source, arm64 prefers a signalling one) and the Go compiler may order
// commutative operands either way, so only the NaN-ness is pinned down there;
// TestNaNPropagation checks the case of a single NaN operand exactly.
func sameArith(got, want float32) bool {
	return math.Float32bits(got) == math.Float32bits(want) || isNaN32(got) && isNaN32(want)
}

// guard is written around every slice under test; a kernel that writes outside its slice
// changes it.
const guard = 0x7ff1a5a5 // a float32 NaN with a payload no kernel produces

// window returns a slice of n elements starting off elements into a fresh buffer whose other
// elements hold the guard word, and a function that checks they still do.
func window[T float32 | uint16](t *testing.T, n, off int, fill func(i int) T, g T) ([]T, func()) {
	t.Helper()
	buf := make([]T, off+n+8)
	for i := range buf {
		buf[i] = g
	}
	s := buf[off : off+n : off+n]
	for i := range s {
		s[i] = fill(i)
	}
	return s, func() {
		t.Helper()
		for i, v := range buf {
			if (i < off || i >= off+n) && v != g && !(v != v && g != g) {
				t.Fatalf("n=%d off=%d: element %d outside the slice was overwritten", n, off, i-off)
			}
		}
	}
}

func guardF() float32 { return math.Float32frombits(guard) }

const guard16 = 0x5a5a

// testShapes calls f with every length 0..67 and a few long ones, at start offsets 0..7 for
// dst and for src (in elements), so the kernels see every tail length and misalignment.
func testShapes(f func(n, dstOff, srcOff int)) {
	lengths := []int{}
	for n := 0; n <= 67; n++ {
		lengths = append(lengths, n)
	}
	lengths = append(lengths, 255, 1000, 4099, 1<<16+3)
	for _, n := range lengths {
		for off := range 8 {
			f(n, off, (off*5+3)%8)
		}
	}
}

func TestBinaryOps(t *testing.T) {
	ops := []struct {
		name string
		vec  func(dst, src []float32)
		ref  func(d, s float32) float32
		max  bool
	}{
		{"Add", Add, func(d, s float32) float32 { return d + s }, false},
		{"AddScale", func(dst, src []float32) { AddScale(dst, src, 0.125) },
			func(d, s float32) float32 { return (d + s) * 0.125 }, false},
		{"AddScaleThird", func(dst, src []float32) { AddScale(dst, src, 1.0/3) },
			func(d, s float32) float32 { sum := d + s; return sum * (1.0 / 3) }, false},
		{"Max", Max, max32, true},
	}
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			forEachImpl(t, func(t *testing.T) {
				rng := rand.New(rand.NewPCG(1, 2))
				testShapes(func(n, dOff, sOff int) {
					a, b := testValues(rng, n), testValues(rng, n)
					rng.Shuffle(n, func(i, j int) { b[i], b[j] = b[j], b[i] })
					dst, checkD := window(t, n, dOff, func(i int) float32 { return a[i] }, guardF())
					src, checkS := window(t, n, sOff, func(i int) float32 { return b[i] }, guardF())
					op.vec(dst, src)
					checkD()
					checkS()
					for i := range dst {
						want := op.ref(a[i], b[i])
						if src[i] != b[i] && !isNaN32(b[i]) {
							t.Fatalf("n=%d: src[%d] changed", n, i)
						}
						ok := sameArith(dst[i], want)
						if op.max {
							ok = math.Float32bits(dst[i]) == math.Float32bits(want)
						}
						if !ok {
							t.Fatalf("n=%d off=%d,%d: %s(%#08x, %#08x) = %#08x, want %#08x", n, dOff, sOff,
								op.name, math.Float32bits(a[i]), math.Float32bits(b[i]),
								math.Float32bits(dst[i]), math.Float32bits(want))
						}
					}
				})
			})
		})
	}
}

func TestScale(t *testing.T) {
	forEachImpl(t, func(t *testing.T) {
		rng := rand.New(rand.NewPCG(3, 4))
		for _, s := range []float32{0.5, 1.0 / 3, -7, 0, float32(math.Inf(1)), float32(math.NaN()), 1e-40} {
			testShapes(func(n, off, _ int) {
				a := testValues(rng, n)
				x, check := window(t, n, off, func(i int) float32 { return a[i] }, guardF())
				Scale(x, s)
				check()
				for i := range x {
					if want := a[i] * s; !sameArith(x[i], want) {
						t.Fatalf("n=%d off=%d: %#08x * %v = %#08x, want %#08x", n, off,
							math.Float32bits(a[i]), s, math.Float32bits(x[i]), math.Float32bits(want))
					}
				}
			})
		}
	})
}

// TestNaNPropagation checks the NaN bits that IEEE 754 leaves to the implementation but that
// x86 and arm64 agree on: an operation with one NaN operand returns that NaN, made quiet.
func TestNaNPropagation(t *testing.T) {
	nans := []uint32{0x7fc00000, 0xffc00001, 0x7f800001, 0xff812345, 0x7fffffff}
	forEachImpl(t, func(t *testing.T) {
		for _, nb := range nans {
			nan := math.Float32frombits(nb)
			quiet := nb | 0x00400000
			for _, nanInDst := range []bool{true, false} {
				n := 21 // some lanes in the vector kernel, some in the tail
				dst, src := make([]float32, n), make([]float32, n)
				for i := range dst {
					dst[i], src[i] = float32(i)-3.5, 1.25
					if nanInDst {
						dst[i] = nan
					} else {
						src[i] = nan
					}
				}
				for _, op := range []struct {
					name string
					f    func(dst, src []float32)
				}{
					{"Add", Add},
					{"AddScale", func(d, s []float32) { AddScale(d, s, 3) }},
				} {
					d := append([]float32(nil), dst...)
					op.f(d, src)
					for i, v := range d {
						if math.Float32bits(v) != quiet {
							t.Fatalf("%s with NaN %#08x (in dst: %v): element %d = %#08x, want %#08x",
								op.name, nb, nanInDst, i, math.Float32bits(v), quiet)
						}
					}
				}
				if nanInDst {
					d := append([]float32(nil), dst...)
					Scale(d, 3)
					for i, v := range d {
						if math.Float32bits(v) != quiet {
							t.Fatalf("Scale(NaN %#08x): element %d = %#08x", nb, i, math.Float32bits(v))
						}
					}
				}
			}
		}
	})
}

// TestMaxMatchesBuiltin checks max32, the reference for Max, against the builtin max: the same
// value everywhere, and on amd64 the same bits, NaNs included (the claim in max32's comment).
func TestMaxMatchesBuiltin(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	vals := testValues(rng, 3000)
	for i, x := range vals {
		for _, y := range []float32{vals[(i*7+1)%len(vals)], vals[i%len(specialBits)], x, -x} {
			got, want := max32(x, y), max(x, y)
			if isNaN32(got) != isNaN32(want) ||
				!isNaN32(want) && math.Float32bits(got) != math.Float32bits(want) ||
				runtime.GOARCH == "amd64" && math.Float32bits(got) != math.Float32bits(want) {
				t.Fatalf("max32(%#08x, %#08x) = %#08x, builtin max gives %#08x", math.Float32bits(x),
					math.Float32bits(y), math.Float32bits(got), math.Float32bits(want))
			}
		}
	}
	if b := math.Float32bits(max32(float32(math.Copysign(0, -1)), 0)); b != 0 {
		t.Fatalf("max32(-0, +0) = %#08x, want +0", b)
	}
}

// sumSquaresRef is SumSquares's definition, written as plainly as possible: lane i%8
// accumulates float64(x[i])² in index order, then the fixed tree, then one canonical NaN.
func sumSquaresRef(x []float32) float64 {
	var p [8]float64
	for i, v := range x {
		p[i%8] += float64(v) * float64(v)
	}
	s := ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
	if math.IsNaN(s) {
		return math.NaN()
	}
	return s
}

func TestSumSquares(t *testing.T) {
	forEachImpl(t, func(t *testing.T) {
		rng := rand.New(rand.NewPCG(7, 8))
		testShapes(func(n, off, _ int) {
			// Finite values spread over many magnitudes, so that the order of the additions
			// shows in the low bits of the sum.
			a := make([]float32, n)
			for i := range a {
				a[i] = float32(rng.NormFloat64() * math.Exp2(float64(rng.IntN(60)-30)))
			}
			x, check := window(t, n, off, func(i int) float32 { return a[i] }, guardF())
			got, want := SumSquares(x), sumSquaresRef(a)
			check()
			if math.Float64bits(got) != math.Float64bits(want) {
				t.Fatalf("n=%d off=%d: SumSquares = %v (%#016x), want %v (%#016x)", n, off, got,
					math.Float64bits(got), want, math.Float64bits(want))
			}
		})
		// Special values: NaNs of any kind give the canonical NaN; Inf gives +Inf.
		for _, c := range []struct {
			bits uint32
			want float64
		}{
			{0x7f800000, math.Inf(1)}, {0xff800000, math.Inf(1)},
			{0x7fc00000, math.NaN()}, {0xff800001, math.NaN()}, {0x7fa5a5a5, math.NaN()},
			{0x00000001, 0x1p-298}, {0x80000000, 0},
		} {
			for _, n := range []int{1, 8, 37} {
				for pos := range n {
					x := make([]float32, n)
					x[pos] = math.Float32frombits(c.bits)
					if n > 1 {
						x[(pos+1)%n] = float32(math.Inf(-1)) // NaN must win over Inf
						if !math.IsNaN(c.want) {
							x[(pos+1)%n] = 0
						}
					}
					if got := SumSquares(x); math.Float64bits(got) != math.Float64bits(c.want) {
						t.Fatalf("SumSquares with %#08x at %d of %d = %#016x, want %#016x", c.bits, pos,
							n, math.Float64bits(got), math.Float64bits(c.want))
					}
				}
			}
		}
	})
}

func TestEncode(t *testing.T) {
	encoders := []struct {
		name string
		vec  func([]uint16, []float32)
		ref  func(float32) uint16
	}{
		{"F16", EncodeF16, half.F32ToF16},
		{"BF16", EncodeBF16, half.F32ToBF16},
	}
	for _, e := range encoders {
		t.Run(e.name, func(t *testing.T) {
			forEachImpl(t, func(t *testing.T) {
				rng := rand.New(rand.NewPCG(9, 10))
				testShapes(func(n, dOff, sOff int) {
					a := testValues(rng, n)
					dst, checkD := window(t, n, dOff, func(int) uint16 { return guard16 }, guard16)
					src, checkS := window(t, n, sOff, func(i int) float32 { return a[i] }, guardF())
					e.vec(dst, src)
					checkD()
					checkS()
					for i, v := range a {
						if want := e.ref(v); dst[i] != want {
							t.Fatalf("n=%d off=%d,%d: Encode%s(%#08x) = %#04x, want %#04x", n, dOff, sOff,
								e.name, math.Float32bits(v), dst[i], want)
						}
					}
				})
			})
		})
	}
}

func TestDecode(t *testing.T) {
	ops := []struct {
		name string
		vec  func([]float32, []uint16)
		ref  func(d float32, h uint16) float32
	}{
		{"DecodeF16", DecodeF16, func(_ float32, h uint16) float32 { return half.F16ToF32(h) }},
		{"AddDecodedF16", AddDecodedF16, func(d float32, h uint16) float32 { return d + half.F16ToF32(h) }},
		{"AddDecodedBF16", AddDecodedBF16, func(d float32, h uint16) float32 { return d + half.BF16ToF32(h) }},
	}
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			forEachImpl(t, func(t *testing.T) {
				rng := rand.New(rand.NewPCG(11, 12))
				testShapes(func(n, dOff, sOff int) {
					a, w := testValues(rng, n), testWords(rng, n)
					dst, checkD := window(t, n, dOff, func(i int) float32 { return a[i] }, guardF())
					src, checkS := window(t, n, sOff, func(i int) uint16 { return w[i] }, guard16)
					op.vec(dst, src)
					checkD()
					checkS()
					for i, h := range w {
						// DecodeF16 stores words exactly; the additions follow sameArith.
						want := op.ref(a[i], h)
						if math.Float32bits(dst[i]) != math.Float32bits(want) &&
							(op.name == "DecodeF16" || !sameArith(dst[i], want)) {
							t.Fatalf("n=%d off=%d,%d: %s(%#08x, %#04x) = %#08x, want %#08x", n, dOff, sOff,
								op.name, math.Float32bits(a[i]), h, math.Float32bits(dst[i]), math.Float32bits(want))
						}
					}
				})
			})
		})
	}
}

// TestDecodeF16AllWords decodes every binary16 word, and adds each to zero and to a finite
// value, in one buffer.
func TestDecodeF16AllWords(t *testing.T) {
	forEachImpl(t, func(t *testing.T) {
		words := make([]uint16, 1<<16)
		for i := range words {
			words[i] = uint16(i)
		}
		dec := make([]float32, len(words))
		DecodeF16(dec, words)
		for i, h := range words {
			if want := half.F16ToF32(h); math.Float32bits(dec[i]) != math.Float32bits(want) {
				t.Fatalf("DecodeF16(%#04x) = %#08x, want %#08x", h, math.Float32bits(dec[i]), math.Float32bits(want))
			}
		}
		for _, base := range []float32{0, -1.5} {
			for _, c := range []struct {
				name   string
				f      func([]float32, []uint16)
				decode func(uint16) float32
			}{{"AddDecodedF16", AddDecodedF16, half.F16ToF32}, {"AddDecodedBF16", AddDecodedBF16, half.BF16ToF32}} {
				sum := make([]float32, len(words))
				for i := range sum {
					sum[i] = base
				}
				c.f(sum, words)
				for i, h := range words {
					// base is not a NaN, so a NaN word's quieted bits are the exact result.
					if want := base + c.decode(h); math.Float32bits(sum[i]) != math.Float32bits(want) {
						t.Fatalf("%s(%v, %#04x) = %#08x, want %#08x", c.name, base, h,
							math.Float32bits(sum[i]), math.Float32bits(want))
					}
				}
			}
		}
	})
}

// TestEncodeManyPatterns converts several million float32 words covering every sign and
// exponent: per exponent, mantissas with every pattern of the bits that decide rounding
// (around the binary16 and bfloat16 ties), the extremes and random ones. The exhaustive 2^32
// sweep is TestEncodeSweep, run on request.
func TestEncodeManyPatterns(t *testing.T) {
	const perExp = 8192
	src := make([]float32, 0, 512*perExp)
	rng := rand.New(rand.NewPCG(13, 14))
	tails := []uint32{0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0xffff}
	for se := uint32(0); se < 512; se++ {
		top := se << 23
		for k := range perExp {
			var m uint32
			switch {
			case k < 2*len(tails):
				// The rounding bits with both values of the kept lsb (bit 13 or bit 16).
				m = tails[k/2] | uint32(k%2)<<13 | uint32(k%2)<<16
			case k < 2*len(tails)+4:
				m = []uint32{0x7fffff, 0x400000, 0x3fffff, 0x000001}[k-2*len(tails)]
			case k%2 == 0:
				m = rng.Uint32()&0x7fe000 | tails[rng.IntN(len(tails))]&0x1fff
			default:
				m = rng.Uint32() & 0x7fffff
			}
			src = append(src, math.Float32frombits(top|m&0x7fffff))
		}
	}
	dst := make([]uint16, len(src))
	forEachImpl(t, func(t *testing.T) {
		checkEncodeAll(t, dst, src)
	})
}

// checkEncodeAll encodes src both ways and compares every word with internal/half's scalar
// conversions.
func checkEncodeAll(t *testing.T, dst []uint16, src []float32) {
	t.Helper()
	EncodeF16(dst, src)
	for i, v := range src {
		if want := half.F32ToF16(v); dst[i] != want {
			t.Fatalf("EncodeF16(%#08x) = %#04x, want %#04x", math.Float32bits(v), dst[i], want)
		}
	}
	EncodeBF16(dst, src)
	for i, v := range src {
		if want := half.F32ToBF16(v); dst[i] != want {
			t.Fatalf("EncodeBF16(%#08x) = %#04x, want %#04x", math.Float32bits(v), dst[i], want)
		}
	}
}

func TestNoAllocs(t *testing.T) {
	f32a, f32b := make([]float32, 1001), make([]float32, 1001)
	w := make([]uint16, 1001)
	a, b, h := f32a[1:], f32b[1:], w[1:]
	m, v := make([]float32, 1000), make([]float32, 1000)
	k := adamTestConsts(1e-3, 0.01, 1, 1)
	var sink float64
	cases := map[string]func(){
		"AdamW":          func() { AdamW(a, b, m, v, k) },
		"AdamL2":         func() { AdamL2(a, b, m, v, k) },
		"Add":            func() { Add(a, b) },
		"AddScale":       func() { AddScale(a, b, 0.5) },
		"Scale":          func() { Scale(a, 1) },
		"Max":            func() { Max(a, b) },
		"SumSquares":     func() { sink += SumSquares(a) },
		"EncodeF16":      func() { EncodeF16(h, a) },
		"DecodeF16":      func() { DecodeF16(a, h) },
		"AddDecodedF16":  func() { AddDecodedF16(a, h) },
		"EncodeBF16":     func() { EncodeBF16(h, a) },
		"AddDecodedBF16": func() { AddDecodedBF16(a, h) },
	}
	forEachImpl(t, func(t *testing.T) {
		for name, f := range cases {
			// AllocsPerRun's warm-up call absorbs the one-time decode table of the Go path.
			if n := testing.AllocsPerRun(20, f); n != 0 {
				t.Errorf("%s allocates %v times per call", name, n)
			}
		}
	})
	_ = sink
}

func TestLengthMismatchPanics(t *testing.T) {
	f4, f5, w4 := make([]float32, 4), make([]float32, 5), make([]uint16, 4)
	k := &AdamConsts{}
	cases := map[string]func(){
		"AdamW g":        func() { AdamW(f4, f5, f4, f4, k) },
		"AdamW m":        func() { AdamW(f4, f4, f5, f4, k) },
		"AdamL2 v":       func() { AdamL2(f4, f4, f4, f5, k) },
		"Add":            func() { Add(f4, f5) },
		"AddScale":       func() { AddScale(f5, f4, 2) },
		"Max":            func() { Max(f4, f5) },
		"EncodeF16":      func() { EncodeF16(w4, f5) },
		"DecodeF16":      func() { DecodeF16(f5, w4) },
		"AddDecodedF16":  func() { AddDecodedF16(f5, w4) },
		"EncodeBF16":     func() { EncodeBF16(w4, f5) },
		"AddDecodedBF16": func() { AddDecodedBF16(f5, w4) },
	}
	for name, f := range cases {
		t.Run(name, func(t *testing.T) {
			defer func() {
				r := recover()
				if msg := fmt.Sprint(r); !strings.Contains(msg, "vec: length mismatch") {
					t.Fatalf("recovered %v, want a length-mismatch panic", r)
				}
			}()
			f()
		})
	}
}

func TestAccelerated(t *testing.T) {
	t.Logf("Accelerated() = %q", Accelerated())
	for _, im := range impls {
		restore := use(im)
		got := Accelerated()
		restore()
		want := "purego"
		if im.asm {
			want = "avx2+f16c"
		}
		if got != want {
			t.Errorf("Accelerated() with the %s kernels = %q, want %q", im.name, got, want)
		}
	}
}
