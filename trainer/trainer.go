package trainer

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"os"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/progress"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// Model is what the trainer trains. Parameters are a flat buffer of Layout().Size float32;
// the model owns the working-precision parameters it computes with, the trainer's ZeRO engine
// the gradient and the fp32 master copy.
type Model interface {
	Layout() *model.Layout
	// Params is the working-precision parameter buffer the model computes with.
	Params() []float32
	MicroBatch() int
	EvalBatch() int
	// ForwardBackward runs one micro-batch of exactly MicroBatch samples and hands the
	// gradient of loss×scale, in working precision, to sink piece by piece as the backward
	// pass produces it (the ZeRO engine reduces each bucket as soon as it is complete); it
	// returns the unscaled mean loss. A failure to allocate happens before the first piece.
	ForwardBackward(b *data.Batch, scale float32, sink model.GradSink) (float32, error)
	// Evaluate runs the forward pass on the first b.N (<= EvalBatch) samples.
	Evaluate(b *data.Batch) (model.EvalResult, error)
}

// MetricsSink receives one record per optimizer step and per evaluation.
type MetricsSink interface {
	Write(metrics.Record) error
}

// ProgressSink shows the live progress line.
type ProgressSink interface {
	Update(progress.Status)
	Done()
}

// Clock is the time source (a manual clock in tests).
type Clock interface{ Now() time.Time }

type realClock struct{}

var _ Clock = realClock{}

func (realClock) Now() time.Time { return time.Now() }

// Setup is everything a Trainer is built from. Model, Train and Test are required; the
// sinks, logger and clock default to no-ops and the wall clock.
type Setup struct {
	Config     Config
	Schedule   ScheduleConfig
	Scaler     ScalerConfig
	Optimizer  optim.Config
	Zero       zero.Config
	Checkpoint checkpoint.Config // Dir "" disables checkpointing
	Seed       uint64

	Model Model
	// Pool, if set, runs the optimizer and the trainer's flat-buffer passes (the caller owns
	// it: the CPU backend's passes share it, so one set of goroutines owns the cores); nil
	// makes the trainer start its own.
	Pool        *offload.Pool
	Train, Test *data.Dataset
	// Val, if set, is the validation split (data.val_split, an image folder's val/): it is
	// evaluated after every epoch in Test's place, and Test once, when the run completes.
	// Its samples must not be in Train. nil: Test is evaluated after every epoch.
	Val       *data.Dataset
	Normalize data.Normalize

	// Comm, if set, makes this trainer one rank of a data-parallel group: the global batch
	// is split across ranks and gradients are averaged with all-reduce. Every rank must be
	// given the same configuration.
	Comm collective.Communicator

	// Resume, if set, is the checkpoint to continue from. In a group only rank 0 reads it
	// (and may be the only one with access to it); weights and optimizer state stream from it
	// to the others, each keeping its shard, so any world size and ZeRO stage can resume any
	// checkpoint.
	Resume *checkpoint.Checkpoint
	// State, if set, is the state to continue from, in memory (TakeState of a survivor's
	// previous trainer, elastic training): given to every rank or to none, and not with
	// Resume. Rank 0's copy wins: it is broadcast when Run starts.
	State *State
	// ConfigSnapshot is stored in every checkpoint's meta.json (the resolved run config).
	ConfigSnapshot any

	Metrics  MetricsSink
	Progress ProgressSink
	Logger   *zap.Logger
	Clock    Clock
	// MemoryMonitor, if set, gets per-phase peaks and one sample per step; the trainer logs
	// its line every memory.log_every steps and at new peaks, warns on host memory pressure,
	// logs the memory change of each phase's first run, and writes its figures to the
	// metrics. The caller owns it and closes it. nil: only heap and RSS are recorded.
	MemoryMonitor *memory.Monitor

	// Rebuild, if set, builds the model again for another micro-batch over the same
	// parameter buffer: the trainer then adapts to memory trouble at run time, halving the
	// micro-batch and doubling accumulation (the global batch, and so the run, unchanged)
	// after OOMAdaptAfter consecutive out-of-memory micro-batches, and, with AdaptOnPressure,
	// when the memory monitor reports host pressure.
	Rebuild         func(microBatch int) (Model, error)
	AdaptOnPressure bool
	// OOMAdaptAfter is how many consecutive micro-batches may fail with
	// memory.ErrOutOfMemory before the micro-batch is halved (0 = 3).
	OOMAdaptAfter int
	// Admit, if set, is asked at every step boundary whether members wait to join the group
	// (elastic training, on the rank that coordinates the next generation). A yes is voted
	// with the step's counters, and every rank ends Run after that step with ErrRegroup, the
	// whole state gathered for TakeState: the job re-forms with the newcomers.
	Admit func() bool
	// SampleLog, if set, records every micro-batch's sample indices (testing elastic runs).
	SampleLog *SampleLog
	// Prefetch is how many training micro-batches a goroutine fills ahead of the step
	// (data.prefetch; 0 = fill each in the step). The batches, and so the run, are the same.
	Prefetch int
	// SnapshotEvery: every how many steps each rank ships its ZeRO shard to its ring
	// neighbour (elastic training, snapshot.go): 0 never, SnapshotAuto measured. Only at
	// stages 1-2 in a group; elsewhere TakeState has the whole state.
	SnapshotEvery int
}

