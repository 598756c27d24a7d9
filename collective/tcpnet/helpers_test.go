package tcpnet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/leakcheck"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/qvd/qvd/collective"
)

// testConfig shortens the timeouts so failure tests finish in well under a second or two.
func testConfig() Config {
	c := DefaultConfig()
	c.HandshakeTimeout = 300 * time.Millisecond
	c.DialTimeout = 600 * time.Millisecond
	c.FinishTimeout = 300 * time.Millisecond
	return c
}

// checkLeaks fails the test if goroutines started during it outlive its cleanup.
func checkLeaks(t testing.TB) { leakcheck.Check(t) }

// cluster is n ranks of one job, each with its own listener, as n processes would have.
type cluster struct {
	lns    []*Listener
	ts     []collective.Transport
	logs   []*observer.ObservedLogs
	job    string
	secret []byte
}

func newSecret(t testing.TB) []byte {
	s := make([]byte, 32)
	if _, err := rand.Read(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// listeners opens n listeners on 127.0.0.1, each logging to an observer, closed at cleanup.
func listeners(t testing.TB, n int, cfg Config) ([]*Listener, []*observer.ObservedLogs) {
	t.Helper()
	lns := make([]*Listener, n)
	logs := make([]*observer.ObservedLogs, n)
	for i := range lns {
		core, obs := observer.New(zapcore.DebugLevel)
		l, err := ListenWith("127.0.0.1:0", cfg, zap.New(core))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = l.Close() })
		lns[i], logs[i] = l, obs
	}
	return lns, logs
}

func addrs(lns []*Listener) []string {
	a := make([]string, len(lns))
	for i, l := range lns {
		a[i] = l.Addr()
	}
	return a
}

func newCluster(t testing.TB, n int, cfg Config) *cluster {
	t.Helper()
	c := &cluster{job: "job-" + t.Name(), secret: newSecret(t)}
	c.lns, c.logs = listeners(t, n, cfg)
	c.ts = make([]collective.Transport, n)
	for r := range c.ts {
		tr, err := c.lns[r].Transport(context.Background(), Group{Job: c.job, Rank: r, Addrs: addrs(c.lns), Secret: c.secret})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tr.Close() })
		c.ts[r] = tr
	}
	return c
}

// dataHeader is a valid fp32 data frame header from src carrying n bytes (n % 4 == 0).
func dataHeader(src, n int) collective.Header {
	return collective.Header{Kind: collective.KindData, Op: collective.OpAllReduce, Src: uint16(src),
		Count: uint32(n / 4), Length: uint32(n)}
}

// frameHeader is a valid header from src for a payload of n bytes: an fp32 data frame when
// n is a multiple of 4, otherwise an abort frame (whose length is free).
func frameHeader(src, n int) collective.Header {
	if n%4 == 0 {
		return dataHeader(src, n)
	}
	return collective.Header{Kind: collective.KindAbort, Src: uint16(src), Length: uint32(n)}
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// wantPeerErr checks that err is a *collective.PeerError naming rank and wrapping sentinel.
func wantPeerErr(t testing.TB, err error, rank int, addr string, sentinel error) {
	t.Helper()
	var pe *collective.PeerError
	if !errors.As(err, &pe) {
		t.Fatalf("error %v (%T) is not a *collective.PeerError", err, err)
	}
	if pe.Rank != rank || pe.Addr != addr {
		t.Fatalf("error names rank %d (%s), want rank %d (%s): %v", pe.Rank, pe.Addr, rank, addr, err)
	}
	if !errors.Is(err, sentinel) {
		t.Fatalf("error %v does not wrap %v", err, sentinel)
	}
}

// fakePeer dials addr and completes the handshake as rank of job, returning the raw
// connection: a peer the test can make misbehave.
func fakePeer(t testing.TB, addr string, secret []byte, job string, rank, size int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := writeHello(c, secret, job, rank, size); err != nil {
		t.Fatal(err)
	}
	if _, _, err := readHello(c); err != nil {
		t.Fatalf("fake peer: no answering hello: %v", err)
	}
	_ = c.SetDeadline(time.Time{})
	return c
}

func rawFrame(h collective.Header, payload []byte) []byte {
	b := make([]byte, collective.HeaderSize+len(payload))
	collective.PutHeader(b, h)
	copy(b[collective.HeaderSize:], payload)
	return b
}

// fill writes a pattern determined by seed into b.
func fill(b []byte, seed uint64) {
	x := seed*0x9e3779b97f4a7c15 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
}

func checkFill(b []byte, seed uint64) error {
	want := make([]byte, len(b))
	fill(want, seed)
	for i := range b {
		if b[i] != want[i] {
			return fmt.Errorf("byte %d of %d is %#x, want %#x (seed %d)", i, len(b), b[i], want[i], seed)
		}
	}
	return nil
}

// waitClosed reads c until the other end closes it (EOF, or a reset where it closed with our
// bytes unread) or c's read deadline passes (an error).
func waitClosed(c net.Conn) error {
	_, err := io.Copy(io.Discard, c)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("the other end did not close the connection: %w", err)
	}
	return nil
}
