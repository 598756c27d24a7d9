package zero

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/optim"
)

// Options build an Engine.
type Options struct {
	Config    Config
	Optimizer optim.Config
	// Params is the model's full working-precision parameter buffer (its graph reads it).
	Params []float32
	// Format is the working precision: gradients and parameters travel in it.
	Format half.Format
	// Comm is the group; nil for a single worker.
	Comm collective.Communicator
	// Pool runs the flat-buffer passes and the optimizer.
	Pool *offload.Pool
	// Stream moves gradients to the host and parameters back when the optimizer is offloaded
	// (Config.OffloadOptimizer.Device == "cpu"); nil makes the engine start a HostStream.
	Stream offload.Stream
	// Accum is the micro-batches per step the run starts with (BeginStep may change it): at
	// stage 1 it says whether the gradient is partitioned (GradPartitioned).
	Accum int
	// Extents are the trainable tensors as the backward pass produces their gradients
	// (model.Layout.Extents): reduce buckets begin only at tensor and row starts, so every
	// piece the pass writes lies in one bucket. nil: buckets are cut anywhere.
	Extents []Extent
}

// Engine runs one rank's part of a ZeRO training step, and is the sink the backward pass
// writes its gradient into (model.GradSink): as soon as the pass has written all of a bucket
// of the flat space, the engine's communication goroutine reduces it — all-reduce at stages
// 0–1 (in the last micro-batch of a step), reduce-scatter at stage 2 (in every micro-batch) —
// while the pass goes on below (PyTorch DDP's bucketing, DeepSpeed's overlap_comm).
//
// The trainer calls, from one goroutine: BeginStep; per micro-batch BeginMicro, the model's
// forward and backward (which call WaitParams, Cuts, Acquire and Release), EndMicro; then
// Reduce, SumSquares and Step. Every rank calls them in the same order and the backward pass
// hands pieces over in decreasing offset order, so every rank issues the same collectives in
// the same order. Collectives run on two goroutines, never at once: the communication
// goroutine's (the buckets, a prefetched all-gather) are done before Reduce returns, and the
// trainer's own (SumSquares, the step's scalars, Gather) come after it or after
// SettleParams.
//
// Where the gradient lives: at stages 0–1 in one full buffer (the pass accumulates into it
// across micro-batches); at stage 2 only in two bucket-sized staging buffers, which the pass
// writes and the communication goroutine reduces and sums into this rank's gradient shard:
// no full-size gradient exists anywhere in the process. Every large buffer is an
// internal/arena block, outside the Go heap.
//
// With offload the master weights, the gradient shard the optimizer reads and the optimizer
// state are in host memory, where the step runs; the transfers go through an offload.Stream.
// On the CPU backend both sides are the same RAM, but the transfers and the accounting
// (Memory) are the ones a GPU uses.
type Engine struct {
	cfg         Config
	offload     bool
	rank, world int
	comm        collective.Communicator
	format      half.Format
	pool        *offload.Pool
	stream      offload.Stream
	ownStream   bool
	layout      *Layout
	lo, hi      int // this rank's shard; [0, n) at stage 0
	blocks      []*arena.Block

	params []float32 // full working parameters (the model's)
	// master is the fp32 master copy the optimizer updates: stage 0 all of it, stages 1-2 the
	// shard. Training in fp32 without offload it is (a view of) params itself: no second copy.
	master []float32
	opt    optim.Optimizer

	// grads: stages 0-1 the full gradient accumulated over micro-batches; nil at stage 2.
	grads []float32
	// hgrads: with offload at stages 0-1, the host copy of this rank's part of the reduced
	// gradient, which the host optimizer reads.
	hgrads []float32
	// gshard: stage 2's gradient shard, accumulated across micro-batches: in the working
	// precision on the device, in fp32 on the host with offload.
	gshard []float32
	// staging: with offload and fp16/bf16, the host buffer the updated shard is rounded into
	// before it is copied to the device parameters.
	staging []float32

	// part says the step's gradient is partitioned (stage 2; stage 1 without accumulation):
	// pieces go through the staging buffers and only this rank's shard of the reduced
	// gradient is kept. Otherwise the whole gradient accumulates in grads.
	part      bool
	hostGrads bool // offload: the host copy of the shard (hgrads) at stages 0-1
	gradBlks  []*arena.Block

	reduce, gather []Bucket
	cuts           []int      // reduce buckets' starts (Cuts)
	want           []int      // per reduce bucket: gradient elements the pass writes
	holes          [][][2]int // per reduce bucket: the gaps between tensors, relative to Lo

	// The step in progress (trainer goroutine only).
	microCtx     context.Context
	first, last  bool
	wrote        bool   // a piece was written this step (stages 0-1)
	got          []int  // per bucket: elements released in this micro-batch
	sent         []bool // per bucket: handed to the communication goroutine
	slot         []int  // stage 2, per bucket: its staging buffer, -1 for none yet
	bufs         [][]float32
	free         chan int // stage 2: staging buffers not in use
	scalar       [2]float32
	maxBucketLen int

	// The communication goroutine.
	jobs      chan commJob
	inflight  sync.WaitGroup // jobs handed over and not done
	stopped   sync.WaitGroup
	closed    bool
	errMu     sync.Mutex
	commErr   error        // the first failure; later jobs are skipped
	commNanos atomic.Int64 // time spent in the reductions (CommSeconds)
	gathNanos atomic.Int64 // time spent in the parameters' all-gathers (GatherSeconds)

	// The parameters' all-gather prefetched under the next forward pass (prefetching): the
	// communication goroutine sends one token on gathTok per gather bucket it has finished
	// (or skipped after a failure); the trainer goroutine takes them in WaitParams.
	gathTok  chan struct{}
	gathOut  bool  // a prefetched all-gather has buckets whose token is not yet taken
	gathNext int   // the first gather bucket whose token is not yet taken
	gathErr  error // the last prefetched all-gather's failure (errMu): the parameters are incomplete until Step or SetMaster
}

