//go:build !cuda

package model

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

// BenchmarkCheckpointing measures a micro-batch forward+backward of the shipped Fashion-MNIST
// models without and with activation checkpointing: step time (ns/op, samples/s) and the
// step's live heap (after a forced GC) over the heap before the Net was built —
//
//	peak-MiB: the largest, sampled after every graph run while its values are still bound,
//	  which is when a run's activations and their gradients are all live;
//	retained-MiB: what stays live between steps (gorgonia keeps a graph's last values).
//
// Both include what does not depend on the batch (graph structures, the parameter gradients
// held in gorgonia's dual values); compare two batch sizes for the per-sample slope.
func BenchmarkCheckpointing(b *testing.B) {
	models := []struct {
		name   string
		cfg    Config
		micros []int
	}{
		{"mlp-784-256-128-10", Config{Type: TypeMLP, Hidden: []int{256, 128}}, []int{64, 256}},
		{"cnn-16-32-128", Config{Type: TypeCNN, Channels: []int{16, 32}, Kernel: 3, Hidden: []int{128}}, []int{64, 256}},
	}
	for _, m := range models {
		for _, micro := range m.micros {
			for _, k := range []int{0, 2, 3} {
				b.Run(fmt.Sprintf("%s/micro%d/segments%d", m.name, micro, k), func(b *testing.B) {
					spec, err := NewSpec(m.cfg, []int{1, 28, 28}, 10)
					if err != nil {
						b.Fatal(err)
					}
					layout := NewLayout(spec)
					params := make([]float32, layout.Size)
					Init(spec, layout, params, 1)
					batch := randomBatch(micro, 784, 10, 1)
					grads := make([]float32, layout.Size)
					base := liveHeap()
					net, err := New(spec, layout, params, Options{MicroBatch: micro, EvalBatch: 1, Grad: half.FP32, Segments: k})
					if err != nil {
						b.Fatal(err)
					}
					defer net.Close()
					var peak uint64
					testHookAfterRun = func() { peak = max(peak, liveHeap()) }
					for i := 0; i < 2; i++ { // the first step allocates the gradients' dual values
						if _, err := net.ForwardBackward(batch, 1, FlatSink(grads)); err != nil {
							b.Fatal(err)
						}
					}
					testHookAfterRun = nil
					retained := liveHeap()
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						if _, err := net.ForwardBackward(batch, 1, FlatSink(grads)); err != nil {
							b.Fatal(err)
						}
					}
					b.StopTimer()
					const mib = 1 << 20
					b.ReportMetric(float64(peak-base)/mib, "peak-MiB")
					b.ReportMetric(float64(retained-base)/mib, "retained-MiB")
					b.ReportMetric(float64(micro*b.N)/b.Elapsed().Seconds(), "samples/s")
				})
			}
		}
	}
}

func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
