package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/qvd/qvd/checkpoint/sharded"
	"github.com/qvd/qvd/zero"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/internal/metrics"
)

// fullMasters gathers every rank's full fp32 master weights (a collective at stages 1-2).
func fullMasters(t *testing.T, ts []*Trainer) [][]float32 {
	t.Helper()
	out := make([][]float32, len(ts))
	errs := make([]error, len(ts))
	var wg sync.WaitGroup
	for i, tr := range ts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := tr.FullMaster(context.Background())
			out[i], errs[i] = append([]float32(nil), m...), err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return out
}

// zeroCase names one sharding configuration.
type zeroCase struct {
	stage   int
	offload bool
}

func (z zeroCase) String() string {
	if z.offload {
		return fmt.Sprintf("stage%d+offload", z.stage)
	}
	return fmt.Sprintf("stage%d", z.stage)
}

var zeroCases = []zeroCase{{0, false}, {0, true}, {1, false}, {1, true}, {2, false}, {2, true}}

func (r *testRun) setZero(z zeroCase) {
	r.zero.Stage = z.stage
	r.zero.OffloadOptimizer.Device = "none"
	if z.offload {
		r.zero.OffloadOptimizer.Device = "cpu"
	}
}

// TestZeroEquivalence: ZeRO stages 0, 1 and 2, with and without offload, at N = 1, 3 and 4
// ranks, take the same steps as one stage-0 worker with the same global batch (micro N·m,
// accum a), with global-norm clipping that triggers, in each precision, and every rank ends
// with the same weights bit for bit. SGD with momentum is linear in the gradient, so the
// tolerances bound only the summation-order and rounding differences; AdamW divides by
// sqrt(v), which turns a last-bit difference of a near-zero gradient into a weight difference
// of up to lr per step, so with AdamW the test checks that stages 0 and 1 are bit-identical
// (same gradient bits, same elementwise update) and that stage 2 stays within that bound.
func TestZeroEquivalence(t *testing.T) {
	for _, optName := range []string{"sgd", "adamw"} {
		for _, prec := range []string{"fp32", "bf16", "fp16"} {
			base := defaultRun()
			base.cfg.Precision = prec
			base.cfg.MaxSteps = 6
			base.cfg.MaxGradNorm = 0.5
			base.model.Hidden = []int{24, 12} // 2,008 elements: shards end inside tensors
			base.opt.Type = optName
			// A loss scale that does not overflow: a step skipped by one configuration and
			// not by another (an fp16 partial sum of 4 samples overflows where the mean of 12
			// does not) is a real difference, not a rounding one.
			base.scaler.InitialScalePower = 8
			if optName == "sgd" {
				base.opt.LR, base.opt.Momentum = 0.05, 0.9
			}
			const m, a = 4, 2
			for _, n := range []int{1, 3, 4} {
				single := base
				single.cfg.MicroBatch, single.cfg.Accum = n*m, a
				ref := single.build(t, nil, nil)
				if _, err := ref.Run(context.Background()); err != nil {
					t.Fatal(err)
				}
				want := ref.Master()
				if moved, _ := maxAbsDiff(want, single.build(t, nil, nil).Master()); moved < 1e-3 {
					t.Fatalf("weights barely moved (%g)", moved)
				}
				var stage0 []float32
				for _, z := range zeroCases {
					t.Run(fmt.Sprintf("%s/%s/N%d/%s", optName, prec, n, z), func(t *testing.T) {
						grp := base
						grp.setZero(z)
						grp.cfg.MicroBatch, grp.cfg.Accum = m, a
						trainers, _ := grp.group(t, n, nil, nil)
						if _, errs := runAll(context.Background(), trainers); errors.Join(errs...) != nil {
							t.Fatal(errors.Join(errs...))
						}
						ms := fullMasters(t, trainers)
						if trainers[0].pos.skipped != 0 {
							t.Fatalf("%d fp16 overflow steps", trainers[0].pos.skipped)
						}
						for r := 1; r < n; r++ {
							if d, at := maxAbsDiff(ms[0], ms[r]); d != 0 {
								t.Fatalf("rank %d's weights differ from rank 0's by %g at %d", r, d, at)
							}
						}
						if z.stage == 0 && !z.offload {
							stage0 = ms[0]
						}
						if optName == "adamw" {
							d, at := maxAbsDiff(stage0, ms[0])
							t.Logf("max weight difference from stage 0: %.3g", d)
							if z.stage < 2 && d != 0 {
								t.Fatalf("weights differ from stage 0's by %g at %d: stages 0 and 1 must agree bit for bit", d, at)
							}
							if bound := 6 * base.opt.LR; d > bound {
								t.Fatalf("weights differ from stage 0's by %g at %d (bound %g)", d, at, bound)
							}
							return
						}
						// fp16/bf16: each rank rounds its own partial gradient, and stage 2
						// sums micro-batches in fp32 rather than in the working precision.
						tol := map[string]float64{"fp32": 1e-6, "fp16": 1e-4, "bf16": 1e-3}[prec]
						d, at := maxAbsDiff(want, ms[0])
						t.Logf("max weight difference from the single worker: %.3g", d)
						if d > tol {
							t.Fatalf("weights differ from the single worker's by %g at %d (tolerance %g)", d, at, tol)
						}
					})
				}
			}
		}
	}
}

