package trainer

import (
	"fmt"
	"math"
)

// Schedule types.
const (
	ScheduleConstant     = "constant"      // base lr throughout
	ScheduleWarmup       = "warmup"        // warm up, then constant (DeepSpeed WarmupLR)
	ScheduleWarmupCosine = "warmup_cosine" // warm up, then cosine decay to min_ratio (WarmupCosineLR)
	ScheduleWarmupLinear = "warmup_linear" // warm up, then linear decay to min_ratio (WarmupDecayLR)
)

// ScheduleConfig is the learning-rate schedule (YAML `scheduler:`). The learning rate at
// optimizer step s (0-based, counting only steps that updated the weights) is the optimizer's
// base lr times Factor(s, total).
type ScheduleConfig struct {
	Type        string `yaml:"type" json:"type"`
	WarmupSteps int    `yaml:"warmup_steps" json:"warmup_steps"`
	// WarmupType is "linear" (the factor rises as (s+1)/warmup) or "log" (DeepSpeed WarmupLR's
	// default: log(s+1)/log(warmup), which warms up faster early).
	WarmupType string `yaml:"warmup_type" json:"warmup_type"`
	// WarmupStartRatio is the factor at the first warmup step's origin (DeepSpeed warmup_min_lr / lr).
	WarmupStartRatio float64 `yaml:"warmup_start_ratio" json:"warmup_start_ratio"`
	// MinRatio is the final factor of the decaying schedules (DeepSpeed cos_min_ratio).
	MinRatio float64 `yaml:"min_ratio" json:"min_ratio"`
	// TotalSteps is the length of the decay; 0 = the run's total optimizer steps.
	TotalSteps int `yaml:"total_steps" json:"total_steps"`
}

// DefaultScheduleConfig is a constant learning rate.
func DefaultScheduleConfig() ScheduleConfig {
	return ScheduleConfig{Type: ScheduleConstant, WarmupType: "linear"}
}

// Validate checks the fields; errors name the field.
func (c ScheduleConfig) Validate() error {
	switch c.Type {
	case ScheduleConstant, ScheduleWarmup, ScheduleWarmupCosine, ScheduleWarmupLinear:
	default:
		return fmt.Errorf("type: unknown schedule %q (want %s, %s, %s or %s)", c.Type,
			ScheduleConstant, ScheduleWarmup, ScheduleWarmupCosine, ScheduleWarmupLinear)
	}
	switch {
	case c.WarmupSteps < 0:
		return fmt.Errorf("warmup_steps: must be >= 0, got %d", c.WarmupSteps)
	case c.WarmupType != "linear" && c.WarmupType != "log":
		return fmt.Errorf("warmup_type: must be linear or log, got %q", c.WarmupType)
	case c.WarmupStartRatio < 0 || c.WarmupStartRatio > 1 || math.IsNaN(c.WarmupStartRatio):
		return fmt.Errorf("warmup_start_ratio: must be in [0, 1], got %v", c.WarmupStartRatio)
	case c.MinRatio < 0 || c.MinRatio > 1 || math.IsNaN(c.MinRatio):
		return fmt.Errorf("min_ratio: must be in [0, 1], got %v", c.MinRatio)
	case c.TotalSteps < 0:
		return fmt.Errorf("total_steps: must be >= 0 (0 = the whole run), got %d", c.TotalSteps)
	case c.TotalSteps > 0 && c.TotalSteps <= c.WarmupSteps && (c.Type == ScheduleWarmupCosine || c.Type == ScheduleWarmupLinear):
		return fmt.Errorf("total_steps: %d must exceed warmup_steps %d for a decaying schedule", c.TotalSteps, c.WarmupSteps)
	}
	return nil
}

// Factor is the multiplier of the base learning rate at optimizer step s of a run of
// runTotal steps (used when TotalSteps is 0).
func (c ScheduleConfig) Factor(s, runTotal int64) float64 {
	if c.Type == ScheduleConstant {
		return 1
	}
	w := int64(c.WarmupSteps)
	if s < w {
		var frac float64
		switch {
		case w == 1:
			frac = 1
		case c.WarmupType == "log":
			frac = math.Log(float64(s+1)) / math.Log(float64(w))
		default:
			frac = float64(s+1) / float64(w)
		}
		return c.WarmupStartRatio + (1-c.WarmupStartRatio)*frac
	}
	if c.Type == ScheduleWarmup {
		return 1
	}
	total := int64(c.TotalSteps)
	if total == 0 {
		total = runTotal
	}
	p := 1.0
	if total > w {
		p = math.Min(1, float64(s-w)/float64(total-w))
	}
	if c.Type == ScheduleWarmupCosine {
		return c.MinRatio + (1-c.MinRatio)*0.5*(1+math.Cos(math.Pi*p))
	}
	return c.MinRatio + (1-c.MinRatio)*(1-p)
}
