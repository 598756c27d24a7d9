package grpcnet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/leakcheck"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/test/bufconn"

	"github.com/qvd/qvd/collective"
)

// testTuning shortens the timings so that failures show in well under a second or two.
func testTuning() tuning {
	return tuning{
		handshake:      2 * time.Second,
		heartbeatEvery: 100 * time.Millisecond,
		silenceLimit:   2 * time.Second,
		releaseGrace:   200 * time.Millisecond,
		retryEvery:     20 * time.Millisecond,
		linger:         500 * time.Millisecond,
	}
}

// leakCheck fails the test if goroutines started during it are still running at the end.
func leakCheck(t testing.TB) { leakcheck.Check(t) }

// node is one process's gRPC server with its Hub.
type node struct {
	hub    *Hub
	srv    *grpc.Server
	addr   string
	logs   *observer.ObservedLogs
	dialer func(context.Context, string) (net.Conn, error) // for bufconn nodes
	done   chan struct{}
}

// newNode starts a server on 127.0.0.1:0 (or an in-memory listener when mem is set).
func newNode(t testing.TB, tune tuning, mem bool, extra ...grpc.ServerOption) *node {
	t.Helper()
	core, logs := observer.New(zap.WarnLevel)
	srv := grpc.NewServer(append(ServerOptions(), extra...)...)
	n := &node{srv: srv, logs: logs, done: make(chan struct{})}
	n.hub = NewHub(srv, zap.New(core))
	n.hub.tune = tune
	var lis net.Listener
	if mem {
		bl := bufconn.Listen(4 << 20)
		lis, n.addr = bl, "bufconn"
		n.dialer = func(ctx context.Context, string string) (net.Conn, error) { return bl.DialContext(ctx) }
	} else {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lis, n.addr = Listener(l), l.Addr().String()
	}
	go func() {
		defer close(n.done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(n.stop)
	return n
}

func (n *node) stop() {
	_ = n.hub.Close()
	n.srv.Stop()
	<-n.done
}

// refusals counts the refused-stream warnings the node's Hub logged.
func (n *node) refusals() []string {
	var out []string
	for _, e := range n.logs.FilterMessage("grpcnet: refused a frame stream").All() {
		out = append(out, fmt.Sprint(e.ContextMap()["error"]))
	}
	return out
}

// group creates the transports of one job, rank r on nodes[r]; addrs overrides the
// addresses the ranks dial (proxies), when given.
func group(t testing.TB, job string, secret []byte, nodes []*node, addrs []string) []*transport {
	t.Helper()
	if addrs == nil {
		for _, n := range nodes {
			addrs = append(addrs, n.addr)
		}
	}
	out := make([]*transport, len(nodes))
	for r, n := range nodes {
		g := Group{Roster: collective.Roster{Job: job, Rank: r, Addrs: addrs, Secret: secret}}
		if n.dialer != nil {
			// Every in-memory node has its own listener; route by address.
			byAddr := make(map[string]func(context.Context, string) (net.Conn, error))
			for _, m := range nodes {
				byAddr[m.addr] = m.dialer
			}
			g.Dialer = func(ctx context.Context, addr string) (net.Conn, error) { return byAddr[addr](ctx, addr) }
		}
		tr, err := n.hub.Transport(context.Background(), g)
		if err != nil {
			t.Fatal(err)
		}
		out[r] = tr.(*transport)
		t.Cleanup(func() { _ = tr.Close() })
	}
	return out
}

// memNodes makes n in-memory nodes with distinct addresses.
func memNodes(t testing.TB, tune tuning, n int) []*node {
	nodes := make([]*node, n)
	for i := range nodes {
		nodes[i] = newNode(t, tune, true)
		nodes[i].addr = fmt.Sprintf("bufconn-%d", i)
	}
	return nodes
}

func tcpNodes(t testing.TB, tune tuning, n int, extra ...grpc.ServerOption) []*node {
	nodes := make([]*node, n)
	for i := range nodes {
		nodes[i] = newNode(t, tune, false, extra...)
	}
	return nodes
}

// dataHeader describes a frame of n payload bytes from src: fp32 data when n is a multiple
// of 4, else an abort frame (any length).
func dataHeader(src, n int, tag uint64, piece uint32) collective.Header {
	h := collective.Header{Kind: collective.KindData, DType: collective.DTypeFP32, Op: collective.OpAllReduce,
		Src: uint16(src), Tag: tag, Piece: piece, Count: uint32(n / 4), Length: uint32(n)}
	if n%4 != 0 {
		h = collective.Header{Kind: collective.KindAbort, Src: uint16(src), Tag: tag, Piece: piece, Length: uint32(n)}
	}
	return h
}

// pattern fills b with bytes determined by seed and position, so that a frame whose bytes
// were shifted, mixed with another frame's or overwritten is told apart.
func pattern(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 + 1
	for i := range b {
		if i%8 == 0 {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
		}
		b[i] = byte(x >> (8 * (i % 8)))
	}
}

func checkPattern(b []byte, seed uint64) error {
	want := make([]byte, len(b))
	pattern(want, seed)
	if i := firstDiff(b, want); i >= 0 {
		return fmt.Errorf("payload differs from pattern %d at byte %d of %d", seed, i, len(b))
	}
	return nil
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if i >= len(b) || a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// proxy forwards TCP connections to target until frozen: then it stops moving bytes but
// keeps every connection open, like a host that vanished without closing its sockets.
type proxy struct {
	lis    net.Listener
	target string
	frozen chan struct{}
	thawed chan struct{}
	closed chan struct{}
	wg     sync.WaitGroup

	mu struct {
		sync.Mutex
		conns []net.Conn
	}
	freezeOnce, thawOnce, closeOnce sync.Once
}

func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{lis: l, target: target, frozen: make(chan struct{}), thawed: make(chan struct{}), closed: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) addr() string { return p.lis.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		d, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.mu.conns = append(p.mu.conns, c, d)
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pump(d, c)
		go p.pump(c, d)
	}
}

func (p *proxy) pump(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			select {
			case <-p.frozen:
				// Hold the bytes until thawed (then they go on) or closed.
				select {
				case <-p.thawed:
				case <-p.closed:
					return
				}
			default:
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			_ = dst.Close()
			return
		}
	}
}

func (p *proxy) freeze() { p.freezeOnce.Do(func() { close(p.frozen) }) }

// thaw lets the proxy move bytes again, the held ones first.
func (p *proxy) thaw() { p.thawOnce.Do(func() { close(p.thawed) }) }

func (p *proxy) close() {
	p.closeOnce.Do(func() {
		close(p.closed)
		_ = p.lis.Close()
		p.mu.Lock()
		for _, c := range p.mu.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
}

// isPeerErr checks that err is a *collective.PeerError naming rank and wrapping want.
func isPeerErr(t testing.TB, err error, rank int, want error) {
	t.Helper()
	var pe *collective.PeerError
	if !errors.As(err, &pe) {
		t.Fatalf("error %v (%T) is not a *collective.PeerError", err, err)
	}
	if pe.Rank != rank {
		t.Fatalf("error names rank %d, want %d: %v", pe.Rank, rank, err)
	}
	if !errors.Is(err, want) {
		t.Fatalf("error %v does not wrap %v", err, want)
	}
}

var _ = io.EOF
