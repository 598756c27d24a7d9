package trainer

import (
	"context"
	"sync"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/checkpoint/sharded"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// The Trainer's state, grouped by what it is about. Each group is owned by the Trainer and,
// like it, used by one goroutine (Run's); abortState is the exception, guarded by its mutex.

// runSpec is what the run is, fixed once New has validated the Setup.
type runSpec struct {
	sched    ScheduleConfig
	opt      optim.Config
	zero     zero.Config
	seed     uint64
	snapshot any // stored in every checkpoint's meta.json
	format   half.Format

	global        int // samples per optimizer step across all workers
	stepsPerEpoch int
	totalSteps    int64
}

// group is this rank's place in the data-parallel group.
type group struct {
	world, rank int
	comm        collective.Communicator // nil for a single worker
	scalarBuf   []float32               // for the small per-step all-reduces: loss sums
	intBuf      []int64                 // and counters and flags (read them out before the next call)
	// admit is Setup.Admit; regroup is set when the group voted to admit members at the
	// step just done, and gathered is the whole state Run collected for TakeState then.
	admit    func() bool
	regroup  bool
	gathered *State
	synced   bool // Run has taken rank 0's state (syncFromRank0)
}

// position is how far the run has got: the next step is global step step+1, reading the
// epoch-`epoch` permutation from position offset.
type position struct {
	step    int64
	epoch   int
	offset  int
	skipped int64 // steps that did not update the weights
}

// fracEpoch is the fractional epochs completed.
func (p position) fracEpoch(s runSpec) float64 {
	return float64(p.epoch) + float64(p.offset)/float64(s.stepsPerEpoch*s.global)
}

// ownedPool is the worker pool, and whether the trainer started it (and so closes it).
type ownedPool struct {
	p   *offload.Pool
	own bool
}

// weights are the trainer's views of the parameters beside the engine's.
type weights struct {
	params []float32 // the model's working-precision parameters (full, frozen prefix included)
	// frozenMaster is the fp32 copy of the frozen prefix in fp16/bf16 runs (nil otherwise).
	frozenMaster []float32
	// initial holds the full fp32 weights to start from (the model's initialisation, or on
	// rank 0 a checkpoint's) until Run has spread rank 0's copy to every rank. In fp32 it is
	// params itself (the working weights are exact); in fp16/bf16 a copy outside the Go heap,
	// initialBlock, freed once spread.
	initial      []float32
	initialBlock *arena.Block
}

// releaseInitial drops the initial weights once they have been spread; safe to call twice.
func (w *weights) releaseInitial() {
	w.initialBlock.Free()
	w.initial, w.initialBlock = nil, nil
}

// dataState is the data the run reads and the buffers it reads it into.
type dataState struct {
	train, test *data.Dataset
	val         *data.Dataset // nil: no validation split
	norm        data.Normalize
	batch       *data.Batch
	evalBatch   *data.Batch
	perm        []int32
	samples     *SampleLog // nil: none
}

// ckptState is the checkpointing side of the run.
type ckptState struct {
	cfg  checkpoint.Config   // Dir "" disables checkpointing
	mgr  *checkpoint.Manager // rank 0's; nil on the others
	last string              // the last checkpoint written or resumed from
	step int64               // the step it holds
	// resumed is rank 0's open checkpoint, read again in Run for the optimizer state.
	resumed *sharded.Source
}

func (c *ckptState) enabled() bool { return c.cfg.Dir != "" }

// outputs are where the run reports: metrics, progress, the clock they are stamped with,
// and the memory figures that go with them.
type outputs struct {
	metrics  MetricsSink
	progress ProgressSink
	clock    Clock
	mem      *memstat.Reader
	mon      *memory.Monitor // nil: no monitor
	monState monitorState
	emaStep  float64 // smoothed seconds per step, for ETA
	// gathMark is the engine's GatherSeconds before the last applied step's optimizer: with
	// a prefetched all-gather, a step's param_gather is the gather time since.
	gathMark float64
	// sinkErr is the first error writing the metrics (or what the sink writes with them: the
	// log file), or a peer's report of one: the run stops at the next step boundary every rank
	// agrees on, saves a checkpoint and fails with it.
	sinkErr error
}

// abortState lets Abort, from any goroutine, cancel the collectives of Run.
type abortState struct {
	mu      sync.Mutex
	f       context.CancelCauseFunc
	pending error // an Abort before Run set f
}

// abort cancels Run's collectives with err, or, before Run, has it do so when it starts.
func (a *abortState) abort(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.f != nil {
		a.f(err)
	} else {
		a.pending = err
	}
}

// set installs Run's cancel function (nil when Run ends), applying a pending Abort.
func (a *abortState) set(f context.CancelCauseFunc) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.f = f
	if f != nil && a.pending != nil {
		f(a.pending)
	}
}
