package lograte

import (
	"testing"
	"time"
)

// TestLimiter: a burst passes, the rest is counted, refill allows more and the first line
// allowed again reports the count.
func TestLimiter(t *testing.T) {
	now := time.Unix(0, 0)
	l := NewWithClock(3, 3*time.Second, func() time.Time { return now })
	for i := range 3 {
		if ok, s := l.Allow(); !ok || s != 0 {
			t.Fatalf("line %d of the burst: ok=%v suppressed=%d", i, ok, s)
		}
	}
	for i := range 100 {
		if ok, _ := l.Allow(); ok {
			t.Fatalf("line %d past the burst was allowed", i)
		}
	}
	now = now.Add(time.Second) // one token back
	if ok, s := l.Allow(); !ok || s != 100 {
		t.Fatalf("after refill: ok=%v suppressed=%d, want true, 100", ok, s)
	}
	if ok, _ := l.Allow(); ok {
		t.Fatal("a second line after one token's refill was allowed")
	}
	now = now.Add(time.Hour) // refill is capped at the burst
	n := 0
	for range 10 {
		if ok, _ := l.Allow(); ok {
			n++
		}
	}
	if n != 3 {
		t.Fatalf("after a long pause %d lines passed, want the burst of 3", n)
	}
}
