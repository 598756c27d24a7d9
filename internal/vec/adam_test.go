package vec

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// adamRef is one element of AdamW (l2 false) or AdamL2 (l2 true), written from the formulas in
// their docs, one float32 rounding per operation.
func adamRef(l2 bool, c *AdamConsts, p, g, m, v float32) (float32, float32, float32) {
	var gs float32
	if l2 {
		gs = float32(g*c.Scale) + float32(c.WD*p)
	} else {
		p = float32(p * c.Decay)
		gs = float32(g * c.Scale)
	}
	m = float32(c.B1*m) + float32(c.C1*gs)
	v = float32(c.B2*v) + float32(float32(c.C2*gs)*gs)
	root := float32(math.Sqrt(float64(v)))
	denom := float32(root/c.BC2Sqrt) + c.Eps
	return p + float32(c.NegStep*m)/denom, m, v
}

// adamTestConsts builds the constants Step would for lr, weight decay wd and step t with
// PyTorch's default betas and eps.
func adamTestConsts(lr, wd, scale float64, t int) *AdamConsts {
	b1, b2 := 0.9, 0.999
	lr = float64(float32(lr))
	return &AdamConsts{
		B1: float32(b1), C1: float32(1 - b1), B2: float32(b2), C2: float32(1 - b2),
		Eps: 1e-8, WD: float32(wd), Scale: float32(scale),
		NegStep: float32(-lr / (1 - math.Pow(b1, float64(t)))),
		BC2Sqrt: float32(math.Sqrt(1 - math.Pow(b2, float64(t)))),
		Decay:   float32(1 - lr*wd),
	}
}

// adamValue returns a value of the kind the optimizer sees in the role given: mostly typical
// magnitudes, with zeros of both signs, subnormals, and values whose squares or quotients
// underflow or overflow. In the "wild" role it may be any word, NaNs and infinities included.
func adamValue(rng *rand.Rand, role string) float32 {
	switch role {
	case "wild":
		return randomValue(rng)
	case "v": // a second moment is never negative
		return float32(math.Abs(float64(adamValue(rng, "g"))))
	}
	sign := float32(1 - 2*rng.IntN(2))
	switch rng.IntN(10) {
	case 0:
		return 0 * sign
	case 1: // subnormal
		return math.Float32frombits(uint32(rng.IntN(1<<23))) * sign
	case 2: // tiny: squares underflow
		return float32(rng.Float64()*1e-20) * sign
	case 3: // huge: squares overflow to Inf, quotients to zero
		return float32(rng.Float64()*1e30) * sign
	case 4:
		return float32(rng.NormFloat64())
	default:
		if role == "g" || role == "m" {
			return float32(rng.NormFloat64() * 1e-3)
		}
		return float32(rng.NormFloat64() * 0.05) // weights
	}
}

// TestAdam checks both kernels, on every implementation, against adamRef element by element:
// the same bits, or NaN where the reference is NaN. It covers every tail length 0..70, lengths
// that span several vector chunks, each of the four buffers at its own misalignment, and
// gradients and moments from zero and subnormal to overflowing.
func TestAdam(t *testing.T) {
	lengths := []int{}
	for n := 0; n <= 70; n++ {
		lengths = append(lengths, n)
	}
	lengths = append(lengths, 255, 4099, 2<<16+21) // the last spans three vector chunks (maxChunk)
	consts := []*AdamConsts{
		adamTestConsts(1e-3, 0.01, 1, 1),
		adamTestConsts(3e-4, 0.1, 1.0/65536, 1000),
		adamTestConsts(1, 0, 1, 7),
		// Last, extremes: zero denominators, overflowing steps, Inf-Inf in the L2 gradient.
		{B1: 0.5, C1: 0.5, B2: 0.25, C2: 0.75, Eps: 0, WD: 1e30, Scale: 1e-30, NegStep: -1e30,
			BC2Sqrt: 1e-20, Decay: 0.5},
	}
	for _, kern := range []struct {
		name string
		f    func(p, g, m, v []float32, c *AdamConsts)
		l2   bool
	}{{"AdamW", AdamW, false}, {"AdamL2", AdamL2, true}} {
		t.Run(kern.name, func(t *testing.T) {
			forEachImpl(t, func(t *testing.T) {
				rng := rand.New(rand.NewPCG(5, 6))
				for ci, c := range consts {
					for _, wild := range []bool{false, true} {
						for _, n := range lengths {
							typical := !wild && ci < len(consts)-1
							checkAdam(t, rng, kern.f, kern.l2, c, n, wild, typical,
								fmt.Sprintf("consts %d wild=%v", ci, wild))
						}
					}
				}
			})
		})
	}
}

