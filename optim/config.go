package optim

import (
	"fmt"
	"math"
)

// Optimizer types accepted in Config.Type.
const (
	TypeSGD   = "sgd"
	TypeAdam  = "adam"
	TypeAdamW = "adamw"
	// TypeAdam8bit and TypeAdamW8bit are adam and adamw with both moments block-wise quantised
	// to 8 bits (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022).
	TypeAdam8bit  = "adam8bit"
	TypeAdamW8bit = "adamw8bit"
)

// Config of the optimizer. YAML under `optimizer:`.
type Config struct {
	// Type is "sgd", "adam" (Kingma & Ba, 2015), "adamw" (Loshchilov & Hutter, "Decoupled
	// Weight Decay Regularization", 2019), or "adam8bit" and "adamw8bit": the same updates with
	// the moments kept in 8 bits, about a quarter of the memory (QuantizedStateBytes).
	Type string `yaml:"type" json:"type"`
	// LR is the base learning rate. The LR schedule scales it; Step receives the current value.
	LR float64 `yaml:"lr" json:"lr"`
	// Momentum is SGD's momentum factor in [0, 1); ignored by the Adam types.
	Momentum float64 `yaml:"momentum" json:"momentum"`
	// Nesterov selects Nesterov momentum (Sutskever et al., 2013) for sgd; needs Momentum > 0.
	Nesterov bool `yaml:"nesterov" json:"nesterov"`
	// Betas are Adam's decay rates of the first and second moment estimates, each in [0, 1).
	Betas [2]float64 `yaml:"betas" json:"betas"`
	// Eps is added to Adam's denominator for numerical stability; > 0.
	Eps float64 `yaml:"eps" json:"eps"`
	// WeightDecay >= 0. For sgd, adam and adam8bit it is L2 regularisation added to the
	// gradient (g += wd*p); for adamw and adamw8bit it is decoupled: p *= 1 - lr*wd before the
	// Adam update.
	WeightDecay float64 `yaml:"weight_decay" json:"weight_decay"`
	// Threads is the number of threads Step uses, the caller's goroutine included;
	// 0 means runtime.GOMAXPROCS(0).
	Threads int `yaml:"threads" json:"threads"`
}

// DefaultConfig is AdamW with PyTorch's default betas and eps, lr 1e-3 and weight decay 0.01.
// Momentum is preset to 0.9 so that switching Type to sgd gives the usual momentum SGD.
func DefaultConfig() Config {
	return Config{
		Type:        TypeAdamW,
		LR:          1e-3,
		Momentum:    0.9,
		Betas:       [2]float64{0.9, 0.999},
		Eps:         1e-8,
		WeightDecay: 0.01,
	}
}

// Validate checks the fields that the chosen Type uses; errors name the field by its YAML name
// and give the allowed range. Fields another Type would use are ignored, except that nesterov
// is rejected outside sgd because setting it there is surely a mistake.
func (c Config) Validate() error {
	switch c.Type {
	case TypeSGD, TypeAdam, TypeAdamW, TypeAdam8bit, TypeAdamW8bit:
	default:
		return fmt.Errorf("type: unknown optimizer %q (want %s, %s, %s, %s or %s)", c.Type, TypeSGD, TypeAdam, TypeAdamW, TypeAdam8bit, TypeAdamW8bit)
	}
	if !(c.LR > 0) || math.IsInf(c.LR, 0) {
		return fmt.Errorf("lr: must be > 0 and finite, got %v", c.LR)
	}
	if !(c.WeightDecay >= 0) || math.IsInf(c.WeightDecay, 0) {
		return fmt.Errorf("weight_decay: must be >= 0 and finite, got %v", c.WeightDecay)
	}
	if c.Threads < 0 {
		return fmt.Errorf("threads: must be >= 0 (0 = GOMAXPROCS), got %d", c.Threads)
	}
	if c.Type == TypeSGD {
		if !(c.Momentum >= 0 && c.Momentum < 1) {
			return fmt.Errorf("momentum: must be in [0, 1), got %v", c.Momentum)
		}
		if c.Nesterov && c.Momentum == 0 {
			return fmt.Errorf("nesterov: needs momentum > 0, got momentum %v", c.Momentum)
		}
		return nil
	}
	if c.Nesterov {
		return fmt.Errorf("nesterov: only used by type %s, got type %s", TypeSGD, c.Type)
	}
	for i, b := range c.Betas {
		if !(b >= 0 && b < 1) {
			return fmt.Errorf("betas[%d]: must be in [0, 1), got %v", i, b)
		}
	}
	// The kernels use eps in float32: a value that rounds to 0 there would divide 0 by 0 for a
	// parameter whose gradient has always been 0.
	if e := float32(c.Eps); !(e > 0) || math.IsInf(float64(e), 0) {
		return fmt.Errorf("eps: must be > 0 and finite in float32 (about 1.4e-45 to 3.4e38), got %v", c.Eps)
	}
	return nil
}
