package cluster

import (
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/leakcheck"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
)

// Random keys, as `qvd keygen` makes them: ValidateKey refuses patterned ones.
var (
	testKey  = mustHex("04d27db39f306d1cb957887e8d2ec0291f5ba6bbd44b17ebc751b90c47ad1dc9")
	otherKey = mustHex("e5d474cfc838d2e1caf84cce9106813ee2419f3dd22f487a4ade208308af2b48")
)

func mustHex(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

// testGossip scales the LAN defaults down 5×, so a death is detected in about a second.
var testGossip = GossipConfig{
	ProbeInterval:    200 * time.Millisecond,
	ProbeTimeout:     100 * time.Millisecond,
	GossipInterval:   40 * time.Millisecond,
	PushPullInterval: 3 * time.Second,
	TCPTimeout:       time.Second,
	SuspicionMult:    3,
}

func testConfig(name string) Config {
	c := DefaultConfig()
	c.NodeName = name
	c.Bind = "127.0.0.1:0"
	c.Gossip = testGossip
	c.RendezvousTimeout = 10 * time.Second
	c.StepInterval = 50 * time.Millisecond
	c.Key = testKey
	return c
}

// testNode is a Node with its own gRPC server on 127.0.0.1:0, as every qvd process has.
type testNode struct {
	*Node
	logs   *observer.ObservedLogs
	srv    *grpc.Server
	served chan struct{}
	events *eventLog
}

type nodeOpt func(*Config, *Meta)

func withVersion(v string) nodeOpt { return func(_ *Config, m *Meta) { m.Version = v } }
func withKey(k []byte) nodeOpt     { return func(c *Config, _ *Meta) { c.Key = k } }
func withRendezvous(d time.Duration) nodeOpt {
	return func(c *Config, _ *Meta) { c.RendezvousTimeout = d }
}

// startNode starts a node and its gRPC server; both are stopped at cleanup.
func startNode(t *testing.T, name, role string, opts ...nodeOpt) *testNode {
	t.Helper()
	cfg := testConfig(name)
	meta := Meta{Role: role, Devices: 1, Memory: 1 << 30}
	for _, o := range opts {
		o(&cfg, &meta)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	meta.GRPC = lis.Addr().String()
	meta.Data = "127.0.0.1:1" // a placeholder data-plane address, carried in the roster

	core, logs := observer.New(zapcore.InfoLevel)
	n, err := New(cfg, meta, zap.New(core))
	if err != nil {
		_ = lis.Close()
		t.Fatalf("New(%s): %v", name, err)
	}
	srv := grpc.NewServer(ServerOptions(cfg.Key, cfg.TLS, zap.New(core))...)
	n.Register(srv)
	tn := &testNode{Node: n, logs: logs, srv: srv, served: make(chan struct{})}
	go func() {
		defer close(tn.served)
		_ = srv.Serve(lis)
	}()
	tn.events = watchEvents(n)
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Logf("close %s: %v", name, err)
		}
		srv.Stop()
		<-tn.served
		tn.events.wait()
	})
	return tn
}

// eventLog records a node's events until its channel closes.
type eventLog struct {
	mu     sync.Mutex
	events []timedEvent
	done   chan struct{}
}

type timedEvent struct {
	Event
	at time.Time
}

func watchEvents(n *Node) *eventLog {
	l := &eventLog{done: make(chan struct{})}
	ch := n.Events()
	go func() {
		defer close(l.done)
		for ev := range ch {
			l.mu.Lock()
			l.events = append(l.events, timedEvent{ev, time.Now()})
			l.mu.Unlock()
		}
	}()
	return l
}

func (l *eventLog) wait() { <-l.done }

// find returns the first event of kind about member, waiting up to timeout.
func (l *eventLog) find(t *testing.T, kind EventKind, member string, timeout time.Duration) timedEvent {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		l.mu.Lock()
		for _, ev := range l.events {
			if ev.Kind == kind && ev.Member.Name == member {
				l.mu.Unlock()
				return ev
			}
		}
		l.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no %v event for %s within %v; events: %v", kind, member, timeout, l.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (l *eventLog) has(kind EventKind, member string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ev := range l.events {
		if ev.Kind == kind && ev.Member.Name == member {
			return true
		}
	}
	return false
}

func (l *eventLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var parts []string
	for _, ev := range l.events {
		parts = append(parts, fmt.Sprintf("%v:%s", ev.Kind, ev.Member.Name))
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// eventually polls cond until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func memberNames(ms []Member) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Name)
	}
	sort.Strings(out)
	return out
}

func join(t *testing.T, n *testNode, peer *testNode) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := n.Join(ctx, peer.LocalAddr()); err != nil {
		t.Fatalf("%s joins %s: %v", n.LocalName(), peer.LocalName(), err)
	}
}

// checkLeaks fails the test if goroutines started during it outlive its cleanup. Call it
// first in a test, so that its cleanup runs last.
func checkLeaks(t *testing.T) {
	// memberlist's suspicion timers run as time.AfterFunc callbacks (short-lived, and not
	// ours to stop); the testing package's own goroutines are not ours either.
	leakcheck.Check(t, goleak.IgnoreAnyFunction("testing.tRunner"),
		goleak.IgnoreAnyFunction("github.com/hashicorp/memberlist.newSuspicion.func1"))
}
