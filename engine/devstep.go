package engine

import (
	"context"
	"errors"
	"fmt"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/optim"
)

// The device step: without optimizer offload the gradient never leaves the device. Micro-
// batches accumulate into the device gradient, a group averages it (NCCL on the device, or
// staged through host memory for the gRPC/TCP rings), one kernel unscales it and checks for
// Inf/NaN, and the fused AdamW kernel steps the device's fp32 master weights and writes the
// working weights. The host copies (Params, the trainer's master and optimizer state) are
// brought up to date only when a checkpoint or the end of the run needs them (PullState).

// DeviceReducer is a communicator that reduces device buffers in place (NCCL): the device
// step uses it instead of staging through the host. It runs after the device's queued work
// (the caller syncs first) and returns when the result is in place.
type DeviceReducer interface {
	AllReduceBuf(ctx context.Context, b Buf, op collective.Op) error
}

// DeviceStep reports whether the step can run on the device apart from the host (a GPU):
// on a host-memory device (the CPU backend) the ZeRO engine's buffers are the device's, so
// the trainer's host step is the device step.
func (n *Net) DeviceStep() bool { return n.hostm == nil }

// EnableDeviceOptimizer puts an fp32 master copy of the trainable weights and AdamW's moments
// on the device; PushState then loads the trainer's state into them.
func (n *Net) EnableDeviceOptimizer(cfg optim.Config) error {
	if n.adam != nil {
		return errors.New("engine: the device optimizer is already enabled")
	}
	if n.hostm != nil {
		return errors.New("engine: a host-memory device steps on the host engine's buffers")
	}
	a, err := NewAdam(n.alloc, cfg, n.host[n.layout.Frozen:])
	if err != nil {
		return err
	}
	n.adam = a
	return nil
}

// DeviceOptimizer reports whether the device optimizer is enabled.
func (n *Net) DeviceOptimizer() bool { return n.adam != nil }

// AccumulateMicro runs one micro-batch and adds the gradient of loss × scale into the device
// gradient (first: set it instead). It returns the mean loss.
func (n *Net) AccumulateMicro(b *data.Batch, scale float32, first bool) (float32, error) {
	beta := float32(1)
	if first {
		beta = 0
	}
	return n.run(b, scale, beta)
}

// ZeroGrads clears the device gradient.
func (n *Net) ZeroGrads() error {
	n.dev.Fill(n.grads, 0)
	return n.dev.Sync()
}

// ReduceGrads averages the device gradient across the group (comm nil: one worker, nothing
// to do), on the wire in the working precision like the host path.
func (n *Net) ReduceGrads(ctx context.Context, comm collective.Communicator, wire half.Format) error {
	if comm == nil || comm.Size() == 1 {
		return nil
	}
	if r, ok := comm.(DeviceReducer); ok {
		// The reducer runs on its own stream: the gradient's kernels must be done first.
		if err := n.dev.Sync(); err != nil {
			return fmt.Errorf("engine: before the gradient all-reduce: %w", err)
		}
		if err := r.AllReduceBuf(ctx, n.grads, collective.Avg); err != nil {
			return fmt.Errorf("engine: all-reducing the gradient on the device: %w", err)
		}
		return nil
	}
	if err := n.dev.Download(n.gbuf, n.grads); err != nil {
		return fmt.Errorf("engine: copying the gradient to the host: %w", err)
	}
	if err := comm.AllReduce(ctx, n.gbuf, collective.Avg, collective.Call{Wire: wire}); err != nil {
		return fmt.Errorf("engine: all-reducing the gradient: %w", err)
	}
	n.dev.Upload(n.grads, n.gbuf)
	return n.dev.Sync()
}

// CheckGrads unscales the device gradient by unscale and returns whether it held an Inf or
// NaN, and its squared norm after unscaling.
func (n *Net) CheckGrads(unscale float32) (overflow bool, sumsq float64, err error) {
	if n.adam == nil {
		return false, 0, errors.New("engine: the device optimizer is not enabled")
	}
	return n.adam.Check(n.grads, unscale)
}

// StepDevice applies one AdamW step to the device gradient × gradScale and writes the working
// weights on the device. It returns the optimizer's step count.
func (n *Net) StepDevice(lr, gradScale float32) (int64, error) {
	if n.adam == nil {
		return 0, errors.New("engine: the device optimizer is not enabled")
	}
	if err := n.adam.Step(n.grads, n.params.Slice(n.layout.Frozen, n.layout.Size), lr, gradScale); err != nil {
		return 0, err
	}
	return n.adam.Steps(), nil
}

// PullState copies the device's state to the host: the working weights into Params, and the
// fp32 master weights and moments of the trainable part into master, m and v (each
// len Layout().Trainable()). It returns the optimizer's step count.
func (n *Net) PullState(master, m, v []float32) (int64, error) {
	if n.adam == nil {
		return 0, errors.New("engine: the device optimizer is not enabled")
	}
	if err := n.dev.Download(n.host, n.params); err != nil {
		return 0, fmt.Errorf("engine: copying the weights to the host: %w", err)
	}
	for _, c := range []struct {
		dst []float32
		src Buf
	}{{master, n.adam.master}, {m, n.adam.m}, {v, n.adam.v}} {
		if err := n.dev.Download(c.dst, c.src); err != nil {
			return 0, fmt.Errorf("engine: copying the optimizer state to the host: %w", err)
		}
	}
	return n.adam.steps, nil
}

// PushState loads host state into the device: Params into the working weights, and master,
// m and v (the trainable part, fp32) into the device optimizer at step count steps.
func (n *Net) PushState(master, m, v []float32, steps int64) error {
	if n.adam == nil {
		return errors.New("engine: the device optimizer is not enabled")
	}
	if len(master) != n.adam.master.N || len(m) != n.adam.m.N || len(v) != n.adam.v.N {
		return fmt.Errorf("engine: optimizer state of %d/%d/%d values for %d parameters", len(master), len(m), len(v), n.adam.master.N)
	}
	n.dev.Upload(n.params, n.host)
	n.dev.Upload(n.adam.master, master)
	n.dev.Upload(n.adam.m, m)
	n.dev.Upload(n.adam.v, v)
	if err := n.dev.Sync(); err != nil {
		return fmt.Errorf("engine: loading the optimizer state on the device: %w", err)
	}
	n.adam.steps = steps
	return nil
}
