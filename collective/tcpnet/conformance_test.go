package tcpnet

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

var jobSeq atomic.Int64

// ringFactory builds groups of Rings over this transport, each rank with its own listener on
// 127.0.0.1 and its ring links connected up front (Connector), as the cluster would before
// the first collective. kill(r) does to the network what a crash of rank r's process does:
// its listener stops and its connections are reset.
func ringFactory(cfg collective.Config, tcfg Config) collectivetest.Factory {
	return func(t *testing.T, size int) ([]collective.Communicator, func(int)) {
		lns, _ := listeners(t, size, tcfg)
		job, secret := fmt.Sprint("conformance-", jobSeq.Add(1)), newSecret(t)
		trs := make([]*transport, size)
		for r := range trs {
			tr, err := lns[r].Transport(context.Background(), Group{Job: job, Rank: r, Addrs: addrs(lns), Secret: secret})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tr.Close() })
			trs[r] = tr.(*transport)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := onAll(size, func(r int) error {
			if size == 1 {
				return nil
			}
			return trs[r].Connect(ctx, (r+1)%size)
		}); err != nil {
			t.Fatal(err)
		}
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
			tr := trs[r]
			tr.mu.Lock()
			for c := range tr.mu.conns {
				_ = c.(*net.TCPConn).SetLinger(0)
			}
			tr.mu.Unlock()
			_ = lns[r].Close()
		}
		return comms, kill
	}
}

// The suite's buffers are about 3 MiB; 64 KiB pieces make them span many pieces.
func conformanceConfig(timeout time.Duration) collective.Config {
	return collective.Config{Transport: "tcp", Timeout: timeout, ChunkBytes: 64 << 10}
}

func TestConformance(t *testing.T) {
	if testing.Short() {
		t.Skip("the conformance suite over real TCP takes a while")
	}
	collectivetest.Run(t, ringFactory(conformanceConfig(10*time.Second), testConfig()))
}

func TestConformanceFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("the fault suite over real TCP takes a while")
	}
	const timeout = 500 * time.Millisecond
	tcfg := testConfig()
	tcfg.DialTimeout = timeout // a dial to a dead rank fails within the call's timeout
	collectivetest.RunFaults(t, ringFactory(conformanceConfig(timeout), tcfg), timeout)
}
