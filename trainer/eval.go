package trainer

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/progress"
	"github.com/qvd/qvd/model"
)

// report records a finished step in the metrics file and the progress line.
func (t *Trainer) report(res *Result, rec metrics.Record, start time.Time) error {
	dt := t.out.clock.Now().Sub(start).Seconds()
	if dt > 0 {
		rec.SamplesPerSec = float64(t.spec.global) / dt
	}
	if t.out.emaStep == 0 {
		t.out.emaStep = dt
	} else {
		t.out.emaStep = 0.9*t.out.emaStep + 0.1*dt
	}
	t.observeMemory(&rec)
	rec.Time = float64(t.out.clock.Now().UnixNano()) / 1e9
	res.LastLoss = rec.Loss
	if t.out.metrics != nil && t.out.sinkErr == nil {
		if err := t.out.metrics.Write(rec); err != nil {
			t.sinkFailed(err)
		}
	}
	if t.out.progress != nil {
		st := progress.Status{Step: t.pos.step, TotalSteps: t.spec.totalSteps, Epoch: t.pos.epoch + 1, Epochs: t.cfg.Epochs,
			Loss: rec.Loss, LR: rec.LR, LossScale: rec.Scale, ETA: -1}
		if t.out.emaStep > 0 {
			st.SamplesPerSec = float64(t.spec.global) / t.out.emaStep
			st.ETA = time.Duration(float64(t.spec.totalSteps-t.pos.step) * t.out.emaStep * float64(time.Second))
		}
		t.out.progress.Update(st)
	}
	return nil
}

// evaluate is the evaluation after an epoch (or where max_steps ends one): the validation
// split where there is one, else the test split.
func (t *Trainer) evaluate(cctx context.Context, res *Result) error {
	if t.data.val == nil {
		return t.evaluateTest(cctx, res)
	}
	return t.evaluateSplit(cctx, t.data.val, "validation", "val", metrics.KindVal, &res.ValAccuracy, &res.ValLoss)
}

// evaluateTest evaluates the test split, logs it as "evaluation" and records it.
func (t *Trainer) evaluateTest(cctx context.Context, res *Result) error {
	return t.evaluateSplit(cctx, t.data.test, "evaluation", "test", metrics.KindEval, &res.TestAccuracy, &res.TestLoss)
}

// evaluateSplit evaluates d, stores its accuracy and loss in acc and loss, logs them as msg
// with fields named prefix_accuracy and prefix_loss, and records them as a kind record. An
// empty split leaves everything untouched.
func (t *Trainer) evaluateSplit(cctx context.Context, d *data.Dataset, msg, prefix, kind string, acc, loss *float64) error {
	a, l, n, err := t.evalSplit(cctx, d)
	if err != nil || n == 0 {
		return err
	}
	*acc, *loss = a, l
	t.log.Info(msg, zap.Int64("step", t.pos.step), zap.Float64("epoch", t.fracEpoch()),
		zap.Float64(prefix+"_accuracy", a), zap.Float64(prefix+"_loss", l), zap.Int("samples", n))
	t.writeEval(kind, a, l, n)
	return nil
}

// writeEval records an evaluation in the metrics.
func (t *Trainer) writeEval(kind string, acc, loss float64, n int) {
	if t.out.metrics == nil || t.out.sinkErr != nil {
		return
	}
	rec := metrics.Record{Kind: kind, Time: float64(t.out.clock.Now().UnixNano()) / 1e9, Step: t.pos.step,
		Epoch: t.fracEpoch(), Loss: loss, Accuracy: acc, Samples: n}
	if err := t.out.metrics.Write(rec); err != nil {
		t.sinkFailed(err)
	}
}

// evalSplit runs the model over d; in a group each rank takes an even share of the samples
// and the sums are all-reduced. It returns the accuracy, the mean loss and the sample count
// (0: d is empty, and the others are unset).
func (t *Trainer) evalSplit(cctx context.Context, d *data.Dataset) (acc, loss float64, n int, err error) {
	if err := t.stepper.SyncParams(); err != nil {
		return 0, 0, 0, fmt.Errorf("evaluation at step %d: %w", t.pos.step, err)
	}
	shards := collective.EvenShards(d.N, t.group.world)
	lo, hi := shards[t.group.rank], shards[t.group.rank+1]
	var sum model.EvalResult
	for start := lo; start < hi; start += t.cfg.EvalBatch {
		count := min(t.cfg.EvalBatch, hi-start)
		if err := d.FillRange(t.data.evalBatch, start, count, t.data.norm); err != nil {
			return 0, 0, 0, fmt.Errorf("evaluation: %w", err)
		}
		r, err := t.model.Evaluate(t.data.evalBatch)
		if err != nil {
			return 0, 0, 0, fmt.Errorf("evaluation at step %d: %w", t.pos.step, err)
		}
		sum.LossSum += r.LossSum
		sum.Correct += r.Correct
		sum.N += r.N
	}
	if c, ok := t.model.(CacheReleaser); ok {
		c.ReleaseCache()
	}
	lossSum := []float64{sum.LossSum}
	if err := t.group.reduceScalars(cctx, lossSum, collective.Sum); err != nil {
		return 0, 0, 0, fmt.Errorf("evaluation at step %d: reducing results: %w", t.pos.step, err)
	}
	counts := []int64{int64(sum.Correct), int64(sum.N)}
	if err := t.group.reduceInts(cctx, counts, collective.Sum); err != nil {
		return 0, 0, 0, fmt.Errorf("evaluation at step %d: reducing results: %w", t.pos.step, err)
	}
	if counts[1] == 0 {
		return 0, 0, 0, nil
	}
	return float64(counts[0]) / float64(counts[1]), lossSum[0] / float64(counts[1]), int(counts[1]), nil
}

// CacheReleaser is a Model whose allocator caches blocks (the native engine): after an
// evaluation the trainer has it give them back, since the training steps reuse none of the
// evaluation batch's.
type CacheReleaser interface {
	ReleaseCache()
}
