//go:build linux

package shmnet

import (
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

// ringFactory builds groups of Rings over shmnet, the ranks as fake processes of this one.
// kill(r) does what SIGKILL does to rank r as its peers see it: its rings stop, without the
// closed flags a graceful Close sets, and its descriptors close, so the peers must notice the
// death through the segment lock.
func ringFactory(cfg collective.Config, tcfg Config) collectivetest.Factory {
	return func(t *testing.T, size int) ([]collective.Communicator, func(int)) {
		g := newGroup(t, size, tcfg)
		comms := make([]collective.Communicator, size)
		for r, tr := range g.ts {
			ring, err := collective.NewRing(tr, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ring.Close() }) // before the transport's Close
			comms[r] = ring
		}
		return comms, g.kill
	}
}

// conformanceConfig: the suite's buffers are about 3 MiB; 64 KiB pieces make them span
// many pieces and, with testConfig's 256 KiB rings, wrap the rings many times. Transport
// names the ring's config only ("tcp" passes collective.Config.Validate).
func conformanceConfig(timeout time.Duration) collective.Config {
	return collective.Config{Transport: "tcp", Timeout: timeout, ChunkBytes: 64 << 10}
}

func TestConformance(t *testing.T) {
	cfg := testConfig()
	if testing.Short() {
		collectivetest.RunSizes(t, ringFactory(conformanceConfig(10*time.Second), cfg), 1, 2, 3)
		return
	}
	collectivetest.Run(t, ringFactory(conformanceConfig(10*time.Second), cfg))
}

func TestConformanceFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("the fault suite waits out timeouts")
	}
	const timeout = 500 * time.Millisecond
	collectivetest.RunFaults(t, ringFactory(conformanceConfig(timeout), testConfig()), timeout)
}
