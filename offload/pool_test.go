package offload

import (
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Run covers [0,n) exactly once with at most Threads() pieces that respect the grain.
func TestRunCoversRangeOnce(t *testing.T) {
	p := NewPool(4)
	defer p.Close()
	for _, n := range []int{0, 1, 3, 4, 5, 17, 100, 1001} {
		for _, grain := range []int{1, 2, 7, 1000} {
			c := &countPass{hits: make([]int, n)}
			p.Run(n, grain, c)
			for i, h := range c.hits {
				if h != 1 {
					t.Fatalf("n=%d grain=%d: index %d visited %d times", n, grain, i, h)
				}
			}
			if c.pieces > p.Threads() {
				t.Fatalf("n=%d grain=%d: %d pieces on %d threads", n, grain, c.pieces, p.Threads())
			}
			if n > 0 && c.pieces != min(p.Threads(), (n+grain-1)/grain) {
				t.Fatalf("n=%d grain=%d: %d pieces, want %d", n, grain, c.pieces, min(p.Threads(), (n+grain-1)/grain))
			}
			for _, lo := range c.los {
				if lo%grain != 0 {
					t.Fatalf("n=%d grain=%d: piece starts at %d", n, grain, lo)
				}
			}
		}
	}
}

type countPass struct {
	mu     sync.Mutex
	hits   []int
	pieces int
	los    []int
}

func (c *countPass) Range(lo, hi int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pieces++
	c.los = append(c.los, lo)
	for i := lo; i < hi; i++ {
		c.hits[i]++
	}
}

func TestScale(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	x := normals(rng, 3*DefaultGrain+5, 1)
	want := make([]float32, len(x))
	for i, v := range x {
		want[i] = v * 0.3
	}
	for _, threads := range []int{1, 3} {
		p := NewPool(threads)
		got := append([]float32(nil), x...)
		p.Scale(got, 0.3)
		p.Close()
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("threads=%d: x[%d] = %g, want %g", threads, i, got[i], want[i])
			}
		}
	}
}

func TestSumSquaresExactOnIntegers(t *testing.T) {
	p := NewPool(3)
	defer p.Close()
	// 1² + 2² + … + n² = n(n+1)(2n+1)/6; every partial sum is an integer below 2^53, so
	// float64 accumulation is exact whatever the chunking. 100003 elements span 7 chunks.
	for _, n := range []int{1, 2, 3, 4, 5, 1000, 100003} {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(i + 1)
			if i%3 == 0 {
				x[i] = -x[i] // signs do not matter
			}
		}
		want := float64(n) * float64(n+1) * float64(2*n+1) / 6
		if got := p.SumSquares(x); got != want {
			t.Errorf("n=%d: SumSquares = %v, want %v", n, got, want)
		}
	}
	if got := p.SumSquares(nil); got != 0 {
		t.Errorf("SumSquares(nil) = %v", got)
	}
}

func TestSumSquaresDeterministicAcrossThreads(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	for _, n := range []int{7, sumChunk - 1, sumChunk + 1, 1000003} {
		x := normals(rng, n, 3)
		var naive float64
		for _, v := range x {
			naive += float64(v) * float64(v)
		}
		var first float64
		for i, threads := range []int{1, 2, 3, 7, 16} {
			p := NewPool(threads)
			got := p.SumSquares(x)
			again := p.SumSquares(x)
			p.Close()
			if math.Float64bits(got) != math.Float64bits(again) {
				t.Fatalf("n=%d threads=%d: %v then %v", n, threads, got, again)
			}
			if i == 0 {
				first = got
				if math.Abs(got-naive) > 1e-12*naive {
					t.Fatalf("n=%d: SumSquares = %v, naive sum %v", n, got, naive)
				}
			} else if math.Float64bits(got) != math.Float64bits(first) {
				t.Fatalf("n=%d threads=%d: SumSquares = %v, on 1 thread %v", n, threads, got, first)
			}
		}
	}
}

