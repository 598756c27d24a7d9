package collective_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
	"github.com/qvd/qvd/internal/half"
)

// onAll runs fn on every rank at once and returns each rank's error and how long the
// slowest took; it fails the test if they have not all returned within a minute.
func onAll(t *testing.T, rings []*collective.Ring, fn func(ctx context.Context, r int, ring *collective.Ring) error) ([]error, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errs := make([]error, len(rings))
	start := time.Now()
	var wg sync.WaitGroup
	for r, ring := range rings {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = fn(ctx, r, ring)
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(70 * time.Second):
		t.Fatal("hang: the ranks did not return")
	}
	return errs, time.Since(start)
}

// intInputs gives rank r the buffer x[i] = (r+1)*(i%97) - 40, whose sums are exact.
func intInputs(n, length int) [][]float32 {
	bufs := make([][]float32, n)
	for r := range bufs {
		bufs[r] = make([]float32, length)
		for i := range bufs[r] {
			bufs[r][i] = float32((r+1)*(i%97) - 40)
		}
	}
	return bufs
}

func checkIntSum(t *testing.T, bufs [][]float32) {
	t.Helper()
	n := len(bufs)
	for r, b := range bufs {
		for i, v := range b {
			if want := float32(n*(n+1)/2*(i%97) - 40*n); v != want {
				t.Fatalf("rank %d element %d = %v, want %v", r, i, v, want)
			}
		}
	}
}

func allReduceAll(bufs [][]float32, op collective.Op, c collective.Call) func(ctx context.Context, r int, ring *collective.Ring) error {
	return func(ctx context.Context, r int, ring *collective.Ring) error {
		return ring.AllReduce(ctx, bufs[r], op, c)
	}
}

