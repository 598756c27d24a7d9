package engine

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/optim"
)

// TestAdamMatchesCPUOptimizer: the device optimizer's master weights and moments are the CPU
// optimizer's bit for bit over several steps, and the working weights are the master rounded.
func TestAdamMatchesCPUOptimizer(t *testing.T) {
	for _, f := range []half.Format{half.FP32, half.BF16} {
		t.Run(f.String(), func(t *testing.T) {
			const n = 1000
			rng := rand.New(rand.NewPCG(1, 2))
			w := make([]float32, n)
			for i := range w {
				w[i] = float32(rng.NormFloat64())
			}
			cfg := optim.DefaultConfig()
			cfg.WeightDecay = 0.01
			cpu, err := optim.New(cfg, n)
			if err != nil {
				t.Fatal(err)
			}
			defer cpu.Close()
			hostW := append([]float32(nil), w...)
			alloc := NewAllocator(NewReference())
			a, err := NewAdam(alloc, cfg, w)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			dt := FromFormat(f)
			g, _ := alloc.Alloc(n, dt)
			work, _ := alloc.Alloc(n, dt)
			grad := make([]float32, n)
			for step := 0; step < 5; step++ {
				for i := range grad {
					grad[i] = float32(rng.NormFloat64()) * 512
				}
				round(grad, dt) // what the device gradient holds
				alloc.Device().Upload(g, grad)
				over, sumsq, err := a.Check(g, 1.0/512)
				if err != nil || over {
					t.Fatalf("check: %v %v", over, err)
				}
				want := 0.0
				for _, v := range grad {
					u := float64(round1(v/512, dt))
					want += u * u
				}
				if math.Abs(sumsq-want) > 1e-4*want {
					t.Fatalf("sum of squares %v, want %v", sumsq, want)
				}
				if err := a.Step(g, work, 1e-3, 1); err != nil {
					t.Fatal(err)
				}
				for i := range grad {
					grad[i] = round1(grad[i]/512, dt)
				}
				cpu.Step(hostW, grad, 1e-3, 1)
			}
			master, m, _, err := a.State()
			if err != nil {
				t.Fatal(err)
			}
			for i := range master {
				if math.Float32bits(master[i]) != math.Float32bits(hostW[i]) {
					t.Fatalf("master[%d] = %v, CPU optimizer %v", i, master[i], hostW[i])
				}
			}
			cm := cpu.State()[0].Data
			for i := range m {
				if math.Float32bits(m[i]) != math.Float32bits(cm[i]) {
					t.Fatalf("exp_avg[%d] = %v, CPU %v", i, m[i], cm[i])
				}
			}
			got := make([]float32, n)
			if err := alloc.Device().Download(got, work); err != nil {
				t.Fatal(err)
			}
			for i := range got {
				if got[i] != round1(master[i], dt) {
					t.Fatalf("working weight %d = %v, want the master rounded %v", i, got[i], round1(master[i], dt))
				}
			}
		})
	}
}

func TestAdamOverflowAndRefusals(t *testing.T) {
	alloc := NewAllocator(NewReference())
	a, err := NewAdam(alloc, optim.DefaultConfig(), make([]float32, 4))
	if err != nil {
		t.Fatal(err)
	}
	g, _ := alloc.Alloc(4, F16)
	alloc.Device().Upload(g, []float32{1, float32(math.Inf(1)), 2, 3})
	if over, _, err := a.Check(g, 0.5); err != nil || !over {
		t.Fatalf("an Inf gradient: overflow %v, err %v", over, err)
	}
	cfg := optim.DefaultConfig()
	cfg.Type, cfg.WeightDecay = optim.TypeAdam, 0.1
	if _, err := NewAdam(alloc, cfg, make([]float32, 4)); err == nil {
		t.Fatal("adam with L2 weight decay accepted by the fused kernel")
	}
	if err := a.Step(g.Slice(0, 3), Buf{}, 1e-3, 1); err == nil {
		t.Fatal("a gradient of the wrong length accepted")
	}
}
