// Package enginetest is the conformance suite of engine.Device, run by every backend as
// gonum's testblas is by every BLAS: exported functions that take a *testing.T and a
// constructor of fresh devices (TestDevice runs them all).
// It must not import trainer, configs, job or cmd (docs/architecture.md): the trainer drives
// the engine through its own interfaces.
//
// Each operation is checked against a float64 computation of its definition from the values
// the device actually holds (inputs already rounded to their types), with tolerances derived
// from the Device contract — compute and accumulate in fp32, round once when storing: an
// element that sums K terms may be off by (K+2)·2⁻²⁴ times the sum of the terms' magnitudes,
// and a half-precision result by one more unit in the last place of its type. Operations that
// do no arithmetic (copies, transposes, unfoldings, max-pool, ReLU) must be exact. Every
// buffer the suite allocates is a view with guard zones on both sides that are checked after
// each test, and the randomness is seeded from the test's name, so a failure reproduces.
//
// TestBitIdentical compares several devices (the CPU backend at different thread counts) bit
// for bit on shapes large enough that the parallel passes split. TestLayerGradients (not in
// cuda builds, which exclude gorgonia) checks each layer kind's forward and backward against
// gorgonia's symbolic differentiation and central finite differences.
//
// The package is imported by tests only.
package enginetest
