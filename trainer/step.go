package trainer

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/memory"
)

// A step is collect → reduce → decide → apply, then report: the micro-batches run and their
// gradient accumulates (collect); the gradient and the step's scalars are reduced across the
// group (reduce); the pure decide turns the reduced statistics into the step's decision; the
// decision is applied to the weights, the scaler and the counters (apply); and it is logged
// and recorded (report).

// collected is what one rank's micro-batches produced.
type collected struct {
	lossSum float64 // the sum of the mean losses of the micro-batches that ran
	ran     int     // micro-batches that ran (the others ran out of memory)
}

// votes are the flags every rank reports with the step's loss, so every rank stops or adapts
// at the same step.
type votes struct {
	stop       bool // a rank was asked to stop, or failed to write its metrics
	adapt      bool // a rank wants the micro-batch halved
	sinkFailed bool // a rank failed to write its metrics
	regroup    bool // members wait to join the group (Setup.Admit)
}

// stepTimes is where the step's time went (metrics' phase_seconds): the micro-batches'
// forward and backward passes (with overlap_comm, the reductions run beside them), the wait
// for the gradient after them, the time the reductions themselves took, and the optimizer
// (which at ZeRO stages 1-2 without overlap_comm includes the parameters' all-gather; with it
// the gather runs under the next step's forward pass; stepRecord gives it alone either way).
type stepTimes struct {
	fb, wait, reduction, optimizer float64
	gathered                       float64 // the engine's GatherSeconds between the gradient's reduction and the optimizer
}

// runStep performs one optimizer step. It reports stop when any rank has been asked to stop
// (ctx cancelled); collectives run on cctx.
func (t *Trainer) runStep(ctx, cctx context.Context, res *Result) (stop bool, err error) {
	start := t.out.clock.Now()
	if err := t.stepper.BeginStep(t.cfg.Accum); err != nil {
		return false, fmt.Errorf("step %d: %w", t.pos.step+1, err)
	}
	pre := t.stepState()
	policy := t.policy()
	scale := policy.scale(pre)
	var times stepTimes
	commBefore := t.eng.CommSeconds()
	col, err := t.collect(cctx, scale, &times)
	if err != nil {
		return false, err
	}
	stats, v, err := t.reduce(ctx, cctx, col, scale, &times)
	if err != nil {
		return false, err
	}
	times.reduction = t.eng.CommSeconds() - commBefore
	// The last step's prefetched all-gather has ended by now (SumSquares waits for it), and
	// this step's has not begun.
	times.gathered = t.eng.GatherSeconds()
	d := policy.decide(stats, pre)
	if t.snap != nil {
		if err := t.snap.settle(); err != nil {
			return false, fmt.Errorf("step %d: %w", t.pos.step+1, err)
		}
	}
	t.pos.step++
	t.pos.offset += t.spec.global
	if err := t.apply(cctx, d, &times); err != nil {
		return false, err
	}
	t.logDecision(d)
	if d.LossDiverged {
		return false, fmt.Errorf("step %d: the loss is %v: the run diverged", t.pos.step, d.Loss)
	}
	if err := t.report(res, t.stepRecord(d, stats, times), start); err != nil {
		return v.stop, err
	}
	// A stop wins over admitting members: the run ends at this step either way.
	t.group.regroup = v.regroup && !v.stop
	if v.adapt {
		if err := t.stepper.SyncParams(); err != nil {
			return v.stop, fmt.Errorf("after step %d: %w", t.pos.step, err)
		}
		if err := t.halveMicroBatch(); err != nil {
			return v.stop, fmt.Errorf("after step %d: %w", t.pos.step, err)
		}
	}
	return v.stop, nil
}

// policy is what decides the run's steps.
func (t *Trainer) policy() stepPolicy {
	p := stepPolicy{MaxGradNorm: t.cfg.MaxGradNorm, LR: t.spec.opt.LR, Schedule: t.spec.sched, TotalSteps: t.spec.totalSteps}
	if t.scaler != nil {
		p.Scaler = &t.scaler.cfg
	}
	return p
}

// stepState is the state the next step starts from.
func (t *Trainer) stepState() stepState {
	s := stepState{OptimizerSteps: t.eng.Optimizer().Steps()}
	if t.scaler != nil {
		s.Scaler = t.scaler.State()
	}
	return s
}

// collect runs the step's micro-batches, their gradient accumulating in the step engine. A
// micro-batch that runs out of memory is skipped (its rank takes part in the collectives
// with a zero gradient).
func (t *Trainer) collect(cctx context.Context, scale float64, times *stepTimes) (collected, error) {
	// The loss is divided by accum so the summed gradient is the mean over micro × accum
	// samples; the loss scale rides on the same multiplier.
	lossMul := float32(scale / float64(t.cfg.Accum))
	var c collected
	for j := 0; j < t.cfg.Accum; j++ {
		if err := t.nextMicroBatch(cctx, j); err != nil {
			return c, fmt.Errorf("step %d: filling micro-batch %d: %w", t.pos.step+1, j, err)
		}
		fb := t.beginPhase(memory.PhaseForwardBackward)
		fbStart := t.out.clock.Now()
		t.seedDropout(j)
		loss, err := t.stepper.Accumulate(cctx, t.data.batch, lossMul, c.ran == 0, j == t.cfg.Accum-1)
		times.fb += t.out.clock.Now().Sub(fbStart).Seconds()
		fb.end()
		if errors.Is(err, memory.ErrOutOfMemory) {
			t.skipMicroBatch(j, err)
			continue
		}
		if err != nil {
			return c, fmt.Errorf("step %d, micro-batch %d: %w", t.pos.step+1, j, err)
		}
		t.adapt.streak = 0
		c.lossSum += float64(loss)
		c.ran++
	}
	return c, nil
}

