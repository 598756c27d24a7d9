// Package collectivetest is the conformance suite for collective.Communicator: one set of
// tests that every implementation must pass — the ring over the in-process transport, over
// gRPC streams and raw TCP, and NCCL — in the manner of gonum's testblas.
// It is imported by tests only, and must not import anything above the collective layer of
// docs/architecture.md.
//
// An implementation's test supplies a Factory that builds a connected group and calls Run for
// the functional cases (RunSizes where it can make only some group sizes), and RunFaults for
// the failure cases if it can kill a rank:
//
//	func TestConformance(t *testing.T) { collectivetest.Run(t, factory) }
//	func TestFaults(t *testing.T)      { collectivetest.RunFaults(t, factory, 500*time.Millisecond) }
//
// The suite checks results against a float64 reference computed in the test: exactly for
// fp32 (integer-valued inputs, so every order of summation gives the same bits) and for Max,
// within the rounding bound of the format for fp16 and bf16 sums, and always bit-identical on
// every rank. Inputs come from seeded generators, so a failure reproduces.
//
// For the suite to exercise pipelining, the factory should configure pieces much smaller than
// the largest buffer used here (about 3 MiB): 16 KiB or 64 KiB pieces are a good choice.
// Run takes a few seconds over the in-process transport.
package collectivetest
