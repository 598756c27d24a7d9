package job

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/elastic"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/trainer"
)

// Membership is an elastic job's group (elastic.min_nodes > 0): it reports the members it
// loses, counts those waiting to join, and re-forms the group as the next generation. The
// cluster member implements it over gossip and the rendezvous (clusterMembership); tests
// implement it in one process (Options.Membership), so that a rank can be dropped without
// memberlist.
type Membership interface {
	// Watch calls lost whenever the failure detector loses a member of the current
	// generation, until stop is called.
	Watch(lost func(error)) (stop func())
	// Newcomers is how many members wait to join the current generation (asked by its rank
	// 0 at every step boundary).
	Newcomers() int
	// Reform forms the next generation of the members still alive after cause, with the
	// newcomers while it has fewer than max members — at least min of them, waiting up to
	// wait for members to come back — and returns this process's place in it. The previous
	// generation's communicator is closed by then. The error, when too few remain, wraps
	// cause.
	Reform(ctx context.Context, cause error, min, max int, wait time.Duration) (Generation, error)
}

// Generation is one process's place in a re-formed group.
type Generation struct {
	Gen         uint64
	Rank, World int
	Comm        collective.Communicator
	// Close releases Comm and its transports (nil: the Membership does).
	Close func()
	// Dead are the ranks, in the generation that trained, of the members known to have ended
	// (cluster.Node.Dead): they cannot be training on the other side of a partition.
	Dead []int
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

// reform carries out elastic training's answer to a lost member (elastic.Decide), or to
// members waiting to join (cause trainer.ErrRegroup: the group stopped at a step boundary
// with the whole state gathered): it takes this survivor's state where it holds all of it,
// re-forms the group through mem, agrees with the others — newcomers included — on the state
// to continue from and the accumulation that keeps the global batch, and builds the next
// generation's trainer from setup. old is the trainer that stopped, which the caller closes.
func (j *job) reform(ctx context.Context, mem Membership, old *trainer.Trainer, setup trainer.Setup, cause error) (reformed, error) {
	start := time.Now()
	oldWorld, oldRank := j.world, j.rank
	grow := errors.Is(cause, trainer.ErrRegroup)
	if grow {
		j.log.Info("members wait to join the job: re-forming the group with them", zap.Int("world", oldWorld))
	} else {
		j.log.Warn("lost a member of the job: re-forming the group without it", zap.Int("world", oldWorld), zap.Error(cause))
	}
	state, serr := old.TakeState()
	if serr != nil && !errors.Is(serr, trainer.ErrStateSharded) && !errors.Is(serr, trainer.ErrNotSynced) {
		return reformed{}, serr
	}
	// Stages 1-2: the neighbour snapshots this rank holds (none from a trainer that failed
	// before it started: its generation never trained).
	var snap *trainer.Snapshot
	if errors.Is(serr, trainer.ErrStateSharded) {
		snap = old.Snapshot()
	}
	if ecfg := j.cfg.Elastic; ecfg.Settle > 0 && !grow {
		j.closeComm()
		if err := sleepCtx(ctx, ecfg.Settle); err != nil { // let the failure detector's verdicts reach every survivor
			return reformed{}, fmt.Errorf("%w (while settling: %w)", cause, err)
		}
	}
	// A member lost while the group re-forms (it died between the roster and the data plane,
	// or during the agreement) is one more loss: re-form again without it.
	j.trained = j.roster
	dead := map[int]bool{} // the trained generation's members known to have ended, over the attempts
	for attempt := 1; ; attempt++ {
		r, err := j.reformOnce(ctx, mem, old, setup, cause, reformFrom{state: state, serr: serr, snap: snap, oldWorld: oldWorld, oldRank: oldRank, grow: grow, start: start, dead: dead})
		if err == nil || attempt == maxReformAttempts || ctx.Err() != nil || !lostMember(err) {
			return r, err
		}
		j.log.Warn("lost a member while re-forming: re-forming again", zap.Int("attempt", attempt), zap.Error(err))
		cause, grow = err, false
	}
}

// maxReformAttempts bounds the re-forms one loss may take when members keep failing during
// them.
const maxReformAttempts = 5

// reformFrom is what a re-form continues from: this survivor's state (or its error), its
// neighbour snapshots, and its place in the generation that last trained.
type reformFrom struct {
	state             *trainer.State
	serr              error
	snap              *trainer.Snapshot
	oldWorld, oldRank int
	grow              bool
	start             time.Time
	dead              map[int]bool
}

// reformOnce is one attempt of reform.
func (j *job) reformOnce(ctx context.Context, mem Membership, old *trainer.Trainer, setup trainer.Setup, cause error, f reformFrom) (reformed, error) {
	state, serr, snap, oldWorld, oldRank, grow, start := f.state, f.serr, f.snap, f.oldWorld, f.oldRank, f.grow, f.start
	j.closeComm()
	ecfg := j.cfg.Elastic
	g, err := mem.Reform(ctx, cause, ecfg.MinNodes, ecfg.MaxNodes, ecfg.RejoinTimeout)
	if err != nil {
		return reformed{}, err
	}
	j.rank, j.world, j.comm, j.closeGen, j.generation = g.Rank, g.World, g.Comm, g.Close, g.Gen
	for _, r := range g.Dead {
		f.dead[r] = true
	}
	if grow && g.World <= oldWorld {
		// The newcomers did not answer (or were refused): do not stop the job for them at
		// every step.
		j.noAdmitUntil = time.Now().Add(admitBackoff)
		j.log.Warn("no member was admitted; admitting again later", zap.Duration("after", admitBackoff))
	}
	j.log.Info("re-formed the group", zap.Uint64("gen", g.Gen), zap.Int("old_rank", oldRank), zap.Int("rank", g.Rank),
		zap.Int("old_world", oldWorld), zap.Int("world", g.World))

	// Rank 0 of the new generation (a survivor: newcomers rank after them) resolves the
	// newest checkpoint and its step decides for everyone (only rank 0 reads checkpoints);
	// the survivors' steps may differ by one where a rank finished a step's reduction that
	// another did not.
	var from *checkpoint.Checkpoint
	a := agreeInput{survivor: true, step: old.Step(), ckptStep: -1, oldWorld: oldWorld, formerRank0: oldRank == 0, whole: state != nil, snapshots: snap != nil, dead: f.dead}
	if g.Rank == 0 && setup.Checkpoint.Dir != "" {
		if c, skipped, err := checkpoint.Resolve(checkpoint.ResumeAuto, setup.Checkpoint.Dir); err == nil {
			from, a.ckptStep = c, c.Step()
			for _, s := range skipped {
				j.log.Warn("skipping a checkpoint that failed verification", zap.Error(s))
			}
		} else if !errors.Is(err, checkpoint.ErrNoCheckpoint) {
			return reformed{}, fmt.Errorf("re-forming: looking for a checkpoint: %w", err)
		}
	}
	agreed, err := j.agree(ctx, a)
	if err != nil {
		return reformed{}, fmt.Errorf("re-forming: agreeing on the state: %w", err)
	}
	if s, err := j.assemble(ctx, &agreed, snap); err != nil {
		return reformed{}, err
	} else if s != nil {
		state = s
	}
	plan, err := j.plan(setup, agreed, cause)
	if err != nil {
		return reformed{}, err
	}
	if plan.Source == elastic.FromMemory || plan.Source == elastic.FromSnapshot {
		if state == nil {
			return reformed{}, fmt.Errorf("re-forming: %w", serr)
		}
		setup.State, setup.Resume = state, nil
	} else {
		setup.State, setup.Resume = nil, from // rank 0 reads it; the others receive their shards
	}
	setup.Config.Accum = plan.Accum
	setup.Comm = g.Comm
	t, err := trainer.New(setup)
	if err != nil {
		return reformed{}, fmt.Errorf("re-forming: %w", err)
	}
	took := time.Since(start)
	if !grow {
		j.noAdmitUntil = time.Time{}
	}
	detail := cause.Error()
	if grow {
		detail = fmt.Sprintf("admitted %d members", g.World-agreed.survivors)
	}
	rec := metrics.Record{Kind: metrics.KindEvent, Time: float64(time.Now().UnixNano()) / 1e9, Step: plan.FromStep,
		Event: metrics.EventReform, Detail: detail, Gen: g.Gen, World: g.World, OldWorld: oldWorld,
		Source: string(plan.Source), LostSteps: plan.LostSteps} // ResumeSeconds: at the first step (reformSink)
	j.log.Warn("continuing at the new world size", zap.Uint64("gen", g.Gen), zap.Int("old_world", oldWorld), zap.Int("world", g.World),
		zap.String("source", rec.Source), zap.Int64("from_step", plan.FromStep), zap.Int64("lost_steps", plan.LostSteps),
		zap.Int("accum", plan.Accum), zap.Duration("took", took.Round(time.Millisecond)))
	return reformed{t: t, rec: rec}, nil
}

// agreeInput is what one process brings to a new generation's agreement.
type agreeInput struct {
	survivor    bool  // a member of the previous generation (false: a newcomer, or a first start)
	step        int64 // the last step it completed
	ckptStep    int64 // rank 0: the newest checkpoint's step, or -1
	oldWorld    int
	formerRank0 bool         // it was the previous generation's rank 0
	whole       bool         // it holds the whole state
	snapshots   bool         // it holds neighbour snapshots (trainer.Snapshot)
	dead        map[int]bool // ranks of the trained generation it knows to have ended
}

// agreement is what a new generation agreed on: the largest of every member's figures.
type agreement struct {
	running            bool  // the group continues a running job (some member is a survivor)
	ckptStep           int64 // rank 0's newest checkpoint, or -1
	rank0Step, maxStep int64
	oldWorld           int
	survivors          int
	baseWorld          int
	formerRank0        bool
	whole              bool // every survivor holds the whole state
	snapshots          bool // every survivor holds neighbour snapshots
	dead               int  // members of the old generation some survivor knows to have ended
	// snapshotStep is the step of the state rebuilt from them (assemble), or -1.
	snapshotStep int64
}

// agree runs a new generation's agreement: every member — survivors, newcomers, and at a
// first start everyone — passes what it knows, and all get the same answer.
func (j *job) agree(ctx context.Context, a agreeInput) (agreement, error) {
	const none = math.MinInt64
	// v[9:] marks the old generation's members known dead (the first maxDeadRanks ranks).
	v := make([]int64, 9+maxDeadRanks)
	v[0], v[1], v[2] = none, none, none
	if a.survivor {
		v[2], v[3], v[4], v[5] = a.step, int64(a.oldWorld), 1, int64(j.baseWorld)
		if j.rank == 0 {
			v[0], v[1] = a.ckptStep, a.step
		}
		if a.formerRank0 {
			v[6] = 1 // the last generation's rank 0 is on this side (the quorum's tie-break)
		}
		if !a.whole {
			v[7] = 1
		}
		if !a.snapshots {
			v[8] = 1
		}
		for r := range a.dead {
			if r < maxDeadRanks {
				v[9+r] = 1
			}
		}
	}
	n := []int64{vote(a.survivor)}
	if j.world > 1 {
		if err := j.comm.AllReduceInt64(ctx, v, collective.Max); err != nil {
			return agreement{}, err
		}
		if err := j.comm.AllReduceInt64(ctx, n, collective.Sum); err != nil {
			return agreement{}, err
		}
	}
	dead := 0
	for _, d := range v[9:] {
		dead += int(d)
	}
	return agreement{running: v[4] > 0, ckptStep: v[0], rank0Step: v[1], maxStep: v[2], oldWorld: int(v[3]), survivors: int(n[0]),
		baseWorld: int(v[5]), formerRank0: v[6] == 1, whole: v[7] == 0, snapshots: v[8] == 0, snapshotStep: -1, dead: dead}, nil
}

// maxDeadRanks bounds the old ranks whose death the agreement carries: a larger job's
// members beyond it count in the quorum as if alive (the safe side).
const maxDeadRanks = 64

// assemble rebuilds the whole state from the neighbour snapshots when the survivors do not
// hold it but every one holds snapshots: a collective of the new generation (newcomers pass
// nil). It returns nil, having logged why, where two neighbours were lost together; the
// group then continues from a checkpoint. a.snapshotStep records the step of what it built.
func (j *job) assemble(ctx context.Context, a *agreement, snap *trainer.Snapshot) (*trainer.State, error) {
	if a.whole || !a.snapshots {
		return nil, nil
	}
	start := time.Now()
	s, err := trainer.Assemble(ctx, j.comm, snap)
	switch {
	case errors.Is(err, trainer.ErrNoSnapshot):
		j.log.Warn("the neighbour snapshots do not hold every lost shard: continuing from a checkpoint", zap.Error(err))
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("re-forming: rebuilding the state from the neighbour snapshots: %w", err)
	}
	a.snapshotStep = s.Step
	j.log.Info("rebuilt the state from the neighbour snapshots", zap.Int64("step", s.Step), zap.Duration("took", time.Since(start).Round(time.Millisecond)))
	return s, nil
}

func vote(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// plan is the decision every member of a new generation computes from the same agreement.
func (j *job) plan(setup trainer.Setup, a agreement, cause error) (elastic.Plan, error) {
	ecfg := j.cfg.Elastic
	j.baseWorld = a.baseWorld
	plan, err := elastic.Decide(ecfg, elastic.Loss{OldWorld: a.oldWorld, NewWorld: j.world, Survivors: a.survivors, Stage: setup.Zero.Stage,
		Step: a.rank0Step, Checkpoint: a.ckptStep, Micro: setup.Config.MicroBatch, Accum: setup.Config.Accum, BaseWorld: a.baseWorld,
		FormerRank0: a.formerRank0, Whole: a.whole, Snapshots: a.snapshotStep >= 0, SnapshotStep: a.snapshotStep, Dead: a.dead})
	switch {
	case err != nil:
		return plan, fmt.Errorf("%w; %w", cause, err)
	case plan.Action == elastic.Wait: // Reform waited for min_nodes already
		return plan, fmt.Errorf("%d of min_nodes %d members remain: %w", j.world, ecfg.MinNodes, cause)
	}
	if plan.Warning != "" {
		j.log.Warn(plan.Warning)
	}
	if plan.Source == elastic.FromMemory {
		plan.LostSteps = a.maxStep - a.rank0Step
	} else {
		plan.LostSteps = max(0, a.maxStep-plan.FromStep)
	}
	return plan, nil
}

// admitBackoff is how long a job that stopped to admit members, and admitted none, trains
// before it looks for newcomers again.
const admitBackoff = 30 * time.Second

// admit is the trainer's Setup.Admit: rank 0 stops the group at a step boundary when members
// wait to join and the job is below max_nodes.
func (j *job) admit(mem Membership) func() bool {
	return func() bool {
		return j.rank == 0 && j.world < j.cfg.Elastic.MaxNodes && time.Now().After(j.noAdmitUntil) && mem.Newcomers() > 0
	}
}

// sampleLog opens this process's sample log when QVD_SAMPLE_LOG names a directory (elastic
// soak tests check from it that no sample was lost or trained twice): DIR/samples-PID.jsonl,
// appended to. close closes it.
func (j *job) sampleLog() (l *trainer.SampleLog, close func(), err error) {
	dir := j.getenv("QVD_SAMPLE_LOG")
	if dir == "" {
		return nil, func() {}, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, nil, fmt.Errorf("QVD_SAMPLE_LOG: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("samples-%d.jsonl", os.Getpid())), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, nil, fmt.Errorf("QVD_SAMPLE_LOG: %w", err)
	}
	return &trainer.SampleLog{W: f, Gen: j.generation}, func() { _ = f.Close() }, nil
}

// errAdmitted is a newcomer's cause of its first generation.
var errAdmitted = errors.New("admitted to a running job")

// joinRunning is every elastic member's first agreement, before its trainer is built: at a
// first start nobody is a survivor and nothing changes; a member admitted to a running job
// learns from the survivors where the job is — the accumulation at this world, and whether
// rank 0 continues from memory or from a checkpoint (the trainer then receives the state) —
// and reports joined.
func (j *job) joinRunning(ctx context.Context, setup *trainer.Setup) (joined bool, err error) {
	a, err := j.agree(ctx, agreeInput{ckptStep: -1})
	if err != nil {
		return false, fmt.Errorf("joining the job: agreeing on the state: %w", err)
	}
	if !a.running {
		j.baseWorld = j.world
		return false, nil
	}
	if _, err := j.assemble(ctx, &a, nil); err != nil { // rank 0 broadcasts what it builds
		return false, err
	}
	plan, err := j.plan(*setup, a, errAdmitted)
	if err != nil {
		return false, err
	}
	setup.Config.Accum = plan.Accum
	j.log.Info("admitted to a running job: receiving the state from rank 0", zap.Int("world", j.world),
		zap.String("source", string(plan.Source)), zap.Int64("from_step", plan.FromStep), zap.Int("accum", plan.Accum))
	return true, nil
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
