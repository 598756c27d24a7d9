package zero

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
	"github.com/qvd/qvd/offload"
)

// Options build an Engine.
type Options struct {
	Config    Config
	Optimizer offload.Config
	// Params is the model's full working-precision parameter buffer (its graph reads it).
	Params []float32
	// Format is the working precision: gradients and parameters travel in it.
	Format half.Format
	// Comm is the group; nil for a single worker.
	Comm collective.Communicator
	// Pool runs the flat-buffer passes and the optimizer.
	Pool *offload.Pool
}

// Engine runs one rank's part of a ZeRO training step. Its methods are called from the
// trainer's goroutine, in the order: BeginStep, then per micro-batch BeginMicro, the model's
// backward into Micro() (or, at stage 2, MicroSink), EndMicro; then Reduce, SumSquares and
// Step. Every rank calls the same methods in the same order (they run collectives).
type Engine struct {
	cfg         Config
	rank, world int
	comm        collective.Communicator
	format      half.Format
	pool        *offload.Pool
	layout      *Layout
	lo, hi      int // this rank's shard; [0, n) at stage 0

	params []float32 // full working parameters (the model's)
	// master is the fp32 master copy the optimizer updates: stage 0 all of it, stages 1-2 the
	// shard. With fp32 training it is (a view of) params itself: no second copy.
	master []float32
	opt    offload.Optimizer

	// grads: stages 0-1 the full gradient accumulated over micro-batches; stage 2 nil.
	grads []float32
	// gshard: stage 2's gradient shard, accumulated in fp32 across micro-batches.
	gshard []float32
	// bucket: stage 2's staging buffer for one reduce bucket; the model's gradient streams
	// through it tensor by tensor, so no full-size gradient buffer is held.
	bucket           []float32
	reduce, gather   []Bucket
	bi, bfill        int             // stage 2: current bucket and how far it is written
	microCtx         context.Context // stage 2: context of the collectives the sink triggers
	microErr         error
	scalar           [1]float32
	singleWorkerOnly bool
}

// NewEngine allocates a rank's buffers and optimizer for its shard.
func NewEngine(o Options) (*Engine, error) {
	if err := o.Config.Validate(); err != nil {
		return nil, fmt.Errorf("zero_optimization.%w", err)
	}
	if o.Pool == nil {
		return nil, errors.New("zero: Options.Pool is required")
	}
	e := &Engine{cfg: o.Config, rank: 0, world: 1, comm: o.Comm, format: o.Format, pool: o.Pool, params: o.Params}
	if o.Comm != nil {
		e.rank, e.world = o.Comm.Size()-o.Comm.Size()+o.Comm.Rank(), o.Comm.Size()
	}
	n := len(o.Params)
	var err error
	if e.layout, err = NewLayout(n, e.world); err != nil {
		return nil, err
	}
	if e.reduce, err = e.layout.Buckets(int(min(o.Config.ReduceBucketSize, int64(max(n, 1))))); err != nil {
		return nil, err
	}
	if e.gather, err = e.layout.Buckets(int(min(o.Config.AllgatherBucketSize, int64(max(n, 1))))); err != nil {
		return nil, err
	}
	e.lo, e.hi = 0, n
	if o.Config.Stage >= 1 {
		e.lo, e.hi = e.layout.Shard(e.rank)
	}
	switch {
	case o.Format == half.FP32:
		e.master = o.Params[e.lo:e.hi]
	default:
		e.master = make([]float32, e.hi-e.lo)
		copy(e.master, o.Params[e.lo:e.hi])
	}
	if o.Config.Stage == 2 {
		e.gshard = make([]float32, e.hi-e.lo)
		maxBucket := 0
		for _, b := range e.reduce {
			maxBucket = max(maxBucket, b.Hi-b.Lo)
		}
		e.bucket = make([]float32, maxBucket)
	} else {
		e.grads = make([]float32, n)
	}
	if e.opt, err = offload.NewWithPool(o.Optimizer, e.hi-e.lo, o.Pool); err != nil {
		return nil, fmt.Errorf("optimizer: %w", err)
	}
	e.roundShard()
	return e, nil
}

// Close stops the optimizer (not the pool or the communicator, which the caller owns).
func (e *Engine) Close() error { return e.opt.Close() }

// Stage is the ZeRO stage.
func (e *Engine) Stage() int { return e.cfg.Stage }

// Layout is the partition of the flat space among the group.
func (e *Engine) Layout() *Layout { return e.layout }

// Shard is the range of the flat space whose master weights and optimizer state this rank
// holds ([0, n) at stage 0).
func (e *Engine) Shard() (lo, hi int) { return e.lo, e.hi }

