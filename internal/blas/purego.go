//go:build !cgo || cuda

package blas

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Use keeps gonum's pure-Go BLAS (no cgo in this build, or a -tags cuda build, which has no
// gorgonia engine to hand OpenBLAS to) and returns its name.
func Use() string { return "gonum (pure Go)" }

// SetThreads is a no-op: gonum's BLAS sizes its own parallelism.
func SetThreads(n int) {}

// Threads reports 0: not configurable without OpenBLAS.
func Threads() int { return 0 }

// selected is the Level-3 implementation in use (for benchmarks).
func selected() blas.Float32Level3 { return gonum.Implementation{} }
