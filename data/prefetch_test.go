package data

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/leakcheck"
)

// epochSequence is the trainer's sequence for one epoch: micro-batches of m taken in order
// from perm, on one rank.
func epochSequence(perm []int32, m, n int) Sequence {
	return Sequence{Len: n, Indices: func(k int) []int32 { return MicroBatch(perm, 0, k, 1, 0, m) }}
}

// prefetchDataset is 600 samples of 2x3.
func prefetchDataset() *Dataset {
	d := &Dataset{Name: FashionMNIST, N: 600, C: 1, H: 2, W: 3, Classes: NumClasses, Images: seq(600 * 6), Labels: make([]uint8, 600)}
	for i := range d.Labels {
		d.Labels[i] = uint8(i % NumClasses)
	}
	return d
}

// TestPrefetchMatchesFill: at every depth the batches are exactly Fill's, in order, across
// several sequences (epochs) with a new permutation each, and the sequence ends cleanly.
func TestPrefetchMatchesFill(t *testing.T) {
	leakcheck.Check(t)
	d := prefetchDataset()
	norm := DefaultConfig().Normalize
	const m = 7
	perm := make([]int32, d.N)
	want := NewBatch(m, d.SampleSize())
	for _, depth := range []int{0, 1, 2, 5} {
		p, err := NewPrefetcher(d, norm, m, depth)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Next(context.Background()); !errors.Is(err, ErrSequenceDone) {
			t.Fatalf("depth %d: Next before Start: %v", depth, err)
		}
		for epoch := range 3 {
			Permutation(perm, 9, epoch)
			n := StepsPerEpoch(d.N, m)
			if err := p.Start(epochSequence(perm, m, n)); err != nil {
				t.Fatal(err)
			}
			for k := range n {
				b, err := p.Next(context.Background())
				if err != nil {
					t.Fatalf("depth %d epoch %d micro-batch %d: %v", depth, epoch, k, err)
				}
				if err := d.Fill(want, MicroBatch(perm, 0, k, 1, 0, m), norm); err != nil {
					t.Fatal(err)
				}
				if b.N != want.N || !slices.Equal(f32bytes(b.X), f32bytes(want.X)) || !slices.Equal(b.Y, want.Y) {
					t.Fatalf("depth %d epoch %d micro-batch %d differs from Fill", depth, epoch, k)
				}
			}
			for range 2 {
				if _, err := p.Next(context.Background()); !errors.Is(err, ErrSequenceDone) {
					t.Fatalf("depth %d epoch %d: Next after the sequence: %v", depth, epoch, err)
				}
			}
		}
		p.Close()
		p.Close()
		if _, err := p.Next(context.Background()); !errors.Is(err, ErrPrefetcherClosed) {
			t.Fatalf("Next after Close: %v", err)
		}
		if err := p.Start(epochSequence(perm, m, 1)); !errors.Is(err, ErrPrefetcherClosed) {
			t.Fatalf("Start after Close: %v", err)
		}
	}
}

// TestPrefetchErrorInOrder: a Fill error reaches the consumer after every batch before it,
// and ends the sequence.
func TestPrefetchErrorInOrder(t *testing.T) {
	leakcheck.Check(t)
	d := prefetchDataset()
	bad := []int32{1, 2, int32(d.N)} // out of range
	for _, depth := range []int{0, 3} {
		p, err := NewPrefetcher(d, DefaultConfig().Normalize, 3, depth)
		if err != nil {
			t.Fatal(err)
		}
		seq := Sequence{Len: 10, Indices: func(k int) []int32 {
			if k == 4 {
				return bad
			}
			return []int32{int32(k), int32(k + 1), int32(k + 2)}
		}}
		if err := p.Start(seq); err != nil {
			t.Fatal(err)
		}
		for k := range 4 {
			b, err := p.Next(context.Background())
			if err != nil || b.Y[0] != int32(k%NumClasses) {
				t.Fatalf("depth %d micro-batch %d: %v", depth, k, err)
			}
		}
		_, err = p.Next(context.Background())
		if err == nil || !strings.Contains(err.Error(), "micro-batch 4 of the sequence") || !strings.Contains(err.Error(), "outside [0, 600)") {
			t.Fatalf("depth %d: error %v, want micro-batch 4's fill error", depth, err)
		}
		if _, err2 := p.Next(context.Background()); err2 == nil || err2.Error() != err.Error() {
			t.Fatalf("depth %d: after the error Next returned %v", depth, err2)
		}
		// The ring is whole again after a restart.
		if err := p.Start(epochSequence(identity(d.N), 3, 20)); err != nil {
			t.Fatal(err)
		}
		for k := range 20 {
			if _, err := p.Next(context.Background()); err != nil {
				t.Fatalf("depth %d after restart, micro-batch %d: %v", depth, k, err)
			}
		}
		p.Close()
	}
}

// identity is the order 0..n-1.
func identity(n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(i)
	}
	return p
}