// Result summarises a run.
type Result struct {
	Steps          int64   // global steps completed (including skipped ones)
	OptimizerSteps int64   // steps that updated the weights
	Skipped        int64   // steps skipped on fp16 overflow
	Epoch          float64 // fractional epochs completed
	LastLoss       float64 // mean loss of the last step
	TestAccuracy   float64 // last evaluation of the test split
	TestLoss       float64
	Checkpoint     string // path of the last checkpoint written ("" if none)
	Interrupted    bool   // the context was cancelled; a checkpoint was written at the step boundary
	// ValAccuracy and ValLoss are the last evaluation of the validation split (unset
	// without one).
	ValAccuracy, ValLoss float64
	// SkippedMicroBatches counts micro-batches skipped on an out-of-memory error (this rank).
	SkippedMicroBatches int64
	// MicroBatch and Accum are the values in use at the end (memory adaptation may have
	// halved the micro-batch and doubled the accumulation).
	MicroBatch, Accum int
	// WeightsSHA256 is the SHA-256 of the working parameters' bytes at the end: equal on every
	// rank of a group (they hold the same model), and a cheap fingerprint to compare runs.
	WeightsSHA256 string
	EpochSeconds  []float64
	// AlreadyFinished: the run resumed from a checkpoint at or past its last step, so Run
	// trained nothing (and evaluated nothing: TestAccuracy and TestLoss are unset).
	AlreadyFinished bool
	// TotalSteps is the step the run ends at (epochs or max_steps, whichever comes first).
	TotalSteps int64
}

// Trainer runs the single-worker training loop: micro-batches with gradient accumulation,
// mixed precision with loss scaling, global-norm clipping, the LR schedule, the optimizer
// step on fp32 master weights, evaluation and checkpoints.
type Trainer struct {
	cfg      Config  // MicroBatch and Accum change when memory adaptation halves the micro-batch
	spec     runSpec // what the run is: fixed at construction
	group    group   // the data-parallel group this rank belongs to
	model    Model
	layout   *model.Layout
	eng      *zero.Engine // gradients, master weights, optimizer: this rank's share
	stepper  StepEngine   // where the step runs: the host engine or the model's device
	pool     ownedPool
	scaler   *Scaler // nil unless fp16
	w        weights
	data     dataState
	prefetch prefetchState
	pos      position
	ckpt     ckptState
	out      outputs
	log      *zap.Logger
	adapt    adaptState
	abort    abortState
	mem      *State       // the in-memory state to start from (Setup.State) until Run has loaded it
	snap     *snapshotter // neighbour snapshots of the ZeRO shard (nil: off)
}

