//go:build cgo && cuda

package blas

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Use is a no-op in a -tags cuda build, which has no gorgonia engine to hand OpenBLAS to; the
// CPU backend calls OpenBLAS itself.
func Use() string { return "openblas (CPU backend only)" }

// selected is the Level-3 implementation in use (for benchmarks).
func selected() blas.Float32Level3 { return gonum.Implementation{} }
