package trainer

import (
	"context"
	"encoding/binary"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint/sharded"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/optim"
)

// Data parallelism: the global batch of micro × accum × world samples is split so that
// micro-batch j of rank r is perm[offset + j·world·micro + r·micro : +micro] (data.MicroBatch),
// i.e. the union over ranks of micro-batch j is exactly a single worker's micro-batch j of
// world·micro samples. Averaging the ranks' gradients therefore gives the single worker's
// gradient, whatever the ZeRO stage (zero.Engine) partitions afterwards, and every rank makes the
// same overflow, clipping and optimizer decisions without further agreement.

// reduceScalars reduces a few float64 figures across ranks, in float32: for sums of losses,
// whose mean is only logged. Counters and flags go through reduceInts.
func (g *group) reduceScalars(ctx context.Context, v []float64, op collective.Op) error {
	if g.world == 1 {
		return nil
	}
	buf := g.scalarBuf[:len(v)]
	for i, x := range v {
		buf[i] = float32(x)
	}
	if err := g.comm.AllReduce(ctx, buf, op, collective.Call{}); err != nil {
		return err
	}
	for i := range v {
		v[i] = float64(buf[i])
	}
	return nil
}

// reduceInts reduces counters and flags across ranks, exactly.
func (g *group) reduceInts(ctx context.Context, v []int64, op collective.Op) error {
	if g.world == 1 {
		return nil
	}
	return g.comm.AllReduceInt64(ctx, v, op)
}

// anyTrue tells every rank whether b is true on any rank.
func (g *group) anyTrue(ctx context.Context, b bool) (bool, error) {
	v := g.intBuf[:1]
	v[0] = vote(b)
	if err := g.reduceInts(ctx, v, collective.Max); err != nil {
		return false, err
	}
	return v[0] != 0, nil
}

// vote is a flag as a count to reduce.
func vote(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// broadcast copies rank 0's b to every rank.
func (g *group) broadcast(ctx context.Context, what string, b []float32) error {
	if err := g.comm.Broadcast(ctx, b, 0, collective.Call{}); err != nil {
		return fmt.Errorf("synchronising %s from rank 0: %w", what, err)
	}
	return nil
}

// startState is what every rank takes from rank 0 before the first step: the training
// position, the optimizer's step count and the loss scaler's state. It travels as one
// fixed-size binary record (encoding/binary, little-endian).
type startState struct {
	Step, Epoch, Offset, Skipped int64
	OptimizerSteps               int64
	Scaler                       struct {
		Scale                     float64
		GoodSteps, HysteresisLeft int64
		Overflows                 int64
	}
	// AtCheckpoint: rank 0 resumed from (or saved) a checkpoint at Step.
	AtCheckpoint bool
	// Resumed: rank 0 resumed, and streams the optimizer state from its checkpoint.
	Resumed bool
	// FromMemory: rank 0 continues from a state in memory (Setup.State, elastic training)
	// and broadcasts its optimizer state; a rank admitted to the group holds none.
	FromMemory bool
}

// syncFromRank0 makes every rank start from rank 0's state — its initialisation or the
// checkpoint it resumed from — as DDP broadcasts the module state at construction: the
// training position, the full fp32 weights (each rank keeps its master shard), and, after a
// resume, the optimizer state streamed chunk by chunk from rank 0's checkpoint, each rank
// keeping the part that falls in its shard.
func (t *Trainer) syncFromRank0(ctx context.Context) error {
	opt := t.eng.Optimizer()
	var s startState
	s.Step, s.Epoch, s.Offset, s.Skipped = t.pos.step, int64(t.pos.epoch), int64(t.pos.offset), t.pos.skipped
	s.OptimizerSteps = opt.Steps()
	if t.scaler != nil {
		st := t.scaler.State()
		s.Scaler.Scale, s.Scaler.GoodSteps, s.Scaler.HysteresisLeft, s.Scaler.Overflows = st.Scale, int64(st.GoodSteps), int64(st.HysteresisLeft), st.Overflows
	}
	s.AtCheckpoint = t.ckpt.last != "" && t.ckpt.step == t.pos.step
	s.Resumed = t.ckpt.resumed != nil
	s.FromMemory = t.mem != nil
	if t.group.world > 1 {
		b, err := binary.Append(nil, binary.LittleEndian, &s)
		if err != nil {
			return fmt.Errorf("encoding the training position: %w", err)
		}
		if err := t.group.comm.BroadcastBytes(ctx, b, 0); err != nil {
			return fmt.Errorf("synchronising the training position from rank 0: %w", err)
		}
		if _, err := binary.Decode(b, binary.LittleEndian, &s); err != nil {
			return fmt.Errorf("decoding the training position from rank 0: %w", err)
		}
		if err := t.group.broadcast(ctx, "the weights", t.w.initial); err != nil {
			return err
		}
	}
	t.setFrozen(t.w.initial[:t.layout.Frozen])
	t.eng.SetMaster(t.w.initial[t.layout.Frozen:])
	t.w.releaseInitial()
	if s.Resumed {
		if err := t.loadOptimizerState(ctx); err != nil {
			return err
		}
	}
	if s.FromMemory {
		if err := t.loadMemoryState(ctx); err != nil {
			return err
		}
		t.mem = nil
	}
	t.ckpt.resumed = nil
	t.pos.step, t.pos.epoch, t.pos.offset, t.pos.skipped = s.Step, int(s.Epoch), int(s.Offset), s.Skipped
	opt.SetSteps(s.OptimizerSteps)
	if t.scaler != nil {
		st := ScalerState{Scale: s.Scaler.Scale, GoodSteps: int(s.Scaler.GoodSteps), HysteresisLeft: int(s.Scaler.HysteresisLeft), Overflows: s.Scaler.Overflows}
		if err := t.scaler.SetState(st); err != nil {
			return fmt.Errorf("synchronising the loss scaler from rank 0: %w", err)
		}
	}
	if s.AtCheckpoint {
		t.ckpt.step = t.pos.step // rank 0 resumed from a checkpoint at this step
	}
	t.group.synced = true
	t.log.Debug("state synchronised from rank 0", zap.Int64("step", t.pos.step))
	return nil
}

// loadOptimizerState fills every rank's optimizer shard from rank 0's checkpoint
// (sharded.LoadState). The chunks land in float32 buffers: the optimizer's own state, or,
// for an optimizer that encodes its state (optim.StateCodec), decoded copies that it
// encodes again at the end.
func (t *Trainer) loadOptimizerState(ctx context.Context) error {
	lo, hi := t.eng.Shard()
	state := optim.ExportState(t.eng.Optimizer())
	bufs := make([]sharded.Buffer, len(state))
	for i, nb := range state {
		bufs[i] = sharded.Buffer{Name: nb.Name, Data: nb.Data}
	}
	if err := sharded.LoadState(ctx, t.group.communicator(), t.ckpt.resumed, t.layout.Trainable(), lo, hi, bufs); err != nil {
		return err
	}
	if err := optim.ImportState(t.eng.Optimizer(), state); err != nil {
		return fmt.Errorf("resume: optimizer state from the checkpoint: %w", err)
	}
	return nil
}

// communicator is the group's communicator for the checkpoint protocol (nil: one worker).
func (g *group) communicator() sharded.Comm {
	if g.comm == nil {
		return nil
	}
	return g.comm
}
