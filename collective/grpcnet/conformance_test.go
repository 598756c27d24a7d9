package grpcnet

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

var jobSeq atomic.Int64

// ringFactory builds groups of Rings over this transport, each rank with its own gRPC server
// on 127.0.0.1. kill(r) does what a crash of rank r's process does to the network: its
// server stops and every connection it dialled closes.
func ringFactory(cfg collective.Config) collectivetest.Factory {
	return func(t *testing.T, size int) ([]collective.Communicator, func(int)) {
		nodes := tcpNodes(t, testTuning(), size)
		trs := group(t, fmt.Sprint("conformance-", jobSeq.Add(1)), secret, nodes, nil)
		comms := make([]collective.Communicator, size)
		for r, tr := range trs {
			ring, err := collective.NewRing(tr, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ring.Close() }) // before the transport's Close
			comms[r] = ring
		}
		kill := func(r int) {
			nodes[r].srv.Stop()
			for _, p := range trs[r].peers {
				if p != nil {
					p.out.cut()
				}
			}
		}
		return comms, kill
	}
}

// The suite uses buffers of about 3 MiB; 64 KiB pieces make them span many pieces.
func conformanceConfig(timeout time.Duration) collective.Config {
	return collective.Config{Transport: "grpc", Timeout: timeout, ChunkBytes: 64 << 10}
}

func TestConformance(t *testing.T) {
	if testing.Short() {
		t.Skip("the conformance suite over real gRPC takes a while")
	}
	collectivetest.Run(t, ringFactory(conformanceConfig(10*time.Second)))
}

func TestConformanceFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("the fault suite over real gRPC takes a while")
	}
	const timeout = 500 * time.Millisecond
	collectivetest.RunFaults(t, ringFactory(conformanceConfig(timeout)), timeout)
}
