package configs

import (
	"os"
	"path/filepath"
	"testing"
)

// TestOverridesPrecedence: defaults < YAML < DeepSpeed JSON < overrides, and a nil override
// leaves the value below it.
func TestOverridesPrecedence(t *testing.T) {
	dir := t.TempDir()
	yml := filepath.Join(dir, "c.yaml")
	if err := os.WriteFile(yml, []byte("train:\n  micro_batch: 8\n  accum: 2\n  epochs: 3\noptimizer:\n  lr: 0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ds := filepath.Join(dir, "ds.json")
	if err := os.WriteFile(ds, []byte(`{"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, res, err := Overrides{}.Load(yml, ds)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Train.MicroBatch != 16 || cfg.Optimizer.LR != 0.01 || cfg.Train.Epochs != 3 || cfg.Train.Accum != 2 || !res.MicroSet || res.AccumSet {
		t.Errorf("YAML < JSON: micro %d lr %v epochs %d accum %d, %+v", cfg.Train.MicroBatch, cfg.Optimizer.LR, cfg.Train.Epochs, cfg.Train.Accum, res)
	}
	micro, accum, threads, lr, dev := 4, 1, 3, 0.5, "reference"
	cfg, res, err = Overrides{MicroBatch: &micro, Accum: &accum, Threads: &threads, LR: &lr, Device: &dev}.Load(yml, ds)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Train.MicroBatch != 4 || cfg.Train.Accum != 1 || cfg.Optimizer.LR != 0.5 || cfg.Train.Epochs != 3 || cfg.Device.Type != "reference" ||
		cfg.Train.Threads != 3 || cfg.Optimizer.Threads != 3 || !res.MicroSet || !res.AccumSet {
		t.Errorf("JSON < overrides: %+v %+v %+v, %+v", cfg.Train, cfg.Optimizer, cfg.Device, res)
	}
	def, _, err := Overrides{}.Load("", "")
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := Load(DefaultName); def.Run.Name != want.Run.Name || def.Model.Type != want.Model.Type {
		t.Errorf(`"" is not %s: %+v`, DefaultName, def.Run)
	}
}

// TestOverridesApplyEach: every field lands on its key.
func TestOverridesApplyEach(t *testing.T) {
	i := func(v int) *int { return &v }
	s := func(v string) *string { return &v }
	seed, steps := uint64(7), int64(9)
	o := Overrides{EffectiveBatch: i(64), Precision: s("bf16"), Epochs: i(2), Out: s("o"), Seed: &seed, MaxSteps: &steps,
		TrainSubset: i(100), TestSubset: i(50), DataPath: s("d"), Transport: s("tcp"), Engine: s("gorgonia"), ZeroStage: i(2),
		Offload: s("cpu"), CheckpointEvery: i(5), Recompute: i(3), MetricsAddr: s("m:0"), DashboardAddr: s("a:0")}
	c := Default()
	var ds DeepSpeedResult
	o.Apply(&c, &ds)
	got := []any{c.Train.EffectiveBatch, c.Train.Precision, c.Train.Epochs, c.Run.Out, c.Run.Seed, c.Train.MaxSteps,
		c.Data.TrainSubset, c.Data.TestSubset, c.Data.Path, c.Collective.Transport, c.Engine, c.Zero.Stage,
		c.Zero.OffloadOptimizer.Device, c.Checkpoint.EverySteps, c.Model.Recompute.Segments, c.Monitoring.MetricsAddr, c.Dashboard.Addr}
	want := []any{64, "bf16", 2, "o", uint64(7), int64(9), 100, 50, "d", "tcp", "gorgonia", 2, "cpu", 5, 3, "m:0", "a:0"}
	for k := range want {
		if got[k] != want[k] {
			t.Errorf("field %d: %v, want %v", k, got[k], want[k])
		}
	}
	if ds.MicroSet || ds.AccumSet {
		t.Errorf("micro/accum marked set: %+v", ds)
	}
}
