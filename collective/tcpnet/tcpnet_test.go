package tcpnet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

func TestRoundTrip(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 2, testConfig())
	ctx := ctxTimeout(t, 20*time.Second)
	for _, n := range []int{0, 1, 40 << 10, 8 << 20} {
		for _, dir := range [][2]int{{0, 1}, {1, 0}} {
			src, dst := dir[0], dir[1]
			t.Run(fmt.Sprintf("%dB/%d->%d", n, src, dst), func(t *testing.T) {
				payload := make([]byte, n)
				fill(payload, uint64(n))
				h := frameHeader(src, n)
				h.Tag, h.Step, h.Piece, h.Offset = 1<<40+7, 3, 9, 1<<33
				errc := make(chan error, 1)
				go func() { errc <- c.ts[src].Send(ctx, dst, h, payload) }()
				buf := make([]byte, n+13) // larger than needed: Recv must return exactly the frame
				got, p, err := c.ts[dst].Recv(ctx, src, buf)
				if err != nil {
					t.Fatal(err)
				}
				if err := <-errc; err != nil {
					t.Fatal(err)
				}
				if got != h {
					t.Fatalf("header %+v, want %+v", got, h)
				}
				if len(p) != n {
					t.Fatalf("payload of %d bytes, want %d", len(p), n)
				}
				if n > 0 && &p[0] != &buf[0] {
					t.Fatal("payload is not the caller's buffer")
				}
				if err := checkFill(p, uint64(n)); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
	if c.ts[0].Rank() != 0 || c.ts[1].Size() != 2 || c.ts[1].Addr(0) != c.lns[0].Addr() || c.ts[0].Addr(5) != "" {
		t.Fatal("Rank, Size or Addr wrong")
	}
}

// Frames from one rank arrive in order and whole, with several goroutines sending to the
// same peer and several peers sending to one rank at once.
func TestFIFOConcurrentSenders(t *testing.T) {
	checkLeaks(t)
	const (
		ranks    = 3
		senders  = 4   // goroutines per sending rank
		frames   = 150 // per goroutine
		maxBytes = 48 << 10
	)
	c := newCluster(t, ranks, testConfig())
	ctx := ctxTimeout(t, 30*time.Second)
	size := func(g, seq int) int { return ((g*7919 + seq*104729) % (maxBytes / 4)) * 4 }
	var wg sync.WaitGroup
	errs := make(chan error, ranks*senders+ranks)
	for src := 1; src < ranks; src++ {
		for g := 0; g < senders; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				payload := make([]byte, maxBytes)
				for seq := 0; seq < frames; seq++ {
					n := size(g, seq)
					fill(payload[:n], uint64(src<<32|g<<16|seq))
					h := dataHeader(src, n)
					h.Piece, h.Step = uint32(g), uint32(seq)
					if err := c.ts[src].Send(ctx, 0, h, payload[:n]); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, maxBytes)
			next := make([]int, senders)
			for i := 0; i < senders*frames; i++ {
				h, p, err := c.ts[0].Recv(ctx, src, buf)
				if err != nil {
					errs <- err
					return
				}
				g, seq := int(h.Piece), int(h.Step)
				if g >= senders || seq != next[g] {
					errs <- fmt.Errorf("from rank %d: frame (sender %d, seq %d) out of order; want seq %d", src, g, seq, next[g])
					return
				}
				next[g]++
				if len(p) != size(g, seq) {
					errs <- fmt.Errorf("from rank %d: frame (%d, %d) of %d bytes, want %d", src, g, seq, len(p), size(g, seq))
					return
				}
				if err := checkFill(p, uint64(src<<32|g<<16|seq)); err != nil {
					errs <- fmt.Errorf("from rank %d: frame (%d, %d): %w", src, g, seq, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// Send returns only once the kernel holds the bytes, so overwriting the payload right after
// must not change what the peer receives.
func TestPayloadReuseAfterSend(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 2, testConfig())
	ctx := ctxTimeout(t, 20*time.Second)
	const n, rounds = 8 << 20, 6
	errc := make(chan error, 1)
	go func() {
		payload := make([]byte, n)
		for r := 0; r < rounds; r++ {
			fill(payload, uint64(r))
			if err := c.ts[0].Send(ctx, 1, dataHeader(0, n), payload); err != nil {
				errc <- err
				return
			}
		}
		fill(payload, 999) // scribble over the last frame at once
		errc <- nil
	}()
	buf := make([]byte, n)
	for r := 0; r < rounds; r++ {
		_, p, err := c.ts[1].Recv(ctx, 0, buf)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkFill(p, uint64(r)); err != nil {
			t.Fatalf("frame %d: %v", r, err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// A rank holding the wrong secret, or the right secret for another job, is refused by the
// acceptor (which logs the remote address) and delivers nothing.
func TestWrongSecretOrJobRefused(t *testing.T) {
	for _, tc := range []struct {
		name        string
		job, secret string
	}{
		{"wrong secret", "job", "not the secret"},
		{"wrong job", "other job", "the secret"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkLeaks(t)
			cfg := testConfig()
			lns, logs := listeners(t, 2, cfg)
			a := addrs(lns)
			good, err := lns[1].Transport(context.Background(), Group{Job: "job", Rank: 1, Addrs: a, Secret: []byte("the secret")})
			if err != nil {
				t.Fatal(err)
			}
			bad, err := lns[0].Transport(context.Background(), Group{Job: tc.job, Rank: 0, Addrs: a, Secret: []byte(tc.secret)})
			if err != nil {
				t.Fatal(err)
			}
			recvErr := make(chan error, 1)
			go func() {
				_, _, err := good.Recv(ctxTimeout(t, cfg.DialTimeout+200*time.Millisecond), 0, make([]byte, 64))
				recvErr <- err
			}()
			start := time.Now()
			err = bad.Send(context.Background(), 1, dataHeader(0, 8), make([]byte, 8))
			wantPeerErr(t, err, 1, a[1], collective.ErrPeerGone)
			if d := time.Since(start); d > cfg.DialTimeout+cfg.HandshakeTimeout+time.Second {
				t.Errorf("refused dial took %v", d)
			}
			if err := <-recvErr; !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Recv on the refusing side: %v, want a deadline (nothing delivered)", err)
			}
			refusals := logs[1].FilterMessage("tcpnet: refused data connection").All()
			if len(refusals) == 0 {
				t.Fatal("refusal not logged")
			}
			remote, _ := refusals[0].ContextMap()["remote"].(string)
			if !strings.HasPrefix(remote, "127.0.0.1:") {
				t.Fatalf("refusal log names remote %q", remote)
			}
			if msg := fmt.Sprint(refusals[0].ContextMap()["error"]); !strings.Contains(msg, "authentication failed") {
				t.Fatalf("refusal logged with error %q", msg)
			}
		})
	}
}

// A dialler answered with a hello it cannot verify (an impostor at the peer's address) does
// not send to it, and does not retry.
func TestImpostorAcceptorRefused(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	lns, _ := listeners(t, 1, cfg)
	fake, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer fake.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := fake.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _, _ = readHello(c)
		_ = writeHello(c, []byte("guessed"), "job", 1, 2)
		_, _ = io.Copy(io.Discard, c)
	}()
	tr, err := lns[0].Transport(context.Background(), Group{Job: "job", Rank: 0, Addrs: []string{lns[0].Addr(), fake.Addr().String()}, Secret: []byte("s")})
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Send(context.Background(), 1, dataHeader(0, 4), make([]byte, 4))
	wantPeerErr(t, err, 1, fake.Addr().String(), collective.ErrAuth)
	_ = tr.Close()
	<-done
}

// Two jobs on one listener, even with the same secret, only see their own connections.
func TestGroupsIsolatedOnOneListener(t *testing.T) {
	checkLeaks(t)
	lns, _ := listeners(t, 2, testConfig())
	a := addrs(lns)
	secret := newSecret(t)
	ctx := ctxTimeout(t, 10*time.Second)
	jobs := []string{"job-a", "job-b"}
	ts := make(map[string][2]collective.Transport)
	for _, job := range jobs {
		var pair [2]collective.Transport
		for r := range pair {
			tr, err := lns[r].Transport(ctx, Group{Job: job, Rank: r, Addrs: a, Secret: secret})
			if err != nil {
				t.Fatal(err)
			}
			pair[r] = tr
		}
		ts[job] = pair
	}
	if _, err := lns[0].Transport(ctx, Group{Job: "job-a", Rank: 0, Addrs: a, Secret: secret}); err == nil {
		t.Fatal("a second transport for the same job on one listener was allowed")
	}
	for i, job := range jobs {
		p := []byte(job + " payload")
		if err := ts[job][0].Send(ctx, 1, frameHeader(0, len(p)), p); err != nil {
			t.Fatal(err)
		}
		h := frameHeader(1, 4)
		h.Tag = uint64(i)
		if err := ts[job][1].Send(ctx, 0, h, []byte("ping")); err != nil {
			t.Fatal(err)
		}
	}
	for i, job := range jobs {
		_, p, err := ts[job][1].Recv(ctx, 0, make([]byte, 64))
		if err != nil || string(p) != job+" payload" {
			t.Fatalf("job %s rank 1 got %q, %v", job, p, err)
		}
		h, _, err := ts[job][0].Recv(ctx, 1, make([]byte, 64))
		if err != nil || h.Tag != uint64(i) {
			t.Fatalf("job %s rank 0 got tag %d, %v", job, h.Tag, err)
		}
	}
}

// A peer may dial before this process has registered the job; the handshake waits for it.
func TestLateRegistration(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	cfg.HandshakeTimeout = 2 * time.Second
	cfg.DialTimeout = 2 * time.Second
	lns, _ := listeners(t, 2, cfg)
	a := addrs(lns)
	g := Group{Job: "late", Addrs: a, Secret: []byte("s")}
	ctx := ctxTimeout(t, 5*time.Second)
	g.Rank = 0
	t0, err := lns[0].Transport(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	sent := make(chan error, 1)
	go func() { sent <- t0.Send(ctx, 1, frameHeader(0, 5), []byte("early")) }()
	time.Sleep(200 * time.Millisecond)
	g.Rank = 1
	t1, err := lns[1].Transport(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	_, p, err := t1.Recv(ctx, 0, make([]byte, 8))
	if err != nil || string(p) != "early" {
		t.Fatalf("got %q, %v", p, err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
}

// Killing a peer (its listener and connections closed, abruptly with RST or with FIN) makes
// a blocked Recv fail at once with ErrPeerGone naming it, and Sends fail soon after.
func TestPeerKilled(t *testing.T) {
	for _, abrupt := range []bool{false, true} {
		t.Run(fmt.Sprintf("rst=%v", abrupt), func(t *testing.T) {
			checkLeaks(t)
			c := newCluster(t, 2, testConfig())
			ctx := ctxTimeout(t, 10*time.Second)
			// Connect both directions.
			for src := 0; src < 2; src++ {
				if err := c.ts[src].Send(ctx, 1-src, frameHeader(src, 4), []byte("ping")); err != nil {
					t.Fatal(err)
				}
				if _, _, err := c.ts[1-src].Recv(ctx, src, make([]byte, 4)); err != nil {
					t.Fatal(err)
				}
			}
			recvErr := make(chan error, 1)
			go func() {
				_, _, err := c.ts[1].Recv(ctx, 0, make([]byte, 4))
				recvErr <- err
			}()
			time.Sleep(20 * time.Millisecond) // let Recv block in read
			if abrupt {
				tr := c.ts[0].(*transport)
				tr.mu.Lock()
				for conn := range tr.mu.conns {
					_ = conn.(*net.TCPConn).SetLinger(0) // close sends RST, as a killed process's kernel may
				}
				tr.mu.Unlock()
			}
			killed := time.Now()
			_ = c.lns[0].Close()
			err := <-recvErr
			if d := time.Since(killed); d > 500*time.Millisecond {
				t.Errorf("Recv noticed the dead peer after %v", d)
			}
			wantPeerErr(t, err, 0, c.lns[0].Addr(), collective.ErrPeerGone)
			// The failure sticks.
			_, _, err = c.ts[1].Recv(ctx, 0, make([]byte, 4))
			wantPeerErr(t, err, 0, c.lns[0].Addr(), collective.ErrPeerGone)
			// Sends land in the kernel until the peer's RST comes back; then they fail.
			for i := 0; ; i++ {
				err := c.ts[1].Send(ctx, 0, frameHeader(1, 4), []byte("ping"))
				if err != nil {
					wantPeerErr(t, err, 0, c.lns[0].Addr(), collective.ErrPeerGone)
					break
				}
				if i > 100 {
					t.Fatal("Send to a dead peer kept succeeding")
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// A dial to a peer that is not listening retries within the dial budget or ctx, then fails
// naming the peer.
func TestDialDeadPeer(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	lns, _ := listeners(t, 1, cfg)
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	_ = dead.Close()
	tr, err := lns[0].Transport(context.Background(), Group{Job: "j", Rank: 0, Addrs: []string{lns[0].Addr(), deadAddr}, Secret: []byte("s")})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = tr.Send(context.Background(), 1, frameHeader(0, 4), []byte("ping"))
	wantPeerErr(t, err, 1, deadAddr, collective.ErrPeerGone)
	if d := time.Since(start); d < cfg.DialTimeout/2 || d > cfg.DialTimeout+time.Second {
		t.Errorf("dial gave up after %v, budget %v", d, cfg.DialTimeout)
	}
	if !strings.Contains(err.Error(), "attempts") {
		t.Errorf("error does not say it retried: %v", err)
	}
	// A shorter ctx wins over the dial budget.
	start = time.Now()
	err = tr.Send(ctxTimeout(t, 100*time.Millisecond), 1, frameHeader(0, 4), []byte("ping"))
	wantPeerErr(t, err, 1, deadAddr, context.DeadlineExceeded)
	if d := time.Since(start); d > 400*time.Millisecond {
		t.Errorf("dial ignored ctx: gave up after %v", d)
	}
}

// Close unblocks a Recv waiting for its peer to connect, a Recv waiting for a frame, a Send
// blocked on a full socket and a Send queued behind it, all with ErrClosed.
func TestCloseUnblocks(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 3, testConfig())
	ctx := ctxTimeout(t, 10*time.Second)
	tr := c.ts[0]
	// Connect 0 -> 1 (rank 1 never reads again) and 1 -> 0.
	if err := tr.Send(ctx, 1, frameHeader(0, 4), []byte("ping")); err != nil {
		t.Fatal(err)
	}
	if err := c.ts[1].Send(ctx, 0, frameHeader(1, 4), []byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := tr.Recv(ctx, 1, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 8<<20)
	errs := make(chan error, 4)
	go func() { _, _, err := tr.Recv(ctx, 2, make([]byte, 4)); errs <- err }() // rank 2 never dials
	go func() { _, _, err := tr.Recv(ctx, 1, make([]byte, 4)); errs <- err }() // rank 1 sends nothing more
	go func() {
		for { // fill the socket until a Send blocks
			if err := tr.Send(ctx, 1, dataHeader(0, len(big)), big); err != nil {
				errs <- err
				return
			}
		}
	}()
	time.Sleep(100 * time.Millisecond)
	go func() { errs <- tr.Send(ctx, 1, frameHeader(0, 4), []byte("ping")) }()
	time.Sleep(50 * time.Millisecond)
	closed := time.Now()
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 4; i++ {
		if err := <-errs; !errors.Is(err, collective.ErrClosed) {
			t.Errorf("after Close: %v, want ErrClosed", err)
		}
	}
	if d := time.Since(closed); d > 500*time.Millisecond {
		t.Errorf("Close took %v to unblock everything", d)
	}
	if err := tr.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := tr.Send(ctx, 1, frameHeader(0, 4), []byte("ping")); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("Send after Close: %v", err)
	}
	if _, _, err := tr.Recv(ctx, 1, make([]byte, 4)); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("Recv after Close: %v", err)
	}
	if err := c.lns[0].Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.lns[0].Close(); err != nil {
		t.Fatalf("second listener Close: %v", err)
	}
	if _, err := c.lns[0].Transport(ctx, Group{Job: "x", Addrs: []string{"a"}, Secret: []byte("s")}); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("Transport on a closed listener: %v", err)
	}
}

// Frames a peer gets wrong are ErrProtocol naming it, never a panic, and leave its
// connection failed.
func TestBadFrames(t *testing.T) {
	good := rawFrame(dataHeader(0, 8), make([]byte, 8))
	tooLong := rawFrame(dataHeader(0, 8), nil)
	// Patch in a length over MaxPayload (count to match, so only the bound trips).
	collective.PutHeader(tooLong, collective.Header{Kind: collective.KindData, Op: collective.OpAllReduce,
		Count: (collective.MaxPayload + 4) / 4, Length: collective.MaxPayload + 4})
	for _, tc := range []struct {
		name  string
		bytes []byte
		buf   int
		extra error
	}{
		{"bad magic", append([]byte{0xde, 0xad}, good[2:]...), 64, nil},
		{"bad version", append(append([]byte{}, good[:2]...), append([]byte{9}, good[3:]...)...), 64, nil},
		{"length over MaxPayload", tooLong, 64, nil},
		{"payload larger than buf", good, 4, io.ErrShortBuffer},
		{"wrong source rank", rawFrame(dataHeader(1, 8), make([]byte, 8)), 64, nil},
		{"hello after handshake", rawFrame(collective.Header{Kind: collective.KindHello, Length: 4}, make([]byte, 4)), 64, nil},
		{"http", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n" + strings.Repeat("x", 40)), 64, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkLeaks(t)
			lns, _ := listeners(t, 1, testConfig())
			secret := []byte("s")
			a := []string{"127.0.0.1:1", lns[0].Addr()}
			tr, err := lns[0].Transport(context.Background(), Group{Job: "j", Rank: 1, Addrs: a, Secret: secret})
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()
			peer := fakePeer(t, a[1], secret, "j", 0, 2)
			if _, err := peer.Write(tc.bytes); err != nil {
				t.Fatal(err)
			}
			ctx := ctxTimeout(t, 5*time.Second)
			_, _, err = tr.Recv(ctx, 0, make([]byte, tc.buf))
			wantPeerErr(t, err, 0, a[0], collective.ErrProtocol)
			if tc.extra != nil && !errors.Is(err, tc.extra) {
				t.Fatalf("%v does not wrap %v", err, tc.extra)
			}
			_, _, err2 := tr.Recv(ctx, 0, make([]byte, 64))
			if err2 == nil || err2.Error() != err.Error() {
				t.Fatalf("second Recv: %v, want the same failure", err2)
			}
			// The transport closed the connection.
			_ = peer.SetReadDeadline(time.Now().Add(2 * time.Second))
			if err := waitClosed(peer); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// Strangers that send garbage or nothing before a hello are dropped within the handshake
// timeout, and the listener keeps serving.
func TestStrangersDropped(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	c := newCluster(t, 2, cfg)
	silent, err := net.Dial("tcp", c.lns[1].Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	noisy, err := net.Dial("tcp", c.lns[1].Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer noisy.Close()
	_, _ = noisy.Write([]byte(strings.Repeat("garbage!", 100)))
	for _, s := range []net.Conn{silent, noisy} {
		_ = s.SetReadDeadline(time.Now().Add(cfg.HandshakeTimeout + 2*time.Second))
		if err := waitClosed(s); err != nil {
			t.Fatal(err)
		}
	}
	ctx := ctxTimeout(t, 5*time.Second)
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 2), []byte("ok")); err != nil {
		t.Fatal(err)
	}
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 2)); err != nil || string(p) != "ok" {
		t.Fatalf("after strangers: %q, %v", p, err)
	}
	if n := len(c.logs[1].FilterMessage("tcpnet: refused data connection").All()); n != 2 {
		t.Fatalf("%d refusals logged, want 2", n)
	}
}

// A second connection claiming a rank whose connection has delivered data is refused; the
// first keeps working.
func TestDuplicateConnectionRefused(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 2, testConfig())
	ctx := ctxTimeout(t, 5*time.Second)
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("a")); err != nil {
		t.Fatal(err)
	}
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 1)); err != nil || string(p) != "a" {
		t.Fatalf("got %q, %v", p, err)
	}
	dup, err := net.Dial("tcp", c.lns[1].Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer dup.Close()
	_ = dup.SetDeadline(time.Now().Add(3 * time.Second))
	if err := writeHello(dup, c.secret, c.job, 0, 2); err != nil {
		t.Fatal(err)
	}
	if _, _, err := readHello(dup); err == nil {
		t.Fatal("duplicate connection was answered")
	}
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("b")); err != nil {
		t.Fatal(err)
	}
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 1)); err != nil || string(p) != "b" {
		t.Fatalf("got %q, %v, want %q", p, err, "b")
	}
}

// A dialler whose ctx ends while its hello waits for the job to register here hangs up; the
// acceptor must not adopt that dead connection, and the next Send connects.
func TestAbandonedHandshakeWhileRegistering(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	cfg.HandshakeTimeout = 3 * time.Second
	lns, logs := listeners(t, 2, cfg)
	g := Group{Job: "late", Addrs: addrs(lns), Secret: []byte("s")}
	ctx := ctxTimeout(t, 10*time.Second)
	t0, err := lns[0].Transport(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	err = t0.Send(ctxTimeout(t, 100*time.Millisecond), 1, frameHeader(0, 1), []byte("x"))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Send before the peer registered: %v", err)
	}
	g.Rank = 1
	t1, err := lns[1].Transport(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for len(logs[1].FilterMessage("tcpnet: refused data connection").All()) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the abandoned connection was not refused")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := t0.Send(ctx, 1, frameHeader(0, 1), []byte("y")); err != nil {
		t.Fatal(err)
	}
	if _, p, err := t1.Recv(ctx, 0, make([]byte, 1)); err != nil || string(p) != "y" {
		t.Fatalf("got %q, %v", p, err)
	}
}

// A connection that ends without delivering anything (its dialler gave up just after the
// handshake) gives way to the peer's next connection, with a Recv blocked on it or not.
func TestEmptyConnectionReplaced(t *testing.T) {
	checkLeaks(t)
	lns, _ := listeners(t, 1, testConfig())
	secret := []byte("s")
	a := []string{"127.0.0.1:1", lns[0].Addr()}
	tr, err := lns[0].Transport(context.Background(), Group{Job: "j", Rank: 1, Addrs: a, Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	ctx := ctxTimeout(t, 5*time.Second)

	// A Recv blocked on the first connection when it ends: it moves on to the second.
	first := fakePeer(t, a[1], secret, "j", 0, 2)
	got := make(chan string, 1)
	go func() {
		_, p, err := tr.Recv(ctx, 0, make([]byte, 8))
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(p)
	}()
	second := fakePeer(t, a[1], secret, "j", 0, 2) // answered: the first has delivered nothing
	time.Sleep(20 * time.Millisecond)
	_ = first.Close()
	if _, err := second.Write(rawFrame(frameHeader(0, 6), []byte("second"))); err != nil {
		t.Fatal(err)
	}
	if p := <-got; p != "second" {
		t.Fatalf("Recv got %q, want the second connection's frame", p)
	}

	// Once data has come, a further connection is refused and an end is final.
	_ = second.Close()
	_, _, err = tr.Recv(ctx, 0, make([]byte, 8))
	wantPeerErr(t, err, 0, a[0], collective.ErrPeerGone)
	c, err := net.Dial("tcp", a[1])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	_ = writeHello(c, secret, "j", 0, 2)
	if _, _, err := readHello(c); err == nil {
		t.Fatal("a connection after data was answered")
	}
}

// An empty connection that ended before the peer's next one arrived is reported (the peer
// may be dead), but the next connection is still taken.
func TestEmptyConnectionEndedThenReplaced(t *testing.T) {
	checkLeaks(t)
	lns, _ := listeners(t, 1, testConfig())
	secret := []byte("s")
	a := []string{"127.0.0.1:1", lns[0].Addr()}
	tr, err := lns[0].Transport(context.Background(), Group{Job: "j", Rank: 1, Addrs: a, Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	ctx := ctxTimeout(t, 5*time.Second)
	first := fakePeer(t, a[1], secret, "j", 0, 2)
	_ = first.Close()
	_, _, err = tr.Recv(ctx, 0, make([]byte, 8))
	wantPeerErr(t, err, 0, a[0], collective.ErrPeerGone)
	second := fakePeer(t, a[1], secret, "j", 0, 2)
	if _, err := second.Write(rawFrame(frameHeader(0, 2), []byte("ok"))); err != nil {
		t.Fatal(err)
	}
	// The replacement is registered by the listener's handshake goroutine right after it
	// answers the hello, which can be a moment after fakePeer returns: until then Recv still
	// reports the ended connection.
	for deadline := time.Now().Add(3 * time.Second); ; {
		_, p, err := tr.Recv(ctx, 0, make([]byte, 8))
		if err == nil && string(p) == "ok" {
			break
		}
		if !errors.Is(err, collective.ErrPeerGone) || time.Now().After(deadline) {
			t.Fatalf("got %q, %v", p, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A ctx ending while Recv waits between frames leaves the connection usable.
func TestContextInterruptsRecv(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 2, testConfig())
	ctx := ctxTimeout(t, 10*time.Second)
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("a")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.ts[1].Recv(ctx, 0, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	_, _, err := c.ts[1].Recv(short, 0, make([]byte, 1))
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv past its deadline: %v", err)
	}
	canceled, cancel := context.WithCancel(ctx)
	time.AfterFunc(30*time.Millisecond, cancel)
	_, _, err = c.ts[1].Recv(canceled, 0, make([]byte, 1))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Recv: %v", err)
	}
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("b")); err != nil {
		t.Fatal(err)
	}
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 1)); err != nil || string(p) != "b" {
		t.Fatalf("after interrupted Recvs: %q, %v", p, err)
	}
}

// A Recv cut short in the middle of a frame (its header or its payload) keeps what it read,
// and the next Recv, into another buffer, returns the whole frame.
func TestRecvResumesInterruptedFrame(t *testing.T) {
	checkLeaks(t)
	lns, _ := listeners(t, 1, testConfig())
	secret := []byte("s")
	a := []string{"127.0.0.1:1", lns[0].Addr()}
	tr, err := lns[0].Transport(context.Background(), Group{Job: "j", Rank: 1, Addrs: a, Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	peer := fakePeer(t, a[1], secret, "j", 0, 2)
	ctx := ctxTimeout(t, 5*time.Second)
	payload := make([]byte, 1<<20)
	fill(payload, 42)
	h := dataHeader(0, len(payload))
	h.Tag = 77
	frame := rawFrame(h, payload)
	for _, cut := range []int{10, collective.HeaderSize, collective.HeaderSize + 1000, len(frame) - 1} {
		t.Run(fmt.Sprint(cut), func(t *testing.T) {
			if _, err := peer.Write(frame[:cut]); err != nil {
				t.Fatal(err)
			}
			short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			_, _, err := tr.Recv(short, 0, make([]byte, len(payload)))
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Recv of a partial frame: %v", err)
			}
			if _, err := peer.Write(frame[cut:]); err != nil {
				t.Fatal(err)
			}
			got, p, err := tr.Recv(ctx, 0, make([]byte, len(payload)))
			if err != nil {
				t.Fatal(err)
			}
			if got != h {
				t.Fatalf("header %+v, want %+v", got, h)
			}
			if err := checkFill(p, 42); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A Send cut short mid-frame by its ctx returns at once; the rest of its frame goes out in
// the background, so the peer still gets it whole and the connection stays usable. If the
// peer does not take it within FinishTimeout, the connection is given up.
func TestSendFinishesInterruptedFrame(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	cfg.FinishTimeout = 10 * time.Second // ample, even under the race detector
	c := newCluster(t, 2, cfg)
	ctx := ctxTimeout(t, 20*time.Second)
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("a")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.ts[1].Recv(ctx, 0, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	// Rank 1 is not reading: a frame larger than the socket buffers blocks mid-way.
	big := make([]byte, 48<<20)
	fill(big, 7)
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	start := time.Now()
	err := c.ts[0].Send(short, 1, dataHeader(0, len(big)), big)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked Send past its deadline: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second { // "at once": well before FinishTimeout
		t.Fatalf("cut-short Send returned after %v", d)
	}
	fill(big, 8) // the caller's buffer is theirs again
	sent := make(chan error, 1)
	go func() { sent <- c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("b")) }()
	_, p, err := c.ts[1].Recv(ctx, 0, make([]byte, len(big)))
	if err != nil {
		t.Fatal(err)
	}
	if err := checkFill(p, 7); err != nil {
		t.Fatalf("the cut-short frame: %v", err)
	}
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 1)); err != nil || string(p) != "b" {
		t.Fatalf("next frame: %q, %v", p, err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}

	// Now the peer never reads: finishing fails after FinishTimeout and the connection goes.
	c = newCluster(t, 2, testConfig())
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("a")); err != nil { // connect first
		t.Fatal(err)
	}
	short, cancel = context.WithTimeout(ctx, 50*time.Millisecond)
	err = c.ts[0].Send(short, 1, dataHeader(0, len(big)), big)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked Send past its deadline: %v", err)
	}
	err = c.ts[0].Send(ctx, 1, frameHeader(0, 1), []byte("c"))
	wantPeerErr(t, err, 1, c.lns[1].Addr(), collective.ErrPeerGone)
	if !strings.Contains(err.Error(), "cut short") {
		t.Fatalf("error does not explain the lost connection: %v", err)
	}
}

func TestSendRejectsBadFrames(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 2, testConfig())
	ctx := ctxTimeout(t, 5*time.Second)
	for _, tc := range []struct {
		name    string
		peer    int
		h       collective.Header
		payload []byte
	}{
		{"self", 0, frameHeader(0, 1), []byte("x")},
		{"out of range", 2, frameHeader(0, 1), []byte("x")},
		{"length mismatch", 1, frameHeader(0, 2), []byte("x")},
		{"wrong source", 1, frameHeader(1, 1), []byte("x")},
		{"hello", 1, collective.Header{Kind: collective.KindHello, Length: 1}, []byte("x")},
		{"bad count", 1, collective.Header{Kind: collective.KindData, Op: collective.OpAllReduce, Count: 3, Length: 4}, []byte("abcd")},
	} {
		if err := c.ts[0].Send(ctx, tc.peer, tc.h, tc.payload); err == nil {
			t.Errorf("%s: Send accepted it", tc.name)
		}
	}
	if _, _, err := c.ts[0].Recv(ctx, 0, nil); err == nil {
		t.Error("Recv from self accepted")
	}
	// None of that reached or broke the connection.
	if err := c.ts[0].Send(ctx, 1, frameHeader(0, 2), []byte("ok")); err != nil {
		t.Fatal(err)
	}
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 2)); err != nil || string(p) != "ok" {
		t.Fatalf("%q, %v", p, err)
	}
}

// Steady-state Send and Recv allocate nothing, under a cancelable ctx with a deadline.
func TestSteadyStateAllocs(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 2, testConfig())
	ctx := ctxTimeout(t, 20*time.Second)
	payload := make([]byte, 64<<10)
	buf := make([]byte, len(payload))
	h := dataHeader(0, len(payload))
	done := make(chan error, 1)
	const runs = 200
	go func() {
		for i := 0; i < runs+1+10; i++ {
			if _, _, err := c.ts[1].Recv(ctx, 0, buf); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	// Warm up: dial, arm the ctx watches.
	for i := 0; i < 10; i++ {
		if err := c.ts[0].Send(ctx, 1, h, payload); err != nil {
			t.Fatal(err)
		}
	}
	allocs := testing.AllocsPerRun(runs, func() {
		if err := c.ts[0].Send(ctx, 1, h, payload); err != nil {
			t.Fatal(err)
		}
	})
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// AllocsPerRun counts every goroutine's allocations, so this covers Recv too.
	if allocs > 0 {
		t.Errorf("%.2f allocations per Send+Recv, want 0", allocs)
	}
}

// Connect dials ahead of the first Send: a live peer is connected (and its Recv sees the
// frames that follow), a dead one is reported naming it.
func TestConnect(t *testing.T) {
	checkLeaks(t)
	c := newCluster(t, 3, testConfig())
	ctx := ctxTimeout(t, 5*time.Second)
	conn := c.ts[0].(Connector)
	if err := conn.Connect(ctx, 1, 2); err != nil {
		t.Fatal(err)
	}
	if err := conn.Connect(ctx, 1); err != nil { // already connected: nothing to do
		t.Fatal(err)
	}
	for p := 1; p < 3; p++ {
		if c.ts[0].(*transport).out[p].conn == nil {
			t.Fatalf("rank %d not connected", p)
		}
		if err := c.ts[0].Send(ctx, p, frameHeader(0, 2), []byte("hi")); err != nil {
			t.Fatal(err)
		}
		if _, m, err := c.ts[p].Recv(ctx, 0, make([]byte, 2)); err != nil || string(m) != "hi" {
			t.Fatalf("rank %d got %q, %v", p, m, err)
		}
	}
	if err := conn.Connect(ctx, 0); err == nil {
		t.Fatal("Connect to self accepted")
	}
	_ = c.lns[2].Close()
	err := c.ts[1].(Connector).Connect(ctx, 0, 2)
	wantPeerErr(t, err, 2, c.lns[2].Addr(), collective.ErrPeerGone)
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		field string
		mod   func(*Config)
	}{
		{"handshake_timeout", func(c *Config) { c.HandshakeTimeout = 0 }},
		{"dial_timeout", func(c *Config) { c.DialTimeout = time.Hour }},
		{"finish_timeout", func(c *Config) { c.FinishTimeout = time.Nanosecond }},
		{"socket_buffer", func(c *Config) { c.SocketBuffer = -1 }},
		{"keepalive", func(c *Config) { c.KeepAlive = time.Millisecond }},
	} {
		c := DefaultConfig()
		tc.mod(&c)
		err := c.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), tc.field+":") {
			t.Errorf("%s: %v", tc.field, err)
		}
		if _, err := ListenWith("127.0.0.1:0", c, nil); err == nil {
			t.Errorf("%s: ListenWith accepted an invalid config", tc.field)
		}
	}
	l, err := Listen("127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for _, g := range []Group{
		{Rank: 0, Addrs: []string{"a"}, Secret: []byte("s")},
		{Job: "j", Rank: 1, Addrs: []string{"a"}, Secret: []byte("s")},
		{Job: "j", Rank: 0, Addrs: nil, Secret: []byte("s")},
		{Job: "j", Rank: 0, Addrs: []string{"a"}},
		{Job: "j", Rank: 0, Addrs: []string{"a", ""}, Secret: []byte("s")},
	} {
		if _, err := l.Transport(context.Background(), g); err == nil {
			t.Errorf("group %+v accepted", g)
		}
	}
}
