package zero_test

import (
	"testing"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// TestEstimateMatchesEngine: for the shipped models, every stage, offload on and off, fp32
// and bf16, 1 to 4 ranks, and AdamW, SGD and 8-bit AdamW, Estimate with 4-byte elements
// equals what the CPU engine allocates on its largest-shard rank, byte for byte.
func TestEstimateMatchesEngine(t *testing.T) {
	pool := offload.NewPool(1)
	defer pool.Close()
	for _, name := range []string{"fashion-mlp", "fashion-cnn"} {
		cfg, err := configs.Load(name)
		if err != nil {
			t.Fatal(err)
		}
		spec, err := model.NewSpec(cfg.Model, []int{1, 28, 28}, 10)
		if err != nil {
			t.Fatal(err)
		}
		n := model.NewLayout(spec).Size
		q8 := cfg.Optimizer
		q8.Type = optim.TypeAdamW8bit
		for _, opt := range []optim.Config{cfg.Optimizer, {Type: "sgd", LR: 0.1, Momentum: 0.9}, q8} {
			for _, f := range []half.Format{half.FP32, half.BF16} {
				for world := 1; world <= 4; world++ {
					for stage := 0; stage <= 2; stage++ {
						for _, off := range []bool{false, true} {
							zc := zero.DefaultConfig()
							zc.Stage, zc.ReduceBucketSize = stage, 50_000
							if off {
								zc.OffloadOptimizer.Device = "cpu"
							}
							l, _ := zero.NewLayout(n, world)
							big := 0
							for r := 1; r < world; r++ {
								if l.Len(r) > l.Len(big) {
									big = r
								}
							}
							e, err := zero.NewEngine(zero.Options{Config: zc, Optimizer: opt, Params: make([]float32, n), Format: f,
								Comm: fakeComm{rank: big, size: world}, Pool: pool})
							if err != nil {
								t.Fatal(err)
							}
							got := e.Memory()
							e.Close()
							state := map[string]int{"adamw": 2, "adam": 2, "sgd": 1, "adamw8bit": 2}[opt.Type]
							want, err := zero.Estimate(zero.Spec{Elems: n, World: world, Stage: stage, Offload: off, ElemBytes: 4,
								FP32: f == half.FP32, StateElems: state, Quantized: opt.Type == optim.TypeAdamW8bit, BucketElems: 50_000})
							if err != nil {
								t.Fatal(err)
							}
							if got != want {
								t.Errorf("%s %s %s N%d stage %d offload %v: engine %+v, estimate %+v", name, opt.Type, f, world, stage, off, got, want)
							}
						}
					}
				}
			}
		}
	}
}

// TestEstimatePaperFormulas: with 2-byte elements and Adam the estimate is the ZeRO paper's
// model-state accounting (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N), plus stage 2's two staging buckets.
func TestEstimatePaperFormulas(t *testing.T) {
	const psi, n, bucket = 1 << 24, 8, 1 << 20
	for stage, want := range []int64{16 * psi, 4*psi + 12*psi/n, 2*psi + 14*psi/n + 2*2*bucket} {
		// Accum 2: the paper's stage 1 keeps the whole gradient (qvd partitions it too when
		// there is nothing to accumulate).
		m, err := zero.Estimate(zero.Spec{Elems: psi, World: n, Stage: stage, ElemBytes: 2, StateElems: 2, BucketElems: bucket, Accum: 2})
		if err != nil {
			t.Fatal(err)
		}
		if m.Host.Total() != 0 || m.Device.Total() != want {
			t.Errorf("stage %d: device %d host %d, want %d (%s)", stage, m.Device.Total(), m.Host.Total(), want, zero.PaperFormula(stage, false))
		}
	}
	m, _ := zero.Estimate(zero.Spec{Elems: psi, World: n, Stage: 2, Offload: true, ElemBytes: 2, StateElems: 2, BucketElems: bucket})
	if m.Device.Params != 2*psi || m.Host.Grads+m.Host.Master+m.Host.Optimizer != 16*psi/n {
		t.Errorf("stage 2 + offload: %+v", m)
	}
	if _, err := zero.Estimate(zero.Spec{Elems: psi, World: 0, ElemBytes: 2}); err == nil {
		t.Error("world 0 accepted")
	}
}

// fakeComm is a communicator that is only asked its rank and size.
type fakeComm struct {
	collective.Communicator
	rank, size int
}

func (c fakeComm) Rank() int { return c.rank }
func (c fakeComm) Size() int { return c.size }

// TestEstimateStage1WithoutAccumulation: at stage 1 with one micro-batch per step the
// gradient is partitioned, so the estimate is stage 2's.
func TestEstimateStage1WithoutAccumulation(t *testing.T) {
	const psi, n, bucket = 1 << 24, 8, 1 << 20
	s1, err1 := zero.Estimate(zero.Spec{Elems: psi, World: n, Stage: 1, ElemBytes: 4, StateElems: 2, BucketElems: bucket, Accum: 1})
	s2, err2 := zero.Estimate(zero.Spec{Elems: psi, World: n, Stage: 2, ElemBytes: 4, StateElems: 2, BucketElems: bucket, Accum: 1})
	if err1 != nil || err2 != nil || s1 != s2 {
		t.Fatalf("stage 1 accum 1 %+v (%v), stage 2 %+v (%v)", s1, err1, s2, err2)
	}
	if !zero.GradPartitioned(1, 1) || zero.GradPartitioned(1, 2) || zero.GradPartitioned(0, 1) || !zero.GradPartitioned(2, 4) {
		t.Fatal("GradPartitioned")
	}
}