func TestRingSizeOne(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	rings, _, _ := inprocGroup(t, 1, testConfig(time.Second))
	r := rings[0]
	ctx := context.Background()
	x := []float32{1.0001, -3, 7.77}
	want := append([]float32(nil), x...)
	for _, w := range []half.Format{half.FP32, half.FP16, half.BF16} {
		for _, op := range []collective.Op{collective.Sum, collective.Avg, collective.Max} {
			if err := r.AllReduce(ctx, x, op, collective.Call{Wire: w}); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.ReduceScatter(ctx, x, collective.Shards{0, 3}, collective.Avg, collective.Call{Wire: w}); err != nil {
			t.Fatal(err)
		}
		if err := r.AllGather(ctx, x, collective.Shards{0, 3}, collective.Call{Wire: w}); err != nil {
			t.Fatal(err)
		}
		if err := r.Broadcast(ctx, x, 0, collective.Call{Wire: w}); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range x {
		if x[i] != want[i] {
			t.Fatalf("a group of one changed the data: %v, want %v", x, want)
		}
	}
	if err := r.AllGather(ctx, x, collective.Shards{0, 2}, collective.Call{}); err == nil {
		t.Error("bad shards accepted")
	}
	if err := r.Broadcast(ctx, x, 1, collective.Call{}); err == nil {
		t.Error("root 1 of a group of one accepted")
	}
	r.Close()
	if err := r.AllReduce(ctx, x, collective.Sum, collective.Call{}); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
}

func TestNewRingConfig(t *testing.T) {
	_, ts := collective.NewInproc(2, 1)
	defer ts[0].Close()
	defer ts[1].Close()
	for _, cfg := range []collective.Config{
		{Transport: "inproc", Timeout: time.Millisecond, ChunkBytes: 1 << 16},
		{Transport: "inproc", Timeout: time.Second, ChunkBytes: 100},
		{Transport: "carrier-pigeon", Timeout: time.Second, ChunkBytes: 1 << 16},
		{Transport: "inproc", Timeout: time.Second, ChunkBytes: 1 << 16, ShmChunkBytes: 100},
	} {
		if _, err := collective.NewRing(ts[0], cfg); err == nil {
			t.Errorf("NewRing accepted %+v", cfg)
		}
	}
	// ForShm: shared memory's pieces where set, chunk_bytes' otherwise.
	c := collective.DefaultConfig()
	c.ShmChunkBytes = 2 << 20
	if got := c.ForShm().ChunkBytes; got != c.ShmChunkBytes || got == c.ChunkBytes {
		t.Errorf("ForShm with shm_chunk_bytes 2 MiB: %d-byte pieces, want %d", got, c.ShmChunkBytes)
	}
	c.ShmChunkBytes = 0
	if got := c.ForShm().ChunkBytes; got != c.ChunkBytes {
		t.Errorf("ForShm with shm_chunk_bytes 0: %d-byte pieces, want chunk_bytes' %d", got, c.ChunkBytes)
	}
}

// TestRingInvalidArgs: a rank that rejects its own arguments fails at once and aborts the
// call on the others, which name it.
func TestRingInvalidArgs(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	rings, _, _ := inprocGroup(t, 3, testConfig(5*time.Second))
	errs, el := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
		shards := collective.EvenShards(30, 3)
		if r == 1 {
			shards = collective.Shards{0, 10, 40, 30} // decreasing bound
		}
		return ring.ReduceScatter(ctx, make([]float32, 30), shards, collective.Sum, collective.Call{})
	})
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "must not decrease") {
		t.Errorf("rank 1 with bad shards: %v", errs[1])
	}
	for _, r := range []int{0, 2} {
		var pe *collective.PeerError
		if !errors.As(errs[r], &pe) || pe.Rank != 1 || !errors.Is(errs[r], collective.ErrAborted) {
			t.Errorf("rank %d: %v, want an abort naming rank 1", r, errs[r])
		}
	}
	if el > 2*time.Second {
		t.Errorf("took %v: the abort should be immediate", el)
	}

	ctx := context.Background()
	buf := make([]float32, 4)
	for name, err := range map[string]error{
		"root":     rings[0].Broadcast(ctx, buf, 3, collective.Call{}),
		"negative": rings[0].Broadcast(ctx, buf, -1, collective.Call{}),
		"op":       rings[0].AllReduce(ctx, buf, collective.Op(9), collective.Call{}),
		"wire":     rings[0].AllReduce(ctx, buf, collective.Sum, collective.Call{Wire: half.Format(7)}),
		"tag":      rings[0].AllReduce(ctx, buf, collective.Sum, collective.Call{Tag: collective.MaxUserTag}),
		"shards":   rings[0].AllGather(ctx, buf, collective.Shards{0, 4}, collective.Call{}),
	} {
		if err == nil {
			t.Errorf("%s: bad argument accepted", name)
		}
	}
}

func TestRingDuplicateTag(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	ring, peer := fakePrev(t, 5*time.Second)
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { first <- ring.AllReduce(ctx, make([]float32, 8), collective.Sum, collective.Call{Tag: 5}) }()
	// The first frame the ring sends proves its call with tag 5 is running.
	h, _, err := peer.Recv(ctx, 1, make([]byte, 1<<16))
	if err != nil || h.Tag != 5 {
		t.Fatalf("first frame: %+v, %v", h, err)
	}
	err = ring.AllReduce(ctx, make([]float32, 8), collective.Sum, collective.Call{Tag: 5})
	if err == nil || !strings.Contains(err.Error(), "already used") {
		t.Fatalf("duplicate concurrent tag: %v, want an error", err)
	}
	// Another tag runs alongside.
	go func() { _ = ring.Broadcast(ctx, make([]float32, 8), 1, collective.Call{Tag: 6}) }()
	h, _, err = peer.Recv(ctx, 1, make([]byte, 1<<16))
	if err != nil || h.Tag != 6 || h.Op != collective.OpBroadcast {
		t.Fatalf("second call's frame: %+v, %v", h, err)
	}
	ring.Close()
	if err := <-first; !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("first call after Close: %v", err)
	}
}

