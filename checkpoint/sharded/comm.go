package sharded

import (
	"context"
	"errors"
	"fmt"

	"github.com/qvd/qvd/collective"
)

// Comm is the part of a collective.Communicator the protocol uses. A nil Comm, or one of
// size 1, is a single worker: no collective is called.
type Comm interface {
	Rank() int
	Size() int
	// AllReduceInt64 carries the status flags (Max: did any rank fail?).
	AllReduceInt64(ctx context.Context, v []int64, op collective.Op) error
	// Broadcast carries the optimizer state, chunk by chunk, from rank 0.
	Broadcast(ctx context.Context, buf []float32, root int, c collective.Call) error
}

var _ Comm = collective.Communicator(nil)

// group is a Comm with the single-worker case folded in.
type group struct{ c Comm }

func (g group) rank() int {
	if g.c == nil {
		return 0
	}
	return g.c.Rank()
}

func (g group) alone() bool { return g.c == nil || g.c.Size() == 1 }

// anyFailed tells every rank whether any rank passed failed = true.
func (g group) anyFailed(ctx context.Context, failed bool) (bool, error) {
	if g.alone() {
		return failed, nil
	}
	flag := []int64{0}
	if failed {
		flag[0] = 1
	}
	if err := g.c.AllReduceInt64(ctx, flag, collective.Max); err != nil {
		return false, err
	}
	return flag[0] != 0, nil
}

// ErrSaveFailed is what ranks report when another rank failed a phase of a save.
var ErrSaveFailed = errors.New("rank 0 failed to write the checkpoint")

// Agree tells every rank whether any rank failed a phase of a save (werr != nil on it): it
// returns this rank's own error, or an error matching ErrSaveFailed when only another rank
// failed, so a failed save fails every rank together. Every rank calls it.
func Agree(ctx context.Context, comm Comm, step int64, werr error, phase string) error {
	failed, err := group{comm}.anyFailed(ctx, werr != nil)
	if err != nil {
		return errors.Join(werr, fmt.Errorf("agreeing on the checkpoint at step %d (%s): %w", step, phase, err))
	}
	if werr != nil {
		return werr
	}
	if failed {
		return fmt.Errorf("checkpoint at step %d (%s): %w", step, phase, ErrSaveFailed)
	}
	return nil
}