func TestSumSquaresNonFinite(t *testing.T) {
	p := NewPool(4)
	defer p.Close()
	big := float32(math.MaxFloat32)
	for _, tc := range []struct {
		name string
		bad  float32
		want func(float64) bool
	}{
		{"+Inf", float32(math.Inf(1)), func(s float64) bool { return math.IsInf(s, 1) }},
		{"-Inf", float32(math.Inf(-1)), func(s float64) bool { return math.IsInf(s, 1) }},
		{"NaN", float32(math.NaN()), math.IsNaN},
		{"max float32 stays finite", big, func(s float64) bool { return s == float64(big)*float64(big)+99999 }},
	} {
		for _, at := range []int{0, 54321, 99999} { // first, middle and last chunk
			x := make([]float32, 100000)
			for i := range x {
				x[i] = 1
			}
			x[at] = tc.bad
			if got := p.SumSquares(x); !tc.want(got) {
				t.Errorf("%s at %d: SumSquares = %v", tc.name, at, got)
			}
		}
	}
}

func TestSumSquaresChunksFit(t *testing.T) {
	for _, n := range []int{1, sumChunk, sumChunk * maxPartials, sumChunk*maxPartials + 1, 1 << 40, math.MaxInt32} {
		chunk, chunks := sumSquaresChunks(n)
		if chunks > maxPartials || chunks*chunk < n || (chunks-1)*chunk >= n {
			t.Errorf("n=%d: %d chunks of %d", n, chunks, chunk)
		}
	}
}

func TestPoolConcurrentUse(t *testing.T) {
	p := NewPool(3)
	defer p.Close()
	x := make([]float32, 5*DefaultGrain)
	for i := range x {
		x[i] = 2
	}
	var wg sync.WaitGroup
	errs := make(chan float64, 8)
	for range 8 {
		wg.Go(func() {
			for range 20 {
				if s := p.SumSquares(x); s != 4*float64(len(x)) {
					errs <- s
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for s := range errs {
		t.Fatalf("concurrent SumSquares = %v, want %v", s, 4*float64(len(x)))
	}
}

// normals draws n values from N(0, scale²).
func normals(rng *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(scale * rng.NormFloat64())
	}
	return x
}

func TestPoolZeroAllocs(t *testing.T) {
	const n = 1 << 16
	grads := normals(rand.New(rand.NewPCG(4, 4)), n, 0.01)
	p := NewPool(4)
	defer p.Close()
	if a := testing.AllocsPerRun(20, func() { p.SumSquares(grads) }); a != 0 {
		t.Errorf("SumSquares allocates %v times per call", a)
	}
	if a := testing.AllocsPerRun(20, func() { p.Scale(grads, 1) }); a != 0 {
		t.Errorf("Scale allocates %v times per call", a)
	}
	r := &scalePass{x: grads, s: 1}
	if a := testing.AllocsPerRun(20, func() { p.Run(n, 100, r) }); a != 0 {
		t.Errorf("Run allocates %v times per call", a)
	}
}

// A Run waits for every piece whether its workers were polling or parked, and whether the
// caller's wait outlasts its polling: pieces that take longer than spinFor, and Runs spaced
// further apart than it.
func TestRunPollsThenParks(t *testing.T) {
	p := NewPool(3)
	defer p.Close()
	for i, gap := range []time.Duration{0, 3 * spinFor, 0, 5 * spinFor} {
		time.Sleep(gap)
		s := &slowPass{done: make([]atomic.Bool, 3), slow: 2 * spinFor * time.Duration(i%2)}
		p.Run(3, 1, s)
		for j := range s.done {
			if !s.done[j].Load() {
				t.Fatalf("run %d (gap %v, pieces sleeping %v): piece %d not finished when Run returned", i, gap, s.slow, j)
			}
		}
	}
}

type slowPass struct {
	done []atomic.Bool
	slow time.Duration
}

func (s *slowPass) Range(lo, hi int) {
	if lo > 0 {
		time.Sleep(s.slow) // the workers' pieces: the caller's wait outlasts its polling
	}
	for i := lo; i < hi; i++ {
		s.done[i].Store(true)
	}
}
