package tcpnet

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// BenchmarkStream measures one connection, one way: 64 MiB per op in 512 KiB frames over
// loopback, the receiver reading each payload straight into its buffer. The sub-benchmarks
// compare socket buffer settings (Config.SocketBuffer; 0 = kernel autotuning).
//
// Measured 2026-11-22 on the shared 2-core machine (Go 1.26.8; other engineers' jobs running
// much of the time, so ranges): autotuning 4.3–4.5 GB/s when the machine was quiet (2.4–4.8
// under load), about 22 ms of CPU per 64 MiB. Fixed buffers of 1 MiB or 4 MiB were no better
// (4 MiB often worse), nor were 128–512 KiB in the all-reduce, hence the default of 0. For
// comparison, the same machine measured 3.1–3.4 GB/s for a plain net.TCPConn stream in 1 MiB
// writes and 2.0–2.25 GB/s for gRPC's best codec (encoding.CodecV2), one stream, one way.
func BenchmarkStream(b *testing.B) {
	const total, frame = 64 << 20, 512 << 10
	for _, sockBuf := range []int{0, 1 << 20, 4 << 20} {
		name := "sockbuf=auto"
		if sockBuf > 0 {
			name = fmt.Sprintf("sockbuf=%dKiB", sockBuf>>10)
		}
		b.Run(name, func(b *testing.B) {
			cfg := DefaultConfig()
			cfg.SocketBuffer = sockBuf
			c := newCluster(b, 2, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			payload := make([]byte, frame)
			h := dataHeader(0, frame)
			// Connect before timing.
			if err := c.ts[0].Send(ctx, 1, h, payload); err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, frame)
			if _, _, err := c.ts[1].Recv(ctx, 0, buf); err != nil {
				b.Fatal(err)
			}
			frames := b.N * (total / frame)
			done := make(chan error, 1)
			b.SetBytes(total)
			b.ResetTimer()
			cpu0 := cpuTime()
			go func() {
				for i := 0; i < frames; i++ {
					if _, _, err := c.ts[1].Recv(ctx, 0, buf); err != nil {
						done <- err
						return
					}
				}
				done <- nil
			}()
			for i := 0; i < frames; i++ {
				if err := c.ts[0].Send(ctx, 1, h, payload); err != nil {
					b.Fatal(err)
				}
			}
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(time.Millisecond)/float64(b.N), "cpu_ms/op")
			b.ReportMetric(float64(total)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
