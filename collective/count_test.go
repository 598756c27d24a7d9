package collective_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

// TestCountConformance runs the conformance suite over counting transports: the wrapper
// changes nothing the Ring relies on.
func TestCountConformance(t *testing.T) {
	collectivetest.RunSizes(t, func(t *testing.T, size int) ([]collective.Communicator, func(int)) {
		net, ts := collective.NewInproc(size, 1)
		comms := make([]collective.Communicator, size)
		for r := range size {
			c := collective.Count(ts[r])
			ring, err := collective.NewRing(c, testConfig(10*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			comms[r] = ring
			t.Cleanup(func() { ring.Close(); c.Close() })
		}
		return comms, net.Kill
	}, 2, 3)
}

// directFake is a Transport with the DirectReceiver extension, recording that it was used.
type directFake struct {
	collective.Transport
	used atomic.Bool
}

func (d *directFake) RecvInto(ctx context.Context, peer int, buf []byte, dst func(collective.Header) []byte) (collective.Header, []byte, error) {
	d.used.Store(true)
	h, p, err := d.Recv(ctx, peer, buf)
	if err == nil {
		if to := dst(h); to != nil {
			p = to[:copy(to, p)]
		}
	}
	return h, p, err
}

// TestCountKeepsDirectReceiver: wrapping keeps the zero-copy receive path, and counts the
// same bytes on both sides of every link, per op.
func TestCountKeepsDirectReceiver(t *testing.T) {
	_, ts := collective.NewInproc(3, 1)
	fakes := make([]*directFake, 3)
	counted := make([]collective.CountingTransport, 3)
	rings := make([]*collective.Ring, 3)
	for r := range ts {
		fakes[r] = &directFake{Transport: ts[r]}
		counted[r] = collective.Count(fakes[r])
		if _, ok := counted[r].(collective.DirectReceiver); !ok {
			t.Fatal("Count dropped the DirectReceiver extension")
		}
		ring, err := collective.NewRing(counted[r], testConfig(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		rings[r] = ring
		defer ring.Close()
		defer counted[r].Close()
	}
	errs := make(chan error, 3)
	for r := range rings {
		go func() {
			buf := make([]float32, 10000)
			if err := rings[r].AllReduce(context.Background(), buf, collective.Sum, collective.Call{}); err != nil {
				errs <- err
				return
			}
			errs <- rings[r].Broadcast(context.Background(), buf, 0, collective.Call{})
		}()
	}
	for range rings {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for r := range rings {
		if !fakes[r].used.Load() {
			t.Errorf("rank %d: the Ring did not use RecvInto through the wrapper", r)
		}
		next := counted[(r+1)%3].WireCounts()
		for _, op := range []uint8{collective.OpAllReduce, collective.OpBroadcast} {
			sent, recv := counted[r].WireCounts().Sent(op), next.Received(op)
			if sent != recv {
				t.Errorf("%s: rank %d sent %d bytes, its successor received %d", collective.OpName(op), r, sent, recv)
			}
			if op == collective.OpAllReduce && sent == 0 {
				t.Errorf("rank %d sent nothing for the all-reduce", r)
			}
		}
	}
}
