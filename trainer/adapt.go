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
func (t *Trainer) skipMicroBatch(j int, err error) error {
	t.adapt.skipped++
	t.adapt.streak++
	t.log.Warn("out of memory in a micro-batch: skipping it",
		zap.Int64("step", t.step+1), zap.Int("micro_batch_index", j), zap.Int("micro_batch", t.cfg.MicroBatch),
		zap.Int("consecutive", t.adapt.streak), zap.Int64("skipped_total", t.adapt.skipped), zap.Error(err))
	return nil
}

// wantAdapt is this rank's vote (1) for halving the micro-batch after this step: too many
// consecutive out-of-memory micro-batches, or host pressure with memory.adapt on.
func (t *Trainer) wantAdapt() float64 {
	a := &t.adapt
	if a.stuck {
		return 0
	}
	after := a.after
	if after <= 0 {
		after = defaultOOMAdaptAfter
	}
	if a.streak >= after {
		return 1
	}
	// Pressure lingers for a while after a halving (the collector has to catch up): give each
	// halving pressureCooldown steps before the next.
	if a.onPressure && (a.halvings == 0 || t.step-a.lastStep >= pressureCooldown) {
		if p, _ := t.mon.Pressure(); p {
			return 1
		}
	}
	return 0
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
	if err := t.pullDevice(); err != nil { // the device state goes with the old model
		return err
	}
	next, err := a.rebuild(m / 2)
	if err != nil {
		return fmt.Errorf("rebuilding the model at micro-batch %d: %w", m/2, err)
	}
	if next.MicroBatch() != m/2 || next.EvalBatch() != t.cfg.EvalBatch || len(next.Params()) != len(t.params) || &next.Params()[0] != &t.params[0] {
		return errors.New("the rebuilt model must share the parameter buffer and take the new micro-batch")
	}
	if c, ok := t.model.(interface{ Close() error }); ok {
		_ = c.Close()
	}
	t.model = next
	if t.dev != nil {
		t.dev = nil
		if err := t.enableDeviceStep(); err != nil {
			return err
		}
		if err := t.pushDevice(); err != nil {
			return err
		}
	}
	t.cfg.MicroBatch, t.cfg.Accum = m/2, t.cfg.Accum*2
	t.batch = data.NewBatch(t.cfg.MicroBatch, t.train.SampleSize())
	a.streak = 0
	a.halvings++
	a.lastStep = t.step
	why := "out-of-memory micro-batches"
	if p, reason := t.mon.Pressure(); p {
		why = reason
	}
	t.log.Warn("memory: halved the micro-batch and doubled accumulation; the global batch is unchanged",
		zap.Int64("after_step", t.step), zap.Int("micro_batch", t.cfg.MicroBatch), zap.Int("accum", t.cfg.Accum),
		zap.Int("global_batch", t.global), zap.String("why", why))
	if t.metrics != nil && t.sinkErr == nil { // an event on the dashboard
		ev := metrics.Record{Kind: metrics.KindEvent, Time: float64(t.clock.Now().UnixNano()) / 1e9, Step: t.step, Epoch: t.fracEpoch(),
			Event: metrics.EventMicroBatchHalved, Detail: fmt.Sprintf("micro-batch %d, accumulation %d (%s)", t.cfg.MicroBatch, t.cfg.Accum, why)}
		if err := t.metrics.Write(ev); err != nil {
			t.sinkFailed(err)
		}
	}
	return nil
}