// Master is the fp32 master copy of the shard.
func (e *Engine) Master() []float32 { return e.master }

// Optimizer is the optimizer over the shard.
func (e *Engine) Optimizer() offload.Optimizer { return e.opt }

// BeginStep clears the gradient accumulation.
func (e *Engine) BeginStep() {
	if e.grads != nil {
		clear(e.grads)
	}
	if e.gshard != nil {
		clear(e.gshard)
	}
}

// Micro is the buffer a model adds a micro-batch's gradient into (stages 0-1); nil at stage 2,
// where the gradient streams through MicroSink instead.
func (e *Engine) Micro() []float32 { return e.grads }

// BeginMicro prepares for one micro-batch whose collectives (stage 2) run on ctx.
func (e *Engine) BeginMicro(ctx context.Context) {
	if e.cfg.Stage == 2 {
		e.microCtx, e.microErr = ctx, nil
		e.bi, e.bfill = 0, 0
		clear(e.bucket)
	}
}

// MicroSink receives one tensor of the micro-batch's gradient at flat offset off, in
// increasing offset order (stage 2). Whenever a bucket is complete it is reduce-scattered and
// this rank's part added into its gradient shard.
func (e *Engine) MicroSink(off int, g []float32) error {
	if e.microErr != nil {
		return e.microErr
	}
	for len(g) > 0 {
		b := e.reduce[e.bi]
		if off >= b.Hi {
			if e.microErr = e.flushBucket(); e.microErr != nil {
				return e.microErr
			}
			continue
		}
		n := min(len(g), b.Hi-off)
		copy(e.bucket[off-b.Lo:], g[:n])
		off, g = off+n, g[n:]
	}
	return nil
}

// EndMicro finishes the micro-batch: at stage 2 the remaining buckets are reduced (every
// rank reduces every bucket, in order).
func (e *Engine) EndMicro() error {
	if e.cfg.Stage != 2 {
		return nil
	}
	for e.microErr == nil && e.bi < len(e.reduce) {
		e.microErr = e.flushBucket()
	}
	return e.microErr
}

// flushBucket reduce-scatters the current bucket and accumulates this rank's part.
func (e *Engine) flushBucket() error {
	b := e.reduce[e.bi]
	buf := e.bucket[:b.Hi-b.Lo]
	if e.world > 1 {
		op := e.prepareReduce(buf)
		if err := e.comm.ReduceScatter(e.microCtx, buf, b.Shards, op, collective.Call{Wire: e.format}); err != nil {
			return fmt.Errorf("reduce-scatter of gradient bucket [%d, %d): %w", b.Lo, b.Hi, err)
		}
	}
	mine := buf[b.Shards[e.rank]:b.Shards[e.rank+1]]
	if len(mine) > 0 {
		at := b.Lo + b.Shards[e.rank] - e.lo
		vec.Add(e.gshard[at:at+len(mine)], mine)
	}
	clear(buf)
	e.bi++
	return nil
}

// prepareReduce returns the reduction to use on buf: the average, except that fp16 partial
// sums of N ranks could overflow on the wire where their average would not, so fp16 gradients
// are divided by N first and summed (DeepSpeed's gradient predivision).
func (e *Engine) prepareReduce(buf []float32) collective.Op {
	if e.format == half.FP16 {
		e.pool.Scale(buf, 1/float32(e.world))
		return collective.Sum
	}
	return collective.Avg
}

// Reduce averages the accumulated gradient across ranks (stages 0-1), bucket by bucket, in
// the working precision. Every rank then holds identical gradient bits, so every rank makes
// the same overflow and clipping decisions.
func (e *Engine) Reduce(ctx context.Context) error {
	if e.world == 1 || e.cfg.Stage == 2 {
		return nil
	}
	for _, b := range e.reduce {
		buf := e.grads[b.Lo:b.Hi]
		op := e.prepareReduce(buf)
		if err := e.comm.AllReduce(ctx, buf, op, collective.Call{Wire: e.format}); err != nil {
			return fmt.Errorf("all-reduce of gradient bucket [%d, %d): %w", b.Lo, b.Hi, err)
		}
	}
	return nil
}

// shardGrads is the gradient of this rank's shard after Reduce.
func (e *Engine) shardGrads() []float32 {
	if e.gshard != nil {
		return e.gshard
	}
	return e.grads[e.lo:e.hi]
}