// commJob is one bucket for the communication goroutine, or the parameters' all-gather
// (gather).
type commJob struct {
	ctx    context.Context
	bucket int
	slot   int // stage 2: the staging buffer holding it
	gather bool
}

// NewEngine allocates a rank's buffers and optimizer for its shard and starts its
// communication goroutine (Close stops it).
func NewEngine(o Options) (*Engine, error) {
	if err := o.Config.Validate(); err != nil {
		return nil, fmt.Errorf("zero_optimization.%w", err)
	}
	if o.Pool == nil {
		return nil, errors.New("zero: Options.Pool is required")
	}
	e := &Engine{cfg: o.Config, offload: o.Config.Offload(), world: 1, comm: o.Comm, format: o.Format, pool: o.Pool, params: o.Params}
	if o.Comm != nil {
		e.rank, e.world = o.Comm.Rank(), o.Comm.Size()
	}
	n := len(o.Params)
	var err error
	if e.layout, err = NewLayout(n, e.world); err != nil {
		return nil, err
	}
	reduceElems, gatherElems := o.Config.ResolveBuckets(n, e.world)
	if e.reduce, err = e.layout.BucketsAt(reduceElems, o.Extents); err != nil {
		return nil, err
	}
	if e.gather, err = e.layout.Buckets(gatherElems); err != nil {
		return nil, err
	}
	e.planBuckets(o.Extents)
	e.lo, e.hi = 0, n
	if o.Config.Stage >= 1 {
		e.lo, e.hi = e.layout.Shard(e.rank)
	}
	ok := false
	defer func() {
		if !ok {
			e.Close()
		}
	}()
	if o.Format == half.FP32 && !e.offload {
		e.master = o.Params[e.lo:e.hi]
	} else {
		if e.master, err = e.alloc(e.hi-e.lo, arena.Master); err != nil {
			return nil, err
		}
		copy(e.master, o.Params[e.lo:e.hi])
	}
	e.hostGrads = e.offload
	if err := e.gradBuffers(GradPartitioned(o.Config.Stage, o.Accum)); err != nil {
		return nil, err
	}
	if e.offload {
		if o.Format != half.FP32 {
			if e.staging, err = e.alloc(e.hi-e.lo, arena.Buffers); err != nil {
				return nil, err
			}
		}
		e.stream = o.Stream
		if e.stream == nil {
			e.stream, e.ownStream = offload.NewHostStream(64), true
		}
	}
	if e.opt, err = optim.NewWithPool(o.Optimizer, e.hi-e.lo, o.Pool); err != nil {
		return nil, fmt.Errorf("optimizer: %w", err)
	}
	e.jobs = make(chan commJob, len(e.reduce)+1)
	e.gathTok = make(chan struct{}, len(e.gather))
	e.stopped.Add(1)
	go e.communicate()
	e.writeShard()
	ok = true
	return e, nil
}

