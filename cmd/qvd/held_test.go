package main

// Regression tests for behaviours the hardening review found already hold and had no test.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/launch"
)

// fillDir writes one file into dir until its filesystem returns ENOSPC, ending with single
// bytes so that no page is left for a new file's data.
func fillDir(dir string) error {
	f, err := os.CreateTemp(dir, "filler-*")
	if err != nil {
		return err
	}
	defer f.Close()
	for _, chunk := range []int{1 << 20, 4 << 10, 1} {
		b := make([]byte, chunk)
		for {
			if _, err := f.Write(b); err != nil {
				if !errors.Is(err, syscall.ENOSPC) {
					return fmt.Errorf("filling %s: %w", dir, err)
				}
				break
			}
		}
	}
	return nil
}

// TestFullDiskDuringCheckpointSave: a checkpoint directory whose filesystem fills up fails
// the run at the save that does not fit, naming the error; every checkpoint committed
// before stays intact and verifies, and the half-written one is neither visible as a
// checkpoint nor left behind.
func TestFullDiskDuringCheckpointSave(t *testing.T) {
	needDataset(t)
	// The MLP's checkpoint is 2.83 MB (model 0.94 MB, optimizer 1.88 MB). keep: 0 keeps
	// every checkpoint, so nothing is freed by pruning and step 2's stays to be checked.
	cfg := filepath.Join(t.TempDir(), "cfg.yaml")
	if err := os.WriteFile(cfg, []byte("checkpoint:\n  keep: 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		size   string // room for two checkpoints (7m) or five (16m)
		filler bool   // another writer fills the filesystem once step 2's checkpoint is in
	}{
		{"the run's own checkpoints fill it", "7m", false},
		{"another writer fills it", "16m", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := t.TempDir()
			dir := filepath.Join(out, "checkpoints")
			mountTmpfs(t, dir, "size="+c.size)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			// The steps committed when the filler was done: each must survive the failure.
			filled := make(chan []string, 1)
			fillErr := make(chan error, 1)
			if c.filler {
				go func() {
					defer close(filled)
					defer close(fillErr)
					for ctx.Err() == nil {
						if _, err := os.Stat(filepath.Join(dir, checkpoint.StepDirName(2))); err == nil {
							fillErr <- fillDir(dir)
							steps, _ := filepath.Glob(filepath.Join(dir, "step-*"))
							filled <- steps
							return
						}
						time.Sleep(time.Millisecond)
					}
				}()
			} else {
				close(filled)
				close(fillErr)
			}
			args := []string{"train", "-c", cfg, "--out", out, "--checkpoint-every", "2", "--max-steps", "5000", "--epochs", "1000",
				"--micro-batch", "16", "--train-subset", "512", "--test-subset", "200", "--quiet"}
			code, stdout, stderr := runQVD(t, args...)
			cancel()
			before := <-filled
			if err := <-fillErr; err != nil {
				t.Fatal(err)
			}
			if code != exitFailure {
				t.Fatalf("exit %d, want %d\n%s\n%s", code, exitFailure, stdout, stderr)
			}
			failed := regexp.MustCompile(`checkpoint at step (\d+)[^\n]*no space left on device`).FindStringSubmatch(stderr)
			if failed == nil {
				t.Fatalf("no error naming the checkpoint and ENOSPC:\n%s", stderr)
			}
			if c.filler {
				t.Logf("the save at step %s failed; %d checkpoints were committed when the filler was done", failed[1], len(before))
			} else {
				t.Logf("the save at step %s failed", failed[1])
			}

			entries, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			var steps []string
			for _, e := range entries {
				switch name := e.Name(); {
				case strings.HasPrefix(name, ".tmp-step-"):
					t.Errorf("the failed save left its pending directory %s", name)
				case strings.HasPrefix(name, "step-"):
					steps = append(steps, name)
					if _, err := checkpoint.Open(filepath.Join(dir, name)); err != nil {
						t.Errorf("%s is visible as a checkpoint but does not verify: %v", name, err)
					}
				}
			}
			failedStep, _ := strconv.ParseInt(failed[1], 10, 64)
			if failedDir := checkpoint.StepDirName(failedStep); slices.Contains(steps, failedDir) {
				t.Errorf("the failed save's %s is visible", failedDir)
			}
			for _, b := range before {
				if !slices.Contains(steps, filepath.Base(b)) {
					t.Errorf("%s, committed before the disk filled, is gone; left: %v", filepath.Base(b), steps)
				}
			}
			ck, err := checkpoint.Open(filepath.Join(dir, checkpoint.StepDirName(2)))
			if err != nil || ck.Step() != 2 {
				t.Fatalf("step 2's checkpoint after the failure: %v", err)
			}
			latest, skipped, err := checkpoint.Latest(dir)
			if err != nil || len(skipped) > 0 {
				t.Fatalf("Latest after the failure: %v, skipped %v", err, skipped)
			}
			if want := steps[len(steps)-1]; filepath.Base(latest.Path()) != want {
				t.Fatalf("Latest = %s, want the newest committed %s", latest.Path(), want)
			}
		})
	}
}

