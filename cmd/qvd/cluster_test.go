package main

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

// The multi-process tests run this test binary itself as qvd: TestMain hands over to run()
// when asQVD is set, which `qvd launch` (os.Executable) and the tests' own exec.Commands pass
// on to their children through the environment.
const asQVD = "QVD_TEST_AS_QVD"

func TestMain(m *testing.M) {
	if os.Getenv(asQVD) == "1" {
		os.Exit(mainWithSignals())
	}
	os.Exit(m.Run())
}

// qvdCmd is a child process running this binary as qvd.
func qvdCmd(t *testing.T, key string, args ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), asQVD+"=1", job.ClusterKeyEnv+"="+key)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	return cmd, out
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// testKey is random, as `qvd keygen` makes keys: cluster.ValidateKey refuses patterned ones.
const testKey = "bd9df3d2910285c0cdc3780fe1d63c8820b2af8ad8499474a9910d78e5e16713"

// readModel loads a checkpoint's weights as one flat slice in file order.
func readModel(t *testing.T, dir string) map[string][]float32 {
	t.Helper()
	ck, skipped, err := checkpoint.Latest(dir)
	if err != nil || len(skipped) > 0 {
		t.Fatalf("checkpoint in %s: %v %v", dir, err, skipped)
	}
	f, err := ck.Safetensors("model.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]float32{}
	for _, n := range f.Names() {
		ts, err := f.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		out[n] = ts.Data
	}
	return out
}

func maxDiff(t *testing.T, a, b map[string][]float32) float64 {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("%d tensors vs %d", len(a), len(b))
	}
	worst := 0.0
	for n, x := range a {
		y := b[n]
		if len(x) != len(y) {
			t.Fatalf("%s: %d vs %d elements", n, len(x), len(y))
		}
		for i := range x {
			worst = math.Max(worst, math.Abs(float64(x[i])-float64(y[i])))
		}
	}
	return worst
}

// TestLaunchMatchesSingleProcess is the cross-process equivalence guarantee: N processes over
// gRPC (N=2) or raw TCP (N=4) with micro-batch m, at ZeRO stages 0, 1 and 2 (with offload),
// reach the weights of one process with micro-batch N·m after the same steps. The stage-2 run's
// checkpoint (four optimizer shards) then resumes as two processes at stage 1 and continues
// like the single process resumed from its own.
func TestLaunchMatchesSingleProcess(t *testing.T) {
	needDataset(t)
	t.Setenv(asQVD, "1") // inherited by the processes launch starts
	common := []string{"-c", "../../configs/fashion-mlp.yaml", "--epochs", "1", "--train-subset", "3072",
		"--test-subset", "512", "--seed", "5", "--quiet"}
	single := t.TempDir()
	if code, out, errs := runQVD(t, append([]string{"train", "--out", single, "--micro-batch", "32", "--max-steps", "12"}, common...)...); code != exitOK {
		t.Fatalf("single process: exit %d\n%s\n%s", code, out, errs)
	}
	want := readModel(t, filepath.Join(single, "checkpoints"))
	stage2 := ""
	for _, c := range []struct {
		n         int
		micro     string
		transport string
		zero      []string
	}{{2, "16", "grpc", nil}, {2, "16", "tcp", []string{"--zero-stage", "1"}}, {4, "8", "tcp", []string{"--zero-stage", "2", "--offload", "cpu"}}} {
		t.Run(fmt.Sprintf("N%d-%s-%s", c.n, c.transport, strings.Join(c.zero, "")), func(t *testing.T) {
			dir := t.TempDir()
			args := append([]string{"launch", "--nproc", fmt.Sprint(c.n), "--out", dir, "--micro-batch", c.micro, "--transport", c.transport, "--max-steps", "12"}, c.zero...)
			code, out, errs := runQVD(t, append(args, common...)...)
			if code != exitOK {
				t.Fatalf("launch: exit %d\n%s\n%s", code, out, errs)
			}
			got := readModel(t, filepath.Join(dir, "checkpoints"))
			if d := maxDiff(t, want, got); d > 1e-5 {
				t.Fatalf("%d processes end %g away from the single process", c.n, d)
			} else {
				t.Logf("%d processes over %s %v: max weight difference %.3g", c.n, c.transport, c.zero, d)
			}
			if len(c.zero) > 1 && c.zero[1] == "2" {
				stage2 = dir
			}
		})
	}
	if stage2 == "" {
		return
	}
	if code, out, errs := runQVD(t, append([]string{"train", "--out", single, "--micro-batch", "32", "--max-steps", "16", "--resume", "auto"}, common...)...); code != exitOK {
		t.Fatalf("single process resume: exit %d\n%s\n%s", code, out, errs)
	}
	want = readModel(t, filepath.Join(single, "checkpoints"))
	args := []string{"launch", "--nproc", "2", "--out", stage2, "--micro-batch", "16", "--transport", "tcp", "--max-steps", "16", "--zero-stage", "1", "--resume", "auto"}
	if code, out, errs := runQVD(t, append(args, common...)...); code != exitOK {
		t.Fatalf("resuming the 4-process stage-2 checkpoint as 2 processes at stage 1: exit %d\n%s\n%s", code, out, errs)
	}
	got := readModel(t, filepath.Join(stage2, "checkpoints"))
	if d := maxDiff(t, want, got); d > 1e-5 {
		t.Fatalf("after resharding 4→2 and continuing to step 16, %g away from the single process", d)
	} else {
		t.Logf("resharded 4 (stage 2) → 2 (stage 1) and continued: max weight difference %.3g", d)
	}
}

