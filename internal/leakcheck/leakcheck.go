// Package leakcheck is a test helper: it fails a test whose goroutines outlive it, the way
// grpc-go's grpctest does, so every package that starts servers and workers can prove each
// goroutine has an owner that stops it.
package leakcheck

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// Check records the running goroutines and registers a cleanup that fails t if goroutines
// started since are still running 5 s after t's other cleanups. Call it first in a test, so
// its cleanup runs last. ignore, if not nil, exempts goroutines by their stack (timers of
// libraries that are not ours to stop, the testing package's own).
func Check(t testing.TB, ignore func(stack string) bool) {
	t.Helper()
	before := Goroutines()
	t.Cleanup(func() {
		deadline := time.Now().Add(grace)
		for {
			var extra []string
			for id, stack := range Goroutines() {
				if _, ok := before[id]; !ok && (ignore == nil || !ignore(stack)) {
					extra = append(extra, stack)
				}
			}
			if len(extra) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%d goroutines leaked:\n\n%s", len(extra), strings.Join(extra, "\n\n"))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// grace is how long goroutines get to finish after the test's cleanups.
var grace = 5 * time.Second

// Goroutines returns the stack of every goroutine, keyed by goroutine id.
func Goroutines() map[string]string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := make(map[string]string)
	for _, g := range strings.Split(string(buf), "\n\n") {
		head, _, _ := strings.Cut(g, "\n")
		fields := strings.Fields(head) // "goroutine", id, "[state]:"
		if len(fields) >= 2 && fields[0] == "goroutine" {
			out[fields[1]] = g
		}
	}
	return out
}
