package trainer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/model"
)

// group builds n trainers of r over an in-process transport, as n ranks.
func (r testRun) group(t *testing.T, n int, sinks []MetricsSink, resume *checkpoint.Checkpoint) ([]*Trainer, *collective.InprocNet) {
	t.Helper()
	net, transports := collective.NewInproc(n, 1)
	cfg := collective.DefaultConfig()
	cfg.Transport = "inproc"
	cfg.Timeout = 2 * time.Second
	cfg.ChunkBytes = 4 << 10
	trainers := make([]*Trainer, n)
	for rank := 0; rank < n; rank++ {
		ring, err := collective.NewRing(transports[rank], cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ring.Close(); transports[rank].Close() })
		var sink MetricsSink
		if sinks != nil {
			sink = sinks[rank]
		}
		rr := r
		if rank != 0 {
			// A different initialisation on purpose: rank 0's state must be broadcast.
			rr.prepare = func(l *model.Layout, p []float32) {
				for i := range p {
					p[i] *= 1.5
				}
			}
		}
		var res *checkpoint.Checkpoint
		if rank == 0 {
			res = resume
		}
		trainers[rank] = rr.buildWith(t, sink, res, ring)
	}
	return trainers, net
}

// runAll runs every rank's trainer concurrently and returns their results and errors.
func runAll(ctx context.Context, ts []*Trainer) ([]Result, []error) {
	res := make([]Result, len(ts))
	errs := make([]error, len(ts))
	var wg sync.WaitGroup
	for i, tr := range ts {
		wg.Add(1)
		go func(i int, tr *Trainer) {
			defer wg.Done()
			res[i], errs[i] = tr.Run(ctx)
		}(i, tr)
	}
	wg.Wait()
	return res, errs
}

// TestDataParallelEquivalence: N ranks with micro m and accum a take the same steps as one
// worker with micro N·m and accum a (within float tolerance: only the summation order of
// the gradient differs), and every rank ends with bit-identical weights.
func TestDataParallelEquivalence(t *testing.T) {
	for _, n := range []int{2, 4} {
		for _, prec := range []string{"fp32", "bf16", "fp16"} {
			t.Run(fmt.Sprintf("N%d/%s", n, prec), func(t *testing.T) {
				base := defaultRun()
				base.cfg.Precision = prec
				base.cfg.MaxSteps = 7
				base.cfg.MaxGradNorm = 1
				base.opt.Type, base.opt.LR, base.opt.Momentum = "sgd", 0.05, 0.9
				const m, a = 4, 2
				single := base
				single.cfg.MicroBatch, single.cfg.Accum = n*m, a
				ts := single.build(t, nil, nil)
				want, err := ts.Run(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				grp := base
				grp.cfg.MicroBatch, grp.cfg.Accum = m, a
				trainers, _ := grp.group(t, n, nil, nil)
				results, errs := runAll(context.Background(), trainers)
				for r, err := range errs {
					if err != nil {
						t.Fatalf("rank %d: %v", r, err)
					}
					if results[r].Steps != want.Steps {
						t.Fatalf("rank %d took %d steps, single worker %d", r, results[r].Steps, want.Steps)
					}
				}
				for r := 1; r < n; r++ {
					if d, at := maxAbsDiff(trainers[0].Master(), trainers[r].Master()); d != 0 {
						t.Fatalf("rank %d weights differ from rank 0 by %g at %d", r, d, at)
					}
				}
				// fp32: only the summation order differs. fp16/bf16: each rank rounds its own
				// partial gradient (and the wire its partial sums) to 11 / 8 bits of mantissa.
				tol := map[string]float64{"fp32": 1e-6, "fp16": 2e-4, "bf16": 5e-3}[prec]
				d, at := maxAbsDiff(ts.Master(), trainers[0].Master())
				t.Logf("max weight difference from the single worker: %.3g", d)
				if d > tol {
					t.Fatalf("group weights differ from the single worker's by %g at %d", d, at)
				}
				if results[0].TestAccuracy != want.TestAccuracy && prec == "fp32" {
					t.Logf("test accuracy %v (group) vs %v (single)", results[0].TestAccuracy, want.TestAccuracy)
				}
			})
		}
	}
}

// TestDataParallelResume: a group interrupted mid-run saves (rank 0 writes), and a new group
// resumed from that checkpoint ends exactly where the uninterrupted group does.
func TestDataParallelResume(t *testing.T) {
	const n = 2
	r := defaultRun()
	r.cfg.MicroBatch, r.cfg.Accum = 8, 2
	r.cfg.MaxSteps = 9
	full, _ := r.group(t, n, nil, nil)
	if _, errs := runAll(context.Background(), full); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	r.ckptDir = t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	sinks := []MetricsSink{&recorder{after: func(rec metrics.Record) {
		if rec.Step == 4 {
			cancel()
		}
	}}, nil}
	first, _ := r.group(t, n, sinks, nil)
	res, errs := runAll(ctx, first)
	for i := range errs {
		if !errors.Is(errs[i], context.Canceled) || !res[i].Interrupted {
			t.Fatalf("rank %d: %v interrupted=%v", i, errs[i], res[i].Interrupted)
		}
		if res[i].Steps != res[0].Steps {
			t.Fatalf("ranks stopped at different steps: %d and %d", res[0].Steps, res[i].Steps)
		}
	}
	ck, _, err := checkpoint.Resolve("auto", r.ckptDir)
	if err != nil {
		t.Fatal(err)
	}
	second, _ := r.group(t, n, nil, ck)
	if _, errs := runAll(context.Background(), second); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	for rank := 0; rank < n; rank++ {
		if d, at := maxAbsDiff(full[0].Master(), second[rank].Master()); d != 0 {
			t.Fatalf("rank %d after resume differs from the uninterrupted run by %g at %d", rank, d, at)
		}
	}
}

// TestDataParallelPeerLoss: a rank that dies makes the others fail within the collective
// timeout with an error naming it — no hang.
func TestDataParallelPeerLoss(t *testing.T) {
	const n = 3
	r := defaultRun()
	r.cfg.MicroBatch = 8
	r.cfg.MaxSteps = 100000
	r.cfg.Epochs = 10000
	trainers, net := r.group(t, n, nil, nil)
	go func() {
		time.Sleep(300 * time.Millisecond)
		net.Kill(2)
	}()
	start := time.Now()
	_, errs := runAll(context.Background(), trainers)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("survivors took %v to fail", took)
	}
	for rank := 0; rank < 2; rank++ {
		var pe *collective.PeerError
		if !errors.As(errs[rank], &pe) || pe.Rank != 2 {
			t.Fatalf("rank %d: want a PeerError naming rank 2, got %v", rank, errs[rank])
		}
	}
}