// alloc maps n zeroed float32s outside the Go heap, freed by Close.
func (e *Engine) alloc(n int, c arena.Category) ([]float32, error) {
	b, f, err := arena.Float32s(n, c)
	if err != nil {
		return nil, fmt.Errorf("zero: allocating %d elements of %s: %w", n, c, err)
	}
	if b != nil {
		e.blocks = append(e.blocks, b)
	}
	if f == nil {
		f = []float32{}
	}
	return f, nil
}

// planBuckets records, per reduce bucket, how many gradient elements the pass writes into it
// and the gaps it leaves (alignment padding), which stay zero.
func (e *Engine) planBuckets(ext []Extent) {
	nb := len(e.reduce)
	e.cuts = make([]int, nb)
	e.want = make([]int, nb)
	e.holes = make([][][2]int, nb)
	e.got = make([]int, nb)
	e.sent = make([]bool, nb)
	e.slot = make([]int, nb)
	if ext == nil {
		ext = []Extent{{Off: 0, Size: e.layout.Size, Row: 1}}
	}
	sorted := append([]Extent(nil), ext...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Off < sorted[j].Off })
	for i, b := range e.reduce {
		e.cuts[i] = b.Lo
		e.maxBucketLen = max(e.maxBucketLen, b.Hi-b.Lo)
		at := b.Lo
		for _, x := range sorted {
			lo, hi, ok := Overlap(x.Off, x.Off+x.Size, b.Lo, b.Hi)
			if !ok {
				continue
			}
			if lo > at {
				e.holes[i] = append(e.holes[i], [2]int{at - b.Lo, lo - b.Lo})
			}
			e.want[i] += hi - lo
			at = hi
		}
		if at < b.Hi {
			e.holes[i] = append(e.holes[i], [2]int{at - b.Lo, b.Hi - b.Lo})
		}
	}
}

// Close stops the communication goroutine and the optimizer, and frees the buffers (not the
// pool, the communicator or a stream passed in, which the caller owns). Safe to call twice.
func (e *Engine) Close() error {
	if e.closed {
		return nil
	}
	e.closed = true
	if e.jobs != nil {
		close(e.jobs)
		e.stopped.Wait()
	}
	var err error
	if e.opt != nil {
		err = e.opt.Close()
	}
	if e.ownStream {
		err = errors.Join(err, e.stream.Close())
	}
	for _, b := range e.blocks {
		b.Free()
	}
	e.blocks = nil
	for _, b := range e.gradBlks {
		b.Free()
	}
	e.gradBlks = nil
	e.grads, e.hgrads, e.gshard, e.staging, e.bufs = nil, nil, nil, nil, nil
	return err
}

// Stage is the ZeRO stage.
func (e *Engine) Stage() int { return e.cfg.Stage }

// Offloaded says whether the optimizer state and step are in host memory.
func (e *Engine) Offloaded() bool { return e.offload }

// Layout is the partition of the flat space among the group.
func (e *Engine) Layout() *Layout { return e.layout }

// ReduceBuckets is the gradient's reduce buckets, ascending.
func (e *Engine) ReduceBuckets() []Bucket { return e.reduce }

// Shard is the range of the flat space whose master weights and optimizer state this rank
// holds ([0, n) at stage 0).
func (e *Engine) Shard() (lo, hi int) { return e.lo, e.hi }

// Master is the fp32 master copy of the shard.
func (e *Engine) Master() []float32 { return e.master }

// Optimizer is the optimizer over the shard.
func (e *Engine) Optimizer() optim.Optimizer { return e.opt }

// GradPartitioned says whether a step of accum micro-batches keeps only this rank's shard of
// the gradient: at stage 2 always; at stage 1 when there is nothing to accumulate (accum 1),
// since then the gradient outside the shard is never needed after its bucket is reduced, and
// reducing it with a reduce-scatter instead of an all-reduce sends half the bytes.
func GradPartitioned(stage, accum int) bool { return stage == 2 || (stage == 1 && accum <= 1) }

// BeginStep starts a step of accum micro-batches: the partitioned gradient's shard is cleared
// (the full one is overwritten by the step's first micro-batch instead). The gradient's
// buffers are made here, the first time a step needs them.
func (e *Engine) BeginStep(accum int) error {
	e.inflight.Wait()
	clear(e.sent)
	e.wrote = false
	if err := e.gradBuffers(GradPartitioned(e.cfg.Stage, accum)); err != nil {
		return err
	}
	if e.part {
		if e.stream != nil {
			e.stream.Sync() // no transfer into the shard may still be running
		}
		clear(e.gshard)
	}
	return nil
}

