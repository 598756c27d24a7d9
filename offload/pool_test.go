package offload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// setGrain makes Step split buffers into pieces as small as grain, so that tiny lengths are
// spread across threads too.
func setGrain(o Optimizer, grain int) {
	switch o := o.(type) {
	case *adam:
		o.grain = grain
	case *sgd:
		o.grain = grain
	case *adam8:
		o.grain = grain
	default:
		panic("setGrain: unknown optimizer type")
	}
}

func randSlice(rng *rand.Rand, n int, scale float32) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = scale * float32(rng.NormFloat64())
	}
	return x
}

func sameBits(a, b []float32) int {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i
		}
	}
	return -1
}

func allConfigs() map[string]Config {
	cfgs := map[string]Config{}
	for _, name := range []string{"sgd", "sgd/momentum/wd", "sgd/nesterov", "adam", "adam/wd", "adamw", "adam8bit/wd", "adamw8bit"} {
		c := DefaultConfig()
		switch name {
		case "sgd":
			c.Type, c.Momentum, c.WeightDecay = TypeSGD, 0, 0
		case "sgd/momentum/wd":
			c.Type, c.WeightDecay = TypeSGD, 1e-4
		case "sgd/nesterov":
			c.Type, c.Nesterov = TypeSGD, true
		case "adam":
			c.Type, c.WeightDecay = TypeAdam, 0
		case "adam/wd":
			c.Type = TypeAdam
		case "adam8bit/wd":
			c.Type = TypeAdam8bit
		case "adamw8bit":
			c.Type = TypeAdamW8bit
		}
		cfgs[name] = c
	}
	return cfgs
}

// Every element's update depends only on that element, so how [0,n) is split across threads
// must not change a single bit, including for lengths that no thread count divides.
func TestParallelStepMatchesSingleThread(t *testing.T) {
	lengths := []int{0, 1, 7, 1000003}
	if testing.Short() {
		lengths = lengths[:3]
	}
	for name, cfg := range allConfigs() {
		for _, n := range lengths {
			rng := rand.New(rand.NewPCG(1, uint64(n)))
			p0 := randSlice(rng, n, 1)
			grads := [][]float32{randSlice(rng, n, 0.1), randSlice(rng, n, 0.1), randSlice(rng, n, 0.1)}
			run := func(threads, grain int) []float32 {
				c := cfg
				c.Threads = threads
				o := mustNew(t, c, n)
				setGrain(o, grain)
				p := append([]float32(nil), p0...)
				for s, g := range grads {
					o.Step(p, g, 1e-3*float32(s+1), 0.75)
				}
				o.Close()
				return p
			}
			want := run(1, DefaultGrain)
			for _, tc := range []struct{ threads, grain int }{{2, 1}, {3, 2}, {8, 3}, {5, DefaultGrain}} {
				if i := sameBits(run(tc.threads, tc.grain), want); i >= 0 {
					t.Errorf("%s n=%d threads=%d grain=%d: element %d differs from single-threaded", name, n, tc.threads, tc.grain, i)
				}
			}
		}
	}
}

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
	x := randSlice(rng, 3*DefaultGrain+5, 1)
	want := make([]float32, len(x))
	for i, v := range x {
		want[i] = v * 0.3
	}
	for _, threads := range []int{1, 3} {
		p := NewPool(threads)
		got := append([]float32(nil), x...)
		p.Scale(got, 0.3)
		p.Close()
		if i := sameBits(got, want); i >= 0 {
			t.Fatalf("threads=%d: x[%d] = %g, want %g", threads, i, got[i], want[i])
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
		x := randSlice(rng, n, 3)
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

func TestZeroAllocs(t *testing.T) {
	const n = 100003
	rng := rand.New(rand.NewPCG(4, 4))
	params, grads := randSlice(rng, n, 1), randSlice(rng, n, 0.01)
	for name, cfg := range allConfigs() {
		cfg.Threads = 4
		o := mustNew(t, cfg, n)
		setGrain(o, 1000) // make sure every thread gets work
		if a := testing.AllocsPerRun(20, func() { o.Step(params, grads, 1e-4, 1) }); a != 0 {
			t.Errorf("%s: Step allocates %v times per call", name, a)
		}
	}
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

// waitGoroutines waits for the goroutine count to fall back to want: goroutines that have
// returned may be counted for a moment while they finish exiting.
func waitGoroutines(t *testing.T, want int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > want {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines still running, want %d", runtime.NumGoroutine(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestCloseStopsWorkersAndIsSafeTwice(t *testing.T) {
	before := runtime.NumGoroutine()
	c := DefaultConfig()
	c.Threads = 6
	o, err := New(c, 100)
	if err != nil {
		t.Fatal(err)
	}
	if got := runtime.NumGoroutine(); got < before+5 {
		t.Fatalf("%d goroutines after New with 6 threads, had %d", got, before)
	}
	p := make([]float32, 100)
	g := make([]float32, 100)
	for i := range g {
		g[i] = 1
	}
	o.Step(p, g, 0.1, 1)
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	waitGoroutines(t, before)
	// Close unmapped the state: a Step now is a programmer error, reported as a panic rather
	// than a fault on the unmapped pages.
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "after Close") {
				t.Fatalf("Step after Close: recovered %v, want a panic about Close", r)
			}
		}()
		o.Step(p, g, 0.1, 1)
	}()
	if o.Steps() != 1 {
		t.Fatalf("Steps() = %d after a refused Step", o.Steps())
	}
}

func TestSharedPool(t *testing.T) {
	before := runtime.NumGoroutine()
	pool := NewPool(3)
	a, err := NewWithPool(DefaultConfig(), 10, pool)
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(DefaultConfig(), 10)
	if err != nil {
		t.Fatal(err)
	}
	pa, pb := make([]float32, 10), make([]float32, 10)
	g := randSlice(rand.New(rand.NewPCG(5, 5)), 10, 1)
	a.Step(pa, g, 0.01, 1)
	b.Step(pb, g, 0.01, 1)
	if i := sameBits(pa, pb); i >= 0 {
		t.Fatalf("shared pool: p[%d] = %v, own pool %v", i, pa[i], pb[i])
	}
	a.Close()
	b.Close()
	// Closing the optimizer leaves a borrowed pool running.
	if got := pool.SumSquares([]float32{3, 4}); got != 25 {
		t.Fatalf("SumSquares after optimizer Close = %v", got)
	}
	pool.Close()
	pool.Close()
	waitGoroutines(t, before)
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