// TestRingTagReuse reuses one explicit tag call after call: a fast rank's frames for the
// next call may arrive while a slow rank is still finishing the previous one.
func TestRingTagReuse(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	for _, n := range []int{2, 3} {
		rings, _, _ := inprocGroup(t, n, testConfig(5*time.Second))
		const calls = 30
		out := make([][][]float32, calls)
		for k := range out {
			out[k] = intInputs(n, 50+k)
		}
		errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
			for k := range calls {
				if err := ring.AllReduce(ctx, out[k][r], collective.Sum, collective.Call{Tag: 3}); err != nil {
					return err
				}
			}
			return nil
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		for k := range out {
			checkIntSum(t, out[k])
		}
	}
}

func TestRingClose(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	rings, _, _ := inprocGroup(t, 2, testConfig(10*time.Second))
	errc := make(chan error, 1)
	go func() {
		errc <- rings[0].AllReduce(context.Background(), make([]float32, 10), collective.Sum, collective.Call{})
	}()
	time.Sleep(20 * time.Millisecond) // rank 1 never calls: rank 0 waits
	rings[0].Close()
	select {
	case err := <-errc:
		if !errors.Is(err, collective.ErrClosed) {
			t.Errorf("call cut by Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end the running call")
	}
	rings[0].Close()
	if err := rings[0].Barrier(context.Background()); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
}

func TestRingContext(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	rings, _, _ := inprocGroup(t, 2, testConfig(10*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	err := rings[0].AllReduce(ctx, make([]float32, 10), collective.Sum, collective.Call{})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("got %v, want DeadlineExceeded", err)
	}
}

func TestRingBufferBytes(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	cfg := testConfig(10 * time.Second)
	rings, _, _ := inprocGroup(t, 3, cfg)
	bufs := intInputs(3, 1<<18)
	errs, _ := onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{Wire: half.BF16}))
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for r, ring := range rings {
		b := ring.BufferBytes()
		if limit := int64(17 * cfg.ChunkBytes); b <= 0 || b > limit {
			t.Errorf("rank %d holds %d buffer bytes, want (0, %d]", r, b, limit)
		}
	}
}

// TestRingAllocs checks that a call in steady state allocates only small bookkeeping.
func TestRingAllocs(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation counts need a quiet process")
	}
	collectivetest.CheckGoroutines(t)
	const n = 4
	rings, _, _ := inprocGroup(t, n, testConfig(10*time.Second))
	w := startWorkers(rings, 1<<16, collective.Avg, collective.Call{Wire: half.FP16})
	defer w.stop()
	w.round() // warm the pools
	w.round()
	allocs := testing.AllocsPerRun(20, w.round)
	t.Logf("%.1f allocations per all-reduce over %d ranks", allocs, n)
	if allocs > 6*n {
		t.Errorf("%.1f allocations per all-reduce over %d ranks, want at most %d", allocs, n, 6*n)
	}
	if err := w.err(); err != nil {
		t.Fatal(err)
	}
}

// workers are persistent rank goroutines that run one all-reduce per round, so that
// measuring a round counts the collective and not goroutine start-up.
type workers struct {
	start []chan struct{}
	done  chan error
	errs  []error
	mu    sync.Mutex
	wg    sync.WaitGroup
}

func startWorkers(rings []*collective.Ring, length int, op collective.Op, c collective.Call) *workers {
	w := &workers{done: make(chan error, len(rings))}
	for r, ring := range rings {
		ch := make(chan struct{})
		w.start = append(w.start, ch)
		buf := make([]float32, length)
		for i := range buf {
			buf[i] = float32(i%13) * 0.5
		}
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			for range ch {
				w.done <- ring.AllReduce(context.Background(), buf, op, c)
			}
		}()
		_ = r
	}
	return w
}

func (w *workers) round() {
	for _, ch := range w.start {
		ch <- struct{}{}
	}
	for range w.start {
		if err := <-w.done; err != nil {
			w.mu.Lock()
			w.errs = append(w.errs, err)
			w.mu.Unlock()
		}
	}
}

func (w *workers) err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return errors.Join(w.errs...)
}

func (w *workers) stop() {
	for _, ch := range w.start {
		close(ch)
	}
	w.wg.Wait()
}

// --- Faults injected with InprocNet ---