// TestPrefetchStopMidSequence: Start and Close in the middle of a sequence stop the producer
// (no leak) and drop what it had filled; a later sequence starts at its own first batch.
func TestPrefetchStopMidSequence(t *testing.T) {
	leakcheck.Check(t)
	d := prefetchDataset()
	norm := DefaultConfig().Normalize
	perm := identity(d.N)
	p, err := NewPrefetcher(d, norm, 4, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for round := range 5 {
		if err := p.Start(Sequence{Len: 100, Indices: func(k int) []int32 { return MicroBatch(perm, 4*round, k, 1, 0, 4) }}); err != nil {
			t.Fatal(err)
		}
		b, err := p.Next(context.Background())
		if err != nil || b.Y[0] != int32((4*round)%NumClasses) {
			t.Fatalf("round %d: first batch %v, label %d", round, err, b.Y[0])
		}
		if round%2 == 1 {
			p.Stop()
			if _, err := p.Next(context.Background()); !errors.Is(err, ErrSequenceDone) {
				t.Fatalf("Next after Stop: %v", err)
			}
		}
	}
}

// TestPrefetchNextHonoursContext: a consumer waiting for a producer that cannot go on (its
// Indices blocks) gets ctx's error instead of hanging.
func TestPrefetchNextHonoursContext(t *testing.T) {
	leakcheck.Check(t)
	d := prefetchDataset()
	p, err := NewPrefetcher(d, DefaultConfig().Normalize, 2, 1)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	if err := p.Start(Sequence{Len: 3, Indices: func(k int) []int32 {
		if k == 1 {
			<-release
		}
		return []int32{0, 1}
	}}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Next(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := p.Next(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Next with a stuck producer: %v", err)
	}
	close(release)
	p.Close()
}

func TestPrefetchDoesNotAllocate(t *testing.T) {
	d := prefetchDataset()
	norm := DefaultConfig().Normalize
	perm := identity(d.N)
	for _, depth := range []int{0, 2} {
		p, err := NewPrefetcher(d, norm, 8, depth)
		if err != nil {
			t.Fatal(err)
		}
		const n = 1000
		if err := p.Start(Sequence{Len: n, Indices: func(k int) []int32 { return MicroBatch(perm, 0, k%70, 1, 0, 8) }}); err != nil {
			t.Fatal(err)
		}
		var nextErr error
		if a := testing.AllocsPerRun(500, func() {
			if _, err := p.Next(context.Background()); err != nil {
				nextErr = err
			}
		}); a != 0 || nextErr != nil {
			t.Errorf("depth %d: %v allocations per micro-batch (err %v)", depth, a, nextErr)
		}
		p.Close()
	}
}

func TestNewPrefetcherErrors(t *testing.T) {
	d := prefetchDataset()
	norm := DefaultConfig().Normalize
	for _, c := range []struct {
		d            *Dataset
		norm         Normalize
		micro, depth int
		want         string
	}{
		{nil, norm, 4, 2, "needs a dataset"},
		{d, norm, 0, 2, "micro-batch must be >= 1, got 0"},
		{d, norm, 4, -1, fmt.Sprintf("depth must be in [0, %d], got -1", MaxPrefetch)},
		{d, norm, 4, MaxPrefetch + 1, "depth must be in"},
		{d, Normalize{Std: 0}, 4, 2, "normalize.std"},
	} {
		if _, err := NewPrefetcher(c.d, c.norm, c.micro, c.depth); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewPrefetcher(micro %d, depth %d): %v, want %q", c.micro, c.depth, err, c.want)
		}
	}
	p, _ := NewPrefetcher(d, norm, 4, 1)
	defer p.Close()
	if err := p.Start(Sequence{Len: 3}); err == nil {
		t.Error("a sequence without Indices was accepted")
	}
}

// BenchmarkPrefetchOverlap models the step loop: fill a 256-sample micro-batch of 28x28 and
// then "compute" on it for about as long as filling takes. With prefetch the two overlap.
func BenchmarkPrefetchOverlap(b *testing.B) {
	const n, ss, batch = 4096, 784, 256
	d := &Dataset{Name: FashionMNIST, N: n, C: 1, H: 28, W: 28, Classes: NumClasses, Images: seq(n * ss), Labels: make([]uint8, n)}
	perm := make([]int32, n)
	Permutation(perm, 1, 0)
	norm := DefaultConfig().Normalize
	work := make([]float32, batch*ss)
	compute := func(x []float32) {
		for i, v := range x {
			work[i] = work[i]*0.5 + v*v
		}
	}
	for _, depth := range []int{0, 2} {
		b.Run(fmt.Sprintf("prefetch=%d", depth), func(b *testing.B) {
			p, err := NewPrefetcher(d, norm, batch, depth)
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			seq := Sequence{Len: 1 << 40, Indices: func(k int) []int32 { return MicroBatch(perm, 0, k%(n/batch), 1, 0, batch) }}
			if err := p.Start(seq); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(batch * ss * 4)
			for b.Loop() {
				x, err := p.Next(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				compute(x.X)
			}
		})
	}
}
