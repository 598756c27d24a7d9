package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// Neighbour snapshots (elastic training at ZeRO stages 1-2). Every snapshot_every steps each
// rank copies its shard of the state — fp32 master weights and every optimizer buffer — into
// an "own" snapshot and ships it to its ring successor, which keeps it as a "peer" copy.
// When a rank dies its successor still holds its shard, so the survivors rebuild the whole
// state in memory (Assemble) instead of reading the newest checkpoint.
//
// Consistency. Snapshots are taken at the same steps on every rank, into two slots used in
// turn (snapshot k into slot k mod 2). The ship of snapshot k is a Shift followed by a
// commit, a one-element all-reduce: once the commit returns on any rank, every rank has
// received its peer copy k. A rank overwrites slot k mod 2 again (snapshot k+2) only after
// its commit of k+1 has returned. So at every moment, for the newest commit c that has
// returned anywhere, every rank still holds its own snapshot c and its predecessor's copy c:
// whichever ranks die, if no two of them are ring neighbours, step c is complete (Assemble
// may find a newer one). A copy is only used once fully received; one whose ship was cut
// off by the failure is ignored. The ship of snapshot S overlaps step S+1's forward and
// backward passes and reductions, and is awaited before that step's optimizer applies it
// (settle): a member that dies before its copy has landed fails step S+1 unapplied, so a
// recovery loses at most every steps.
//
// Concurrency. Over a collective.Shifter (the Ring) the ship runs in a goroutine under its
// own Call tags while training goes on, and is awaited before the next step is applied; over
// other communicators (NCCL, which needs every rank's calls in one order) it runs in the
// step loop. Its failure fails the run like any collective's: a lost peer.

// SnapshotAuto is Setup.SnapshotEvery's value for an interval chosen from measurement: a
// snapshot is taken at each of the first snapshotCalibrate steps, none at the next ones, and
// the steps are timed hook to hook; what a snapshot adds to its step (the copy, the wait for
// the previous ship, the ship's share of the cores and links) is the difference of the
// medians, and the interval is the smallest that keeps it within snapshotBudget of the step
// time (every step where it costs less), the largest any rank proposes.
const SnapshotAuto = -1

const (
	// Explicit tags of the ship's calls (collective.Call.Tag), used by nothing else.
	snapTagShift  = 0x51564400_0001
	snapTagCommit = 0x51564400_0002
	// snapHeader floats precede a shard's values in a snapshot: magic, old rank, step (two
	// halves), shard length, buffers, all as raw bits. The receiver checks them.
	snapHeader = 8
	snapMagic  = 0x51564453 // "QVDS"

	snapshotCalibrate = 3
	snapshotBudget    = 0.05
	snapshotMaxEvery  = 100000
)

// SnapshotPosition is the state a snapshot was taken at beside the shards: the same on every
// rank at a step boundary.
type SnapshotPosition struct {
	Step           int64
	Epoch, Offset  int
	Skipped        int64
	OptimizerSteps int64
	Scaler         *ScalerState // nil unless fp16
}

// ShardCopy is one rank's shard of the trainable state at a step: Master is the fp32 master
// weights [Shards[Rank], Shards[Rank+1]) of the trainable part, Optimizer the same range of
// each optimizer buffer (Snapshot.Names).
type ShardCopy struct {
	Rank      int // the rank whose shard it is, in the snapshot's world
	Step      int64
	Master    []float32
	Optimizer [][]float32
}

// OwnCopy is a rank's snapshot of its own shard, with what every rank has whole.
type OwnCopy struct {
	ShardCopy
	Position SnapshotPosition
	Frozen   []float32 // the frozen prefix of the weights (Layout().Frozen elements)
}

// Snapshot is what one rank holds of the neighbour snapshots once Run has returned: its own
// shard and its predecessor's, at up to two steps each, complete copies only, newest first.
// The slices view the trainer's buffers: valid until its Close.
type Snapshot struct {
	Rank, World int               // this rank's place in the group the snapshots were taken in
	Size        int               // the weights' length, frozen prefix included
	Frozen      int               // the frozen prefix's length
	Shards      collective.Shards // the trainable shards of every rank of that world
	Names       []string          // the optimizer buffers
	Own         []OwnCopy
	Peer        []ShardCopy // copies of rank (Rank-1) mod World's shard
}

