package zero

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/optim"
)

// ring builds an in-process group of n ranks.
func ring(t *testing.T, n int) []collective.Communicator {
	t.Helper()
	_, ts := collective.NewInproc(n, 1)
	cfg := collective.DefaultConfig()
	cfg.Transport = "inproc"
	cfg.Timeout = 5 * time.Second
	cfg.ChunkBytes = 4 << 10
	out := make([]collective.Communicator, n)
	for r := range n {
		c, err := collective.NewRing(ts[r], cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); ts[r].Close() })
		out[r] = c
	}
	return out
}

// grad is rank r's gradient element i of micro-batch j: exact in fp32 sums of a few terms.
func grad(r, j, i int) float32 { return float32((i*7+r*3+j*5)%17-8) / 16 }

// testExtents are three "tensors" over n elements: a first one produced whole, a gap of two
// padding elements, one produced element by element, and a last one produced whole.
func testExtents(n int) []Extent {
	if n < 20 {
		return []Extent{{Off: 0, Size: n, Row: 1}}
	}
	a, b := n/3, 2*n/3
	return []Extent{{Off: 0, Size: a, Row: a}, {Off: a + 2, Size: b - a - 2, Row: 1}, {Off: b, Size: n - b, Row: n - b}}
}

// inExtent reports whether offset i is a gradient element (not padding).
func inExtent(ext []Extent, i int) bool {
	for _, x := range ext {
		if i >= x.Off && i < x.Off+x.Size {
			return true
		}
	}
	return false
}

// backward hands g to e as a backward pass would: each extent from the top, in pieces
// between e's cuts, highest first.
func backward(e *Engine, g []float32, ext []Extent) error {
	if ext == nil {
		ext = []Extent{{Off: 0, Size: len(g), Row: 1}}
	}
	cuts := e.Cuts()
	for k := len(ext) - 1; k >= 0; k-- {
		x := ext[k]
		hi := x.Off + x.Size
		for hi > x.Off {
			lo := x.Off
			for _, c := range cuts {
				if c > lo && c < hi {
					lo = c // the highest cut below hi
				}
			}
			dst, acc, err := e.Acquire(lo, hi)
			if err != nil {
				return err
			}
			if acc {
				for i := range dst {
					dst[i] += g[lo+i]
				}
			} else {
				copy(dst, g[lo:hi])
			}
			if err := e.Release(lo, hi); err != nil {
				return err
			}
			hi = lo
		}
	}
	return nil
}

// TestEngineStep drives engines by hand through two steps of two micro-batches with plain SGD
// and checks every rank's parameters against the arithmetic: p -= lr · mean over ranks of the
// summed micro-batch gradients. Sizes and world sizes include empty shards (more ranks than
// 16-element blocks), buckets that straddle shards, and stage 2's tensors arriving in pieces.
func TestEngineStep(t *testing.T) {
	pool := offload.NewPool(2)
	defer pool.Close()
	const lr, micro, steps = 0.5, 2, 2
	for _, n := range []int{1, 20, 33, 1000} {
		for _, world := range []int{1, 2, 3, 5} {
			for stage := 0; stage <= 2; stage++ {
				for _, off := range []bool{false, true} {
					name := fmt.Sprintf("n%d/N%d/stage%d/offload=%v", n, world, stage, off)
					t.Run(name, func(t *testing.T) {
						cfg := DefaultConfig()
						cfg.Stage, cfg.ReduceBucketSize, cfg.AllgatherBucketSize = stage, 7, 11
						if off {
							cfg.OffloadOptimizer.Device = "cpu"
						}
						comms := ring(t, world)
						engines := make([]*Engine, world)
						params := make([][]float32, world)
						for r := range world {
							params[r] = make([]float32, n)
							for i := range params[r] {
								params[r][i] = float32(i%5) - 2
							}
							e, err := NewEngine(Options{Config: cfg, Optimizer: optim.Config{Type: "sgd", LR: lr}, Params: params[r],
								Format: half.FP32, Comm: comms[r], Pool: pool, Extents: testExtents(n)})
							if err != nil {
								t.Fatal(err)
							}
							defer e.Close()
							engines[r] = e
						}
						want := make([]float32, n)
						for i := range want {
							want[i] = float32(i%5) - 2
						}
						ext := testExtents(n)
						for s := 0; s < steps; s++ {
							for i := range want {
								if !inExtent(ext, i) {
									continue
								}
								var sum float32
								for r := range world {
									for j := range micro {
										sum += grad(r, j+s, i)
									}
								}
								want[i] -= lr * (sum / float32(world))
							}
							if err := onRanks(world, func(r int) error { return step(engines[r], r, s, micro, lr) }); err != nil {
								t.Fatal(err)
							}
						}
						for r := range world {
							if err := engines[r].SettleParams(); err != nil {
								t.Fatal(err)
							}
							for i := range want {
								if math.Abs(float64(params[r][i]-want[i])) > 1e-5 {
									t.Fatalf("rank %d element %d: %v, want %v", r, i, params[r][i], want[i])
								}
							}
						}
					})
				}
			}
		}
	}
}

