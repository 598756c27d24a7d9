//go:build cgo && !cuda

package blas

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

// selected is the Level-3 implementation Use installs (for benchmarks).
func selected() blas.Float32Level3 { return netlib.Implementation{} }
