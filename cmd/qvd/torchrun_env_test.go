package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/cluster"
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
		want   torchrunPlan
	}{
		{"no environment", func(string) string { return "" }, false, torchrunPlan{}},
		{"RANK without WORLD_SIZE", torchEnv(0, 2, "WORLD_SIZE", ""), false, torchrunPlan{}},
		{"one process", torchEnv(0, 1), false, torchrunPlan{}},
		{"rank 0", torchEnv(0, 2), true, torchrunPlan{World: 2, Coordinator: true, MasterAddr: "10.0.0.7", Port: 29400,
			Peer: "10.0.0.7:29400", NodeName: "torchrun-0"}},
		{"rank 0 without MASTER_ADDR", torchEnv(0, 2, "MASTER_ADDR", ""), true, torchrunPlan{World: 2, Coordinator: true, Port: 29400,
			NodeName: "torchrun-0"}},
		{"default port", torchEnv(3, 12, "MASTER_PORT", "", "MASTER_ADDR", "master-0.job"), true, torchrunPlan{Rank: 3, World: 12,
			MasterAddr: "master-0.job", Port: 29500, Peer: "master-0.job:29500", NodeName: "torchrun-03"}},
		{"local rank and world", torchEnv(5, 8, "LOCAL_RANK", "1", "LOCAL_WORLD_SIZE", "4"), true, torchrunPlan{Rank: 5, World: 8,
			LocalRank: 1, LocalWorld: 4, MasterAddr: "10.0.0.7", Port: 29400, Peer: "10.0.0.7:29400", NodeName: "torchrun-5"}},
		{"IPv6 master", torchEnv(1, 2, "MASTER_ADDR", "fd00::1"), true, torchrunPlan{Rank: 1, World: 2, MasterAddr: "fd00::1", Port: 29400,
			Peer: "[fd00::1]:29400", NodeName: "torchrun-1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok, err := planTorchrun(c.getenv)
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
			if _, _, err := planTorchrun(c.getenv); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error mentioning %q", err, c.want)
			}
		})
	}
	// The rendezvous ranks workers by node name: names must sort in RANK order at every width.
	for _, n := range []int{2, 10, 11, 101, 1000} {
		var names []string
		for r := range n {
			p, ok, err := planTorchrun(torchEnv(r, n))
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

// launcherEnv is this process's environment without the variables of any launcher (torchrun,
// SLURM, qvd launch) that could leak in from the machine running the tests.
func launcherEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "SLURM"), strings.HasPrefix(k, "MASTER_"), strings.HasPrefix(k, "QVD_"),
			slices.Contains([]string{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GOMAXPROCS", "OPENBLAS_NUM_THREADS"}, k):
			continue
		}
		env = append(env, kv)
	}
	return env
}

// freePortPair is a free port whose successor is free too (the coordinator's gRPC port).
func freePortPair(t *testing.T) int {
	t.Helper()
	for range 50 {
		port, err := freePort("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1)); err == nil {
			l.Close()
			return port
		}
	}
	t.Fatal("no two consecutive free ports")
	return 0
}

var weightsRE = regexp.MustCompile(`"weights_sha256": "([0-9a-f]{64})"`)