// reduce averages the gradient across the group and reduces the step's scalars: the loss
// (for logging), the micro-batches that ran, and the votes.
func (t *Trainer) reduce(ctx, cctx context.Context, c collected, scale float64, times *stepTimes) (stepStats, votes, error) {
	comm := t.beginPhase(memory.PhaseCommunication)
	commStart := t.out.clock.Now()
	if err := t.stepper.Reduce(cctx, c.ran); err != nil {
		return stepStats{}, votes{}, fmt.Errorf("step %d: %w", t.pos.step+1, err)
	}
	// The loss, for logging.
	loss := []float64{c.lossSum}
	if err := t.group.reduceScalars(cctx, loss, collective.Sum); err != nil {
		return stepStats{}, votes{}, fmt.Errorf("step %d: reducing the loss: %w", t.pos.step+1, err)
	}
	// The micro-batches that ran, a stop request, a request to adapt the micro-batch and a
	// failed metrics write: counted over the ranks.
	n := t.group.intBuf[:5]
	n[0], n[1], n[2], n[3] = int64(c.ran), vote(ctx.Err() != nil), vote(t.wantAdapt()), vote(t.out.sinkErr != nil)
	n[4] = vote(t.group.admit != nil && t.group.admit())
	if err := t.group.reduceInts(cctx, n, collective.Sum); err != nil {
		return stepStats{}, votes{}, fmt.Errorf("step %d: reducing the step's counters: %w", t.pos.step+1, err)
	}
	ran, v := int(n[0]), votes{stop: n[1] > 0 || n[3] > 0, adapt: n[2] > 0, sinkFailed: n[3] > 0, regroup: n[4] > 0}
	if v.sinkFailed && t.out.sinkErr == nil {
		t.out.sinkErr = errPeerSink
	}
	sumsq, err := t.stepper.SumSquares(cctx, scale)
	if err != nil {
		return stepStats{}, votes{}, fmt.Errorf("step %d: %w", t.pos.step+1, err)
	}
	comm.end()
	times.wait = t.out.clock.Now().Sub(commStart).Seconds()
	return stepStats{Ran: ran, LossSum: loss[0], SumSq: sumsq}, v, nil
}

// apply carries out a decision: the optimizer step, the scaler's new state, the counters.
func (t *Trainer) apply(cctx context.Context, d stepDecision, times *stepTimes) error {
	switch d.Action {
	case actDiverged:
		return fmt.Errorf("step %d: the gradient is not finite (loss %v) in %s: the run diverged; lower the learning rate or enable max_grad_norm",
			t.pos.step, d.Loss, t.spec.format)
	case actSkipEmpty, actSkipOverflow:
		t.pos.skipped++
	case actApply:
		opt := t.beginPhase(memory.PhaseOptimizer)
		optStart := t.out.clock.Now()
		if err := t.stepper.Apply(cctx, float32(d.LR), d.GradScale, d.Scale); err != nil {
			return fmt.Errorf("step %d: %w", t.pos.step, err)
		}
		times.optimizer = t.out.clock.Now().Sub(optStart).Seconds()
		opt.end()
	}
	if t.scaler != nil {
		t.scaler.set(d.Scaler)
	}
	return nil
}

// logDecision logs what is unusual in an applied decision.
func (t *Trainer) logDecision(d stepDecision) {
	switch {
	case d.Action == actSkipEmpty:
		t.log.Warn("every micro-batch of this step ran out of memory: skipping the optimizer step", zap.Int64("step", t.pos.step))
	case d.Action == actSkipOverflow:
		t.log.Warn("fp16 gradient overflow: skipping the optimizer step",
			zap.Int64("step", t.pos.step), zap.Float64("scale", d.Scale), zap.Float64("new_scale", d.Scaler.Scale), zap.Bool("scale_changed", d.ScaleChanged))
	case d.Action == actApply && d.ScaleChanged:
		t.log.Info("loss scale grew", zap.Int64("step", t.pos.step), zap.Float64("scale", d.Scaler.Scale))
	}
}

// stepRecord is the metrics record of a decided step.
func (t *Trainer) stepRecord(d stepDecision, st stepStats, times stepTimes) metrics.Record {
	rec := metrics.Record{Kind: metrics.KindTrain, Step: t.pos.step, Epoch: t.fracEpoch(), Loss: d.Loss,
		PhaseSeconds: map[string]float64{"forward_backward": times.fb, "gradient_wait": times.wait, "reduction": times.reduction}}
	if t.scaler != nil {
		rec.Scale = d.Scale
	}
	rec.OOMSkipped = t.cfg.Accum*t.group.world - st.Ran
	switch d.Action {
	case actSkipEmpty, actSkipOverflow:
		rec.Skipped = true
	case actApply:
		rec.PhaseSeconds["optimizer"] = times.optimizer
		if t.spec.zero.Stage > 0 && t.group.world > 1 {
			if t.eng.Prefetching() {
				// The last applied step's all-gather, which ran under this step's forward pass.
				rec.PhaseSeconds["param_gather"] = times.gathered - t.out.gathMark
				t.out.gathMark = times.gathered
			} else {
				rec.PhaseSeconds["param_gather"] = t.eng.GatherSeconds() - times.gathered
			}
		}
		rec.LR = d.LR
		rec.GradNorm = d.Norm
	}
	return rec
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
	z := t.spec.seed
	for _, v := range []uint64{uint64(t.pos.step), uint64(j), uint64(t.group.rank)} {
		z = (z ^ v) * 0x9E3779B97F4A7C15
		z ^= z >> 29
	}
	s.SetDropoutSeed(z)
}
