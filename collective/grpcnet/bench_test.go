package grpcnet

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// Figures recorded 2026-11-22 on the 2-core development machine shared with other engineers'
// builds and tests (so noisy: medians, load average in brackets), Go 1.26, grpc v1.85.0,
// every rank in one process, 127.0.0.1, default collective.Config (512 KiB pieces):
//
//	                                   lend (Send)     copy (alternative)
//	Stream, 64 MiB one way     [~1.3]  2.43 GB/s       2.00 GB/s
//	                           [~1.6]  1.54            1.19
//	AllReduce N=2 busbw        [~1.5]  0.82            0.67
//	                           [~1.6]  0.60            0.53
//	AllReduce N=4 busbw        [~1.5]  0.41            0.31
//	                           [~1.6]  0.34            0.25
//
// The profile of N=2 shows both cores busy (185%): user-space copies ~50% (gRPC's read
// buffer into its frame buffers, the payload into gRPC's write buffer, Recv's copy into the
// caller's buffer, ~15% each), syscalls ~25%, the ring's reduction ~14%.
//
//	go test -run - -bench . -benchtime 5x -count 5 ./collective/grpcnet

const (
	benchBytes = 64 << 20
	benchFrame = 512 << 10
)

// benchModes are the two ways of keeping the caller's payload safe: lending it to gRPC and
// waiting for its release (what Send does), or copying it into buffers gRPC frees.
var benchModes = []struct {
	name string
	copy bool
}{{"lend", false}, {"copy", true}}

// BenchmarkStream: one stream, one way, 64 MiB in 512 KiB frames, between two Hubs on their
// own servers over loopback TCP.
func BenchmarkStream(b *testing.B) {
	for _, mode := range benchModes {
		b.Run(mode.name, func(b *testing.B) {
			tr := group(b, "bench", secret, tcpNodes(b, defaultTuning, 2), nil)
			tr[0].copySends = mode.copy
			ctx := context.Background()
			payload := make([]byte, benchFrame)
			buf := make([]byte, benchFrame)
			// Open the stream and warm the pools before timing.
			for i := 0; i < 16; i++ {
				if err := tr[0].Send(ctx, 1, dataHeader(0, benchFrame, 1, 0), payload); err != nil {
					b.Fatal(err)
				}
				if _, _, err := tr[1].Recv(ctx, 0, buf); err != nil {
					b.Fatal(err)
				}
			}
			const frames = benchBytes / benchFrame
			b.SetBytes(benchBytes)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				errc := make(chan error, 1)
				go func() {
					for j := 0; j < frames; j++ {
						if err := tr[0].Send(ctx, 1, dataHeader(0, benchFrame, 1, uint32(j)), payload); err != nil {
							errc <- err
							return
						}
					}
					errc <- nil
				}()
				for j := 0; j < frames; j++ {
					if _, _, err := tr[1].Recv(ctx, 0, buf); err != nil {
						b.Fatal(err)
					}
				}
				if err := <-errc; err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)*benchBytes/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// BenchmarkAllReduce: collective.Ring all-reduce of 64 MiB of fp32 over this transport, every
// rank in this process with its own gRPC server, reported as nccl-tests does: algbw =
// bytes/time, busbw = algbw × 2(N-1)/N.
func BenchmarkAllReduce(b *testing.B) {
	for _, n := range []int{2, 4} {
		for _, mode := range benchModes {
			b.Run(fmt.Sprintf("N=%d/%s", n, mode.name), func(b *testing.B) {
				trs := group(b, "bench", secret, tcpNodes(b, defaultTuning, n), nil)
				cfg := collective.DefaultConfig()
				cfg.Timeout = time.Minute
				rings := make([]*collective.Ring, n)
				bufs := make([][]float32, n)
				for r, tr := range trs {
					tr.copySends = mode.copy
					ring, err := collective.NewRing(tr, cfg)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { _ = ring.Close() })
					rings[r] = ring
					bufs[r] = make([]float32, benchBytes/4)
					for i := range bufs[r] {
						bufs[r][i] = float32(r)
					}
				}
				ctx := context.Background()
				allReduce := func() {
					var wg sync.WaitGroup
					errs := make([]error, n)
					for r := range rings {
						wg.Go(func() { errs[r] = rings[r].AllReduce(ctx, bufs[r], collective.Sum, collective.Call{}) })
					}
					wg.Wait()
					for r, err := range errs {
						if err != nil {
							b.Fatalf("rank %d: %v", r, err)
						}
					}
				}
				allReduce() // open the streams
				b.SetBytes(benchBytes)
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					allReduce()
				}
				alg := float64(b.N) * benchBytes / b.Elapsed().Seconds() / 1e9
				b.ReportMetric(alg, "algbw_GB/s")
				b.ReportMetric(alg*2*float64(n-1)/float64(n), "busbw_GB/s")
			})
		}
	}
}
