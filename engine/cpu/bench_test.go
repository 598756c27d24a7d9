package cpu

import (
	"fmt"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
)

// BenchmarkTrainStep measures one micro-batch's forward and backward pass of the shipped
// Fashion-MNIST models on the CPU backend, the gradient written into a full buffer (the
// optimizer is benchmarked in offload), in samples/s.
func BenchmarkTrainStep(b *testing.B) {
	for _, m := range []struct {
		name string
		cfg  model.Config
	}{
		{"mlp-784-256-128-10", model.Config{Type: model.TypeMLP, Hidden: []int{256, 128}}},
		{"cnn-16-32-128", model.Config{Type: model.TypeCNN, Channels: []int{16, 32}, Kernel: 3, Hidden: []int{128}}},
		{"mlp-784-4096x3-10", model.Config{Type: model.TypeMLP, Hidden: []int{4096, 4096, 4096}}},
	} {
		for _, f := range []half.Format{half.FP32, half.BF16} {
			micro := 64
			b.Run(fmt.Sprintf("%s/micro%d/%s", m.name, micro, f), func(b *testing.B) {
				spec, err := model.NewSpec(m.cfg, []int{1, 28, 28}, 10)
				if err != nil {
					b.Fatal(err)
				}
				layout := model.NewLayout(spec)
				params := make([]float32, layout.Size)
				model.Init(spec, layout, params, 1)
				dev := New(Options{})
				defer dev.Close()
				alloc := engine.NewAllocator(dev)
				defer alloc.Close()
				net, err := engine.NewNet(alloc, spec, layout, params, engine.Options{MicroBatch: micro, EvalBatch: micro, Precision: f})
				if err != nil {
					b.Fatal(err)
				}
				defer net.Close()
				batch := data.NewBatch(micro, 784)
				batch.N = micro
				for i := range batch.X {
					batch.X[i] = float32(i%13) / 13
				}
				for i := range batch.Y[:micro] {
					batch.Y[i] = int32(i % 10)
				}
				sink := model.FlatSink(make([]float32, layout.Trainable()))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if _, err := net.ForwardBackward(batch, 1, sink); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(micro*b.N)/b.Elapsed().Seconds(), "samples/s")
			})
		}
	}
}