// TestZeroMemoryScaling: the same model at N = 1, 2 and 4 ranks and stages 0, 1 and 2: the
// optimizer state per rank (and the master weights, in bf16) scales as 1/N (±1%) at stages
// 1-2 and not at stage 0; the gradient held between micro-batches as 1/N at stage 2 only. The
// bytes are the ones the engine actually allocated.
func TestZeroMemoryScaling(t *testing.T) {
	base := defaultRun()
	base.cfg.Precision = "bf16"
	base.model.Hidden = []int{128, 64} // 16,964 elements: alignment is far below 1%
	type key struct{ n, stage int }
	mem := map[key][]int64{} // optimizer, grads, master of rank r...
	for _, n := range []int{1, 2, 4} {
		for stage := 0; stage <= 2; stage++ {
			r := base
			r.zero.Stage = stage
			trainers, _ := r.group(t, n, nil, nil)
			for rank, tr := range trainers {
				m := tr.Memory()
				if m.Host.Total() != 0 {
					t.Fatalf("N%d stage %d: %d host bytes without offload", n, stage, m.Host.Total())
				}
				if m.Device.Params != int64(4*tr.layout.Size) {
					t.Fatalf("N%d stage %d rank %d: params %d bytes, want the full %d", n, stage, rank, m.Device.Params, 4*tr.layout.Size)
				}
				got := []int64{m.Device.Optimizer, m.Device.Grads, m.Device.Master}
				if rank == 0 {
					mem[key{n, stage}] = got
				}
				t.Logf("N%d stage %d rank %d: optimizer %d, grads %d, master %d, buffers %d bytes", n, stage, rank, got[0], got[1], got[2], m.Device.Buffers)
			}
		}
	}
	// Stage 1 with accumulation keeps the whole gradient to accumulate into.
	acc := base
	acc.zero.Stage, acc.cfg.Accum, acc.cfg.MicroBatch = 1, 2, base.cfg.MicroBatch/2
	trainers, _ := acc.group(t, 2, nil, nil)
	if g := trainers[0].Memory().Device.Grads; g != int64(4*trainers[0].layout.Trainable()) {
		t.Errorf("stage 1 with accum 2: grads %d bytes, want the full %d", g, 4*trainers[0].layout.Trainable())
	}
	near := func(got, want float64) bool { return math.Abs(got-want) <= 0.01*want }
	for _, n := range []int{2, 4} {
		one := mem[key{1, 0}]
		for stage := 0; stage <= 2; stage++ {
			got := mem[key{n, stage}]
			wantOpt, wantMaster := float64(one[0]), float64(one[2])
			if stage >= 1 {
				wantOpt, wantMaster = wantOpt/float64(n), wantMaster/float64(n)
			}
			wantGrads := float64(one[1])
			if zero.GradPartitioned(stage, base.cfg.Accum) { // stage 1 too: accum is 1
				wantGrads /= float64(n)
			}
			if !near(float64(got[0]), wantOpt) || !near(float64(got[2]), wantMaster) || !near(float64(got[1]), wantGrads) {
				t.Errorf("N%d stage %d: optimizer %d, grads %d, master %d bytes; want %.0f, %.0f, %.0f (±1%%)",
					n, stage, got[0], got[1], got[2], wantOpt, wantGrads, wantMaster)
			}
		}
	}
}

