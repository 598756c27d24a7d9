package offload

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/qvd/qvd/internal/vec"
)

// Ranger is one parallel pass over a flat index space: Pool.Run calls Range on disjoint,
// contiguous pieces [lo,hi) that together cover [0,n), from several goroutines at once. An
// implementation is typically a pointer to a long-lived struct holding the pass's slices and
// scalars, so that handing it to Run allocates nothing (a closure would escape per call).
type Ranger interface {
	Range(lo, hi int)
}

// DefaultGrain is the fewest indices a piece gets from Run when grain <= 0, and what the
// optimizers use: 16 Ki float32 elements, 64 KiB per stream, take several microseconds to
// update, well above the microsecond or two that waking a parked worker costs, so short buffers
// stay on the calling goroutine instead of being split into pieces that cost more to hand out
// than to compute.
const DefaultGrain = 1 << 14

// SumSquares splits its input into fixed-size chunks whose float64 partial sums are added in
// chunk order. The chunk size depends only on the length of the input, never on the number of
// threads, which is what makes the result bit-identical on any Pool.
const (
	sumChunk    = 1 << 14 // elements per chunk for inputs up to sumChunk*maxPartials (256 Mi)
	maxPartials = 1 << 12 // partial sums kept in the Pool; longer inputs get longer chunks
)

// task is what a worker receives: a piece of one Run.
type task struct {
	r      Ranger
	lo, hi int
}

// Pool is a fixed set of worker goroutines for data-parallel passes over flat buffers. It owns
// Threads()-1 goroutines, started by NewPool and stopped by Close; the goroutine that calls a
// method works on the first piece itself. Methods are safe for concurrent use and take turns.
// After Close, the methods still work, on the calling goroutine alone.
type Pool struct {
	threads int
	work    []chan task    // one per worker, capacity 1: a send never blocks
	workers sync.WaitGroup // lifetime of the worker goroutines
	pending sync.WaitGroup // pieces of the Run in progress that workers have not finished
	left    atomic.Int32   // the same count, which the caller polls before it parks

	mu struct {
		sync.Mutex // held for the whole of each Run, SumSquares, Scale and Close
		closed     bool
		partials   [maxPartials]float64 // SumSquares' per-chunk sums
		sum        sumSquaresPass
		scale      scalePass
	}
}

// NewPool starts a pool that runs passes on threads goroutines, the caller's included;
// threads <= 0 means runtime.GOMAXPROCS(0).
func NewPool(threads int) *Pool {
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	p := &Pool{threads: threads, work: make([]chan task, threads-1)}
	for i := range p.work {
		ch := make(chan task, 1)
		p.work[i] = ch
		p.workers.Add(1)
		go p.worker(ch)
	}
	return p
}

func (p *Pool) worker(ch <-chan task) {
	defer p.workers.Done()
	for {
		t, ok := next(ch)
		if !ok {
			return
		}
		t.r.Range(t.lo, t.hi)
		p.pending.Done()
		p.left.Add(-1) // after Done: a caller that sees 0 finds the WaitGroup at 0 too
	}
}

// spinFor is how long a worker polls for its next piece, and the caller for the workers to
// finish, before parking. A training step hands the pool a pass every few to few hundred
// microseconds; parking and waking a thread costs several microseconds each way (more in a
// VM, where the wake is an inter-processor interrupt through the hypervisor), which on the
// shipped MLP was 17% of the process's CPU time. OpenMP runtimes poll for the same reason
// (GOMP_SPINCOUNT, KMP_BLOCKTIME: 200 ms by default); qvd polls briefly, and yields its
// thread to other goroutines while it does.
const spinFor = 200 * time.Microsecond

// poll calls done until it reports true, for up to spinFor, yielding the thread now and
// then; it reports whether done did.
func poll(done func() bool) bool {
	deadline := time.Now().Add(spinFor)
	for i := 1; ; i++ {
		if done() {
			return true
		}
		if i%64 == 0 {
			if time.Now().After(deadline) {
				return false
			}
			runtime.Gosched()
		}
	}
}

// next receives a worker's next piece: polled for spinFor, then waited for.
func next(ch <-chan task) (t task, ok bool) {
	got := poll(func() bool {
		select {
		case t, ok = <-ch:
			return true
		default:
			return false
		}
	})
	if !got {
		t, ok = <-ch
	}
	return t, ok
}

// Threads is the number of goroutines a pass runs on, the caller's included.
func (p *Pool) Threads() int { return p.threads }

