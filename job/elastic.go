package job

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/elastic"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/trainer"
)

// Membership is an elastic job's group (elastic.min_nodes > 0): it reports the members it
// loses and re-forms the survivors as the next generation. The cluster member implements it
// over gossip and the rendezvous (clusterMembership); tests implement it in one process
// (Options.Membership), so that a rank can be dropped without memberlist.
type Membership interface {
	// Watch calls lost whenever the failure detector loses a member of the current
	// generation, until stop is called.
	Watch(lost func(error)) (stop func())
	// Reform forms the next generation of the members still alive after cause — at least
	// min of them, waiting up to wait for members to come back — and returns this process's
	// place in it. The previous generation's communicator is closed by then. The error,
	// when too few remain, wraps cause.
	Reform(ctx context.Context, cause error, min int, wait time.Duration) (Generation, error)
}

// Generation is one process's place in a re-formed group.
type Generation struct {
	Gen         uint64
	Rank, World int
	Comm        collective.Communicator
	// Close releases Comm and its transports (nil: the Membership does).
	Close func()
}

// ErrMemberLost wraps the failure detector's report of a lost member, with which the
// trainer's collectives are aborted.
var ErrMemberLost = errors.New("a member of the job was lost")

// lostMember says whether a run failed because a member of its group is gone — dead, hung or
// cut off — which an elastic job survives.
func lostMember(err error) bool {
	if errors.Is(err, ErrMemberLost) {
		return true
	}
	var pe *collective.PeerError
	if errors.As(err, &pe) {
		return errors.Is(pe.Err, collective.ErrPeerGone) || errors.Is(pe.Err, collective.ErrTimeout) ||
			errors.Is(pe.Err, collective.ErrAborted) || errors.Is(pe.Err, context.DeadlineExceeded)
	}
	return errors.Is(err, collective.ErrPeerGone) || errors.Is(err, collective.ErrTimeout)
}

// reformed is the next generation's trainer and what the re-form recorded.
type reformed struct {
	t   *trainer.Trainer
	rec metrics.Record
}

// reform carries out elastic training's answer to a lost member (elastic.Decide): it takes
// the survivors' state (stage 0: from memory), re-forms the group through mem, agrees on the
// state to continue from and the accumulation that keeps the global batch, and builds the
// next generation's trainer from setup. cause is the run's error; old is the trainer that
// failed, which the caller closes.
func (j *job) reform(ctx context.Context, mem Membership, old *trainer.Trainer, setup trainer.Setup, cause error) (reformed, error) {
	start := time.Now()
	oldWorld, oldRank := j.world, j.rank
	j.log.Warn("lost a member of the job: re-forming the group without it", zap.Int("world", oldWorld), zap.Error(cause))
	state, serr := old.TakeState()
	if serr != nil && !errors.Is(serr, trainer.ErrStateSharded) {
		return reformed{}, serr
	}
	j.closeComm()
	ecfg := j.cfg.Elastic
	if ecfg.Settle > 0 {
		t := time.NewTimer(ecfg.Settle) // let the failure detector's verdicts reach every survivor
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	g, err := mem.Reform(ctx, cause, ecfg.MinNodes, ecfg.RejoinTimeout)
	if err != nil {
		return reformed{}, err
	}
	j.rank, j.world, j.comm, j.closeGen = g.Rank, g.World, g.Comm, g.Close
	j.log.Info("re-formed the group", zap.Uint64("gen", g.Gen), zap.Int("old_rank", oldRank), zap.Int("rank", g.Rank),
		zap.Int("old_world", oldWorld), zap.Int("world", g.World))

	// Rank 0 of the new generation resolves the newest checkpoint and its step decides for
	// everyone (only rank 0 reads checkpoints); the survivors' steps may differ by one where
	// a rank finished a step's reduction that another did not.
	var from *checkpoint.Checkpoint
	ckptStep := int64(-1)
	if g.Rank == 0 && setup.Checkpoint.Dir != "" {
		if c, skipped, err := checkpoint.Resolve(checkpoint.ResumeAuto, setup.Checkpoint.Dir); err == nil {
			from, ckptStep = c, c.Step()
			for _, s := range skipped {
				j.log.Warn("skipping a checkpoint that failed verification", zap.Error(s))
			}
		} else if !errors.Is(err, checkpoint.ErrNoCheckpoint) {
			return reformed{}, fmt.Errorf("re-forming: looking for a checkpoint: %w", err)
		}
	}
	step := old.Step()
	agreed := []int64{math.MinInt64, math.MinInt64, step, 0}
	if g.Rank == 0 {
		agreed[0], agreed[1] = ckptStep, step
	}
	if oldRank == 0 {
		agreed[3] = 1 // the last generation's rank 0 is on this side (the quorum's tie-break)
	}
	if g.World > 1 {
		if err := g.Comm.AllReduceInt64(ctx, agreed, collective.Max); err != nil {
			return reformed{}, fmt.Errorf("re-forming: agreeing on the state: %w", err)
		}
	}
	ckptStep, rank0Step, maxStep := agreed[0], agreed[1], agreed[2]
	plan, err := elastic.Decide(ecfg, elastic.Loss{OldWorld: oldWorld, NewWorld: g.World, Stage: setup.Zero.Stage, Step: rank0Step,
		Checkpoint: ckptStep, Micro: setup.Config.MicroBatch, Accum: setup.Config.Accum, FormerRank0: agreed[3] == 1})
	switch {
	case err != nil:
		return reformed{}, fmt.Errorf("%w; %w", cause, err)
	case plan.Action == elastic.Wait: // Reform waited for min_nodes already
		return reformed{}, fmt.Errorf("%d of min_nodes %d members remain: %w", g.World, ecfg.MinNodes, cause)
	}
	if plan.Warning != "" {
		j.log.Warn(plan.Warning)
	}
	if plan.Source == elastic.FromMemory {
		plan.LostSteps = maxStep - rank0Step
		if state == nil {
			return reformed{}, fmt.Errorf("re-forming: %w", serr)
		}
		setup.State, setup.Resume = state, nil
	} else {
		plan.LostSteps = maxStep - plan.FromStep
		setup.State, setup.Resume = nil, from // rank 0 reads it; the others receive their shards
	}
	setup.Config.Accum = plan.Accum
	setup.Comm = g.Comm
	t, err := trainer.New(setup)
	if err != nil {
		return reformed{}, fmt.Errorf("re-forming: %w", err)
	}
	took := time.Since(start)
	rec := metrics.Record{Kind: metrics.KindEvent, Time: float64(time.Now().UnixNano()) / 1e9, Step: plan.FromStep,
		Event: metrics.EventReform, Detail: cause.Error(), Gen: g.Gen, World: g.World, OldWorld: oldWorld,
		Source: string(plan.Source), LostSteps: plan.LostSteps} // ResumeSeconds: at the first step (reformSink)
	j.log.Warn("continuing at the new world size", zap.Uint64("gen", g.Gen), zap.Int("old_world", oldWorld), zap.Int("world", g.World),
		zap.String("source", rec.Source), zap.Int64("from_step", plan.FromStep), zap.Int64("lost_steps", plan.LostSteps),
		zap.Int("accum", plan.Accum), zap.Duration("took", took.Round(time.Millisecond)))
	return reformed{t: t, rec: rec}, nil
}

// closeComm releases the current generation's communicator, where this job owns it.
func (j *job) closeComm() {
	if j.closeGen != nil {
		j.closeGen()
		j.closeGen = nil
	}
	if j.plane != nil {
		j.plane.Close()
		j.plane = nil
	}
}