// SumSquares returns the sum of squares of the whole (loss-scaled) gradient, identical on
// every rank; it is not finite if any gradient element anywhere is. At stages 0-1 every rank
// holds the whole gradient; at stage 2 the shards' sums are all-reduced.
func (e *Engine) SumSquares(ctx context.Context) (float64, error) {
	if e.cfg.Stage < 2 {
		return e.pool.SumSquares(e.grads), nil
	}
	s := e.pool.SumSquares(e.gshard)
	if e.world == 1 {
		return s, nil
	}
	e.scalar[0] = float32(s)
	if math.IsNaN(s) || math.IsInf(s, 0) {
		e.scalar[0] = float32(math.Inf(1))
	}
	if err := e.comm.AllReduce(ctx, e.scalar[:], collective.Sum, collective.Call{}); err != nil {
		return 0, fmt.Errorf("all-reduce of the gradient norm: %w", err)
	}
	return float64(e.scalar[0]), nil
}

// Step applies the optimizer to this rank's shard (the gradient multiplied by gradScale, the
// learning rate lr), writes the shard's working-precision parameters, and at stages 1-2
// all-gathers the parameters so every rank holds the whole updated model.
func (e *Engine) Step(ctx context.Context, lr, gradScale float32) error {
	e.opt.Step(e.master, e.shardGrads(), lr, gradScale)
	e.roundShard()
	return e.gatherParams(ctx)
}

// roundShard writes the master shard, rounded to the working precision, into the parameters
// (nothing to do in fp32, where the master is the parameters).
func (e *Engine) roundShard() {
	if e.format == half.FP32 {
		return
	}
	p := e.params[e.lo:e.hi]
	copy(p, e.master)
	vec.Round(p, e.format)
}

// gatherParams spreads each rank's updated shard to every rank (stages 1-2), in the working
// precision: the values are representable in it, so the wire loses nothing.
func (e *Engine) gatherParams(ctx context.Context) error {
	if e.world == 1 || e.cfg.Stage == 0 {
		return nil
	}
	for _, b := range e.gather {
		if err := e.comm.AllGather(ctx, e.params[b.Lo:b.Hi], b.Shards, collective.Call{Wire: e.format}); err != nil {
			return fmt.Errorf("all-gather of parameters [%d, %d): %w", b.Lo, b.Hi, err)
		}
	}
	return nil
}

// FullMaster returns the fp32 master weights of the whole model, gathered from the shards
// when they are sharded and kept apart from the parameters (stages 1-2 with fp16/bf16): a
// collective, so every rank must call it. The result is a new buffer (fp32 at stage 0, or the
// parameters themselves when training in fp32).
func (e *Engine) FullMaster(ctx context.Context) ([]float32, error) {
	if e.format == half.FP32 {
		return e.params, nil
	}
	if e.cfg.Stage == 0 {
		return e.master, nil
	}
	full := make([]float32, len(e.params))
	copy(full[e.lo:e.hi], e.master)
	if e.world > 1 {
		for _, b := range e.gather {
			if err := e.comm.AllGather(ctx, full[b.Lo:b.Hi], b.Shards, collective.Call{}); err != nil {
				return nil, fmt.Errorf("gathering the fp32 master weights: %w", err)
			}
		}
	}
	return full, nil
}

// SetMaster loads this rank's part of a full fp32 master vector (a checkpoint's weights) and
// rounds it into the parameters.
func (e *Engine) SetMaster(full []float32) {
	copy(e.master, full[e.lo:e.hi])
	if e.format != half.FP32 {
		// Parameters outside the shard come from the other ranks' shards at the next
		// all-gather; set them now too so every rank starts from the same full model.
		copy(e.params, full)
		vec.Round(e.params, e.format)
	}
}

// Memory is what a rank holds for training, in bytes, by category — measured from the
// buffers actually allocated, not from a formula.
type Memory struct {
	Params    int64 `json:"params"`    // working-precision parameters (full)
	Grads     int64 `json:"grads"`     // gradients held across micro-batches (full at stages 0-1, the shard at 2)
	Master    int64 `json:"master"`    // fp32 master weights held apart from the parameters
	Optimizer int64 `json:"optimizer"` // optimizer state (moments, momentum)
	Buckets   int64 `json:"buckets"`   // stage 2's reduce staging bucket
}

// Total sums the categories.
func (m Memory) Total() int64 { return m.Params + m.Grads + m.Master + m.Optimizer + m.Buckets }

// Memory reports the bytes this rank's engine holds (the CPU engine stores every format in
// float32, 4 bytes per element).
func (e *Engine) Memory() Memory {
	const f32 = 4
	m := Memory{Params: int64(len(e.params)) * f32, Grads: int64(len(e.grads)+len(e.gshard)) * f32, Buckets: int64(len(e.bucket)) * f32}
	if e.format != half.FP32 {
		m.Master = int64(len(e.master)) * f32
	}
	for _, nb := range e.opt.State() {
		m.Optimizer += int64(len(nb.Data)) * f32
	}
	return m
}
