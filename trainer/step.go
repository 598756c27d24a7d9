package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/progress"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
)

// runStep performs one optimizer step: accum micro-batches, the gradient all-reduce, the
// overflow check, unscale + clip, the optimizer, re-rounding the working weights. It reports
// stop when any rank has been asked to stop (ctx cancelled); collectives run on cctx.
func (t *Trainer) runStep(ctx, cctx context.Context, res *Result) (stop bool, err error) {
	start := t.clock.Now()
	if err := t.syncModel(); err != nil {
		return false, fmt.Errorf("step %d: %w", t.step+1, err)
	}
	if err := t.eng.BeginStep(t.cfg.Accum); err != nil {
		return false, fmt.Errorf("step %d: %w", t.step+1, err)
	}
	scale := 1.0
	if t.scaler != nil {
		scale = t.scaler.Scale()
	}
	// The loss is divided by accum so the summed gradient is the mean over micro × accum
	// samples; the loss scale rides on the same multiplier.
	lossMul := float32(scale / float64(t.cfg.Accum))
	var lossSum float64
	ran := 0
	// Where the step's time goes (metrics' phase_seconds): the micro-batches' forward and
	// backward passes (with overlap_comm, the reductions run beside them), the wait for the
	// gradient after them, the optimizer; and the time the reductions themselves took.
	commBefore := t.eng.CommSeconds()
	var fbSecs float64
	for j := 0; j < t.cfg.Accum; j++ {
		if err := t.nextMicroBatch(cctx, j); err != nil {
			return false, fmt.Errorf("step %d: filling micro-batch %d: %w", t.step+1, j, err)
		}
		fb := t.beginPhase(memory.PhaseForwardBackward)
		fbStart := t.clock.Now()
		t.seedDropout(j)
		loss, err := t.microBatch(cctx, lossMul, ran == 0, j == t.cfg.Accum-1)
		fbSecs += t.clock.Now().Sub(fbStart).Seconds()
		fb.end()
		if errors.Is(err, memory.ErrOutOfMemory) {
			if err := t.skipMicroBatch(j, err); err != nil {
				return false, fmt.Errorf("step %d, micro-batch %d: %w", t.step+1, j, err)
			}
			continue
		}
		if err != nil {
			return false, fmt.Errorf("step %d, micro-batch %d: %w", t.step+1, j, err)
		}
		t.adapt.streak = 0
		lossSum += float64(loss)
		ran++
	}
	comm := t.beginPhase(memory.PhaseCommunication)
	commStart := t.clock.Now()
	if err := t.reduceGrads(cctx, ran); err != nil {
		return false, fmt.Errorf("step %d: %w", t.step+1, err)
	}
	// The loss (for logging), the stop request, a request to adapt the micro-batch and a
	// failed metrics write travel together, so every rank stops or adapts at the same step.
	wantStop, sinkFailed := 0.0, 0.0
	if ctx.Err() != nil {
		wantStop = 1
	}
	if t.sinkErr != nil {
		sinkFailed = 1
	}
	sc := []float64{lossSum, float64(ran), wantStop, t.wantAdapt(), sinkFailed}
	if err := t.reduceScalars(cctx, sc, collective.Sum); err != nil {
		return false, fmt.Errorf("step %d: reducing the loss: %w", t.step+1, err)
	}
	loss := math.NaN()
	if sc[1] > 0 {
		loss = sc[0] / sc[1] // mean over the micro-batches that ran, on all ranks
	}
	if sc[4] > 0 && t.sinkErr == nil {
		t.sinkErr = errPeerSink
	}
	stop = sc[2] > 0 || sc[4] > 0
	adaptNow := sc[3] > 0

	// One pass gives both the norm and the overflow check: any Inf/NaN makes the sum
	// non-finite. The sum is identical on every rank (the same gradient bits at stages 0-1,
	// the all-reduced sum of the shards' sums at stage 2), so every rank decides alike.
	sumsq, err := t.sumSquares(cctx, scale)
	if err != nil {
		return false, fmt.Errorf("step %d: %w", t.step+1, err)
	}
	comm.end()
	waitSecs := t.clock.Now().Sub(commStart).Seconds()
	overflow := math.IsNaN(sumsq) || math.IsInf(sumsq, 0)
	t.step++
	t.offset += t.global
	rec := metrics.Record{Kind: metrics.KindTrain, Step: t.step, Epoch: t.fracEpoch(), Loss: loss,
		PhaseSeconds: map[string]float64{"forward_backward": fbSecs, "gradient_wait": waitSecs, "reduction": t.eng.CommSeconds() - commBefore}}
	if t.scaler != nil {
		rec.Scale = scale
	}
	rec.OOMSkipped = t.cfg.Accum*t.world - int(sc[1]) // sc[1]: the micro-batches that ran, all ranks
	switch {
	case sc[1] == 0:
		// Every micro-batch of every rank ran out of memory: there is no gradient to apply.
		t.skipped++
		rec.Skipped = true
		t.log.Warn("every micro-batch of this step ran out of memory: skipping the optimizer step", zap.Int64("step", t.step))
	case overflow:
		if t.scaler == nil {
			return false, fmt.Errorf("step %d: the gradient is not finite (loss %v) in %s: the run diverged; lower the learning rate or enable max_grad_norm",
				t.step, loss, t.format)
		}
		_, changed := t.scaler.Update(true)
		t.skipped++
		rec.Skipped = true
		t.log.Warn("fp16 gradient overflow: skipping the optimizer step",
			zap.Int64("step", t.step), zap.Float64("scale", scale), zap.Float64("new_scale", t.scaler.Scale()), zap.Bool("scale_changed", changed))
	default:
		norm := math.Sqrt(sumsq) / scale
		gradScale := 1 / scale
		if t.cfg.MaxGradNorm > 0 && norm > t.cfg.MaxGradNorm {
			gradScale *= t.cfg.MaxGradNorm / (norm + 1e-6)
		}
		lr := t.optCfg.LR * t.sched.Factor(t.eng.Optimizer().Steps(), t.totalSteps)
		opt := t.beginPhase(memory.PhaseOptimizer)
		optStart := t.clock.Now()
		if err := t.optimizerStep(cctx, float32(lr), gradScale, scale); err != nil {
			return false, fmt.Errorf("step %d: %w", t.step, err)
		}
		rec.PhaseSeconds["optimizer"] = t.clock.Now().Sub(optStart).Seconds()
		opt.end()
		if t.scaler != nil {
			if _, changed := t.scaler.Update(false); changed {
				t.log.Info("loss scale grew", zap.Int64("step", t.step), zap.Float64("scale", t.scaler.Scale()))
			}
		}
		rec.LR = lr
		rec.GradNorm = norm
	}
	if sc[1] > 0 && (math.IsNaN(loss) || math.IsInf(loss, 0)) && t.scaler == nil {
		return false, fmt.Errorf("step %d: the loss is %v: the run diverged", t.step, loss)
	}
	if err := t.report(res, rec, start); err != nil {
		return stop, err
	}
	if adaptNow {
		if err := t.halveMicroBatch(); err != nil {
			return stop, fmt.Errorf("after step %d: %w", t.step, err)
		}
	}
	return stop, nil
}

