//go:build cgo && !cuda

package blas

/*
#cgo LDFLAGS: -lopenblas
void openblas_set_num_threads(int);
int openblas_get_num_threads(void);
*/
import "C"

import (
	"sync"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/netlib/blas/netlib"
	"gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

var once sync.Once

// Use switches gorgonia and tensor to OpenBLAS and returns its name.
func Use() string {
	once.Do(func() {
		impl := netlib.Implementation{}
		tensor.Use(impl)
		gorgonia.Use(impl)
	})
	return "openblas"
}

// SetThreads sets the number of threads OpenBLAS uses (n >= 1).
func SetThreads(n int) {
	if n >= 1 {
		C.openblas_set_num_threads(C.int(n))
	}
}

// Threads reports OpenBLAS's thread count.
func Threads() int { return int(C.openblas_get_num_threads()) }

// selected is the Level-3 implementation Use installs (for benchmarks).
func selected() blas.Float32Level3 { return netlib.Implementation{} }
