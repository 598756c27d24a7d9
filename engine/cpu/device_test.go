package cpu_test

import (
	"fmt"
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cpu"
	"github.com/qvd/qvd/engine/enginetest"
)

// threads returns a constructor of CPU devices with their own pool of n goroutines.
func threads(n int) enginetest.NewDevice {
	return func() engine.Device { return cpu.New(cpu.Options{Threads: n}) }
}

// The CPU backend passes the conformance suite with one thread and with several (three on a
// two-core machine too: the pool's goroutines need not have a core each).
func TestConformance(t *testing.T) {
	for _, n := range []int{1, 2, 3} {
		t.Run(fmt.Sprintf("threads=%d", n), func(t *testing.T) { enginetest.TestDevice(t, threads(n)) })
	}
}

// Results do not depend on the number of threads (see the package documentation).
func TestBitIdenticalAcrossThreads(t *testing.T) {
	enginetest.TestBitIdentical(t, threads(1), threads(2), threads(3))
}