// DropoutSeeder is a Model with dropout layers, whose masks the trainer seeds before each
// micro-batch.
type DropoutSeeder interface{ SetDropoutSeed(seed uint64) }

// seedDropout seeds micro-batch j's dropout masks from the run's seed, the step, j and the
// rank: a resumed run draws the same masks, and every rank its own.
func (t *Trainer) seedDropout(j int) {
	s, ok := t.model.(DropoutSeeder)
	if !ok {
		return
	}
	z := t.seed
	for _, v := range []uint64{uint64(t.step), uint64(j), uint64(t.rank)} {
		z = (z ^ v) * 0x9E3779B97F4A7C15
		z ^= z >> 29
	}
	s.SetDropoutSeed(z)
}

// microBatch runs the forward and backward pass of the filled micro-batch, its gradient
// going into the engine piece by piece as the backward pass produces it (the engine reduces
// each bucket as soon as it is complete: in the last micro-batch at stages 0-1, in every one at
// stage 2). first says no micro-batch of the step has run yet, last that this is the step's
// last. The engine's part is finished whether the pass succeeded or failed, so a rank that
// skips a micro-batch still takes part in its collectives, with a zero gradient.
func (t *Trainer) microBatch(cctx context.Context, lossMul float32, first, last bool) (float32, error) {
	if t.dev != nil {
		return t.dev.AccumulateMicro(t.batch, lossMul, first)
	}
	t.eng.BeginMicro(cctx, first, last)
	loss, err := t.model.ForwardBackward(t.batch, lossMul, t.eng)
	if eerr := t.eng.EndMicro(); err == nil {
		err = eerr
	}
	return loss, err
}

