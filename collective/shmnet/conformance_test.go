//go:build linux

package shmnet

import (
	"fmt"
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

// TestConformanceShared runs the suite on buffers from the Rings' shared arenas: the direct
// path (collective/direct.go), every rank reading its peers' buffers in place.
func TestConformanceShared(t *testing.T) {
	cfg := testConfig()
	sizes := []int{1, 2, 3, 4, 5}
	if testing.Short() {
		sizes = []int{1, 2, 3}
	}
	collectivetest.RunShared(t, ringFactory(conformanceConfig(10*time.Second), cfg), sizes...)
}

// hierSharedFactory builds hierarchical worlds of 2 "hosts" (n even): each host's ranks a
// shmnet group, each local rank's cross group in-process. Run with RunShared, the local legs
// of AllReduce (and of the identity-layout ReduceScatter and AllGather) take the direct path.
func hierSharedFactory(cfg collective.Config) collectivetest.Factory {
	return func(t *testing.T, n int) ([]collective.Communicator, func(int)) {
		const hosts = 2
		nl := n / hosts
		ids := make([]string, n)
		for g := range n {
			ids[g] = fmt.Sprint("host-", g/nl)
		}
		locals := make([]*group, hosts)
		for h := range hosts {
			locals[h] = newGroup(t, nl, testConfig())
		}
		crossTs := make([][]collective.Transport, nl)
		for l := range nl {
			_, crossTs[l] = collective.NewInproc(hosts, uint64(l+1))
			for _, tr := range crossTs[l] {
				t.Cleanup(func() { _ = tr.Close() })
			}
		}
		comms := make([]collective.Communicator, n)
		for g := range n {
			tp, err := collective.NewTopology(ids, g)
			if err != nil {
				t.Fatal(err)
			}
			local, err := collective.NewRing(locals[tp.HostOf[g]].ts[tp.LocalRank], cfg)
			if err != nil {
				t.Fatal(err)
			}
			cross, err := collective.NewRing(crossTs[tp.LocalRank][tp.CrossRank], cfg)
			if err != nil {
				t.Fatal(err)
			}
			h, err := collective.NewHierarchical(local, cross, tp)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = h.Close() })
			comms[g] = h
		}
		return comms, nil
	}
}

// TestHierarchicalShared runs the suite on shared buffers over 2 hosts × 2 and × 3 ranks.
func TestHierarchicalShared(t *testing.T) {
	collectivetest.RunShared(t, hierSharedFactory(conformanceConfig(10*time.Second)), 4, 6)
}
