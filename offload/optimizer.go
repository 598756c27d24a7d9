package offload

import (
	"errors"
	"fmt"
	"sync/atomic"
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
	// same views. The returned slice is the caller's; the buffers are the optimizer's.
	// An optimizer whose state is not float32 (adam8bit, adamw8bit) returns nil and implements
	// StateCodec; code that saves, restores or measures state uses ExportState, ImportState and
	// StateBytes, which handle both kinds.
	State() []NamedBuffer
	// Close stops the worker goroutines of the optimizer's own pool (not those of a pool passed
	// to NewWithPool). It is safe to call twice; Step still works afterwards, single-threaded.
	Close() error
}

// StateCodec is implemented by an optimizer that keeps its state in a compact encoding (the
// 8-bit optimizers) rather than as float32 views. Checkpoints still hold float32 state, so they
// can be resumed by any world size, ZeRO stage and shard alignment: the encoding is the
// optimizer's business, its buffers' names and meaning are the float32 optimizer's.
type StateCodec interface {
	// ExportState decodes the state into new float32 buffers of length Len(), named and
	// ordered as the float32 optimizer's State. They are the caller's: temporary memory at
	// checkpoint time, not views; writing into them changes nothing until ImportState.
	ExportState() []NamedBuffer
	// ImportState encodes state, named and sized as ExportState's, into the optimizer. It
	// returns an error, changing nothing, for the wrong names or lengths or values the state
	// cannot hold (such as a NaN or a negative second moment).
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
// ZeRO shard may be empty), with its own Pool of cfg.Threads threads.
func New(cfg Config, n int) (Optimizer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("offload: optimizer config: %w", err)
	}
	if n < 0 {
		return nil, fmt.Errorf("offload: optimizer length must be >= 0, got %d", n)
	}
	return build(cfg, n, NewPool(cfg.Threads), true), nil
}

// NewWithPool is New on a Pool that the caller owns and shares with its other passes;
// cfg.Threads is ignored and Close leaves the pool running.
func NewWithPool(cfg Config, n int, pool *Pool) (Optimizer, error) {
	if pool == nil {
		return nil, errors.New("offload: NewWithPool with a nil pool")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("offload: optimizer config: %w", err)
	}
	if n < 0 {
		return nil, fmt.Errorf("offload: optimizer length must be >= 0, got %d", n)
	}
	return build(cfg, n, pool, false), nil
}

func build(cfg Config, n int, pool *Pool, ownPool bool) Optimizer {
	switch cfg.Type {
	case TypeSGD:
		o := newSGD(cfg, n)
		o.init(n, pool, ownPool)
		return o
	case TypeAdam8bit, TypeAdamW8bit:
		o := newAdam8(cfg, n)
		o.init(n, pool, ownPool)
		return o
	}
	o := newAdam(cfg, n)
	o.init(n, pool, ownPool)
	return o
}

// base is what every optimizer shares: length, step count and pool.
type base struct {
	n       int
	steps   atomic.Int64
	pool    *Pool
	ownPool bool
	grain   int // Run grain for Step; tests shrink it to split tiny buffers across threads
}

func (b *base) init(n int, pool *Pool, ownPool bool) {
	b.n, b.pool, b.ownPool, b.grain = n, pool, ownPool, DefaultGrain
}

func (b *base) Len() int     { return b.n }
func (b *base) Steps() int64 { return b.steps.Load() }
func (b *base) SetSteps(t int64) {
	if t < 0 {
		panic(fmt.Sprintf("offload: SetSteps(%d): step count must be >= 0", t))
	}
	b.steps.Store(t)
}

func (b *base) Close() error {
	if b.ownPool {
		return b.pool.Close()
	}
	return nil
}

func (b *base) checkLen(params, grads []float32) {
	if len(params) != b.n || len(grads) != b.n {
		panicLen(len(params), len(grads), b.n)
	}
}

// panicLen is out of line so that its boxing of arguments stays off Step's path.
//
//go:noinline
func panicLen(p, g, n int) {
	panic(fmt.Sprintf("offload: Step with len(params)=%d, len(grads)=%d on an optimizer of length %d", p, g, n))
}
