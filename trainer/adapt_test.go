package trainer

import (
	"context"
	"fmt"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
)

// oomModel wraps a Model and fails micro-batches as told, like an allocator that runs out.
type oomModel struct {
	Model
	fail func(micro, call int) bool
	call int
}

func (m *oomModel) ForwardBackward(b *data.Batch, scale float32, sink model.GradSink) (float32, error) {
	m.call++
	if m.fail(m.MicroBatch(), m.call) {
		return 0, fmt.Errorf("allocating activations: %w", memory.ErrOutOfMemory)
	}
	return m.Model.ForwardBackward(b, scale, sink)
}

// buildOOM builds a trainer of r whose model fails as fail says, with Rebuild wired.
func (r testRun) buildOOM(t *testing.T, fail func(micro, call int) bool, after int, mon ...*memory.Monitor) *Trainer {
	t.Helper()
	spec, err := model.NewSpec(r.model, []int{1, 8, 8}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, r.seed)
	calls := 0
	build := func(micro int) (Model, error) {
		net, err := model.New(spec, layout, params, model.Options{MicroBatch: micro, EvalBatch: r.cfg.EvalBatch, Grad: r.cfg.Format()})
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { net.Close() })
		m := &oomModel{Model: net, fail: fail}
		m.call = calls
		return m, nil
	}
	first, err := build(r.cfg.MicroBatch)
	if err != nil {
		t.Fatal(err)
	}
	setup := Setup{
		Config: r.cfg, Schedule: r.sched, Scaler: r.scaler, Optimizer: r.opt, Zero: r.zero, Checkpoint: checkpoint.Config{}, Seed: r.seed,
		Model: first, Train: r.train, Test: r.test, Normalize: data.Normalize{Mean: 0.5, Std: 0.25},
		Rebuild: build, OOMAdaptAfter: after,
	}
	if len(mon) > 0 {
		setup.MemoryMonitor, setup.AdaptOnPressure = mon[0], true
	}
	tr, err := New(setup)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// TestOOMSkip: a micro-batch that runs out of memory is skipped, counted, and the run goes on.
func TestOOMSkip(t *testing.T) {
	for _, stage := range []int{0, 2} {
		r := defaultRun()
		r.zero.Stage = stage
		r.cfg.MicroBatch, r.cfg.Accum, r.cfg.MaxSteps = 8, 2, 6
		tr := r.buildOOM(t, func(_, call int) bool { return call == 3 || call == 8 }, 5)
		res, err := tr.Run(context.Background())
		if err != nil {
			t.Fatalf("stage %d: %v", stage, err)
		}
		if res.SkippedMicroBatches != 2 || res.Steps != 6 || res.MicroBatch != 8 {
			t.Fatalf("stage %d: skipped %d micro-batches in %d steps at micro %d; want 2, 6, 8 (no halving below the threshold)",
				stage, res.SkippedMicroBatches, res.Steps, res.MicroBatch)
		}
	}
}

// TestOOMAdapt: after K consecutive out-of-memory micro-batches the micro-batch is halved and
// accumulation doubled, so the global batch is unchanged, and training goes on without
// further failures at the smaller size — without a restart.
func TestOOMAdapt(t *testing.T) {
	r := defaultRun()
	r.cfg.MicroBatch, r.cfg.Accum, r.cfg.MaxSteps = 16, 1, 8
	global := r.cfg.MicroBatch * r.cfg.Accum
	// "Memory" holds 8 samples: every micro-batch above that fails.
	tr := r.buildOOM(t, func(micro, _ int) bool { return micro > 8 }, 2)
	res, err := tr.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res.MicroBatch != 8 || res.Accum != 2 || res.MicroBatch*res.Accum != global || tr.GlobalBatch() != global {
		t.Fatalf("ended at micro %d × accum %d (global %d), want 8 × 2 = %d", res.MicroBatch, res.Accum, tr.GlobalBatch(), global)
	}
	// The first two steps lost their only micro-batch: no gradient, no optimizer step.
	if res.SkippedMicroBatches != 2 || res.Steps != 8 || res.OptimizerSteps != 6 || res.Skipped != 2 {
		t.Fatalf("skipped %d micro-batches, %d steps (%d optimizer steps, %d skipped); want 2 skipped micro-batches, 8 steps, 6 optimizer steps",
			res.SkippedMicroBatches, res.Steps, res.OptimizerSteps, res.Skipped)
	}
	// An odd micro-batch cannot be halved exactly: the run goes on skipping, and says so.
	r.cfg.MicroBatch = 9
	tr = r.buildOOM(t, func(micro, call int) bool { return call <= 3 }, 2)
	res, err = tr.Run(context.Background())
	if err != nil || res.MicroBatch != 9 || res.SkippedMicroBatches != 3 {
		t.Fatalf("odd micro-batch: %v, micro %d, skipped %d", err, res.MicroBatch, res.SkippedMicroBatches)
	}
}

// TestPressureAdapt: with memory.adapt, host memory pressure (a fake /proc with 1 GiB of 16
// available) halves the micro-batch once, without a restart; the run then takes the same
// steps as one that never adapted, up to the summation order of the gradient.
func TestPressureAdapt(t *testing.T) {
	mon, err := memory.New(memory.Config{LogEvery: 100, MinAvailable: "10%"},
		memory.Options{Host: pressuredHost(t), Device: memory.NoDevices{Reason: "test"}})
	if err != nil {
		t.Fatal(err)
	}
	defer mon.Close()
	r := defaultRun()
	r.opt.Type, r.opt.LR, r.opt.Momentum = "sgd", 0.05, 0.9
	r.cfg.MicroBatch, r.cfg.Accum, r.cfg.MaxSteps = 16, 2, 8
	never := func(int, int) bool { return false }
	plain := r.buildOOM(t, never, 3)
	if _, err := plain.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	adapted := r.buildOOM(t, never, 3, mon)
	res, err := adapted.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res.MicroBatch != 8 || res.Accum != 4 || adapted.GlobalBatch() != 32 {
		t.Fatalf("under pressure: micro %d × accum %d (global %d), want one halving to 8 × 4 = 32", res.MicroBatch, res.Accum, adapted.GlobalBatch())
	}
	d, at := maxAbsDiff(plain.Master(), adapted.Master())
	t.Logf("max weight difference from the run that never adapted: %.3g", d)
	if d > 1e-5 {
		t.Fatalf("adapting changed the run: weights differ by %g at %d", d, at)
	}
}
