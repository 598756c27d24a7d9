package trainer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/leakcheck"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/model"
)

// withPrefetch sets data.prefetch on a built trainer (as Setup.Prefetch would) and returns it.
func withPrefetch(tr *Trainer, depth int) *Trainer {
	tr.prefetch.depth = depth
	return tr
}

// TestPrefetchBitIdentical: prefetching changes nothing: the same batches in the same order,
// so the same losses and the same final weights, bit for bit — across epoch boundaries,
// with accumulation, and in a data-parallel group where each rank prefetches its share.
func TestPrefetchBitIdentical(t *testing.T) {
	leakcheck.Check(t)
	r := defaultRun()
	r.cfg.MicroBatch, r.cfg.Accum = 16, 2
	r.cfg.MaxSteps = 13 // 5 steps per epoch: two epoch boundaries, and a stop mid-epoch
	run := func(depth int) (*Trainer, map[int64]float64) {
		rec := &recorder{}
		tr := withPrefetch(r.build(t, rec, nil), depth)
		res, err := tr.Run(context.Background())
		if err != nil || res.Steps != 13 {
			t.Fatalf("prefetch %d: %v after %d steps", depth, err, res.Steps)
		}
		return tr, rec.trainLosses()
	}
	base, baseLoss := run(0)
	for _, depth := range []int{1, 2, 5} {
		tr, loss := run(depth)
		if d, at := maxAbsDiff(base.Master(), tr.Master()); d != 0 {
			t.Fatalf("prefetch %d: final weights differ from prefetch 0 by %g at %d", depth, d, at)
		}
		for s, l := range baseLoss {
			if loss[s] != l {
				t.Fatalf("prefetch %d: step %d loss %v, prefetch 0 %v", depth, s, loss[s], l)
			}
		}
	}
	moved, _ := maxAbsDiff(base.Master(), r.build(t, nil, nil).Master())
	if moved < 1e-3 {
		t.Fatalf("weights barely moved (%g): the comparison would pass for a trainer that does nothing", moved)
	}

	// Two ranks, each prefetching its share of every micro-batch.
	r.cfg.MicroBatch = 8
	var hashes []string
	for _, depth := range []int{0, 2} {
		ts, _ := r.group(t, 2, nil, nil)
		for _, tr := range ts {
			withPrefetch(tr, depth)
		}
		res, errs := runAll(context.Background(), ts)
		for i, err := range errs {
			if err != nil {
				t.Fatalf("prefetch %d rank %d: %v", depth, i, err)
			}
		}
		if res[0].WeightsSHA256 != res[1].WeightsSHA256 {
			t.Fatalf("prefetch %d: ranks disagree", depth)
		}
		hashes = append(hashes, res[0].WeightsSHA256)
	}
	if hashes[0] != hashes[1] {
		t.Fatal("two ranks: prefetch 2 ends with other weights than prefetch 0")
	}
}

// TestPrefetchResume: a run interrupted and resumed with prefetch 2 ends with the weights of
// an uninterrupted run without prefetch, bit for bit; the resumed run starts its prefetch
// mid-epoch, at the checkpoint's position.
func TestPrefetchResume(t *testing.T) {
	leakcheck.Check(t)
	r := defaultRun()
	r.cfg.MicroBatch, r.cfg.Accum = 16, 2
	const total, stopAfter = 13, 7 // stops mid-epoch 2
	r.cfg.MaxSteps = total
	full := withPrefetch(r.build(t, nil, nil), 0)
	if _, err := full.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.ckptDir = t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := &recorder{after: func(rec metrics.Record) {
		if rec.Kind == metrics.KindTrain && rec.Step == stopAfter {
			cancel()
		}
	}}
	res, err := withPrefetch(r.build(t, first, nil), 2).Run(ctx)
	if !errors.Is(err, context.Canceled) || !res.Interrupted || res.Steps != stopAfter {
		t.Fatalf("interrupted run: err=%v interrupted=%v steps=%d", err, res.Interrupted, res.Steps)
	}
	ck, _, err := checkpoint.Resolve("auto", r.ckptDir)
	if err != nil || ck.Step() != stopAfter {
		t.Fatalf("resolve: %v", err)
	}
	resumed := withPrefetch(r.build(t, nil, ck), 2)
	if _, err := resumed.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if d, at := maxAbsDiff(full.Master(), resumed.Master()); d != 0 {
		t.Fatalf("resumed with prefetch: final weights differ by %g at %d from the uninterrupted run without", d, at)
	}
}

