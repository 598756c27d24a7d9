package job

import (
	"testing"

	"github.com/qvd/qvd/cluster"
)

// TestOnDeparture: only departures of other members of the job abort it; a graceful one
// waits out leftGrace, so a worker that finished and left cannot fail a rank still reading
// the last collective (the compose test's rare coordinator exit 1).
func TestOnDeparture(t *testing.T) {
	for _, c := range []struct {
		name       string
		kind       cluster.EventKind
		inRoster   bool
		rank, self int
		want       departure
	}{
		{"peer left", cluster.Left, true, 2, 0, abortAfterGrace},
		{"peer failed", cluster.Failed, true, 2, 0, abortNow},
		{"observer left", cluster.Left, false, 0, 0, ignoreDeparture},
		{"observer failed", cluster.Failed, false, 0, 0, ignoreDeparture},
		{"self failed", cluster.Failed, true, 1, 1, ignoreDeparture},
		{"peer joined", cluster.Joined, true, 2, 0, ignoreDeparture},
		{"peer updated", cluster.Updated, true, 2, 0, ignoreDeparture},
	} {
		if got := onDeparture(c.kind, c.inRoster, c.rank, c.self); got != c.want {
			t.Errorf("%s: onDeparture = %d, want %d", c.name, got, c.want)
		}
	}
	if leftGrace < 2e9 {
		t.Errorf("leftGrace %v: a rank a moment behind in the last collective needs longer", leftGrace)
	}
}