// gradBuffers makes the buffers of a partitioned gradient (the shard and two staging
// buckets) or of a full one (with offload, also the shard's host copy), and frees the other
// kind's if a change of accumulation (memory adaptation) left them behind.
func (e *Engine) gradBuffers(part bool) error {
	if part == e.part && (e.gshard != nil || e.grads != nil) {
		return nil
	}
	for _, b := range e.gradBlks {
		b.Free()
	}
	e.gradBlks, e.grads, e.hgrads, e.gshard, e.bufs = nil, nil, nil, nil, nil
	e.part = part
	alloc := func(n int, c arena.Category) ([]float32, error) {
		b, f, err := arena.Float32s(n, c)
		if err != nil {
			return nil, fmt.Errorf("zero: allocating %d elements of %s: %w", n, c, err)
		}
		if b != nil {
			e.gradBlks = append(e.gradBlks, b)
		}
		if f == nil {
			f = []float32{}
		}
		return f, nil
	}
	var err error
	if !part {
		if e.grads, err = alloc(e.layout.Size, arena.Grads); err != nil {
			return err
		}
		if e.hostGrads {
			e.hgrads, err = alloc(e.hi-e.lo, arena.Grads)
		}
		return err
	}
	if e.gshard, err = alloc(e.hi-e.lo, arena.Grads); err != nil {
		return err
	}
	// Two staging buffers: the pass writes one bucket while the other is on the wire.
	const nbufs = 2
	e.free = make(chan int, nbufs)
	for i := range nbufs {
		b, err := alloc(e.maxBucketLen, arena.Buffers)
		if err != nil {
			return err
		}
		e.bufs = append(e.bufs, b)
		e.free <- i
	}
	return nil
}

// BeginMicro prepares for one micro-batch whose collectives run on ctx: first says no
// micro-batch of this step has written a gradient yet (its pieces overwrite instead of add, at
// stages 0-1), last that it is the step's last (whose buckets are all-reduced as they
// complete, at stages 0-1; at stage 2 every micro-batch's are reduce-scattered).
func (e *Engine) BeginMicro(ctx context.Context, first, last bool) {
	e.microCtx, e.first, e.last = ctx, first, last
	clear(e.got)
	if e.part {
		clear(e.sent)
		for i := range e.slot {
			e.slot[i] = -1
		}
	}
}

// Cuts are where the reduce buckets begin (model.GradSink).
func (e *Engine) Cuts() []int { return e.cuts }

// bucketOf is the reduce bucket holding offset off.
func (e *Engine) bucketOf(off int) int {
	return sort.Search(len(e.cuts), func(i int) bool { return e.cuts[i] > off }) - 1
}

// piece checks [lo, hi) lies in one bucket and returns the bucket.
func (e *Engine) piece(lo, hi int) (int, error) {
	if lo < 0 || hi > e.layout.Size || lo >= hi {
		return 0, fmt.Errorf("zero: gradient piece [%d, %d) outside the %d-element space", lo, hi, e.layout.Size)
	}
	b := e.bucketOf(lo)
	if hi > e.reduce[b].Hi {
		return 0, fmt.Errorf("zero: gradient piece [%d, %d) spans the bucket boundary at %d", lo, hi, e.reduce[b].Hi)
	}
	return b, nil
}

// Acquire returns the memory for gradient elements [lo, hi) (model.GradSink): the full
// buffer at stages 0-1 (added to after the step's first micro-batch), a staging buffer at
// stage 2 (always overwritten), waiting for one to come free if both are on the wire.
func (e *Engine) Acquire(lo, hi int) ([]float32, bool, error) {
	if err := e.err(); err != nil {
		return nil, false, err
	}
	b, err := e.piece(lo, hi)
	if err != nil {
		return nil, false, err
	}
	if !e.part {
		e.wrote = true
		return e.grads[lo:hi], !e.first, nil
	}
	if e.slot[b] < 0 {
		e.takeSlot(b)
		if err := e.err(); err != nil {
			return nil, false, err
		}
	}
	at := e.reduce[b].Lo
	return e.bufs[e.slot[b]][lo-at : hi-at], false, nil
}

// takeSlot gives bucket b a staging buffer with its gaps zeroed.
func (e *Engine) takeSlot(b int) {
	s := <-e.free // the communication goroutine frees every buffer it takes, failed or not
	e.slot[b] = s
	buf := e.bufs[s]
	for _, h := range e.holes[b] {
		clear(buf[h[0]:h[1]])
	}
}