// New builds a trainer; with s.Resume it restores weights, optimizer, scaler and data position.
func New(s Setup) (*Trainer, error) {
	if err := s.Config.Validate(); err != nil {
		return nil, fmt.Errorf("train.%w", err)
	}
	if err := s.Schedule.Validate(); err != nil {
		return nil, fmt.Errorf("scheduler.%w", err)
	}
	if err := s.Optimizer.Validate(); err != nil {
		return nil, fmt.Errorf("optimizer.%w", err)
	}
	if err := s.Zero.Validate(); err != nil {
		return nil, fmt.Errorf("zero_optimization.%w", err)
	}
	if err := s.Checkpoint.Validate(); err != nil {
		return nil, fmt.Errorf("checkpoint.%w", err)
	}
	if s.Model == nil || s.Train == nil || s.Test == nil {
		return nil, errors.New("trainer: Setup needs Model, Train and Test")
	}
	if s.Prefetch < 0 || s.Prefetch > data.MaxPrefetch {
		return nil, fmt.Errorf("data.prefetch: must be in [0, %d], got %d", data.MaxPrefetch, s.Prefetch)
	}
	cfg := s.Config
	if s.Model.MicroBatch() != cfg.MicroBatch || s.Model.EvalBatch() != cfg.EvalBatch {
		return nil, fmt.Errorf("trainer: model graphs are built for micro-batch %d / eval batch %d, config says %d / %d",
			s.Model.MicroBatch(), s.Model.EvalBatch(), cfg.MicroBatch, cfg.EvalBatch)
	}
	t := &Trainer{
		cfg:    cfg,
		spec:   runSpec{sched: s.Schedule, opt: s.Optimizer, zero: s.Zero, seed: s.Seed, snapshot: s.ConfigSnapshot, format: cfg.Format()},
		group:  group{world: 1, rank: 0, comm: s.Comm, scalarBuf: make([]float32, 8), intBuf: make([]int64, 8), admit: s.Admit},
		model:  s.Model,
		layout: s.Model.Layout(),
		data:   dataState{train: s.Train, test: s.Test, val: s.Val, norm: s.Normalize, samples: s.SampleLog},
		ckpt:   ckptState{cfg: s.Checkpoint},
		out:    outputs{metrics: s.Metrics, progress: s.Progress, clock: s.Clock, mem: memstat.NewReader(), mon: s.MemoryMonitor},
		log:    s.Logger,
		adapt:  adaptState{rebuild: s.Rebuild, onPressure: s.AdaptOnPressure, after: s.OOMAdaptAfter},
	}
	t.prefetch.depth = s.Prefetch
	if t.log == nil {
		t.log = zap.NewNop()
	}
	if t.group.comm != nil {
		t.group.world, t.group.rank = t.group.comm.Size(), t.group.comm.Rank()
	}
	if t.out.clock == nil {
		t.out.clock = realClock{}
	}
	if t.spec.format == half.FP16 {
		if err := s.Scaler.Validate(); err != nil {
			return nil, fmt.Errorf("fp16.%w", err)
		}
		t.scaler = NewScaler(s.Scaler)
	}
	t.spec.global = cfg.MicroBatch * cfg.Accum * t.group.world
	t.spec.stepsPerEpoch = data.StepsPerEpoch(t.data.train.N, t.spec.global)
	if t.spec.stepsPerEpoch < 1 {
		return nil, fmt.Errorf("train: the global batch (micro_batch %d × accum %d × world %d = %d) is larger than the training set (%d samples)",
			cfg.MicroBatch, cfg.Accum, t.group.world, t.spec.global, t.data.train.N)
	}
	t.spec.totalSteps = int64(cfg.Epochs) * int64(t.spec.stepsPerEpoch)
	if cfg.MaxSteps > 0 && cfg.MaxSteps < t.spec.totalSteps {
		t.spec.totalSteps = cfg.MaxSteps
	}

	n := t.layout.Size
	t.w.params = s.Model.Params()
	if len(t.w.params) != n {
		return nil, fmt.Errorf("trainer: model params have %d elements, layout says %d", len(t.w.params), n)
	}
	if t.spec.format == half.FP32 {
		t.w.initial = t.w.params
	} else {
		blk, buf, err := arena.Float32s(n, arena.Master)
		if err != nil {
			return nil, fmt.Errorf("trainer: the initial weights: %w", err)
		}
		copy(buf, t.w.params)
		t.w.initial, t.w.initialBlock = buf, blk
	}
	// Frozen tensors (model.Layout.Frozen) sit in a prefix of the flat buffer that the engine
	// never sees: no gradient, optimizer state or communication. In fp16/bf16 their fp32
	// values are kept for checkpoints, since the working copy is rounded.
	frozen := t.layout.Frozen
	if frozen > 0 && t.spec.format != half.FP32 {
		t.w.frozenMaster = append([]float32(nil), t.w.params[:frozen]...)
	}
	// One pool of workers serves the optimizer and the trainer's own flat-buffer passes.
	threads := cfg.Threads
	if s.Optimizer.Threads > 0 {
		threads = s.Optimizer.Threads
	}
	t.pool.p, t.pool.own = s.Pool, s.Pool == nil
	if t.pool.own {
		t.pool.p = offload.NewPool(threads)
	}
	var ext []zero.Extent
	for _, x := range t.layout.Extents() {
		ext = append(ext, zero.Extent{Off: x.Off, Size: x.Size, Row: x.Row})
	}
	eng, err := zero.NewEngine(zero.Options{Config: s.Zero, Optimizer: s.Optimizer, Params: t.w.params[frozen:], Format: t.spec.format, Comm: t.group.comm, Pool: t.pool.p, Accum: cfg.Accum, Extents: ext})
	if err != nil {
		if t.pool.own {
			t.pool.p.Close()
		}
		return nil, err
	}
	t.eng = eng
	t.data.batch = data.NewBatch(cfg.MicroBatch, t.data.train.SampleSize())
	t.data.evalBatch = data.NewBatch(cfg.EvalBatch, t.data.test.SampleSize())
	if t.data.val != nil && t.data.val.SampleSize() != t.data.test.SampleSize() {
		t.Close()
		return nil, fmt.Errorf("trainer: validation samples hold %d values, test samples %d", t.data.val.SampleSize(), t.data.test.SampleSize())
	}
	t.data.perm = make([]int32, t.data.train.N)

	if s.Checkpoint.Dir != "" && t.group.rank == 0 { // rank 0 writes checkpoints for the group
		if t.ckpt.mgr, err = checkpoint.NewManager(s.Checkpoint.Dir, s.Checkpoint.Keep); err != nil {
			t.Close()
			return nil, fmt.Errorf("checkpoint: %w", err)
		}
		// Now, not at the first save, after the training time has been spent.
		if err := CheckDir(s.Checkpoint.Dir, t.CheckpointBytes()); err != nil {
			t.Close()
			return nil, fmt.Errorf("checkpoint.dir: %w", err)
		}
	}
	if s.State != nil {
		if s.Resume != nil {
			t.Close()
			return nil, errors.New("trainer: Setup has both Resume and State")
		}
		if err := t.useState(s.State); err != nil {
			t.Close()
			return nil, err
		}
	}
	if s.Resume != nil && t.group.rank == 0 { // the others receive rank 0's state when Run starts
		if err := t.restore(s.Resume); err != nil {
			t.Close()
			return nil, err
		}
	}
	if t.stepper, err = newStepEngine(t.model, stepEnv{eng: t.eng, spec: &t.spec, group: &t.group, log: t.log}); err != nil {
		t.Close()
		return nil, err
	}
	if s.SnapshotEvery != 0 && s.Zero.Stage >= 1 && t.group.world > 1 {
		if t.snap, err = newSnapshotter(t, s.SnapshotEvery); err != nil {
			t.Close()
			return nil, err
		}
	}
	return t, nil
}