func checkAdam(t *testing.T, rng *rand.Rand, f func(p, g, m, v []float32, c *AdamConsts), l2 bool,
	c *AdamConsts, n int, wild, typical bool, what string) {
	t.Helper()
	role := func(r string) string {
		if wild {
			return "wild"
		}
		return r
	}
	var in [4][]float32 // p, g, m, v
	for b, r := range []string{"p", "g", "m", "v"} {
		in[b] = make([]float32, n)
		for i := range in[b] {
			in[b][i] = adamValue(rng, role(r))
		}
	}
	var bufs [4][]float32
	var checks [4]func()
	for b := range bufs {
		off := rng.IntN(8)
		bufs[b], checks[b] = window(t, n, off, func(i int) float32 { return in[b][i] }, guardF())
	}
	f(bufs[0], bufs[1], bufs[2], bufs[3], c)
	for _, check := range checks {
		check()
	}
	nans := 0
	for i := range n {
		wp, wm, wv := adamRef(l2, c, in[0][i], in[1][i], in[2][i], in[3][i])
		got := [4]float32{bufs[0][i], bufs[1][i], bufs[2][i], bufs[3][i]}
		want := [4]float32{wp, in[1][i], wm, wv}
		for b, name := range []string{"p", "g", "m", "v"} {
			if !sameArith(got[b], want[b]) {
				t.Fatalf("%s n=%d: element %d (p, g, m, v = %#08x, %#08x, %#08x, %#08x): %s = %#08x, want %#08x",
					what, n, i, math.Float32bits(in[0][i]), math.Float32bits(in[1][i]),
					math.Float32bits(in[2][i]), math.Float32bits(in[3][i]), name,
					math.Float32bits(got[b]), math.Float32bits(want[b]))
			}
		}
		if isNaN32(wp) {
			nans++
		}
	}
	// With typical constants and no NaN inputs most results must be numbers, or the test would
	// compare little.
	if typical && n >= 64 && nans > n/4 {
		t.Fatalf("%s n=%d: %d of the reference's results are NaN", what, n, nans)
	}
}

// TestAdamGolden pins both kernels' bits across CPUs and builds, as TestSumSquaresGolden does
// for SumSquares: the hashes were computed once (on amd64) and every implementation must give
// them. Ranks on different machines step their shards with these kernels.
func TestAdamGolden(t *testing.T) {
	const n = 1003
	for _, c := range []struct {
		name string
		f    func(p, g, m, v []float32, c *AdamConsts)
		want uint64
	}{
		{"AdamW", AdamW, 0xcbd2e0721271af1b},
		{"AdamL2", AdamL2, 0x97f0ff369fd6b0b5},
	} {
		t.Run(c.name, func(t *testing.T) {
			forEachImpl(t, func(t *testing.T) {
				p, g := goldenInput(n), goldenInput(2 * n)[n:]
				m, v := make([]float32, n), make([]float32, n)
				k := adamTestConsts(1e-3, 0.01, 1.0/1024, 1)
				for step := 1; step <= 3; step++ {
					c.f(p, g, m, v, k)
				}
				h := fnv64(p, m, v)
				if h != c.want {
					t.Errorf("hash of p, m, v after 3 steps = %#016x, want %#016x", h, c.want)
				}
			})
		})
	}
}

// fnv64 is FNV-1a over the bits of the buffers.
func fnv64(bufs ...[]float32) uint64 {
	h := uint64(14695981039346656037)
	for _, b := range bufs {
		for _, x := range b {
			w := math.Float32bits(x)
			for range 4 {
				h ^= uint64(w & 0xff)
				h *= 1099511628211
				w >>= 8
			}
		}
	}
	return h
}

// BenchmarkAdamW runs one thread's AdamW over buffers in L1 (4K: the kernels' arithmetic
// rate), L2 (64K) and memory (16M); SetBytes counts the 28 bytes an element reads and writes.
func BenchmarkAdamW(b *testing.B) {
	for _, im := range impls {
		for _, size := range []struct {
			name string
			n    int
		}{{"4K", 4 << 10}, {"64K", 64 << 10}, {"16M", 16 << 20}} {
			b.Run(fmt.Sprintf("%s/%s", im.name, size.name), func(b *testing.B) {
				defer use(im)()
				p, g, m, v := make([]float32, size.n), make([]float32, size.n),
					make([]float32, size.n), make([]float32, size.n)
				for i := range p {
					p[i] = float32(i%1997-998) / 998
					g[i] = p[i] * 1e-3
				}
				k := adamTestConsts(1e-3, 0.01, 1, 1)
				AdamW(p, g, m, v, k)
				b.SetBytes(int64(28 * size.n))
				for b.Loop() {
					AdamW(p, g, m, v, k)
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(size.n), "ns/elem")
			})
		}
	}
}
