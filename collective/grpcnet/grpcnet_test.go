package grpcnet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/qvd/qvd/collective"
)

var secret = []byte("the job's secret")

// exchange sends one frame from src to dst and checks what arrives.
func exchange(t *testing.T, ctx context.Context, tr []*transport, src, dst, n int, seed uint64) {
	t.Helper()
	payload := make([]byte, n)
	pattern(payload, seed)
	h := dataHeader(src, n, 7, uint32(seed))
	h.Step, h.Offset = 3, 12345
	errc := make(chan error, 1)
	go func() { errc <- tr[src].Send(ctx, dst, h, payload) }()
	buf := make([]byte, n+16)
	got, p, err := tr[dst].Recv(ctx, src, buf)
	if err != nil {
		t.Fatalf("recv %d bytes %d→%d: %v", n, src, dst, err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("send %d bytes %d→%d: %v", n, src, dst, err)
	}
	if got != h {
		t.Fatalf("header %+v, sent %+v", got, h)
	}
	if !bytes.Equal(p, payload) {
		t.Fatalf("%d bytes %d→%d: payload differs at byte %d", n, src, dst, firstDiff(p, payload))
	}
	if n > 0 && &p[0] != &buf[0] {
		t.Fatalf("Recv returned a slice outside the caller's buffer")
	}
}

func TestRoundTrip(t *testing.T) {
	for _, mem := range []bool{false, true} {
		name := map[bool]string{false: "tcp", true: "bufconn"}[mem]
		t.Run(name, func(t *testing.T) {
			leakCheck(t)
			var nodes []*node
			if mem {
				nodes = memNodes(t, testTuning(), 2)
			} else {
				nodes = tcpNodes(t, testTuning(), 2)
			}
			tr := group(t, "job", secret, nodes, nil)
			ctx := ctxFor(t, 30*time.Second)
			for i, n := range []int{0, 1, 40 << 10, smallPayload, smallPayload + 4, 8 << 20} {
				exchange(t, ctx, tr, 0, 1, n, uint64(i))
				exchange(t, ctx, tr, 1, 0, n, uint64(i+100))
			}
			if tr[0].Rank() != 0 || tr[0].Size() != 2 || tr[0].Addr(1) != nodes[1].addr || tr[0].Addr(0) != "" {
				t.Fatalf("Rank/Size/Addr: %d %d %q %q", tr[0].Rank(), tr[0].Size(), tr[0].Addr(1), tr[0].Addr(0))
			}
		})
	}
}

// Frames of several senders travel concurrently; each pair's frames arrive in order, and
// two goroutines sending to one peer never interleave their frames' bytes.
func TestFIFOConcurrentSenders(t *testing.T) {
	leakCheck(t)
	const n, k = 4, 24
	tr := group(t, "job", secret, tcpNodes(t, testTuning(), n), nil)
	ctx := ctxFor(t, 60*time.Second)
	sizes := []int{100, 64<<10 + 4, 200 << 10, 0, 33 << 10, 3}
	seed := func(s, d int, tag uint64, i uint32) uint64 {
		return uint64(s)<<48 | uint64(d)<<32 | tag<<24 | uint64(i)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4*n*n)
	for s := 0; s < n; s++ {
		for d := 0; d < n; d++ {
			if s == d {
				continue
			}
			for tag := uint64(1); tag <= 2; tag++ {
				wg.Go(func() {
					buf := make([]byte, 256<<10)
					for i := uint32(0); i < k; i++ {
						p := buf[:sizes[(int(i)+int(tag))%len(sizes)]]
						pattern(p, seed(s, d, tag, i))
						if err := tr[s].Send(ctx, d, dataHeader(s, len(p), tag, i), p); err != nil {
							errs <- fmt.Errorf("send %d→%d: %w", s, d, err)
							return
						}
					}
				})
			}
			wg.Go(func() {
				buf := make([]byte, 256<<10)
				next := map[uint64]uint32{1: 0, 2: 0}
				for j := 0; j < 2*k; j++ {
					h, p, err := tr[d].Recv(ctx, s, buf)
					if err != nil {
						errs <- fmt.Errorf("recv %d→%d: %w", s, d, err)
						return
					}
					if h.Piece != next[h.Tag] {
						errs <- fmt.Errorf("%d→%d tag %d: frame %d arrived when %d was due", s, d, h.Tag, h.Piece, next[h.Tag])
						return
					}
					next[h.Tag]++
					if err := checkPattern(p, seed(s, d, h.Tag, h.Piece)); err != nil {
						errs <- fmt.Errorf("%d→%d tag %d frame %d: %w", s, d, h.Tag, h.Piece, err)
						return
					}
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// The hazard of a zero-copy codec: SendMsg returns before gRPC has copied the payload, so a
// caller that reuses its buffer at once would corrupt frames still queued. Send must return
// only when the bytes are safe to overwrite; the sender here overwrites them immediately.
// (With Send returning as soon as SendMsg returned, this test saw corrupt frames.)
func TestPayloadReuseAfterSend(t *testing.T) {
	for _, procs := range []int{1, runtime.GOMAXPROCS(0)} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			leakCheck(t)
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			tr := group(t, "job", secret, tcpNodes(t, testTuning(), 2), nil)
			ctx := ctxFor(t, 60*time.Second)
			const frames = 120
			sizes := []int{512 << 10, 16 << 10, 1<<20 + 4, 40 << 10}
			errc := make(chan error, 1)
			go func() {
				buf := make([]byte, 1<<20+4)
				for i := 0; i < frames; i++ {
					p := buf[:sizes[i%len(sizes)]]
					pattern(p, uint64(i))
					if err := tr[0].Send(ctx, 1, dataHeader(0, len(p), 1, uint32(i)), p); err != nil {
						errc <- err
						return
					}
					for j := range p {
						p[j] = 0xEE
					}
				}
				errc <- nil
			}()
			buf := make([]byte, 1<<20+4)
			corrupt := 0
			for i := 0; i < frames; i++ {
				h, p, err := tr[1].Recv(ctx, 0, buf)
				if err != nil {
					t.Fatal(err)
				}
				if err := checkPattern(p, uint64(h.Piece)); err != nil {
					corrupt++
					if corrupt < 4 {
						t.Errorf("frame %d: %v", h.Piece, err)
					}
				}
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if corrupt > 0 {
				t.Fatalf("%d of %d frames corrupted by reusing the payload after Send", corrupt, frames)
			}
		})
	}
}

func TestWrongSecretRefused(t *testing.T) {
	leakCheck(t)
	nodes := tcpNodes(t, testTuning(), 2)
	a := group(t, "job", []byte("secret A"), nodes[:1], []string{nodes[0].addr, nodes[1].addr})
	addrs := []string{nodes[0].addr, nodes[1].addr}
	tb, err := nodes[1].hub.Transport(context.Background(), Group{Roster: collective.Roster{Job: "job", Rank: 1, Addrs: addrs, Secret: []byte("secret B")}})
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close()
	ctx := ctxFor(t, 10*time.Second)

	err = a[0].Send(ctx, 1, dataHeader(0, 8, 1, 0), make([]byte, 8))
	isPeerErr(t, err, 1, collective.ErrAuth)
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("status %v, want Unauthenticated: %v", status.Code(err), err)
	}
	t.Logf("sender's error: %v", err)
	// The link stays refused.
	err = a[0].Send(ctx, 1, dataHeader(0, 8, 1, 1), make([]byte, 8))
	isPeerErr(t, err, 1, collective.ErrAuth)

	// Nothing was delivered: rank 1's Recv from rank 0 waits until its ctx ends.
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, _, err := tb.Recv(short, 0, make([]byte, 64)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("recv after a refused stream: %v, want the ctx's deadline", err)
	}
	// Rank 1 is refused by rank 0 in turn; that fails its link to rank 0 both ways.
	err = tb.Send(ctx, 0, dataHeader(1, 8, 1, 0), make([]byte, 8))
	isPeerErr(t, err, 0, collective.ErrAuth)
	_, _, err = tb.Recv(ctx, 0, make([]byte, 64))
	isPeerErr(t, err, 0, collective.ErrAuth)
	if r := nodes[1].refusals(); len(r) == 0 || !strings.Contains(strings.Join(r, "\n"), "signature") {
		t.Fatalf("rank 1's hub logged %q, want a refusal for a bad signature", r)
	}
}

// A stream claiming a job its receiver does not run is refused once the receiver has
// waited for the job to register; the sender retries within its ctx.
func TestUnknownJobRefused(t *testing.T) {
	leakCheck(t)
	tune := testTuning()
	tune.handshake = 200 * time.Millisecond
	nodes := tcpNodes(t, tune, 2)
	addrs := []string{nodes[0].addr, nodes[1].addr}
	a := group(t, "job-a", secret, nodes[:1], addrs)
	b, err := nodes[1].hub.Transport(context.Background(), Group{Roster: collective.Roster{Job: "job-b", Rank: 1, Addrs: addrs, Secret: secret}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := ctxFor(t, 10*time.Second)
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	err = a[0].Send(short, 1, dataHeader(0, 8, 1, 0), make([]byte, 8))
	isPeerErr(t, err, 1, context.DeadlineExceeded)
	if !strings.Contains(err.Error(), "not running here") {
		t.Fatalf("error %q does not say the job is not running there", err)
	}
	quick, cancel2 := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel2()
	if _, _, err := b.Recv(quick, 0, make([]byte, 64)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("job-b received from a job-a rank: %v", err)
	}

	// The same Send succeeds once the job registers on the receiver within the ctx.
	go func() {
		time.Sleep(100 * time.Millisecond)
		tr, err := nodes[1].hub.Transport(context.Background(), Group{Roster: collective.Roster{Job: "job-a", Rank: 1, Addrs: addrs, Secret: secret}})
		if err == nil {
			t.Cleanup(func() { _ = tr.Close() })
		}
	}()
	if err := a[0].Send(ctx, 1, dataHeader(0, 8, 1, 0), make([]byte, 8)); err != nil {
		t.Fatalf("send after the job registered late: %v", err)
	}
}

// rawStream opens a frame stream by hand, to play a misbehaving peer.
func rawStream(t *testing.T, ctx context.Context, addr, job string) grpc.ClientStream {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+addr, DialOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	if job != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, jobKey, job)
	}
	cs, err := cc.NewStream(ctx, &framesDesc.Streams[0], fullMethod, grpc.ForceCodecV2(frameCodec{}))
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// streamStatus reads until the stream ends and returns how.
func streamStatus(cs grpc.ClientStream) error {
	f := new(inFrame)
	for {
		if err := cs.RecvMsg(f); err != nil {
			return err
		}
		f.release()
	}
}

func helloOf(rank, size int, job string, key []byte) *rawFrame {
	return newRawFrame(collective.Header{Kind: collective.KindHello, Src: uint16(rank)},
		collective.NewHello(key, job, rank, size, time.Now()))
}

func TestHandshakeRefusals(t *testing.T) {
	leakCheck(t)
	tune := testTuning()
	tune.handshake = 300 * time.Millisecond
	nodes := tcpNodes(t, tune, 2)
	tr := group(t, "job", secret, nodes, nil)
	ctx := ctxFor(t, 10*time.Second)
	addr := nodes[1].addr
	for _, c := range []struct {
		name string
		job  string
		send []*rawFrame
		code codes.Code
		msg  string
	}{
		{"no job claimed", "", []*rawFrame{helloOf(0, 2, "job", secret)}, codes.Unauthenticated, "claims no job"},
		{"no hello", "job", nil, codes.Unauthenticated, "no hello within"},
		{"data before hello", "job", []*rawFrame{newRawFrame(dataHeader(0, 8, 1, 0), make([]byte, 8))}, codes.Unauthenticated, "not a hello"},
		{"garbage before hello", "job", []*rawFrame{{b: []byte("GET / HTTP/1.1")}}, codes.Unauthenticated, "must open with a hello"},
		{"wrong secret", "job", []*rawFrame{helloOf(0, 2, "job", []byte("guess"))}, codes.Unauthenticated, "signature"},
		{"wrong group size", "job", []*rawFrame{helloOf(0, 3, "job", secret)}, codes.Unauthenticated, "group of"},
		{"own rank", "job", []*rawFrame{helloOf(1, 2, "job", secret)}, codes.Unauthenticated, "own rank"},
		{"unknown job", "nojob", []*rawFrame{helloOf(0, 2, "nojob", secret)}, codes.NotFound, "not running here"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cs := rawStream(t, ctx, addr, c.job)
			for _, f := range c.send {
				_ = cs.SendMsg(f)
			}
			err := streamStatus(cs)
			if status.Code(err) != c.code || !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("stream ended with %v, want %v mentioning %q", err, c.code, c.msg)
			}
		})
	}
	// None of it reached the transport.
	quick, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, _, err := tr[1].Recv(quick, 0, make([]byte, 64)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("recv after refused streams: %v", err)
	}
	if n := len(nodes[1].refusals()); n < 8 {
		t.Fatalf("%d refusals logged, want 8", n)
	}

	// A second stream claiming a rank that already has one is refused.
	exchange(t, ctx, tr, 0, 1, 8, 1)
	cs := rawStream(t, ctx, addr, "job")
	_ = cs.SendMsg(helloOf(0, 2, "job", secret))
	if err := streamStatus(cs); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("duplicate stream ended with %v, want AlreadyExists", err)
	}
	exchange(t, ctx, tr, 0, 1, 8, 2)
}

// A peer's malformed frame fails Recv with ErrProtocol naming it (after the good frames
// before it), ends its stream with InvalidArgument, and never panics.
func TestBadFrames(t *testing.T) {
	leakCheck(t)
	nodes := tcpNodes(t, testTuning(), 2)
	ctx := ctxFor(t, 20*time.Second)
	good := newRawFrame(dataHeader(0, 16, 1, 0), make([]byte, 16))
	badMagic := newRawFrame(dataHeader(0, 16, 1, 1), make([]byte, 16))
	badMagic.b[0] ^= 0xFF
	lying := newRawFrame(dataHeader(0, 16, 1, 1), make([]byte, 16))
	lying.b = lying.b[:collective.HeaderSize+8]
	badKind := newRawFrame(dataHeader(0, 16, 1, 1), make([]byte, 16))
	badKind.b[3] = 99
	oversized := &rawFrame{b: make([]byte, collective.HeaderSize)}
	collective.PutHeader(oversized.b, collective.Header{Kind: collective.KindAbort, Length: collective.MaxPayload + 1})
	for i, c := range []struct {
		name  string
		frame *rawFrame
		msg   string
	}{
		{"bad magic", badMagic, "magic"},
		{"short message", &rawFrame{b: []byte("short")}, "shorter than a frame header"},
		{"length mismatch", lying, "the message carries 8"},
		{"unknown kind", badKind, "kind 99"},
		{"wrong sender", newRawFrame(dataHeader(1, 16, 1, 1), make([]byte, 16)), "claiming rank 1"},
		{"hello after handshake", helloOf(0, 2, fmt.Sprint("job", 0), secret), "hello frame after the handshake"},
		{"oversized length", oversized, "exceeds"},
	} {
		t.Run(c.name, func(t *testing.T) {
			job := fmt.Sprint("job", i)
			tr := group(t, job, secret, nodes, nil)
			cs := rawStream(t, ctx, nodes[1].addr, job)
			if err := cs.SendMsg(helloOf(0, 2, job, secret)); err != nil {
				t.Fatal(err)
			}
			ans := new(inFrame)
			if err := cs.RecvMsg(ans); err != nil || ans.hdr.Kind != collective.KindHello {
				t.Fatalf("no answering hello: %v", err)
			}
			ans.release()
			_ = cs.SendMsg(good)
			_ = cs.SendMsg(c.frame)
			buf := make([]byte, 64)
			if _, p, err := tr[1].Recv(ctx, 0, buf); err != nil || len(p) != 16 {
				t.Fatalf("the good frame before the bad one: %v", err)
			}
			_, _, err := tr[1].Recv(ctx, 0, buf)
			isPeerErr(t, err, 0, collective.ErrProtocol)
			if !strings.Contains(err.Error(), c.msg) {
				t.Fatalf("error %q does not mention %q", err, c.msg)
			}
			if st := streamStatus(cs); status.Code(st) != codes.InvalidArgument {
				t.Fatalf("the sender's stream ended with %v, want InvalidArgument", st)
			}
			// Sticky: the link stays failed, in both directions.
			_, _, err2 := tr[1].Recv(ctx, 0, buf)
			isPeerErr(t, err2, 0, collective.ErrProtocol)
			isPeerErr(t, tr[1].Send(ctx, 0, dataHeader(1, 4, 1, 0), make([]byte, 4)), 0, collective.ErrProtocol)
		})
	}
}

func TestRecvBufferTooSmall(t *testing.T) {
	leakCheck(t)
	tr := group(t, "job", secret, tcpNodes(t, testTuning(), 2), nil)
	ctx := ctxFor(t, 10*time.Second)
	if err := tr[0].Send(ctx, 1, dataHeader(0, 1024, 1, 0), make([]byte, 1024)); err != nil {
		t.Fatal(err)
	}
	_, _, err := tr[1].Recv(ctx, 0, make([]byte, 512))
	isPeerErr(t, err, 0, collective.ErrProtocol)
	// The sender learns that its stream was ended.
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := tr[0].Send(ctx, 1, dataHeader(0, 4, 1, 1), make([]byte, 4))
		if err != nil {
			isPeerErr(t, err, 1, collective.ErrProtocol)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sends to a peer that refused a frame still succeed")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestGroupsIsolated(t *testing.T) {
	leakCheck(t)
	nodes := tcpNodes(t, testTuning(), 2)
	j1 := group(t, "job-1", []byte("secret 1"), nodes, nil)
	j2 := group(t, "job-2", []byte("secret 2"), nodes, nil)
	if _, err := nodes[0].hub.Transport(context.Background(), Group{Roster: collective.Roster{Job: "job-1", Rank: 0, Addrs: []string{"a", "b"}, Secret: secret}}); err == nil {
		t.Fatal("a second transport for job-1 on one hub was accepted")
	}
	ctx := ctxFor(t, 10*time.Second)
	for i := 0; i < 5; i++ {
		one, two := []byte("one!"), []byte("two!")
		if err := j1[0].Send(ctx, 1, dataHeader(0, 4, 1, uint32(i)), one); err != nil {
			t.Fatal(err)
		}
		if err := j2[0].Send(ctx, 1, dataHeader(0, 4, 2, uint32(i)), two); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 16)
	for i := 0; i < 5; i++ {
		if h, p, err := j1[1].Recv(ctx, 0, buf); err != nil || string(p) != "one!" || h.Tag != 1 {
			t.Fatalf("job-1 got %q tag %d, %v", p, h.Tag, err)
		}
		if h, p, err := j2[1].Recv(ctx, 0, buf); err != nil || string(p) != "two!" || h.Tag != 2 {
			t.Fatalf("job-2 got %q tag %d, %v", p, h.Tag, err)
		}
	}
	quick, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, _, err := j1[1].Recv(quick, 0, buf); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("job-1 has an extra frame: %v", err)
	}
	// Closing one job leaves the other working.
	_ = j1[0].Close()
	_ = j1[1].Close()
	exchange(t, ctx, j2, 0, 1, 1000, 3)
	exchange(t, ctx, j2, 1, 0, 1000, 4)
}

// A peer whose process dies (its server stops, its connections close) fails Recv and Send
// with ErrPeerGone naming it, at once.
func TestPeerKilled(t *testing.T) {
	leakCheck(t)
	nodes := tcpNodes(t, testTuning(), 3)
	tr := group(t, "job", secret, nodes, nil)
	ctx := ctxFor(t, 20*time.Second)
	exchange(t, ctx, tr, 0, 1, 100, 1)
	exchange(t, ctx, tr, 1, 0, 100, 2)
	exchange(t, ctx, tr, 2, 0, 100, 3)

	recvErr := make(chan error, 1)
	go func() {
		_, _, err := tr[0].Recv(ctx, 1, make([]byte, 64))
		recvErr <- err
	}()
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	// What dies with a process: its server and every connection it dialled.
	nodes[1].srv.Stop()
	for _, p := range tr[1].peers {
		if p != nil {
			p.out.cut()
		}
	}
	err := <-recvErr
	took := time.Since(start)
	isPeerErr(t, err, 1, collective.ErrPeerGone)
	if took > 3*time.Second {
		t.Fatalf("the peer's death was noticed after %v", took)
	}
	t.Logf("noticed in %v: %v", took, err)
	isPeerErr(t, tr[0].Send(ctx, 1, dataHeader(0, 4, 1, 0), make([]byte, 4)), 1, collective.ErrPeerGone)
	// The other peer is unaffected.
	exchange(t, ctx, tr, 2, 0, 100, 4)
	exchange(t, ctx, tr, 0, 2, 100, 5)
}

// A peer that vanishes without closing anything (host frozen, network cut) is noticed by
// the missing heartbeats on the stream to it.
func TestPeerSilentHeartbeat(t *testing.T) {
	leakCheck(t)
	tune := testTuning()
	tune.silenceLimit = time.Second
	nodes := tcpNodes(t, tune, 2)
	to1, to0 := newProxy(t, nodes[1].addr), newProxy(t, nodes[0].addr)
	tr := group(t, "job", secret, nodes, []string{to0.addr(), to1.addr()})
	ctx := ctxFor(t, 20*time.Second)
	exchange(t, ctx, tr, 0, 1, 100, 1)
	exchange(t, ctx, tr, 1, 0, 100, 2)
	to1.freeze()
	to0.freeze()
	start := time.Now()
	sendErr := make(chan error, 1)
	go func() {
		payload := make([]byte, 8<<20)
		for {
			if err := tr[0].Send(ctx, 1, dataHeader(0, len(payload), 1, 0), payload); err != nil {
				sendErr <- err
				return
			}
		}
	}()
	_, _, err := tr[0].Recv(ctx, 1, make([]byte, 64))
	isPeerErr(t, err, 1, collective.ErrPeerGone)
	isPeerErr(t, <-sendErr, 1, collective.ErrPeerGone)
	took := time.Since(start)
	if took > tune.silenceLimit+2*time.Second {
		t.Fatalf("a silent peer was noticed after %v", took)
	}
	if !strings.Contains(err.Error(), "heartbeat") {
		t.Fatalf("error %q does not say the heartbeats stopped", err)
	}
	t.Logf("noticed in %v: %v", took, err)
}

// A rank that only receives from a vanished peer has no outgoing stream to watch; the
// server's keepalive (ServerOptions) notices instead.
func TestPeerSilentKeepalive(t *testing.T) {
	leakCheck(t)
	tune := testTuning()
	tune.silenceLimit = time.Minute // only keepalive may notice
	// gRPC's shortest server keepalive: ping after 1 s of silence, wait 1 s for the answer.
	fast := grpc.KeepaliveParams(keepalive.ServerParameters{Time: time.Second, Timeout: time.Second})
	nodes := tcpNodes(t, tune, 2, fast)
	to0 := newProxy(t, nodes[0].addr)
	tr := group(t, "job", secret, nodes, []string{to0.addr(), nodes[1].addr})
	ctx := ctxFor(t, 20*time.Second)
	exchange(t, ctx, tr, 1, 0, 100, 1)
	to0.freeze()
	start := time.Now()
	_, _, err := tr[0].Recv(ctx, 1, make([]byte, 64))
	took := time.Since(start)
	isPeerErr(t, err, 1, collective.ErrPeerGone)
	if took > 5*time.Second {
		t.Fatalf("a silent peer was noticed after %v", took)
	}
	t.Logf("noticed in %v: %v", took, err)
}

func TestCloseUnblocks(t *testing.T) {
	leakCheck(t)
	tune := testTuning()
	tune.silenceLimit = time.Minute // the frozen peer must not be declared gone first
	nodes := tcpNodes(t, tune, 3)
	to1 := newProxy(t, nodes[1].addr)
	// Rank 2's address accepts connections and never answers.
	hole := newProxy(t, nodes[2].addr)
	hole.freeze()
	tr := group(t, "job", secret, nodes, []string{nodes[0].addr, to1.addr(), hole.addr()})
	ctx := ctxFor(t, 30*time.Second)
	exchange(t, ctx, tr, 0, 1, 100, 1)
	to1.freeze()

	errs := make(chan error, 3)
	go func() { // blocked in Recv
		_, _, err := tr[0].Recv(ctx, 2, make([]byte, 64))
		errs <- fmt.Errorf("recv: %w", err)
	}()
	go func() { // blocked opening a stream
		errs <- fmt.Errorf("open: %w", tr[0].Send(ctx, 2, dataHeader(0, 4, 1, 0), make([]byte, 4)))
	}()
	blocked := make(chan struct{})
	go func() { // blocked on a frame gRPC cannot write
		payload := make([]byte, 8<<20)
		for i := 0; ; i++ {
			done := make(chan error, 1)
			go func() { done <- tr[0].Send(ctx, 1, dataHeader(0, len(payload), 1, uint32(i)), payload) }()
			select {
			case err := <-done:
				if err != nil {
					errs <- fmt.Errorf("send: %w", err)
					return
				}
				continue
			case <-time.After(300 * time.Millisecond):
			}
			close(blocked)
			errs <- fmt.Errorf("send: %w", <-done)
			return
		}
	}()
	<-blocked
	start := time.Now()
	if err := tr[0].Close(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	for i := 0; i < 3; i++ {
		if err := <-errs; !errors.Is(err, collective.ErrClosed) {
			t.Errorf("after Close: %v, want ErrClosed", err)
		}
	}
	if took > 2*time.Second {
		t.Fatalf("Close took %v", took)
	}
	if err := tr[0].Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := tr[0].Send(ctx, 1, dataHeader(0, 4, 1, 0), make([]byte, 4)); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("send after Close: %v", err)
	}
	if _, _, err := tr[0].Recv(ctx, 1, make([]byte, 4)); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("recv after Close: %v", err)
	}
}

// A Send given up on by its ctx while gRPC still holds the frame never lets gRPC put the
// caller's later bytes on the wire: whatever the receiver gets is whole and correct, then
// the link fails.
func TestAbandonedSendNeverCorrupts(t *testing.T) {
	leakCheck(t)
	tune := testTuning()
	tune.silenceLimit = time.Minute
	nodes := tcpNodes(t, tune, 2)
	to1 := newProxy(t, nodes[1].addr)
	tr := group(t, "job", secret, nodes, []string{nodes[0].addr, to1.addr()})
	ctx := ctxFor(t, 30*time.Second)
	exchange(t, ctx, tr, 0, 1, 100, 1)
	to1.freeze()
	payload := make([]byte, 1<<20)
	var abandoned error
	for i := 0; i < 100 && abandoned == nil; i++ {
		pattern(payload, uint64(i))
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		abandoned = tr[0].Send(short, 1, dataHeader(0, len(payload), 1, uint32(i)), payload)
		cancel()
	}
	if !errors.Is(abandoned, context.DeadlineExceeded) {
		t.Fatalf("send to a frozen peer: %v, want the ctx's deadline", abandoned)
	}
	for i := range payload {
		payload[i] = 0xEE
	}
	to1.thaw()
	buf := make([]byte, len(payload))
	got := 0
	for {
		h, p, err := tr[1].Recv(ctx, 0, buf)
		if err != nil {
			isPeerErr(t, err, 0, collective.ErrPeerGone)
			break
		}
		if err := checkPattern(p, uint64(h.Piece)); err != nil {
			t.Fatalf("frame %d: %v", h.Piece, err)
		}
		got++
	}
	// Usually none arrive: cutting the connection resets it, and the proxy's side drops what
	// it had buffered. What matters is that nothing arrives corrupted.
	t.Logf("%d whole frames arrived, then: link failed", got)
	isPeerErr(t, tr[0].Send(ctx, 1, dataHeader(0, 4, 1, 0), make([]byte, 4)), 1, collective.ErrPeerGone)
}

func TestHubClose(t *testing.T) {
	leakCheck(t)
	nodes := tcpNodes(t, testTuning(), 2)
	tr := group(t, "job", secret, nodes, nil)
	ctx := ctxFor(t, 10*time.Second)
	exchange(t, ctx, tr, 0, 1, 100, 1)
	if err := nodes[0].hub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := nodes[0].hub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tr[0].Send(ctx, 1, dataHeader(0, 4, 1, 0), make([]byte, 4)); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("send on a closed hub's transport: %v", err)
	}
	if _, err := nodes[0].hub.Transport(ctx, Group{Roster: collective.Roster{Job: "new", Rank: 0, Addrs: []string{"a", "b"}, Secret: secret}}); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("Transport on a closed hub: %v", err)
	}
	// Rank 1 sees rank 0 go.
	_, _, err := tr[1].Recv(ctx, 0, make([]byte, 4))
	isPeerErr(t, err, 0, collective.ErrPeerGone)
}

