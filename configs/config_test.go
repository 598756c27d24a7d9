package configs

import (
	"errors"
	"strings"
	"testing"
)

func TestEmbeddedConfigsAreValid(t *testing.T) {
	names := Embedded()
	if len(names) < 2 {
		t.Fatalf("embedded configs: %v", names)
	}
	for _, n := range names {
		c, err := Load(n)
		if err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		c.Resolve()
		if err := c.Validate(); err != nil {
			t.Fatalf("%s: %v", n, err)
		}
	}
	mlp, _ := Load("fashion-mlp")
	if mlp.Model.Type != "mlp" || len(mlp.Model.Hidden) != 2 || mlp.Model.Hidden[0] != 256 || mlp.Model.Hidden[1] != 128 {
		t.Fatalf("fashion-mlp is not 784-256-128-10: %+v", mlp.Model)
	}
}

func TestLoadFileFromDisk(t *testing.T) {
	c, err := Load("fashion-cnn.yaml") // the file in this directory
	if err != nil {
		t.Fatal(err)
	}
	if c.Model.Type != "cnn" || c.Run.Name != "fashion-cnn" {
		t.Fatalf("got %+v", c.Model)
	}
	if _, err := Load("/nonexistent/x.yaml"); err == nil || !strings.Contains(err.Error(), "/nonexistent/x.yaml") {
		t.Fatalf("missing file: %v", err)
	}
}

func TestParseOverlaysDefaults(t *testing.T) {
	c, err := Parse([]byte("train:\n  micro_batch: 8\noptimizer:\n  betas: [0.8, 0.9]\n"), "t")
	if err != nil {
		t.Fatal(err)
	}
	d := Default()
	if c.Train.MicroBatch != 8 || c.Train.Epochs != d.Train.Epochs || c.Optimizer.Betas != [2]float64{0.8, 0.9} || c.Optimizer.LR != d.Optimizer.LR {
		t.Fatalf("overlay wrong: %+v %+v", c.Train, c.Optimizer)
	}
	if c, err := Parse(nil, "empty"); err != nil || c.Train.MicroBatch != d.Train.MicroBatch {
		t.Fatalf("empty file: %v", err)
	}
}

func TestParseErrorsNameTheKey(t *testing.T) {
	cases := []struct{ yaml, want string }{
		{"trian:\n  epochs: 3\n", "trian (line 1): unknown key"},
		{"train:\n  micro_bach: 3\n", "train.micro_bach (line 2): unknown key"},
		{"train:\n  micro_batch: lots\n", "train.micro_batch (line 2)"},
		{"optimizer:\n  betas: [0.9]\n", "optimizer.betas"},
		{"data:\n  normalize: {mean: 0.3, sd: 1}\n", "data.normalize.sd"},
		{"train: 5\n", "train (line 1): expected a mapping"},
		{"train:\n  epochs: 1\n  epochs: 2\n", "already defined"},
		{"[1, 2]\n", "top level"},
	}
	for _, c := range cases {
		_, err := Parse([]byte(c.yaml), "cfg.yaml")
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "cfg.yaml") {
			t.Errorf("%q: error %v, want it to mention %q and the file", c.yaml, err, c.want)
		}
	}
}

func TestValidateNamesTheField(t *testing.T) {
	cases := []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Train.MicroBatch = 0 }, "train.micro_batch"},
		{func(c *Config) { c.Train.Accum = -1 }, "train.accum"},
		{func(c *Config) { c.Train.Precision = "fp8" }, "train.precision"},
		{func(c *Config) { c.Optimizer.LR = -1 }, "optimizer.lr"},
		{func(c *Config) { c.Optimizer.Type = "lion" }, "optimizer.type"},
		{func(c *Config) { c.Scheduler.Type = "step" }, "scheduler.type"},
		{func(c *Config) { c.Train.Precision = "fp16"; c.FP16.Hysteresis = 0 }, "fp16.hysteresis"},
		{func(c *Config) { c.Checkpoint.Keep = -1 }, "checkpoint.keep"},
		{func(c *Config) { c.Zero.Stage = 3 }, "zero_optimization.stage"},
		{func(c *Config) { c.Zero.OffloadOptimizer.Device = "nvme" }, "zero_optimization.offload_optimizer.device"},
		{func(c *Config) { c.Model.Type = "resnet" }, "model.type"},
		{func(c *Config) { c.Data.Normalize.Std = 0 }, "data.normalize.std"},
		{func(c *Config) { c.Run.Name = "a/b" }, "run.name"},
	}
	for _, tc := range cases {
		c := Default()
		tc.edit(&c)
		c.Resolve()
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error naming %s, got %v", tc.want, err)
		}
	}
	c := Default()
	c.Resolve()
	if err := c.Validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
}
