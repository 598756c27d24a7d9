package collectivetest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// RunFaults runs the failure cases for groups of 2 to 4 ranks. timeout must be the
// Config.Timeout the factory gives its communicators. It needs kill and skips the cases
// that use it when the factory returns none.
//
//   - A dead rank (killed before the call, or while the others wait on it): every survivor's
//     call fails within about one timeout with a *PeerError naming the dead rank.
//   - A rank whose call fails locally (its context is already cancelled) aborts the call on
//     every other rank well within the timeout, naming it, with ErrAborted: the abort travels
//     round the ring instead of each rank waiting out its own timeout.
//   - A stalled rank (alive, never calls): every other rank fails within about one timeout
//     and its successor names it with ErrTimeout. Nothing hangs.
func RunFaults(t *testing.T, f Factory, timeout time.Duration) {
	CheckGoroutines(t)
	// "Within about one timeout": a dead peer is usually known at once (its connection
	// breaks), a silent one after the timeout; allow for scheduling on a busy machine.
	limit := timeout + timeout/2 + 500*time.Millisecond
	const length = 10000
	for n := 2; n <= 4; n++ {
		for _, d := range deadRanks(n) {
			t.Run(fmt.Sprintf("KillBeforeCall/N=%d/dead=%d", n, d), func(t *testing.T) {
				comms, kill := f(t, n)
				if kill == nil {
					t.Skip("the implementation cannot kill a rank")
				}
				kill(d)
				start := time.Now()
				errs := survivors(t, comms, d, func(ctx context.Context, r int, c collective.Communicator) error {
					return c.AllReduce(ctx, make([]float32, length), collective.Sum, collective.Call{})
				})
				checkNamed(t, errs, d, d, start, limit, nil)
			})
			t.Run(fmt.Sprintf("KillWhileWaiting/N=%d/dead=%d", n, d), func(t *testing.T) {
				comms, kill := f(t, n)
				if kill == nil {
					t.Skip("the implementation cannot kill a rank")
				}
				killed := make(chan time.Time, 1)
				timer := time.AfterFunc(50*time.Millisecond, func() { killed <- time.Now(); kill(d) })
				defer timer.Stop()
				errs := survivors(t, comms, d, func(ctx context.Context, r int, c collective.Communicator) error {
					return c.AllReduce(ctx, make([]float32, length), collective.Avg, collective.Call{})
				})
				checkNamed(t, errs, d, d, <-killed, limit, nil)
			})
		}
		t.Run(fmt.Sprintf("Abort/N=%d", n), func(t *testing.T) {
			comms, _ := f(t, n)
			bad := n - 1
			start := time.Now()
			errs := all(t, comms, func(ctx context.Context, r int, c collective.Communicator) error {
				if r == bad {
					cctx, cancel := context.WithCancel(ctx)
					cancel()
					ctx = cctx
				}
				return c.AllReduce(ctx, make([]float32, length), collective.Sum, collective.Call{})
			})
			if !errors.Is(errs[bad], context.Canceled) {
				t.Errorf("rank %d with a cancelled context: got %v, want context.Canceled", bad, errs[bad])
			}
			// Well within one timeout: only an abort can have told them.
			checkNamed(t, errs, bad, bad, start, timeout*3/4, collective.ErrAborted)
		})
		t.Run(fmt.Sprintf("Stalled/N=%d", n), func(t *testing.T) {
			comms, _ := f(t, n)
			stalled := n / 2
			start := time.Now()
			errs := survivors(t, comms, stalled, func(ctx context.Context, r int, c collective.Communicator) error {
				return c.AllReduce(ctx, make([]float32, length), collective.Sum, collective.Call{})
			})
			succ := (stalled + 1) % n
			var pe *collective.PeerError
			if !errors.As(errs[succ], &pe) || pe.Rank != stalled || !errors.Is(errs[succ], collective.ErrTimeout) {
				t.Errorf("rank %d after the stalled rank %d: got %v, want a timeout naming rank %d", succ, stalled, errs[succ], stalled)
			}
			for r, err := range errs {
				if r != stalled && !errors.As(err, &pe) {
					t.Errorf("rank %d: got %v, want a *PeerError", r, err)
				}
			}
			if el := time.Since(start); el > limit {
				t.Errorf("the ranks took %v to fail, want at most %v (timeout %v)", el, limit, timeout)
			}
		})
	}
}

// deadRanks are the ranks killed in a group of n: the first and a middle one.
func deadRanks(n int) []int {
	if n <= 2 {
		return []int{0}
	}
	return []int{0, n / 2}
}

// survivors runs fn on every rank but skip, which is reported as nil.
func survivors(t *testing.T, comms []collective.Communicator, skip int, fn func(ctx context.Context, r int, c collective.Communicator) error) []error {
	t.Helper()
	return all(t, comms, func(ctx context.Context, r int, c collective.Communicator) error {
		if r == skip {
			return nil
		}
		return fn(ctx, r, c)
	})
}

// checkNamed requires every rank but skip to have failed, after start, within limit, with a
// *PeerError naming rank want (and wrapping sentinel, if given).
func checkNamed(t *testing.T, errs []error, skip, want int, start time.Time, limit time.Duration, sentinel error) {
	t.Helper()
	if el := time.Since(start); el > limit {
		t.Errorf("the ranks took %v to fail, want at most %v", el, limit)
	}
	for r, err := range errs {
		if r == skip {
			continue
		}
		var pe *collective.PeerError
		switch {
		case err == nil:
			t.Errorf("rank %d: the call succeeded, want a failure naming rank %d", r, want)
		case !errors.As(err, &pe) || pe.Rank != want:
			t.Errorf("rank %d: got %v, want a *PeerError naming rank %d", r, err, want)
		case sentinel != nil && !errors.Is(err, sentinel):
			t.Errorf("rank %d: got %v, want %v", r, err, sentinel)
		}
	}
}
