package leakcheck

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// fakeT records Errorf instead of failing.
type fakeT struct {
	testing.TB
	cleanups []func()
	failed   string
}

func (f *fakeT) Helper()                           {}
func (f *fakeT) Cleanup(fn func())                 { f.cleanups = append(f.cleanups, fn) }
func (f *fakeT) Errorf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

func parked(stop <-chan struct{}) { <-stop }

func TestCheckCatchesALeak(t *testing.T) {
	defer func(g time.Duration) { grace = g }(grace)
	grace = 50 * time.Millisecond
	stop := make(chan struct{})
	defer close(stop)
	f := &fakeT{TB: t}
	Check(f)
	go parked(stop) // started after the snapshot and still running at cleanup
	f.cleanups[0]()
	if !strings.Contains(f.failed, "leaked") || !strings.Contains(f.failed, "leakcheck.parked") {
		t.Fatalf("a running goroutine was not reported: %q", f.failed)
	}
}

func TestCheckWaitsForGrace(t *testing.T) {
	f := &fakeT{TB: t}
	Check(f)
	stop := make(chan struct{})
	go parked(stop)
	// goleak alone gives up after about 0.4 s; this goroutine ends after 1 s.
	time.AfterFunc(time.Second, func() { close(stop) })
	f.cleanups[0]()
	if f.failed != "" {
		t.Fatalf("a goroutine that ended within the grace period was reported: %s", f.failed)
	}
}

func TestCheckPassesAndIgnores(t *testing.T) {
	f := &fakeT{TB: t}
	Check(f)
	done := make(chan struct{})
	go func() { close(done) }()
	<-done
	f.cleanups[0]()
	if f.failed != "" {
		t.Fatal("a finished goroutine was reported")
	}
	stop := make(chan struct{})
	defer close(stop)
	g := &fakeT{TB: t}
	Check(g, goleak.IgnoreAnyFunction("github.com/qvd/qvd/internal/leakcheck.parked"))
	go parked(stop)
	g.cleanups[0]()
	if g.failed != "" {
		t.Fatal("an ignored goroutine was reported")
	}
}
