package trainer

import (
	"context"
	"fmt"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/zero"
)

// StepEngine is where a step's gradient lives and the optimizer runs: the ZeRO engine on the
// host (hostStep), or the model's device (deviceStep, over a DeviceStepper). The trainer
// picks one in New — and again for a model rebuilt by memory adaptation, through Rebind —
// and drives every step through it in this order: BeginStep, Accumulate once per
// micro-batch, Reduce, SumSquares, then Apply unless the step is skipped. Every method that
// takes a context may run collectives, which every rank calls alike.
type StepEngine interface {
	// SyncParams makes the model compute with the current weights, all of them: called before
	// evaluation and whatever else reads them between steps, after whatever wrote them (the
	// optimizer, the first broadcast, a resume).
	SyncParams() error
	// BeginStep starts a step of accum micro-batches, with the current weights; where the
	// model reads them in place, the last step's all-gather may still be arriving under the
	// forward pass (zero.Engine.Prefetching).
	BeginStep(accum int) error
	// Accumulate runs the forward and backward pass of micro-batch b, adding the gradient of
	// loss×lossMul, and returns the unscaled mean loss. first says no micro-batch of the step
	// has run yet, last that this is the step's last. A rank whose pass fails still takes
	// part in the group's collectives, with a zero gradient.
	Accumulate(ctx context.Context, b *data.Batch, lossMul float32, first, last bool) (float32, error)
	// Reduce averages the step's gradient across the group; ran is how many micro-batches of
	// this rank ran (with none, the rank adds nothing to the average).
	Reduce(ctx context.Context, ran int) error
	// SumSquares returns Σ g² of the reduced gradient, the loss scale included: non-finite
	// on overflow, and the same on every rank, so every rank decides alike.
	SumSquares(ctx context.Context, scale float64) (float64, error)
	// Apply is the optimizer step at learning rate lr on the gradient × gradScale (1/scale ×
	// the clipping factor); scale is the step's loss scale.
	Apply(ctx context.Context, lr float32, gradScale, scale float64) error
	// PushState loads the host's weights and optimizer state into the engine (after the
	// first broadcast or a resume); PullState brings the host's copies up to date from it
	// (for checkpoints, memory adaptation and the end of the run).
	PushState() error
	PullState() error
	// Buckets are the gradient buckets reduced while the backward pass goes on; nil where
	// the gradient is reduced in one piece after it.
	Buckets() []zero.Bucket
	// Rebind returns the engine for m, a model rebuilt over the same parameters.
	Rebind(m Model) (StepEngine, error)
}

// ParamSyncer is a Model that computes with its own copy of Params (the GPU engine's device
// buffer): SyncParams copies Params there. The host engine calls it before each step and
// each evaluation, after whatever wrote the weights (the optimizer, the first broadcast, a
// resume).
type ParamSyncer interface {
	SyncParams() error
}

// hostStep is the host path: the model hands its gradient to the ZeRO engine piece by piece
// (each bucket reduced as soon as it is complete), and the engine steps the optimizer on this
// rank's shard.
type hostStep struct {
	eng   *zero.Engine
	model Model
}

var _ StepEngine = (*hostStep)(nil)

func (h *hostStep) SyncParams() error {
	if err := h.eng.SettleParams(); err != nil {
		return fmt.Errorf("the parameters' all-gather: %w", err)
	}
	if s, ok := h.model.(ParamSyncer); ok {
		return s.SyncParams()
	}
	return nil
}

func (h *hostStep) BeginStep(accum int) error {
	if l, ok := h.model.(model.LazyParams); !ok || !l.ReadsParamsInPlace() {
		if err := h.SyncParams(); err != nil {
			return err
		}
	}
	return h.eng.BeginStep(accum)
}

// Accumulate feeds the gradient into the engine as the backward pass produces it: in the
// last micro-batch at stages 0-1, in every one at stage 2, the engine reduces each bucket
// as soon as it is complete. The engine's part is finished whether the pass succeeded or
// failed.
func (h *hostStep) Accumulate(ctx context.Context, b *data.Batch, lossMul float32, first, last bool) (float32, error) {
	h.eng.BeginMicro(ctx, first, last)
	loss, err := h.model.ForwardBackward(b, lossMul, h.eng)
	if eerr := h.eng.EndMicro(); err == nil {
		err = eerr
	}
	return loss, err
}

// Reduce waits for the engine's bucketed reduction; a rank whose micro-batches all failed
// has a cleared buffer, which adds nothing.
func (h *hostStep) Reduce(ctx context.Context, ran int) error { return h.eng.Reduce(ctx) }

func (h *hostStep) SumSquares(ctx context.Context, scale float64) (float64, error) {
	return h.eng.SumSquares(ctx)
}

func (h *hostStep) Apply(ctx context.Context, lr float32, gradScale, scale float64) error {
	return h.eng.Step(ctx, lr, float32(gradScale))
}

// The host engine's state is the host's: nothing to move.
func (h *hostStep) PushState() error { return nil }
func (h *hostStep) PullState() error { return nil }

func (h *hostStep) Buckets() []zero.Bucket {
	if bs := h.eng.ReduceBuckets(); bs != nil {
		return bs
	}
	return []zero.Bucket{}
}

func (h *hostStep) Rebind(m Model) (StepEngine, error) { return &hostStep{eng: h.eng, model: m}, nil }
