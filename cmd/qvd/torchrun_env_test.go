package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

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
		port, err := launch.FreePort("127.0.0.1")
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
		cmd.Env = append(launcherEnv(), asQVD+"=1", job.ClusterKeyEnv+"="+testKey, "RANK="+fmt.Sprint(rank), "WORLD_SIZE=2",
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
	env := map[string]string{job.TLSCAEnv: "env-ca", job.TLSCertEnv: "env-cert", job.TLSKeyEnv: "env-key"}
	getenv := func(k string) string { return env[k] }
	none := func(string) string { return "" }
	conf := cluster.TLSConfig{CA: "conf-ca", Cert: "conf-cert", Key: "conf-key"}
	flags := cluster.TLSConfig{CA: "flag-ca", Cert: "flag-cert", Key: "flag-key"}
	for _, c := range []struct {
		name   string
		flags  cluster.TLSConfig
		getenv func(string) string
		conf   cluster.TLSConfig
		want   string
	}{
		{"flags over all", flags, getenv, conf, "flag"},
		{"environment over config", cluster.TLSConfig{}, getenv, conf, "env"},
		{"config alone", cluster.TLSConfig{}, none, conf, "conf"},
		{"environment alone (a worker)", cluster.TLSConfig{}, getenv, cluster.TLSConfig{}, "env"},
		{"nothing", cluster.TLSConfig{}, none, cluster.TLSConfig{}, ""},
	} {
		got := job.ResolveTLS(c.flags, c.getenv, c.conf)
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
	t.Setenv(job.TLSCAEnv, a[1])
	t.Setenv(job.TLSCertEnv, a[3])
	t.Setenv(job.TLSKeyEnv, a[5])
	bogus := cluster.TLSConfig{CA: filepath.Join(dir, "missing-ca.pem"), Cert: filepath.Join(dir, "missing.pem"), Key: filepath.Join(dir, "missing-key.pem")}
	files, id, err := job.LoadTLS(cluster.TLSConfig{}, os.Getenv, bogus, nil)
	if err != nil || id == nil || files.CA != a[1] {
		t.Fatalf("QVD_TLS_* over the config: loaded %+v, %v", files, err)
	}
	if _, _, err := job.LoadTLS(bogus, os.Getenv, cluster.TLSConfig{}, nil); err == nil {
		t.Fatal("flags naming missing files loaded: the environment won over the flags")
	}
}
