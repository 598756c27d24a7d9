package optim

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/qvd/qvd/offload"
)

// Optimizer updates a flat fp32 parameter buffer, or one contiguous shard of it, in place from
// the matching flat gradient buffer.
type Optimizer interface {
	// Step updates params in place from grads. The gradient used is grads[i]*gradScale:
	// gradScale fuses loss-scale removal and global-norm clipping into the same pass over
	// memory. lr is the learning rate for this step. len(params) and len(grads) must equal
	// Len(), else Step panics (a programmer error). Step runs in parallel on the optimizer's
	// threads and does not allocate.
	Step(params, grads []float32, lr, gradScale float32)
	// Len is the number of parameters, fixed at construction.
	Len() int
	// Steps is the number of completed Step calls: Adam's t for bias correction, and for SGD
	// with momentum whether the buffer is initialised. Safe to call concurrently with Step.
	Steps() int64
	// SetSteps sets the step count when restoring from a checkpoint, together with copying
	// State. t must be >= 0; the checkpoint loader validates it.
	SetSteps(t int64)
	// State returns the optimizer's state buffers as named views (not copies), in a fixed
	// order: "exp_avg", "exp_avg_sq" for adam and adamw, "momentum_buffer" for sgd with
	// momentum, none for plain sgd. A checkpoint saves them and restores by copying into the
	// same views. The returned slice is the caller's; the buffers are the optimizer's, mapped
	// outside the Go heap (internal/arena): the views are valid until Close unmaps them, and
	// must not be used after it. After Close, State returns nil.
	// An optimizer whose state is not float32 (adam8bit, adamw8bit) returns nil and implements
	// StateCodec; code that saves, restores or measures state uses ExportState, ImportState and
	// StateBytes, which handle both kinds.
	State() []NamedBuffer
	// Close unmaps the optimizer's state, which invalidates every view State returned, and
	// stops the worker goroutines of the optimizer's own pool (not those of a pool passed to
	// NewWithPool). It is safe to call twice. Step after Close panics (a programmer error),
	// and ImportState returns ErrClosed.
	Close() error
}

// StateCodec is implemented by an optimizer that keeps its state in a compact encoding (the
// 8-bit optimizers) rather than as float32 views. Checkpoints still hold float32 state, so they
// can be resumed by any world size, ZeRO stage and shard alignment: the encoding is the
// optimizer's business, its buffers' names and meaning are the float32 optimizer's.
type StateCodec interface {
	// ExportState decodes the state into new float32 buffers of length Len(), named and
	// ordered as the float32 optimizer's State. They are the caller's: temporary memory at
	// checkpoint time, not views; writing into them changes nothing until ImportState. It
	// returns nil after Close.
	ExportState() []NamedBuffer
	// ImportState encodes state, named and sized as ExportState's, into the optimizer. It
	// returns an error, changing nothing, for the wrong names or lengths or values the state
	// cannot hold (such as a NaN or a negative second moment), and ErrClosed after Close.
	ImportState(state []NamedBuffer) error
	// StateBytes is the memory the encoded state occupies.
	StateBytes() int64
}

// ExportState returns o's state as float32 buffers: State's views for a float32 optimizer,
// fresh decoded copies for a StateCodec.
func ExportState(o Optimizer) []NamedBuffer {
	if c, ok := o.(StateCodec); ok {
		return c.ExportState()
	}
	return o.State()
}

// ErrClosed is returned by ImportState on an optimizer that has been closed: its state is
// unmapped.
var ErrClosed = errors.New("optim: optimizer is closed")

// ImportState finishes a restore into buffers that ExportState(o) returned: a StateCodec
// encodes them; for a float32 optimizer they were its views, already written, and it does
// nothing.
func ImportState(o Optimizer, state []NamedBuffer) error {
	if c, ok := o.(StateCodec); ok {
		return c.ImportState(state)
	}
	return nil
}

// StateBytes is the memory o's state occupies.
func StateBytes(o Optimizer) int64 {
	if c, ok := o.(StateCodec); ok {
		return c.StateBytes()
	}
	var b int64
	for _, nb := range o.State() {
		b += 4 * int64(len(nb.Data))
	}
	return b
}

// NamedBuffer is a named view of an optimizer state buffer of length Len().
type NamedBuffer struct {
	Name string
	Data []float32
}

