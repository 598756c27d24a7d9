package optim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/offload"
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
			want := run(1, offload.DefaultGrain)
			for _, tc := range []struct{ threads, grain int }{{2, 1}, {3, 2}, {8, 3}, {5, offload.DefaultGrain}} {
				if i := sameBits(run(tc.threads, tc.grain), want); i >= 0 {
					t.Errorf("%s n=%d threads=%d grain=%d: element %d differs from single-threaded", name, n, tc.threads, tc.grain, i)
				}
			}
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
	pool := offload.NewPool(3)
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

func randSlice(rng *rand.Rand, n int, scale float32) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = scale * float32(rng.NormFloat64())
	}
	return x
}
