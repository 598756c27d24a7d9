package main

import (
	"strings"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
)

// TestAutoMicroBatch: micro_batch: auto keeps the effective batch exactly, takes the largest
// micro-batch the budget allows, and fails clearly when it cannot.
func TestAutoMicroBatch(t *testing.T) {
	old := budgetFor
	defer func() { budgetFor = old }()
	load := func() configs.Config {
		c, err := configs.Parse([]byte("model: {type: cnn, channels: [16, 32], hidden: [128]}\ntrain: {micro_batch: auto, effective_batch: 96}\n"), "test")
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// A budget of 10 MiB per worker: after the CNN's model states (~3.3 MB), its activations
	// (~0.2 MiB per sample on the native engine) allow a micro-batch in the tens, not 48.
	budgetFor = func(*configs.Config, int) int64 { return 10 << 20 }
	for _, world := range []int{1, 2, 3} {
		c := load()
		a, err := resolveAutoMicro(&c, world)
		if err != nil {
			t.Fatalf("world %d: %v", world, err)
		}
		if m, k := c.Train.MicroBatch, c.Train.Accum; m*k*world != 96 || m < 1 {
			t.Fatalf("world %d: micro %d × accum %d × %d != 96", world, m, k, world)
		}
		if c.Train.MicroBatch == 96/world {
			t.Fatalf("world %d: a 10 MiB budget allowed the whole per-worker batch (%d)", world, c.Train.MicroBatch)
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("world %d: resolved config does not validate: %v", world, err)
		}
		t.Logf("world %d: micro %d × accum %d (states %d B, %d B per sample, heap at probe %d B, tried %v)",
			world, a.micro, a.accum, a.states, a.perSample, a.probed, a.tried)
	}
	// With a generous budget the whole per-worker batch is one micro-batch.
	budgetFor = func(*configs.Config, int) int64 { return 8 << 30 }
	c := load()
	if _, err := resolveAutoMicro(&c, 2); err != nil || c.Train.MicroBatch != 48 || c.Train.Accum != 1 {
		t.Fatalf("8 GiB: micro %d accum %d, %v", c.Train.MicroBatch, c.Train.Accum, err)
	}
	for name, tc := range map[string]struct {
		budget int64
		world  int
		want   string
	}{
		"not divisible": {8 << 30, 5, "not a multiple of the 5 workers"},
		"too small":     {4 << 20, 1, "budget"},
	} {
		budgetFor = func(*configs.Config, int) int64 { return tc.budget }
		c := load()
		if _, err := resolveAutoMicro(&c, tc.world); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v (want an error saying %q)", name, err, tc.want)
		}
	}
	c = load()
	c.Train.EffectiveBatch = 0
	if _, err := resolveAutoMicro(&c, 1); err == nil || !strings.Contains(err.Error(), "effective_batch") {
		t.Errorf("auto without effective_batch: %v", err)
	}
	// At the command line, with this machine's memory as the budget.
	budgetFor = old
	code, _, errs := runQVD(t, "config", "--micro-batch", "auto")
	if code != exitUsage || !strings.Contains(errs, "effective_batch") {
		t.Errorf("--micro-batch auto alone: exit %d, %s", code, errs)
	}
	code, out, errs := runQVD(t, "config", "--micro-batch", "auto", "--effective-batch", "64")
	if code != exitOK || !strings.Contains(errs, "micro_batch: auto chose") || !strings.Contains(out, "micro_batch: 64") {
		t.Errorf("--micro-batch auto --effective-batch 64: exit %d\n%s\n%s", code, out, errs)
	}
}

// TestAutoMicroBatchGPU: with the GPU engine, micro_batch: auto measures the device
// allocator's peak (weights, gradient, activations) against the device's memory — here a
// 24 MiB reference device, on which the CNN's whole per-worker batch does not fit.
func TestAutoMicroBatchGPU(t *testing.T) {
	const limit = 24 << 20
	engine.Register("reference", func(int) (engine.Device, error) { return engine.NewReferenceLimit(limit), nil }, func() (int, error) { return 1, nil })
	defer engine.Register("reference", func(int) (engine.Device, error) { return engine.NewReference(), nil }, func() (int, error) { return 1, nil })
	c, err := configs.Parse([]byte("model: {type: cnn, channels: [16, 32], hidden: [128]}\ntrain: {micro_batch: auto, effective_batch: 96}\ndevice: {type: reference}\n"), "test")
	if err != nil {
		t.Fatal(err)
	}
	a, err := resolveAutoMicro(&c, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("micro %d × accum %d: %d B per sample on the device, peak %d B at the chosen micro-batch, budget %d B, tried %v",
		a.micro, a.accum, a.perSample, a.probed, a.budget, a.tried)
	if a.micro*a.accum != 96 || a.micro == 96 || a.budget != limit {
		t.Fatalf("micro %d × accum %d (budget %d): want a split of 96 below 96 within %d", a.micro, a.accum, a.budget, limit)
	}
	if a.probed > limit {
		t.Fatalf("the chosen micro-batch peaks at %d B on a %d B device", a.probed, limit)
	}
}
