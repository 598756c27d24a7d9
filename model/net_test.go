//go:build !cuda

package model

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
)

// tinyNet builds a small network over 1×8×8 inputs with 4 classes.
func tinyNet(t *testing.T, cfg Config, micro int, f half.Format) (*Net, []float32) {
	t.Helper()
	spec, err := NewSpec(cfg, []int{1, 8, 8}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := NewLayout(spec)
	params := make([]float32, layout.Size)
	Init(spec, layout, params, 7)
	net, err := New(spec, layout, params, Options{MicroBatch: micro, EvalBatch: micro, Grad: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { net.Close() })
	return net, params
}

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

// TestGradientFiniteDifference checks gorgonia's symbolic gradients (through the flat
// buffer views) against central differences of the evaluation graph's loss, computed in
// float64 from the logits.
func TestGradientFiniteDifference(t *testing.T) {
	for _, cfg := range []Config{
		{Type: TypeMLP, Hidden: []int{16, 8}},
		{Type: TypeCNN, Channels: []int{3, 4}, Kernel: 3, Hidden: []int{8}},
	} {
		t.Run(cfg.Type, func(t *testing.T) {
			const micro = 6
			net, params := tinyNet(t, cfg, micro, half.FP32)
			b := randomBatch(micro, 64, 4, 3)
			grads := make([]float32, len(params))
			if _, err := net.ForwardBackward(b, 1, FlatSink(grads)); err != nil {
				t.Fatal(err)
			}
			meanLoss := func() float64 {
				r, err := net.Evaluate(b)
				if err != nil {
					t.Fatal(err)
				}
				return r.LossSum / float64(r.N)
			}
			rng := rand.New(rand.NewPCG(9, 9))
			checked := 0
			for _, ts := range net.Layout().Tensors {
				for k := 0; k < 6; k++ {
					i := ts.Offset + rng.IntN(ts.Size)
					const h = 3e-3
					orig := params[i]
					params[i] = orig + h
					up := meanLoss()
					params[i] = orig - h
					down := meanLoss()
					params[i] = orig
					fd := (up - down) / (2 * h)
					g := float64(grads[i])
					if math.Abs(fd-g) > 2e-3+0.05*math.Abs(fd) {
						t.Errorf("%s[%d]: analytic %.6g, finite difference %.6g", ts.Name, i-ts.Offset, g, fd)
					}
					checked++
				}
			}
			if checked == 0 {
				t.Fatal("nothing checked")
			}
		})
	}
}

// TestForwardBackwardIndependentCalls guards against gorgonia's dual values accumulating
// across runs: the same batch twice must add the same gradient twice.
func TestForwardBackwardIndependentCalls(t *testing.T) {
	net, params := tinyNet(t, Config{Type: TypeMLP, Hidden: []int{16}}, 4, half.FP32)
	b := randomBatch(4, 64, 4, 5)
	once := make([]float32, len(params))
	if _, err := net.ForwardBackward(b, 1, FlatSink(once)); err != nil {
		t.Fatal(err)
	}
	twice := make([]float32, len(params))
	for i := 0; i < 3; i++ {
		clear(twice)
		if _, err := net.ForwardBackward(b, 1, FlatSink(twice)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range once {
		if once[i] != twice[i] {
			t.Fatalf("gradient %d differs between calls: %v vs %v", i, once[i], twice[i])
		}
	}
}