// Release records that [lo, hi) is written; a bucket whose every element is written goes to
// the communication goroutine (model.GradSink).
func (e *Engine) Release(lo, hi int) error {
	b, err := e.piece(lo, hi)
	if err != nil {
		return err
	}
	e.got[b] += hi - lo
	if e.got[b] > e.want[b] {
		return fmt.Errorf("zero: gradient bucket [%d, %d) written %d times its %d elements", e.reduce[b].Lo, e.reduce[b].Hi, e.got[b], e.want[b])
	}
	if e.got[b] == e.want[b] && e.dispatching() {
		return e.dispatchFrom(b)
	}
	return nil
}

// dispatching says whether this micro-batch's buckets are reduced as they complete.
func (e *Engine) dispatching() bool { return e.part || e.last }

// dispatchFrom hands over bucket b and any above it not yet sent (empty ones: the pass
// writes from the top, so every bucket above b is complete). Every rank hands its buckets
// over in the same order, from the top.
func (e *Engine) dispatchFrom(b int) error {
	for i := len(e.reduce) - 1; i > b; i-- {
		if e.sent[i] {
			continue
		}
		if e.got[i] != e.want[i] {
			return fmt.Errorf("zero: gradient bucket [%d, %d) is complete while [%d, %d) above it is not: pieces must come from the top",
				e.reduce[b].Lo, e.reduce[b].Hi, e.reduce[i].Lo, e.reduce[i].Hi)
		}
		e.dispatch(i)
	}
	e.dispatch(b)
	return nil
}

// dispatch hands bucket b to the communication goroutine (zero-filled if the pass wrote none
// of it: a rank whose micro-batch failed still takes part in the collectives).
func (e *Engine) dispatch(b int) {
	e.sent[b] = true
	job := commJob{ctx: e.microCtx, bucket: b, slot: -1}
	if e.part {
		if e.slot[b] < 0 {
			e.takeSlot(b)
			clear(e.bufs[e.slot[b]][:e.reduce[b].Hi-e.reduce[b].Lo])
		}
		job.slot = e.slot[b]
	}
	e.inflight.Add(1)
	if !e.cfg.OverlapComm {
		// Without overlap the pass waits for each bucket's reduction, here.
		e.run(job)
		return
	}
	e.jobs <- job
}

// EndMicro finishes the micro-batch's part (whether it ran or failed): at stage 2 — and at
// stages 0-1 in the step's last micro-batch — every bucket not yet handed over goes now, so
// that every rank issues the same collectives. It does not wait for them.
func (e *Engine) EndMicro() error {
	if !e.dispatching() {
		return e.err()
	}
	if !e.part && !e.wrote {
		// No micro-batch of this rank ran: it adds nothing to the average.
		clear(e.grads)
	}
	for b := len(e.reduce) - 1; b >= 0; b-- {
		if !e.sent[b] {
			e.dispatch(b)
		}
	}
	return e.err()
}

// err is the communication goroutine's first failure.
func (e *Engine) err() error {
	e.errMu.Lock()
	defer e.errMu.Unlock()
	return e.commErr
}

func (e *Engine) fail(err error) {
	e.errMu.Lock()
	if e.commErr == nil {
		e.commErr = err
	}
	e.errMu.Unlock()
}

// communicate is the communication goroutine: it reduces the buckets handed over, in order.
// After a failure it skips the collectives but still releases the buckets' buffers.
func (e *Engine) communicate() {
	defer e.stopped.Done()
	for j := range e.jobs {
		e.run(j)
	}
}

// run reduces one bucket (skipped after a failure), releases its staging buffer and accounts
// the time its collective took; or runs the parameters' all-gather.
func (e *Engine) run(j commJob) {
	if j.gather {
		e.runGather(j.ctx)
		return
	}
	if e.err() == nil {
		start := time.Now()
		if err := e.reduceBucket(j); err != nil {
			e.fail(err)
		}
		e.commNanos.Add(int64(time.Since(start)))
	}
	if j.slot >= 0 {
		e.free <- j.slot
	}
	e.inflight.Done()
}

// CommSeconds is the wall time the gradient's reductions have taken since the engine
// started, on the communication goroutine (overlap_comm) or in the backward pass.
func (e *Engine) CommSeconds() float64 { return time.Duration(e.commNanos.Load()).Seconds() }

