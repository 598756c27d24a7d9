//go:build !cuda

package model

import (
	"fmt"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

// BenchmarkTrainStep measures one micro-batch forward+backward (the bulk of a training step;
// the optimizer is benchmarked in offload) of the shipped Fashion-MNIST models, in samples/s.
func BenchmarkTrainStep(b *testing.B) {
	models := []struct {
		name string
		cfg  Config
	}{
		{"mlp-784-256-128-10", Config{Type: TypeMLP, Hidden: []int{256, 128}}},
		{"cnn-16-32-128", Config{Type: TypeCNN, Channels: []int{16, 32}, Kernel: 3, Hidden: []int{128}}},
	}
	for _, m := range models {
		for _, micro := range []int{64} {
			for _, f := range []half.Format{half.FP32, half.BF16} {
				b.Run(fmt.Sprintf("%s/micro%d/%s", m.name, micro, f), func(b *testing.B) {
					spec, err := NewSpec(m.cfg, []int{1, 28, 28}, 10)
					if err != nil {
						b.Fatal(err)
					}
					layout := NewLayout(spec)
					params := make([]float32, layout.Size)
					Init(spec, layout, params, 1)
					net, err := New(spec, layout, params, Options{MicroBatch: micro, EvalBatch: micro, Grad: f})
					if err != nil {
						b.Fatal(err)
					}
					defer net.Close()
					batch := randomBatch(micro, 784, 10, 1)
					grads := make([]float32, layout.Size)
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						if _, err := net.ForwardBackward(batch, 1, FlatSink(grads)); err != nil {
							b.Fatal(err)
						}
					}
					b.ReportMetric(float64(micro*b.N)/b.Elapsed().Seconds(), "samples/s")
				})
			}
		}
	}
}
