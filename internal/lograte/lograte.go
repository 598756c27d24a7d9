// Package lograte bounds log lines that someone outside the cluster can cause: a refused gRPC
// call, a failed TLS handshake, a garbage gossip datagram. Without a bound, each such event
// writes a line, and a flood of them fills the disk and buries the lines that matter.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// A Limiter is a token bucket (Burst lines at once, then Burst per Every on average) that
// counts the lines it refuses; the next line it allows carries that count, so the log says
// how much was left out. It holds no goroutine. It is safe for concurrent use.
package lograte

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// Limiter allows at most Burst lines at once and Burst per Every on average.
type Limiter struct {
	burst float64
	rate  float64 // tokens per nanosecond
	now   func() time.Time

	mu struct {
		sync.Mutex
		tokens     float64
		last       time.Time
		suppressed int
	}
}

// New returns a Limiter that allows burst lines at once, refilled at burst per every.
// burst < 1 is taken as 1.
func New(burst int, every time.Duration) *Limiter {
	return NewWithClock(burst, every, time.Now)
}

// NewWithClock is New with a clock, for tests.
func NewWithClock(burst int, every time.Duration, now func() time.Time) *Limiter {
	if burst < 1 {
		burst = 1
	}
	if every <= 0 {
		every = time.Second
	}
	l := &Limiter{burst: float64(burst), rate: float64(burst) / float64(every), now: now}
	l.mu.tokens = l.burst
	l.mu.last = now()
	return l
}

// Allow reports whether a line may be written now. When it may, suppressed is the number of
// lines refused since the last one allowed, to be logged with it (see Field).
func (l *Limiter) Allow() (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if d := now.Sub(l.mu.last); d > 0 {
		l.mu.tokens = min(l.burst, l.mu.tokens+float64(d)*l.rate)
	}
	l.mu.last = now
	if l.mu.tokens < 1 {
		l.mu.suppressed++
		return false, 0
	}
	l.mu.tokens--
	suppressed, l.mu.suppressed = l.mu.suppressed, 0
	return true, suppressed
}

// Field is the zap field that reports suppressed lines: "suppressed", or zap.Skip when
// there were none.
func Field(suppressed int) zap.Field {
	if suppressed == 0 {
		return zap.Skip()
	}
	return zap.Int("suppressed", suppressed)
}