func TestPartitionThenHeal(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const timeout = 300 * time.Millisecond
	rings, net, _ := inprocGroup(t, 4, testConfig(timeout))
	net.Partition([]int{0, 1}, []int{2, 3})
	bufs := intInputs(4, 20000)
	errs, el := onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{}))
	for r, err := range errs {
		var pe *collective.PeerError
		if !errors.As(err, &pe) {
			t.Errorf("rank %d across a partition: %v, want a *PeerError", r, err)
		}
	}
	// The ranks just after the cut (2 and 0) hear nothing and blame 1 and 3.
	for _, c := range []struct{ r, blamed int }{{2, 1}, {0, 3}} {
		var pe *collective.PeerError
		if !errors.As(errs[c.r], &pe) || pe.Rank != c.blamed || !errors.Is(errs[c.r], collective.ErrTimeout) {
			t.Errorf("rank %d: %v, want a timeout naming rank %d", c.r, errs[c.r], c.blamed)
		}
	}
	if limit := 2*timeout + 500*time.Millisecond; el > limit {
		t.Errorf("failing took %v, want at most %v", el, limit)
	}
	net.Heal()
	// Frames held by the partition now arrive for a call that has finished: they must be
	// dropped, and the next call must work.
	bufs = intInputs(4, 20000)
	errs, _ = onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{}))
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("after Heal: %v", err)
	}
	checkIntSum(t, bufs)
}

func TestDropLink(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const timeout = 300 * time.Millisecond
	rings, net, _ := inprocGroup(t, 3, testConfig(timeout))
	net.SetDrop(1, 2, 1)
	bufs := intInputs(3, 5000)
	errs, el := onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{}))
	var pe *collective.PeerError
	if !errors.As(errs[2], &pe) || pe.Rank != 1 || !errors.Is(errs[2], collective.ErrTimeout) {
		t.Errorf("rank 2 behind the dropping link: %v, want a timeout naming rank 1", errs[2])
	}
	for r, err := range errs {
		if !errors.As(err, &pe) || pe.Rank != 1 {
			t.Errorf("rank %d: %v, want a *PeerError naming rank 1", r, err)
		}
	}
	if limit := timeout + timeout/2 + 500*time.Millisecond; el > limit {
		t.Errorf("failing took %v, want at most %v", el, limit)
	}
	net.SetDrop(1, 2, 0)
	bufs = intInputs(3, 5000)
	errs, _ = onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{}))
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("after the link recovered: %v", err)
	}
	checkIntSum(t, bufs)
}

func TestDelayedLinks(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const n, delay = 3, 10 * time.Millisecond
	rings, net, _ := inprocGroup(t, n, testConfig(5*time.Second))
	for r := range n {
		net.SetDelay(r, (r+1)%n, delay)
	}
	bufs := intInputs(n, 30000) // several pieces per shard
	errs, el := onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{}))
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	checkIntSum(t, bufs)
	// 2(N-1) steps, each waiting at least one delay for its first piece.
	if min := time.Duration(2*(n-1)) * delay; el < min {
		t.Errorf("all-reduce over delayed links took %v, less than %v", el, min)
	}
}

func TestKillMidCall(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const n, dead, timeout = 5, 3, 500 * time.Millisecond
	rings, net, _ := inprocGroup(t, n, testConfig(timeout))
	// Slow links keep the call running when the kill comes.
	for r := range n {
		net.SetDelay(r, (r+1)%n, 20*time.Millisecond)
	}
	bufs := intInputs(n, 50000)
	time.AfterFunc(30*time.Millisecond, func() { net.Kill(dead) })
	errs, el := onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{}))
	for r, err := range errs {
		if r == dead {
			continue
		}
		var pe *collective.PeerError
		if !errors.As(err, &pe) || pe.Rank != dead {
			t.Errorf("rank %d: %v, want a *PeerError naming the dead rank %d", r, err, dead)
		}
	}
	if el > timeout {
		t.Errorf("survivors took %v to fail, want well within the %v timeout", el, timeout)
	}
}

// --- Frames crafted by a fake predecessor ---

