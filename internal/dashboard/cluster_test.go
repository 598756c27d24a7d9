package dashboard

import (
	"context"
	"encoding/hex"
	"testing"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/internal/leakcheck"
	"github.com/qvd/qvd/internal/metrics"
)

func testNode(t *testing.T, name, role string) *cluster.Node {
	t.Helper()
	return testNodeAt(t, name, role, "127.0.0.1:0")
}

func testNodeAt(t *testing.T, name, role, bind string) *cluster.Node {
	t.Helper()
	key, _ := hex.DecodeString("04d27db39f306d1cb957887e8d2ec0291f5ba6bbd44b17ebc751b90c47ad1dc9")
	cfg := cluster.DefaultConfig()
	cfg.NodeName, cfg.Bind, cfg.Key, cfg.StepInterval = name, bind, key, 50*time.Millisecond
	cfg.Gossip = cluster.GossipConfig{ProbeInterval: 200 * time.Millisecond, ProbeTimeout: 100 * time.Millisecond,
		GossipInterval: 40 * time.Millisecond, PushPullInterval: 3 * time.Second, TCPTimeout: time.Second, SuspicionMult: 3}
	n, err := cluster.New(cfg, cluster.Meta{Role: role}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	return n
}

// waitMembers polls v until ok accepts its members, or fails the test after 10 s.
func waitMembers(t *testing.T, v *ClusterView, what string, ok func([]metrics.Member) bool) []metrics.Member {
	t.Helper()
	var ms []metrics.Member
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if ms = v.Members(); ok(ms) {
			return ms
		}
	}
	t.Fatalf("%s: never; last view %+v", what, ms)
	return nil
}

// TestClusterView: an observer's view lists the training members (not itself) with the rank,
// step and memory they gossip, and a member that leaves as left, from the node's events.
func TestClusterView(t *testing.T) {
	leakcheck.Check(t)
	worker := testNode(t, "w0", cluster.RoleWorker)
	obs := testNode(t, "dash", cluster.RoleObserver)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := obs.Join(ctx, worker.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	v := NewClusterView(obs, ViewOptions{WatchEvents: true})
	defer v.Close()
	if err := worker.UpdateMeta(func(m *cluster.Meta) { m.Rank = 0 }); err != nil {
		t.Fatal(err)
	}
	worker.SetStep(12)
	worker.SetModelBytes(3 << 20)
	worker.SetMemory(300<<20, 100<<20)
	ms := waitMembers(t, v, "the worker's figures", func(ms []metrics.Member) bool {
		return len(ms) == 1 && ms[0].Step == 12 && ms[0].RSS == 300<<20
	})
	if m := ms[0]; m.Name != "w0" || m.Rank != 0 || m.State != cluster.StateAlive || m.Peak != 100<<20 || m.Model != 3<<20 || m.Gen == 0 || m.Role != cluster.RoleWorker {
		t.Fatalf("member %+v", m)
	}
	if err := worker.Close(); err != nil {
		t.Fatal(err)
	}
	waitMembers(t, v, "the worker shown as left", func(ms []metrics.Member) bool {
		return len(ms) == 1 && ms[0].State == cluster.StateLeft && ms[0].Step == 12
	})
}

// TestClusterViewWithoutEvents: a view that does not read events (rank 0's, beside the
// trainer's peer watch) shows a departed member as missing, and its own figures at once.
func TestClusterViewWithoutEvents(t *testing.T) {
	leakcheck.Check(t)
	coord := testNode(t, "c0", cluster.RoleCoordinator)
	worker := testNode(t, "w1", cluster.RoleWorker)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := worker.Join(ctx, coord.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	v := NewClusterView(coord, ViewOptions{})
	defer v.Close()
	coord.SetStep(3)
	waitMembers(t, v, "both members", func(ms []metrics.Member) bool {
		return len(ms) == 2 && ms[0].Name == "c0" && ms[0].Step == 3
	})
	// A view of one job leaves out the members of others (here the worker, with none).
	if err := coord.UpdateMeta(func(m *cluster.Meta) { m.Job = "j1" }); err != nil {
		t.Fatal(err)
	}
	if ms := NewClusterView(coord, ViewOptions{Job: "j1"}).Members(); len(ms) != 1 || ms[0].Name != "c0" || ms[0].Job != "j1" {
		t.Fatalf("job j1's view: %+v, want c0 alone", ms)
	}
	if err := worker.Close(); err != nil {
		t.Fatal(err)
	}
	waitMembers(t, v, "the worker shown as missing", func(ms []metrics.Member) bool {
		return len(ms) == 2 && ms[1].Name == "w1" && ms[1].State == StateMissing
	})
}

// TestClusterViewRejoin: when every member it knew is gone, an observer's view joins its peer
// address again, so a job restarted there (a resumed run) shows up.
func TestClusterViewRejoin(t *testing.T) {
	leakcheck.Check(t)
	first := testNode(t, "w0", cluster.RoleWorker)
	addr := first.LocalAddr()
	obs := testNode(t, "dash", cluster.RoleObserver)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := obs.Join(ctx, addr); err != nil {
		t.Fatal(err)
	}
	v := NewClusterView(obs, ViewOptions{WatchEvents: true, Rejoin: addr, RejoinEvery: 100 * time.Millisecond})
	defer v.Close()
	waitMembers(t, v, "the first member", func(ms []metrics.Member) bool { return len(ms) == 1 && ms[0].State == cluster.StateAlive })
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	waitMembers(t, v, "the first member gone", func(ms []metrics.Member) bool { return len(ms) == 1 && ms[0].State != cluster.StateAlive })
	testNodeAt(t, "w0-restarted", cluster.RoleWorker, addr)
	waitMembers(t, v, "the restarted member", func(ms []metrics.Member) bool {
		return len(ms) == 2 && ms[0].Name == "w0-restarted" && ms[0].State == cluster.StateAlive && ms[1].Name == "w0"
	})
}