// TestKilledWorker: kill -9 one worker mid-training. The others must exit non-zero within the
// deadline with an error naming the lost rank; the last checkpoint stays intact and resumable.
func TestKilledWorker(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	// The shipped config's checkpoint.every_steps (2000) would never trigger here.
	cfgPath := filepath.Join(t.TempDir(), "cfg.yaml")
	os.WriteFile(cfgPath, []byte("checkpoint:\n  every_steps: 10\n  keep: 2\ncollective:\n  timeout: 20s\n"), 0o644)
	train, trainOut := qvdCmd(t, testKey, "train", "-c", cfgPath, "--nodes", "3", "--bind", coord, "--grpc-bind", "127.0.0.1:0",
		"--node-name", "n0", "--out", out, "--micro-batch", "16", "--epochs", "50", "--train-subset", "4800", "--test-subset", "500", "--quiet")
	w1, w1Out := qvdCmd(t, testKey, "join", coord, "--bind", "127.0.0.1:0", "--node-name", "n1")
	w2, _ := qvdCmd(t, testKey, "join", coord, "--bind", "127.0.0.1:0", "--node-name", "n2")
	exited := map[*exec.Cmd]chan error{}
	for _, c := range []*exec.Cmd{train, w1, w2} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer c.Process.Kill()
		done := make(chan error, 1)
		go func(c *exec.Cmd) { done <- c.Wait() }(c)
		exited[c] = done
	}
	// Wait until training is under way and a checkpoint exists.
	deadline := time.Now().Add(90 * time.Second)
	for {
		if steps, _ := checkpointSteps(filepath.Join(out, "checkpoints")); len(steps) > 0 {
			break
		}
		select {
		case err := <-exited[train]:
			t.Fatalf("the coordinator exited early (%v)\ncoordinator:\n%s\nworker 1:\n%s", err, trainOut, w1Out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no checkpoint after 90s\ncoordinator:\n%s\nworker 1:\n%s", trainOut, w1Out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	killed := time.Now()
	if err := w2.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited[w2]
	for name, c := range map[string]*exec.Cmd{"coordinator": train, "worker 1": w1} {
		select {
		case err := <-exited[c]:
			if err == nil {
				t.Fatalf("%s exited 0 after losing rank 2", name)
			}
		case <-time.After(40 * time.Second):
			t.Fatalf("%s still running 40s after rank 2 was killed", name)
		}
	}
	took := time.Since(killed)
	for name, o := range map[string]string{"coordinator": trainOut.String(), "worker 1": w1Out.String()} {
		if !strings.Contains(o, "rank 2") {
			t.Fatalf("%s's error does not name rank 2:\n%s\n\ncoordinator:\n%s", name, o, trainOut.String())
		}
	}
	t.Logf("survivors exited %v after the kill", took.Round(time.Millisecond))

	// The last checkpoint verifies and a single process resumes from it.
	ck, skipped, err := checkpoint.Latest(filepath.Join(out, "checkpoints"))
	if err != nil || len(skipped) > 0 {
		t.Fatalf("latest checkpoint after the failure: %v %v", err, skipped)
	}
	code, stdout, stderr := runQVD(t, "train", "-c", cfgPath, "--out", out, "--micro-batch", "48", "--epochs", "50",
		"--train-subset", "4800", "--test-subset", "500", "--quiet", "--resume", "auto", "--max-steps", fmt.Sprint(ck.Step()+3))
	if code != exitOK || !strings.Contains(stderr, "resumed") {
		t.Fatalf("resume after the failure: exit %d\n%s\n%s", code, stdout, stderr)
	}
}

func checkpointSteps(dir string) ([]int64, error) {
	m, err := checkpoint.NewManager(dir, 0)
	if err != nil {
		return nil, err
	}
	return m.List()
}

// TestStatusListsMembers: qvd status shows a running job's members with their ranks.
func TestStatusAndWrongKey(t *testing.T) {
	needDataset(t)
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	out := t.TempDir()
	train, trainOut := qvdCmd(t, testKey, "train", "--nodes", "2", "--bind", coord, "--grpc-bind", "127.0.0.1:0", "--node-name", "s0", "--out", out,
		"--epochs", "200", "--train-subset", "1280", "--test-subset", "200", "--quiet")
	w, _ := qvdCmd(t, testKey, "join", coord, "--bind", "127.0.0.1:0", "--node-name", "s1")
	for _, c := range []*exec.Cmd{train, w} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer func(c *exec.Cmd) { c.Process.Signal(syscall.SIGTERM); c.Wait() }(c)
	}
	t.Setenv(job.ClusterKeyEnv, testKey)
	var status string
	for deadline := time.Now().Add(60 * time.Second); ; {
		code, o, _ := runQVD(t, "status", coord)
		if code == exitOK && strings.Contains(o, "s1") && strings.Contains(o, "worker") && strings.Count(o, "alive") >= 2 {
			status = o
			if strings.Contains(o, " 1 ") { // rank 1 assigned
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("status never showed both members with ranks; last:\n%s\ncoordinator:\n%s", status, trainOut)
		}
		time.Sleep(300 * time.Millisecond)
	}
	t.Logf("qvd status:\n%s", status)

	// A node with another key is refused, and says why.
	t.Setenv(job.ClusterKeyEnv, "e5d474cfc838d2e1caf84cce9106813ee2419f3dd22f487a4ade208308af2b48")
	code, _, errs := runQVD(t, "join", coord, "--bind", "127.0.0.1:0", "--node-name", "intruder")
	if code == exitOK || !strings.Contains(errs, "key") {
		t.Fatalf("wrong key: exit %d\n%s", code, errs)
	}
}

// TestLaunchFailureAndInterrupt: a worker that fails fails the launch with its error; an
// interrupted launch stops every worker at the same step after a checkpoint and exits 130.
func TestLaunchFailureAndInterrupt(t *testing.T) {
	needDataset(t)
	t.Setenv(asQVD, "1")
	code, _, errs := runQVD(t, "launch", "--nproc", "2", "--precision", "fp8", "--out", t.TempDir())
	if code != exitFailure || !strings.Contains(errs, "rank 0 failed") || !strings.Contains(errs, "train.precision") {
		t.Fatalf("bad config under launch: exit %d\n%s", code, errs)
	}

	out := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// Interrupt once training is under way (the metrics file has a few steps).
		for i := 0; i < 600; i++ {
			if b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl")); err == nil && bytes.Count(b, []byte("\n")) >= 5 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		cancel()
	}()
	var so, se bytes.Buffer
	code = run(ctx, []string{"launch", "--nproc", "2", "--out", out, "--epochs", "100", "--train-subset", "2560",
		"--test-subset", "256", "--quiet"}, &so, &se)
	if code != exitInterrupted {
		t.Fatalf("interrupted launch: exit %d\n%s\n%s", code, so.String(), se.String())
	}
	ck, _, err := checkpoint.Latest(filepath.Join(out, "checkpoints"))
	if err != nil {
		t.Fatalf("no checkpoint after the interrupt: %v\n%s\n%s", err, so.String(), se.String())
	}
	if !strings.Contains(so.String(), fmt.Sprintf("interrupted at step %d", ck.Step())) {
		t.Fatalf("rank 0 should report stopping at the checkpointed step %d:\n%s", ck.Step(), so.String())
	}
}
