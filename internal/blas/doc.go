// Package blas selects the BLAS that gorgonia's tensor operations use.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// With cgo (the default build) it routes float32/float64 GEMM and friends to OpenBLAS through
// gonum's netlib bindings: on the 2-core development machine a 1024³ float32 matmul runs at
// ~115–180 GFLOP/s there against ~9–25 GFLOP/s for gonum's pure-Go kernels, and the MLP
// training step gets about 2× faster. Without cgo it leaves gonum's pure-Go BLAS in place.
//
// Use is idempotent and safe to call from several goroutines; it changes process-wide state
// in gorgonia and tensor, which is why the model package calls it once rather than init().
package blas