// report records a finished step in the metrics file and the progress line.
func (t *Trainer) report(res *Result, rec metrics.Record, start time.Time) error {
	dt := t.clock.Now().Sub(start).Seconds()
	if dt > 0 {
		rec.SamplesPerSec = float64(t.global) / dt
	}
	if t.emaStep == 0 {
		t.emaStep = dt
	} else {
		t.emaStep = 0.9*t.emaStep + 0.1*dt
	}
	t.observeMemory(&rec)
	rec.Time = float64(t.clock.Now().UnixNano()) / 1e9
	res.LastLoss = rec.Loss
	if t.metrics != nil && t.sinkErr == nil {
		if err := t.metrics.Write(rec); err != nil {
			t.sinkFailed(err)
		}
	}
	if t.progress != nil {
		st := progress.Status{Step: t.step, TotalSteps: t.totalSteps, Epoch: t.epoch + 1, Epochs: t.cfg.Epochs,
			Loss: rec.Loss, LR: rec.LR, LossScale: rec.Scale, ETA: -1}
		if t.emaStep > 0 {
			st.SamplesPerSec = float64(t.global) / t.emaStep
			st.ETA = time.Duration(float64(t.totalSteps-t.step) * t.emaStep * float64(time.Second))
		}
		t.progress.Update(st)
	}
	return nil
}

// evaluate is the evaluation after an epoch (or where max_steps ends one): the validation
// split where there is one, else the test split.
func (t *Trainer) evaluate(cctx context.Context, res *Result) error {
	if t.val == nil {
		return t.evaluateTest(cctx, res)
	}
	acc, loss, n, err := t.evalSplit(cctx, t.val)
	if err != nil || n == 0 {
		return err
	}
	res.ValAccuracy, res.ValLoss = acc, loss
	t.log.Info("validation", zap.Int64("step", t.step), zap.Float64("epoch", t.fracEpoch()),
		zap.Float64("val_accuracy", acc), zap.Float64("val_loss", loss), zap.Int("samples", n))
	t.writeEval(metrics.KindVal, acc, loss, n)
	return nil
}

// evaluateTest evaluates the test split, logs it as "evaluation" and records it.
func (t *Trainer) evaluateTest(cctx context.Context, res *Result) error {
	acc, loss, n, err := t.evalSplit(cctx, t.test)
	if err != nil || n == 0 {
		return err
	}
	res.TestAccuracy, res.TestLoss = acc, loss
	t.log.Info("evaluation", zap.Int64("step", t.step), zap.Float64("epoch", t.fracEpoch()),
		zap.Float64("test_accuracy", acc), zap.Float64("test_loss", loss), zap.Int("samples", n))
	t.writeEval(metrics.KindEval, acc, loss, n)
	return nil
}

// writeEval records an evaluation in the metrics.
func (t *Trainer) writeEval(kind string, acc, loss float64, n int) {
	if t.metrics == nil || t.sinkErr != nil {
		return
	}
	rec := metrics.Record{Kind: kind, Time: float64(t.clock.Now().UnixNano()) / 1e9, Step: t.step,
		Epoch: t.fracEpoch(), Loss: loss, Accuracy: acc, Samples: n}
	if err := t.metrics.Write(rec); err != nil {
		t.sinkFailed(err)
	}
}