// New validates cfg and returns the optimizer it describes for n parameters (n >= 0; a rank's
// ZeRO shard may be empty), with its own Pool of cfg.Threads threads. The state is mapped
// here, zeroed and outside the Go heap (internal/arena, category arena.Optimizer); where the
// kernel refuses it the error wraps arena.ErrOutOfMemory.
func New(cfg Config, n int) (Optimizer, error) { return newOn(cfg, n, nil) }

// NewWithPool is New on a Pool that the caller owns and shares with its other passes;
// cfg.Threads is ignored and Close leaves the pool running.
func NewWithPool(cfg Config, n int, pool *offload.Pool) (Optimizer, error) {
	if pool == nil {
		return nil, errors.New("optim: NewWithPool with a nil pool")
	}
	return newOn(cfg, n, pool)
}

// newOn builds the optimizer on pool, or on a Pool of its own when pool is nil.
func newOn(cfg Config, n int, pool *offload.Pool) (Optimizer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("optim: optimizer config: %w", err)
	}
	if n < 0 {
		return nil, fmt.Errorf("optim: optimizer length must be >= 0, got %d", n)
	}
	o, err := build(cfg, n)
	if err != nil {
		return nil, err
	}
	own := pool == nil
	if own {
		pool = offload.NewPool(cfg.Threads)
	}
	o.core().init(n, pool, own)
	return o, nil
}

// optimizer is what build returns: an Optimizer whose base New and NewWithPool complete.
type optimizer interface {
	Optimizer
	core() *base
}

// build returns cfg's optimizer for n parameters with its state mapped, before it has a pool.
func build(cfg Config, n int) (optimizer, error) {
	var o optimizer
	var err error
	switch cfg.Type {
	case TypeSGD:
		o, err = asOptimizer(newSGD(cfg, n))
	case TypeAdam8bit, TypeAdamW8bit:
		o, err = asOptimizer(newAdam8(cfg, n))
	default:
		o, err = asOptimizer(newAdam(cfg, n))
	}
	if err != nil {
		return nil, fmt.Errorf("optim: %s state for %d parameters: %w", cfg.Type, n, err)
	}
	return o, nil
}

// asOptimizer keeps a failed constructor's nil pointer out of the interface.
func asOptimizer[T optimizer](o T, err error) (optimizer, error) {
	if err != nil {
		return nil, err
	}
	return o, nil
}

// base is what every optimizer shares: length, step count, pool and the state's memory.
type base struct {
	n       int
	steps   atomic.Int64
	pool    *offload.Pool
	ownPool bool
	grain   int      // Run grain for Step; tests shrink it to split tiny buffers across threads
	mem     stateMem // the state's arena blocks, unmapped by Close
	closed  bool
}

func (b *base) init(n int, pool *offload.Pool, ownPool bool) {
	b.n, b.pool, b.ownPool, b.grain = n, pool, ownPool, offload.DefaultGrain
}

func (b *base) core() *base  { return b }
func (b *base) Len() int     { return b.n }
func (b *base) Steps() int64 { return b.steps.Load() }
func (b *base) SetSteps(t int64) {
	if t < 0 {
		panic(fmt.Sprintf("optim: SetSteps(%d): step count must be >= 0", t))
	}
	b.steps.Store(t)
}

// close is the shared half of every optimizer's Close, which first drops its own slices of
// the state: it unmaps the state and stops an own pool. Safe to call twice.
func (b *base) close() error {
	b.closed = true
	b.mem.free()
	if b.ownPool {
		return b.pool.Close()
	}
	return nil
}

// checkStep panics on a Step with buffers of the wrong length or after Close (whose state
// is unmapped: without the check the step would fault, not panic).
func (b *base) checkStep(params, grads []float32) {
	if len(params) != b.n || len(grads) != b.n || b.closed {
		panicStep(len(params), len(grads), b.n, b.closed)
	}
}

// panicStep is out of line so that its boxing of arguments stays off Step's path.
//
//go:noinline
func panicStep(p, g, n int, closed bool) {
	if closed {
		panic("optim: Step after Close")
	}
	panic(fmt.Sprintf("optim: Step with len(params)=%d, len(grads)=%d on an optimizer of length %d", p, g, n))
}
