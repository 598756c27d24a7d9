package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/zero"
)

// Data parallelism: the global batch of micro × accum × world samples is split so that
// micro-batch j of rank r is perm[offset + j·world·micro + r·micro : +micro] (data.MicroBatch),
// i.e. the union over ranks of micro-batch j is exactly a single worker's micro-batch j of
// world·micro samples. Averaging the ranks' gradients therefore gives the single worker's
// gradient, whatever the ZeRO stage (zero.Engine) partitions afterwards, and every rank makes the
// same overflow, clipping and optimizer decisions without further agreement.

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
// checkpoint it resumed from — as DDP broadcasts the module state at construction: the
// training position, the full fp32 weights (each rank keeps its master shard), and, after a
// resume, the optimizer state streamed chunk by chunk from rank 0's checkpoint, each rank
// keeping the part that falls in its shard. Integer counters travel as 16-bit pieces (exact
// in float32) so no float rounding touches them.
func (t *Trainer) syncFromRank0(ctx context.Context) error {
	opt := t.eng.Optimizer()
	var st ScalerState
	if t.scaler != nil {
		st = t.scaler.State()
	}
	resumed := uint64(0)
	if t.resumed != nil {
		resumed = 1
	}
	counters := []uint64{uint64(t.step), uint64(t.epoch), uint64(t.offset), uint64(t.skipped), uint64(opt.Steps()),
		math.Float64bits(st.Scale), uint64(st.GoodSteps), uint64(st.HysteresisLeft), uint64(st.Overflows), t.ckptFlag(), resumed}
	if t.world > 1 {
		buf := make([]float32, 4*len(counters))
		for i, c := range counters {
			for k := 0; k < 4; k++ {
				buf[4*i+k] = float32(uint16(c >> (16 * k)))
			}
		}
		if err := t.broadcast(ctx, "the training position", buf); err != nil {
			return err
		}
		for i := range counters {
			var c uint64
			for k := 0; k < 4; k++ {
				c |= uint64(uint16(buf[4*i+k])) << (16 * k)
			}
			counters[i] = c
		}
		if err := t.broadcast(ctx, "the weights", t.initial); err != nil {
			return err
		}
	}
	t.setFrozen(t.initial[:t.layout.Frozen])
	t.eng.SetMaster(t.initial[t.layout.Frozen:])
	t.initialBlock.Free()
	t.initial, t.initialBlock = nil, nil
	if counters[10] == 1 {
		if err := t.loadOptimizerState(ctx); err != nil {
			return err
		}
	}
	t.resumed = nil
	t.step, t.epoch, t.offset, t.skipped = int64(counters[0]), int(counters[1]), int(counters[2]), int64(counters[3])
	opt.SetSteps(int64(counters[4]))
	if t.scaler != nil {
		st = ScalerState{Scale: math.Float64frombits(counters[5]), GoodSteps: int(counters[6]), HysteresisLeft: int(counters[7]), Overflows: int64(counters[8])}
		if err := t.scaler.SetState(st); err != nil {
			return fmt.Errorf("synchronising the loss scaler from rank 0: %w", err)
		}
	}
	if counters[9] == 1 {
		t.ckptStep = t.step // rank 0 resumed from a checkpoint at this step
	}
	t.log.Debug("state synchronised from rank 0", zap.Int64("step", t.step))
	return nil
}

// restoreChunk bounds the buffer the optimizer state streams through on resume.
const restoreChunk = 1 << 22

// loadOptimizerState fills every rank's optimizer shard from rank 0's checkpoint. The flat
// space is walked in chunks; rank 0 reads each chunk from whichever saved shards overlap it
// (the checkpoint may come from any world size and stage), broadcasts it with a status flag,
// and each rank copies the part inside its own shard. A read error on rank 0 fails every rank
// at the same chunk instead of leaving them waiting. The chunks land in float32 buffers: the
// optimizer's own state, or, for an optimizer that encodes its state (offload.StateCodec),
// decoded copies that it encodes again at the end.
func (t *Trainer) loadOptimizerState(ctx context.Context) error {
	n := t.layout.Trainable()
	lo, hi := t.eng.Shard()
	chunk := min(restoreChunk, max(n, 1))
	buf := make([]float32, chunk+1)
	state := offload.ExportState(t.eng.Optimizer())
	for _, nb := range state {
		for a := 0; a < n; a += chunk {
			b := min(a+chunk, n)
			part := buf[:b-a+1]
			var rerr error
			if t.rank == 0 {
				rerr = t.resumed.read(nb.Name, a, part[:b-a])
				part[b-a] = 0
				if rerr != nil {
					part[b-a] = 1
				}
			}
			if t.world > 1 {
				if err := t.broadcast(ctx, "optimizer state "+nb.Name, part); err != nil {
					return errors.Join(rerr, err)
				}
			}
			if rerr != nil {
				return rerr
			}
			if part[b-a] != 0 {
				return fmt.Errorf("resume: rank 0 could not read optimizer state %s [%d, %d) from its checkpoint", nb.Name, a, b)
			}
			if x, y, ok := zero.Overlap(a, b, lo, hi); ok {
				copy(nb.Data[x-lo:y-lo], part[x-a:y-a])
			}
		}
	}
	if err := offload.ImportState(t.eng.Optimizer(), state); err != nil {
		return fmt.Errorf("resume: optimizer state from the checkpoint: %w", err)
	}
	return nil
}

func (t *Trainer) broadcast(ctx context.Context, what string, b []float32) error {
	if err := t.comm.Broadcast(ctx, b, 0, collective.Call{}); err != nil {
		return fmt.Errorf("synchronising %s from rank 0: %w", what, err)
	}
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