// GatherSeconds is the wall time the optimizer steps' all-gathers of the parameters (stages
// 1-2) have taken since the engine started: the rest of a step's communication.
func (e *Engine) GatherSeconds() float64 { return time.Duration(e.gathNanos.Load()).Seconds() }

// reduceBucket runs one bucket's collective and files the result: in place in the full
// gradient at stages 0-1 (with offload, this rank's part copied to the host), into the
// gradient shard at stage 2.
func (e *Engine) reduceBucket(j commJob) error {
	b := e.reduce[j.bucket]
	if !e.part {
		buf := e.grads[b.Lo:b.Hi]
		if e.world > 1 {
			op := e.prepareReduce(buf)
			if err := e.comm.AllReduce(j.ctx, buf, op, collective.Call{Wire: e.format}); err != nil {
				return fmt.Errorf("all-reduce of gradient bucket [%d, %d): %w", b.Lo, b.Hi, err)
			}
		}
		if lo, hi, ok := Overlap(b.Lo, b.Hi, e.lo, e.hi); ok && e.hgrads != nil {
			e.stream.Copy(e.hgrads[lo-e.lo:hi-e.lo], e.grads[lo:hi])
		}
		return nil
	}
	buf := e.bufs[j.slot][:b.Hi-b.Lo]
	if e.world > 1 {
		op := e.prepareReduce(buf)
		if err := e.comm.ReduceScatter(j.ctx, buf, b.Shards, op, collective.Call{Wire: e.format}); err != nil {
			return fmt.Errorf("reduce-scatter of gradient bucket [%d, %d): %w", b.Lo, b.Hi, err)
		}
	}
	mine := buf[b.Shards[e.rank]:b.Shards[e.rank+1]]
	if len(mine) == 0 {
		return nil
	}
	at := b.Lo + b.Shards[e.rank] - e.lo
	dst := e.gshard[at : at+len(mine)]
	if e.stream != nil {
		// Offloaded, the shard is fp32 host memory (DeepSpeed's CPU accumulation); the
		// staging buffer is reused once the transfer has read it.
		e.stream.Wait(e.stream.Accumulate(dst, mine))
		return nil
	}
	// On the device the shard is in the working precision, like the full gradient at
	// stages 0-1, so every stage sums micro-batches with the same rounding and sees the same
	// overflows.
	vec.Add(dst, mine)
	if e.format != half.FP32 {
		vec.Round(dst, e.format)
	}
	return nil
}

// prepareReduce returns the reduction to use on buf: the average, except that fp16 partial
// sums of N ranks could overflow on the wire where their average would not, so fp16 gradients
// are divided by N first and summed (DeepSpeed's gradient predivision). It runs on the
// communication goroutine, beside the backward pass's use of the pool, so it does not use it.
func (e *Engine) prepareReduce(buf []float32) collective.Op {
	if e.format == half.FP16 {
		vec.Scale(buf, 1/float32(e.world))
		return collective.Sum
	}
	return collective.Avg
}

// Reduce waits for the step's gradient: every bucket reduced, and with offload on the host.
// Every rank then holds identical gradient bits (stages 0-1) or its shard of them (stage 2),
// so every rank makes the same overflow and clipping decisions.
func (e *Engine) Reduce(ctx context.Context) error {
	if !e.part && !e.allSent() {
		// The trainer did not mark a last micro-batch (or none ran): send what is left.
		e.microCtx, e.last = ctx, true
		if err := e.EndMicro(); err != nil {
			e.inflight.Wait()
			return err
		}
	}
	e.inflight.Wait()
	if e.stream != nil {
		e.stream.Sync()
	}
	return e.err()
}

func (e *Engine) allSent() bool {
	for _, s := range e.sent {
		if !s {
			return false
		}
	}
	return true
}

// shardGrads is the gradient of this rank's shard after Reduce, where the optimizer reads it.
func (e *Engine) shardGrads() []float32 {
	switch {
	case e.gshard != nil:
		return e.gshard
	case e.hgrads != nil:
		return e.hgrads
	}
	return e.grads[e.lo:e.hi]
}

