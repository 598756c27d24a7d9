package trainer

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cpu"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/model"
)

// cpuModel makes testRun build the native engine on the CPU backend (the default).
func cpuModel(r testRun) func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
	return func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
		t.Helper()
		dev := cpu.New(cpu.Options{Threads: 2})
		alloc := engine.NewAllocator(dev)
		n, err := engine.NewNet(alloc, spec, layout, params,
			engine.Options{MicroBatch: r.cfg.MicroBatch, EvalBatch: r.cfg.EvalBatch, Precision: r.cfg.Format()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close(); alloc.Close(); dev.Close() })
		return n
	}
}

// gorgoniaModel makes testRun build the gorgonia engine (the oracle).
func gorgoniaModel(r testRun) func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
	return func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
		t.Helper()
		n, err := model.New(spec, layout, params, model.Options{MicroBatch: r.cfg.MicroBatch, EvalBatch: r.cfg.EvalBatch, Grad: r.cfg.Format()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
}

// gpuModel makes testRun build the GPU engine over the reference device.
func gpuModel(r testRun) func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
	return func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
		t.Helper()
		n, err := engine.NewNet(engine.NewAllocator(engine.NewReference()), spec, layout, params,
			engine.Options{MicroBatch: r.cfg.MicroBatch, EvalBatch: r.cfg.EvalBatch, Precision: r.cfg.Format()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
}

// TestDeviceStepMatchesHostStep: the GPU engine with the optimizer on the device (stage 0,
// no offload: gradient accumulation, unscale + overflow check, clipping and the fused AdamW
// all on the device) takes the steps the CPU engine with the host optimizer takes; with
// offload the GPU engine steps on the host instead, and matches too.
func TestDeviceStepMatchesHostStep(t *testing.T) {
	for _, tc := range []struct {
		name    string
		prec    string
		offload bool
		tol     float64
	}{{"fp32", "fp32", false, 2e-6}, {"fp32-offload", "fp32", true, 2e-6}, {"bf16", "bf16", false, 5e-3}, {"fp16", "fp16", false, 2e-3}} {
		t.Run(tc.name, func(t *testing.T) {
			base := defaultRun()
			base.cfg.Precision = tc.prec
			base.cfg.MicroBatch, base.cfg.Accum = 16, 2
			base.cfg.MaxGradNorm = 0.5
			base.cfg.MaxSteps = 9
			// fp16: a huge initial scale overflows in the first steps, so skipping and backing
			// off must happen alike on the device.
			base.scaler.InitialScalePower, base.scaler.Window = 22, 4
			if tc.prec == "fp16" {
				base.cfg.MaxSteps = 20
			}
			if tc.offload {
				base.zero.OffloadOptimizer.Device = "cpu"
			}
			host := &recorder{}
			th := base.build(t, host, nil)
			rh, err := th.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			g := base
			g.newModel = gpuModel(g)
			dev := &recorder{}
			td := g.build(t, dev, nil)
			if onDevice(td) == tc.offload {
				t.Fatalf("device step on = %v with offload %v", onDevice(td), tc.offload)
			}
			rd, err := td.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if rh.Steps != rd.Steps || rh.Skipped != rd.Skipped || rh.OptimizerSteps != rd.OptimizerSteps {
				t.Fatalf("host run %d steps (%d skipped, %d optimizer), device %d (%d, %d)", rh.Steps, rh.Skipped, rh.OptimizerSteps, rd.Steps, rd.Skipped, rd.OptimizerSteps)
			}
			if tc.prec == "fp16" && (rd.Skipped == 0 || rd.OptimizerSteps < 5) {
				t.Fatalf("fp16 run: %d skipped, %d optimizer steps: the overflow path or training was not exercised", rd.Skipped, rd.OptimizerSteps)
			}
			d, at := maxAbsDiff(th.Master(), td.Master())
			t.Logf("max |master_host - master_device| = %.3g (at %d)", d, at)
			if d > tc.tol {
				t.Fatalf("master weights differ by %g at %d", d, at)
			}
			moved, _ := maxAbsDiff(td.Master(), g.build(t, nil, nil).Master())
			if moved < 1e-3 {
				t.Fatalf("weights barely moved (%g)", moved)
			}
			// The host copy of the working weights was brought back at the end.
			if d, _ := maxAbsDiff(td.w.params[td.layout.Frozen:], td.Master()); tc.prec == "fp32" && d != 0 {
				t.Fatalf("working weights on the host are stale: %g from the master", d)
			}
		})
	}
}

// TestDeviceStepResume: a device-step run interrupted and resumed from its checkpoint ends
// with the uninterrupted run's weights bit for bit (the device state goes into the checkpoint
// and comes back).
func TestDeviceStepResume(t *testing.T) {
	r := defaultRun()
	r.cfg.Precision = "bf16"
	r.cfg.MicroBatch, r.cfg.Accum = 16, 2
	r.cfg.MaxSteps = 11
	r.newModel = gpuModel(r)
	tf := r.build(t, nil, nil)
	if _, err := tf.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.ckptDir = t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	first := &recorder{after: func(rec metrics.Record) {
		if rec.Kind == metrics.KindTrain && rec.Step == 6 {
			cancel()
		}
	}}
	if res, err := r.build(t, first, nil).Run(ctx); !errors.Is(err, context.Canceled) || res.Steps != 6 {
		t.Fatalf("interrupted run: %v at step %d", err, res.Steps)
	}
	ck, _, err := checkpoint.Resolve("auto", r.ckptDir)
	if err != nil {
		t.Fatal(err)
	}
	tr := r.build(t, nil, ck)
	if !onDevice(tr) {
		t.Fatal("the resumed run does not step on the device")
	}
	if _, err := tr.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if d, at := maxAbsDiff(tf.Master(), tr.Master()); d != 0 {
		t.Fatalf("final weights differ by %g at %d after resume", d, at)
	}
}

// TestDeviceStepGroup: two ranks stepping on their devices (the gradient averaged through
// the in-process ring, staged through host memory) match one worker with twice the
// micro-batch, and end bit-identical to each other.
func TestDeviceStepGroup(t *testing.T) {
	one := defaultRun()
	one.cfg.MicroBatch, one.cfg.MaxSteps = 32, 7
	one.newModel = gpuModel(one)
	t1 := one.build(t, nil, nil)
	if _, err := t1.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	two := one
	two.cfg.MicroBatch = 16
	two.newModel = gpuModel(two)
	ts, _ := two.group(t, 2, nil, nil)
	if !onDevice(ts[0]) || !onDevice(ts[1]) {
		t.Fatal("the ranks do not step on the device")
	}
	_, errs := runAll(context.Background(), ts)
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if d, _ := maxAbsDiff(ts[0].Master(), ts[1].Master()); d != 0 {
		t.Fatalf("ranks differ by %g", d)
	}
	if d, at := maxAbsDiff(t1.Master(), ts[0].Master()); d > 2e-6 {
		t.Fatalf("two ranks differ from one worker by %g at %d", d, at)
	}
}

// TestDeviceStepOutOfMemory: micro-batches whose device allocations fail are skipped (the
// trainer's out-of-memory path), including the first of a step, whose gradient must then not
// be mixed into the next one's; the run goes on and ends near the run without failures.
func TestDeviceStepOutOfMemory(t *testing.T) {
	r := defaultRun()
	r.cfg.MicroBatch, r.cfg.Accum = 16, 2
	r.cfg.MaxSteps = 10
	var alloc *engine.Allocator
	r.newModel = func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
		alloc = engine.NewAllocator(engine.NewReference())
		n, err := engine.NewNet(alloc, spec, layout, params, engine.Options{MicroBatch: r.cfg.MicroBatch, EvalBatch: r.cfg.EvalBatch, Precision: r.cfg.Format()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
	rec := &recorder{after: func(m metrics.Record) {
		if m.Kind == metrics.KindTrain && (m.Step == 3 || m.Step == 6) {
			alloc.FailAfter(1) // the first allocation of the next micro-batch: the step's first
		}
	}}
	tr := r.build(t, rec, nil)
	if !onDevice(tr) {
		t.Fatal("not stepping on the device")
	}
	res, err := tr.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res.SkippedMicroBatches != 2 || res.Steps != 10 {
		t.Fatalf("%d micro-batches skipped in %d steps, want 2 in 10", res.SkippedMicroBatches, res.Steps)
	}
	for _, m := range rec.recs {
		if m.Kind == metrics.KindTrain && (math.IsNaN(m.Loss) || math.IsInf(m.Loss, 0) || m.Loss > 20) {
			t.Fatalf("step %d: loss %v", m.Step, m.Loss)
		}
	}
	clean := r
	clean.newModel = gpuModel(clean)
	base, err := clean.build(t, nil, nil).Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("last loss %.4f with two micro-batches lost, %.4f without", res.LastLoss, base.LastLoss)
	if math.Abs(res.LastLoss-base.LastLoss) > 0.2*base.LastLoss {
		t.Fatalf("last loss %.4f, %.4f without the failures", res.LastLoss, base.LastLoss)
	}
}

// TestEnginesAgree: the native engine on the CPU backend (the default) and the gorgonia
// engine (the oracle) train the shipped model shapes alike: the same losses step by step and
// the same weights at the end, within float tolerance — with accumulation, clipping and, for
// the CNN, ZeRO stage 2's streamed buckets.
func TestEnginesAgree(t *testing.T) {
	for _, tc := range []struct {
		name  string
		model model.Config
		stage int
		tol   float64
	}{
		{"mlp", model.Config{Type: model.TypeMLP, Hidden: []int{32, 16}}, 0, 2e-6},
		{"cnn", model.Config{Type: model.TypeCNN, Channels: []int{4, 6}, Kernel: 3, Hidden: []int{12}}, 0, 2e-6},
		{"cnn-stage2", model.Config{Type: model.TypeCNN, Channels: []int{4, 6}, Kernel: 3, Hidden: []int{12}}, 2, 2e-6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := defaultRun()
			r.model = tc.model
			r.zero.Stage = tc.stage
			r.cfg.MicroBatch, r.cfg.Accum, r.cfg.MaxGradNorm, r.cfg.MaxSteps = 16, 2, 0.5, 8
			g := r
			g.newModel = gorgoniaModel(g)
			hg, hn := &recorder{}, &recorder{}
			tg, tn := g.build(t, hg, nil), r.build(t, hn, nil)
			rg, err := tg.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			rn, err := tn.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if rg.Steps != rn.Steps || rg.OptimizerSteps != rn.OptimizerSteps {
				t.Fatalf("gorgonia %d steps (%d optimizer), native %d (%d)", rg.Steps, rg.OptimizerSteps, rn.Steps, rn.OptimizerSteps)
			}
			lg, ln := hg.trainLosses(), hn.trainLosses()
			for s, l := range lg {
				if math.Abs(l-ln[s]) > 1e-5*math.Max(1, math.Abs(l)) {
					t.Errorf("step %d: loss %v on gorgonia, %v native", s, l, ln[s])
				}
			}
			d, at := maxAbsDiff(tg.Master(), tn.Master())
			moved, _ := maxAbsDiff(tg.Master(), g.build(t, nil, nil).Master())
			t.Logf("max |w_gorgonia - w_native| = %.3g (at %d); the weights moved up to %.3g", d, at, moved)
			if d > tc.tol || moved < 1e-3 {
				t.Fatalf("weights differ by %.3g (tolerance %.3g), moved %.3g", d, tc.tol, moved)
			}
		})
	}
}

// onDevice reports whether tr steps on its model's device.
func onDevice(tr *Trainer) bool {
	_, ok := tr.stepper.(*deviceStep)
	return ok
}
