//go:build cuda

package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
)

// TestNetMatchesReference is the GPU engine on CUDA against the same engine on the reference
// device (which the default build's tests hold to the gorgonia engine): the same spec, weights
// and batches give the same loss, accumulated gradient (through the overlapped copies) and
// evaluation, for the shipped model shapes and every precision.
func TestNetMatchesReference(t *testing.T) {
	mlp := model.Config{Type: model.TypeMLP, Hidden: []int{256, 128}}
	cnn := model.Config{Type: model.TypeCNN, Channels: []int{16, 32}, Kernel: 3, Hidden: []int{128}}
	for _, tc := range []struct {
		name string
		cfg  model.Config
		f    half.Format
		tol  float64
	}{
		{"mlp/fp32", mlp, half.FP32, 1e-4}, {"mlp/fp16", mlp, half.FP16, 2e-2}, {"mlp/bf16", mlp, half.BF16, 5e-2},
		{"cnn/fp32", cnn, half.FP32, 1e-4}, {"cnn/bf16", cnn, half.BF16, 5e-2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const micro = 64
			spec, err := model.NewSpec(tc.cfg, []int{1, 28, 28}, 10)
			if err != nil {
				t.Fatal(err)
			}
			layout := model.NewLayout(spec)
			w := make([]float32, layout.Size)
			model.Init(spec, layout, w, 3)
			opt := engine.Options{MicroBatch: micro, EvalBatch: micro, Precision: tc.f}
			ref, err := engine.NewNet(engine.NewAllocator(engine.NewReference()), spec, layout, append([]float32(nil), w...), opt)
			if err != nil {
				t.Fatal(err)
			}
			defer ref.Close()
			alloc := engine.NewAllocator(dev)
			defer alloc.Close()
			net, err := engine.NewNet(alloc, spec, layout, append([]float32(nil), w...), opt)
			if err != nil {
				t.Fatal(err)
			}
			defer net.Close()
			rng := rand.New(rand.NewPCG(1, 2))
			gr, gd := make([]float32, layout.Trainable()), make([]float32, layout.Trainable())
			for k := 0; k < 2; k++ {
				b := data.NewBatch(micro, 784)
				b.N = micro
				for i := range b.X {
					b.X[i] = float32(rng.NormFloat64())
				}
				for i := 0; i < micro; i++ {
					b.Y[i] = int32(rng.IntN(10))
				}
				lr, err := ref.ForwardBackward(b, 128, model.FlatSink(gr))
				if err != nil {
					t.Fatal(err)
				}
				ld, err := net.ForwardBackward(b, 128, model.FlatSink(gd))
				if err != nil {
					t.Fatal(err)
				}
				if math.Abs(float64(lr-ld)) > tc.tol*math.Max(1, math.Abs(float64(lr))) {
					t.Errorf("micro-batch %d: loss reference %v, CUDA %v", k, lr, ld)
				}
				if k == 1 {
					re, rd := evalBoth(t, ref, net, b)
					if math.Abs(re-rd) > tc.tol*math.Max(1, re) {
						t.Errorf("evaluation loss sum: reference %v, CUDA %v", re, rd)
					}
				}
			}
			var d, m float64
			for i := range gr {
				d = math.Max(d, math.Abs(float64(gr[i])-float64(gd[i])))
				m = math.Max(m, math.Abs(float64(gr[i])))
			}
			t.Logf("gradient relative error %.3g; device peak %d B", d/m, alloc.Stats().MaxAllocated)
			if d/m > tc.tol {
				t.Fatalf("gradients differ: relative error %.3g > %.3g", d/m, tc.tol)
			}
		})
	}
}

func evalBoth(t *testing.T, a, b *engine.Net, batch *data.Batch) (float64, float64) {
	t.Helper()
	ra, err := a.Evaluate(batch)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Evaluate(batch)
	if err != nil {
		t.Fatal(err)
	}
	return ra.LossSum, rb.LossSum
}

// TestDownloadAsync: copies queued behind kernels land in their destinations at WaitDownloads.
func TestDownloadAsync(t *testing.T) {
	for _, ty := range []engine.DType{engine.F32, engine.F16, engine.BF16} {
		b, err := dev.Malloc(3000, ty)
		if err != nil {
			t.Fatal(err)
		}
		dev.Fill(b, 1.5)
		got := make([]float32, 2000)
		dev.DownloadAsync(got[:1000], b.Slice(0, 1000))
		dev.Fill(b.Slice(1000, 3000), -2) // queued after the first copy was
		dev.DownloadAsync(got[1000:], b.Slice(1000, 2000))
		if err := dev.WaitDownloads(); err != nil {
			t.Fatal(err)
		}
		if got[0] != 1.5 || got[999] != 1.5 || got[1000] != -2 || got[1999] != -2 {
			t.Fatalf("%v: got %v %v %v %v", ty, got[0], got[999], got[1000], got[1999])
		}
		dev.Release(b)
	}
}