// ckptMetaBytes bounds meta.json (the resolved config and the tensor table: a few KiB) and
// the filesystem's per-file rounding in CheckpointBytes.
const ckptMetaBytes = 64 << 10

// CheckpointBytes estimates one checkpoint's size on disk: the full fp32 weights and the
// optimizer state of the whole model, which a checkpoint stores in float32 whatever the
// optimizer keeps in memory (the 8-bit optimizers' state is decoded to save it).
func (t *Trainer) CheckpointBytes() int64 {
	const f32 = 4
	opt := t.eng.Optimizer()
	moments := int64(len(opt.State())) // one buffer per moment, each one element per parameter
	if _, ok := opt.(optim.StateCodec); ok {
		moments = 2 // the 8-bit optimizers are Adam's: exp_avg and exp_avg_sq
	}
	return f32*int64(t.layout.Size) + f32*moments*int64(t.layout.Trainable()) + ckptMetaBytes
}

// ErrNoSpace is CheckDir's error when a directory's filesystem has less room than needed.
var ErrNoSpace = errors.New("not enough free space")

// CheckDir checks that a file can be created and written in dir, and that dir's filesystem
// has at least need bytes available (statfs's f_bavail, what an unprivileged writer gets):
// what a run needs of its run and checkpoint directories, checked before it trains rather
// than found at its first write.
func CheckDir(dir string, need int64) error {
	f, err := os.CreateTemp(dir, ".qvd-write-check-*")
	if err != nil {
		return fmt.Errorf("%s is not writable: %w", dir, err)
	}
	_, werr := f.Write([]byte{'\n'})
	cerr := f.Close()
	rerr := os.Remove(f.Name())
	if err := errors.Join(werr, cerr, rerr); err != nil {
		return fmt.Errorf("%s is not writable: %w", dir, err)
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return fmt.Errorf("checking the free space in %s: %w", dir, err)
	}
	if avail := uint64(st.Bavail) * uint64(st.Bsize); need > 0 && avail < uint64(need) {
		return fmt.Errorf("%s: %w: %s available, about %s needed", dir, ErrNoSpace, memstat.FormatBytes(avail), memstat.FormatBytes(uint64(need)))
	}
	return nil
}

