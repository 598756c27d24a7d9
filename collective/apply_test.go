package collective_test

import (
	"context"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

// applyTransport gives a Transport the ApplyReceiver extension the way a shared-memory one
// has it: the payload is received into a scratch buffer standing in for the transport's own
// memory, then handed over in parts of partBytes, which is scribbled over afterwards so a
// Ring that kept a part would read garbage.
type applyTransport struct {
	collective.Transport
	partBytes int
	scratch   []byte
}

func (a *applyTransport) RecvApply(ctx context.Context, peer int, buf []byte, apply func(collective.Header) func(int, []byte)) (collective.Header, []byte, error) {
	h, p, err := a.Transport.Recv(ctx, peer, a.scratch)
	if err != nil || h.Kind != collective.KindData {
		if err == nil {
			p = buf[:copy(buf, p)]
		}
		return h, p, err
	}
	fn := apply(h)
	if fn == nil {
		if len(p) > len(buf) {
			return collective.Header{}, nil, collective.ErrProtocol
		}
		return h, buf[:copy(buf, p)], nil
	}
	for off := 0; off < len(p); off += a.partBytes {
		part := p[off:min(off+a.partBytes, len(p))]
		fn(off, part)
		for i := range part {
			part[i] = 0xA5
		}
	}
	return h, nil, nil
}

var _ collective.ApplyReceiver = (*applyTransport)(nil)

// applyFactory runs Rings over inproc transports with the ApplyReceiver extension, behind
// collective.Count as cmd/qvd puts them, so the counting wrapper must keep the extension.
func applyFactory(cfg collective.Config) collectivetest.Factory {
	return func(t *testing.T, size int) ([]collective.Communicator, func(int)) {
		net, ts := collective.NewInproc(size, 1)
		comms := make([]collective.Communicator, size)
		for r := range size {
			ct := collective.Count(&applyTransport{Transport: ts[r], partBytes: collective.ApplyAlign * 3, scratch: make([]byte, cfg.ChunkBytes+1024)})
			if _, ok := ct.(collective.ApplyReceiver); !ok {
				t.Fatal("collective.Count dropped the ApplyReceiver extension")
			}
			ring, err := collective.NewRing(ct, cfg)
			if err != nil {
				t.Fatal(err)
			}
			comms[r] = ring
			t.Cleanup(func() { ring.Close(); ts[r].Close() })
		}
		return comms, net.Kill
	}
}

func TestConformanceApply(t *testing.T) {
	collectivetest.Run(t, applyFactory(testConfig(10*time.Second)))
}

func TestConformanceApplyFaults(t *testing.T) {
	const timeout = 300 * time.Millisecond
	collectivetest.RunFaults(t, applyFactory(testConfig(timeout)), timeout)
}
