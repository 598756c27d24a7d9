package trainer

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// synthetic makes a learnable dataset of n 1×8×8 images in 4 classes: each class has its own
// pattern, plus noise.
func synthetic(n int, seed uint64) *data.Dataset {
	const side, classes = 8, 4
	rng := rand.New(rand.NewPCG(seed, 2))
	patterns := make([][]float64, classes)
	for c := range patterns {
		patterns[c] = make([]float64, side*side)
		for i := range patterns[c] {
			patterns[c][i] = rng.Float64() * 255
		}
	}
	d := &data.Dataset{Name: "synthetic", N: n, C: 1, H: side, W: side, Classes: classes,
		Images: make([]uint8, n*side*side), Labels: make([]uint8, n)}
	for s := 0; s < n; s++ {
		c := rng.IntN(classes)
		d.Labels[s] = uint8(c)
		for i := 0; i < side*side; i++ {
			v := patterns[c][i] + rng.NormFloat64()*60
			d.Images[s*side*side+i] = uint8(math.Max(0, math.Min(255, v)))
		}
	}
	return d
}

// recorder is a MetricsSink that keeps the records and can run a hook after each one.
type recorder struct {
	mu    sync.Mutex
	recs  []metrics.Record
	after func(metrics.Record)
}

func (r *recorder) Write(rec metrics.Record) error {
	r.mu.Lock()
	r.recs = append(r.recs, rec)
	r.mu.Unlock()
	if r.after != nil {
		r.after(rec)
	}
	return nil
}

// trainLosses maps step → loss of the train records.
func (r *recorder) trainLosses() map[int64]float64 {
	out := map[int64]float64{}
	for _, rec := range r.recs {
		if rec.Kind == metrics.KindTrain {
			out[rec.Step] = rec.Loss
		}
	}
	return out
}

type testRun struct {
	cfg        Config
	opt        optim.Config
	zero       zero.Config
	sched      ScheduleConfig
	scaler     ScalerConfig
	model      model.Config
	seed       uint64
	ckptDir    string
	everySteps int
	train      *data.Dataset
	test       *data.Dataset
	val        *data.Dataset // nil: no validation split
	// freeze, if set, freezes these tensors (model.NewLayoutFrozen).
	freeze func(name string) bool
	// prepare may edit the initial parameters before the trainer is built.
	prepare func(l *model.Layout, params []float32)
	// newModel, if set, builds the model instead of the gorgonia engine (the GPU engine).
	newModel func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model
}

func defaultRun() testRun {
	opt := optim.DefaultConfig()
	opt.Threads = 2
	z := zero.DefaultConfig()
	// Small buckets, so the reductions run as several collective calls.
	z.ReduceBucketSize, z.AllgatherBucketSize = 1000, 700
	return testRun{
		zero:   z,
		cfg:    Config{Epochs: 3, MicroBatch: 32, Accum: 1, Precision: "fp32", EvalBatch: 50, Threads: 2},
		opt:    opt,
		sched:  ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 3, WarmupType: "linear", MinRatio: 0.1},
		scaler: DefaultScalerConfig(),
		model:  model.Config{Type: model.TypeMLP, Hidden: []int{32, 16}},
		seed:   11,
		train:  synthetic(160, 1),
		test:   synthetic(100, 2),
	}
}

func (r testRun) build(t *testing.T, sink MetricsSink, resume *checkpoint.Checkpoint) *Trainer {
	t.Helper()
	return r.buildWith(t, sink, resume, nil)
}

