package trainer

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/offload"
)

// DeviceStepper is a Model that can keep the gradient, the fp32 master weights and the
// optimizer on its device (the GPU engine without optimizer offload, ZeRO stage 0): the
// trainer then drives the step there instead of on the host, and the host copies of the
// weights and optimizer state are brought up to date only for checkpoints, memory adaptation
// and the end of the run.
type DeviceStepper interface {
	// DeviceStep reports whether the model's device is apart from the host (false for the
	// CPU backend, whose memory the host engine already uses in place).
	DeviceStep() bool
	EnableDeviceOptimizer(cfg offload.Config) error
	// AccumulateMicro adds one micro-batch's gradient of loss×scale into the device gradient
	// (first: sets it) and returns the unscaled mean loss.
	AccumulateMicro(b *data.Batch, scale float32, first bool) (float32, error)
	// ZeroGrads clears the device gradient (a step whose micro-batches all failed).
	ZeroGrads() error
	// ReduceGrads averages the device gradient across comm's group (nil: one worker).
	ReduceGrads(ctx context.Context, comm collective.Communicator, wire half.Format) error
	// CheckGrads unscales the gradient in place and reports Inf/NaN and its squared norm.
	CheckGrads(unscale float32) (overflow bool, sumsq float64, err error)
	// StepDevice applies the optimizer to gradient × gradScale and returns its step count.
	StepDevice(lr, gradScale float32) (int64, error)
	PullState(master, m, v []float32) (steps int64, err error)
	PushState(master, m, v []float32, steps int64) error
}

// enableDeviceStep turns the device step on when the model supports it and the run allows
// it: no optimizer offload, ZeRO stage 0 (the shards of stages 1-2 live on the host), and an
// optimizer the fused kernel implements. Otherwise a GPU model steps on the host (ZeRO-Offload's
// split), and the log says why.
func (t *Trainer) enableDeviceStep() error {
	d, ok := t.model.(DeviceStepper)
	if !ok || !d.DeviceStep() {
		return nil
	}
	why := ""
	switch {
	case t.eng.Offloaded():
		why = "zero_optimization.offload_optimizer.device is cpu"
	case t.zeroCfg.Stage != 0:
		why = fmt.Sprintf("ZeRO stage %d keeps its optimizer shards in host memory", t.zeroCfg.Stage)
	case t.optCfg.Type != offload.TypeAdamW && (t.optCfg.Type != offload.TypeAdam || t.optCfg.WeightDecay != 0):
		why = fmt.Sprintf("optimizer %s is not the fused device kernel's (adamw, or adam without weight_decay)", t.optCfg.Type)
	}
	if why != "" {
		t.log.Info("optimizer step on the host (offload)", zap.String("why", why))
		return nil
	}
	if err := d.EnableDeviceOptimizer(t.optCfg); err != nil {
		return fmt.Errorf("device optimizer: %w", err)
	}
	t.dev = d
	t.log.Info("optimizer step on the device: fused AdamW, fp32 master weights and moments in device memory")
	return nil
}

// optimizerState returns the host engine's master weights and Adam moments (stage 0: the whole
// trainable part), the buffers checkpoints read and write.
func (t *Trainer) optimizerState() (master, m, v []float32, err error) {
	master = t.eng.Master()
	for _, nb := range t.eng.Optimizer().State() {
		switch nb.Name {
		case "exp_avg":
			m = nb.Data
		case "exp_avg_sq":
			v = nb.Data
		}
	}
	if m == nil || v == nil {
		return nil, nil, nil, errors.New("device optimizer: the host optimizer has no exp_avg/exp_avg_sq to mirror")
	}
	return master, m, v, nil
}

// pushDevice loads the host's weights and optimizer state into the device (after the first
// broadcast or a resume, and after a rebuild).
func (t *Trainer) pushDevice() error {
	if t.dev == nil {
		return nil
	}
	master, m, v, err := t.optimizerState()
	if err != nil {
		return err
	}
	return t.dev.PushState(master, m, v, t.eng.Optimizer().Steps())
}

// pullDevice brings the host's weights and optimizer state up to date from the device.
func (t *Trainer) pullDevice() error {
	if t.dev == nil {
		return nil
	}
	master, m, v, err := t.optimizerState()
	if err != nil {
		return err
	}
	steps, err := t.dev.PullState(master, m, v)
	if err != nil {
		return err
	}
	t.eng.Optimizer().SetSteps(steps)
	return nil
}