// Close stops the worker goroutines and waits for them to exit. It is safe to call twice, and
// waits for a Run in progress to finish first.
func (p *Pool) Close() error {
	p.mu.Lock()
	if !p.mu.closed {
		p.mu.closed = true
		for _, ch := range p.work {
			close(ch)
		}
	}
	p.mu.Unlock()
	p.workers.Wait()
	return nil
}

// Run calls r.Range over [0,n) split into at most Threads() contiguous pieces and returns when
// all are done. Piece boundaries are multiples of grain and every piece but the last has at
// least grain indices, so n <= grain runs on the calling goroutine only; grain <= 0 means
// DefaultGrain. Run does not allocate. r must not call back into p.
func (p *Pool) Run(n, grain int, r Ranger) {
	if grain <= 0 {
		grain = DefaultGrain
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.runLocked(n, grain, r)
}

func (p *Pool) runLocked(n, grain int, r Ranger) {
	if n <= 0 {
		return
	}
	units := n / grain
	if n%grain != 0 {
		units++
	}
	pieces := min(p.threads, units)
	if pieces <= 1 || p.mu.closed {
		r.Range(0, n)
		return
	}
	// Piece i covers units [i*units/pieces, (i+1)*units/pieces): sizes differ by at most one
	// unit, so no worker waits long for another.
	bound := func(i int) int { return min(n, i*units/pieces*grain) }
	// Deferred so that a panic in the caller's piece still waits for the workers before the
	// lock is released and r's buffers are reused.
	defer p.wait()
	p.pending.Add(pieces - 1)
	p.left.Add(int32(pieces - 1))
	for i := 1; i < pieces; i++ {
		p.work[i-1] <- task{r: r, lo: bound(i), hi: bound(i + 1)}
	}
	r.Range(0, bound(1))
}

// wait returns when the workers have finished their pieces of a Run.
func (p *Pool) wait() {
	poll(func() bool { return p.left.Load() == 0 })
	p.pending.Wait()
}

// SumSquares returns the sum of x[i]*x[i], accumulated in float64. Each square of a float32 is
// exact in float64; the sums are not, so to make the result depend only on x — the trainer's
// global gradient norm must be bit-identical run to run and across thread counts — x is cut into
// chunks whose size depends only on len(x), each chunk is summed in a fixed order, and the chunk
// sums are added in chunk order. Any Inf or NaN in x makes the result +Inf or NaN (squares are
// never negative, so Inf-Inf cannot arise); finite inputs never overflow, since float32's
// largest square is about 1.2e77. It does not allocate.
func (p *Pool) SumSquares(x []float32) float64 {
	if len(x) == 0 {
		return 0
	}
	chunk, chunks := sumSquaresChunks(len(x))
	p.mu.Lock()
	defer p.mu.Unlock()
	k := &p.mu.sum
	k.x, k.chunk, k.out = x, chunk, p.mu.partials[:chunks]
	p.runLocked(chunks, 1, k)
	var s float64
	for _, v := range k.out {
		s += v
	}
	k.x, k.out = nil, nil // keep no reference to the caller's buffer
	return s
}

// sumSquaresChunks returns SumSquares' chunk size for n > 0 elements, a function of n alone,
// and the number of chunks, at most maxPartials.
func sumSquaresChunks(n int) (chunk, chunks int) {
	chunk = max(sumChunk, n/maxPartials+min(1, n%maxPartials))
	return chunk, n/chunk + min(1, n%chunk)
}

type sumSquaresPass struct {
	x     []float32
	chunk int
	out   []float64
}

// Range sums the squares of chunks [lo,hi).
func (k *sumSquaresPass) Range(lo, hi int) {
	for c := lo; c < hi; c++ {
		start := c * k.chunk
		k.out[c] = sumSquares(k.x[start:min(start+k.chunk, len(k.x))])
	}
}

// sumSquares is one chunk's sum: internal/vec's, eight float64 lanes in a fixed order (AVX2
// where the CPU has it), so a chunk's bits are the same on every CPU and build.
func sumSquares(x []float32) float64 { return vec.SumSquares(x) }

// Scale multiplies x by s in place, in parallel, without allocating. Each element is rounded
// once, so the result does not depend on the thread count.
func (p *Pool) Scale(x []float32, s float32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := &p.mu.scale
	k.x, k.s = x, s
	p.runLocked(len(x), DefaultGrain, k)
	k.x = nil
}

type scalePass struct {
	x []float32
	s float32
}

func (k *scalePass) Range(lo, hi int) {
	x, s := k.x[lo:hi], k.s
	for i := range x {
		x[i] *= s
	}
}
