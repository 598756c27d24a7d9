package job

import (
	"strings"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
)

// TestAutoMicroBatch: micro_batch: auto keeps the effective batch exactly, takes the largest
// micro-batch the budget allows, and fails clearly when it cannot.
func TestAutoMicroBatch(t *testing.T) {
	load := func() configs.Config {
		c, err := configs.Parse([]byte("model: {type: cnn, channels: [16, 32], hidden: [128]}\ntrain: {micro_batch: auto, effective_batch: 96}\n"), "test")
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	budget := func(b int64) AutoOptions {
		return AutoOptions{Budget: func(*configs.Config, int) (int64, string) { return b, "test" }}
	}
	// A budget of 10 MiB per worker: after the CNN's model states (~3.3 MB), its activations
	// (~0.2 MiB per sample on the native engine) allow a micro-batch in the tens, not 48.
	for _, world := range []int{1, 2, 3} {
		c := load()
		a, err := ResolveAutoMicro(&c, world, budget(10<<20))
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
			world, a.Micro, a.Accum, a.States, a.PerSample, a.Probed, a.Tried)
	}
	// With a generous budget the whole per-worker batch is one micro-batch.
	c := load()
	if _, err := ResolveAutoMicro(&c, 2, budget(8<<30)); err != nil || c.Train.MicroBatch != 48 || c.Train.Accum != 1 {
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
		c := load()
		if _, err := ResolveAutoMicro(&c, tc.world, budget(tc.budget)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v (want an error saying %q)", name, err, tc.want)
		}
	}
	c = load()
	c.Train.EffectiveBatch = 0
	if _, err := ResolveAutoMicro(&c, 1, budget(8<<30)); err == nil || !strings.Contains(err.Error(), "effective_batch") {
		t.Errorf("auto without effective_batch: %v", err)
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
	a, err := ResolveAutoMicro(&c, 1, AutoOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("micro %d × accum %d: %d B per sample on the device, peak %d B at the chosen micro-batch, budget %d B, tried %v",
		a.Micro, a.Accum, a.PerSample, a.Probed, a.Budget, a.Tried)
	if a.Micro*a.Accum != 96 || a.Micro == 96 || a.Budget != limit {
		t.Fatalf("micro %d × accum %d (budget %d): want a split of 96 below 96 within %d", a.Micro, a.Accum, a.Budget, limit)
	}
	if a.Probed > limit {
		t.Fatalf("the chosen micro-batch peaks at %d B on a %d B device", a.Probed, limit)
	}
}

// TestAutoMicroBudgetNotAboveCgroup: on the CPU, memory.limit is only the Go runtime's soft
// limit; where the memory the process can have (the cgroup's limit less its working set,
// inside a container) is less, the auto budget is that, and errors say where it comes from.
func TestAutoMicroBudgetNotAboveCgroup(t *testing.T) {
	cgroup := func(*configs.Config, int) (int64, string) {
		return 4 << 20, "cgroup /sys/fs/cgroup: limit 256.0 MiB, working set 250.0 MiB, available 6.0 MiB"
	}
	c, err := configs.Parse([]byte("model: {type: cnn, channels: [16, 32], hidden: [128]}\ntrain: {micro_batch: auto, effective_batch: 96}\nmemory: {limit: 8GiB}\n"), "test")
	if err != nil {
		t.Fatal(err)
	}
	_, err = ResolveAutoMicro(&c, 1, AutoOptions{Budget: cgroup})
	if err == nil || !strings.Contains(err.Error(), " per worker, from cgroup /sys/fs/cgroup: limit 256.0 MiB") || !strings.Contains(err.Error(), "below memory.limit 8GiB") {
		t.Fatalf("memory.limit 8GiB in a cgroup with 4 MiB left: %v", err)
	}
	// The live figure names the limit that applies here.
	budget, from := HostBudget(&c, 2)
	if budget <= 0 || !(strings.HasPrefix(from, "host: ") || strings.HasPrefix(from, "cgroup ")) || !strings.HasSuffix(from, "shared by 2 worker(s)") {
		t.Errorf("HostBudget: %d, %q", budget, from)
	}
	t.Logf("budget here: %d per worker (%s)", budget, from)
}