// garbageJob is a 2-process job started as `qvd train --nodes 2` and `qvd join` on
// 127.0.0.1, over the raw-TCP data plane.
type garbageJob struct {
	procs []*exec.Cmd
	logs  []*syncBuffer
	done  []chan error
	out   string
}

func startGarbageJob(t *testing.T, out string, steps int) *garbageJob {
	t.Helper()
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	train, trainOut := qvdCmd(t, testKey, "train", "--nodes", "2", "--bind", coord, "--grpc-bind", "127.0.0.1:0", "--node-name", "h0",
		"--out", out, "--transport", "tcp", "--max-steps", strconv.Itoa(steps), "--epochs", "100", "--train-subset", "2560",
		"--test-subset", "200", "--micro-batch", "16", "--seed", "3", "--quiet")
	w, wOut := qvdCmd(t, testKey, "join", coord, "--bind", "127.0.0.1:0", "--node-name", "h1")
	j := &garbageJob{procs: []*exec.Cmd{train, w}, logs: []*syncBuffer{trainOut, wOut}, out: out}
	for _, c := range j.procs {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func(c *exec.Cmd) { done <- c.Wait() }(c)
		j.done = append(j.done, done)
		t.Cleanup(func() { c.Process.Kill(); <-done })
	}
	return j
}

// exitGrace is how long a process may take to exit after logging that it is done: closing
// the cluster member (leave broadcast, gRPC GracefulStop bounded at 2s) takes a few seconds.
const exitGrace = 15 * time.Second

// wait waits for both processes to exit 0, each within exitGrace of its "done" line, and
// returns rank 0's final weights hash.
func (j *garbageJob) wait(t *testing.T) string {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\ncoordinator:\n%s\nworker:\n%s", append(args, j.logs[0], j.logs[1])...)
	}
	start := time.Now()
	for i, done := range j.done {
		var finished time.Time // when the process was first seen to have logged "done"
		for exited := false; !exited; {
			select {
			case err := <-done:
				if err != nil {
					fail("process %d: %v", i, err)
				}
				done <- nil // for the cleanup
				exited = true
			case <-time.After(50 * time.Millisecond):
				if finished.IsZero() && strings.Contains(j.logs[i].String(), "\tdone\t") {
					finished = time.Now()
				}
				if !finished.IsZero() && time.Since(finished) > exitGrace {
					fail("process %d trained to the end but has not exited %v later", i, exitGrace)
				}
				if time.Since(start) > 90*time.Second {
					fail("process %d still running after 90s", i)
				}
			}
		}
	}
	m := regexp.MustCompile(`"weights_sha256": "([0-9a-f]{64})"`).FindStringSubmatch(j.logs[0].String())
	if m == nil {
		t.Fatalf("no weights_sha256 in the coordinator's log:\n%s", j.logs[0])
	}
	return m[1]
}

// running reports whether neither process has exited.
func (j *garbageJob) running() bool {
	for _, done := range j.done {
		select {
		case err := <-done:
			done <- err
			return false
		default:
		}
	}
	return true
}

var memberStarted = regexp.MustCompile(`cluster member started\t[^\n]*"gossip": "([^"]+)", "grpc": "([^"]+)", "data": "([^"]+)"`)

