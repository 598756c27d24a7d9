// Package leakcheck is a test helper: it fails a test whose goroutines outlive it, the way
// grpc-go's grpctest does, so every package that starts servers and workers can prove each
// goroutine has an owner that stops it.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// Finding and filtering goroutines is go.uber.org/goleak's. This package adds only what
// goleak v1.3.0 cannot be told: how long to wait. goleak.Find gives up after about 0.4 s
// (20 retries, backoff capped at 100 ms, neither exported), and our transports close
// connections and drain workers asynchronously, which on a loaded CI machine takes longer;
// Check keeps asking goleak until grace has passed.
package leakcheck

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Check records the running goroutines and registers a cleanup that fails t if goroutines
// started since are still running grace after t's other cleanups. Call it first in a test,
// so its cleanup runs last. ignore exempts goroutines that are not ours to stop, such as a
// library's timer callbacks (goleak.IgnoreAnyFunction).
func Check(t testing.TB, ignore ...goleak.Option) {
	t.Helper()
	opts := append([]goleak.Option{goleak.IgnoreCurrent()}, ignore...)
	t.Cleanup(func() {
		deadline := time.Now().Add(grace)
		for {
			err := goleak.Find(opts...)
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("goroutines leaked: %v", err)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// grace is how long goroutines get to finish after the test's cleanups.
var grace = 5 * time.Second
