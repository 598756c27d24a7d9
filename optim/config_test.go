package optim

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
)

func TestDefaultConfig(t *testing.T) {
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatalf("DefaultConfig().Validate() = %v", err)
	}
	want := Config{Type: "adamw", LR: 1e-3, Momentum: 0.9, Betas: [2]float64{0.9, 0.999}, Eps: 1e-8, WeightDecay: 0.01}
	if c != want {
		t.Fatalf("DefaultConfig() = %+v, want %+v", c, want)
	}
}

func TestValidateNamesField(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string // prefix of the error text
	}{
		{"unknown type", func(c *Config) { c.Type = "adamax" }, `type: unknown optimizer "adamax" (want sgd, adam, adamw, adam8bit or adamw8bit)`},
		{"empty type", func(c *Config) { c.Type = "" }, `type: unknown optimizer ""`},
		{"negative lr", func(c *Config) { c.LR = -1 }, "lr: must be > 0 and finite, got -1"},
		{"zero lr", func(c *Config) { c.LR = 0 }, "lr: "},
		{"NaN lr", func(c *Config) { c.LR = math.NaN() }, "lr: "},
		{"Inf lr", func(c *Config) { c.LR = math.Inf(1) }, "lr: "},
		{"negative weight decay", func(c *Config) { c.WeightDecay = -0.1 }, "weight_decay: must be >= 0"},
		{"NaN weight decay", func(c *Config) { c.WeightDecay = math.NaN() }, "weight_decay: "},
		{"negative threads", func(c *Config) { c.Threads = -2 }, "threads: must be >= 0"},
		{"beta1 = 1", func(c *Config) { c.Betas[0] = 1 }, "betas[0]: must be in [0, 1), got 1"},
		{"beta2 < 0", func(c *Config) { c.Betas[1] = -0.5 }, "betas[1]: "},
		{"beta2 NaN", func(c *Config) { c.Betas[1] = math.NaN() }, "betas[1]: "},
		{"eps 0", func(c *Config) { c.Eps = 0 }, "eps: must be > 0"},
		{"eps underflows float32", func(c *Config) { c.Eps = 1e-50 }, "eps: "},
		{"nesterov with adamw", func(c *Config) { c.Nesterov = true }, "nesterov: only used by type sgd"},
		{"sgd momentum 1", func(c *Config) { c.Type = "sgd"; c.Momentum = 1 }, "momentum: must be in [0, 1), got 1"},
		{"sgd momentum negative", func(c *Config) { c.Type = "sgd"; c.Momentum = -0.1 }, "momentum: "},
		{"sgd nesterov without momentum", func(c *Config) { c.Type = "sgd"; c.Momentum = 0; c.Nesterov = true }, "nesterov: needs momentum > 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.mutate(&c)
			err := c.Validate()
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want error starting %q", err, tc.want)
			}
			// New reports the same error, wrapped.
			if _, err := New(c, 4); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New() error = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestValidateIgnoresOtherTypesFields(t *testing.T) {
	c := DefaultConfig()
	c.Momentum = 7 // ignored by adamw
	if err := c.Validate(); err != nil {
		t.Fatalf("adamw with momentum 7: %v", err)
	}
	c = DefaultConfig()
	c.Type, c.Betas, c.Eps = "sgd", [2]float64{3, 3}, 0 // ignored by sgd
	if err := c.Validate(); err != nil {
		t.Fatalf("sgd with bad betas/eps: %v", err)
	}
	c.Momentum = 0 // plain sgd
	if err := c.Validate(); err != nil {
		t.Fatalf("plain sgd: %v", err)
	}
}

func TestConfigJSONNames(t *testing.T) {
	c := DefaultConfig()
	in := `{"type":"sgd","lr":0.1,"momentum":0.5,"nesterov":true,"betas":[0.8,0.99],"eps":1e-6,"weight_decay":0.2,"threads":3}`
	if err := json.Unmarshal([]byte(in), &c); err != nil {
		t.Fatal(err)
	}
	want := Config{Type: "sgd", LR: 0.1, Momentum: 0.5, Nesterov: true, Betas: [2]float64{0.8, 0.99}, Eps: 1e-6, WeightDecay: 0.2, Threads: 3}
	if c != want {
		t.Fatalf("decoded %+v, want %+v", c, want)
	}
}

func TestNewRejectsBadLength(t *testing.T) {
	if _, err := New(DefaultConfig(), -1); err == nil {
		t.Fatal("New with n = -1: no error")
	}
	if _, err := NewWithPool(DefaultConfig(), 3, nil); err == nil {
		t.Fatal("NewWithPool with nil pool: no error")
	}
}
