package trainer

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
)

// adaptState is the trainer's reaction to memory trouble: micro-batches skipped on an
// out-of-memory error, and halving the micro-batch (doubling accumulation) at run time.
type adaptState struct {
	rebuild    func(microBatch int) (Model, error)
	onPressure bool  // halve on host memory pressure (memory.adapt)
	after      int   // consecutive OOM micro-batches before halving (0 = defaultOOMAdaptAfter)
	streak     int   // consecutive OOM micro-batches on this rank
	skipped    int64 // OOM micro-batches skipped on this rank
	halvings   int
	lastStep   int64 // the step after which the micro-batch was last halved
	stuck      bool  // the micro-batch cannot be halved any more (odd, 1, or no Rebuild)
}

const (
	defaultOOMAdaptAfter = 3
	pressureCooldown     = 50
)

// skipMicroBatch drops micro-batch j after an out-of-memory error: what it held is garbage
// now, its samples contribute nothing to this step, and the run goes on. The other ranks may be
// reducing this micro-batch's buckets; this rank takes part with a zero gradient (the model
// fails before it writes any, and microBatch has finished the engine's part).
func (t *Trainer) skipMicroBatch(j int, err error) {
	t.adapt.skipped++
	t.adapt.streak++
	t.log.Warn("out of memory in a micro-batch: skipping it",
		zap.Int64("step", t.pos.step+1), zap.Int("micro_batch_index", j), zap.Int("micro_batch", t.cfg.MicroBatch),
		zap.Int("consecutive", t.adapt.streak), zap.Int64("skipped_total", t.adapt.skipped), zap.Error(err))
}

// wantAdapt is this rank's vote for halving the micro-batch after this step: too many
// consecutive out-of-memory micro-batches, or host pressure with memory.adapt on.
func (t *Trainer) wantAdapt() bool {
	a := &t.adapt
	if a.stuck {
		return false
	}
	after := a.after
	if after <= 0 {
		after = defaultOOMAdaptAfter
	}
	if a.streak >= after {
		return true
	}
	// Pressure lingers for a while after a halving (the collector has to catch up): give each
	// halving pressureCooldown steps before the next.
	if a.onPressure && (a.halvings == 0 || t.pos.step-a.lastStep >= pressureCooldown) {
		if p, _ := t.out.mon.Pressure(); p {
			return true
		}
	}
	return false
}

// halveMicroBatch rebuilds the model at half the micro-batch and doubles accumulation, so
// micro × accum × world — the global batch, the samples of each step — stays the same and
// the run continues without a restart (the memory guides restart the job by hand). Every rank
// does it after the same step: the vote travels with the step's loss all-reduce.
func (t *Trainer) halveMicroBatch() error {
	a := &t.adapt
	m := t.cfg.MicroBatch
	switch {
	case a.rebuild == nil:
		a.stuck = true
		t.log.Warn("memory trouble, but this trainer cannot rebuild its model at a smaller micro-batch (no Setup.Rebuild); going on as is",
			zap.Int("micro_batch", m))
		return nil
	case m < 2 || m%2 != 0:
		a.stuck = true
		t.log.Warn("memory trouble, but the micro-batch cannot be halved exactly; going on as is (choose an even micro_batch to allow it)",
			zap.Int("micro_batch", m), zap.Int("accum", t.cfg.Accum))
		return nil
	}
	if err := t.stepper.PullState(); err != nil { // the device state goes with the old model
		return err
	}
	next, err := a.rebuild(m / 2)
	if err != nil {
		return fmt.Errorf("rebuilding the model at micro-batch %d: %w", m/2, err)
	}
	if next.MicroBatch() != m/2 || next.EvalBatch() != t.cfg.EvalBatch || len(next.Params()) != len(t.w.params) || &next.Params()[0] != &t.w.params[0] {
		return errors.New("the rebuilt model must share the parameter buffer and take the new micro-batch")
	}
	if c, ok := t.model.(interface{ Close() error }); ok {
		_ = c.Close()
	}
	t.model = next
	stepper, err := t.stepper.Rebind(next)
	if err != nil {
		return err
	}
	t.stepper = stepper
	t.cfg.MicroBatch, t.cfg.Accum = m/2, t.cfg.Accum*2
	t.data.batch = data.NewBatch(t.cfg.MicroBatch, t.data.train.SampleSize())
	a.streak = 0
	a.halvings++
	a.lastStep = t.pos.step
	why := "out-of-memory micro-batches"
	if p, reason := t.out.mon.Pressure(); p {
		why = reason
	}
	t.log.Warn("memory: halved the micro-batch and doubled accumulation; the global batch is unchanged",
		zap.Int64("after_step", t.pos.step), zap.Int("micro_batch", t.cfg.MicroBatch), zap.Int("accum", t.cfg.Accum),
		zap.Int("global_batch", t.spec.global), zap.String("why", why))
	if t.out.metrics != nil && t.out.sinkErr == nil { // an event on the dashboard
		ev := metrics.Record{Kind: metrics.KindEvent, Time: float64(t.out.clock.Now().UnixNano()) / 1e9, Step: t.pos.step, Epoch: t.fracEpoch(),
			Event: metrics.EventMicroBatchHalved, Detail: fmt.Sprintf("micro-batch %d, accumulation %d (%s)", t.cfg.MicroBatch, t.cfg.Accum, why)}
		if err := t.out.metrics.Write(ev); err != nil {
			t.sinkFailed(err)
		}
	}
	return nil
}
