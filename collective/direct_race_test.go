package collective_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/leakcheck"
)

// holdingTransport is a DirectReceiver over an in-process Transport whose RecvInto can stop
// in the middle of a frame, the way a TCP read does when the predecessor stalls half-way
// through a payload: once dst(h) has named a destination for a held frame, RecvInto waits
// for the test to release it — then writes the payload there — or for its ctx to end — then
// it returns having written nothing, and the next RecvInto resumes the frame, as tcpnet's
// does. It can also hold Sends until the test releases them, and keep from receiving until
// it has sent a data frame (so the call that sent it is running when its frames arrive).
type holdingTransport struct {
	collective.Transport
	scratch []byte

	hold     atomic.Bool            // hold the next frame that gets a destination
	held     chan collective.Header // a frame is held
	release  chan struct{}          // closed by the test: the held frame may be written
	returned chan error             // the held RecvInto returned (nil: it wrote the payload)
	recvd    chan collective.Header // every data frame received, for the test to follow
	sendHold func(collective.Header) bool
	sendGo   chan struct{} // closed by the test: held Sends may go
	recvGate bool          // receive nothing until a data frame has been sent
	sent     chan struct{} // closed when the first data frame has been sent
	sentOnce sync.Once

	// A frame a cut-short RecvInto kept (RecvInto runs on one goroutine at a time).
	kept bool
	kh   collective.Header
	kp   []byte
}

func newHoldingTransport(t collective.Transport, chunk int) *holdingTransport {
	return &holdingTransport{
		Transport: t,
		scratch:   make([]byte, chunk),
		held:      make(chan collective.Header, 1),
		release:   make(chan struct{}),
		returned:  make(chan error, 1),
		recvd:     make(chan collective.Header, 64),
		sendGo:    make(chan struct{}),
		sent:      make(chan struct{}),
	}
}

var _ collective.DirectReceiver = (*holdingTransport)(nil)

func (t *holdingTransport) Send(ctx context.Context, peer int, h collective.Header, payload []byte) error {
	if t.sendHold != nil && t.sendHold(h) {
		select {
		case <-t.sendGo:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	err := t.Transport.Send(ctx, peer, h, payload)
	if err == nil && h.Kind == collective.KindData {
		t.sentOnce.Do(func() { close(t.sent) })
	}
	return err
}

func (t *holdingTransport) RecvInto(ctx context.Context, peer int, buf []byte, dst func(collective.Header) []byte) (collective.Header, []byte, error) {
	if t.recvGate {
		select {
		case <-t.sent:
		case <-ctx.Done():
			return collective.Header{}, nil, ctx.Err()
		}
	}
	h, p := t.kh, t.kp
	if !t.kept {
		var err error
		if h, p, err = t.Transport.Recv(ctx, peer, t.scratch); err != nil {
			return collective.Header{}, nil, err
		}
	}
	t.kept = false
	var to []byte
	if h.Kind == collective.KindData {
		select {
		case t.recvd <- h:
		default:
		}
		if h.Length > 0 {
			if d := dst(h); len(d) == int(h.Length) {
				to = d
			}
		}
	}
	if to == nil {
		if len(p) > len(buf) {
			return collective.Header{}, nil, fmt.Errorf("%w: frame of %d bytes for a buffer of %d", collective.ErrProtocol, len(p), len(buf))
		}
		return h, buf[:copy(buf, p)], nil
	}
	if !t.hold.CompareAndSwap(true, false) {
		return h, to[:copy(to, p)], nil
	}
	t.held <- h
	select {
	case <-t.release:
		copy(to, p)
		t.returned <- nil
		return h, to, nil
	case <-ctx.Done():
		t.kh, t.kp, t.kept = h, p, true
		t.returned <- ctx.Err()
		return collective.Header{}, nil, fmt.Errorf("holding transport: recv from rank %d: %w", peer, ctx.Err())
	}
}

const sentinel = -12345.5

func fill(x []float32, v float32) {
	for i := range x {
		x[i] = v
	}
}

// intact reports the first element of x that is not v, or -1.
func intact(x []float32, v float32) int {
	for i := range x {
		if math.Float32bits(x[i]) != math.Float32bits(v) {
			return i
		}
	}
	return -1
}

// TestDirectNoWriteAfterReturn: a call that ends while the dispatcher is reading one of its
// frames straight into the caller's buffer (the predecessor stalled mid-frame) must not
// return until nothing can write there any more — and must not wait for the stalled frame
// either — and the ring must stay usable afterwards.
func TestDirectNoWriteAfterReturn(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration // rank 1's Config.Timeout
		end     func(cancel context.CancelFunc)
		want    error
	}{
		{"cancel", 10 * time.Second, func(cancel context.CancelFunc) { cancel() }, context.Canceled},
		{"timeout", 300 * time.Millisecond, func(context.CancelFunc) {}, collective.ErrTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leakcheck.Check(t)
			const n = 1000
			cfg := testConfig(10 * time.Second)
			_, ts := collective.NewInproc(2, 1)
			ht := newHoldingTransport(ts[1], cfg.ChunkBytes)
			ht.hold.Store(true)
			ht.recvGate = true
			r0, err := collective.NewRing(ts[0], cfg)
			if err != nil {
				t.Fatal(err)
			}
			cfg1 := cfg
			cfg1.Timeout = tc.timeout
			r1, err := collective.NewRing(ht, cfg1)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { r0.Close(); r1.Close(); ts[0].Close(); ts[1].Close() })
			shards := collective.EvenShards(n, 2)
			root := make(chan error, 1)
			gather := func(base float32) {
				src := make([]float32, n)
				fill(src[shards[0]:shards[1]], base)
				go func() { root <- r0.AllGather(context.Background(), src, shards, collective.Call{}) }()
			}

			// Rank 1 receives rank 0's shard straight into buf, and the frame stalls half-way.
			gather(1)
			buf := make([]float32, n)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- r1.AllGather(ctx, buf, shards, collective.Call{}) }()
			select {
			case <-ht.held:
			case <-time.After(10 * time.Second):
				t.Fatal("the frame never reached RecvInto with a destination")
			}
			tc.end(cancel)
			select {
			case err := <-errc:
				if !errors.Is(err, tc.want) {
					t.Fatalf("all-gather: %v, want %v", err, tc.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("hang: the call waits for a frame stalled mid-read")
			}
			if err := <-root; err != nil {
				t.Fatalf("rank 0's all-gather: %v", err)
			}
			// The caller owns buf again: write to it, then let the stalled frame finish.
			fill(buf, sentinel)
			close(ht.release)
			select {
			case <-ht.returned:
			case <-time.After(10 * time.Second):
				t.Fatal("the held RecvInto never returned")
			}
			if i := intact(buf, sentinel); i >= 0 {
				t.Fatalf("buf[%d] = %v after the call returned: the frame was written into the caller's buffer", i, buf[i])
			}

			// The link is still in step: the next call works.
			gather(2)
			next := make([]float32, n)
			fill(next[shards[1]:shards[2]], 3)
			if err := r1.AllGather(context.Background(), next, shards, collective.Call{}); err != nil {
				t.Fatalf("second all-gather: %v", err)
			}
			if err := <-root; err != nil {
				t.Fatalf("rank 0's second all-gather: %v", err)
			}
			if i := intact(next[:shards[1]], 2); i >= 0 {
				t.Fatalf("second all-gather: next[%d] = %v, want 2", i, next[i])
			}
			if i := intact(buf, sentinel); i >= 0 {
				t.Fatalf("buf[%d] = %v: a later frame was written into a returned call's buffer", i, buf[i])
			}
		})
	}
}

