package trainer

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/optim"
)

// State is a rank's whole training state at a step boundary, in memory: what a checkpoint
// holds, without the disk. Elastic training (package job) takes it from a survivor's
// trainer after a lost member and builds the next generation's trainer from it
// (Setup.State), at any world size and ZeRO stage.
type State struct {
	// Master is the full fp32 weights, the frozen prefix included (Layout().Size).
	Master []float32
	// Optimizer is the optimizer's state over every trainable parameter, float32, by name
	// (optim.ExportState's buffers, whole).
	Optimizer      []optim.NamedBuffer
	OptimizerSteps int64
	// Step, Epoch, Offset and Skipped are the training position (see Result).
	Step          int64
	Epoch, Offset int
	Skipped       int64
	Scaler        *ScalerState // nil unless fp16
}

// ErrStateSharded is TakeState's error where this rank holds only a shard of the optimizer
// state (ZeRO stages 1-2 in a group): the other shards died with their ranks.
var ErrStateSharded = errors.New("trainer: this rank holds only a shard of the optimizer state")

// ErrNotSynced is TakeState's error where Run failed before this rank received the group's
// state (a member admitted to a running job, or one resuming from a checkpoint): it holds none.
var ErrNotSynced = errors.New("trainer: this rank has not received the group's state")

// TakeState copies this rank's whole state after Run has returned: the last completed step's
// weights, optimizer state, scaler and position. A step Run abandoned (a lost peer) was not
// applied: its reductions come before the optimizer. It needs the whole optimizer state on
// this rank (ZeRO stage 0, or one worker), else ErrStateSharded. It runs no collective.
func (t *Trainer) TakeState() (*State, error) {
	switch {
	case t.group.gathered != nil: // Run ended with ErrRegroup
		s := t.group.gathered
		t.group.gathered = nil
		return s, nil
	case t.mem != nil: // Run failed before it loaded the state it was given: that is still it
		return t.mem, nil
	case !t.group.synced:
		return nil, ErrNotSynced
	}
	lo, hi := t.eng.Shard()
	if trainable := t.layout.Trainable(); lo != 0 || hi != trainable {
		return nil, fmt.Errorf("%w [%d, %d) of %d elements (ZeRO stage %d, world %d)", ErrStateSharded, lo, hi, trainable, t.spec.zero.Stage, t.group.world)
	}
	if err := t.stepper.PullState(); err != nil {
		return nil, fmt.Errorf("taking the training state: %w", err)
	}
	// A whole shard: Gather and FullMaster run no collective.
	s, err := t.wholeState(context.Background())
	if err != nil {
		return nil, fmt.Errorf("taking the training state: %w", err)
	}
	return s, nil
}

// wholeState copies the whole training state into a State, gathering the master weights and
// each optimizer buffer's shards: a collective at ZeRO stages 1-2 in a group.
func (t *Trainer) wholeState(ctx context.Context) (*State, error) {
	master, err := t.eng.FullMaster(ctx)
	if err != nil {
		return nil, err
	}
	s := &State{
		Master:         make([]float32, t.layout.Size),
		OptimizerSteps: t.eng.Optimizer().Steps(),
		Step:           t.pos.step, Epoch: t.pos.epoch, Offset: t.pos.offset, Skipped: t.pos.skipped,
	}
	f := t.layout.Frozen
	copy(s.Master[:f], t.frozenWeights())
	copy(s.Master[f:], master)
	for _, nb := range optim.ExportState(t.eng.Optimizer()) {
		full, err := t.eng.Gather(ctx, nb.Data)
		if err != nil {
			return nil, fmt.Errorf("the optimizer state %s: %w", nb.Name, err)
		}
		s.Optimizer = append(s.Optimizer, optim.NamedBuffer{Name: nb.Name, Data: full})
	}
	if t.scaler != nil {
		st := t.scaler.State()
		s.Scaler = &st
	}
	return s, nil
}

// ErrRegroup is Run's error when the group voted to admit members (Setup.Admit) at the step
// just completed: every rank has stopped there with the whole state gathered, for TakeState.
var ErrRegroup = errors.New("trainer: members wait to join the group")

// regroup ends Run for a re-form that admits members: it gathers the whole state on every
// rank — at ZeRO stages 1-2 each optimizer buffer's shards, a collective — so that every
// current member can continue from memory at the new world, and returns ErrRegroup.
func (t *Trainer) regroup(cctx context.Context) error {
	if err := t.stepper.PullState(); err != nil {
		return fmt.Errorf("gathering the training state: %w", err)
	}
	s, err := t.wholeState(cctx)
	if err != nil {
		return t.abortCause(cctx, fmt.Errorf("gathering the training state: %w", err))
	}
	t.group.gathered = s
	t.log.Info("members wait to join: ending this generation at a step boundary", zap.Int64("step", t.pos.step))
	return ErrRegroup
}

// useState starts this trainer from s (New, on every rank): the weights and position now, the
// optimizer state when Run starts (loadMemoryState), after rank 0's copy has been spread.
func (t *Trainer) useState(s *State) error {
	if len(s.Master) != t.layout.Size {
		return fmt.Errorf("trainer: the state holds %d weights, the model %d", len(s.Master), t.layout.Size)
	}
	want := optim.ExportState(t.eng.Optimizer())
	if len(want) != len(s.Optimizer) {
		return fmt.Errorf("trainer: the state holds %d optimizer buffers, the optimizer %d", len(s.Optimizer), len(want))
	}
	for i, nb := range s.Optimizer {
		if nb.Name != want[i].Name || len(nb.Data) != t.layout.Trainable() {
			return fmt.Errorf("trainer: the state's optimizer buffer %d is %s of %d elements, want %s of %d", i, nb.Name, len(nb.Data), want[i].Name, t.layout.Trainable())
		}
	}
	if t.scaler != nil && s.Scaler != nil {
		if err := t.scaler.SetState(*s.Scaler); err != nil {
			return fmt.Errorf("trainer: the state's loss scaler: %w", err)
		}
	}
	copy(t.w.initial, s.Master)
	t.eng.Optimizer().SetSteps(s.OptimizerSteps)
	t.pos = position{step: s.Step, epoch: s.Epoch, offset: s.Offset, skipped: s.Skipped}
	t.mem = s
	t.log.Info("continuing from the training state in memory", zap.Int64("step", s.Step), zap.Int("epoch", s.Epoch), zap.Int("epoch_offset", s.Offset))
	return nil
}

// loadMemoryState fills this rank's optimizer shard from the in-memory state: rank 0's copy,
// broadcast first so that every rank continues from the same state even if the survivors
// stopped a step apart. A rank without one (admitted to a running job) receives it.
func (t *Trainer) loadMemoryState(ctx context.Context) error {
	lo, hi := t.eng.Shard()
	state := optim.ExportState(t.eng.Optimizer())
	for i := range state {
		var buf []float32
		if t.mem != nil {
			buf = t.mem.Optimizer[i].Data
		} else {
			buf = make([]float32, t.layout.Trainable())
		}
		if t.group.world > 1 {
			if err := t.group.broadcast(ctx, "the optimizer state", buf); err != nil {
				return err
			}
		}
		copy(state[i].Data, buf[lo:hi])
	}
	if err := optim.ImportState(t.eng.Optimizer(), state); err != nil {
		return fmt.Errorf("the optimizer state from memory: %w", err)
	}
	return nil
}