// TestTorchrunEnvJob (ecosystem item 1): two `qvd train` processes with nothing but RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and the cluster key) form a job: rank 1 joins as
// rank 1, both exit 0 with the same weights, and those are the weights of one process with
// the same global batch.
func TestTorchrunEnvJob(t *testing.T) {
	needDataset(t)
	if testing.Short() {
		t.Skip("multi-process")
	}
	port := freePortPair(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "torchrun")
	small := []string{"--train-subset", "1024", "--test-subset", "200", "--max-steps", "8", "--transport", "tcp", "--seed", "5", "--quiet"}
	var outs []*syncBuffer
	var dones []<-chan int
	for rank := range 2 {
		cmd, o := qvdCmd(t, testKey, append([]string{"train", "--out", out, "--micro-batch", "16"}, small...)...)
		cmd.Env = append(launcherEnv(), asQVD+"=1", clusterKeyEnv+"="+testKey, "RANK="+fmt.Sprint(rank), "WORLD_SIZE=2",
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT="+fmt.Sprint(port))
		outs, dones = append(outs, o), append(dones, started(t, cmd))
	}
	var sums []string
	for rank, done := range dones {
		select {
		case code := <-done:
			if code != exitOK {
				t.Fatalf("rank %d: exit %d\n%s\n--- other rank:\n%s", rank, code, outs[rank], tail(outs[1-rank].String(), 30))
			}
		case <-time.After(3 * time.Minute):
			t.Fatalf("the job did not finish:\n%s\n%s", outs[0], outs[1])
		}
		m := weightsRE.FindAllStringSubmatch(outs[rank].String(), -1)
		if len(m) == 0 {
			t.Fatalf("rank %d logged no weights_sha256:\n%s", rank, outs[rank])
		}
		sums = append(sums, m[len(m)-1][1])
	}
	if w := outs[1].String(); !strings.Contains(w, "torchrun-1") || !strings.Contains(w, `"rank": 1`) || !strings.Contains(w, `"role": "worker"`) {
		t.Fatalf("RANK=1 did not run as the worker torchrun-1 with rank 1:\n%s", w)
	}
	if sums[0] != sums[1] {
		t.Fatalf("the ranks end with different weights: %s vs %s", sums[0], sums[1])
	}
	single := filepath.Join(dir, "single")
	if code, so, se := runQVD(t, append([]string{"train", "--out", single, "--micro-batch", "32"}, small...)...); code != exitOK {
		t.Fatalf("single process: exit %d\n%s\n%s", code, so, se)
	}
	if d := maxDiff(t, readModel(t, filepath.Join(single, "checkpoints")), readModel(t, filepath.Join(out, "checkpoints"))); d > 1e-5 {
		t.Fatalf("the torchrun-style job ends %g away from one process with the same global batch", d)
	} else {
		t.Logf("2 processes from the torchrun environment vs 1 process, global batch 32, 8 steps: max weight difference %.3g", d)
	}
}

// TestTLSEnvOverConfig (ecosystem item 2): flags > environment > config. QVD_TLS_* win over
// the config's tls section (which names files that do not exist here), and the flags over both.
func TestTLSEnvOverConfig(t *testing.T) {
	env := map[string]string{tlsCAEnv: "env-ca", tlsCertEnv: "env-cert", tlsKeyEnv: "env-key"}
	getenv := func(k string) string { return env[k] }
	none := func(string) string { return "" }
	conf := cluster.TLSConfig{CA: "conf-ca", Cert: "conf-cert", Key: "conf-key"}
	flags := tlsFlags{ca: "flag-ca", cert: "flag-cert", key: "flag-key"}
	for _, c := range []struct {
		name   string
		flags  tlsFlags
		getenv func(string) string
		conf   cluster.TLSConfig
		want   string
	}{
		{"flags over all", flags, getenv, conf, "flag"},
		{"environment over config", tlsFlags{}, getenv, conf, "env"},
		{"config alone", tlsFlags{}, none, conf, "conf"},
		{"environment alone (a worker)", tlsFlags{}, getenv, cluster.TLSConfig{}, "env"},
		{"nothing", tlsFlags{}, none, cluster.TLSConfig{}, ""},
	} {
		got := resolveTLS(c.flags, c.getenv, c.conf)
		want := cluster.TLSConfig{}
		if c.want != "" {
			want = cluster.TLSConfig{CA: c.want + "-ca", Cert: c.want + "-cert", Key: c.want + "-key"}
		}
		if got != want {
			t.Errorf("%s: got %+v, want %+v", c.name, got, want)
		}
	}
	// The same through the loader, with real files: the environment's load, the config's would
	// fail (no such files).
	dir := certsFor(t, "127.0.0.1")
	a := tlsArgs(dir, "127.0.0.1")
	t.Setenv(tlsCAEnv, a[1])
	t.Setenv(tlsCertEnv, a[3])
	t.Setenv(tlsKeyEnv, a[5])
	bogus := cluster.TLSConfig{CA: filepath.Join(dir, "missing-ca.pem"), Cert: filepath.Join(dir, "missing.pem"), Key: filepath.Join(dir, "missing-key.pem")}
	files, id, err := tlsFlags{}.load(bogus)
	if err != nil || id == nil || files.CA != a[1] {
		t.Fatalf("QVD_TLS_* over the config: loaded %+v, %v", files, err)
	}
	if _, _, err := (tlsFlags{ca: bogus.CA, cert: bogus.Cert, key: bogus.Key}).load(cluster.TLSConfig{}); err == nil {
		t.Fatal("flags naming missing files loaded: the environment won over the flags")
	}
}
