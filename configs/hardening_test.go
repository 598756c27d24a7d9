package configs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/trainer"
)

// TestMicroBatchNegativeIsNotAuto: auto is stored as trainer.AutoMicroBatch (-1), so a -1
// written in the file used to pass for auto. Only the word auto means auto; a negative number
// is an error naming the key, its line and the value.
func TestMicroBatchNegativeIsNotAuto(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want string // "" = no error
		auto bool
	}{
		{"train:\n  micro_batch: -1\n  effective_batch: 64\n", "train.micro_batch (line 2): must be a positive number or auto, got -1", false},
		{"train:\n  micro_batch: -7\n", "train.micro_batch (line 2): must be a positive number or auto, got -7", false},
		{"train: {micro_batch: -1}\n", "train.micro_batch (line 1)", false},
		{"train:\n  micro_batch: auto\n  effective_batch: 64\n", "", true},
		{"train:\n  micro_batch: 8\n", "", false},
	} {
		c, err := Parse([]byte(tc.yaml), "cfg.yaml")
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%q: %v", tc.yaml, err)
		case tc.want != "" && (err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%q: error %v, want one saying %q", tc.yaml, err, tc.want)
		case tc.want == "" && (c.Train.MicroBatch == trainer.AutoMicroBatch) != tc.auto:
			t.Errorf("%q: micro_batch %d, auto %v", tc.yaml, c.Train.MicroBatch, tc.auto)
		}
	}
}

// TestDeepSpeedDuplicateKeys: encoding/json keeps the last of two equal keys; a ds_config.json
// with one is refused naming the key's path and both lines, at any depth, as YAML's are.
func TestDeepSpeedDuplicateKeys(t *testing.T) {
	cases := map[string]string{
		"{\n  \"train_batch_size\": 64,\n  \"train_batch_size\": 32\n}":                                        "train_batch_size (line 3): key already defined at line 2",
		"{\"zero_optimization\": {\n  \"stage\": 1,\n  \"stage\": 2}}":                                         "zero_optimization.stage (line 3): key already defined at line 2",
		`{"zero_optimization": {"offload_optimizer": {"device": "cpu", "device": "none"}}}`:                    "zero_optimization.offload_optimizer.device",
		`{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "lr": 1e-4}}}`:                                 "optimizer.params.lr",
		`{"fp16": {"enabled": false}, "fp16": {"enabled": true}}`:                                              "fp16 (line 1): key already defined",
		`{"optimizer": {"type": "AdamW", "params": {"betas": [{"a": 1, "a": 2}, 0.9]}}}`:                       "optimizer.params.betas[0].a",
		`{"steps_per_print": 1, "wall_clock_breakdown": false, "zero_optimization": {}, "steps_per_print": 2}`: "steps_per_print",
	}
	for js, want := range cases {
		c := Default()
		_, err := ApplyDeepSpeed(&c, []byte(js))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: want an error saying %q, got %v", js, want, err)
		}
	}
	// Equal keys in different objects are not duplicates.
	c := Default()
	if _, err := ApplyDeepSpeed(&c, []byte(dsFull)); err != nil {
		t.Fatalf("dsFull: %v", err)
	}
	ok := `{"fp16": {"enabled": false, "loss_scale": 0}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}}`
	if _, err := ApplyDeepSpeed(&c, []byte(ok)); err != nil {
		t.Fatalf("no duplicates: %v", err)
	}
	// Through LoadDeepSpeed the file is named too.
	path := filepath.Join(t.TempDir(), "ds.json")
	if err := os.WriteFile(path, []byte(`{"gradient_clipping": 1, "gradient_clipping": 2}`), 0o644); err != nil {
		t.Fatal(err)
	}
	c = Default()
	if _, err := LoadDeepSpeed(&c, path); err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "gradient_clipping (line 1)") {
		t.Fatalf("LoadDeepSpeed: %v", err)
	}
	// Broken JSON keeps the decoder's own error.
	c = Default()
	if _, err := ApplyDeepSpeed(&c, []byte(`{"a": `)); err == nil || !strings.Contains(err.Error(), "want a JSON object") {
		t.Fatalf("broken JSON: %v", err)
	}
}

// TestFP16SectionValidatedWhateverThePrecision: a bad value in fp16: is an error while the
// precision is fp32 or bf16 too, from YAML and from a DeepSpeed fp16 block that is disabled.
func TestFP16SectionValidatedWhateverThePrecision(t *testing.T) {
	for _, precision := range []string{"fp32", "bf16", "fp16"} {
		for _, tc := range []struct {
			edit func(*Config)
			want string
		}{
			{func(c *Config) { c.FP16.Hysteresis = 0 }, "fp16.hysteresis"},
			{func(c *Config) { c.FP16.Window = -5 }, "fp16.loss_scale_window"},
			{func(c *Config) { c.FP16.MinScale = 0 }, "fp16.min_loss_scale"},
			{func(c *Config) { c.FP16.LossScale = -1 }, "fp16.loss_scale"},
		} {
			c := Default()
			c.Train.Precision = precision
			tc.edit(&c)
			c.Resolve()
			if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("precision %s: want an error naming %s, got %v", precision, tc.want, err)
			}
		}
	}
	c, err := Parse([]byte("train:\n  precision: fp32\nfp16:\n  hysteresis: 0\n"), "cfg.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c.Resolve()
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "fp16.hysteresis") {
		t.Errorf("YAML fp16.hysteresis 0 at fp32: %v", err)
	}
	c = Default()
	if _, err := ApplyDeepSpeed(&c, []byte(`{"fp16": {"enabled": false, "loss_scale_window": 0}}`)); err != nil {
		t.Fatal(err)
	}
	c.Resolve()
	if err := c.Validate(); c.Train.Precision == "fp16" || err == nil || !strings.Contains(err.Error(), "fp16.loss_scale_window") {
		t.Errorf("DeepSpeed fp16 disabled with loss_scale_window 0: precision %s, %v", c.Train.Precision, err)
	}
	// The defaults are valid at every precision.
	for _, precision := range []string{"fp32", "bf16", "fp16"} {
		c := Default()
		c.Train.Precision = precision
		c.Resolve()
		if err := c.Validate(); err != nil {
			t.Errorf("defaults at %s: %v", precision, err)
		}
	}
}
