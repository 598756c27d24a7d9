package launch

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
)

// torchEnv is a process's environment as torchrun sets it (plus extra name, value pairs).
func torchEnv(rank, world int, extra ...string) func(string) string {
	env := map[string]string{"RANK": fmt.Sprint(rank), "WORLD_SIZE": fmt.Sprint(world), "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
	for i := 0; i+1 < len(extra); i += 2 {
		env[extra[i]] = extra[i+1]
	}
	return func(k string) string { return env[k] }
}

func TestTorchrunPlan(t *testing.T) {
	for _, c := range []struct {
		name   string
		getenv func(string) string
		ok     bool
		want   TorchrunPlan
	}{
		{"no environment", func(string) string { return "" }, false, TorchrunPlan{}},
		{"RANK without WORLD_SIZE", torchEnv(0, 2, "WORLD_SIZE", ""), false, TorchrunPlan{}},
		{"one process", torchEnv(0, 1), false, TorchrunPlan{}},
		{"rank 0", torchEnv(0, 2), true, TorchrunPlan{World: 2, Coordinator: true, MasterAddr: "10.0.0.7", Port: 29400,
			Peer: "10.0.0.7:29400", NodeName: "torchrun-0"}},
		{"rank 0 without MASTER_ADDR", torchEnv(0, 2, "MASTER_ADDR", ""), true, TorchrunPlan{World: 2, Coordinator: true, Port: 29400,
			NodeName: "torchrun-0"}},
		{"default port", torchEnv(3, 12, "MASTER_PORT", "", "MASTER_ADDR", "master-0.job"), true, TorchrunPlan{Rank: 3, World: 12,
			MasterAddr: "master-0.job", Port: 29500, Peer: "master-0.job:29500", NodeName: "torchrun-03"}},
		{"local rank and world", torchEnv(5, 8, "LOCAL_RANK", "1", "LOCAL_WORLD_SIZE", "4"), true, TorchrunPlan{Rank: 5, World: 8,
			LocalRank: 1, LocalWorld: 4, MasterAddr: "10.0.0.7", Port: 29400, Peer: "10.0.0.7:29400", NodeName: "torchrun-5"}},
		{"IPv6 master", torchEnv(1, 2, "MASTER_ADDR", "fd00::1"), true, TorchrunPlan{Rank: 1, World: 2, MasterAddr: "fd00::1", Port: 29400,
			Peer: "[fd00::1]:29400", NodeName: "torchrun-1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok, err := PlanTorchrun(c.getenv)
			if err != nil {
				t.Fatal(err)
			}
			if ok != c.ok {
				t.Fatalf("ok = %v, want %v", ok, c.ok)
			}
			if ok && got != c.want {
				t.Fatalf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
	for _, c := range []struct {
		name   string
		getenv func(string) string
		want   string
	}{
		{"rank not a number", torchEnv(0, 2, "RANK", "x"), "RANK"},
		{"rank too large", torchEnv(2, 2), "not below"},
		{"world 0", torchEnv(0, 0), "WORLD_SIZE"},
		{"bad port", torchEnv(1, 2, "MASTER_PORT", "http"), "MASTER_PORT"},
		{"port without room for gRPC", torchEnv(1, 2, "MASTER_PORT", "65535"), "65534"},
		{"worker without MASTER_ADDR", torchEnv(1, 2, "MASTER_ADDR", ""), "MASTER_ADDR"},
		{"local rank too large", torchEnv(1, 2, "LOCAL_RANK", "2", "LOCAL_WORLD_SIZE", "2"), "LOCAL_RANK"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, _, err := PlanTorchrun(c.getenv); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error mentioning %q", err, c.want)
			}
		})
	}
	// The rendezvous ranks workers by node name: names must sort in RANK order at every width.
	for _, n := range []int{2, 10, 11, 101, 1000} {
		var names []string
		for r := range n {
			p, ok, err := PlanTorchrun(torchEnv(r, n))
			if err != nil || !ok {
				t.Fatalf("rank %d of %d: %v %v", r, n, ok, err)
			}
			names = append(names, p.NodeName)
		}
		if !sort.StringsAreSorted(names) || len(slices.Compact(slices.Clone(names))) != n {
			t.Fatalf("%d ranks: node names not unique and in rank order: %v", n, names)
		}
	}
}

func TestTorchrunThreads(t *testing.T) {
	for _, c := range []struct {
		env        map[string]string
		localWorld int
		want       int
	}{
		{nil, 0, 0}, {nil, 4, 4}, {nil, 32, 1}, {map[string]string{"OMP_NUM_THREADS": "1"}, 2, 8},
		{map[string]string{"GOMAXPROCS": "3"}, 2, 0}, {map[string]string{"OPENBLAS_NUM_THREADS": "3"}, 2, 0},
	} {
		if got := torchrunThreads(func(k string) string { return c.env[k] }, c.localWorld, 16); got != c.want {
			t.Errorf("%v, LOCAL_WORLD_SIZE %d: %d threads, want %d", c.env, c.localWorld, got, c.want)
		}
	}
}
