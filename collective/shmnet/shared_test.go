//go:build linux

package shmnet

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// sharedRings is n Rings over counted shmnet transports, closed at cleanup.
func sharedRings(t *testing.T, n int, timeout time.Duration) (*group, []*collective.Ring, []collective.CountingTransport) {
	t.Helper()
	g := newGroup(t, n, testConfig())
	rings := make([]*collective.Ring, n)
	counted := make([]collective.CountingTransport, n)
	for r, tr := range g.ts {
		counted[r] = collective.Count(tr)
		ring, err := collective.NewRing(counted[r], conformanceConfig(timeout))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ring.Close() })
		rings[r] = ring
	}
	return g, rings, counted
}

// TestDirectPath: an all-reduce on buffers from the arena, through Count's wrapper as job
// builds it, moves no byte through the rings, counts what it read, and gives every rank the
// exact sum; the buffers outlive Close until freed, and then no mapping is left.
func TestDirectPath(t *testing.T) {
	const n, length = 3, 1<<20 + 7
	g, rings, counted := sharedRings(t, n, 5*time.Second)
	bufs := make([][]float32, n)
	for r, ring := range rings {
		b, err := ring.AllocShared(length)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := g.ts[r].SharedOffset(b); !ok {
			t.Fatal("AllocShared's buffer is not in the arena")
		}
		bufs[r] = b
	}
	for iter := range 3 {
		for r := range n {
			for i := range bufs[r] {
				bufs[r][i] = float32((r + 1) * (i%7 + iter))
			}
		}
		if err := onAll(n, func(r int) error {
			return rings[r].AllReduce(context.Background(), bufs[r], collective.Sum, collective.Call{})
		}); err != nil {
			t.Fatal(err)
		}
		for r := range n {
			for i, v := range bufs[r] {
				if want := float32(6 * (i%7 + iter)); v != want {
					t.Fatalf("iteration %d rank %d element %d = %v, want %v", iter, r, i, v, want)
				}
			}
		}
	}
	for r, tr := range g.ts {
		for p := range n {
			if p != r && (tr.in[p].tail != 0 || tr.out[p].head != 0) {
				t.Errorf("rank %d: ring with rank %d moved bytes (tail %d, head %d)", r, p, tr.in[p].tail, tr.out[p].head)
			}
		}
		sh := collective.EvenShards(length, n)
		own := sh[r+1] - sh[r]
		// Per call: (N-1)·own read in the reduce, length-own in the gather.
		if got, want := counted[r].WireCounts().Received(collective.OpAllReduce), uint64(3*4*((n-1)*own+length-own)); got != want {
			t.Errorf("rank %d counted %d bytes received, want %d", r, got, want)
		}
	}
	dir := g.dir
	for r := range n {
		_ = rings[r].Close()
		_ = g.ts[r].Close()
	}
	bufs[0][0] = 1 // still mapped after Close
	for r := range n {
		if err := g.ts[r].FreeShared(bufs[r]); err != nil {
			t.Fatal(err)
		}
	}
	if m := mappedFrom(t, dir); m != 0 {
		t.Fatalf("%d mappings of %s left after Close and FreeShared", m, dir)
	}
}

// TestArena: allocation is page-granular first fit, freed runs coalesce and come back
// zeroed, a full arena is ErrNoShared, and a foreign slice cannot be freed.
func TestArena(t *testing.T) {
	cfg := testConfig()
	cfg.ArenaBytes = 16 * pageSize
	g := newGroup(t, 2, cfg)
	tr := g.ts[0]
	a, err := tr.AllocShared(3 * pageSize / 4) // 3 pages
	if err != nil {
		t.Fatal(err)
	}
	b, err := tr.AllocShared(1) // 1 page
	if err != nil {
		t.Fatal(err)
	}
	if off, _ := tr.SharedOffset(b); off != 3*pageSize {
		t.Fatalf("second buffer at %d, want %d", off, 3*pageSize)
	}
	if _, err := tr.AllocShared(13 * pageSize / 4); !errors.Is(err, collective.ErrNoShared) {
		t.Fatalf("over-allocating: %v, want ErrNoShared", err)
	}
	a[5] = 7
	if err := tr.FreeShared(a); err != nil {
		t.Fatal(err)
	}
	if err := tr.FreeShared(make([]float32, 4)); err == nil {
		t.Fatal("freeing a heap slice succeeded")
	}
	c, err := tr.AllocShared(3 * pageSize / 4)
	if err != nil {
		t.Fatal(err)
	}
	if off, _ := tr.SharedOffset(c); off != 0 || c[5] != 0 {
		t.Fatalf("reallocated run at %d holds %v, want offset 0 and zeros", off, c[5])
	}
	for _, x := range [][]float32{b, c} {
		if err := tr.FreeShared(x); err != nil {
			t.Fatal(err)
		}
	}
	if whole, err := tr.AllocShared(16 * pageSize / 4); err != nil || len(whole) != 16*pageSize/4 {
		t.Fatalf("the coalesced arena: %v", err)
	}
	cfg.ArenaBytes = 0
	g0 := newGroup(t, 2, cfg)
	if _, err := g0.ts[1].AllocShared(1); !errors.Is(err, collective.ErrNoShared) {
		t.Fatalf("no arena: %v, want ErrNoShared", err)
	}
}