// TestDirectTagReuse: rank 0 finishes an all-gather with explicit tag 7 and starts the next
// one with tag 7 while rank 1's is still running (waiting for its last send to go). The new
// call's first frame must wait for rank 1's new call, not land in the old call's buffer —
// which would corrupt the old call's result, and hand the new call a frame whose payload
// lies in a buffer its caller owns again.
func TestDirectTagReuse(t *testing.T) {
	leakcheck.Check(t)
	const size, n, tag = 3, 30, 7
	cfg := testConfig(10 * time.Second)
	_, ts := collective.NewInproc(size, 1)
	ht := newHoldingTransport(ts[1], cfg.ChunkBytes)
	// Rank 1's send at step 1 forwards shard 0 to rank 2: rank 0 needs nothing from it, so it
	// can finish the first call while rank 1 cannot.
	ht.sendHold = func(h collective.Header) bool { return h.Kind == collective.KindData && h.Step == 1 }
	trs := []collective.Transport{ts[0], ht, ts[2]}
	rings := make([]*collective.Ring, size)
	for r := range size {
		ring, err := collective.NewRing(trs[r], cfg)
		if err != nil {
			t.Fatal(err)
		}
		rings[r] = ring
	}
	t.Cleanup(func() {
		for r := range size {
			rings[r].Close()
			ts[r].Close()
		}
	})
	shards := collective.EvenShards(n, size)
	input := func(buf []float32, r int, base float32) {
		fill(buf[shards[r]:shards[r+1]], base+float32(r))
	}
	check := func(what string, buf []float32, base float32) {
		t.Helper()
		for r := range size {
			if i := intact(buf[shards[r]:shards[r+1]], base+float32(r)); i >= 0 {
				t.Errorf("%s: element %d = %v, want %v", what, shards[r]+i, buf[shards[r]+i], base+float32(r))
				return
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	call := collective.Call{Tag: tag}
	errc := make(chan error, 4)
	for _, r := range []int{0, 2} {
		go func() {
			a, b := make([]float32, n), make([]float32, n)
			input(a, r, 100)
			input(b, r, 200)
			if err := rings[r].AllGather(ctx, a, shards, call); err != nil {
				errc <- fmt.Errorf("rank %d, first call: %w", r, err)
				return
			}
			errc <- rings[r].AllGather(ctx, b, shards, call)
		}()
	}
	a := make([]float32, n)
	input(a, 1, 100)
	ac := make(chan error, 1)
	go func() { ac <- rings[1].AllGather(ctx, a, shards, call) }()
	// Rank 1 has received both frames of the first call and the second call's first.
	for range 3 {
		select {
		case <-ht.recvd:
		case <-time.After(10 * time.Second):
			t.Fatal("rank 1 did not receive the frames")
		}
	}
	close(ht.sendGo)
	if err := <-ac; err != nil {
		t.Fatalf("rank 1, first call: %v", err)
	}
	check("rank 1, first call", a, 100)
	fill(a, sentinel) // the caller's again

	b := make([]float32, n)
	input(b, 1, 200)
	if err := rings[1].AllGather(ctx, b, shards, call); err != nil {
		t.Fatalf("rank 1, second call: %v", err)
	}
	check("rank 1, second call", b, 200)
	if i := intact(a, sentinel); i >= 0 {
		t.Errorf("the first call's buffer changed after it returned: element %d = %v", i, a[i])
	}
	for range 2 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
}