// snapshotter is a Trainer's neighbour snapshots (Trainer.snap; nil when off).
type snapshotter struct {
	every       int // steps between snapshots; 0 while SnapshotAuto measures
	hooks       int // afterStep calls
	async       bool
	comm        collective.Communicator
	pool        *offload.Pool
	log         *zap.Logger
	rank, world int
	shards      collective.Shards
	names       []string
	size        int
	frozen      int
	own, peer   [2]snapSlot
	taken       int   // snapshots started
	last        int64 // step of the last snapshot (when taken > 0)
	job         *snapJob
	blocks      []*arena.Block
	meas        snapMeasure
}

// snapSlot is one buffer of a double-buffered snapshot.
type snapSlot struct {
	data   []float32 // snapHeader, then the master shard and each optimizer buffer's
	frozen []float32 // own slots: the frozen prefix
	step   int64     // -1: not complete
	pos    SnapshotPosition
}

// snapJob is the ship of one snapshot, run by its goroutine, which closes done when it has
// finished. Its fields are the goroutine's until done is closed.
type snapJob struct {
	slot     int
	step     int64
	done     chan struct{}
	cancel   context.CancelCauseFunc
	stop     func() bool // detaches the propagation of Run's aborts
	shiftErr error
	err      error // the shift's or the commit's
	took     time.Duration
}

// snapMeasure is SnapshotAuto's calibration: hooks 0 to snapshotCalibrate-1 take a
// snapshot, the next ones do not; a cycle is the time from one hook to the next.
type snapMeasure struct {
	last          time.Time // the previous hook's start
	with, without []time.Duration
	copies, ships []time.Duration // for the log
}

// record times the cycle that ends at hook h, now. The cycles that start at a snapshot's
// hook (plan: hooks below snapshotCalibrate) count as "with"; "without" skips the first cycle
// after them, which the last ship may still share.
func (m *snapMeasure) record(h int, now time.Time) {
	if h > 0 {
		switch c := now.Sub(m.last); {
		case h <= snapshotCalibrate:
			m.with = append(m.with, c)
		case h >= snapshotCalibrate+2:
			m.without = append(m.without, c)
		}
	}
	m.last = now
}

// newSnapshotter allocates the four snapshot slots outside the Go heap. every is
// Setup.SnapshotEvery (non-zero).
func newSnapshotter(t *Trainer, every int) (*snapshotter, error) {
	if every < SnapshotAuto || every > snapshotMaxEvery {
		return nil, fmt.Errorf("trainer: snapshot interval %d: want %d (auto), 0 (off) or 1 to %d steps", every, SnapshotAuto, snapshotMaxEvery)
	}
	l, err := zero.NewLayout(t.layout.Trainable(), t.group.world)
	if err != nil {
		return nil, err
	}
	s := &snapshotter{
		every: max(every, 0), comm: t.group.comm, pool: t.pool.p, log: t.log,
		rank: t.group.rank, world: t.group.world, shards: l.Shards,
		size: t.layout.Size, frozen: t.layout.Frozen,
	}
	_, s.async = s.comm.(collective.Shifter)
	if lo, hi := t.eng.Shard(); lo != l.Shards[s.rank] || hi != l.Shards[s.rank+1] {
		return nil, fmt.Errorf("trainer: the engine's shard [%d, %d) is not the layout's [%d, %d)", lo, hi, l.Shards[s.rank], l.Shards[s.rank+1])
	}
	for _, nb := range optim.ExportState(t.eng.Optimizer()) {
		s.names = append(s.names, nb.Name)
	}
	prev := (s.rank + s.world - 1) % s.world
	alloc := func(n int) ([]float32, error) {
		b, f, err := arena.Float32s(n, arena.Buffers)
		if err != nil {
			return nil, fmt.Errorf("trainer: allocating the neighbour snapshots (%d floats): %w", n, err)
		}
		s.blocks = append(s.blocks, b)
		return f, nil
	}
	for i := range 2 {
		own, peer := &s.own[i], &s.peer[i]
		own.step, peer.step = -1, -1
		if own.data, err = alloc(s.payload(s.rank)); err == nil {
			if peer.data, err = alloc(s.payload(prev)); err == nil && s.frozen > 0 {
				own.frozen, err = alloc(s.frozen)
			}
		}
		if err != nil {
			s.close()
			return nil, err
		}
	}
	return s, nil
}