// Close stops the optimizer's and the pool's goroutines; safe to call twice.
func (t *Trainer) Close() error {
	t.closePrefetch()
	if t.snap != nil {
		t.snap.close()
	}
	t.w.releaseInitial()
	if t.eng != nil {
		t.eng.Close()
	}

	if t.pool.p != nil && t.pool.own {
		t.pool.p.Close()
	}
	return nil
}

// Master returns the full fp32 master weights if this rank holds them without communication
// (one worker, stage 0, or fp32, where the gathered parameters are the master); nil
// otherwise, where FullMaster gathers them.
func (t *Trainer) Master() []float32 {
	if t.spec.format == half.FP32 || t.spec.zero.Stage == 0 || t.group.world == 1 {
		m, _ := t.eng.FullMaster(context.Background()) // no collective in these cases
		return m
	}
	return nil
}

// FullMaster gathers the full fp32 master weights: a collective at ZeRO stages 1-2 with
// fp16/bf16, so every rank of a group must call it.
func (t *Trainer) FullMaster(ctx context.Context) ([]float32, error) { return t.eng.FullMaster(ctx) }

// Memory is what this rank holds for training, measured from its buffers.
func (t *Trainer) Memory() memory.States { return t.eng.Memory() }

// Step returns the number of global steps completed.
func (t *Trainer) Step() int64 { return t.pos.step }

// GlobalBatch is micro-batch × accumulation × world size.
func (t *Trainer) GlobalBatch() int { return t.spec.global }

// StepsPerEpoch is the number of optimizer steps in one epoch (the last partial batch is dropped).
func (t *Trainer) StepsPerEpoch() int { return t.spec.stepsPerEpoch }

// TotalSteps is the number of steps the run will take.
func (t *Trainer) TotalSteps() int64 { return t.spec.totalSteps }