// TestDirectMismatch: ranks in different calls on shared buffers fail with ErrProtocol
// rather than read the wrong bytes, and every later call on shared buffers fails too (the
// steps are out of step), while calls on other buffers still work.
func TestDirectMismatch(t *testing.T) {
	const n = 3
	_, rings, _ := sharedRings(t, n, 2*time.Second)
	bufs := make([][]float32, n)
	for r, ring := range rings {
		var err error
		if bufs[r], err = ring.AllocShared(1000); err != nil {
			t.Fatal(err)
		}
	}
	err := onAll(n, func(r int) error {
		if r == 1 {
			return rings[r].Broadcast(context.Background(), bufs[r], 0, collective.Call{})
		}
		return rings[r].AllReduce(context.Background(), bufs[r], collective.Sum, collective.Call{})
	})
	if !errors.Is(err, collective.ErrProtocol) {
		t.Fatalf("mismatched calls: %v, want ErrProtocol", err)
	}
	err = onAll(n, func(r int) error {
		return rings[r].AllReduce(context.Background(), bufs[r], collective.Sum, collective.Call{})
	})
	if err == nil {
		t.Fatal("a call on shared buffers after a failed one succeeded")
	}
	heap := make([][]float32, n)
	if err := onAll(n, func(r int) error {
		heap[r] = []float32{float32(r)}
		return rings[r].AllReduce(context.Background(), heap[r], collective.Sum, collective.Call{})
	}); err != nil {
		t.Fatalf("a call on heap buffers after the failure: %v", err)
	}
	if heap[2][0] != 3 {
		t.Fatalf("sum %v, want 3", heap[2][0])
	}
}

// TestDirectAbort: a rank whose context is already cancelled gives up the call at once,
// and its peers fail at once too, naming it, instead of waiting out the timeout.
func TestDirectAbort(t *testing.T) {
	const n, victim = 4, 2
	_, rings, _ := sharedRings(t, n, 20*time.Second)
	bufs := make([][]float32, n)
	for r, ring := range rings {
		var err error
		if bufs[r], err = ring.AllocShared(4096); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	errs := make([]error, n)
	_ = onAll(n, func(r int) error {
		ctx := context.Background()
		if r == victim {
			c, cancel := context.WithCancel(ctx)
			cancel()
			ctx = c
		}
		errs[r] = rings[r].AllReduce(ctx, bufs[r], collective.Sum, collective.Call{})
		return nil
	})
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("the abort took %v", el)
	}
	for r, err := range errs {
		if r == victim {
			if !errors.Is(err, context.Canceled) {
				t.Errorf("rank %d: %v, want context.Canceled", r, err)
			}
			continue
		}
		t.Run(fmt.Sprint("rank ", r), func(t *testing.T) { wantPeerErr(t, err, victim, collective.ErrAborted) })
	}
}

// TestDirectPeerKilled: a rank that dies in a call on shared buffers (as a SIGKILL looks:
// no flags, its lock dropped) is named by every survivor with ErrPeerGone well within the
// collective timeout.
func TestDirectPeerKilled(t *testing.T) {
	const n, victim = 3, 1
	g, rings, _ := sharedRings(t, n, 20*time.Second)
	bufs := make([][]float32, n)
	for r, ring := range rings {
		var err error
		if bufs[r], err = ring.AllocShared(4096); err != nil {
			t.Fatal(err)
		}
	}
	time.AfterFunc(50*time.Millisecond, func() { g.kill(victim) })
	start := time.Now()
	errs := make([]error, n)
	_ = onAll(n, func(r int) error {
		if r == victim {
			return nil // never enters
		}
		errs[r] = rings[r].AllReduce(context.Background(), bufs[r], collective.Sum, collective.Call{})
		return nil
	})
	if el := time.Since(start); el > 3*time.Second {
		t.Fatalf("the survivors took %v to notice", el)
	}
	for r, err := range errs {
		if r != victim {
			wantPeerErr(t, err, victim, collective.ErrPeerGone)
		}
	}
}
