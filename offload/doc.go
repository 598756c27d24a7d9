// Package offload is where qvd's host-side work runs: the worker Pool that steps the
// optimizers (package optim) and the trainer's flat-buffer passes (gradient norm, gradient
// scaling) in parallel on the CPU, and the Stream that moves gradients to the host and
// parameters back when ZeRO-Offload keeps the optimizer in host memory. It is a leaf of
// docs/architecture.md: it must not import any qvd package outside internal/.
//
// Pool.Run, SumSquares and Scale do not allocate and start no goroutines: each Pool owns
// Threads()-1 persistent workers that receive pre-sized tasks over per-worker channels while
// the calling goroutine works on the first piece itself. Pool methods are safe for concurrent
// use: they take turns. A Ranger passed to Pool.Run must not call back into the same Pool.
// Close stops the workers and is safe to call twice.
package offload