// listening waits until the job trains (rank 0 has written a few steps' metrics) and returns
// each process's gossip, gRPC and data-plane addresses, from its log.
func (j *garbageJob) listening(t *testing.T) [][]string {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); ; {
		b, _ := os.ReadFile(filepath.Join(j.out, "metrics.jsonl"))
		var addrs [][]string
		for _, l := range j.logs {
			if m := memberStarted.FindStringSubmatch(l.String()); m != nil {
				addrs = append(addrs, m[1:])
			}
		}
		if bytes.Count(b, []byte("\n")) >= 3 && len(addrs) == 2 {
			return addrs
		}
		if !j.running() || time.Now().After(deadline) {
			t.Fatalf("the job did not start training\ncoordinator:\n%s\nworker:\n%s", j.logs[0], j.logs[1])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Bytes that are not what a port expects, each sent on a fresh connection.
var (
	httpRequest = []byte("GET / HTTP/1.1\r\nHost: qvd\r\nUser-Agent: held_test\r\n\r\n")
	// The HTTP/2 client preface, then a SETTINGS frame header whose length claims 16 MiB.
	h2Garbage = append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), 0xff, 0xff, 0xff, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 1, 2, 3)
	// A TLS 1.2 record header announcing a 512-byte ClientHello, and only its first bytes.
	halfTLSHello = []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03, 0xde, 0xad}
)

// TestGarbageOnEveryPortLeavesJobAlive: while a 2-process job trains, every port it listens
// on (gossip TCP and UDP, gRPC, the raw-TCP data plane) gets random bytes, an HTTP request,
// an HTTP/2 preface with a bad frame and a TLS hello cut short, each on its own connection
// that the sender closes after half a second; the job still finishes with exit 0 and the
// same final weights as the same job left alone.
func TestGarbageOnEveryPortLeavesJobAlive(t *testing.T) {
	needDataset(t)
	want := startGarbageJob(t, t.TempDir(), 500).wait(t)

	j := startGarbageJob(t, t.TempDir(), 500)
	addrs := j.listening(t)
	rng := rand.New(rand.NewPCG(1, 2))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	sent := 0
	for _, a := range addrs {
		for _, addr := range a { // gossip, gRPC, data
			for _, msg := range [][]byte{random(64 << 10), httpRequest, h2Garbage, halfTLSHello, random(7)} {
				sent++
				wg.Go(func() {
					c, err := net.DialTimeout("tcp", addr, 5*time.Second)
					if err != nil {
						mu.Lock()
						errs = append(errs, fmt.Errorf("dialling %s while the job runs: %w", addr, err))
						mu.Unlock()
						return
					}
					defer c.Close()
					c.SetDeadline(time.Now().Add(500 * time.Millisecond))
					// The peer may close as soon as it has read enough to refuse: a write or
					// read error here is the refusal, not a failure.
					_, _ = c.Write(msg)
					_, _ = c.Read(make([]byte, 512))
				})
			}
		}
		// Gossip UDP shares the gossip TCP port.
		u, err := net.Dial("udp", a[0])
		if err != nil {
			t.Fatal(err)
		}
		for i := range 50 {
			_, _ = u.Write(random(1 + i*29))
			sent++
		}
		_, _ = u.Write(httpRequest)
		sent++
		u.Close()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("%v\njob running: %v\ncoordinator:\n%s\nworker:\n%s", err, j.running(), j.logs[0], j.logs[1])
	}
	if !j.running() {
		t.Fatalf("the job finished before the garbage was all sent: make it longer\ncoordinator:\n%s", j.logs[0])
	}
	t.Logf("sent %d garbage connections and datagrams to %v while the job trained", sent, addrs)
	if got := j.wait(t); got != want {
		t.Fatalf("weights_sha256 %s after the garbage, %s without\ncoordinator:\n%s\nworker:\n%s", got, want, j.logs[0], j.logs[1])
	}
}