// evalSplit runs the model over d; in a group each rank takes an even share of the samples
// and the sums are all-reduced. It returns the accuracy, the mean loss and the sample count
// (0: d is empty, and the others are unset).
func (t *Trainer) evalSplit(cctx context.Context, d *data.Dataset) (acc, loss float64, n int, err error) {
	if err := t.syncModel(); err != nil {
		return 0, 0, 0, fmt.Errorf("evaluation at step %d: %w", t.step, err)
	}
	shards := collective.EvenShards(d.N, t.world)
	lo, hi := shards[t.rank], shards[t.rank+1]
	var sum model.EvalResult
	for start := lo; start < hi; start += t.cfg.EvalBatch {
		count := min(t.cfg.EvalBatch, hi-start)
		if err := d.FillRange(t.evalBatch, start, count, t.norm); err != nil {
			return 0, 0, 0, fmt.Errorf("evaluation: %w", err)
		}
		r, err := t.model.Evaluate(t.evalBatch)
		if err != nil {
			return 0, 0, 0, fmt.Errorf("evaluation at step %d: %w", t.step, err)
		}
		sum.LossSum += r.LossSum
		sum.Correct += r.Correct
		sum.N += r.N
	}
	if c, ok := t.model.(CacheReleaser); ok {
		c.ReleaseCache()
	}
	tot := []float64{sum.LossSum, float64(sum.Correct), float64(sum.N)}
	if err := t.reduceScalars(cctx, tot, collective.Sum); err != nil {
		return 0, 0, 0, fmt.Errorf("evaluation at step %d: reducing results: %w", t.step, err)
	}
	if tot[2] == 0 {
		return 0, 0, 0, nil
	}
	return tot[1] / tot[2], tot[0] / tot[2], int(tot[2]), nil
}

// CacheReleaser is a Model whose allocator caches blocks (the native engine): after an
// evaluation the trainer has it give them back, since the training steps reuse none of the
// evaluation batch's.
type CacheReleaser interface {
	ReleaseCache()
}

// ParamSyncer is a Model that computes with its own copy of Params (the GPU engine's device
// buffer): SyncParams copies Params there. The trainer calls it before each step and each
// evaluation, after whatever wrote the weights (the optimizer, the first broadcast, a resume).
type ParamSyncer interface {
	SyncParams() error
}

func (t *Trainer) syncModel() error {
	if t.dev != nil {
		return nil // the device's weights are the current ones
	}
	if s, ok := t.model.(ParamSyncer); ok {
		return s.SyncParams()
	}
	return nil
}

// reduceGrads averages the step's gradient across the group: the engine's bucketed reduce on
// the host, or the device gradient's. ran is how many micro-batches of this rank ran (with
// none, the device gradient holds nothing of this step: it is zeroed first, so the rank adds
// nothing to the average, as the host path's cleared buffer does).
func (t *Trainer) reduceGrads(cctx context.Context, ran int) error {
	if t.dev == nil {
		return t.eng.Reduce(cctx)
	}
	if ran == 0 {
		if err := t.dev.ZeroGrads(); err != nil {
			return err
		}
	}
	return t.dev.ReduceGrads(cctx, t.comm, t.format)
}

// sumSquares returns Σ g² of the reduced gradient, loss scale included (non-finite on
// overflow). On the device the check also unscales the gradient in place; the result is
// scaled back so both paths report the same quantity.
func (t *Trainer) sumSquares(cctx context.Context, scale float64) (float64, error) {
	if t.dev == nil {
		return t.eng.SumSquares(cctx)
	}
	overflow, s, err := t.dev.CheckGrads(float32(1 / scale))
	if err != nil {
		return 0, err
	}
	// The averaged gradient is the same on every rank, and so its check; the flag is agreed
	// all the same (one float), so that no reduction's nondeterminism (NCCL's, on some
	// topologies) could make one rank step while another skips.
	flag := []float64{0}
	if overflow {
		flag[0] = 1
	}
	if err := t.reduceScalars(cctx, flag, collective.Max); err != nil {
		return 0, fmt.Errorf("agreeing on the overflow check: %w", err)
	}
	if flag[0] != 0 {
		return math.Inf(1), nil
	}
	return s * scale * scale, nil
}

// optimizerStep applies the optimizer with gradScale (1/loss scale × the clipping factor):
// on the host engine, or on the device, whose gradient is already unscaled.
func (t *Trainer) optimizerStep(cctx context.Context, lr float32, gradScale, scale float64) error {
	if t.dev == nil {
		return t.eng.Step(cctx, lr, float32(gradScale))
	}
	steps, err := t.dev.StepDevice(lr, float32(gradScale*scale))
	if err != nil {
		return err
	}
	t.eng.Optimizer().SetSteps(steps) // the LR schedule and checkpoints count steps there
	return nil
}
