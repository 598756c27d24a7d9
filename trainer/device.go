package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
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
	EnableDeviceOptimizer(cfg optim.Config) error
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

// stepEnv is what choosing a StepEngine depends on besides the model.
type stepEnv struct {
	eng   *zero.Engine
	spec  *runSpec
	group *group
	log   *zap.Logger
}

// newStepEngine steps on the model's device when the model supports it and the run allows
// it: no optimizer offload, ZeRO stage 0 (the shards of stages 1-2 live on the host), and an
// optimizer the fused kernel implements. Otherwise the step runs on the host engine (for a
// GPU model, ZeRO-Offload's split), and the log says why.
func newStepEngine(m Model, env stepEnv) (StepEngine, error) {
	host := &hostStep{eng: env.eng, model: m}
	d, ok := m.(DeviceStepper)
	if !ok || !d.DeviceStep() {
		return host, nil
	}
	opt := env.spec.opt
	why := ""
	switch {
	case env.eng.Offloaded():
		why = "zero_optimization.offload_optimizer.device is cpu"
	case env.spec.zero.Stage != 0:
		why = fmt.Sprintf("ZeRO stage %d keeps its optimizer shards in host memory", env.spec.zero.Stage)
	case opt.Type != optim.TypeAdamW && (opt.Type != optim.TypeAdam || opt.WeightDecay != 0):
		why = fmt.Sprintf("optimizer %s is not the fused device kernel's (adamw, or adam without weight_decay)", opt.Type)
	}
	if why != "" {
		env.log.Info("optimizer step on the host (offload)", zap.String("why", why))
		return host, nil
	}
	if err := d.EnableDeviceOptimizer(opt); err != nil {
		return nil, fmt.Errorf("device optimizer: %w", err)
	}
	env.log.Info("optimizer step on the device: fused AdamW, fp32 master weights and moments in device memory")
	return &deviceStep{dev: d, env: env}, nil
}

// deviceStep is the device path: micro-batches accumulate into the device gradient, which is
// reduced, checked and stepped there. The host engine keeps the state checkpoints read.
type deviceStep struct {
	dev DeviceStepper
	env stepEnv
}

var _ StepEngine = (*deviceStep)(nil)

// SyncParams: the device's weights are the current ones.
func (d *deviceStep) SyncParams() error { return nil }

func (d *deviceStep) BeginStep(accum int) error { return d.env.eng.BeginStep(accum) }

func (d *deviceStep) Accumulate(ctx context.Context, b *data.Batch, lossMul float32, first, last bool) (float32, error) {
	return d.dev.AccumulateMicro(b, lossMul, first)
}

// Reduce averages the device gradient. With no micro-batch run, the device gradient holds
// nothing of this step: it is zeroed first, so the rank adds nothing to the average, as the
// host path's cleared buffer does.
func (d *deviceStep) Reduce(ctx context.Context, ran int) error {
	if ran == 0 {
		if err := d.dev.ZeroGrads(); err != nil {
			return err
		}
	}
	return d.dev.ReduceGrads(ctx, d.env.group.comm, d.env.spec.format)
}

// SumSquares checks the gradient on the device, which also unscales it in place; the sum is
// scaled back so both paths report the same quantity.
func (d *deviceStep) SumSquares(ctx context.Context, scale float64) (float64, error) {
	overflow, s, err := d.dev.CheckGrads(float32(1 / scale))
	if err != nil {
		return 0, err
	}
	// The averaged gradient is the same on every rank, and so its check; the flag is agreed
	// all the same, so that no reduction's nondeterminism (NCCL's, on some topologies) could
	// make one rank step while another skips.
	overflow, err = d.env.group.anyTrue(ctx, overflow)
	if err != nil {
		return 0, fmt.Errorf("agreeing on the overflow check: %w", err)
	}
	if overflow {
		return math.Inf(1), nil
	}
	return s * scale * scale, nil
}

// Apply steps the device optimizer, whose gradient is already unscaled.
func (d *deviceStep) Apply(ctx context.Context, lr float32, gradScale, scale float64) error {
	steps, err := d.dev.StepDevice(lr, float32(gradScale*scale))
	if err != nil {
		return err
	}
	d.env.eng.Optimizer().SetSteps(steps) // the LR schedule and checkpoints count steps there
	return nil
}

// PushState loads the host's weights and optimizer state into the device.
func (d *deviceStep) PushState() error {
	master, m, v, err := hostState(d.env.eng)
	if err != nil {
		return err
	}
	return d.dev.PushState(master, m, v, d.env.eng.Optimizer().Steps())
}

// PullState brings the host's weights and optimizer state up to date from the device.
func (d *deviceStep) PullState() error {
	master, m, v, err := hostState(d.env.eng)
	if err != nil {
		return err
	}
	steps, err := d.dev.PullState(master, m, v)
	if err != nil {
		return err
	}
	d.env.eng.Optimizer().SetSteps(steps)
	return nil
}

func (d *deviceStep) Buckets() []zero.Bucket { return nil }

// Rebind enables the device step on the rebuilt model (the caller pulled the state from the
// old one) and loads the state into it.
func (d *deviceStep) Rebind(m Model) (StepEngine, error) {
	next, err := newStepEngine(m, d.env)
	if err != nil {
		return nil, err
	}
	if err := next.PushState(); err != nil {
		return nil, err
	}
	return next, nil
}

// hostState returns the host engine's master weights and Adam moments (stage 0: the whole
// trainable part), the buffers checkpoints read and write.
func hostState(eng *zero.Engine) (master, m, v []float32, err error) {
	master = eng.Master()
	for _, nb := range eng.Optimizer().State() {
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
