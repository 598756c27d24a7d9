package engine

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
)

func randomBatch(n, size, classes int, seed uint64) *data.Batch {
	rng := rand.New(rand.NewPCG(seed, 1))
	b := data.NewBatch(n, size)
	for i := range b.X {
		b.X[i] = float32(rng.NormFloat64())
	}
	for i := 0; i < n; i++ {
		b.Y[i] = int32(rng.IntN(classes))
	}
	b.N = n
	return b
}

// pair builds the CPU engine (gorgonia) and the GPU engine on dev over equal weights.
func pair(t *testing.T, dev Device, cfg model.Config, input []int, classes, micro int, f half.Format, frozen func(string) bool) (*model.Net, *Net) {
	t.Helper()
	spec, err := model.NewSpec(cfg, input, classes)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayoutFrozen(spec, frozen)
	cpuW := make([]float32, layout.Size)
	model.Init(spec, layout, cpuW, 11)
	if f != half.FP32 {
		round(cpuW, FromFormat(f))
	}
	gpuW := append([]float32(nil), cpuW...)
	cpu, err := model.New(spec, layout, cpuW, model.Options{MicroBatch: micro, EvalBatch: micro, Grad: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cpu.Close() })
	g, err := NewNet(NewAllocator(dev), spec, layout, gpuW, Options{MicroBatch: micro, EvalBatch: micro, Precision: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return cpu, g
}

// relErr is max|a−b| / max(max|a|, tiny).
func relErr(a, b []float32) float64 {
	var d, m float64
	for i := range a {
		d = math.Max(d, math.Abs(float64(a[i])-float64(b[i])))
		m = math.Max(m, math.Abs(float64(a[i])))
	}
	return d / math.Max(m, 1e-30)
}

// TestNetMatchesCPUEngine is the check that keeps the two engines one model: the same spec,
// weights and batch give the same loss, gradients (of loss × scale, accumulated over two
// micro-batches) and evaluation on the GPU engine (here over the host reference device, on a
// GPU over CUDA: see engine/cuda) as on the gorgonia engine.
func TestNetMatchesCPUEngine(t *testing.T) {
	mlp := model.Config{Type: model.TypeMLP, Hidden: []int{32, 16}}
	cnn := model.Config{Type: model.TypeCNN, Channels: []int{4, 6}, Kernel: 3, Hidden: []int{12}}
	for _, tc := range []struct {
		name  string
		cfg   model.Config
		input []int
		f     half.Format
		tol   float64
	}{
		{"mlp/fp32", mlp, []int{1, 8, 8}, half.FP32, 2e-5},
		{"cnn/fp32", cnn, []int{2, 9, 10}, half.FP32, 2e-5},
		// On the device activations are stored in half precision too; the CPU engine keeps
		// them in fp32 and rounds only the weights and gradients.
		{"mlp/fp16", mlp, []int{1, 8, 8}, half.FP16, 1e-2},
		{"mlp/bf16", mlp, []int{1, 8, 8}, half.BF16, 6e-2},
		{"cnn/bf16", cnn, []int{2, 9, 10}, half.BF16, 8e-2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const micro, classes = 5, 4
			cpu, g := pair(t, NewReference(), tc.cfg, tc.input, classes, micro, tc.f, nil)
			size := tc.input[0] * tc.input[1] * tc.input[2]
			n := cpu.Layout().Trainable()
			gc, gg := make([]float32, n), make([]float32, n)
			for k := uint64(0); k < 2; k++ {
				b := randomBatch(micro, size, classes, 3+k)
				lc, err := cpu.ForwardBackward(b, 64, model.FlatSink(gc))
				if err != nil {
					t.Fatal(err)
				}
				lg, err := g.ForwardBackward(b, 64, model.FlatSink(gg))
				if err != nil {
					t.Fatal(err)
				}
				if d := math.Abs(float64(lc - lg)); d > tc.tol*math.Max(1, math.Abs(float64(lc))) {
					t.Errorf("micro-batch %d: loss cpu %v gpu %v", k, lc, lg)
				}
			}
			e := relErr(gc, gg)
			t.Logf("gradient relative error %.3g", e)
			if e > tc.tol {
				t.Errorf("gradients differ: relative error %.3g > %.3g", e, tc.tol)
			}
			for _, tt := range cpu.Layout().Tensors {
				var nz bool
				for _, v := range gg[tt.Offset : tt.Offset+tt.Size] {
					nz = nz || v != 0
				}
				if !nz {
					t.Errorf("tensor %s has an all-zero gradient", tt.Name)
				}
			}
			b := randomBatch(micro, size, classes, 9)
			b.N = micro - 2 // a short last batch
			rc, err := cpu.Evaluate(b)
			if err != nil {
				t.Fatal(err)
			}
			rg, err := g.Evaluate(b)
			if err != nil {
				t.Fatal(err)
			}
			if rc.N != rg.N || math.Abs(rc.LossSum-rg.LossSum) > tc.tol*10*math.Max(1, rc.LossSum) {
				t.Errorf("evaluation: cpu %+v gpu %+v", rc, rg)
			}
		})
	}
}

// TestNetStreamAndFrozen checks the streamed gradient equals the accumulated one, that frozen
// tensors get none, and that the gradient of the layers below a frozen prefix is not computed.
func TestNetStreamAndFrozen(t *testing.T) {
	cfg := model.Config{Type: model.TypeMLP, Hidden: []int{16, 8}}
	frozen := func(name string) bool { return name == "fc1.weight" || name == "fc1.bias" }
	cpu, g := pair(t, NewReference(), cfg, []int{1, 6, 6}, 3, 4, half.FP32, frozen)
	b := randomBatch(4, 36, 3, 5)
	n := cpu.Layout().Trainable()
	want := make([]float32, n)
	if _, err := cpu.ForwardBackward(b, 1, model.FlatSink(want)); err != nil {
		t.Fatal(err)
	}
	rec := &recordSink{mem: make([]float32, n), cuts: []int{0, n / 2}}
	if _, err := g.ForwardBackward(b, 1, rec); err != nil {
		t.Fatal(err)
	}
	got := rec.mem
	for i := 1; i < len(rec.pieces); i++ {
		if rec.pieces[i][1] > rec.pieces[i-1][0] {
			t.Errorf("piece %v after %v: not from the top", rec.pieces[i], rec.pieces[i-1])
		}
	}
	if e := relErr(want, got); e > 2e-5 {
		t.Fatalf("streamed gradient differs from the CPU engine's: %.3g", e)
	}
	if g.needDx[0] || g.needDx[1] {
		t.Errorf("needDx = %v: the layers under the frozen fc1 need no input gradient", g.needDx)
	}
}

// TestNetParamsSync checks that the device computes with the weights the trainer last wrote
// and synced, not with stale ones.
func TestNetParamsSync(t *testing.T) {
	cfg := model.Config{Type: model.TypeMLP, Hidden: []int{8}}
	cpu, g := pair(t, NewReference(), cfg, []int{1, 4, 4}, 3, 3, half.FP32, nil)
	b := randomBatch(3, 16, 3, 1)
	for i := range cpu.Params() {
		cpu.Params()[i] *= 0.5
		g.Params()[i] *= 0.5
	}
	if err := g.SyncParams(); err != nil {
		t.Fatal(err)
	}
	rc, _ := cpu.Evaluate(b)
	rg, err := g.Evaluate(b)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(rc.LossSum-rg.LossSum) > 1e-5 {
		t.Fatalf("after SyncParams: cpu loss %v, gpu %v", rc.LossSum, rg.LossSum)
	}
}

// TestNetOutOfMemory checks an allocation failure in the middle of a micro-batch is an
// error wrapping memory.ErrOutOfMemory, leaks nothing, and the next micro-batch works.
func TestNetOutOfMemory(t *testing.T) {
	cfg := model.Config{Type: model.TypeCNN, Channels: []int{3}, Kernel: 3, Hidden: []int{8}}
	_, g := pair(t, NewReference(), cfg, []int{1, 6, 6}, 3, 4, half.FP32, nil)
	b := randomBatch(4, 36, 3, 2)
	grads := make([]float32, g.Layout().Trainable())
	if _, err := g.ForwardBackward(b, 1, model.FlatSink(grads)); err != nil {
		t.Fatal(err)
	}
	base := g.Allocator().Stats()
	for k := 1; k <= 8; k++ {
		g.Allocator().FailAfter(k)
		_, err := g.ForwardBackward(b, 1, model.FlatSink(grads))
		if !errors.Is(err, memory.ErrOutOfMemory) {
			t.Fatalf("failure at allocation %d: err = %v, want ErrOutOfMemory", k, err)
		}
		if s := g.Allocator().Stats(); s.Allocated != base.Allocated {
			t.Fatalf("after a failed micro-batch %d bytes are allocated, %d before", s.Allocated, base.Allocated)
		}
	}
	g.Allocator().ClearFailure()
	if _, err := g.ForwardBackward(b, 1, model.FlatSink(grads)); err != nil {
		t.Fatalf("after the failures: %v", err)
	}
	// A real device limit: a host device too small for the activations.
	spec, _ := model.NewSpec(cfg, []int{1, 6, 6}, 3)
	layout := model.NewLayout(spec)
	w := make([]float32, layout.Size)
	small, err := NewNet(NewAllocator(NewReferenceLimit(uint64(layout.Size*4*2+2048))), spec, layout, w, Options{MicroBatch: 4, EvalBatch: 4})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := small.ForwardBackward(b, 1, model.FlatSink(grads)); !errors.Is(err, memory.ErrOutOfMemory) {
		t.Fatalf("on a full device: err = %v, want ErrOutOfMemory", err)
	}
}

func TestNetBadBatch(t *testing.T) {
	cfg := model.Config{Type: model.TypeMLP, Hidden: []int{8}}
	_, g := pair(t, NewReference(), cfg, []int{1, 4, 4}, 3, 3, half.FP32, nil)
	grads := make([]float32, g.Layout().Trainable())
	if _, err := g.ForwardBackward(randomBatch(2, 16, 3, 1), 1, model.FlatSink(grads)); !errors.Is(err, ErrBatch) {
		t.Errorf("short batch: %v", err)
	}
	b := randomBatch(3, 16, 3, 1)
	b.Y[1] = 7
	if _, err := g.ForwardBackward(b, 1, model.FlatSink(grads)); !errors.Is(err, ErrBatch) {
		t.Errorf("bad label: %v", err)
	}
	if _, err := g.Evaluate(b); !errors.Is(err, ErrBatch) {
		t.Errorf("bad label in evaluation: %v", err)
	}
}

func TestConfigAndOpen(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []Config{{Type: "tpu"}, {Type: "cuda", Ordinal: -2}} {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v: no error", c)
		}
	}
	d, err := Open(Config{Type: "reference", Ordinal: -1}, 3)
	if err != nil || d == nil {
		t.Fatalf("reference: %v", err)
	}
	if _, ok := backends["cuda"]; !ok {
		_, err := Open(Config{Type: "cuda", Ordinal: -1}, 0)
		if err == nil || !strings.Contains(err.Error(), "-tags cuda") {
			t.Fatalf("cuda without the backend: %v", err)
		}
	}
}

