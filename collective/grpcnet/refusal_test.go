package grpcnet

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestRefusalLogBounded: a flood of refused frame streams writes at most refusalBurst
// warnings, not one per stream.
func TestRefusalLogBounded(t *testing.T) {
	leakCheck(t)
	n := tcpNodes(t, testTuning(), 1)[0]
	ctx := ctxFor(t, 10*time.Second)
	const streams = 3 * refusalBurst
	for range streams {
		cs := rawStream(t, ctx, n.addr, "") // claims no job: refused at once
		_ = cs.SendMsg(helloOf(0, 2, "job", secret))
		if err := streamStatus(cs); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("stream ended with %v, want Unauthenticated", err)
		}
	}
	if got := len(n.refusals()); got == 0 || got > refusalBurst {
		t.Fatalf("%d refused streams: %d warnings, want 1 to %d", streams, got, refusalBurst)
	}
}