// fakePrev makes a group of two where rank 1 is a Ring and rank 0 is a bare transport the
// test writes frames with. Rank 1 runs an all-reduce of 8 elements (shards [0,4) and
// [4,8)), whose first expected frame is goodHeader.
func fakePrev(t *testing.T, timeout time.Duration) (*collective.Ring, collective.Transport) {
	t.Helper()
	_, ts := collective.NewInproc(2, 1)
	ring, err := collective.NewRing(ts[1], testConfig(timeout))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ring.Close(); ts[0].Close(); ts[1].Close() })
	return ring, ts[0]
}

var goodHeader = collective.Header{
	Kind: collective.KindData, DType: collective.DTypeFP32, Op: collective.OpAllReduce, Src: 0,
	Tag: collective.MaxUserTag, Step: 0, Piece: 0, Offset: 4, Count: 4, Length: 16,
}

func TestBadFrames(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	payload := func(n int) []byte { return make([]byte, n) }
	cases := []struct {
		name string
		h    func(h *collective.Header)
		p    []byte
		want error
	}{
		{"op", func(h *collective.Header) { h.Op = collective.OpBroadcast }, nil, collective.ErrProtocol},
		{"dtype", func(h *collective.Header) { h.DType, h.Length = collective.DTypeFP16, 8 }, payload(8), collective.ErrProtocol},
		{"step", func(h *collective.Header) { h.Step = 1 }, nil, collective.ErrProtocol},
		{"piece", func(h *collective.Header) { h.Piece = 1 }, nil, collective.ErrProtocol},
		{"offset", func(h *collective.Header) { h.Offset = 0 }, nil, collective.ErrProtocol},
		{"offset-huge", func(h *collective.Header) { h.Offset = math.MaxUint64 }, nil, collective.ErrProtocol},
		{"count", func(h *collective.Header) { h.Count, h.Length = 3, 12 }, payload(12), collective.ErrProtocol},
		{"length", func(h *collective.Header) { h.Length = 12 }, payload(12), collective.ErrProtocol},
		{"src", func(h *collective.Header) { h.Src = 1 }, nil, collective.ErrProtocol},
		{"kind", func(h *collective.Header) { h.Kind = collective.KindHello }, nil, collective.ErrProtocol},
		{"oversize", func(h *collective.Header) { h.Count, h.Length = 1<<16, 1<<18 }, payload(1 << 18), collective.ErrProtocol},
		{"abort-bad-rank", func(h *collective.Header) {
			*h = collective.Header{Kind: collective.KindAbort, Tag: collective.MaxUserTag, Step: 9, Length: 3}
		}, []byte("why"), collective.ErrProtocol},
		{"tag", func(h *collective.Header) { h.Tag = 77 }, nil, collective.ErrProtocol}, // found at the timeout
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ring, peer := fakePrev(t, 200*time.Millisecond)
			h := goodHeader
			p := payload(16)
			tc.h(&h)
			if tc.p != nil {
				p = tc.p
			}
			errc := make(chan error, 1)
			go func() {
				errc <- ring.AllReduce(context.Background(), make([]float32, 8), collective.Sum, collective.Call{})
			}()
			if err := peer.Send(context.Background(), 1, h, p); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-errc:
				var pe *collective.PeerError
				if !errors.As(err, &pe) || pe.Rank != 0 || !errors.Is(err, tc.want) {
					t.Errorf("got %v, want a *PeerError naming rank 0 wrapping %v", err, tc.want)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the call did not fail")
			}
		})
	}
}

