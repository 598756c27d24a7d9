package optim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// adam32 is the Adam and AdamW element update in float32, one rounding per operation in
// PyTorch's order, with the per-step scalars computed as Step documents: what Step must
// reproduce bit for bit, whichever kernel internal/vec picks on this machine.
func adam32(cfg Config, p, g, m, v []float32, t int, lr, scale float32) {
	b1, b2, wd := cfg.Betas[0], cfg.Betas[1], cfg.WeightDecay
	negStep := float32(-float64(lr) / (1 - math.Pow(b1, float64(t))))
	bc2Sqrt := float32(math.Sqrt(1 - math.Pow(b2, float64(t))))
	decay := float32(1 - float64(lr)*wd)
	fb1, fc1, fb2, fc2 := float32(b1), float32(1-b1), float32(b2), float32(1-b2)
	for i := range p {
		pi, gi := p[i], float32(g[i]*scale)
		switch {
		case cfg.Type == TypeAdamW:
			pi = float32(pi * decay)
		case wd != 0:
			gi += float32(float32(wd) * pi)
		}
		m[i] = float32(fb1*m[i]) + float32(fc1*gi)
		v[i] = float32(fb2*v[i]) + float32(float32(fc2*gi)*gi)
		denom := float32(float32(math.Sqrt(float64(v[i])))/bc2Sqrt) + float32(cfg.Eps)
		p[i] = pi + float32(negStep*m[i])/denom
	}
}

// TestAdamMatchesFloat32Loop steps buffers long enough for the vector kernels, split across
// threads at unaligned piece boundaries, and compares every bit of the parameters and moments
// with adam32, gradients from subnormal to large included.
func TestAdamMatchesFloat32Loop(t *testing.T) {
	const n = 4099
	for _, name := range []string{"adam", "adam/wd", "adamw"} {
		cfg := allConfigs()[name]
		cfg.Threads = 2
		t.Run(name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(9, 10))
			o := mustNew(t, cfg, n)
			setGrain(o, 3)
			p := randSlice(rng, n, 1)
			wantP, wantM, wantV := append([]float32(nil), p...), make([]float32, n), make([]float32, n)
			for step := 1; step <= 3; step++ {
				g := randSlice(rng, n, 1e-3)
				for i := 0; i < n; i += 97 {
					g[i] *= []float32{0, 1e-38, 1e-30, 1e6, 1e18}[i%5]
				}
				lr, scale := 1e-3*float32(step), float32(1.0/256)
				o.Step(p, g, lr, scale)
				adam32(cfg, wantP, g, wantM, wantV, step, lr, scale)
				for _, c := range []struct {
					name      string
					got, want []float32
				}{{"params", p, wantP}, {"exp_avg", state(o, "exp_avg"), wantM}, {"exp_avg_sq", state(o, "exp_avg_sq"), wantV}} {
					if i := sameBits(c.got, c.want); i >= 0 {
						t.Fatalf("step %d: %s[%d] = %s, want %s", step, c.name, i, bits(c.got[i]), bits(c.want[i]))
					}
				}
			}
		})
	}
}

func bits(x float32) string { return fmt.Sprintf("%g (%#08x)", x, math.Float32bits(x)) }

// TestAdamMatchesCReference pins Step to bench/adamw.c built with -ffp-contract=off: the same
// 1M-element problem (bench_test.go's fill, lr 1e-3, gradient scale 1, default betas, eps and
// weight decay 0.01), stepped 23 times as the C program's 3 warm-up and 20 timed steps, and
// the same checksum of every 4099th parameter. The C build with FMAs prints different
// checksums (b82b4a15 and 1ab11095), so a fused operation anywhere would show here.
func TestAdamMatchesCReference(t *testing.T) {
	const n = 1 << 20
	for _, c := range []struct {
		typ  string
		want uint32 // "check" column of bin/adamw-nofma --kernel adamw|adam 1M
	}{{TypeAdamW, 0xebaa91c1}, {TypeAdam, 0x01c1aabc}} {
		t.Run(c.typ, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Type = c.typ
			o := mustNew(t, cfg, n)
			p, g := make([]float32, n), make([]float32, n)
			fill(p, 1)
			fill(g, 1e-3)
			for range 23 {
				o.Step(p, g, 1e-3, 1)
			}
			var h uint32
			for i := 0; i < n; i += 4099 {
				h = h*31 + math.Float32bits(p[i])
			}
			if h != c.want {
				t.Errorf("checksum %08x, want %08x", h, c.want)
			}
		})
	}
}