// SumSquares returns the sum of squares of the whole (loss-scaled) gradient, identical on
// every rank; it is not finite if any gradient element anywhere is. With a full gradient every
// rank holds all of it; with a partitioned one the shards' sums are all-reduced, so every rank
// makes the same skip and clip decision.
func (e *Engine) SumSquares(ctx context.Context) (float64, error) {
	if err := e.SettleParams(); err != nil {
		return 0, err
	}
	if !e.part {
		return e.pool.SumSquares(e.grads), nil
	}
	s := e.pool.SumSquares(e.gshard)
	if e.world == 1 {
		return s, nil
	}
	// float32 on the wire: the sum travels as a high and a low part, keeping ~48 bits of it.
	hi := float32(s)
	e.scalar[0], e.scalar[1] = hi, float32(s-float64(hi))
	if math.IsNaN(s) || math.IsInf(s, 0) || s > math.MaxFloat32 {
		e.scalar[0], e.scalar[1] = float32(math.Inf(1)), 0
	}
	if err := e.comm.AllReduce(ctx, e.scalar[:], collective.Sum, collective.Call{}); err != nil {
		return 0, fmt.Errorf("all-reduce of the gradient norm: %w", err)
	}
	return float64(e.scalar[0]) + float64(e.scalar[1]), nil
}

// Step applies the optimizer to this rank's shard (the gradient multiplied by gradScale, the
// learning rate lr), writes the shard's working-precision parameters, and at stages 1-2
// all-gathers the parameters so every rank holds the whole updated model. With overlap_comm
// the all-gather is left running on the communication goroutine (Prefetching): the next
// forward pass waits for each layer's parameters (WaitParams), and every other reader for
// all of them (SettleParams).
func (e *Engine) Step(ctx context.Context, lr, gradScale float32) error {
	if err := e.SettleParams(); err != nil {
		return err
	}
	e.opt.Step(e.master, e.shardGrads(), lr, gradScale)
	e.writeShard()
	if e.Prefetching() {
		e.gathOut, e.gathNext = true, 0
		e.setGathErr(nil)
		e.jobs <- commJob{ctx: ctx, gather: true}
		return nil
	}
	return e.gatherParams(ctx)
}

// Prefetching says whether Step leaves the parameters' all-gather running under the next
// forward pass (FSDP's forward prefetch): at stages 1-2 in a group, with overlap_comm. The
// gather buckets go in increasing offset, the order a forward pass reads the layers.
func (e *Engine) Prefetching() bool {
	return e.cfg.OverlapComm && e.world > 1 && e.cfg.Stage > 0 && len(e.gather) > 0
}

// WaitParams waits until the parameters below hi (offsets of the flat space) hold the last
// Step's values on every rank: the forward pass calls it before each layer
// (model.ParamWaiter). It fails if the last prefetched all-gather did (the parameters are
// then incomplete), not for other failures of the group's communication.
func (e *Engine) WaitParams(hi int) error {
	for e.gathOut && e.gathNext < len(e.gather) && e.gather[e.gathNext].Lo < hi {
		<-e.gathTok
		e.gathNext++
	}
	if e.gathNext == len(e.gather) {
		e.gathOut = false
	}
	e.errMu.Lock()
	defer e.errMu.Unlock()
	return e.gathErr
}

// SettleParams waits for the whole of a prefetched all-gather: what reads the parameters
// other than a training forward pass (evaluation, checkpoints, snapshots), and whatever
// issues a collective on the trainer's goroutine, calls it first.
func (e *Engine) SettleParams() error { return e.WaitParams(math.MaxInt) }

func (e *Engine) setGathErr(err error) {
	e.errMu.Lock()
	e.gathErr = err
	e.errMu.Unlock()
}

// runGather is a prefetched all-gather on the communication goroutine: bucket by bucket,
// a token for each (also for those skipped after a failure, which leave the parameters
// incomplete).
func (e *Engine) runGather(ctx context.Context) {
	for _, b := range e.gather {
		err := e.err()
		if err == nil {
			start := time.Now()
			if err = e.comm.AllGather(ctx, e.params[b.Lo:b.Hi], b.Shards, collective.Call{Wire: e.format}); err != nil {
				err = fmt.Errorf("all-gather of parameters [%d, %d): %w", b.Lo, b.Hi, err)
				e.fail(err)
			}
			e.gathNanos.Add(int64(time.Since(start)))
		}
		if err != nil {
			e.errMu.Lock()
			if e.gathErr == nil {
				e.gathErr = err
			}
			e.errMu.Unlock()
		}
		e.gathTok <- struct{}{}
	}
}

