//go:build !cgo

package blas

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Use keeps gonum's pure-Go BLAS (no cgo in this build) and returns its name.
func Use() string { return "gonum (pure Go)" }

// SetThreads is a no-op: gonum's BLAS sizes its own parallelism.
func SetThreads(n int) {}

// Threads reports 0: not configurable without OpenBLAS.
func Threads() int { return 0 }

// selected is the Level-3 implementation in use (for benchmarks).
func selected() blas.Float32Level3 { return gonum.Implementation{} }

// CoreName is empty: there is no OpenBLAS in this build.
func CoreName() string { return "" }

// SelectCore does nothing without OpenBLAS.
func SelectCore() string { return "" }