// payload is the length of rank's snapshot: the header, its master shard and its share of
// every optimizer buffer.
func (s *snapshotter) payload(rank int) int {
	return snapHeader + (1+len(s.names))*(s.shards[rank+1]-s.shards[rank])
}

// afterStep is the step loop's hook, at a step boundary after the optimizer: it collects a
// finished ship, chooses the interval once SnapshotAuto has measured enough, and takes a
// snapshot when one is due.
func (s *snapshotter) afterStep(ctx context.Context, t *Trainer) error {
	h := s.hooks
	s.hooks++
	step := t.pos.step
	due, choose := s.plan(h, step)
	if s.every == 0 {
		s.meas.record(h, time.Now())
	}
	if s.job != nil && (due || isDone(s.job.done)) {
		if err := s.await(); err != nil {
			return err
		}
	}
	if choose {
		if s.job != nil {
			if err := s.await(); err != nil {
				return err
			}
		}
		if err := s.choose(ctx); err != nil {
			return err
		}
		due = step-s.last >= int64(s.every)
	}
	if !due {
		return nil
	}
	return s.take(ctx, t)
}

// plan is afterStep's decision at hook h, after step: whether a snapshot is due, and whether
// the hook ends SnapshotAuto's calibration (an all-reduce, after which a snapshot may be due).
func (s *snapshotter) plan(h int, step int64) (due, choose bool) {
	if s.every == 0 {
		return h < snapshotCalibrate, h == 2*snapshotCalibrate+1
	}
	return s.taken == 0 || step-s.last >= int64(s.every), false
}

// quiet says whether the next afterStep, after step, neither reads the state nor calls a
// collective in the step loop, so the parameters' all-gather may go on under the next forward
// pass (Trainer.nextIsStep). Collecting a finished ship is neither.
func (s *snapshotter) quiet(step int64) bool {
	due, choose := s.plan(s.hooks, step)
	return !due && !choose
}