// writeShard writes the master shard, rounded to the working precision, into the device
// parameters: with offload through the stream (host → device), rounding on the host first.
func (e *Engine) writeShard() {
	p := e.params[e.lo:e.hi]
	switch {
	case e.offload && e.format == half.FP32:
		e.stream.Copy(p, e.master)
		e.stream.Sync()
	case e.offload:
		copy(e.staging, e.master)
		vec.Round(e.staging, e.format)
		e.stream.Copy(p, e.staging)
		e.stream.Sync()
	case e.format != half.FP32:
		copy(p, e.master)
		vec.Round(p, e.format)
	}
}

// gatherParams spreads each rank's updated shard to every rank (stages 1-2), in the working
// precision: the values are representable in it, so the wire loses nothing.
func (e *Engine) gatherParams(ctx context.Context) error {
	if e.world == 1 || e.cfg.Stage == 0 {
		return nil
	}
	start := time.Now()
	defer func() { e.gathNanos.Add(int64(time.Since(start))) }()
	for _, b := range e.gather {
		if err := e.comm.AllGather(ctx, e.params[b.Lo:b.Hi], b.Shards, collective.Call{Wire: e.format}); err != nil {
			return fmt.Errorf("all-gather of parameters [%d, %d): %w", b.Lo, b.Hi, err)
		}
	}
	return nil
}

// FullMaster returns the fp32 master weights of the whole model: a collective at stages 1-2
// with fp16/bf16 (the master is sharded and differs from the parameters), so every rank must
// call it. The result may alias the engine's buffers; treat it as read-only.
func (e *Engine) FullMaster(ctx context.Context) ([]float32, error) {
	if err := e.SettleParams(); err != nil {
		return nil, err
	}
	if e.format == half.FP32 {
		return e.params, nil // equal to the master bit for bit after every step
	}
	if e.cfg.Stage == 0 {
		return e.master, nil
	}
	full, err := e.Gather(ctx, e.master)
	if err != nil {
		return nil, fmt.Errorf("gathering the fp32 master weights: %w", err)
	}
	return full, nil
}

// Gather returns the whole vector of which shard is this rank's part (Shard's [lo, hi)), on
// every rank: a collective at stages 1-2 that every rank must call; at stage 0 a copy. The
// result is a new slice on the Go heap.
func (e *Engine) Gather(ctx context.Context, shard []float32) ([]float32, error) {
	if len(shard) != e.hi-e.lo {
		return nil, fmt.Errorf("zero: Gather of %d elements, this rank's shard has %d", len(shard), e.hi-e.lo)
	}
	if err := e.SettleParams(); err != nil {
		return nil, err
	}
	full := make([]float32, len(e.params))
	copy(full[e.lo:e.hi], shard)
	if e.world > 1 && e.cfg.Stage > 0 {
		for _, b := range e.gather {
			if err := e.comm.AllGather(ctx, full[b.Lo:b.Hi], b.Shards, collective.Call{}); err != nil {
				return nil, err
			}
		}
	}
	return full, nil
}

// SetMaster loads this rank's part of a full fp32 master vector (initial or checkpointed
// weights, identical on every rank) and sets the whole working-precision parameters from it.
func (e *Engine) SetMaster(full []float32) {
	if len(full) != len(e.params) {
		panic(fmt.Sprintf("zero: SetMaster with %d elements, the model has %d", len(full), len(e.params)))
	}
	// A prefetched all-gather must not write over the new weights; whether it failed no
	// longer matters, since they replace all it wrote.
	_ = e.SettleParams()
	e.setGathErr(nil)
	copy(e.master, full[e.lo:e.hi])
	copy(e.params, full)
	if e.format != half.FP32 {
		vec.Round(e.params, e.format)
	}
}

// Memory reports the bytes this rank's engine holds. The engine's host buffers store every
// format in float32, 4 bytes per element (the model's own half-precision copies are the
// compute engine's to report).
func (e *Engine) Memory() memory.States {
	const f32 = 4
	var m memory.States
	m.Device.Params = int64(len(e.params)) * f32
	m.Device.Grads = int64(len(e.grads)) * f32
	for _, b := range e.bufs {
		m.Device.Buffers += int64(len(b)) * f32
	}
	side := &m.Device
	if e.offload {
		side = &m.Host
	}
	side.Grads += int64(len(e.hgrads)+len(e.gshard)) * f32
	if !(e.format == half.FP32 && !e.offload) { // otherwise the master is the parameters
		side.Master = int64(len(e.master)) * f32
	}
	side.Optimizer = optim.StateBytes(e.opt) // codes and scales for the 8-bit optimizers
	m.Host.Buffers += int64(len(e.staging)) * f32
	return m
}
