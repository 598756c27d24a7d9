package trainer

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/model"
)

// TestFreeze: frozen tensors keep their initial values bit for bit, hold no gradient, no
// optimizer state and no share of ZeRO's partition, while the rest trains — alone and as a
// ZeRO-2 group matching the single worker — and checkpoints resume only with the same freeze.
func TestFreeze(t *testing.T) {
	freezeFC1 := func(name string) bool { return strings.HasPrefix(name, "fc1.") }
	base := defaultRun()
	base.freeze = freezeFC1
	base.cfg.MaxSteps = 6
	base.opt.Type, base.opt.LR, base.opt.Momentum = "sgd", 0.05, 0.9

	single := base
	single.cfg.MicroBatch = 16
	tr := single.build(t, nil, nil)
	lay := tr.layout
	if lay.Frozen == 0 || !lay.Tensors[0].Frozen || lay.Tensors[0].Name != "fc1.weight" {
		t.Fatalf("layout: frozen prefix %d, first tensor %+v", lay.Frozen, lay.Tensors[0])
	}
	initial := append([]float32(nil), tr.w.params...)
	if _, err := tr.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < lay.Frozen; i++ {
		if tr.w.params[i] != initial[i] {
			t.Fatalf("frozen element %d changed: %v -> %v", i, initial[i], tr.w.params[i])
		}
	}
	if d, _ := maxAbsDiff(initial[lay.Frozen:], tr.w.params[lay.Frozen:]); d < 1e-4 {
		t.Fatalf("the trainable part barely moved (%g)", d)
	}
	m := tr.Memory()
	if want := int64(4 * lay.Trainable()); m.Device.Grads != want || m.Device.Optimizer != want || m.Device.Params != want {
		t.Fatalf("engine holds %+v; want gradients, momentum and parameters of the %d trainable elements only", m.Device, lay.Trainable())
	}
	if rec := tr.memoryRecord(); rec["device_frozen_params"] != int64(4*lay.Frozen) {
		t.Fatalf("frozen parameters not accounted: %v", rec)
	}

	// Two ranks at ZeRO stage 2: the same weights as the single worker, frozen part intact.
	grp := base
	grp.cfg.MicroBatch = 8
	grp.zero.Stage = 2
	trainers, _ := grp.group(t, 2, nil, nil)
	if _, errs := runAll(context.Background(), trainers); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	if d, at := maxAbsDiff(tr.w.params, trainers[1].w.params); d > 1e-6 {
		t.Fatalf("ZeRO-2 group differs from the single worker by %g at %d", d, at)
	}
	if lo, hi := trainers[1].eng.Shard(); hi > lay.Trainable() || hi-lo > lay.Trainable()/2+16 {
		t.Fatalf("rank 1's shard [%d, %d) is not half of the %d trainable elements", lo, hi, lay.Trainable())
	}

	// Checkpoint and resume with the same freeze; another freeze is refused, naming it.
	ck := base
	ck.cfg.MicroBatch = 16
	ck.ckptDir = t.TempDir()
	if _, err := ck.build(t, nil, nil).Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	c, _, err := checkpoint.Resolve("auto", ck.ckptDir)
	if err != nil {
		t.Fatal(err)
	}
	more := ck
	more.cfg.MaxSteps = 8
	if _, err := more.build(t, nil, c).Run(context.Background()); err != nil {
		t.Fatalf("resume with the same freeze: %v", err)
	}
	other := ck
	other.freeze = nil
	spec, _ := model.NewSpec(other.model, []int{1, 8, 8}, 4)
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	net, _ := model.New(spec, layout, params, model.Options{MicroBatch: 16, EvalBatch: other.cfg.EvalBatch, Grad: other.cfg.Format()})
	defer net.Close()
	_, err = New(Setup{Config: other.cfg, Schedule: other.sched, Scaler: other.scaler, Optimizer: other.opt, Zero: other.zero, Seed: other.seed,
		Model: net, Train: other.train, Test: other.test, Resume: c})
	if err == nil || !strings.Contains(err.Error(), "frozen") {
		t.Fatalf("resuming a frozen run without the freeze: %v", err)
	}
}