// onRanks runs f for every rank of the group at once, as the ranks' processes would, and
// joins their errors.
func onRanks(world int, f func(r int) error) error {
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		wg.Add(1)
		go func() { defer wg.Done(); errs[r] = f(r) }()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// step runs one training step of micro micro-batches on engine e as rank r.
func step(e *Engine, r, s, micro int, lr float32) error {
	ctx := context.Background()
	if err := e.BeginStep(micro); err != nil {
		return err
	}
	n := e.layout.Size
	ext := testExtents(n)
	g := make([]float32, n)
	for j := range micro {
		for i := range g {
			g[i] = grad(r, j+s, i)
		}
		e.BeginMicro(ctx, j == 0, j == micro-1)
		if err := backward(e, g, ext); err != nil {
			return err
		}
		if err := e.EndMicro(); err != nil {
			return err
		}
	}
	if err := e.Reduce(ctx); err != nil {
		return err
	}
	ss, err := e.SumSquares(ctx)
	if err != nil {
		return err
	}
	if math.IsNaN(ss) || ss < 0 {
		return fmt.Errorf("sum of squares %v", ss)
	}
	return e.Step(ctx, lr, 1)
}

// TestEngineSumSquares: at every stage every rank gets the sum of squares of the whole averaged
// gradient, and a non-finite element on one rank makes it non-finite on all.
func TestEngineSumSquares(t *testing.T) {
	pool := offload.NewPool(1)
	defer pool.Close()
	const n, world = 100, 3
	for stage := 0; stage <= 2; stage++ {
		for _, poison := range []bool{false, true} {
			cfg := DefaultConfig()
			cfg.Stage, cfg.ReduceBucketSize = stage, 32
			comms := ring(t, world)
			got := make([]float64, world)
			errs := make([]error, world)
			var wg sync.WaitGroup
			for r := range world {
				wg.Add(1)
				go func() {
					defer wg.Done()
					e, err := NewEngine(Options{Config: cfg, Optimizer: optim.Config{Type: "sgd", LR: 1}, Params: make([]float32, n),
						Format: half.FP32, Comm: comms[r], Pool: pool})
					if err != nil {
						errs[r] = err
						return
					}
					defer e.Close()
					ctx := context.Background()
					e.BeginStep(1)
					g := make([]float32, n)
					for i := range g {
						g[i] = float32(r + 1) // mean over ranks: 2
					}
					if poison && r == 1 {
						g[57] = float32(math.Inf(1))
					}
					e.BeginMicro(ctx, true, true)
					if errs[r] = backward(e, g, nil); errs[r] != nil {
						return
					}
					if errs[r] = e.EndMicro(); errs[r] != nil {
						return
					}
					if errs[r] = e.Reduce(ctx); errs[r] != nil {
						return
					}
					got[r], errs[r] = e.SumSquares(ctx)
				}()
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			for r := range world {
				finite := !math.IsNaN(got[r]) && !math.IsInf(got[r], 0)
				switch {
				case poison && finite:
					t.Errorf("stage %d rank %d: an Inf on rank 1 gave a finite sum %v", stage, r, got[r])
				case !poison && got[r] != 4*n:
					t.Errorf("stage %d rank %d: sum of squares %v, want %d", stage, r, got[r], 4*n)
				}
			}
		}
	}
}

// TestEngineSinkOrder: a bucket completed while one above it is not (pieces out of order),
// and a piece that spans a bucket boundary, are errors instead of mixed buckets.
func TestEngineSinkOrder(t *testing.T) {
	pool := offload.NewPool(1)
	defer pool.Close()
	cfg := DefaultConfig()
	cfg.Stage, cfg.ReduceBucketSize = 2, 10
	e, err := NewEngine(Options{Config: cfg, Optimizer: optim.Config{Type: "sgd", LR: 1}, Params: make([]float32, 40), Format: half.FP32, Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	e.BeginStep(1)
	e.BeginMicro(context.Background(), true, true)
	if _, _, err := e.Acquire(5, 15); err == nil {
		t.Fatal("a piece spanning the cut at 10 was accepted")
	}
	if _, _, err := e.Acquire(0, 10); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(0, 10); err == nil {
		t.Fatal("bucket [0, 10) completed before the buckets above it")
	}
}

// TestEngineStepAllocs: a whole step (stage 2 with offload: micro-batch streaming, transfers
// to and from the host, the host optimizer step) allocates nothing.
func TestEngineStepAllocs(t *testing.T) {
	pool := offload.NewPool(2)
	defer pool.Close()
	cfg := DefaultConfig()
	cfg.Stage, cfg.ReduceBucketSize, cfg.OffloadOptimizer.Device = 2, 1000, "cpu"
	const n = 10_000
	e, err := NewEngine(Options{Config: cfg, Optimizer: optim.DefaultConfig(), Params: make([]float32, n), Format: half.BF16, Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	g := make([]float32, n)
	ctx := context.Background()
	run := func() {
		e.BeginStep(1)
		e.BeginMicro(ctx, true, true)
		if err := backward(e, g, nil); err != nil {
			t.Fatal(err)
		}
		if err := e.EndMicro(); err != nil {
			t.Fatal(err)
		}
		if err := e.Reduce(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := e.SumSquares(ctx); err != nil {
			t.Fatal(err)
		}
		if err := e.Step(ctx, 1e-3, 1); err != nil {
			t.Fatal(err)
		}
	}
	run()
	if a := testing.AllocsPerRun(10, run); a != 0 {
		t.Fatalf("a step allocates %v times", a)
	}
}

// TestEngineOverlapOff: reducing the buckets after the backward pass (overlap_comm false)
// gives the same bits as reducing them while it runs, at every stage.
func TestEngineOverlapOff(t *testing.T) {
	pool := offload.NewPool(2)
	t.Cleanup(func() { pool.Close() }) // after the engines, which sgdGroup closes at cleanup
	const n, world, micro = 1000, 3, 2
	for stage := 0; stage <= 2; stage++ {
		var got [2][]float32
		for k, overlap := range []bool{true, false} {
			cfg := DefaultConfig()
			cfg.Stage, cfg.ReduceBucketSize, cfg.OverlapComm = stage, 64, overlap
			params, engines := sgdGroup(t, cfg, ring(t, world), pool, n, micro)
			for s := 0; s < 2; s++ {
				if err := onRanks(world, func(r int) error { return step(engines[r], r, s, micro, 0.5) }); err != nil {
					t.Fatal(err)
				}
			}
			if err := engines[0].SettleParams(); err != nil {
				t.Fatal(err)
			}
			got[k] = params[0]
		}
		for i := range got[0] {
			if math.Float32bits(got[0][i]) != math.Float32bits(got[1][i]) {
				t.Fatalf("stage %d: element %d is %v with overlap, %v without", stage, i, got[0][i], got[1][i])
			}
		}
	}
}

// sgdGroup builds an fp32 engine per communicator, SGD at lr 0.5 over n parameters (zero)
// each, closed when the test ends, and returns every rank's parameters and engine.
func sgdGroup(t *testing.T, cfg Config, comms []collective.Communicator, pool *offload.Pool, n, accum int) ([][]float32, []*Engine) {
	t.Helper()
	params := make([][]float32, len(comms))
	engines := make([]*Engine, len(comms))
	for r, c := range comms {
		params[r] = make([]float32, n)
		e, err := NewEngine(Options{Config: cfg, Optimizer: optim.Config{Type: "sgd", LR: 0.5}, Params: params[r],
			Format: half.FP32, Comm: c, Pool: pool, Extents: testExtents(n), Accum: accum})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		engines[r] = e
	}
	return params, engines
}

// TestEnginePrefetch: with overlap_comm at stages 1-2, Step returns with the parameters'
// all-gather still running, and a forward pass that waits for each prefix of the flat space
// (WaitParams) reads exactly the values a synchronous all-gather gives — on every rank, with
// the gather buckets cut small so that the pass's waits and the gather interleave.
func TestEnginePrefetch(t *testing.T) {
	pool := offload.NewPool(2)
	t.Cleanup(func() { pool.Close() }) // after the engines, which sgdGroup closes at cleanup
	const n, world, steps = 1000, 3, 3
	for stage := 1; stage <= 2; stage++ {
		var got [2][][]float32 // [overlap][step]: rank 1's parameters as the pass read them
		for k, overlap := range []bool{true, false} {
			cfg := DefaultConfig()
			cfg.Stage, cfg.ReduceBucketSize, cfg.AllgatherBucketSize, cfg.OverlapComm = stage, 64, 48, overlap
			params, engines := sgdGroup(t, cfg, ring(t, world), pool, n, 1)
			for _, e := range engines {
				if e.Prefetching() != overlap {
					t.Fatalf("stage %d, overlap_comm %v: Prefetching() = %v", stage, overlap, e.Prefetching())
				}
			}
			for s := 0; s < steps; s++ {
				seen := make([]float32, n)
				err := onRanks(world, func(r int) error {
					e := engines[r]
					// The "forward pass": each layer of 100 elements read once its prefix has
					// arrived, as engine.Net's forwardRange does.
					for hi := 100; hi <= n; hi += 100 {
						if err := e.WaitParams(hi); err != nil {
							return err
						}
						if r == 1 {
							copy(seen[hi-100:hi], params[r][hi-100:hi])
						}
					}
					return step(e, r, s, 1, 0.5)
				})
				if err != nil {
					t.Fatal(err)
				}
				got[k] = append(got[k], seen)
			}
			if overlap && !engines[0].gathOut {
				t.Fatalf("stage %d: Step did not leave its all-gather to the communication goroutine", stage)
			}
			for r := range world {
				if err := engines[r].SettleParams(); err != nil {
					t.Fatal(err)
				}
				if engines[r].gathOut || len(engines[r].gathTok) != 0 {
					t.Fatalf("stage %d rank %d: tokens left after SettleParams", stage, r)
				}
			}
		}
		for s := range steps {
			for i := range got[0][s] {
				if math.Float32bits(got[0][s][i]) != math.Float32bits(got[1][s][i]) {
					t.Fatalf("stage %d step %d: the pass read element %d as %v with prefetch, %v without", stage, s, i, got[0][s][i], got[1][s][i])
				}
			}
		}
	}
}

// failGather is a communicator whose all-gathers fail.
type failGather struct{ collective.Communicator }

func (failGather) AllGather(context.Context, []float32, collective.Shards, collective.Call) error {
	return errors.New("link down")
}

// TestEnginePrefetchFailure: a prefetched all-gather that fails is reported by the next
// WaitParams (the forward pass) and SettleParams, naming the bucket, and Step does not run the
// optimizer on top of it.
func TestEnginePrefetchFailure(t *testing.T) {
	pool := offload.NewPool(2)
	t.Cleanup(func() { pool.Close() }) // after the engines, which sgdGroup closes at cleanup
	const n, world = 600, 2
	cfg := DefaultConfig()
	cfg.Stage, cfg.ReduceBucketSize, cfg.AllgatherBucketSize = 2, 64, 100
	comms := ring(t, world)
	for r := range comms {
		comms[r] = failGather{comms[r]}
	}
	_, engines := sgdGroup(t, cfg, comms, pool, n, 1)
	if err := onRanks(world, func(r int) error { return step(engines[r], r, 0, 1, 0.5) }); err != nil {
		t.Fatalf("Step failed before its all-gather ran: %v", err)
	}
	for r, e := range engines {
		err := e.WaitParams(50)
		if err == nil || !strings.Contains(err.Error(), "all-gather of parameters [0,") || !strings.Contains(err.Error(), "link down") {
			t.Fatalf("rank %d: WaitParams = %v, want the all-gather's failure", r, err)
		}
		before := append([]float32(nil), e.Master()...)
		if err := e.Step(context.Background(), 0.5, 1); err == nil {
			t.Fatalf("rank %d: Step after a failed all-gather succeeded", r)
		}
		if !slices.Equal(before, e.Master()) {
			t.Fatalf("rank %d: Step ran the optimizer after a failed all-gather", r)
		}
	}
}