func isDone(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// take copies this rank's shard into the next slot and starts its ship.
func (s *snapshotter) take(ctx context.Context, t *Trainer) error {
	start := time.Now()
	if err := t.stepper.PullState(); err != nil {
		return fmt.Errorf("neighbour snapshot: %w", err)
	}
	i := s.taken % 2
	own, peer := &s.own[i], &s.peer[i]
	own.step, peer.step = -1, -1
	step := t.pos.step
	lo, hi := s.shards[s.rank], s.shards[s.rank+1]
	n := hi - lo
	putHeader(own.data, s.rank, step, n, len(s.names))
	master := t.eng.Master()
	state := optim.ExportState(t.eng.Optimizer())
	if len(master) != n || len(state) != len(s.names) {
		return fmt.Errorf("neighbour snapshot: the engine holds %d master weights and %d optimizer buffers, want %d and %d", len(master), len(state), n, len(s.names))
	}
	s.copy(own.data[snapHeader:snapHeader+n], master)
	for b, nb := range state {
		if len(nb.Data) != n {
			return fmt.Errorf("neighbour snapshot: optimizer buffer %s has %d elements, want %d", nb.Name, len(nb.Data), n)
		}
		off := snapHeader + (1+b)*n
		s.copy(own.data[off:off+n], nb.Data)
	}
	if s.frozen > 0 {
		s.copy(own.frozen, t.frozenWeights())
	}
	own.pos = SnapshotPosition{Step: step, Epoch: t.pos.epoch, Offset: t.pos.offset, Skipped: t.pos.skipped,
		OptimizerSteps: t.eng.Optimizer().Steps()}
	if t.scaler != nil {
		st := t.scaler.State()
		own.pos.Scaler = &st
	}
	own.step = step
	s.taken++
	s.last = step
	if s.every == 0 {
		s.meas.copies = append(s.meas.copies, time.Since(start))
	}

	j := &snapJob{slot: i, step: step, done: make(chan struct{})}
	// The ship outlives the step: it ends with its own cancel (Snapshot, Close), or when Run's
	// collectives are aborted (a lost peer), not when Run returns normally.
	var jctx context.Context
	jctx, j.cancel = context.WithCancelCause(context.WithoutCancel(ctx))
	j.stop = context.AfterFunc(ctx, func() {
		if cause := context.Cause(ctx); !errors.Is(cause, context.Canceled) {
			j.cancel(cause)
		}
	})
	s.job = j
	if !s.async {
		s.ship(jctx, j, own.data, peer.data, collective.Call{})
		return s.await()
	}
	go s.ship(jctx, j, own.data, peer.data, collective.Call{Tag: snapTagShift})
	return nil
}

// ship sends send to the successor, receives the predecessor's snapshot into recv and
// commits; cl is the shift's tag (0: the sequence, for a ship in the step loop).
func (s *snapshotter) ship(ctx context.Context, j *snapJob, send, recv []float32, cl collective.Call) {
	defer close(j.done)
	start := time.Now()
	j.shiftErr = collective.Shift(ctx, s.comm, send, recv, cl)
	if j.shiftErr == nil {
		prev := (s.rank + s.world - 1) % s.world
		j.shiftErr = checkHeader(recv, prev, j.step, s.shards[prev+1]-s.shards[prev], len(s.names))
	}
	// The commit is made even after a failed shift, on a context cancelled with its error: it
	// fails at once and its abort tells the ranks waiting in theirs who failed, rather than
	// leave them to time out.
	cctx := ctx
	if j.shiftErr != nil {
		var cancel context.CancelCauseFunc
		cctx, cancel = context.WithCancelCause(ctx)
		cancel(j.shiftErr)
	}
	j.err = s.comm.AllReduce(cctx, []float32{1}, collective.Sum, commitCall(cl))
	if j.shiftErr != nil {
		j.err = j.shiftErr
	}
	j.took = time.Since(start)
}

// commitCall is the commit's Call after a shift under cl: its own explicit tag, or the
// sequence.
func commitCall(cl collective.Call) collective.Call {
	if cl.Tag == 0 {
		return collective.Call{}
	}
	return collective.Call{Tag: snapTagCommit}
}

// settle waits, before a step's optimizer applies it, for the ship of the snapshot taken at
// the step before (if one is in flight): a snapshot is then complete at its neighbour before
// the group completes another step, which bounds a recovery's lost steps by the interval.
func (s *snapshotter) settle() error {
	if s.job == nil {
		return nil
	}
	return s.await()
}

// await waits for the ship in flight and records its result: a failure fails the run.
func (s *snapshotter) await() error {
	j := s.job
	<-j.done
	j.stop()
	j.cancel(nil)
	s.job = nil
	if j.shiftErr == nil {
		// The copy arrived whole (its header checked): it counts even where the commit failed
		// (a rank lost meanwhile), as the recovery that follows may need it.
		s.peer[j.slot].step = j.step
	}
	if j.err != nil {
		return fmt.Errorf("neighbour snapshot of step %d: %w", j.step, j.err)
	}
	if s.every == 0 {
		s.meas.ships = append(s.meas.ships, j.took)
	}
	return nil
}

// choose ends SnapshotAuto's calibration: every rank proposes the smallest interval that
// keeps the snapshot's cost within snapshotBudget of its step time, and the largest wins.
func (s *snapshotter) choose(ctx context.Context) error {
	with, without := median(s.meas.with), median(s.meas.without)
	cost := max(with-without, 0)
	every := int64(1)
	if without > 0 {
		every = int64(math.Ceil(float64(cost) / (snapshotBudget * float64(without))))
	}
	v := []int64{min(max(every, 1), snapshotMaxEvery)}
	if err := s.comm.AllReduceInt64(ctx, v, collective.Max); err != nil {
		return fmt.Errorf("neighbour snapshots: agreeing on the interval: %w", err)
	}
	s.every = int(v[0])
	s.log.Info("neighbour snapshots: interval chosen", zap.Int("every_steps", s.every), zap.Int64("proposed_here", every),
		zap.Duration("step", without), zap.Duration("step_with_snapshot", with), zap.Duration("copy", median(s.meas.copies)),
		zap.Duration("ship", median(s.meas.ships)), zap.Float64("budget", snapshotBudget), zap.Bool("async", s.async))
	return nil
}

func median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// copyRange is a parallel copy on the trainer's pool.
type copyRange struct{ dst, src []float32 }

func (c *copyRange) Range(lo, hi int) { copy(c.dst[lo:hi], c.src[lo:hi]) }

func (s *snapshotter) copy(dst, src []float32) {
	s.pool.Run(len(src), 1<<16, &copyRange{dst: dst, src: src})
}

// stopJob cancels the ship in flight, if any, and waits for it; its peer copy counts if the
// shift had completed.
func (s *snapshotter) stopJob() {
	j := s.job
	if j == nil {
		return
	}
	j.cancel(errors.New("trainer: the run is over"))
	<-j.done
	j.stop()
	s.job = nil
	if j.shiftErr == nil {
		s.peer[j.slot].step = j.step
	}
}

// close stops the ship and frees the slots; safe to call twice.
func (s *snapshotter) close() {
	s.stopJob()
	for _, b := range s.blocks {
		b.Free()
	}
	s.blocks = nil
	for i := range 2 {
		s.own[i], s.peer[i] = snapSlot{step: -1}, snapSlot{step: -1}
	}
}

// snapshot is Trainer.Snapshot.
func (s *snapshotter) snapshot() *Snapshot {
	s.stopJob()
	out := &Snapshot{Rank: s.rank, World: s.world, Size: s.size, Frozen: s.frozen, Shards: slices.Clone(s.shards), Names: slices.Clone(s.names)}
	prev := (s.rank + s.world - 1) % s.world
	for _, i := range s.newestFirst() {
		if o := &s.own[i]; o.step >= 0 {
			out.Own = append(out.Own, OwnCopy{ShardCopy: s.view(o.data, s.rank, o.step), Position: o.pos, Frozen: o.frozen})
		}
		if p := &s.peer[i]; p.step >= 0 {
			out.Peer = append(out.Peer, s.view(p.data, prev, p.step))
		}
	}
	return out
}

// newestFirst orders the slot indices by the snapshot they hold, the latest first.
func (s *snapshotter) newestFirst() []int {
	if s.own[0].step >= s.own[1].step {
		return []int{0, 1}
	}
	return []int{1, 0}
}

// view cuts a slot into its shard's pieces.
func (s *snapshotter) view(data []float32, rank int, step int64) ShardCopy {
	n := s.shards[rank+1] - s.shards[rank]
	c := ShardCopy{Rank: rank, Step: step, Master: data[snapHeader : snapHeader+n]}
	for b := range s.names {
		off := snapHeader + (1+b)*n
		c.Optimizer = append(c.Optimizer, data[off:off+n])
	}
	return c
}

// Snapshot returns the neighbour snapshots this rank holds (nil when they are off), for
// Assemble after Run has returned on a lost member. It stops a ship still in flight.
func (t *Trainer) Snapshot() *Snapshot {
	if t.snap == nil {
		return nil
	}
	return t.snap.snapshot()
}

func putHeader(h []float32, rank int, step int64, n, bufs int) {
	for i, v := range []uint32{snapMagic, uint32(rank), uint32(uint64(step)), uint32(uint64(step) >> 32), uint32(n), uint32(bufs), 0, 0} {
		h[i] = math.Float32frombits(v)
	}
}

// checkHeader verifies that a received snapshot is rank's shard at step.
func checkHeader(h []float32, rank int, step int64, n, bufs int) error {
	want := make([]float32, snapHeader)
	putHeader(want, rank, step, n, bufs)
	for i := range want {
		if math.Float32bits(h[i]) != math.Float32bits(want[i]) {
			b := func(i int) uint32 { return math.Float32bits(h[i]) }
			return fmt.Errorf("trainer: the neighbour snapshot received is rank %d's of %d elements at step %d, want rank %d's of %d at step %d",
				b(1), b(4), int64(uint64(b(2))|uint64(b(3))<<32), rank, n, step)
		}
	}
	return nil
}
