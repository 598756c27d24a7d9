//go:build linux

package shmnet

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/tcpnet"
)

// BenchmarkAllReduce: 64 MiB of fp32 reduced by a collective.Ring (default 512 KiB pieces)
// over this transport, N ranks in one process, reported as nccl-tests does: algbw is the
// buffer's bytes over the time of one call, busbw = algbw × 2(N-1)/N. The tcp case runs the
// same Ring over tcpnet on loopback, for comparison in the same window. Run with
//
//	go test -run '^$' -bench . -benchtime 5x ./collective/shmnet
//
// Figures: see the package report in doc.go.
func BenchmarkAllReduce(b *testing.B) {
	const bytes = 64 << 20
	for _, n := range []int{2, 4} {
		b.Run(fmt.Sprintf("shm/N=%d", n), func(b *testing.B) {
			g := newGroup(b, n, DefaultConfig())
			ts := make([]collective.Transport, n)
			for r, tr := range g.ts {
				ts[r] = tr
			}
			benchAllReduce(b, ts, bytes)
		})
		b.Run(fmt.Sprintf("tcp/N=%d", n), func(b *testing.B) {
			benchAllReduce(b, tcpGroup(b, n), bytes)
		})
	}
}

// BenchmarkSpin compares spin windows and ring sizes at N=2 and N=4.
func BenchmarkSpin(b *testing.B) {
	const bytes = 64 << 20
	for _, n := range []int{2, 4} {
		for _, ring := range []int{1 << 20, 4 << 20} {
			for _, spin := range []time.Duration{0, 10 * time.Microsecond, 50 * time.Microsecond, 200 * time.Microsecond} {
				b.Run(fmt.Sprintf("N=%d/ring=%dMiB/spin=%v", n, ring>>20, spin), func(b *testing.B) {
					cfg := DefaultConfig()
					cfg.RingBytes, cfg.Spin = ring, spin
					g := newGroup(b, n, cfg)
					ts := make([]collective.Transport, n)
					for r, tr := range g.ts {
						ts[r] = tr
					}
					benchAllReduce(b, ts, bytes)
				})
			}
		}
	}
}

func benchAllReduce(b *testing.B, ts []collective.Transport, bytes int) {
	n := len(ts)
	rcfg := collective.DefaultConfig()
	rcfg.Transport, rcfg.Timeout = "tcp", time.Minute
	rings := make([]*collective.Ring, n)
	for r, tr := range ts {
		ring, err := collective.NewRing(tr, rcfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = ring.Close() })
		rings[r] = ring
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bufs := make([][]float32, n)
	for r := range bufs {
		bufs[r] = make([]float32, bytes/4)
		for i := range bufs[r] {
			bufs[r][i] = float32(i % 7)
		}
	}
	run := func() {
		if err := onAll(n, func(r int) error {
			// Avg keeps the values, and so the work, the same from call to call.
			return rings[r].AllReduce(ctx, bufs[r], collective.Avg, collective.Call{})
		}); err != nil {
			b.Fatal(err)
		}
	}
	run() // touch the rings and warm the pools
	b.SetBytes(int64(bytes))
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for b.Loop() {
		run()
	}
	b.StopTimer()
	// CPU per call is the figure that survives other jobs on a shared machine.
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(time.Millisecond)/float64(b.N), "cpu_ms/op")
	algbw := float64(bytes) * float64(b.N) / b.Elapsed().Seconds() / 1e9
	b.ReportMetric(algbw, "algbw_GB/s")
	b.ReportMetric(algbw*2*float64(n-1)/float64(n), "GB/s")
}

// cpuTime is this process's user and system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// tcpGroup is n tcpnet transports on loopback with their ring links connected.
func tcpGroup(b *testing.B, n int) []collective.Transport {
	lns := make([]*tcpnet.Listener, n)
	addrs := make([]string, n)
	for r := range lns {
		l, err := tcpnet.ListenWith("127.0.0.1:0", tcpnet.DefaultConfig(), zap.NewNop())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = l.Close() })
		lns[r], addrs[r] = l, l.Addr()
	}
	secret := newSecret(b)
	ts := make([]collective.Transport, n)
	for r := range ts {
		tr, err := lns[r].Transport(context.Background(), tcpnet.Group{Job: "bench", Rank: r, Addrs: addrs, Secret: secret})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = tr.Close() })
		ts[r] = tr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := onAll(n, func(r int) error {
		return ts[r].(tcpnet.Connector).Connect(ctx, (r+1)%n)
	}); err != nil {
		b.Fatal(err)
	}
	return ts
}