// syncOnly hides the reference device's AsyncUploader and AsyncDownloader (only Device's
// methods are promoted from an embedded interface), to test the engine's synchronous paths.
type syncOnly struct{ Device }

// TestCopyPaths: the engine gives the same results over a device with a copy stream (the
// overlapped uploads and downloads) and over one without.
func TestCopyPaths(t *testing.T) {
	var _ AsyncUploader = (*Reference)(nil)
	var _ AsyncDownloader = (*Reference)(nil)
	cfg := model.Config{Type: model.TypeMLP, Hidden: []int{8}}
	for name, dev := range map[string]Device{"async": NewReference(), "sync": syncOnly{NewReference()}} {
		t.Run(name, func(t *testing.T) {
			if _, ok := dev.(AsyncDownloader); ok != (name == "async") {
				t.Fatalf("%s device: AsyncDownloader %v", name, ok)
			}
			cpu, g := pair(t, dev, cfg, []int{1, 4, 4}, 3, 3, half.FP32, nil)
			// The gradient, through the synchronous or the overlapped copy.
			b0 := randomBatch(3, 16, 3, 8)
			gc, gg := make([]float32, g.Layout().Trainable()), make([]float32, g.Layout().Trainable())
			if _, err := cpu.ForwardBackward(b0, 1, model.FlatSink(gc)); err != nil {
				t.Fatal(err)
			}
			if _, err := g.ForwardBackward(b0, 1, model.FlatSink(gg)); err != nil {
				t.Fatal(err)
			}
			if e := relErr(gc, gg); e > 2e-6 {
				t.Fatalf("gradient differs from the CPU engine's by %.3g", e)
			}
			for i := range g.Params() {
				cpu.Params()[i] += 0.25
				g.Params()[i] += 0.25
			}
			if err := g.SyncParams(); err != nil {
				t.Fatal(err)
			}
			b := randomBatch(3, 16, 3, 4)
			rc, _ := cpu.Evaluate(b)
			rg, err := g.Evaluate(b)
			if err != nil || math.Abs(rc.LossSum-rg.LossSum) > 1e-5 {
				t.Fatalf("after SyncParams: cpu %v gpu %v (%v)", rc.LossSum, rg.LossSum, err)
			}
		})
	}
}

