package collective_test

import (
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

// testConfig is the Ring config of the tests: pieces of 16 KiB, so the suite's largest
// buffers span hundreds of pieces and small ones still split at the larger lengths.
func testConfig(timeout time.Duration) collective.Config {
	return collective.Config{Transport: "inproc", Timeout: timeout, ChunkBytes: 16 << 10}
}

// inprocGroup makes a group of Rings over NewInproc and returns them with the network.
func inprocGroup(t testing.TB, size int, cfg collective.Config) ([]*collective.Ring, *collective.InprocNet, []collective.Transport) {
	t.Helper()
	net, ts := collective.NewInproc(size, 1)
	rings := make([]*collective.Ring, size)
	for r := range size {
		ring, err := collective.NewRing(ts[r], cfg)
		if err != nil {
			t.Fatalf("NewRing(rank %d): %v", r, err)
		}
		rings[r] = ring
	}
	t.Cleanup(func() {
		for r := range size {
			rings[r].Close()
			ts[r].Close()
		}
	})
	return rings, net, ts
}

func inprocFactory(cfg collective.Config) collectivetest.Factory {
	return func(t *testing.T, size int) ([]collective.Communicator, func(int)) {
		rings, net, _ := inprocGroup(t, size, cfg)
		comms := make([]collective.Communicator, size)
		for r, ring := range rings {
			comms[r] = ring
		}
		return comms, net.Kill
	}
}

func TestConformance(t *testing.T) {
	collectivetest.Run(t, inprocFactory(testConfig(10*time.Second)))
}

func TestConformanceFaults(t *testing.T) {
	const timeout = 300 * time.Millisecond
	collectivetest.RunFaults(t, inprocFactory(testConfig(timeout)), timeout)
}
