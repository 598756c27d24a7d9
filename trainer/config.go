package trainer

import (
	"errors"
	"fmt"
	"math"

	"github.com/qvd/qvd/internal/half"
)

// Config holds the training loop's knobs (YAML `train:`).
type Config struct {
	Epochs int `yaml:"epochs" json:"epochs"`
	// MaxSteps stops the run after this many optimizer steps in total (0 = run all epochs).
	MaxSteps int64 `yaml:"max_steps" json:"max_steps"`
	// MicroBatch is the number of samples per forward/backward on one worker; `auto`
	// (AutoMicroBatch) picks the largest that fits the memory budget, with Accum set so that
	// micro × accum × world = EffectiveBatch.
	MicroBatch int `yaml:"micro_batch" json:"micro_batch" auto:"-1"`
	// EffectiveBatch is the global batch micro_batch: auto must keep (0 = not set).
	EffectiveBatch int `yaml:"effective_batch" json:"effective_batch"`
	// Accum is the number of micro-batches whose gradients are summed before each optimizer
	// step; the loss is divided by Accum so the step sees the mean over micro × accum samples.
	Accum int `yaml:"accum" json:"accum"`
	// Precision is fp32, fp16 (with loss scaling) or bf16: the format the model computes
	// its weights and gradients in. Master weights and optimizer state are always fp32.
	Precision string `yaml:"precision" json:"precision"`
	// MaxGradNorm clips the global L2 norm of the gradient (0 = no clipping).
	MaxGradNorm float64 `yaml:"max_grad_norm" json:"max_grad_norm"`
	// EvalBatch is the batch size of the evaluation pass after every epoch.
	EvalBatch int `yaml:"eval_batch" json:"eval_batch"`
	// Threads bounds the goroutines of the flat-buffer passes (optimizer, norm) and OpenBLAS;
	// 0 = all cores.
	Threads int `yaml:"threads" json:"threads"`
}

// AutoMicroBatch is MicroBatch's value for `micro_batch: auto`.
const AutoMicroBatch = -1

// DefaultConfig trains 10 epochs at micro-batch 64 in fp32.
func DefaultConfig() Config {
	return Config{Epochs: 10, MicroBatch: 64, Accum: 1, Precision: "fp32", EvalBatch: 1000}
}

// Validate checks the fields; errors name the field.
func (c Config) Validate() error {
	switch {
	case c.Epochs < 1 || c.Epochs > 100000:
		return fmt.Errorf("epochs: must be in [1, 100000], got %d", c.Epochs)
	case c.MaxSteps < 0:
		return fmt.Errorf("max_steps: must be >= 0 (0 = all epochs), got %d", c.MaxSteps)
	case c.MicroBatch == AutoMicroBatch && c.EffectiveBatch < 1:
		return errors.New("micro_batch: auto needs train.effective_batch, the global batch to keep")
	case c.MicroBatch == AutoMicroBatch:
		return errors.New("micro_batch: auto was not resolved before training (the command line resolves it)")
	case c.MicroBatch < 1 || c.MicroBatch > 1<<20:
		return fmt.Errorf("micro_batch: must be in [1, 1048576] or auto, got %d", c.MicroBatch)
	case c.EffectiveBatch < 0:
		return fmt.Errorf("effective_batch: must be >= 0, got %d", c.EffectiveBatch)
	case c.Accum < 1 || c.Accum > 1<<16:
		return fmt.Errorf("accum: must be in [1, 65536], got %d", c.Accum)
	case c.MaxGradNorm < 0 || math.IsNaN(c.MaxGradNorm) || math.IsInf(c.MaxGradNorm, 0):
		return fmt.Errorf("max_grad_norm: must be 0 (off) or a positive finite number, got %v", c.MaxGradNorm)
	case c.EvalBatch < 1 || c.EvalBatch > 1<<20:
		return fmt.Errorf("eval_batch: must be in [1, 1048576], got %d", c.EvalBatch)
	case c.Threads < 0:
		return fmt.Errorf("threads: must be >= 0 (0 = all cores), got %d", c.Threads)
	}
	if _, err := half.ParseFormat(c.Precision); err != nil {
		return fmt.Errorf("precision: %w", err)
	}
	return nil
}

// Format returns the parsed precision (valid after Validate).
func (c Config) Format() half.Format {
	f, _ := half.ParseFormat(c.Precision)
	return f
}