// TestNetCheckpointing: with activation checkpointing the gradient is the plain run's bit for
// bit (the recomputed operations are the same), accumulation across micro-batches too, and
// the device's peak allocation is lower.
func TestNetCheckpointing(t *testing.T) {
	cfg := model.Config{Type: model.TypeCNN, Channels: []int{4, 6}, Kernel: 3, Hidden: []int{16, 12}}
	spec, err := model.NewSpec(cfg, []int{1, 12, 12}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayout(spec)
	w := make([]float32, layout.Size)
	model.Init(spec, layout, w, 5)
	const micro = 6
	run := func(segments int, beta bool) ([]float32, int64) {
		alloc := NewAllocator(NewReference())
		n, err := NewNet(alloc, spec, layout, append([]float32(nil), w...), Options{MicroBatch: micro, EvalBatch: micro, Segments: segments})
		if err != nil {
			t.Fatal(err)
		}
		defer n.Close()
		alloc.ResetPeaks()
		for k := uint64(0); k < 2; k++ {
			if _, err := n.AccumulateMicro(randomBatch(micro, 144, 4, 20+k), 8, k == 0 || !beta); err != nil {
				t.Fatal(err)
			}
		}
		g := make([]float32, layout.Trainable())
		if err := n.dev.Download(g, n.grads); err != nil {
			t.Fatal(err)
		}
		return g, alloc.Stats().MaxAllocated
	}
	plain, peak1 := run(1, true)
	for _, k := range []int{2, 3} {
		got, peak := run(k, true)
		for i := range plain {
			if math.Float32bits(plain[i]) != math.Float32bits(got[i]) {
				t.Fatalf("%d segments: gradient[%d] = %v, plain %v", k, i, got[i], plain[i])
			}
		}
		t.Logf("%d segments: peak %d B, plain %d B", k, peak, peak1)
		if peak >= peak1 {
			t.Errorf("%d segments: peak %d B, not below the plain run's %d B", k, peak, peak1)
		}
	}
	if _, err := NewNet(NewAllocator(NewReference()), spec, layout, w, Options{MicroBatch: 2, EvalBatch: 2, Segments: 9}); err == nil {
		t.Error("9 segments of a 4-weight-layer net accepted")
	}
}

// TestNetCheckpointingOOM: an allocation failure during a checkpointed micro-batch is an
// out-of-memory skip while nothing was added to the gradient, and ErrGradientLost (not a
// skip) once part of it was added into an accumulating gradient.
func TestNetCheckpointingOOM(t *testing.T) {
	cfg := model.Config{Type: model.TypeMLP, Hidden: []int{16, 12, 8}}
	spec, _ := model.NewSpec(cfg, []int{1, 6, 6}, 4)
	layout := model.NewLayout(spec)
	w := make([]float32, layout.Size)
	model.Init(spec, layout, w, 5)
	alloc := NewAllocator(NewReference())
	n, err := NewNet(alloc, spec, layout, w, Options{MicroBatch: 4, EvalBatch: 4, Segments: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	b := randomBatch(4, 36, 4, 1)
	var skips, lost int
	for k := 1; k < 60; k++ {
		if _, err := n.AccumulateMicro(b, 1, true); err != nil {
			t.Fatal(err)
		}
		alloc.FailAfter(k)
		_, err := n.AccumulateMicro(b, 1, false)
		alloc.ClearFailure()
		switch {
		case err == nil:
		case errors.Is(err, ErrGradientLost):
			if errors.Is(err, memory.ErrOutOfMemory) {
				t.Fatalf("a lost gradient must not look like a skippable OOM: %v", err)
			}
			lost++
		case errors.Is(err, memory.ErrOutOfMemory):
			skips++
		default:
			t.Fatalf("failure at allocation %d: %v", k, err)
		}
	}
	if skips == 0 || lost == 0 {
		t.Fatalf("%d skippable failures, %d lost gradients: both paths should occur", skips, lost)
	}
}

// recordSink is a model.GradSink with the given cuts that lets every piece overwrite one
// buffer and records the pieces in the order they came.
type recordSink struct {
	mem    []float32
	cuts   []int
	pieces [][2]int
}

func (r *recordSink) Cuts() []int { return r.cuts }

func (r *recordSink) Acquire(lo, hi int) ([]float32, bool, error) {
	for _, c := range r.cuts {
		if c > lo && c < hi {
			return nil, false, errors.New("piece spans a cut")
		}
	}
	return r.mem[lo:hi], false, nil
}

func (r *recordSink) Release(lo, hi int) error {
	r.pieces = append(r.pieces, [2]int{lo, hi})
	return nil
}
