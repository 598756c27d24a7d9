package trainer

import (
	"fmt"
	"math"

	"github.com/qvd/qvd/checkpoint/sharded"
)

// ScalerConfig configures fp16 loss scaling (YAML `fp16:`, the fields of DeepSpeed's fp16 block).
// It is used only with precision fp16: bf16 has fp32's exponent range and needs no scaling.
type ScalerConfig struct {
	// LossScale > 0 fixes the scale (static loss scaling); 0 selects dynamic scaling.
	LossScale float64 `yaml:"loss_scale" json:"loss_scale"`
	// InitialScalePower: dynamic scaling starts at 2^InitialScalePower.
	InitialScalePower int `yaml:"initial_scale_power" json:"initial_scale_power"`
	// Window is the number of consecutive overflow-free steps after which the scale doubles.
	Window int `yaml:"loss_scale_window" json:"loss_scale_window"`
	// Hysteresis is how many overflows are tolerated (steps skipped, scale kept) before the
	// scale halves; it is restored when the scale next grows, or after every clean step with
	// ConsecutiveHysteresis.
	Hysteresis            int  `yaml:"hysteresis" json:"hysteresis"`
	ConsecutiveHysteresis bool `yaml:"consecutive_hysteresis" json:"consecutive_hysteresis"`
	// MinScale is the floor the scale never goes below.
	MinScale float64 `yaml:"min_loss_scale" json:"min_loss_scale"`
}

// DefaultScalerConfig follows torch.cuda.amp.GradScaler's growth (2^16 start, ×2 after 2000
// clean steps) with DeepSpeed's hysteresis of 2 and minimum scale of 1.
func DefaultScalerConfig() ScalerConfig {
	return ScalerConfig{InitialScalePower: 16, Window: 2000, Hysteresis: 2, MinScale: 1}
}

// Validate checks the fields; errors name the field.
func (c ScalerConfig) Validate() error {
	switch {
	case c.LossScale < 0 || math.IsNaN(c.LossScale) || math.IsInf(c.LossScale, 0):
		return fmt.Errorf("loss_scale: must be 0 (dynamic) or a positive finite number, got %v", c.LossScale)
	case c.InitialScalePower < 0 || c.InitialScalePower > 64:
		return fmt.Errorf("initial_scale_power: must be in [0, 64], got %d", c.InitialScalePower)
	case c.Window < 1:
		return fmt.Errorf("loss_scale_window: must be >= 1, got %d", c.Window)
	case c.Hysteresis < 1:
		return fmt.Errorf("hysteresis: must be >= 1, got %d", c.Hysteresis)
	case !(c.MinScale > 0) || math.IsInf(c.MinScale, 0):
		return fmt.Errorf("min_loss_scale: must be a positive finite number, got %v", c.MinScale)
	case c.LossScale == 0 && math.Ldexp(1, c.InitialScalePower) < c.MinScale:
		return fmt.Errorf("initial_scale_power: 2^%d is below min_loss_scale %v", c.InitialScalePower, c.MinScale)
	}
	return nil
}

// ScalerState is the loss scaler's whole state, saved in checkpoints so a resumed run scales
// (and skips) exactly as the uninterrupted one would have. It is part of the checkpoint's
// meta.json, whose schema package sharded owns.
type ScalerState = sharded.ScalerState

// maxScale keeps the scale finite in float32, in which the model multiplies the loss.
const maxScale = 1 << 100

// Scaler is the dynamic loss scaler of mixed-precision training (Micikevicius et al. 2018,
// "Mixed Precision Training"): the loss is multiplied by a large scale so small gradients
// survive fp16's narrow range, a step whose gradients overflow is skipped and the scale
// backs off, and after a window of clean steps the scale grows again. It is a pure state
// machine: the trainer feeds it one overflow flag per step, agreed by every rank.
type Scaler struct {
	cfg ScalerConfig
	st  ScalerState
}

// NewScaler returns a scaler at its initial scale.
func NewScaler(cfg ScalerConfig) *Scaler {
	s := &Scaler{cfg: cfg}
	s.st = ScalerState{Scale: math.Ldexp(1, cfg.InitialScalePower), HysteresisLeft: cfg.Hysteresis}
	if cfg.LossScale > 0 {
		s.st.Scale = cfg.LossScale
	}
	return s
}

// Scale is the factor to multiply the loss by for the next step.
func (s *Scaler) Scale() float64 { return s.st.Scale }

// State returns a copy of the state for checkpointing.
func (s *Scaler) State() ScalerState { return s.st }

// SetState restores a checkpointed state.
func (s *Scaler) SetState(st ScalerState) error {
	if !(st.Scale > 0) || math.IsInf(st.Scale, 0) || st.GoodSteps < 0 || st.HysteresisLeft < 0 || st.Overflows < 0 {
		return fmt.Errorf("loss scaler: invalid saved state %+v", st)
	}
	s.st = st
	return nil
}

// set replaces the state with one Update produced (decide's, which ran on a copy).
func (s *Scaler) set(st ScalerState) { s.st = st }

// Update records one step's outcome and reports whether the optimizer step must be skipped
// (it must, exactly when the gradients overflowed). It returns the scale change, if any, so
// the caller can log it.
func (s *Scaler) Update(overflow bool) (skip bool, changed bool) {
	old := s.st.Scale
	if overflow {
		s.st.Overflows++
		s.st.GoodSteps = 0
		if s.cfg.LossScale > 0 {
			return true, false // static scale: skip, never change
		}
		if s.st.HysteresisLeft > 1 {
			s.st.HysteresisLeft--
		} else {
			s.st.Scale = math.Max(s.st.Scale/2, s.cfg.MinScale)
		}
		return true, s.st.Scale != old
	}
	if s.cfg.LossScale > 0 {
		return false, false
	}
	if s.cfg.ConsecutiveHysteresis {
		s.st.HysteresisLeft = s.cfg.Hysteresis
	}
	s.st.GoodSteps++
	if s.st.GoodSteps >= s.cfg.Window {
		s.st.GoodSteps = 0
		s.st.HysteresisLeft = s.cfg.Hysteresis
		s.st.Scale = math.Min(s.st.Scale*2, maxScale)
	}
	return false, s.st.Scale != old
}
