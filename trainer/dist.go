package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
)

// Data parallelism (ZeRO stage 0 / DDP): every rank holds the whole model and optimizer; the
// global batch of micro × accum × world samples is split so that micro-batch j of rank r is
// perm[offset + j·world·micro + r·micro : +micro] (data.MicroBatch), i.e. the union over
// ranks of micro-batch j is exactly a single worker's micro-batch j of world·micro samples.
// Averaging the ranks' gradients therefore gives the single worker's gradient, and because
// every rank then holds identical gradient bits, every rank makes the same overflow, clipping
// and optimizer decisions without further agreement.

// reduceGrads averages the accumulated gradient across ranks, bucket by bucket, with the
// working precision on the wire (fp16/bf16 halve the bytes).
func (t *Trainer) reduceGrads(ctx context.Context) error {
	if t.world == 1 {
		return nil
	}
	op := collective.Avg
	if t.format == half.FP16 {
		// Loss-scaled fp16 partial sums of N ranks could overflow on the wire where their
		// average would not; divide first (DeepSpeed's gradient predivision) and sum.
		t.pool.Scale(t.grads, 1/float32(t.world))
		op = collective.Sum
	}
	bucket := t.bucketElems()
	for lo := 0; lo < len(t.grads); lo += bucket {
		hi := min(lo+bucket, len(t.grads))
		if err := t.comm.AllReduce(ctx, t.grads[lo:hi], op, collective.Call{Wire: t.format}); err != nil {
			return fmt.Errorf("all-reduce of gradient bucket [%d, %d): %w", lo, hi, err)
		}
	}
	return nil
}

// bucketElems is the all-reduce bucket size in elements of the working precision.
func (t *Trainer) bucketElems() int {
	return max(1, t.cfg.BucketBytes/t.format.Bytes())
}

// reduceScalars sums a few float64 figures across ranks (exactly, as long as they are
// integers below 2^24 or the loss values whose mean is only logged).
func (t *Trainer) reduceScalars(ctx context.Context, v []float64, op collective.Op) error {
	if t.world == 1 {
		return nil
	}
	buf := t.scalarBuf[:len(v)]
	for i, x := range v {
		buf[i] = float32(x)
	}
	if err := t.comm.AllReduce(ctx, buf, op, collective.Call{}); err != nil {
		return err
	}
	for i := range v {
		v[i] = float64(buf[i])
	}
	return nil
}

// syncFromRank0 makes every rank start from rank 0's state — its initialisation or the
// checkpoint it resumed from — as DDP broadcasts the module state at construction. Integer
// counters travel as 16-bit pieces (exact in float32) so no float rounding touches them.
func (t *Trainer) syncFromRank0(ctx context.Context) error {
	if t.world == 1 {
		return nil
	}
	var st ScalerState
	if t.scaler != nil {
		st = t.scaler.State()
	}
	counters := []uint64{uint64(t.step), uint64(t.epoch), uint64(t.offset), uint64(t.skipped), uint64(t.opt.Steps()),
		math.Float64bits(st.Scale), uint64(st.GoodSteps), uint64(st.HysteresisLeft), uint64(st.Overflows), t.ckptFlag()}
	buf := make([]float32, 4*len(counters))
	for i, c := range counters {
		for k := 0; k < 4; k++ {
			buf[4*i+k] = float32(uint16(c >> (16 * k)))
		}
	}
	call := func(what string, b []float32) error {
		if err := t.comm.Broadcast(ctx, b, 0, collective.Call{}); err != nil {
			return fmt.Errorf("synchronising %s from rank 0: %w", what, err)
		}
		return nil
	}
	if err := call("the training position", buf); err != nil {
		return err
	}
	for i := range counters {
		var c uint64
		for k := 0; k < 4; k++ {
			c |= uint64(uint16(buf[4*i+k])) << (16 * k)
		}
		counters[i] = c
	}
	if err := call("the weights", t.master); err != nil {
		return err
	}
	for _, nb := range t.opt.State() {
		if err := call("optimizer state "+nb.Name, nb.Data); err != nil {
			return err
		}
	}
	t.step, t.epoch, t.offset, t.skipped = int64(counters[0]), int(counters[1]), int(counters[2]), int64(counters[3])
	t.opt.SetSteps(int64(counters[4]))
	if t.scaler != nil {
		st = ScalerState{Scale: math.Float64frombits(counters[5]), GoodSteps: int(counters[6]), HysteresisLeft: int(counters[7]), Overflows: int64(counters[8])}
		if err := t.scaler.SetState(st); err != nil {
			return fmt.Errorf("synchronising the loss scaler from rank 0: %w", err)
		}
	}
	if counters[9] == 1 {
		t.ckptStep = t.step // rank 0 resumed from a checkpoint at this step
	}
	if t.format != half.FP32 {
		t.roundParams()
	}
	t.log.Debug("state synchronised from rank 0", zap.Int64("step", t.step))
	return nil
}

func (t *Trainer) ckptFlag() uint64 {
	if t.lastCkpt != "" && t.ckptStep == t.step {
		return 1
	}
	return 0
}

// errSaveFailed is what ranks other than 0 report when rank 0 could not write a checkpoint.
var errSaveFailed = errors.New("rank 0 failed to write the checkpoint")