func (r testRun) buildWith(t *testing.T, sink MetricsSink, resume *checkpoint.Checkpoint, comm collective.Communicator) *Trainer {
	t.Helper()
	spec, err := model.NewSpec(r.model, []int{1, 8, 8}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayoutFrozen(spec, r.freeze)
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, r.seed)
	if r.prepare != nil {
		r.prepare(layout, params)
	}
	newModel := r.newModel
	if newModel == nil {
		newModel = cpuModel(r)
	}
	net := newModel(t, spec, layout, params)
	ck := checkpoint.Config{Dir: r.ckptDir, EverySteps: r.everySteps, Keep: 0}
	tr, err := New(Setup{
		Config: r.cfg, Schedule: r.sched, Scaler: r.scaler, Optimizer: r.opt, Zero: r.zero, Checkpoint: ck, Seed: r.seed,
		Model: net, Train: r.train, Test: r.test, Val: r.val, Normalize: data.Normalize{Mean: 0.5, Std: 0.25},
		Resume: resume, Metrics: sink, Comm: comm,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

func maxAbsDiff(a, b []float32) (float64, int) {
	worst, at := 0.0, -1
	for i := range a {
		if d := math.Abs(float64(a[i]) - float64(b[i])); d > worst || math.IsNaN(d) {
			worst, at = d, i
		}
	}
	return worst, at
}

// TestAccumulationEquivalence: micro 8 × accum 4 takes the same steps as micro 32 × accum 1
// (the same 32 samples per step, the loss divided by accum).
func TestAccumulationEquivalence(t *testing.T) {
	for _, opt := range []string{"sgd", "adamw"} {
		t.Run(opt, func(t *testing.T) {
			base := defaultRun()
			base.opt.Type = opt
			if opt == "sgd" {
				base.opt.LR, base.opt.Momentum = 0.05, 0.9
			}
			base.cfg.MaxSteps = 8
			a := base
			a.cfg.MicroBatch, a.cfg.Accum = 32, 1
			b := base
			b.cfg.MicroBatch, b.cfg.Accum = 8, 4
			ta, tb := a.build(t, nil, nil), b.build(t, nil, nil)
			ra, err := ta.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			rb, err := tb.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if ra.Steps != 8 || rb.Steps != 8 {
				t.Fatalf("steps %d and %d, want 8", ra.Steps, rb.Steps)
			}
			diff, at := maxAbsDiff(ta.Master(), tb.Master())
			// Summation order differs (one 32-row reduction vs four 8-row ones), nothing else.
			if diff > 2e-5 {
				t.Fatalf("weights differ by %g at %d after 8 steps", diff, at)
			}
			moved, _ := maxAbsDiff(ta.Master(), a.build(t, nil, nil).Master())
			if moved < 1e-3 {
				t.Fatalf("weights barely moved (%g): the test would pass for a trainer that does nothing", moved)
			}
			if math.Abs(ra.LastLoss-rb.LastLoss) > 1e-5 {
				t.Fatalf("last loss %v vs %v", ra.LastLoss, rb.LastLoss)
			}
		})
	}
}

// TestExactResume interrupts a run (as SIGINT would), resumes from the checkpoint it wrote,
// and checks that every later step's loss and the final weights equal the uninterrupted
// run's exactly — across an epoch boundary, and with fp16 loss-scaler state.
func TestExactResume(t *testing.T) {
	for _, prec := range []string{"fp32", "fp16", "bf16"} {
		t.Run(prec, func(t *testing.T) {
			r := defaultRun()
			r.cfg.Precision = prec
			r.cfg.MicroBatch, r.cfg.Accum = 16, 2
			r.cfg.MaxGradNorm = 0.5
			// An absurd initial scale makes fp16 overflow and back off in the first steps, so
			// the scaler's state and the skipped steps are part of what must resume exactly.
			r.scaler.InitialScalePower, r.scaler.Window = 40, 4
			const total = 13 // 5 steps per epoch: crosses two epoch boundaries
			r.cfg.MaxSteps = total

			full := &recorder{}
			tf := r.build(t, full, nil)
			if _, err := tf.Run(context.Background()); err != nil {
				t.Fatal(err)
			}

			r.ckptDir = t.TempDir()
			const stopAfter = 7
			ctx, cancel := context.WithCancel(context.Background())
			first := &recorder{after: func(rec metrics.Record) {
				if rec.Kind == metrics.KindTrain && rec.Step == stopAfter {
					cancel()
				}
			}}
			res, err := r.build(t, first, nil).Run(ctx)
			if !errors.Is(err, context.Canceled) || !res.Interrupted || res.Steps != stopAfter {
				t.Fatalf("interrupted run: err=%v interrupted=%v steps=%d", err, res.Interrupted, res.Steps)
			}
			ck, skipped, err := checkpoint.Resolve("auto", r.ckptDir)
			if err != nil || len(skipped) > 0 {
				t.Fatalf("resolve: %v %v", err, skipped)
			}
			if ck.Step() != stopAfter {
				t.Fatalf("checkpoint at step %d, want %d", ck.Step(), stopAfter)
			}
			second := &recorder{}
			tr := r.build(t, second, ck)
			if _, err := tr.Run(context.Background()); err != nil {
				t.Fatal(err)
			}
			want, got := full.trainLosses(), second.trainLosses()
			if len(got) != total-stopAfter {
				t.Fatalf("resumed run logged %d steps, want %d", len(got), total-stopAfter)
			}
			for s := int64(stopAfter + 1); s <= total; s++ {
				if got[s] != want[s] {
					t.Errorf("step %d: loss %v after resume, %v uninterrupted", s, got[s], want[s])
				}
			}
			if d, at := maxAbsDiff(tf.Master(), tr.Master()); d != 0 {
				t.Fatalf("final weights differ by %g at %d", d, at)
			}
			if prec == "fp16" {
				skips := 0
				for _, rec := range full.recs {
					if rec.Skipped {
						skips++
					}
				}
				if skips == 0 {
					t.Fatal("fp16 run never overflowed: the scaler state was not exercised")
				}
			}
		})
	}
}

// tinyLoss makes the classifier so sure of class 0 (a logit margin of 20) that the true
// gradients are ~2e-9: below fp16's smallest subnormal (6e-8), normal once scaled by 2^16.
// The classifier's weights are zeroed so every sample's logits are exactly the bias.
func tinyLoss(l *model.Layout, params []float32) {
	w, b := l.Tensors[len(l.Tensors)-2], l.Tensors[len(l.Tensors)-1]
	clear(params[w.Offset : w.Offset+w.Size])
	params[b.Offset] = 20
}

func allZeroLabels(d *data.Dataset) *data.Dataset {
	clear(d.Labels)
	return d
}

// TestFP16LossScalingPreventsUnderflow: gradients that underflow to zero in fp16 without
// scaling train the model with the dynamic loss scale.
func TestFP16LossScalingPreventsUnderflow(t *testing.T) {
	run := func(lossScale float64) (before, after []float32) {
		r := defaultRun()
		r.cfg.Precision = "fp16"
		r.cfg.MaxSteps = 3
		r.opt.Type, r.opt.LR, r.opt.Momentum, r.opt.WeightDecay = "sgd", 1e3, 0, 0
		r.scaler.LossScale = lossScale
		r.train, r.test = allZeroLabels(synthetic(160, 1)), allZeroLabels(synthetic(100, 2))
		r.prepare = tinyLoss
		tr := r.build(t, nil, nil)
		before = append([]float32(nil), tr.Master()...)
		res, err := tr.Run(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res.Skipped != 0 {
			t.Fatalf("loss scale %v: %d steps skipped", lossScale, res.Skipped)
		}
		return before, tr.Master()
	}
	b1, a1 := run(1) // static scale 1: every gradient underflows
	if d, at := maxAbsDiff(b1, a1); d != 0 {
		t.Fatalf("unscaled fp16 gradients should all underflow to zero, but weights moved by %g at %d", d, at)
	}
	b2, a2 := run(0) // dynamic: 2^16
	if d, _ := maxAbsDiff(b2, a2); d == 0 {
		t.Fatal("with loss scaling the gradients still underflowed")
	}
}

// TestGradientClipping: with plain SGD (lr 1) the update is the clipped gradient, whose
// norm must be max_grad_norm.
func TestGradientClipping(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 1
	r.cfg.MaxGradNorm = 1e-3
	r.opt.Type, r.opt.LR, r.opt.Momentum, r.opt.WeightDecay = "sgd", 1, 0, 0
	r.sched = DefaultScheduleConfig()
	rec := &recorder{}
	tr := r.build(t, rec, nil)
	before := append([]float32(nil), tr.Master()...)
	if _, err := tr.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	var sq float64
	for i, v := range tr.Master() {
		d := float64(v) - float64(before[i])
		sq += d * d
	}
	if norm := math.Sqrt(sq); math.Abs(norm-1e-3) > 1e-5 {
		t.Fatalf("update norm %g, want the clip threshold 1e-3", norm)
	}
	if g := rec.recs[0].GradNorm; !(g > 1e-3) {
		t.Fatalf("recorded grad norm %g should be the unclipped norm (> 1e-3)", g)
	}
}

// TestDivergenceIsAnError: a NaN gradient in fp32 stops the run with a clear error.
func TestDivergenceIsAnError(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 2
	r.prepare = func(l *model.Layout, p []float32) { p[l.Tensors[0].Offset] = float32(math.NaN()) }
	_, err := r.build(t, nil, nil).Run(context.Background())
	if err == nil {
		t.Fatal("NaN weights trained without error")
	}
}

// TestResumeRefusesCorruptCheckpoint: a truncated model file is detected by checksum.
func TestResumeRefusesCorruptCheckpoint(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 2
	r.ckptDir = t.TempDir()
	if _, err := r.build(t, nil, nil).Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(r.ckptDir, checkpoint.StepDirName(2))
	truncate(t, filepath.Join(path, "model.safetensors"))
	_, err := checkpoint.Open(path)
	if !errors.Is(err, checkpoint.ErrCorrupt) {
		t.Fatalf("want ErrCorrupt, got %v", err)
	}
}

func truncate(t *testing.T, path string) {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, st.Size()/2); err != nil {
		t.Fatal(err)
	}
}