func TestBadArguments(t *testing.T) {
	leakCheck(t)
	nodes := tcpNodes(t, testTuning(), 2)
	tr := group(t, "job", secret, nodes, nil)
	ctx := ctxFor(t, 10*time.Second)
	for _, c := range []struct {
		name string
		err  error
	}{
		{"self", tr[0].Send(ctx, 0, dataHeader(0, 4, 1, 0), make([]byte, 4))},
		{"out of range", tr[0].Send(ctx, 5, dataHeader(0, 4, 1, 0), make([]byte, 4))},
		{"length mismatch", tr[0].Send(ctx, 1, dataHeader(0, 8, 1, 0), make([]byte, 4))},
		{"wrong src", tr[0].Send(ctx, 1, dataHeader(1, 4, 1, 0), make([]byte, 4))},
		{"hello kind", tr[0].Send(ctx, 1, collective.Header{Kind: collective.KindHello}, nil)},
		{"bad dtype", tr[0].Send(ctx, 1, collective.Header{Kind: collective.KindData, DType: 9, Op: 1, Length: 4, Count: 1}, make([]byte, 4))},
	} {
		if c.err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
	if _, _, err := tr[0].Recv(ctx, -1, nil); err == nil {
		t.Error("recv from rank -1 accepted")
	}
	// None of them broke the link.
	exchange(t, ctx, tr, 0, 1, 4, 1)
	for _, r := range []collective.Roster{
		{Rank: 0, Addrs: []string{"a"}, Secret: secret},
		{Job: "j", Rank: 2, Addrs: []string{"a", "b"}, Secret: secret},
		{Job: "j", Rank: 0, Addrs: []string{"a", "b"}},
		{Job: "j", Rank: 0, Addrs: []string{"a", ""}, Secret: secret},
		{Job: "j", Rank: 0, Secret: secret},
	} {
		g := Group{Roster: r}
		if _, err := nodes[0].hub.Transport(ctx, g); err == nil {
			t.Errorf("group %+v accepted", g)
		}
	}
}

// Frames nobody receives yet are bounded in bytes, not only in count: beyond inQueueBytes
// the reader stops and flow control holds the sender back.
func TestQueueBoundedInBytes(t *testing.T) {
	leakCheck(t)
	tr := group(t, "job", secret, tcpNodes(t, testTuning(), 2), nil)
	ctx := ctxFor(t, 30*time.Second)
	const frames, size = 12, 8 << 20
	errc := make(chan error, 1)
	go func() {
		payload := make([]byte, size)
		for i := 0; i < frames; i++ {
			pattern(payload, uint64(i))
			if err := tr[0].Send(ctx, 1, dataHeader(0, size, 1, uint32(i)), payload); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	in := &tr[1].peers[0].in
	deadline := time.Now().Add(500 * time.Millisecond)
	for time.Now().Before(deadline) {
		if q := in.queued.Load(); q > inQueueBytes+size {
			t.Fatalf("%d bytes queued for Recv, bound %d", q, inQueueBytes+size)
		}
		time.Sleep(5 * time.Millisecond)
	}
	buf := make([]byte, size)
	for i := 0; i < frames; i++ {
		h, p, err := tr[1].Recv(ctx, 0, buf)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkPattern(p, uint64(h.Piece)); err != nil || h.Piece != uint32(i) {
			t.Fatalf("frame %d (piece %d): %v", i, h.Piece, err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}