// TestGoodFramesFromFake checks the other side: a fake predecessor that speaks the protocol
// correctly gets the correct result, and a valid abort names the rank it says.
func TestGoodFramesFromFake(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	ring, peer := fakePrev(t, 2*time.Second)
	ctx := context.Background()
	buf := []float32{1, 2, 3, 4, 5, 6, 7, 8}
	errc := make(chan error, 1)
	go func() { errc <- ring.AllReduce(ctx, buf, collective.Sum, collective.Call{}) }()
	f32 := func(v ...float32) []byte {
		b := make([]byte, 4*len(v))
		for i, x := range v {
			bits := math.Float32bits(x)
			b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(bits), byte(bits>>8), byte(bits>>16), byte(bits>>24)
		}
		return b
	}
	// Reduce-scatter: rank 1 owns [4, 8) and receives rank 0's values for it.
	if err := peer.Send(ctx, 1, goodHeader, f32(10, 20, 30, 40)); err != nil {
		t.Fatal(err)
	}
	// All-gather: rank 0's reduced shard [0, 4).
	h := goodHeader
	h.Step, h.Offset = 1, 0
	if err := peer.Send(ctx, 1, h, f32(-1, -2, -3, -4)); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if want := []float32{-1, -2, -3, -4, 15, 26, 37, 48}; fmt.Sprint(buf) != fmt.Sprint(want) {
		t.Errorf("result %v, want %v", buf, want)
	}

	go func() { errc <- ring.AllReduce(ctx, buf, collective.Sum, collective.Call{}) }()
	abort := collective.Header{Kind: collective.KindAbort, Op: collective.OpAllReduce, Src: 0,
		Tag: collective.MaxUserTag + 1, Step: 0, Piece: 0, Length: 4}
	if err := peer.Send(ctx, 1, abort, []byte("boom")); err != nil {
		t.Fatal(err)
	}
	err := <-errc
	var pe *collective.PeerError
	if !errors.As(err, &pe) || pe.Rank != 0 || !errors.Is(err, collective.ErrAborted) || !strings.Contains(err.Error(), "boom") {
		t.Errorf("got %v, want an abort naming rank 0 with its reason", err)
	}
}

// TestRingBackpressure lets a broadcast root run far ahead of a rank that has not started:
// the frames queue up to the Ring's bound, then the root's sends stall until the late rank
// starts; nothing is lost or reordered, and the late rank's buffers stay bounded.
func TestRingBackpressure(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const n, calls = 3, 60
	cfg := testConfig(5 * time.Second)
	rings, _, _ := inprocGroup(t, n, cfg)
	out := make([][][]float32, calls)
	for k := range out {
		out[k] = make([][]float32, n)
		for r := range n {
			out[k][r] = make([]float32, 3000) // one piece
			if r == 0 {
				for i := range out[k][r] {
					out[k][r][i] = float32(k*10000 + i)
				}
			}
		}
	}
	errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
		if r == 2 {
			time.Sleep(100 * time.Millisecond)
			if b := ring.BufferBytes(); b > 16*int64(cfg.ChunkBytes) {
				return fmt.Errorf("late rank holds %d bytes of frames", b)
			}
		}
		for k := range calls {
			if err := ring.Broadcast(ctx, out[k][r], 0, collective.Call{}); err != nil {
				return fmt.Errorf("broadcast %d: %w", k, err)
			}
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for k := range calls {
		for r := range n {
			for i, v := range out[k][r] {
				if v != float32(k*10000+i) {
					t.Fatalf("broadcast %d rank %d element %d = %v", k, r, i, v)
				}
			}
		}
	}
}

// TestRingExplicitTagAfterFailure: a call with an explicit tag fails on one rank; its
// partner call on the other rank is aborted at once (even though it starts later), and after
// a Barrier the tag works again: no stale frame or abort of the failed call leaks into it.
func TestRingExplicitTagAfterFailure(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	rings, _, _ := inprocGroup(t, 2, testConfig(5*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := rings[0].AllReduce(ctx, make([]float32, 100), collective.Sum, collective.Call{Tag: 9}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("rank 0 alone: %v", err)
	}
	start := time.Now()
	err := rings[1].AllReduce(context.Background(), make([]float32, 100), collective.Sum, collective.Call{Tag: 9})
	var pe *collective.PeerError
	if !errors.As(err, &pe) || pe.Rank != 0 || !errors.Is(err, collective.ErrAborted) || time.Since(start) > time.Second {
		t.Fatalf("rank 1's partner call: %v after %v, want an immediate abort naming rank 0", err, time.Since(start))
	}
	errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error { return ring.Barrier(ctx) })
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	bufs := intInputs(2, 100)
	errs, _ = onAll(t, rings, allReduceAll(bufs, collective.Sum, collective.Call{Tag: 9}))
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	checkIntSum(t, bufs)
}
