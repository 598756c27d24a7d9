package vec

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// The benchmarks run every function at three sizes: 4K elements (the buffers fit in L1), 512K
// (L2/L3) and 16M (memory), once per implementation ("avx2", and "go", the plain Go loops the
// kernels replace; the conversions' Go loops are internal/half's). SetBytes counts the bytes
// each call reads and writes, so MB/s is memory traffic; ns/elem is per element.
//
//	go test -run '^$' -bench . ./internal/vec/
//
// Measured on a 2-core Sapphire Rapids VM shared with other work (Go 1.26, medians of 5 runs
// of 500 ms each; runs there spread by up to 30%, and up to 2x for some Go loops). GB/s is
// the SetBytes traffic:
//
//	function         size   go ns/el  go GB/s asm ns/el asm GB/s speedup
//	Add              4K        0.812     14.8     0.084    142.3    9.6x
//	Add              512K      0.819     14.7     0.383     31.3    2.1x
//	Add              16M       1.032     11.6     0.706     17.0    1.5x
//	AddScale         4K        0.953     12.6     0.102    117.1    9.3x
//	AddScale         512K      0.861     13.9     0.404     29.7    2.1x
//	AddScale         16M       1.111     10.8     0.731     16.4    1.5x
//	Scale            4K        0.925      8.6     0.078    102.3   11.8x
//	Scale            512K      0.765     10.5     0.179     44.7    4.3x
//	Scale            16M       0.893      9.0     0.490     16.3    1.8x
//	Max              4K        1.910      6.3     0.171     70.3   11.2x
//	Max              512K      6.082      2.0     0.352     34.1   17.3x
//	Max              16M       5.583      2.1     0.645     18.6    8.7x
//	SumSquares       4K        0.882      4.5     0.131     30.6    6.7x
//	SumSquares       512K      0.869      4.6     0.124     32.2    7.0x
//	SumSquares       16M       0.946      4.2     0.370     10.8    2.6x
//	EncodeF16        4K        2.000      3.0     0.085     70.6   23.5x
//	EncodeF16        512K      2.185      2.7     0.267     22.5    8.2x
//	EncodeF16        16M       1.911      3.1     0.562     10.7    3.4x
//	DecodeF16        4K        0.927      6.5     0.036    164.9   25.5x
//	DecodeF16        512K      0.827      7.3     0.286     21.0    2.9x
//	DecodeF16        16M       1.236      4.9     0.763      7.9    1.6x
//	AddDecodedF16    4K        1.384      7.2     0.075    133.1   18.4x
//	AddDecodedF16    512K      1.215      8.2     0.289     34.6    4.2x
//	AddDecodedF16    16M       1.434      7.0     0.591     16.9    2.4x
//	EncodeBF16       4K        2.544      2.4     0.244     24.6   10.4x
//	EncodeBF16       512K      2.664      2.3     0.299     20.0    8.9x
//	EncodeBF16       16M       2.647      2.3     0.622      9.7    4.3x
//	AddDecodedBF16   4K        1.838      5.4     0.131     76.4   14.0x
//	AddDecodedBF16   512K      1.582      6.3     0.331     30.2    4.8x
//	AddDecodedBF16   16M       1.642      6.1     0.692     14.5    2.4x

var benchSizes = []struct {
	name string
	n    int
}{{"4K", 4 << 10}, {"512K", 512 << 10}, {"16M", 16 << 20}}

// benchBuffers holds the largest buffers once; every size uses a prefix of them.
var benchBuffers = struct {
	a, b []float32
	h    []uint16
}{}

func buffers(n int) (a, b []float32, h []uint16) {
	bb := &benchBuffers
	if len(bb.a) < n {
		rng := rand.New(rand.NewPCG(1, 1))
		bb.a, bb.b, bb.h = make([]float32, n), make([]float32, n), make([]uint16, n)
		for i := range bb.a {
			bb.a[i] = float32(rng.NormFloat64())
			bb.b[i] = float32(rng.NormFloat64())
		}
		// Words of normal binary16 values, the common case on the wire.
		EncodeF16(bb.h, bb.b)
	}
	return bb.a[:n], bb.b[:n], bb.h[:n]
}

// benchOne runs f over every implementation and size; bytesPerElem is the traffic of one
// element.
func benchOne(b *testing.B, bytesPerElem int, f func(a, b []float32, h []uint16)) {
	for _, im := range impls {
		for _, size := range benchSizes {
			b.Run(fmt.Sprintf("%s/%s", im.name, size.name), func(b *testing.B) {
				defer use(im)()
				x, y, h := buffers(size.n)
				b.SetBytes(int64(bytesPerElem * size.n))
				b.ResetTimer()
				for b.Loop() {
					f(x, y, h)
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(size.n), "ns/elem")
			})
		}
	}
}

func BenchmarkAdd(b *testing.B) {
	benchOne(b, 12, func(x, y []float32, _ []uint16) { Add(x, y) })
}

func BenchmarkAddScale(b *testing.B) {
	// (x+y)/2 converges to y: the values stay normal, so no subnormal slow path is timed.
	benchOne(b, 12, func(x, y []float32, _ []uint16) { AddScale(x, y, 0.5) })
}

func BenchmarkScale(b *testing.B) {
	benchOne(b, 8, func(x, _ []float32, _ []uint16) { Scale(x, 1) })
}

func BenchmarkMax(b *testing.B) {
	benchOne(b, 12, func(x, y []float32, _ []uint16) { Max(x, y) })
}

var sumSink float64

func BenchmarkSumSquares(b *testing.B) {
	benchOne(b, 4, func(x, _ []float32, _ []uint16) { sumSink += SumSquares(x) })
}

func BenchmarkEncodeF16(b *testing.B) {
	w := make([]uint16, 16<<20)
	benchOne(b, 6, func(x, _ []float32, _ []uint16) { EncodeF16(w[:len(x)], x) })
}

func BenchmarkDecodeF16(b *testing.B) {
	benchOne(b, 6, func(x, _ []float32, h []uint16) { DecodeF16(x, h) })
}

func BenchmarkAddDecodedF16(b *testing.B) {
	benchOne(b, 10, func(x, _ []float32, h []uint16) { AddDecodedF16(x, h) })
}

func BenchmarkEncodeBF16(b *testing.B) {
	w := make([]uint16, 16<<20)
	benchOne(b, 6, func(x, _ []float32, _ []uint16) { EncodeBF16(w[:len(x)], x) })
}

func BenchmarkAddDecodedBF16(b *testing.B) {
	benchOne(b, 10, func(x, _ []float32, h []uint16) { AddDecodedBF16(x, h) })
}
