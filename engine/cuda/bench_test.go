//go:build cuda

package cuda

import (
	"fmt"
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/optim"
)

// alloc allocates and fills buffers for a benchmark, releasing them when it ends.
func alloc(b *testing.B, n int, t engine.DType, v float32) engine.Buf {
	b.Helper()
	buf, err := dev.Malloc(n, t)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { dev.Release(buf) })
	dev.Fill(buf, v)
	return buf
}

// BenchmarkGemm times square row-major GEMMs (cublasGemmEx, fp32 accumulation) and reports
// TFLOP/s (2·m·n·k per GEMM). fp32 GEMMs do not use TF32.
func BenchmarkGemm(b *testing.B) {
	for _, t := range floatTypes {
		for _, n := range []int{1024, 4096, 8192} {
			b.Run(fmt.Sprintf("%v/%d", t, n), func(b *testing.B) {
				a, bb, c := alloc(b, n*n, t, 0.01), alloc(b, n*n, t, 0.02), alloc(b, n*n, t, 0)
				dev.Gemm(false, false, n, n, n, 1, a, bb, 0, c) // warm up cuBLAS's heuristics
				if err := dev.Sync(); err != nil {
					b.Fatal(err)
				}
				// A b.N loop, not b.Loop: the timer must keep running through the Sync that
				// waits for the queued GEMMs.
				b.ResetTimer()
				for range b.N {
					dev.Gemm(false, false, n, n, n, 1, a, bb, 0, c)
				}
				if err := dev.Sync(); err != nil {
					b.Fatal(err)
				}
				flops := 2 * float64(n) * float64(n) * float64(n) * float64(b.N)
				b.ReportMetric(flops/b.Elapsed().Seconds()/1e12, "TFLOP/s")
			})
		}
	}
}

// BenchmarkAdamW times the fused optimizer step over 64 Mi parameters (fp32 master weights
// and moments, gradients and working weights in the working type) and reports parameters/s.
func BenchmarkAdamW(b *testing.B) {
	const n = 64 << 20
	c := optim.AdamWConsts(optim.DefaultConfig(), 10, 1e-3, 1.0/1024)
	for _, t := range floatTypes {
		b.Run(t.String(), func(b *testing.B) {
			p, m, v := alloc(b, n, engine.F32, 0.5), alloc(b, n, engine.F32, 0.01), alloc(b, n, engine.F32, 0.001)
			g, w := alloc(b, n, t, 0.1), alloc(b, n, t, 0)
			dev.AdamW(p, m, v, g, w, c)
			if err := dev.Sync(); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				dev.AdamW(p, m, v, g, w, c)
			}
			if err := dev.Sync(); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "params/s")
			// Traffic per parameter: p, m, v read and written (24 bytes), g read, w written.
			traffic := float64(n) * float64(24+2*t.Size()) * float64(b.N)
			b.ReportMetric(traffic/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