// Run trains until the configured epochs or max_steps are done, or ctx is cancelled. On
// cancellation it finishes the step in flight, writes a checkpoint and returns ctx's error
// together with the result so far. In a group every rank stops at the same step: the stop
// request travels with the step's loss all-reduce.
//
// A failed write of the metrics (MetricsSink.Write) stops the run the same way, at the next
// step boundary all ranks agree on, checkpointed; Run then returns the write's error. On
// every error the result carries the counts reached.
func (t *Trainer) Run(ctx context.Context) (res Result, err error) {
	defer func() {
		if err != nil && !res.Interrupted {
			t.fillCounts(&res)
		}
	}()
	// Collectives run on a context that an interrupt does not cancel (the ranks must finish
	// the step and save together); Abort cancels it when a peer is known to be lost.
	cctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	t.abort.set(cancel)
	defer t.abort.set(nil)
	defer t.stopPrefetch() // no producer outlives Run

	if err := t.syncFromRank0(cctx); err != nil {
		return res, t.abortCause(cctx, err)
	}
	if err := t.stepper.PushState(); err != nil {
		return res, err
	}
	t.log.Info("training",
		zap.Int("params", t.layout.NumParams()), zap.Int("micro_batch", t.cfg.MicroBatch), zap.Int("accum", t.cfg.Accum),
		zap.Int("world", t.group.world), zap.Int("global_batch", t.spec.global), zap.Int("steps_per_epoch", t.spec.stepsPerEpoch),
		zap.Int64("total_steps", t.spec.totalSteps), zap.String("precision", t.spec.format.String()), zap.String("optimizer", t.spec.opt.Type),
		zap.Int64("start_step", t.pos.step), zap.Int("zero_stage", t.spec.zero.Stage), zap.Bool("offload", t.eng.Offloaded()))
	if bs := t.stepper.Buckets(); bs != nil {
		largest := 0
		for _, b := range bs {
			largest = max(largest, b.Hi-b.Lo)
		}
		how := "sized from the model and the world (a 32nd of the model; a 64th for stage 2's staged reduce)"
		if t.spec.zero.ReduceBucketSize > 0 {
			how = "zero_optimization.reduce_bucket_size"
		}
		t.log.Info("gradient buckets", zap.Int("buckets", len(bs)), zap.Int("largest_elements", largest), zap.String("chosen", how),
			zap.String("overlap", "each bucket is reduced as soon as the backward pass has written it"))
	}
	t.logMemory()
	defer func() {
		if t.out.progress != nil {
			t.out.progress.Done()
		}
	}()
	if t.pos.step > 0 && !(t.pos.epoch < t.cfg.Epochs && t.pos.step < t.spec.totalSteps) {
		res.AlreadyFinished = true
		t.log.Info("nothing to train: the run resumed at or past its last step",
			zap.Int64("step", t.pos.step), zap.Int64("total_steps", t.spec.totalSteps), zap.Int("epochs", t.cfg.Epochs))
	}
	for t.pos.epoch < t.cfg.Epochs && t.pos.step < t.spec.totalSteps {
		epochStart := t.out.clock.Now()
		t.stopPrefetch() // its producer may read t.data.perm
		data.Permutation(t.data.perm, t.spec.seed, t.pos.epoch)
		for t.pos.offset+t.spec.global <= len(t.data.perm) && t.pos.step < t.spec.totalSteps {
			if t.group.world == 1 && t.out.sinkErr != nil {
				return t.stopOnSinkError(cctx, res)
			}
			if t.group.world == 1 && ctx.Err() != nil {
				// Alone, stop before starting another step; a group agrees on stopping
				// through the step's loss all-reduce instead.
				return t.interrupt(cctx, res, context.Cause(ctx))
			}
			stop, err := t.runStep(ctx, cctx, &res)
			if err != nil {
				return res, t.abortCause(cctx, err)
			}
			if !t.nextIsStep(ctx, stop) {
				// The step's all-gather may still be running under what would have been
				// the next forward pass: what comes instead reads the weights, or talks.
				if err := t.stepper.SyncParams(); err != nil {
					return res, t.abortCause(cctx, fmt.Errorf("after step %d: %w", t.pos.step, err))
				}
			}
			if t.out.sinkErr != nil && (stop || t.group.world == 1) {
				return t.stopOnSinkError(cctx, res)
			}
			if stop {
				cause := context.Cause(ctx)
				if cause == nil {
					// Another rank was asked to stop (its signal came first): stop with it.
					cause = ErrStopRequested
				}
				return t.interrupt(cctx, res, cause)
			}
			if t.ckpt.enabled() && t.ckpt.cfg.EverySteps > 0 && t.pos.step%int64(t.ckpt.cfg.EverySteps) == 0 {
				if err := t.save(cctx); err != nil {
					return res, t.abortCause(cctx, err)
				}
			}
			if t.group.regroup {
				return res, t.regroup(cctx)
			}
			if t.snap != nil {
				if err := t.snap.afterStep(cctx, t); err != nil {
					return res, t.abortCause(cctx, err)
				}
			}
		}
		epochDone := t.pos.offset+t.spec.global > len(t.data.perm)
		if err := t.evaluate(cctx, &res); err != nil {
			return res, t.abortCause(cctx, err)
		}
		if epochDone {
			res.EpochSeconds = append(res.EpochSeconds, t.out.clock.Now().Sub(epochStart).Seconds())
			t.pos.epoch++
			t.pos.offset = 0
		}
	}
	if t.data.val != nil && !res.AlreadyFinished {
		// The epochs evaluated the validation split; the test split is seen once, now.
		if err := t.evaluateTest(cctx, &res); err != nil {
			return res, t.abortCause(cctx, err)
		}
	}
	if t.ckpt.enabled() && t.ckpt.step != t.pos.step {
		if err := t.save(cctx); err != nil {
			return res, t.abortCause(cctx, err)
		}
	}
	if err := t.stepper.PullState(); err != nil {
		return res, err
	}
	t.fill(&res)
	return res, t.out.sinkErr
}

// nextIsStep says whether the step loop goes straight on to another step — no checkpoint,
// snapshot, regrouping, evaluation or stop first — so the parameters' all-gather can go on
// under its forward pass.
func (t *Trainer) nextIsStep(ctx context.Context, stop bool) bool {
	switch {
	case stop, t.out.sinkErr != nil, t.group.regroup, t.snap != nil && !t.snap.quiet(t.pos.step), ctx.Err() != nil:
		return false
	case t.ckpt.enabled() && t.ckpt.cfg.EverySteps > 0 && t.pos.step%int64(t.ckpt.cfg.EverySteps) == 0:
		return false
	}
	return t.pos.offset+t.spec.global <= len(t.data.perm) && t.pos.step < t.spec.totalSteps
}

