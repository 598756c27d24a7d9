package collective_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
)

// BenchmarkRingAllReduce measures the ring all-reduce over the in-process transport with the
// default 512 KiB pieces, reporting bandwidth as nccl-tests does: algbw is the buffer's fp32
// bytes over the time of one call, busbw = algbw × 2(N-1)/N, the rate each rank's link
// carries (so it is comparable across group sizes). The op is Avg so repeated calls keep the
// values, and the work, the same.
func BenchmarkRingAllReduce(b *testing.B) {
	for _, n := range []int{2, 4} {
		for _, wire := range []half.Format{half.FP32, half.FP16} {
			for _, size := range []int{1 << 20, 64 << 20} {
				b.Run(fmt.Sprintf("N=%d/%v/%dMiB", n, wire, size>>20), func(b *testing.B) {
					cfg := collective.DefaultConfig()
					cfg.Transport, cfg.Timeout = "inproc", time.Minute
					rings, _, _ := inprocGroup(b, n, cfg)
					w := startWorkers(rings, size/4, collective.Avg, collective.Call{Wire: wire})
					defer w.stop()
					w.round()
					b.SetBytes(int64(size))
					b.ReportAllocs()
					b.ResetTimer()
					for b.Loop() {
						w.round()
					}
					b.StopTimer()
					if err := w.err(); err != nil {
						b.Fatal(err)
					}
					sec := b.Elapsed().Seconds() / float64(b.N)
					algbw := float64(size) / sec / 1e9
					b.ReportMetric(algbw, "algbw_GB/s")
					b.ReportMetric(algbw*2*float64(n-1)/float64(n), "busbw_GB/s")
				})
			}
		}
	}
}