// TestZeroOffloadPlacement: with offload the master weights, gradient shard and optimizer
// state are accounted to the host and only the parameters and staging buffers to the device.
func TestZeroOffloadPlacement(t *testing.T) {
	r := defaultRun()
	r.cfg.Precision = "fp16"
	r.setZero(zeroCase{2, true})
	trainers, _ := r.group(t, 2, nil, nil)
	m := trainers[1].Memory()
	if m.Device.Optimizer != 0 || m.Device.Master != 0 || m.Device.Grads != 0 {
		t.Fatalf("offloaded state on the device: %+v", m.Device)
	}
	lo, hi := trainers[1].eng.Shard()
	if m.Host.Optimizer != int64(8*(hi-lo)) || m.Host.Master != int64(4*(hi-lo)) || m.Host.Grads != int64(4*(hi-lo)) {
		t.Fatalf("host side %+v for a %d-element shard", m.Host, hi-lo)
	}
	if m.Device.Params == 0 || m.Device.Buffers == 0 {
		t.Fatalf("device side %+v: parameters and staging buckets should be there", m.Device)
	}
}

// interruptedCheckpoint runs r as a group of n, interrupts it after step 3 (it saves at the
// step boundary), and returns the checkpoint and its meta.
func interruptedCheckpoint(t *testing.T, r testRun, n int) (*checkpoint.Checkpoint, sharded.Meta) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sinks := make([]MetricsSink, n)
	sinks[0] = &recorder{after: func(rec metrics.Record) {
		if rec.Step == 3 {
			cancel()
		}
	}}
	first, _ := r.group(t, n, sinks, nil)
	if _, errs := runAll(ctx, first); !errors.Is(errs[0], context.Canceled) {
		t.Fatalf("interrupted run: %v", errs)
	}
	ck, _, err := checkpoint.Resolve("auto", r.ckptDir)
	if err != nil {
		t.Fatal(err)
	}
	var meta sharded.Meta
	if err := ck.Meta(&meta); err != nil {
		t.Fatal(err)
	}
	return ck, meta
}