// ErrStopRequested is Run's error when another rank of the group was asked to stop before
// this one was: every rank stops at the same step, checkpointed, as if interrupted.
var ErrStopRequested = errors.New("trainer: another rank of the group was asked to stop")

// Abort fails the run's collectives at once with err — used when failure detection (gossip)
// learns that a peer is gone, so ranks do not wait out the collective timeout. Safe to call
// from any goroutine, before, during or after Run.
func (t *Trainer) Abort(err error) { t.abort.abort(err) }

// abortCause prefers the reason the run was aborted (e.g. "rank 2 failed") over the
// collective's own error (which would then only say the context was cancelled).
func (t *Trainer) abortCause(cctx context.Context, err error) error {
	if cause := context.Cause(cctx); cause != nil && !errors.Is(err, cause) && cctx.Err() != nil {
		return fmt.Errorf("%w (%v)", cause, err)
	}
	return err
}

// fill completes the result of a run that stopped at a step boundary with its weights on
// the host.
func (t *Trainer) fill(res *Result) {
	t.fillCounts(res)
	res.WeightsSHA256 = weightsHash(t.w.params)
}

// fillCounts records how far the run got, which holds whatever state it failed in.
func (t *Trainer) fillCounts(res *Result) {
	res.Steps = t.pos.step
	res.TotalSteps = t.spec.totalSteps
	res.OptimizerSteps = t.eng.Optimizer().Steps()
	res.Skipped = t.pos.skipped
	res.Epoch = t.fracEpoch()
	res.Checkpoint = t.ckpt.last
	res.SkippedMicroBatches = t.adapt.skipped
	res.MicroBatch, res.Accum = t.cfg.MicroBatch, t.cfg.Accum
}

// weightsHash fingerprints a parameter buffer (little-endian float32 bytes).
func weightsHash(p []float32) string {
	h := sha256.New()
	var b [4096]byte
	for len(p) > 0 {
		n := min(len(p), len(b)/4)
		for i, v := range p[:n] {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
		}
		h.Write(b[:4*n])
		p = p[n:]
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (t *Trainer) fracEpoch() float64 {
	return t.pos.fracEpoch(t.spec)
}

func (t *Trainer) interrupt(cctx context.Context, res Result, cause error) (Result, error) {
	t.log.Warn("interrupted; saving a checkpoint at the step boundary", zap.Int64("step", t.pos.step))
	if t.ckpt.enabled() && t.ckpt.step != t.pos.step {
		if err := t.save(cctx); err != nil {
			return res, errors.Join(cause, err)
		}
	}
	if err := t.stepper.PullState(); err != nil {
		return res, errors.Join(cause, err)
	}
	t.fill(&res)
	res.Interrupted = true
	return res, cause
}

// errPeerSink is a rank's sinkErr when another rank of the group failed to write its metrics.
var errPeerSink = errors.New("trainer: another rank of the group failed to write its metrics or logs")

// sinkFailed records the first failed metrics write: logged at once (the sink's error names
// the file), it stops the run at the next step boundary.
func (t *Trainer) sinkFailed(err error) {
	if t.out.sinkErr != nil {
		return
	}
	t.out.sinkErr = err
	t.log.Error("writing the run's records failed: stopping at the step boundary with a checkpoint", zap.Int64("step", t.pos.step), zap.Error(err))
}

// stopOnSinkError ends a run whose metrics could not be written as an interrupt does (a
// checkpoint at the step boundary), but as a failure.
func (t *Trainer) stopOnSinkError(cctx context.Context, res Result) (Result, error) {
	if t.ckpt.enabled() && t.ckpt.step != t.pos.step {
		t.log.Warn("saving a checkpoint at the step boundary before failing", zap.Int64("step", t.pos.step))
		if err := t.save(cctx); err != nil {
			return res, errors.Join(t.out.sinkErr, err)
		}
	}
	if err := t.stepper.PullState(); err != nil {
		return res, errors.Join(t.out.sinkErr, err)
	}
	t.fill(&res)
	return res, t.out.sinkErr
}
