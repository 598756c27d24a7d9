package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/trainer"
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
	budgetFor = func(*configs.Config, int) (int64, string) { return 10 << 20, "test" }
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
	budgetFor = func(*configs.Config, int) (int64, string) { return 8 << 30, "test" }
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
		budgetFor = func(*configs.Config, int) (int64, string) { return tc.budget, "test" }
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

// TestMicroBatchFlagNegative: auto is stored as -1, so --micro-batch -1 (or micro_batch: -1
// in the file) used to mean auto. A number below 1 is refused naming the flag or key and the
// value; only the word auto means auto.
func TestMicroBatchFlagNegative(t *testing.T) {
	var m microBatchFlag
	for _, s := range []string{"-1", "-2", "0", "1048577"} {
		if err := m.Set(s); err == nil || !strings.Contains(err.Error(), "train.micro_batch: must be in [1, 1048576] or auto, got "+s) {
			t.Errorf("Set(%q): %v", s, err)
		}
	}
	if err := m.Set("auto"); err != nil || int(m) != trainer.AutoMicroBatch || m.String() != "auto" {
		t.Errorf("Set(auto): %v, %d", err, m)
	}
	if err := m.Set("32"); err != nil || m != 32 {
		t.Errorf("Set(32): %v, %d", err, m)
	}
	code, out, errs := runQVD(t, "config", "--micro-batch", "-1", "--effective-batch", "64")
	if code != exitUsage || !strings.Contains(errs, `invalid value "-1" for flag -micro-batch: train.micro_batch: must be in [1, 1048576] or auto, got -1`) || strings.Contains(errs, "auto chose") {
		t.Errorf("--micro-batch -1: exit %d\n%s\n%s", code, out, errs)
	}
	path := filepath.Join(t.TempDir(), "neg.yaml")
	if err := os.WriteFile(path, []byte("train:\n  micro_batch: -1\n  effective_batch: 64\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errs = runQVD(t, "config", "-c", path)
	if code != exitUsage || !strings.Contains(errs, "train.micro_batch (line 2): must be a positive number or auto, got -1") {
		t.Errorf("micro_batch: -1: exit %d\n%s\n%s", code, out, errs)
	}
}

// TestAutoMicroBudgetNotAboveCgroup: on the CPU, memory.limit is only the Go runtime's soft
// limit; where the memory the process can have (the cgroup's limit less its working set,
// inside a container) is less, the auto budget is that, and errors say where it comes from.
func TestAutoMicroBudgetNotAboveCgroup(t *testing.T) {
	old := budgetFor
	defer func() { budgetFor = old }()
	budgetFor = func(*configs.Config, int) (int64, string) {
		return 4 << 20, "cgroup /sys/fs/cgroup: limit 256.0 MiB, working set 250.0 MiB, available 6.0 MiB"
	}
	c, err := configs.Parse([]byte("model: {type: cnn, channels: [16, 32], hidden: [128]}\ntrain: {micro_batch: auto, effective_batch: 96}\nmemory: {limit: 8GiB}\n"), "test")
	if err != nil {
		t.Fatal(err)
	}
	_, err = resolveAutoMicro(&c, 1)
	if err == nil || !strings.Contains(err.Error(), " per worker, from cgroup /sys/fs/cgroup: limit 256.0 MiB") || !strings.Contains(err.Error(), "below memory.limit 8GiB") {
		t.Fatalf("memory.limit 8GiB in a cgroup with 4 MiB left: %v", err)
	}
	// The live figure names the limit that applies here.
	budget, from := old(&c, 2)
	if budget <= 0 || !(strings.HasPrefix(from, "host: ") || strings.HasPrefix(from, "cgroup ")) || !strings.HasSuffix(from, "shared by 2 worker(s)") {
		t.Errorf("budgetFor: %d, %q", budget, from)
	}
	t.Logf("budget here: %d per worker (%s)", budget, from)
}
