package optim

import (
	"fmt"
	"syscall"
	"testing"

	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/offload"
)

// fill writes a cheap deterministic pattern: random numbers would take longer to generate than
// the benchmark takes to run, and the kernels' speed does not depend on the values.
func fill(x []float32, scale float32) {
	for i := range x {
		x[i] = scale * float32(int(i%1997)-998) / 998
	}
}

var benchSizes = []struct {
	name string
	n    int
}{{"16M", 16 << 20}, {"64M", 64 << 20}}

// benchStep reports the memory traffic of one Step (bytesPerParam: Adam and AdamW read p, g, m,
// v and write p, m, v, 7×4 bytes; SGD with momentum reads p, g, buf and writes p, buf, 5×4).
// The optimizer's state is in arena blocks, as New maps it; p and g are in arena blocks too
// (pg=arena, where the trainer keeps parameters and gradients) or on the Go heap (pg=heap).
// Besides params/s it reports the minor page faults per step of the timed loop, which should
// be 0: on the VMs these figures come from, the first touch of a page costs 9 µs or more per
// 4 KiB, some 100 times what streaming the page through a step costs (see the note at the end).
func benchStep(b *testing.B, cfg Config, bytesPerParam int64) {
	for _, sz := range benchSizes {
		for _, pg := range []string{"arena", "heap"} {
			b.Run(sz.name+"/pg="+pg, func(b *testing.B) {
				o, err := New(cfg, sz.n)
				if err != nil {
					b.Fatal(err)
				}
				defer o.Close()
				p, g := benchBuffers(b, sz.n, pg == "arena")
				// One step outside the timing faults in the freshly mapped state pages, a cost
				// paid once per run, not per step.
				o.Step(p, g, 1e-3, 1)
				b.SetBytes(bytesPerParam * int64(sz.n))
				steps, faults := 0, minorFaults()
				for b.Loop() {
					o.Step(p, g, 1e-3, 1)
					steps++
				}
				b.ReportMetric(float64(minorFaults()-faults)/float64(steps), "faults/op")
				b.ReportMetric(float64(sz.n)*float64(steps)/b.Elapsed().Seconds(), "params/s")
			})
		}
	}
}

// benchBuffers returns parameters and gradients of n elements, filled, in arena blocks freed
// when tb ends, or on the Go heap.
func benchBuffers(tb testing.TB, n int, inArena bool) (p, g []float32) {
	if inArena {
		pb, pp, err := arena.Float32s(n, arena.Params)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(pb.Free)
		gb, gg, err := arena.Float32s(n, arena.Grads)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(gb.Free)
		p, g = pp, gg
	} else {
		p, g = make([]float32, n), make([]float32, n)
	}
	fill(p, 1)
	fill(g, 1e-3)
	return p, g
}

// minorFaults is the process's count of minor page faults so far.
func minorFaults() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Minflt
}

func BenchmarkAdamW(b *testing.B) { benchStep(b, DefaultConfig(), 28) }

// BenchmarkAdamW8bit: p and g are read and p written as in AdamW, but each moment is one byte
// read and one written (the per-block scales add 1/64 of that), 16 bytes per parameter.
func BenchmarkAdamW8bit(b *testing.B) {
	c := DefaultConfig()
	c.Type = TypeAdamW8bit
	benchStep(b, c, 16)
}

func BenchmarkAdam(b *testing.B) {
	c := DefaultConfig()
	c.Type = TypeAdam // with L2 weight decay 0.01
	benchStep(b, c, 28)
}

func BenchmarkSGD(b *testing.B) {
	c := DefaultConfig()
	c.Type = TypeSGD // momentum 0.9, L2 weight decay 0.01
	benchStep(b, c, 20)
}

func BenchmarkSumSquares(b *testing.B) {
	for _, n := range []int{64 << 20} {
		b.Run(fmt.Sprintf("%dM", n>>20), func(b *testing.B) {
			p := offload.NewPool(0)
			defer p.Close()
			x := make([]float32, n)
			fill(x, 1)
			b.SetBytes(4 * int64(n))
			calls := 0
			for b.Loop() {
				p.SumSquares(x)
				calls++
			}
			b.ReportMetric(float64(n)*float64(calls)/b.Elapsed().Seconds(), "elems/s")
		})
	}
}

func BenchmarkScale(b *testing.B) {
	const n = 64 << 20
	b.Run("64M", func(b *testing.B) {
		p := offload.NewPool(0)
		defer p.Close()
		x := make([]float32, n)
		fill(x, 1)
		b.SetBytes(8 * n) // read and write
		calls := 0
		for b.Loop() {
			p.Scale(x, 1)
			calls++
		}
		b.ReportMetric(float64(n)*float64(calls)/b.Elapsed().Seconds(), "elems/s")
	})
}

// Note on the 64M "cliff" (the Go step at a quarter of bench/adamw.c's speed at 64M but not at
// 16M, reported on a 2-vCPU AMD EPYC VM). On another VM of that kind (Firecracker, a
// shadow-paging PVM guest, THP "madvise", free pages reported to the host in 8 MiB blocks) it
// did not reproduce, with the state on the Go heap or in the arena, under THP always, madvise
// or never, GOGC=off or 10, GOMEMLIMIT below the live heap, GODEBUG=madvdontneed=0 or
// asyncpreemptoff=1. What was measured there:
//
//   - The timed loop touches no new memory: 0 faults/op. Over whole runs of 20 and of 100 steps
//     (perf stat tracepoints) page faults stay at 263,060, munmap at 0, madvise goes from 14 to
//     20 and TLB flushes from 35 to 47; no GC runs during the loop (gctrace). The Pool's two
//     pieces of a 64M step take 41 and 39 ms (median),
//     and handing them out and joining adds under a millisecond; their boundaries are
//     multiples of DefaultGrain, so the threads share no cache line.
//   - What does scale with size is first touch: 9-18 µs per 4 KiB page (2.4-4.8 s per GiB, the
//     time of 50 to 200 steps at 64M), 3.5-9 µs per 4 KiB with MADV_HUGEPAGE. Since Go
//     1.21.4 the runtime advises none of its heap, so under THP "madvise" a 64M Adam's state
//     and buffers on the Go heap take 262,000 faults, in the arena 1,100.
//   - The same binary's steady speed swings from 0.5 to 3.5 G params/s between consecutive runs
//     (the host's memory bandwidth, other jobs on the two vCPUs), C's as much: a one-off Go run
//     against a few C runs can show a 4-6x gap either way. Hence compare-adamw.sh's interleaved
//     rounds and per-round ratios.
