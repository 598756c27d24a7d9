package offload

import (
	"fmt"
	"testing"
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
func benchStep(b *testing.B, cfg Config, bytesPerParam int64) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			o, err := New(cfg, sz.n)
			if err != nil {
				b.Fatal(err)
			}
			defer o.Close()
			p, g := make([]float32, sz.n), make([]float32, sz.n)
			fill(p, 1)
			fill(g, 1e-3)
			// One step outside the timing faults in the freshly allocated state pages, a cost
			// paid once per run, not per step.
			o.Step(p, g, 1e-3, 1)
			b.SetBytes(bytesPerParam * int64(sz.n))
			steps := 0
			for b.Loop() {
				o.Step(p, g, 1e-3, 1)
				steps++
			}
			b.ReportMetric(float64(sz.n)*float64(steps)/b.Elapsed().Seconds(), "params/s")
		})
	}
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
			p := NewPool(0)
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
		p := NewPool(0)
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
