package leakcheck

import (
	"strings"
	"testing"
	"time"
)

// fakeT records Errorf instead of failing.
type fakeT struct {
	testing.TB
	cleanups []func()
	failed   string
}

func (f *fakeT) Helper()                           {}
func (f *fakeT) Cleanup(fn func())                 { f.cleanups = append(f.cleanups, fn) }
func (f *fakeT) Errorf(format string, args ...any) { f.failed = format }

func TestCheckCatchesALeak(t *testing.T) {
	defer func(g time.Duration) { grace = g }(grace)
	grace = 50 * time.Millisecond
	stop := make(chan struct{})
	defer close(stop)
	f := &fakeT{TB: t}
	Check(f, nil)
	go func() { <-stop }() // started after the snapshot and still running at cleanup
	f.cleanups[0]()
	if !strings.Contains(f.failed, "leaked") {
		t.Fatal("a running goroutine was not reported")
	}
}

func TestCheckPassesAndIgnores(t *testing.T) {
	f := &fakeT{TB: t}
	Check(f, nil)
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
	Check(g, func(stack string) bool { return strings.Contains(stack, "TestCheckPassesAndIgnores") })
	go func() { <-stop }()
	g.cleanups[0]()
	if g.failed != "" {
		t.Fatal("an ignored goroutine was reported")
	}
}
