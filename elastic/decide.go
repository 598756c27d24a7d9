package elastic

import (
	"errors"
	"fmt"
)

// Source is where a re-formed group takes the training state from. New sources (the
// neighbours' in-memory shard copies) are added here and chosen by Decide.
type Source string

// Sources.
const (
	// FromMemory: every survivor holds the whole state (ZeRO stage 0, weights and optimizer
	// moments replicated): the new group's rank 0 broadcasts its copy, nothing is read.
	FromMemory Source = "memory"
	// FromSnapshot: stages 1-2, each lost rank's shard rebuilt from the copy its ring
	// neighbour kept (elastic.snapshot_every), the whole state resharded in memory.
	FromSnapshot Source = "snapshot"
	// FromCheckpoint: a lost rank's optimizer shard is gone (stages 1-2, no neighbour's copy
	// of it): the group resumes from the newest complete checkpoint, resharded to the new world.
	FromCheckpoint Source = "checkpoint"
)

// Action is what a group does after a loss.
type Action int

// Actions.
const (
	Continue Action = iota // re-form at the new world from Plan.Source
	Wait                   // fewer than min_nodes remain: wait up to rejoin_timeout for members
)

// Loss is what the survivors know when they re-form: after losing members, or to admit
// newcomers (then nothing is lost and Survivors is OldWorld).
type Loss struct {
	OldWorld, NewWorld int // the group's size before and after the re-form
	// Survivors is how many members of the old generation are in the new one; 0 means
	// NewWorld (no newcomers were admitted).
	Survivors int
	Stage     int   // ZeRO stage
	Step      int64 // the last step the survivors completed
	// Checkpoint is the step of the newest complete checkpoint, or -1 without one.
	Checkpoint int64
	// Micro and Accum are the configured micro-batch and accumulation, which were set for
	// BaseWorld members (0: OldWorld): the global batch to keep.
	Micro, Accum, BaseWorld int
	// FormerRank0: the survivors include the last generation's rank 0 (it breaks a tie).
	FormerRank0 bool
	// Dead is how many lost members are known to have ended (a refused connection, or a
	// restart under their name) rather than to be out of reach: they cannot be training on
	// the other side of a partition, so the quorum is taken of the others.
	Dead int
	// Whole: every survivor holds the whole state — ZeRO stage 0, or a re-form the group
	// planned at a step boundary (admitting members), which gathered it first.
	Whole bool
	// Snapshots: the survivors rebuilt the whole state from the neighbours' shard copies,
	// as of step SnapshotStep.
	Snapshots    bool
	SnapshotStep int64
}

// Plan is the decision.
type Plan struct {
	Action    Action
	Source    Source
	FromStep  int64 // the step training continues after
	LostSteps int64 // completed steps to be trained again
	Accum     int   // the accumulation at the new world
	// Warning, when set, is to be logged: the global batch changed (keep_global_batch false).
	Warning string
}

// Errors of Decide.
var (
	// ErrNoState: the lost rank's shard is gone and there is no checkpoint to continue from.
	ErrNoState = errors.New("elastic: no state to continue from")
	// ErrGlobalBatch: keep_global_batch, and the global batch cannot be split at the new world.
	ErrGlobalBatch = errors.New("elastic: the global batch cannot be kept")
	// ErrMinority: the survivors are not a quorum of the last generation, so the other side
	// of a partition may be training on; this side stops rather than diverge.
	ErrMinority = errors.New("elastic: not a majority of the last generation")
)

// Decide is the group's decision after losing members. Survivors that are not a quorum of
// the last generation stop (ErrMinority): more than half of its members not known to have
// ended (Dead), or exactly half including its rank 0, so at most one side of a partition
// trains on and writes checkpoints.
// A world below min_nodes waits (the caller fails with the loss once rejoin_timeout passes);
// otherwise it continues from memory where the survivors hold the whole state (Whole), from
// the neighbours' shard copies where they rebuilt it (Snapshots), or from the newest
// checkpoint where that is newer or there is nothing else, with the accumulation Accum gives for the configured
// global batch.
func Decide(cfg Config, l Loss) (Plan, error) {
	surv := l.Survivors
	if surv == 0 {
		surv = l.NewWorld
	}
	if voters := l.OldWorld - l.Dead; 2*surv < voters || (2*surv == voters && !l.FormerRank0) {
		dead := ""
		if l.Dead > 0 {
			dead = fmt.Sprintf(" and %d are known to have ended", l.Dead)
		}
		return Plan{}, fmt.Errorf("%w: %d of its %d members remain here%s (a quorum is more than half of those not known to have ended, or exactly half with its rank 0); the other side may be training on, so this side stops",
			ErrMinority, surv, l.OldWorld, dead)
	}
	if l.NewWorld < cfg.MinNodes {
		return Plan{Action: Wait}, nil
	}
	p := Plan{Action: Continue, Source: FromMemory, FromStep: l.Step}
	if l.Stage > 0 && !l.Whole {
		switch {
		case l.Snapshots && l.SnapshotStep >= l.Checkpoint:
			p.Source, p.FromStep, p.LostSteps = FromSnapshot, l.SnapshotStep, max(0, l.Step-l.SnapshotStep)
		case l.Checkpoint >= 0:
			p.Source, p.FromStep, p.LostSteps = FromCheckpoint, l.Checkpoint, max(0, l.Step-l.Checkpoint)
		default:
			return Plan{}, fmt.Errorf("%w: ZeRO stage %d shards the optimizer state and the lost rank's shard is gone, with no neighbour's copy of it (two neighbours lost together, or elastic.snapshot_every -1); there is no complete checkpoint in checkpoint.dir to resume from (set checkpoint.every_steps, or use zero_optimization.stage 0, whose survivors hold the whole state)",
				ErrNoState, l.Stage)
		}
	}
	base := l.BaseWorld
	if base == 0 {
		base = l.OldWorld
	}
	accum, warn, err := Accum(l.Micro, l.Accum, base, l.NewWorld, cfg.KeepGlobalBatch)
	if err != nil {
		return Plan{}, err
	}
	p.Accum, p.Warning = accum, warn
	return p, nil
}

// Accum is the accumulation at newWorld that keeps micro × accum × oldWorld samples per step.
// When that is not a whole number: with keep an error saying why, without it the nearest
// accumulation (at least 1) and a warning naming the new global batch.
func Accum(micro, accum, oldWorld, newWorld int, keep bool) (int, string, error) {
	global := micro * accum * oldWorld
	per := micro * newWorld // samples per accumulation step at the new world
	if global%per == 0 {
		return global / per, "", nil
	}
	near := max(1, (global+per/2)/per)
	if keep {
		return 0, "", fmt.Errorf("%w: the global batch is %d (micro_batch %d × accum %d × world %d), not a multiple of micro_batch × new world = %d × %d = %d; set elastic.keep_global_batch: false to continue with accum %d (global batch %d), or choose a micro_batch that divides it",
			ErrGlobalBatch, global, micro, accum, oldWorld, micro, newWorld, per, near, near*per)
	}
	return near, fmt.Sprintf("the global batch changes from %d to %d (micro_batch %d × accum %d × world %d): it cannot be kept at world %d (elastic.keep_global_batch is false)",
		global, near*per, micro, near, newWorld, newWorld), nil
}
