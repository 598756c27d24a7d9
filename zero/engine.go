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
	// Stream moves gradients to the host and parameters back when the optimizer is offloaded
	// (Config.OffloadOptimizer.Device == "cpu"); nil makes the engine start a HostStream.
	Stream offload.Stream
}

// Engine runs one rank's part of a ZeRO training step. Its methods are called from the
// trainer's goroutine, in the order: BeginStep; per micro-batch BeginMicro, the model's
// backward into Micro() (stages 0-1) or through MicroSink (stage 2), EndMicro; then Reduce,
// SumSquares and Step. Every rank calls the same methods in the same order: they run
// collectives.
//
// Where the buffers live: the model's parameters, the stage 0-1 gradient and stage 2's
// staging buckets are on the device; the master weights, the gradient shard the optimizer
// reads and the optimizer state are on the device too without offload, and in host memory
// with offload, where the optimizer step runs. On the CPU engine both are the same RAM, but
// the transfers still happen (through offload.Stream) and are accounted apart, so the bytes
// reported are the ones the GPU engine will place on each side.
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

	params []float32 // full working parameters (the model's), on the device
	// master is the fp32 master copy the optimizer updates: stage 0 all of it, stages 1-2 the
	// shard. Training in fp32 without offload it is (a view of) params itself: no second copy.
	master []float32
	opt    offload.Optimizer

	// grads: stages 0-1 the full gradient accumulated over micro-batches (device); nil at 2.
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
	// buckets: stage 2's staging buffers for one reduce bucket each; the model's gradient
	// streams through them, so no full-size gradient buffer is held. With offload there are
	// two, so one bucket's transfer to the host overlaps the next bucket's reduction.
	buckets        [][]float32
	tickets        []offload.Ticket
	reduce, gather []Bucket
	bi, cur        int             // stage 2: current reduce bucket and staging buffer
	microCtx       context.Context // stage 2: context of the collectives the sink triggers
	microErr       error
	scalar         [2]float32
}

// NewEngine allocates a rank's buffers and optimizer for its shard.
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
	if o.Format == half.FP32 && !e.offload {
		e.master = o.Params[e.lo:e.hi]
	} else {
		e.master = make([]float32, e.hi-e.lo)
		copy(e.master, o.Params[e.lo:e.hi])
	}
	if o.Config.Stage == 2 {
		e.gshard = make([]float32, e.hi-e.lo)
		maxBucket := 0
		for _, b := range e.reduce {
			maxBucket = max(maxBucket, b.Hi-b.Lo)
		}
		nb := 1
		if e.offload {
			nb = 2
		}
		for range nb {
			e.buckets = append(e.buckets, make([]float32, maxBucket))
		}
		e.tickets = make([]offload.Ticket, nb)
	} else {
		e.grads = make([]float32, n)
		if e.offload {
			e.hgrads = make([]float32, e.hi-e.lo)
		}
	}
	if e.offload {
		if o.Format != half.FP32 {
			e.staging = make([]float32, e.hi-e.lo)
		}
		e.stream = o.Stream
		if e.stream == nil {
			e.stream, e.ownStream = offload.NewHostStream(64), true
		}
	}
	if e.opt, err = offload.NewWithPool(o.Optimizer, e.hi-e.lo, o.Pool); err != nil {
		e.Close()
		return nil, fmt.Errorf("optimizer: %w", err)
	}
	e.writeShard()
	return e, nil
}

// Close stops the optimizer and the engine's own stream (not the pool, the communicator or a
// stream passed in, which the caller owns).
func (e *Engine) Close() error {
	var err error
	if e.opt != nil {
		err = e.opt.Close()
	}
	if e.ownStream {
		err = errors.Join(err, e.stream.Close())
	}
	return err
}

// Stage is the ZeRO stage.
func (e *Engine) Stage() int { return e.cfg.Stage }

// Offloaded says whether the optimizer state and step are in host memory.
func (e *Engine) Offloaded() bool { return e.offload }

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
		if e.stream != nil {
			e.stream.Sync() // no transfer into the shard may still be running
		}
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
		e.bi = 0
		e.useBucket(0)
	}
}

// useBucket makes staging buffer i current, once the transfer that last read it is done.
func (e *Engine) useBucket(i int) {
	e.cur = i
	if e.stream != nil {
		e.stream.Wait(e.tickets[i])
	}
	clear(e.buckets[i])
}

