package blas

import (
	"testing"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
	"gorgonia.org/tensor"
)

// TestUseRoutesMatMul checks that after Use, tensor's matrix product still computes the
// right answer (whichever BLAS serves it).
func TestUseRoutesMatMul(t *testing.T) {
	t.Logf("BLAS: %s", Use())
	a := tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]float32{1, 2, 3, 4, 5, 6}))
	b := tensor.New(tensor.WithShape(3, 2), tensor.WithBacking([]float32{7, 8, 9, 10, 11, 12}))
	c, err := tensor.MatMul(a, b)
	if err != nil {
		t.Fatal(err)
	}
	want := []float32{58, 64, 139, 154}
	for i, v := range c.Data().([]float32) {
		if v != want[i] {
			t.Fatalf("matmul[%d] = %v, want %v", i, v, want[i])
		}
	}
}

// BenchmarkSgemm1024 compares a 1024³ float32 matrix product on gonum's pure-Go BLAS and on
// the BLAS Use selects (OpenBLAS with cgo), in GFLOP/s.
func BenchmarkSgemm1024(b *testing.B) {
	const n = 1024
	x := make([]float32, n*n)
	y := make([]float32, n*n)
	z := make([]float32, n*n)
	for i := range x {
		x[i], y[i] = float32(i%7)/7, float32(i%5)/5
	}
	impls := map[string]blas.Float32Level3{"gonum": gonum.Implementation{}}
	Use()
	impls["selected"] = selected()
	for name, impl := range impls {
		b.Run(name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				impl.Sgemm(blas.NoTrans, blas.NoTrans, n, n, n, 1, x, n, y, n, 0, z, n)
			}
			b.ReportMetric(2*n*n*n*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}
