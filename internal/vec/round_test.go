package vec

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

func TestRoundMatchesScalar(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	specials := []float32{0, float32(math.Copysign(0, -1)), 65504, 65519.99, 65520, 1e-8, 6e-8, -3e-5,
		float32(math.Inf(1)), float32(math.Inf(-1)), math.Float32frombits(0x7fc00001), math.Float32frombits(0xff800123), 1e38}
	for _, n := range []int{0, 1, 7, 8, 9, 4095, 4096, 4097, 10000} {
		for _, f := range []half.Format{half.FP32, half.FP16, half.BF16} {
			x := make([]float32, n)
			for i := range x {
				switch rng.IntN(4) {
				case 0:
					x[i] = specials[rng.IntN(len(specials))]
				case 1:
					x[i] = math.Float32frombits(rng.Uint32())
				default:
					x[i] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(12)-6)))
				}
			}
			want := append([]float32(nil), x...)
			for i := range want {
				want[i] = f.Round(want[i])
			}
			Round(x, f)
			for i := range x {
				if math.Float32bits(x[i]) != math.Float32bits(want[i]) && !(isNaN32(x[i]) && isNaN32(want[i])) {
					t.Fatalf("%s n=%d [%d]: %#08x, want %#08x", f, n, i, math.Float32bits(x[i]), math.Float32bits(want[i]))
				}
			}
		}
	}
	if a := testing.AllocsPerRun(10, func() { Round(make([]float32, 0), half.FP16) }); a > 1 {
		t.Fatalf("Round allocates %v times", a)
	}
}

func BenchmarkRound(b *testing.B) {
	x := make([]float32, 1<<20)
	for i := range x {
		x[i] = float32(i) * 1e-3
	}
	for _, f := range []half.Format{half.FP16, half.BF16} {
		b.Run(f.String(), func(b *testing.B) {
			b.SetBytes(int64(4 * len(x)))
			for i := 0; i < b.N; i++ {
				Round(x, f)
			}
		})
		b.Run(f.String()+"/scalar", func(b *testing.B) {
			b.SetBytes(int64(4 * len(x)))
			for i := 0; i < b.N; i++ {
				f.RoundSlice(x)
			}
		})
	}
}