// MicroSink receives one tensor of the micro-batch's gradient at flat offset off, in
// increasing offset order (stage 2). Whenever a bucket is complete it is reduce-scattered and
// this rank's part added into its gradient shard.
func (e *Engine) MicroSink(off int, g []float32) error {
	if e.microErr != nil {
		return e.microErr
	}
	for len(g) > 0 {
		if e.bi >= len(e.reduce) {
			e.microErr = fmt.Errorf("zero: gradient at flat offset %d is past the end of the %d-element space", off, e.layout.Size)
			return e.microErr
		}
		b := e.reduce[e.bi]
		if off >= b.Hi {
			if e.microErr = e.flushBucket(); e.microErr != nil {
				return e.microErr
			}
			continue
		}
		if off < b.Lo {
			e.microErr = fmt.Errorf("zero: gradient at flat offset %d arrived after bucket [%d, %d) began: tensors must come in offset order", off, b.Lo, b.Hi)
			return e.microErr
		}
		n := min(len(g), b.Hi-off)
		copy(e.buckets[e.cur][off-b.Lo:], g[:n])
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

// flushBucket reduce-scatters the current bucket and accumulates this rank's part into the
// gradient shard — through the stream with offload, so the transfer overlaps what follows.
func (e *Engine) flushBucket() error {
	b := e.reduce[e.bi]
	buf := e.buckets[e.cur][:b.Hi-b.Lo]
	if e.world > 1 {
		op := e.prepareReduce(buf)
		if err := e.comm.ReduceScatter(e.microCtx, buf, b.Shards, op, collective.Call{Wire: e.format}); err != nil {
			return fmt.Errorf("reduce-scatter of gradient bucket [%d, %d): %w", b.Lo, b.Hi, err)
		}
	}
	mine := buf[b.Shards[e.rank]:b.Shards[e.rank+1]]
	if len(mine) > 0 {
		at := b.Lo + b.Shards[e.rank] - e.lo
		dst := e.gshard[at : at+len(mine)]
		switch {
		case e.stream != nil:
			// Offloaded, the shard is fp32 host memory (DeepSpeed's CPU accumulation).
			e.tickets[e.cur] = e.stream.Accumulate(dst, mine)
		default:
			// On the device the shard is in the working precision, like the full gradient
			// at stages 0-1, so every stage sums micro-batches with the same rounding and
			// sees the same overflows.
			vec.Add(dst, mine)
			if e.format != half.FP32 {
				vec.Round(dst, e.format)
			}
		}
	}
	e.bi++
	if e.bi < len(e.reduce) {
		e.useBucket((e.cur + 1) % len(e.buckets))
	}
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
// the same overflow and clipping decisions. With offload, each bucket's part of this rank's
// shard is sent to the host as soon as it is reduced.
func (e *Engine) Reduce(ctx context.Context) error {
	if e.cfg.Stage == 2 {
		if e.stream != nil {
			e.stream.Sync() // the last buckets' transfers into the shard
		}
		return nil
	}
	for _, b := range e.reduce {
		buf := e.grads[b.Lo:b.Hi]
		if e.world > 1 {
			op := e.prepareReduce(buf)
			if err := e.comm.AllReduce(ctx, buf, op, collective.Call{Wire: e.format}); err != nil {
				return fmt.Errorf("all-reduce of gradient bucket [%d, %d): %w", b.Lo, b.Hi, err)
			}
		}
		if lo, hi, ok := Overlap(b.Lo, b.Hi, e.lo, e.hi); ok && e.hgrads != nil {
			e.stream.Copy(e.hgrads[lo-e.lo:hi-e.lo], e.grads[lo:hi])
		}
	}
	if e.stream != nil {
		e.stream.Sync()
	}
	return nil
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
// every rank; it is not finite if any gradient element anywhere is. At stages 0-1 every rank
// holds the whole gradient; at stage 2 the shards' sums are all-reduced, so every rank makes
// the same skip and clip decision.
func (e *Engine) SumSquares(ctx context.Context) (float64, error) {
	if e.cfg.Stage < 2 {
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
// all-gathers the parameters so every rank holds the whole updated model.
func (e *Engine) Step(ctx context.Context, lr, gradScale float32) error {
	e.opt.Step(e.master, e.shardGrads(), lr, gradScale)
	e.writeShard()
	return e.gatherParams(ctx)
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
	if e.format == half.FP32 {
		return e.params, nil // equal to the master bit for bit after every step
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

// SetMaster loads this rank's part of a full fp32 master vector (initial or checkpointed
// weights, identical on every rank) and sets the whole working-precision parameters from it.
func (e *Engine) SetMaster(full []float32) {
	if len(full) != len(e.params) {
		panic(fmt.Sprintf("zero: SetMaster with %d elements, the model has %d", len(full), len(e.params)))
	}
	copy(e.master, full[e.lo:e.hi])
	copy(e.params, full)
	if e.format != half.FP32 {
		vec.Round(e.params, e.format)
	}
}

// Memory is what a rank holds for training, in bytes, by where it lives and what it is —
// measured from the buffers actually allocated, not from a formula.
type Memory struct {
	Device Bytes `json:"device"`
	Host   Bytes `json:"host"` // with offload: what the optimizer step uses in host memory
}

// Bytes is one side's accounting.
type Bytes struct {
	Params    int64 `json:"params"`    // working-precision parameters (full)
	Grads     int64 `json:"grads"`     // gradients held across micro-batches (full at stages 0-1, the shard at 2)
	Master    int64 `json:"master"`    // fp32 master weights held apart from the parameters
	Optimizer int64 `json:"optimizer"` // optimizer state (moments, momentum)
	Buffers   int64 `json:"buffers"`   // communication and transfer staging buffers
}

// Total sums the categories.
func (b Bytes) Total() int64 { return b.Params + b.Grads + b.Master + b.Optimizer + b.Buffers }

// Total sums both sides.
func (m Memory) Total() int64 { return m.Device.Total() + m.Host.Total() }

// Memory reports the bytes this rank's engine holds. The CPU engine stores every format in
// float32, 4 bytes per element (the GPU engine stores fp16/bf16 in 2).
func (e *Engine) Memory() Memory {
	const f32 = 4
	var m Memory
	m.Device.Params = int64(len(e.params)) * f32
	m.Device.Grads = int64(len(e.grads)) * f32
	for _, b := range e.buckets {
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
	side.Optimizer = offload.StateBytes(e.opt) // codes and scales for the 8-bit optimizers
	m.Host.Buffers += int64(len(e.staging)) * f32
	return m
}