// TestZeroReshardResume: a run saved by 4 ranks at stage 2 resumes as 4 ranks at stage 2
// (step for step equal to the uninterrupted run), as 2 ranks at stage 1, and as one worker,
// without any conversion, and the resharded runs continue as the uninterrupted one does
// (within the tolerance of their different summation orders).
func TestZeroReshardResume(t *testing.T) {
	base := defaultRun()
	base.cfg.Precision = "bf16"
	base.cfg.MaxSteps = 8
	base.model.Hidden = []int{24, 12}
	base.opt.Type = "adamw"
	const global = 24
	at := func(n int, z zeroCase) testRun {
		r := base
		r.setZero(z)
		r.cfg.MicroBatch, r.cfg.Accum = global/n/2, 2
		return r
	}
	saver := at(4, zeroCase{2, false})
	full, _ := saver.group(t, 4, nil, nil)
	rec := &recorder{}
	full[0].out.metrics = rec
	if _, errs := runAll(context.Background(), full); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	want := fullMasters(t, full)[0]
	wantLoss := rec.trainLosses()

	saver.ckptDir = t.TempDir()
	ck, meta := interruptedCheckpoint(t, saver, 4)
	if len(meta.Shards) != 4 || meta.ZeroStage != 2 {
		t.Fatalf("checkpoint has %d optimizer shards at stage %d, want 4 at 2", len(meta.Shards), meta.ZeroStage)
	}

	for _, c := range []struct {
		n   int
		z   zeroCase
		tol float64
	}{{4, zeroCase{2, false}, 0}, {2, zeroCase{1, false}, 1e-4}, {1, zeroCase{0, false}, 1e-4}, {3, zeroCase{2, true}, 1e-4}} {
		t.Run(fmt.Sprintf("N%d/%s", c.n, c.z), func(t *testing.T) {
			r := at(c.n, c.z)
			rec := &recorder{}
			ts, _ := r.group(t, c.n, nil, ck)
			ts[0].out.metrics = rec
			if _, errs := runAll(context.Background(), ts); errors.Join(errs...) != nil {
				t.Fatal(errors.Join(errs...))
			}
			got := fullMasters(t, ts)[0]
			d, i := maxAbsDiff(want, got)
			t.Logf("max weight difference from the uninterrupted 4-rank stage-2 run: %.3g", d)
			if d > c.tol {
				t.Fatalf("weights differ by %g at %d (tolerance %g)", d, i, c.tol)
			}
			if c.tol == 0 {
				for step, l := range rec.trainLosses() {
					if wantLoss[step] != l {
						t.Fatalf("step %d: loss %v, uninterrupted %v", step, l, wantLoss[step])
					}
				}
			}
		})
	}

	// A missing shard is an error naming it, and the checkpoint is left as it was.
	broken := filepath.Join(t.TempDir(), "step")
	if err := os.CopyFS(broken, os.DirFS(ck.Path())); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(broken, "optimizer-00002.safetensors")); err != nil {
		t.Fatal(err)
	}
	_, err := checkpoint.Open(broken)
	if err == nil || !strings.Contains(err.Error(), "optimizer-00002.safetensors") {
		t.Fatalf("opening a checkpoint without shard 2: %v", err)
	}
}

// TestParamGatherPhase: at stages 1-2 with more than one rank every applied step's metrics
// give the parameters' all-gather; at stage 0 (no all-gather) and on one rank they do not.
// Without overlap_comm the gather is inside the optimizer phase; with it (the default) it runs
// under the next step's forward pass, and a step's figure is the last step's gather: zero for
// the first step, never from the second on.
func TestParamGatherPhase(t *testing.T) {
	for _, c := range []struct {
		stage, n int
		overlap  bool
	}{{0, 2, true}, {1, 2, true}, {2, 2, true}, {2, 1, true}, {1, 2, false}, {2, 2, false}} {
		t.Run(fmt.Sprintf("stage%d/N%d/overlap=%v", c.stage, c.n, c.overlap), func(t *testing.T) {
			r := defaultRun()
			r.cfg.MaxSteps = 3
			r.setZero(zeroCase{c.stage, false})
			r.zero.OverlapComm = c.overlap
			rec := &recorder{}
			sinks := make([]MetricsSink, c.n)
			sinks[0] = rec
			trainers, _ := r.group(t, c.n, sinks, nil)
			if _, errs := runAll(context.Background(), trainers); errors.Join(errs...) != nil {
				t.Fatal(errors.Join(errs...))
			}
			steps := 0
			for _, m := range rec.recs {
				if m.Kind != metrics.KindTrain || m.Skipped {
					continue
				}
				steps++
				g, ok := m.PhaseSeconds["param_gather"]
				if want := c.stage > 0 && c.n > 1; ok != want {
					t.Fatalf("step %d: param_gather given %v, want %v (phases %v)", m.Step, ok, want, m.PhaseSeconds)
				}
				if ok && c.overlap && m.Step == 1 {
					if g != 0 {
						t.Fatalf("step 1: param_gather %g s with no step before it", g)
					}
					continue
				}
				if !ok {
					continue
				}
				if g <= 0 || !c.overlap && g > m.PhaseSeconds["optimizer"] {
					t.Fatalf("step %d: param_gather %g s, optimizer %g s", m.Step, g, m.PhaseSeconds["optimizer"])
				}
			}
			if steps != 3 {
				t.Fatalf("%d applied steps recorded, want 3", steps)
			}
		})
	}
}