// TestPrefetchAdapt: when memory adaptation halves the micro-batch in the middle of an
// epoch, the prefetcher is rebuilt for the new size at the trainer's position, and the run
// equals the one without prefetch bit for bit (the same skipped micro-batches, the same
// halving, the same batches afterwards).
func TestPrefetchAdapt(t *testing.T) {
	leakcheck.Check(t)
	r := defaultRun()
	r.opt.Type, r.opt.LR, r.opt.Momentum = "sgd", 0.05, 0.9
	r.cfg.MicroBatch, r.cfg.Accum, r.cfg.MaxSteps = 16, 1, 12 // 10 steps per epoch
	var masters [][]float32
	for _, depth := range []int{0, 2} {
		// "Memory" holds 8 samples: micro-batches of 16 fail until the halving.
		tr := withPrefetch(r.buildOOM(t, func(micro, _ int) bool { return micro > 8 }, 2), depth)
		res, err := tr.Run(context.Background())
		if err != nil {
			t.Fatalf("prefetch %d: %v", depth, err)
		}
		if res.MicroBatch != 8 || res.Accum != 2 || res.SkippedMicroBatches != 2 || res.Steps != 12 {
			t.Fatalf("prefetch %d: micro %d × accum %d, %d skipped micro-batches, %d steps; want 8 × 2, 2, 12",
				depth, res.MicroBatch, res.Accum, res.SkippedMicroBatches, res.Steps)
		}
		if depth > 0 && tr.prefetch.pf.MicroBatch() != 8 {
			t.Fatalf("the prefetcher still fills micro-batches of %d", tr.prefetch.pf.MicroBatch())
		}
		masters = append(masters, append([]float32(nil), tr.Master()...))
	}
	if d, at := maxAbsDiff(masters[0], masters[1]); d != 0 {
		t.Fatalf("after a halving, prefetch 2 differs from prefetch 0 by %g at %d", d, at)
	}
}

// TestPrefetchFillErrorReachesStep: a fill error on the producer goroutine fails the step
// that would have used the batch, with the step and micro-batch named, as without prefetch.
func TestPrefetchFillErrorReachesStep(t *testing.T) {
	leakcheck.Check(t)
	for _, depth := range []int{0, 2} {
		r := defaultRun()
		r.cfg.MaxSteps = 4
		tr := withPrefetch(r.build(t, nil, nil), depth)
		bad := *tr.data.train
		bad.Labels = bad.Labels[:bad.N-1] // Fill rejects the inconsistent dataset
		tr.data.train = &bad
		_, err := tr.Run(context.Background())
		if err == nil || !strings.Contains(err.Error(), "step 1: filling micro-batch 0") || !strings.Contains(err.Error(), "inconsistent dataset") {
			t.Fatalf("prefetch %d: %v", depth, err)
		}
	}
}

func TestPrefetchSetupValidation(t *testing.T) {
	r := defaultRun()
	spec, err := model.NewSpec(r.model, []int{1, 8, 8}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	net, err := model.New(spec, layout, params, model.Options{MicroBatch: r.cfg.MicroBatch, EvalBatch: r.cfg.EvalBatch, Grad: r.cfg.Format()})
	if err != nil {
		t.Fatal(err)
	}
	defer net.Close()
	for _, depth := range []int{-1, data.MaxPrefetch + 1} {
		_, err := New(Setup{Config: r.cfg, Schedule: r.sched, Scaler: r.scaler, Optimizer: r.opt, Zero: r.zero,
			Model: net, Train: r.train, Test: r.test, Normalize: data.Normalize{Mean: 0.5, Std: 0.25}, Prefetch: depth})
		if want := fmt.Sprintf("data.prefetch: must be in [0, %d], got %d", data.MaxPrefetch, depth); err == nil || err.Error() != want {
			t.Errorf("Prefetch %d: %v, want %q", depth, err, want)
		}
	}
}
