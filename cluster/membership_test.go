package cluster

import (
	"context"
	"errors"
	"flag"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

// TestMembership: members join and see each other with metadata; metadata updates spread;
// a member that closes is reported Left; a killed member is reported Failed within the
// tuned detection time.
func TestMembership(t *testing.T) {
	checkLeaks(t)
	a := startNode(t, "a", RoleCoordinator)
	b := startNode(t, "b", RoleWorker)
	c := startNode(t, "c", RoleWorker)
	d := startNode(t, "d", RoleWorker)
	for _, n := range []*testNode{b, c, d} {
		join(t, n, a)
	}
	all := []string{"a", "b", "c", "d"}
	for _, n := range []*testNode{a, b, c, d} {
		eventually(t, 5*time.Second, n.LocalName()+" to see everyone", func() bool {
			return slices.Equal(memberNames(n.Members()), all)
		})
	}
	a.events.find(t, Joined, "b", time.Second)
	a.events.find(t, Joined, "d", time.Second)
	if a.events.has(Joined, "a") {
		t.Error("a node got an event about itself")
	}
	for _, m := range d.Members() {
		if m.Name == "a" && (m.Meta.Role != RoleCoordinator || m.Meta.GRPC != a.LocalMeta().GRPC || m.Meta.Rank != -1 || m.Meta.Devices != 1) {
			t.Errorf("d sees a's metadata as %+v, want %+v", m.Meta, a.LocalMeta())
		}
	}

	// Metadata updates: an explicit one, and the throttled step.
	if err := b.UpdateMeta(func(m *Meta) { m.Job = "j1" }); err != nil {
		t.Fatal(err)
	}
	if ev := a.events.find(t, Updated, "b", 2*time.Second); ev.Member.Meta.Job != "j1" {
		t.Errorf("update event carries job %q", ev.Member.Meta.Job)
	}
	if err := b.UpdateMeta(func(m *Meta) { m.Role = RoleCoordinator }); !errors.Is(err, ErrBadMeta) {
		t.Errorf("changing the role: got %v, want ErrBadMeta", err)
	}
	for step := int64(1); step <= 100; step++ {
		b.SetStep(step)
	}
	eventually(t, 3*time.Second, "a to see b at step 100", func() bool {
		for _, m := range a.Members() {
			if m.Name == "b" {
				return m.Meta.Step == 100
			}
		}
		return false
	})

	// Graceful leave.
	if err := c.Close(); err != nil {
		t.Fatalf("close c: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second close of c: %v", err)
	}
	for _, n := range []*testNode{a, b, d} {
		ev := n.events.find(t, Left, "c", 3*time.Second)
		if ev.Member.State != StateLeft {
			t.Errorf("%s: Left event with state %q", n.LocalName(), ev.Member.State)
		}
	}

	// Kill d: no leave notice, no leave message; only the failure detector can tell.
	killed := time.Now()
	d.kill()
	var slowest time.Duration
	for _, n := range []*testNode{a, b} {
		ev := n.events.find(t, Failed, "d", 5*time.Second)
		took := ev.at.Sub(killed)
		slowest = max(slowest, took)
		if ev.Member.State != StateDead || ev.Member.Meta.Role != RoleWorker {
			t.Errorf("%s: Failed event %+v", n.LocalName(), ev.Member)
		}
		t.Logf("%s saw d fail after %v", n.LocalName(), took.Round(time.Millisecond))
	}
	// probe interval 200ms, suspicion 3 × 200ms (up to 4× that unconfirmed), plus slack
	// for a busy machine.
	if slowest > 4*time.Second {
		t.Errorf("failure detection took %v", slowest)
	}
	for _, n := range []*testNode{a, b} {
		if n.events.has(Failed, "c") || n.events.has(Left, "d") {
			t.Errorf("%s confused a leave with a failure: %s", n.LocalName(), n.events)
		}
		eventually(t, time.Second, "d gone from the member list", func() bool {
			return slices.Equal(memberNames(n.Members()), []string{"a", "b"})
		})
	}
}

var measureDefaults = flag.Bool("cluster.measure-defaults", false, "measure failure detection with the default (production) gossip timings")

// TestDetectionTimeDefaults measures how long the default timings take to report a killed
// member (go test ./cluster -run DetectionTimeDefaults -cluster.measure-defaults -v).
func TestDetectionTimeDefaults(t *testing.T) {
	if !*measureDefaults {
		t.Skip("takes several seconds; enable with -cluster.measure-defaults")
	}
	checkLeaks(t)
	def := DefaultConfig().Gossip
	setDefaults := func(c *Config, _ *Meta) { c.Gossip = def }
	var nodes []*testNode
	for _, name := range []string{"a", "b", "c", "d", "e"} {
		nodes = append(nodes, startNode(t, name, RoleWorker, setDefaults))
	}
	for _, n := range nodes[1:] {
		join(t, n, nodes[0])
	}
	eventually(t, 10*time.Second, "everyone sees everyone", func() bool {
		for _, n := range nodes {
			if len(n.Members()) != len(nodes) {
				return false
			}
		}
		return true
	})
	victim := nodes[len(nodes)-1]
	killed := time.Now()
	victim.kill()
	for _, n := range nodes[:len(nodes)-1] {
		ev := n.events.find(t, Failed, victim.LocalName(), 30*time.Second)
		t.Logf("%s saw %s fail after %v", n.LocalName(), victim.LocalName(), ev.at.Sub(killed).Round(time.Millisecond))
	}
}

// TestWrongKey: a node with another cluster key cannot join; its Join says to check the
// key, and the member it tried logs a warning naming its address.
func TestWrongKey(t *testing.T) {
	checkLeaks(t)
	a := startNode(t, "a", RoleCoordinator)
	b := startNode(t, "b", RoleWorker, withKey(otherKey))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := b.Join(ctx, a.LocalAddr())
	if !errors.Is(err, ErrKeyMismatch) {
		t.Fatalf("join with the wrong key: got %v, want ErrKeyMismatch", err)
	}
	if !strings.Contains(err.Error(), "cluster key") || !strings.Contains(err.Error(), a.LocalAddr()) {
		t.Errorf("join error does not point at the key and the peer: %v", err)
	}
	t.Logf("joiner: %v", err)
	eventually(t, 2*time.Second, "a warning on a", func() bool {
		for _, e := range a.logs.FilterLevelExact(zap.WarnLevel).All() {
			if strings.Contains(e.Message, "cluster's key") {
				addr, _ := e.ContextMap()["remote_addr"].(string)
				t.Logf("member: %s (remote_addr=%s)", e.Message, addr)
				return strings.HasPrefix(addr, "127.0.0.1:")
			}
		}
		return false
	})
	if got := memberNames(a.Members()); !slices.Equal(got, []string{"a"}) {
		t.Errorf("a's members after a refused join: %v", got)
	}
}

// TestIncompatibleVersion: a node with another major.minor is refused on both sides; a
// different patch release is welcome.
func TestIncompatibleVersion(t *testing.T) {
	checkLeaks(t)
	a := startNode(t, "a", RoleCoordinator, withVersion("0.1.0"))
	b := startNode(t, "b", RoleWorker, withVersion("0.2.0"))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := b.Join(ctx, a.LocalAddr())
	if !errors.Is(err, ErrIncompatibleVersion) {
		t.Fatalf("join: got %v, want ErrIncompatibleVersion", err)
	}
	want := "coordinator a (" + a.LocalAddr() + ") runs qvd 0.1.0, this node runs qvd 0.2.0"
	if !strings.Contains(err.Error(), want) {
		t.Errorf("join error %q does not say %q", err, want)
	}
	t.Logf("joiner: %v", err)
	eventually(t, 2*time.Second, "a warning on a", func() bool {
		for _, e := range a.logs.FilterMessage("refusing node").All() {
			errText, _ := e.ContextMap()["error"].(string)
			t.Logf("member: %s: %s", e.Message, errText)
			return e.ContextMap()["member"] == "b" && strings.Contains(errText, "runs qvd 0.2.0, this node runs qvd 0.1.0")
		}
		return false
	})
	if got := memberNames(a.Members()); !slices.Equal(got, []string{"a"}) {
		t.Errorf("a's members after a refused join: %v", got)
	}

	c := startNode(t, "c", RoleWorker, withVersion("0.1.7-rc1"))
	join(t, c, a)
}

func TestCompatible(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want bool
	}{
		{"0.1.0", "0.1.9", true},
		{"0.1.0-dev", "0.1.2", true},
		{"v1.2.3", "1.2.0", true},
		{"1.2", "1.2.5+build7", true},
		{"0.1.0", "0.2.0", false},
		{"1.0.0", "2.0.0", false},
		{"dev", "dev", true},
		{"dev", "0.1.0", false},
		{"", "0.1.0", false},
	} {
		if got := Compatible(tc.a, tc.b); got != tc.want {
			t.Errorf("Compatible(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
}

// TestStatus: an observer lists the members with their metadata, then leaves.
func TestStatus(t *testing.T) {
	checkLeaks(t)
	a := startNode(t, "a", RoleCoordinator)
	b := startNode(t, "b", RoleWorker)
	join(t, b, a)
	if err := a.UpdateMeta(func(m *Meta) { m.Job = "job-7" }); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig("status-probe")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var members []Member
	// Status asks b, which learns a's new job by gossip: wait for that too.
	eventually(t, 3*time.Second, "status to see both members and a's job", func() bool {
		var err error
		members, err = Status(ctx, cfg, b.LocalAddr(), nil)
		if err != nil {
			t.Fatalf("Status: %v", err)
		}
		if !slices.Equal(memberNames(members), []string{"a", "b"}) {
			return false
		}
		for _, m := range members {
			if m.Name == "a" && m.Meta.Job != "job-7" {
				return false
			}
		}
		return true
	})
	var out strings.Builder
	if err := FormatStatus(&out, members); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", out.String())
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "NAME") || !strings.Contains(lines[0], "STEP") {
		t.Fatalf("status table:\n%s", out.String())
	}
	if f := strings.Fields(lines[1]); f[0] != "a" || f[1] != a.LocalAddr() || f[2] != "alive" || f[3] != RoleCoordinator || f[6] != "job-7" {
		t.Errorf("row for a: %q", lines[1])
	}
	// The observer said goodbye: it is reported Left, not Failed. b, which the observer joined
	// through, is asked: a may hear of the observer only by gossip, and under load the observer
	// can be gone before that gossip reaches a (then a never sees it at all).
	b.events.find(t, Left, "status-probe", 3*time.Second)
	if a.events.has(Failed, "status-probe") || b.events.has(Failed, "status-probe") {
		t.Error("the observer's departure was reported as a failure")
	}

	if _, err := Status(ctx, withKeyConfig(cfg, otherKey), a.LocalAddr(), nil); !errors.Is(err, ErrKeyMismatch) {
		t.Errorf("status with the wrong key: %v", err)
	}
}

func withKeyConfig(c Config, key []byte) Config { c.Key = key; return c }

func TestCloseTwiceAndEventsClosed(t *testing.T) {
	checkLeaks(t)
	n, err := New(testConfig("solo"), Meta{Role: RoleWorker}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := <-n.Events(); ok {
		t.Error("Events still open after Close")
	}
	if err := n.UpdateMeta(func(*Meta) {}); !errors.Is(err, ErrClosed) {
		t.Errorf("UpdateMeta after Close: %v", err)
	}
	if err := n.Join(context.Background(), "127.0.0.1:1"); !errors.Is(err, ErrClosed) {
		t.Errorf("Join after Close: %v", err)
	}
}