// TestStalledConnectionsDoNotHoldExit: connections that never finish their handshake (one
// that sends nothing, one that sends half a TLS hello), left open on every port of a
// training job, neither stop it nor keep its processes from exiting once it is done.
func TestStalledConnectionsDoNotHoldExit(t *testing.T) {
	needDataset(t)
	j := startGarbageJob(t, t.TempDir(), 300)
	addrs := j.listening(t)
	for _, a := range addrs {
		for _, addr := range a { // gossip, gRPC, data
			for _, msg := range [][]byte{nil, halfTLSHello} {
				c, err := net.DialTimeout("tcp", addr, 5*time.Second)
				if err != nil {
					t.Fatalf("dialling %s while the job runs: %v", addr, err)
				}
				defer c.Close() // only after the job has exited
				if msg != nil {
					c.SetWriteDeadline(time.Now().Add(time.Second))
					_, _ = c.Write(msg)
				}
			}
		}
	}
	if !j.running() {
		t.Fatalf("the job finished before the connections were all open: make it longer\ncoordinator:\n%s", j.logs[0])
	}
	j.wait(t)
}

// TestBadDeepSpeedAndDataFiles: a DeepSpeed JSON qvd cannot honour exits 2 naming the file
// and the key (and the line, for a duplicate key); a corrupt dataset file exits 1 naming it.
func TestBadDeepSpeedAndDataFiles(t *testing.T) {
	needDataset(t)
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	dup := write("dup.json", "{\n  \"train_batch_size\": 64,\n  \"train_batch_size\": 32\n}\n")
	lamb := write("lamb.json", `{"optimizer": {"type": "Lamb", "params": {}}}`)
	syntax := write("syntax.json", "{\n  \"train_batch_size\": 64,,\n}\n")

	// A data directory of the real files but one: a truncated train-images, or test labels
	// that are not IDX at all.
	dataDir := func(name string, corrupt func(path string)) string {
		d := filepath.Join(dir, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{data.TrainImagesFile, data.TrainLabelsFile, data.TestImagesFile, data.TestLabelsFile} {
			if err := os.Symlink(filepath.Join(data.DefaultPath, f+".gz"), filepath.Join(d, f+".gz")); err != nil {
				t.Fatal(err)
			}
		}
		corrupt(d)
		return d
	}
	truncated := dataDir("truncated", func(d string) {
		p := filepath.Join(d, data.TrainImagesFile+".gz")
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		os.Remove(p)
		if err := os.WriteFile(p, b[:len(b)/3], 0o644); err != nil {
			t.Fatal(err)
		}
	})
	notIDX := dataDir("not-idx", func(d string) {
		p := filepath.Join(d, data.TestLabelsFile+".gz")
		os.Remove(p)
		if err := os.WriteFile(p, []byte("garbage\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	})

	out := filepath.Join(dir, "out")
	for _, c := range []struct {
		args []string
		code int
		want []string
	}{
		{[]string{"--deepspeed", dup}, exitUsage, []string{dup, "train_batch_size (line 3): key already defined at line 2"}},
		{[]string{"--deepspeed", lamb}, exitUsage, []string{lamb, "optimizer.type", "Lamb"}},
		{[]string{"--deepspeed", syntax}, exitUsage, []string{syntax, "invalid character"}},
		{[]string{"--deepspeed", filepath.Join(dir, "none.json")}, exitUsage, []string{filepath.Join(dir, "none.json")}},
		{[]string{"--data", truncated}, exitFailure, []string{filepath.Join(truncated, data.TrainImagesFile+".gz"), "corrupt IDX file", "truncated"}},
		{[]string{"--data", notIDX}, exitFailure, []string{filepath.Join(notIDX, data.TestLabelsFile+".gz"), "corrupt IDX file", "bad magic"}},
	} {
		args := append([]string{"train", "--out", out, "--max-steps", "1", "--quiet"}, c.args...)
		code, stdout, stderr := runQVD(t, args...)
		ok := code == c.code
		for _, w := range c.want {
			ok = ok && strings.Contains(stderr, w)
		}
		if !ok {
			t.Errorf("qvd %v: exit %d, want %d with %q\nstdout: %s\nstderr: %s", c.args, code, c.code, c.want, stdout, stderr)
		}
	}
}
